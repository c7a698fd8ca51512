#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's first three: 1828c32, cccfe3c, c816cba). This version, the sixteenth
# session's fourth call (docs/PERF_NOTES.md "v16", "Where the stable forward's extra goes"): the
# stable forward's extra split into the per-entry count and the per-row shift by diagnostic forms
# (experiments.gpu.stable_parts), back to back and per call, 20 rounds, at 32×1024 and 4×8192.
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
for shape in ${SHAPES:-32x1024x12x64 4x8192x16x128}; do
  for sync in round call; do
    timeout 140 python3 -m experiments.gpu.stable_parts --shape $shape --sync $sync --rounds ${R:-20} \
      --out "$STAGE/parts-$shape-$sync.json" 2>&1 | tail -4 | sed "s/^/$shape $sync /"
    for v in stable "per-row only" "count only"; do
      python3 -m bench.ab ratio "$STAGE/parts-$shape-$sync.json" --variant "$v" --base base | tail -1 \
        | sed "s/^/$shape $sync $v /"
    done
  done
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
