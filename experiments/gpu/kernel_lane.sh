#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). Earlier sessions' versions are in git history
# (the tenth session's: the Mosaic GPU forward's first tests, v12, pfps-d64); this one:
#  1. the benchmark of record with the shipped kernels (v12 backward, the Mosaic forward at 4×8192),
#  2. the D = 64 entry with the score prefetch (pfps-d64): GPU same-values test, second A/B,
#  3. the step time of the "fp32_bf16x6" arm (fp32x6-attn), 60 steps.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 300 python3 -m bench.attention --shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128 --reps 30 \
  --rounds 5 --memory-lengths "" --out "$OUT/bench.json" --md "$OUT/bench.md" > "$OUT/bench.log" 2>&1
echo "bench.attention: exit $?"; tail -30 "$OUT/bench.md" 2>/dev/null
timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and pfps" -q -s -p no:cacheprovider \
  > "$OUT/gpu_pfps.log" 2>&1
echo "gpu test (pfps-d64): exit $?"; tail -1 "$OUT/gpu_pfps.log"
timeout 80 python3 -m bench.ab run --variants new,new@pfps-d64,new:stable,new@pfps-d64:stable,cudnn \
  --entries bench/entries-scores.json --shapes 32x1024x12x64 --passes fwd,fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-pfps-d64.json" 2>&1 | grep " ms " | tail -10
VARIANT=x6 RUNS=/tmp/jf-x6 timeout 150 bash experiments/gpu/repro_seq.sh 140 fp32x6-attn:1:60 2>&1 | tail -3
true
