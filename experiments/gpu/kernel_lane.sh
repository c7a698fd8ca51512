#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). Earlier sessions' versions are in git history
# (the twelfth session's: the ti / k128 candidates, pfps-d64's bitwise re-run, GPT-2 step times, the
# Mosaic forward's SASS, fwd+bwd under ncu). This one, after k128 and pfps-d64 were shipped:
#  1. where a faster forward goes at 4×8192: k128 took 0.45–0.48 ms off the forward alone and ~0 off
#     fwd+bwd (tie_count_int likewise: −0.12 ms stable forward, 0 fwd+bwd). The forward, the backward
#     alone (pass "bwd": from saved residuals) and fwd+bwd side by side, shipped (k128) against the
#     v13 entry (k64) and k128-ti (k128 with the int32 tie count); then per kernel and the device's
#     idle time inside a call (experiments.gpu.trace_split, a profiler trace), with the GPU's clocks
#     and power logged meanwhile (nvidia-smi, read-only),
#  2. the table of record with the shipped table (v14), ~4 min,
#  3. (cut first if time runs out) the A/B with back-to-back calls (host time hidden).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and (k64 or k128-ti)" -q -s -p no:cacheprovider \
  > "$OUT/gpu_entries.log" 2>&1; echo "gpu test (k64, k128-ti): exit $?"
# the GPU's clocks, power and throttle reasons while the split runs (read-only queries: a faster forward
# that leaves fwd+bwd unchanged could be a power cap lowering the clocks of what follows it)
nvidia-smi -i "${CUDA_VISIBLE_DEVICES:-0}" --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > "$OUT/smi.csv" 2>&1 &
SMI=$!
timeout 150 python3 -m bench.ab run --variants new,new:stable,new@k128-ti:stable,new@k64,new@k64:stable,cudnn \
  --entries bench/entries-stable.json --shapes 4x8192x16x128 --passes fwd,bwd,fwd+bwd \
  --rounds 5 --reps 6 --out "$OUT/ab-split-call.json" 2>&1 | grep " ms " | tail -18
for pss in fwd+bwd fwd; do   # per kernel and the device's idle time inside a call (profiler trace)
  timeout 90 python3 -m experiments.gpu.trace_split --shape 4x8192x16x128 --pass $pss \
    --variants new,new@k64,cudnn --entries bench/entries-stable.json --calls 20 \
    --out "$OUT/trace-split-${pss//+/}.json" 2>&1 | tail -3
done
kill $SMI 2>/dev/null
timeout 300 python3 -m bench.attention --shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128 --reps 30 --rounds 5 \
  --memory-lengths "" --out "$OUT/bench.json" --md "$OUT/bench.md" 2>&1 | tail -3
timeout 120 python3 -m bench.ab run --variants new,new@k64,cudnn --sync round \
  --entries bench/entries-stable.json --shapes 4x8192x16x128 --passes fwd,bwd,fwd+bwd \
  --rounds 5 --reps 6 --out "$OUT/ab-split-round.json" 2>&1 | grep " ms " | tail -9
true
