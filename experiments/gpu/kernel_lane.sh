#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's: 1828c32, cccfe3c, c816cba, b497f6a, 8dfa135; the seventeenth's first five:
# 12c59f0, 757106d, b3b6010, c6808be, 4452f31). This version, the seventeenth session's sixth call
# (docs/PERF_NOTES.md "The sixth call"):
#  1. GPU tests of the shipped forms (ftz at 32×1024, the direct form with unscaled scores at 4×8192);
#  2. the stable target judged at the three shapes with the shipped table, 30 rounds, both modes.
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
R=${R:-30}
timeout 240 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider \
  -k "scale_late or exp2_ftz or (vs_jnp and True-fa2) or mosaic_stable_tied or (mosaic_forward and True-True)" \
  > "$STAGE/gpu-tests.log" 2>&1; grep -E "passed|failed" "$STAGE/gpu-tests.log" | tail -3
for s in ${SHAPES:-32x1024x12x64 8x2048x16x128 4x8192x16x128}; do
  for sync in round call; do
    timeout 150 python3 -m bench.ab run --sync $sync --variants new,new:stable --shapes $s \
      --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/judge-$s-$sync.json" 2>&1 | grep " ms " | tail -2
    python3 -m bench.ab ratio "$STAGE/judge-$s-$sync.json" --variant new:stable | tail -1 \
      | sed "s/^/judge $sync /" | tee -a "$STAGE/judgement.txt"
  done
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
