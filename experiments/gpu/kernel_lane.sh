#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7). This version is the fifteenth session's third call; its first two
# measured the stable shift as a per-row factor and the tie count as PTX integer masks (commands and
# results: docs/PERF_NOTES.md "v15"). This one checks what ships:
#  1. the GPU tests of the shipped factor form and the kernels against the jnp executor,
#  2. at 8×2048 the new table entry (k128 Mosaic kernels, factor form) against the defaults it
#     replaces, per call and back to back,
#  3. the table of record (bench.attention, the three table shapes, causal).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -s \
  -k "shift_factor or k128-sf or sf-d64 or kernels_vs_jnp" > "$STAGE/gpu-tests.log" 2>&1
tail -3 "$STAGE/gpu-tests.log"; grep -E "factor vs" "$STAGE/gpu-tests.log" | head -5
E=bench/entries-stable.json
for sync in call round; do
timeout 60 python3 -m bench.ab run --entries $E --sync $sync \
  --variants new@defaults,new@defaults:stable,new,new:stable,cudnn \
  --shapes 8x2048x16x128 --passes fwd,fwd+bwd --rounds 7 --reps 6 \
  --out "$STAGE/ab-t2048-$sync.json" 2>&1 | grep " ms " | tail -10
done
timeout 300 python3 -m bench.attention --shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128 \
  --reps 30 --rounds 5 --memory-lengths "" --out "$STAGE/table-v15.json" --md "$STAGE/table-v15.md" \
  2>&1 | tail -5
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
