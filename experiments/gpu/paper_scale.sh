#!/usr/bin/env bash
# The paper's setting (preset gpt2-small-paper: 524,288 tokens/step, warmup 2,000) on
# every GPU of the machine, data parallel (train/gpt2.py shards the batch over jax.devices();
# accumulation = 524,288 / (32·1024·n_devices)). Runs live on the machine's disk with a checkpoint
# every 250 steps and resume, so the same command repeated while the machine stays warm continues the
# run across 10-minute calls; each call copies metrics and config to $OUT/paper/<arm>/.
# Usage: bash experiments/gpu/paper_scale.sh LIMIT_S ARM MAX_STEPS      (ARM: experiments/arms.py)
#   one-GPU throughput check:  bash experiments/gpu/paper_scale.sh 300 fa2 40
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; RUNS=${RUNS:-/tmp/jf-paper}; LIMIT=$1; ARM=$2; STEPS=$3
mapfile -t EXTRA < <(python3 -m experiments.arms "$ARM") || exit 2
[ "${#EXTRA[@]}" -gt 0 ] || { echo "unknown arm $ARM"; exit 2; }
mkdir -p "$OUT/paper/$ARM" "$RUNS"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tee "$OUT/paper/$ARM/gpus.txt"
timeout "$LIMIT" python3 -m train.gpt2 --preset gpt2-small-paper "${EXTRA[@]}" data.path=data/full.npz \
  run_dir="$RUNS/$ARM" max_steps="$STEPS" checkpoint_every=250 resume=auto probe_every=250 \
  progress=false >> "$RUNS/$ARM.log" 2>&1
echo "exit $?"; tail -5 "$RUNS/$ARM.log"
cp "$RUNS/$ARM.log" "$OUT/paper/$ARM/run.log"
cp "$RUNS/$ARM"/{config.json,summary.json} "$OUT/paper/$ARM/" 2>/dev/null
python3 -c "import sys; from train.gpt2 import pack_metrics; pack_metrics(*sys.argv[1:])" \
  "$RUNS/$ARM" "$OUT/paper/$ARM"
