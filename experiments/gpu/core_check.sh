#!/usr/bin/env bash
# One H200 call for the core library: the `gpu` tests (log under $OUT) and a first speed probe.
# Usage on the device machine: bash experiments/gpu/core_check.sh
# Env: AB_OLD=build/ab/REV (carried; `python -m bench.ab prepare REV` here) also times that revision's
#      kernels against the working tree's, interleaved in one process (AB_SHAPES, AB_VARIANTS);
#      TEST_TIMEOUT / BENCH_TIMEOUT / ISA_TIMEOUT limit each step (ISA_TIMEOUT=0 skips the ISA scan).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 - <<'PY' | tee "$OUT/env.txt"
import jax, jaxlib, flax, optax, sys
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__,
      "flax", flax.__version__, "optax", optax.__version__)
print("devices", jax.devices(), jax.devices()[0].device_kind)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/env.txt"
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -m gpu tests/test_gpu.py -q -s -x -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu_tests.log"
if [ -n "${AB_OLD:-}" ]; then
  timeout ${AB_TIMEOUT:-150} python3 -m bench.ab run --old "$AB_OLD" --shapes ${AB_SHAPES:-4x8192x16x128} \
    --passes fwd+bwd --variants ${AB_VARIANTS:-old,new} --out "$OUT/ab.json" 2>&1 | tee "$OUT/ab.log"
fi
timeout ${BENCH_TIMEOUT:-200} python3 -m bench.attention --shapes ${BENCH_SHAPES:-32x1024x12x64,4x8192x16x128} \
  ${BENCH_ARGS:-} --memory-lengths "" --reps 30 --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
# which matrix instructions the compiled kernels use (wgmma on Hopper, or mma.sync)
[ "${ISA_TIMEOUT:-120}" = 0 ] || timeout ${ISA_TIMEOUT:-120} python3 -m experiments.gpu.kernel_isa --out "$OUT/kernel_isa.json" 2>&1 | tail -12
