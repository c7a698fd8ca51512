#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). Earlier sessions' versions are in git history
# (the twelfth session's first: the ti / k128 candidates' tests and A/Bs, GPT-2 step times, the
# Mosaic forward's SASS). This one:
#  1. pfps-d64 shipped (prefetch_scores in fa2/d64/t1024/causal, the reproduction's training shape):
#     GPU same-values test, then the deterministic seed-1 run's first 500 steps again at replicate=1
#     (VARIANT=r1chk2), to compare bitwise with r1 (`python -m experiments.reproduce rerun`),
#  2. k128's second A/B at 4×8192 (fwd, fwd+bwd; baseline and stable),
#  3. why k128 saves 0.48 ms in the forward alone but 0.06 ms in fwd+bwd: per-kernel durations of
#     fwd+bwd under Nsight Compute, shipped vs k128.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and (pfps or k128)" -q -s -p no:cacheprovider \
  > "$OUT/gpu_entries.log" 2>&1
rc=$?
echo "gpu test (pfps-d64, k128): exit $rc"; grep -E "bitwise|passed|failed" "$OUT/gpu_entries.log" | tail -12
if [ "$rc" = 0 ]; then
  XLA_FLAGS=--xla_gpu_deterministic_ops=true CKPT_EVERY=500 VARIANT=r1chk2 OVERRIDES=replicate=1 \
    bash experiments/gpu/repro_seq.sh 150 fa2:1:500 2>&1 | tail -3
  timeout 150 python3 -m bench.ab run --variants new,new:stable,new@k128,new@k128:stable,cudnn \
    --entries bench/entries-stable.json --shapes 4x8192x16x128 --passes fwd,fwd+bwd \
    --rounds 8 --reps 6 --out "$OUT/ab-k128-2.json" 2>&1 | grep " ms " | tail -10
fi
NCU_TIMEOUT=120 OUT="$OUT" bash experiments/gpu/ncu_profile.sh \
  4x8192x16x128:fa2:0:fwd+bwd 4x8192x16x128:fa2:0:fwd+bwd:k128
true
