#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's: 1828c32, cccfe3c, c816cba, b497f6a, 8dfa135; the seventeenth's first three:
# 12c59f0, 757106d, b3b6010). This version, the seventeenth session's fourth call (docs/PERF_NOTES.md
# "v17c"): unscaled scores in the forward (scale_late) at the three shapes —
#  1. the compiled scale_late (Triton and Mosaic) and ftz forwards against their references (GPU tests);
#  2. forward only, back to back, 32×1024 and 4×8192: base and stable, with and without scale_late;
#  3. fwd+bwd, 20 rounds, back to back and per call, all three shapes: the rule's decision and the
#     stable target's judgement in one run (decision.txt);
#  4. the scale_late stable forwards' SASS with stall samples.
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
R=${R:-20}  # (a CPU dry run sets small shapes and R)
S1=${S1:-32x1024x12x64}; S2=${S2:-8x2048x16x128}; S3=${S3:-4x8192x16x128}
declare -A E=([$S1]=bench/entries-stable-d64.json [$S2]=bench/entries-stable.json [$S3]=bench/entries-stable.json)
declare -A L=([$S1]=d64-ftz-late [$S2]=k128-sf-late [$S3]=k128-sf-late)
timeout 240 python3 -m pytest -q -s -m gpu tests/test_gpu.py -k "scale_late or exp2_ftz" -p no:cacheprovider \
  > "$STAGE/gpu-tests.log" 2>&1; grep -E "scale_late vs|ftz vs|passed|failed" "$STAGE/gpu-tests.log" | tail -12
for s in $S1 $S3; do
  l=${L[$s]}
  timeout 150 python3 -m bench.ab run --entries ${E[$s]} --sync round --variants new,new:stable,new@$l,new@$l:stable \
    --shapes $s --passes fwd --rounds $R --reps 6 --out "$STAGE/fwd-$s-round.json" 2>&1 | grep " ms " | tail -4
done
for s in $S1 $S2 $S3; do
  l=${L[$s]}
  for sync in round call; do
    timeout 200 python3 -m bench.ab run --entries ${E[$s]} --sync $sync --variants new,new:stable,new@$l,new@$l:stable \
      --shapes $s --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/judge-$s-$sync.json" 2>&1 | grep " ms " | tail -4
  done
done
# the rule: scale_late ships at a shape if its baseline is no slower (≤ 1.005) and its stable/base is
# below the shipped pair's, in both modes; the stable target is judged on the pair the rule keeps
python3 - "$STAGE" "$S1:${L[$S1]}" "$S2:${L[$S2]}" "$S3:${L[$S3]}" > "$STAGE/decision.txt" <<'PY'
import json, sys
from bench.ab import paired_ratio
stage = sys.argv[1]
met_all = True
for arg in sys.argv[2:]:
    s, late = arg.split(":")
    shape = tuple(map(int, s.split("x")))
    r = {m: json.load(open(f"{stage}/judge-{s}-{m}.json")) for m in ("round", "call")}
    pr = lambda m, v, b: paired_ratio(r[m], v, b, shape, "fwd+bwd")[0]
    base = {m: pr(m, f"new@{late}", "new") for m in r}
    lat = {m: pr(m, f"new@{late}:stable", f"new@{late}") for m in r}
    ship = {m: pr(m, "new:stable", "new") for m in r}
    ships = all(base[m] <= 1.005 and lat[m] < ship[m] for m in r)
    for m in r:
        print(f"# {s} {m}: late base/new ×{base[m]:.4f}, late stable/base ×{lat[m]:.4f}, shipped ×{ship[m]:.4f}")
    kept = lat if ships else ship
    met = max(kept.values()) <= 1.030
    met_all &= met
    print(f"{s} {late} {'ships' if ships else 'no'} judged ×{kept['round']:.4f} / ×{kept['call']:.4f} "
          f"{'met' if met else 'not met'}")
print(f"all three: {'met' if met_all else 'not met'}")
PY
cat "$STAGE/decision.txt"
SOURCE=1 OUT=$STAGE NCU_TIMEOUT=150 bash experiments/gpu/ncu_profile.sh "$S1:fa2:1:fwd:${L[$S1]}" "$S3:fa2:1:fwd:${L[$S3]}" 2>&1 | grep -v "^$" | tail -4
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
