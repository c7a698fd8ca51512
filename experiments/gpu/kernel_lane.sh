#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's first: the k128 forward's SASS with
# stall samples, base and stable, at commit 5e212b7). This one tests the tie count's form
# (docs/PERF_NOTES.md "The k128 stable forward's SASS"): the float count is a compare and an add per
# score entry; is a sum of −1 masks (entry k128-tm) one compare and half a three-input add, and what
# did the int32 count (k128-ti) compile to?
#  1. the GPU same-values test of the k128-tm entry (stops here if it fails),
#  2. Nsight Compute with stall samples per SASS instruction, the stable forward with k128-tm and
#     k128-ti; read on a CPU with `python -m experiments.gpu.ncu_sass <case>-sass.csv.gz --against
#     <shipped stable>-sass.csv.gz --per MUFU.EX2`,
#  3. the stable extra back to back, shipped count vs both forms, at 4×8192 and 8×2048.
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
python3 -c "import jax, jaxlib, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices()[0].device_kind)" | tee "$STAGE/env.txt"
pack() { mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .; }
timeout 180 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and k128-tm" -q -s -x -p no:cacheprovider \
  > "$STAGE/gpu_test.log" 2>&1 || { tail -30 "$STAGE/gpu_test.log"; echo "gpu test failed: stopping"; pack; exit 1; }
grep -E "bitwise|passed|failed" "$STAGE/gpu_test.log" | tail -6
OUT="$STAGE" SOURCE=1 NCU_TIMEOUT=120 bash experiments/gpu/ncu_profile.sh \
  4x8192x16x128:fa2:1:fwd:k128-tm 4x8192x16x128:fa2:1:fwd:k128-ti
gzip -f "$STAGE"/ncu/*-sass.csv "$STAGE"/ncu/*-raw.csv 2>/dev/null
timeout 150 python3 -m bench.ab run --variants new,new:stable,new@k128-tm:stable,new@k128-ti:stable --sync round \
  --entries bench/entries-stable.json \
  --shapes 8x2048x16x128,4x8192x16x128 --passes fwd,fwd+bwd --rounds 7 --reps 6 \
  --out "$STAGE/ab-tie-form-round.json" 2>&1 | grep " ms " | tail -16
pack
true
