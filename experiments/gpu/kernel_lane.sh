#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). Earlier sessions' versions are in git history
# (the twelfth session's: the ti / k128 candidates, pfps-d64's bitwise re-run, GPT-2 step times, the
# Mosaic forward's SASS, fwd+bwd under ncu). This one, after k128 and pfps-d64 were shipped:
#  1. where a faster forward goes at 4×8192: k128 took 0.45–0.48 ms off the forward alone and ~0 off
#     fwd+bwd (tie_count_int likewise: −0.12 ms stable forward, 0 fwd+bwd). The forward, the backward
#     alone (pass "bwd": from saved residuals) and fwd+bwd side by side, per call and per round
#     (back-to-back calls: host time hidden), shipped (k128) against the v13 entry (k64),
#     plus k128-ti (k128 with the int32 tie count, which took 0.12 ms off the stable forward at k64),
#  2. the table of record with the shipped table (v14), ~4 min.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and (k64 or k128-ti)" -q -s -p no:cacheprovider \
  > "$OUT/gpu_entries.log" 2>&1; echo "gpu test (k64, k128-ti): exit $?"
for sync in call round; do
  timeout 150 python3 -m bench.ab run --variants new,new:stable,new@k128-ti:stable,new@k64,new@k64:stable,cudnn \
    --entries bench/entries-stable.json --shapes 4x8192x16x128 --passes fwd,bwd,fwd+bwd --sync $sync \
    --rounds 5 --reps 6 --out "$OUT/ab-split-$sync.json" 2>&1 | grep " ms " | tail -15
done
timeout 300 python3 -m bench.attention --shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128 --reps 30 --rounds 5 \
  --memory-lengths "" --out "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | tail -3
true
