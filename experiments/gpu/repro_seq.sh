#!/usr/bin/env bash
# Reproduction arms one after the other on one H200 (sequential runs are faster than concurrent
# ones: docs/REPRODUCTION.md), metrics under $OUT/repro, logs under $OUT.
# Usage: bash experiments/gpu/repro_seq.sh LIMIT_S ARM:SEED:STEPS [ARM:SEED:STEPS ...]
# Env: TIED=1 first runs the kernel-level tied-row comparison with PyTorch flash;
#      COMPARE_AT=1000,2000 compares with PyTorch flash on the model's tensors at those steps.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; LIMIT=$1; shift
mkdir -p "$OUT"
python3 -c "import jax, jaxlib, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices()[0].device_kind)" | tee "$OUT/env.txt"
if [ "${TIED:-0}" = 1 ]; then
  timeout 120 python3 -m experiments.gpu.torch_compare tied --rows 4000 --out "$OUT/tied_vs_torch.json" 2>&1 | tail -20
fi
for spec in "$@"; do
  IFS=: read -r arm seed steps <<< "$spec"
  timeout "$LIMIT" python3 -m experiments.reproduce run --arm "$arm" --seed "$seed" --steps "$steps" \
    --probe-every 250 --data data/full.npz --out "$OUT/repro" --compare-torch-at "${COMPARE_AT:-}" \
    > "$OUT/$arm-s$seed.log" 2>&1
  echo "$arm seed $seed: exit $?"; tail -3 "$OUT/$arm-s$seed.log"
done
python3 -m experiments.reproduce table "$OUT/repro"
gzip -f "$OUT"/repro/*/metrics.jsonl
