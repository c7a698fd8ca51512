#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). The ninth session's version (GPU correctness of
# every candidate entry, the second A/B of the prefetch) is in git history; this one:
#  1. the GPU tests of the "fp32_bf16x6" policy (the FP32 control on tensor cores),
#  2. JAX's own Mosaic GPU attention forward beside ours and cuDNN's (float16 inputs for it),
#  3. a second A/B of the D = 64 prefetch entry, with the stable shift,
#  4. the forward's score prefetch (Config.prefetch_scores): GPU same-values test and an A/B,
#  5. the backward's stalls per instruction (Nsight Compute), if time is left.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -k bf16x6 -q -s -p no:cacheprovider > "$OUT/gpu_bf16x6.log" 2>&1
echo "gpu bf16x6 tests: exit $?"; grep -E "ref|passed|failed" "$OUT/gpu_bf16x6.log" | tail -24
timeout 100 python3 -m bench.ab run --variants new,mgpu,cudnn \
  --shapes 4x8192x16x128,8x2048x16x128,32x1024x12x64 --passes fwd \
  --rounds 10 --reps 8 --out "$OUT/ab-mgpu-fwd.json" 2>&1 | grep -E " ms |failed" | tail -12
timeout 100 python3 -m bench.ab run --variants new,new@pf-d64,new:stable,new@pf-d64:stable,cudnn \
  --entries bench/entries-prefetch.json --shapes 32x1024x12x64 --passes fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-d64.json" 2>&1 | grep " ms " | tail -6
# the forward's next-tile scores a loop iteration ahead (Config.prefetch_scores, lever 2)
timeout 200 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and ps" -q -p no:cacheprovider 2>&1 | tail -1
timeout 150 python3 -m bench.ab run --variants new,new@ps,new:stable,new@ps:stable,cudnn \
  --entries bench/entries-scores.json --shapes 4x8192x16x128,8x2048x16x128 --passes fwd,fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-scores-d128.json" 2>&1 | grep " ms " | tail -20
timeout 80 python3 -m bench.ab run --variants new,new@ps-d64,new:stable,new@ps-d64:stable,cudnn \
  --entries bench/entries-scores.json --shapes 32x1024x12x64 --passes fwd,fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-scores-d64.json" 2>&1 | grep " ms " | tail -10
[ "${NCU:-0}" = 1 ] && SOURCE=1 NCU_TIMEOUT=250 OUT="$OUT" bash experiments/gpu/ncu_profile.sh 8x2048x16x128:fa2:0:fwd+bwd
true
