#!/usr/bin/env bash
# Our Mosaic GPU forward (jax_flash/pallas/forward_mosaic.py, opt-in) on the H200, in one ≤ 170-s call:
#  1. its GPU tests against float64 and the Triton forward (pytest -m gpu -k mosaic),
#  2. if they pass, a short interleaved A/B of the forward: Triton (new) vs Mosaic vs cuDNN.
# Everything under $OUT. Usage: OUT=out bash experiments/gpu/mosaic_check.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 100 python3 -m pytest -m gpu tests/test_gpu.py -k mosaic -x -q -s -p no:cacheprovider \
  > "$OUT/gpu_mosaic_tests.log" 2>&1
rc=$?
echo "gpu mosaic tests: exit $rc"; grep -E "mosaic-|tied rows|passed|failed|Error" "$OUT/gpu_mosaic_tests.log" | tail -14
if [ "$rc" != 0 ]; then
  grep -B2 -A12 -E "^E |Traceback" "$OUT/gpu_mosaic_tests.log" | head -60
  exit "$rc"
fi
timeout 60 python3 -m bench.ab run --variants new,mosaic,new:stable,mosaic:stable,cudnn \
  --shapes 4x8192x16x128,32x1024x12x64 --passes fwd --rounds 4 --reps 6 \
  --out "$OUT/ab-mosaic-fwd.json" > "$OUT/ab-mosaic-fwd.log" 2>&1
echo "A/B: exit $?"; grep -E " ms |failed|Error" "$OUT/ab-mosaic-fwd.log" | tail -12
