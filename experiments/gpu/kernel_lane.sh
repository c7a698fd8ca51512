#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's: 1828c32, cccfe3c, c816cba, b497f6a, 8dfa135; the seventeenth's first and
# second, the top-2 tie test and exp2_ftz: 12c59f0, 757106d). This version, the seventeenth session's
# third call (docs/PERF_NOTES.md "The third call"):
#  1. 32×1024, fwd+bwd, 30 rounds, back to back and per call: base and stable, with and without
#     exp2_ftz; the rule's decision on ftz and the 32×1024 judgement (decision.txt);
#  2. 8×2048 and 4×8192, fwd+bwd, 20 rounds, both modes: the shipped stable pair's judgement.
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
E=bench/entries-stable-d64.json; S1=${S1:-32x1024x12x64}; R=${R:-20}  # (a CPU dry run sets small S*, R)
V=new,new:stable,new@d64-ftz,new@d64-ftz:stable
for sync in round call; do
  timeout 200 python3 -m bench.ab run --entries $E --sync $sync --variants $V --shapes $S1 \
    --passes fwd+bwd --rounds $((R * 3 / 2)) --reps 6 --out "$STAGE/d64-$sync.json" 2>&1 | grep " ms " | tail -4
done
# the rule: ftz ships if its baseline is no slower and its stable/base below the shipped pair's, both modes
python3 - "$STAGE" "$S1" > "$STAGE/decision.txt" <<'PY'
import json, sys
from bench.ab import paired_ratio
stage, s = sys.argv[1:]
shape = tuple(map(int, s.split("x")))
r = {m: json.load(open(f"{stage}/d64-{m}.json")) for m in ("round", "call")}
pr = lambda m, v, b: paired_ratio(r[m], v, b, shape, "fwd+bwd")[0]
base = {m: pr(m, "new@d64-ftz", "new") for m in r}
ftz = {m: pr(m, "new@d64-ftz:stable", "new@d64-ftz") for m in r}
shipped = {m: pr(m, "new:stable", "new") for m in r}
ships = all(base[m] <= 1.005 and ftz[m] < shipped[m] for m in r)
for m in r:
    print(f"# {m}: ftz base/new ×{base[m]:.4f}, ftz stable/base ×{ftz[m]:.4f}, shipped stable/base ×{shipped[m]:.4f}")
kept = ftz if ships else shipped
print(f"ftz {'ships' if ships else 'does not ship'}; 32x1024 judged ×{kept['round']:.4f} / ×{kept['call']:.4f}"
      f" -> {'met' if max(kept.values()) <= 1.030 else 'not met'}")
PY
cat "$STAGE/decision.txt"
for s in ${S2:-8x2048x16x128} ${S3:-4x8192x16x128}; do
  for sync in round call; do
    timeout 150 python3 -m bench.ab run --sync $sync --variants new,new:stable --shapes $s \
      --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/judge-$s-$sync.json" 2>&1 | grep " ms " | tail -2
    python3 -m bench.ab ratio "$STAGE/judge-$s-$sync.json" --variant new:stable | tail -1 | sed "s/^/judge $sync /"
  done
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
