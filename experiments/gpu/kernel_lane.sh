#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own
# (the twelfth session's A/Bs beside a training run on the host's other GPU read k128 as ×1.00 in
# fwd+bwd; alone, the thirteenth read ×0.94). Earlier sessions' versions are in git history (the
# thirteenth's: the fwd/bwd split, in-situ traces, the v14 table of record, at commit 4bff7c4; the
# fourteenth's second, the tie-count forms k128-tm / k128-ti, at 5eadb7a). This version ran in the
# fourteenth session (bench/results/ncu-2026-11-30-v14-k128/).
# This one asks where the stable forward's +0.30–0.35 ms at 4×8192 goes, by instruction:
#  1. Nsight Compute with stall samples per SASS instruction, shipped (k128) forward, base and stable
#     (~3 min); read on a CPU with `python -m experiments.gpu.ncu_sass <case>-sass.csv.gz`,
#  2. the stable extra back to back at the three table shapes, a second time (~1 min).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
OUT="$STAGE" SOURCE=1 NCU_TIMEOUT=170 bash experiments/gpu/ncu_profile.sh \
  4x8192x16x128:fa2:0:fwd 4x8192x16x128:fa2:1:fwd
gzip -f "$STAGE"/ncu/*-sass.csv "$STAGE"/ncu/*-raw.csv 2>/dev/null
timeout 150 python3 -m bench.ab run --variants new,new:stable,cudnn --sync round \
  --shapes 32x1024x12x64,8x2048x16x128,4x8192x16x128 --passes fwd,fwd+bwd --rounds 7 --reps 6 \
  --out "$STAGE/ab-stable-round.json" 2>&1 | grep " ms " | tail -18
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
