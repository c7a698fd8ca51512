#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). Earlier sessions' versions are in git history;
# this one (needs `python -m bench.ab prepare 743e614` here and carry=["build/ab", ...]):
#  1. our Mosaic GPU forward (lever 5): its GPU tests and a first A/B (experiments/gpu/mosaic_check.sh),
#  2. v12 (dP's MMA before P's exp): the fa2 GPU tests, then old (743e614) vs new, fwd+bwd,
#  3. the D = 64 entry with the score prefetch (pfps-d64): GPU same-values test, second A/B,
#  4. the step time of the "fp32_bf16x6" arm (fp32x6-attn), 60 steps.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
[ -f experiments/gpu/mosaic_check.sh ] && OUT="$OUT/mosaic" timeout 200 bash experiments/gpu/mosaic_check.sh
timeout 200 python3 -m pytest -m gpu tests/test_gpu.py -k "kernels_vs_jnp and fa2 or ab_entries and pfps" \
  -q -s -p no:cacheprovider > "$OUT/gpu_v12.log" 2>&1
echo "gpu tests (v12, pfps-d64): exit $?"; tail -1 "$OUT/gpu_v12.log"
timeout 150 python3 -m bench.ab run --old build/ab/743e614 --variants old,new,old:stable,new:stable,cudnn \
  --shapes 4x8192x16x128,8x2048x16x128,32x1024x12x64 --passes fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-v12.json" 2>&1 | grep " ms " | tail -15
timeout 80 python3 -m bench.ab run --variants new,new@pfps-d64,new:stable,new@pfps-d64:stable,cudnn \
  --entries bench/entries-scores.json --shapes 32x1024x12x64 --passes fwd,fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-pfps-d64.json" 2>&1 | grep " ms " | tail -10
VARIANT=x6 RUNS=/tmp/jf-x6 timeout 150 bash experiments/gpu/repro_seq.sh 140 fp32x6-attn:1:60 2>&1 | tail -3
true
