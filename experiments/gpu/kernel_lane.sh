#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh.
# Results under $OUT (bench JSON files and logs). Earlier sessions' versions are in git history
# (the eleventh session's: the v13 table of record, pfps-d64's second A/B, fp32x6-attn's step time);
# this one is about the stable forward's tie count, the whole gap to issue 6's ≤ 3 % target:
#  1. the candidates of bench/entries-stable.json (the shipped entries plus "tie_count_int"; at 4×8192
#     128-key tiles for the Mosaic forward, "k128": the per-row work of the shift once per 128 keys):
#     GPU same-values test, then an interleaved A/B of the forward and fwd+bwd at both shapes,
#  2. the GPT-2 small train step with the current kernels: flash, flash + stable, cuDNN (issue 6's
#     "stable ≤ 1.05× cuDNN"; last measured with v9),
#  3. NCU=1: the Mosaic forward at 4×8192 per SASS instruction, baseline and stable (what the count
#     compiles to; read with `python -m experiments.gpu.ncu_sass`), ~4 min.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout 120 python3 -m pytest -m gpu tests/test_gpu.py -k "ab_entries and (ti or k128)" -q -s -p no:cacheprovider \
  > "$OUT/gpu_stable_entries.log" 2>&1
rc=$?
echo "gpu test (ti, ti-d64, k128): exit $rc"; grep -E "bitwise|passed|failed" "$OUT/gpu_stable_entries.log" | tail -10
if [ "$rc" = 0 ]; then
  timeout 150 python3 -m bench.ab run --variants new,new:stable,new@ti:stable,new@k128,new@k128:stable,cudnn \
    --entries bench/entries-stable.json --shapes 4x8192x16x128 --passes fwd,fwd+bwd \
    --rounds 6 --reps 6 --out "$OUT/ab-stable-d128.json" 2>&1 | grep " ms " | tail -12
  timeout 100 python3 -m bench.ab run --variants new,new:stable,new@ti-d64:stable,cudnn \
    --entries bench/entries-stable.json --shapes 32x1024x12x64 --passes fwd,fwd+bwd \
    --rounds 10 --reps 8 --out "$OUT/ab-stable-d64.json" 2>&1 | grep " ms " | tail -8
fi
timeout 150 python3 -m experiments.gpu.throughput --steps 40 --arms flash,flash-stable,cudnn \
  --out "$OUT/throughput.json" 2>&1 | tail -4
[ "${NCU:-0}" = 1 ] && SOURCE=1 NCU_TIMEOUT=250 OUT="$OUT" bash experiments/gpu/ncu_profile.sh \
  4x8192x16x128:fa2:0:fwd 4x8192x16x128:fa2:1:fwd
true
