#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's first two: 1828c32, cccfe3c). This version, the sixteenth session's third
# call (docs/PERF_NOTES.md "v16"):
#  1. the table of record (bench.attention, the three table shapes, causal; its targets table pairs
#     the stable extra by round);
#  2. the GPT-2 small step with flash, flash stable and cuDNN attention (experiments.gpu.throughput).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
timeout 330 python3 -m bench.attention --shapes ${SHAPES:-32x1024x12x64,8x2048x16x128,4x8192x16x128} \
  --reps ${REPS:-30} --rounds 5 --memory-lengths "" --out "$STAGE/table-v16.json" --md "$STAGE/table-v16.md" \
  2>&1 | tail -5
tail -30 "$STAGE/table-v16.md"
timeout 230 python3 -m experiments.gpu.throughput --steps ${STEPS:-30} --arms flash,flash-stable,cudnn \
  --out "$STAGE/gpt2-small-throughput-v16.json" 2>&1 | tail -6
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
