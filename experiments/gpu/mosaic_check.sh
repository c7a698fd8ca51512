#!/usr/bin/env bash
# Our Mosaic GPU kernels (opt-in) on the H200, in one ≤ 460-s call (about 3 min when they pass):
#  1. their GPU tests against float64 and the Triton kernels (pytest -m gpu -k mosaic): the forward
#     (jax_flash/pallas/forward_mosaic.py) and the backward's dK/dV and dQ kernels
#     (jax_flash/pallas/backward_mosaic.py),
#  2. if they pass, a short interleaved A/B of the forward: Triton (new) vs Mosaic vs cuDNN,
#  3. a tiny timing of forward + backward with the backward's kernels chosen by
#     JAX_FLASH_BWD=triton / =mosaic_dkdv (Mosaic dK/dV, Triton dQ) / =mosaic (both Mosaic), one
#     process each, interleaved twice; a fallback to Triton is an error there, not a warning.
# Everything under $OUT. Usage: OUT=out bash experiments/gpu/mosaic_check.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 160 python3 -m pytest -m gpu tests/test_gpu.py -k mosaic -x -q -s -p no:cacheprovider \
  > "$OUT/gpu_mosaic_tests.log" 2>&1
rc=$?
echo "gpu mosaic tests: exit $rc"; grep -E "mosaic-|tied rows|passed|failed|Error" "$OUT/gpu_mosaic_tests.log" | tail -22
if [ "$rc" != 0 ]; then
  grep -B2 -A12 -E "^E |Traceback" "$OUT/gpu_mosaic_tests.log" | head -60
  exit "$rc"
fi
timeout 60 python3 -m bench.ab run --variants new,mosaic,new:stable,mosaic:stable,cudnn \
  --shapes 4x8192x16x128,32x1024x12x64 --passes fwd --rounds 4 --reps 6 \
  --out "$OUT/ab-mosaic-fwd.json" > "$OUT/ab-mosaic-fwd.log" 2>&1
echo "A/B: exit $?"; grep -E " ms |failed|Error" "$OUT/ab-mosaic-fwd.log" | tail -12
for kernel in triton mosaic_dkdv mosaic triton mosaic_dkdv mosaic; do
  JAX_FLASH_BWD=$kernel timeout 40 python3 - >> "$OUT/bwd-timing.log" 2>&1 <<'PY'
import os, time, warnings
warnings.filterwarnings("error", message="JAX_FLASH_BWD")  # a fallback to Triton: not timed
import jax, jax.numpy as jnp, numpy as np
import jax_flash as jf
print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
for shape in ((4, 8192, 16, 128), (16, 2048, 16, 64)):
    q, k, v, do = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4))
    def f(q, k, v, do):  # the forward: the table's choice, the same in every process
        o, vjp = jax.vjp(lambda q, k, v: jf.attention(q, k, v, impl="pallas", causal=True), q, k, v)
        return vjp(do)
    g = jax.jit(f)
    jax.block_until_ready(g(q, k, v, do))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter(); jax.block_until_ready(g(q, k, v, do)); ts.append(time.perf_counter() - t0)
    print(f"fwd+bwd causal {'x'.join(map(str, shape))} JAX_FLASH_BWD={os.environ['JAX_FLASH_BWD']}: "
          f"median {1e3 * np.median(ts):.3f} ms (min {1e3 * min(ts):.3f})", flush=True)
PY
  echo "timing $kernel: exit $?"
done
grep -E " ms|Error|^# jax" "$OUT/bwd-timing.log" | tail -16
