#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's: 1828c32, cccfe3c, c816cba, b497f6a, 8dfa135; the seventeenth's first four:
# 12c59f0, 757106d, b3b6010, c6808be). This version, the seventeenth session's fifth call
# (docs/PERF_NOTES.md "The fifth call"):
#  1. the table of record (bench.attention, the three table shapes, causal) with exp2_ftz shipped;
#  2. the GPT-2 small step with flash, flash stable and cuDNN attention (experiments.gpu.throughput);
#  3. 4×8192: the direct form with unscaled scores against the shipped factor form, decided in one
#     run and judged in another (chosen.txt).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
R=${R:-20}; S3=${S3:-4x8192x16x128}; E=bench/entries-stable.json
timeout 330 python3 -m bench.attention --shapes ${SHAPES:-32x1024x12x64,8x2048x16x128,4x8192x16x128} \
  --reps ${REPS:-30} --rounds 5 --memory-lengths "" --out "$STAGE/table-v17.json" --md "$STAGE/table-v17.md" \
  2>&1 | tail -3
tail -8 "$STAGE/table-v17.md"
timeout 230 python3 -m experiments.gpu.throughput --steps ${STEPS:-30} --arms flash,flash-stable,cudnn \
  --out "$STAGE/gpt2-small-throughput-v17.json" 2>&1 | tail -4
# 4×8192: the direct form with unscaled scores (k128-late) against the shipped factor form — decided
# in one run (16 rounds), judged in another (20 rounds), both modes (docs/PERF_NOTES.md "The fifth call")
V=new,new:stable,new@k128-late,new@k128-late:stable
for sync in round call; do
  timeout 150 python3 -m bench.ab run --entries $E --sync $sync --variants $V --shapes $S3 \
    --passes fwd+bwd --rounds $((R * 4 / 5)) --reps 6 --out "$STAGE/decide-$sync.json" 2>&1 | grep " ms " | tail -4
done
PAIR=$(python3 - "$STAGE" "$S3" <<'PY'
import json, sys
from bench.ab import paired_ratio
stage, s = sys.argv[1:]
shape = tuple(map(int, s.split("x")))
r = {m: json.load(open(f"{stage}/decide-{m}.json")) for m in ("round", "call")}
pr = lambda m, v, b: paired_ratio(r[m], v, b, shape, "fwd+bwd")[0]
ok = all(pr(m, "new@k128-late", "new") <= 1.005 and
         pr(m, "new@k128-late:stable", "new@k128-late") < pr(m, "new:stable", "new") for m in r)
for m in r:
    print(f"# {m}: late base/new ×{pr(m, 'new@k128-late', 'new'):.4f}, late pair ×"
          f"{pr(m, 'new@k128-late:stable', 'new@k128-late'):.4f}, shipped pair ×{pr(m, 'new:stable', 'new'):.4f}",
          file=sys.stderr)
print("new@k128-late,new@k128-late:stable" if ok else "new,new:stable")
PY
)
echo "chosen: $PAIR" | tee "$STAGE/chosen.txt"
for sync in round call; do
  timeout 150 python3 -m bench.ab run --entries $E --sync $sync --variants $PAIR --shapes $S3 \
    --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/judge-$sync.json" 2>&1 | grep " ms " | tail -2
  python3 -m bench.ab ratio "$STAGE/judge-$sync.json" --variant "${PAIR#*,}" --base "${PAIR%%,*}" | tail -1 \
    | sed "s/^/judge $sync /" | tee -a "$STAGE/chosen.txt"
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
