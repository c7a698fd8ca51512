#!/usr/bin/env bash
# Reproduction arms one after the other on one H200 (sequential runs are faster than concurrent
# ones). Runs live on the machine's disk ($RUNS, a checkpoint every CKPT_EVERY
# = 1000 steps and one where the limit's SIGTERM stops a run, resumed when the same ARM:SEED comes
# again), so a run longer than one command continues
# in the next command while the machine stays warm. Metrics, config and summary of each run are copied
# to $OUT/repro/<arm>-s<seed>/ after every command (three files per run: at most two arms per call
# come back, the device returns ≤ 8 files, two folder levels deep).
# Usage: bash experiments/gpu/repro_seq.sh LIMIT_S ARM:SEED:STEPS [ARM:SEED:STEPS ...]
# ARM: an experiments/arms.py arm (ARMS), or torch-flash / torch-standard (TORCH_ARMS) for the PyTorch twin
# (experiments/gpu/torch_train.py: the same init, data order and probe, trained by PyTorch; no resume).
# Env: GPU_TESTS=K first runs the `gpu` kernel tests selected by `-k K` (e.g. fa2) and stops if they fail;
#      TIED=1 first runs the kernel-level tied-row comparison with PyTorch flash;
#      COMPARE_AT=1000,2000 compares with PyTorch flash on the model's tensors at those steps;
#      PRESET=NAME: the train/config.py preset the arms modify (default small-gpu);
#      VARIANT=NAME OVERRIDES="model.n_layer=6 ..." runs every arm with these config overrides (the
#      PyTorch twin follows model sizes, warmup and micro-batch: experiments.arms twin_args; it refuses
#      others), kept apart under $RUNS/NAME/ and $OUT/repro-NAME/;
#      DEADLINE=EPOCH_S (set by lanes.sh) shortens each arm's limit so that the last one ends by then.
#      TWIN_COMPILE_BACKWARD=1 runs the twin's written-out attention backward through torch.compile
#      (torch_train --compile-backward; off by default, as the twin's runs so far).
#      SNAP_STEPS=3000,4000 saves L1's q, k, v, dO (one probe sequence, all heads: ~6 MiB a step) at
#      those steps and copies them to $OUT/repro/<run>/, for experiments/real_chain.py on a CPU —
#      mind the device's 16 MiB per returned file (lanes.sh packs everything into one).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the executables and GEMM autotuning of the first run of a configuration serve the later ones
# (other seeds, the next command while the machine stays warm): ~20 s of compilation each. One
# cache per XLA_FLAGS, so that a deterministic-mode run never takes a default-mode GEMM choice.
flags_key=$(printf '%s' "${XLA_FLAGS:-}" | md5sum | cut -c1-12)
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jf-jax-cache/$flags_key}
mkdir -p "$JAX_COMPILATION_CACHE_DIR/xla_gpu_per_fusion_autotune_cache_dir"
OUT=${OUT:-out}; RUNS=${RUNS:-/tmp/jf-repro}; LIMIT=$1; shift
if [ -n "${VARIANT:-}" ]; then RUNS="$RUNS/$VARIANT"; DEST="$OUT/repro-$VARIANT"; else DEST="$OUT/repro"; fi
read -r -a EXTRA <<< "${OVERRIDES:-}"
mkdir -p "$DEST" "$RUNS"
# the tree hash names the files that ran (a copied checkout's HEAD may be older than its files)
python3 -c "import jax, jaxlib, sys; from bench.train_step import git_tree; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices()[0].device_kind, 'tree', git_tree())" | tee "$OUT/env.txt"
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 300 python3 -m pytest -m gpu tests/test_gpu.py -k "$GPU_TESTS" -q -s -x -p no:cacheprovider \
    > "$OUT/gpu_tests.log" 2>&1 || { tail -30 "$OUT/gpu_tests.log"; echo "gpu tests failed: stopping"; exit 1; }
  tail -1 "$OUT/gpu_tests.log"
fi
if [ "${TIED:-0}" = 1 ]; then
  timeout 120 python3 -m experiments.gpu.torch_compare tied --rows 4000 --out "$OUT/tied_vs_torch.json" 2>&1 | tail -20
fi
for spec in "$@"; do
  IFS=: read -r arm seed steps <<< "$spec"
  name="$arm-s$seed"
  lim=$LIMIT
  if [ -n "${DEADLINE:-}" ]; then
    left=$((DEADLINE - $(date +%s) - 15)); [ "$left" -lt "$lim" ] && lim=$left
    [ "$lim" -lt 90 ] && { echo "$name: skipped, ${lim}s left before the deadline"; continue; }
  fi
  if [[ "$arm" == torch-* ]]; then
    twin=$(python3 -m experiments.arms twin-args "${EXTRA[@]}") \
      || { echo "$name: skipped (the PyTorch twin cannot follow OVERRIDES)"; continue; }
    TWIN=(); [ -n "$twin" ] && mapfile -t TWIN <<< "$twin"
    timeout "$lim" python3 -m experiments.gpu.torch_train --arm "$arm" --seed "$seed" "${TWIN[@]}" \
      --steps "$steps" --probe-every 250 --data data/full.npz --out "$RUNS" \
      --max-seconds $((lim - 45)) --compile-backward "${TWIN_COMPILE_BACKWARD:-0}" \
      >> "$RUNS/$name.log" 2>&1
  else
    timeout "$lim" python3 -m experiments.reproduce run --arm "$arm" --preset "${PRESET:-small-gpu}" \
      --seed "$seed" --steps "$steps" \
      --probe-every 250 --data data/full.npz --out "$RUNS" --compare-torch-at "${COMPARE_AT:-}" \
      --checkpoint-every "${CKPT_EVERY:-1000}" --resume auto --snapshot-steps "${SNAP_STEPS:-}" \
      "${EXTRA[@]}" >> "$RUNS/$name.log" 2>&1
  fi
  echo "$name: exit $?"; tail -5 "$RUNS/$name.log"
  mkdir -p "$DEST/$name"
  cp "$RUNS/$name"/{config.json,summary.json} "$DEST/$name/" 2>/dev/null
  python3 -c "import sys; from train.gpt2 import pack_metrics; pack_metrics(*sys.argv[1:])" \
    "$RUNS/$name" "$DEST/$name"
  cp "$RUNS/$name"/tensors/*.npz "$DEST/$name/" 2>/dev/null
done
python3 -m experiments.reproduce table "$DEST"
