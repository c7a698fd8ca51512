#!/usr/bin/env bash
# Two reproduction arms concurrently on one H200 (each with 45 % of GPU memory), metrics under $OUT.
# Usage: bash experiments/gpu/repro_pair.sh ARM1 ARM2 SEED STEPS [LIMIT_S]   (experiments/arms.py;
# PRESET=NAME: the preset the arms modify, default small-gpu)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
OUT=${OUT:-out}; LIMIT=${5:-560}
for arm in "$1" "$2"; do
  timeout "$LIMIT" python3 -m experiments.reproduce run --arm "$arm" --preset "${PRESET:-small-gpu}" \
    --seed "$3" --steps "$4" \
    --probe-every 250 --data data/full.npz --out "$OUT/repro" > "$OUT/$arm.log" 2>&1 &
done
wait
python3 -m experiments.reproduce table "$OUT/repro"
