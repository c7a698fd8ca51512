#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth's third, GPU tests + the 8×2048 entry's A/B + the v15
# table: commit 13610c4; its fourth, the table with the order reversed in odd rounds: commit after
# it; the first two ran the commands of docs/PERF_NOTES.md "v15"). This version, the fifteenth
# session's fifth call: the stable extra at the three table shapes by interleaved A/Bs whose order
# is reversed in odd rounds (bench.attention.timed_interleaved), 16 rounds, per call and back to
# back; at D = 128 the factor form (shipped) against the direct one (new@k128).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
E=bench/entries-stable.json
for sync in call round; do
timeout 120 python3 -m bench.ab run --entries $E --sync $sync \
  --variants new,new:stable,new@k128:stable,cudnn \
  --shapes 8x2048x16x128,4x8192x16x128 --passes fwd,fwd+bwd --rounds 16 --reps 6 \
  --out "$STAGE/ab-abba-d128-$sync.json" 2>&1 | grep " ms " | tail -16
timeout 60 python3 -m bench.ab run --entries $E --sync $sync \
  --variants new,new:stable,cudnn \
  --shapes 32x1024x12x64 --passes fwd,fwd+bwd --rounds 16 --reps 6 \
  --out "$STAGE/ab-abba-d64-$sync.json" 2>&1 | grep " ms " | tail -6
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
