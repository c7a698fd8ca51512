#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's third, fourth and fifth calls: commits
# 13610c4, 27abc1c and the one after it; its first two ran the commands of docs/PERF_NOTES.md "v15").
# This version, the fifteenth session's last call, measures the shipped kernels' stable extra by the
# rule fixed before it (docs/PERF_NOTES.md "v15", "The rule"): interleaved A/Bs in an order reversed
# every other round, 20 rounds, per call and back to back, at the three table shapes; per-round times
# in the records for `python -m bench.ab ratio FILE` (paired ratios with 90 % intervals).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
for sync in call round; do
timeout 150 python3 -m bench.ab run --sync $sync --variants new,new:stable,cudnn \
  --shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128 --passes fwd,fwd+bwd --rounds 20 --reps 6 \
  --out "$STAGE/ab-final-$sync.json" 2>&1 | grep " ms " | tail -18
python3 -m bench.ab ratio "$STAGE/ab-final-$sync.json"
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
