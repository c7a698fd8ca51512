#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), for one lane of lanes.sh:
# every candidate launch of bench/entries-*.json under the GPU correctness test, a second interleaved
# A/B of the candidates at the three benchmark shapes, and the forward of JAX's own Mosaic GPU
# attention beside ours and cuDNN's. Results under $OUT (bench JSON files and logs).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -c "import json,glob; d={}; [d.update(json.load(open(f))) for f in sorted(glob.glob('bench/entries-*.json'))]; json.dump(d, open('/tmp/entries-all.json','w'))"
timeout 240 python3 -m pytest -m gpu tests/test_gpu.py -k ab_entries -q -s -p no:cacheprovider > "$OUT/gpu_ab_entries.log" 2>&1
echo "gpu ab_entries: exit $?"; grep -E "bitwise|passed|failed" "$OUT/gpu_ab_entries.log" | tail -30
timeout 200 python3 -m bench.ab run --variants new,new@pf,new@pf-dq-r128w8s3,new:stable,cudnn \
  --entries /tmp/entries-all.json --shapes 4x8192x16x128,8x2048x16x128 --passes fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-d128.json" 2>&1 | grep " ms " | tail -12
timeout 100 python3 -m bench.ab run --variants new,new@pf-d64,new:stable,new@pf-d64:stable,cudnn \
  --entries /tmp/entries-all.json --shapes 32x1024x12x64 --passes fwd+bwd \
  --rounds 10 --reps 8 --out "$OUT/ab-d64.json" 2>&1 | grep " ms " | tail -6
timeout 100 python3 -m bench.ab run --variants new,mgpu,cudnn \
  --shapes 4x8192x16x128,8x2048x16x128,32x1024x12x64 --passes fwd \
  --rounds 10 --reps 8 --out "$OUT/ab-mgpu-fwd.json" 2>&1 | grep -E " ms |Error" | tail -12
