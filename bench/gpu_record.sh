#!/usr/bin/env bash
# The GPU record of one revision, in one call on a GPU machine: the GPU tests (their log is the
# evidence that the kernels compute the jnp executor's numerics under every shipped tuning entry),
# the side-by-side attention benchmark at the three shapes of record, and optionally the training
# step and the drop-in beside cuDNN (`dropin`: bench.attention --dropin, kernel throughput).
# Everything lands under $OUT (at most 8 files come back from the device machine).
# Usage: OUT=out bash bench/gpu_record.sh [tests] [bench] [step] [dropin]   (default: tests bench)
# Env: TEST_TIMEOUT, BENCH_TIMEOUT, STEP_TIMEOUT, STEP_BUDGET, DROPIN_TIMEOUT (seconds);
#      SHAPES and BENCH_ARGS (bench.attention's timing and mask arguments; default "--sync round
#      --non-causal --warm-ms 300 --sample-ms 100", the table of record's: calls back to back, each
#      shape with and without the mask, each sample of fa2 (± the shift), cuDNN and cuDNN
#      deterministic after 300 ms of the same calls, a slow reference's samples about 100 ms; 12
#      rounds of 6 calls: 353 s on an H100 before cuDNN deterministic joined, 379–396 s with it);
#      STEP_ARMS, STEP_BATCH, STEP_PRIMARY (fa2-stable), STEP_ROUNDS (1) for the step
#      (bench.train_step --arms, --batch, --primary, --rounds); STEP_PROFILE_ARMS (--profile-arms: several arms profiled, returned as
#      profile-compare.md and profile.tgz), STEP_PROFILE_STEPS (--profile-steps, 3);
#      K selects GPU tests (pytest -k); TEST_WORKERS (1) pytest processes for them.
# `step` alone writes 4 files: env.txt, train_step.{json,log}, profile.tgz (profile/: profile.md,
# trace.json.gz, hlo.txt.gz); it needs nanoGPT's model.py carried in third_party/nanoGPT (`make nanogpt`).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
parts=${*:-tests bench}
python3 - <<'PY' | tee "$OUT/env.txt"
import subprocess, sys, jax, jaxlib
from bench.train_step import git_tree
rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
# the tree names the files that ran: a copied checkout's HEAD may be older than its files
print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__,
      jax.devices()[0].device_kind, "rev", rev or "?", "tree", git_tree() or "?")
PY
rc=0
if [[ " $parts " == *" tests "* ]]; then
  # TEST_WORKERS > 1: that many pytest processes share the GPU (their compilations run on the CPUs
  # side by side), each allocating as it goes (six ran out of an H100's 80 GB in the whole suite;
  # its heaviest tests passed in two); the log names every test as it passes (-v) and
  # gives the cases' printed figures at its end (-rA; a run cut by the timeout has none)
  workers=(-q -s); prealloc=true
  if [ "${TEST_WORKERS:-1}" -gt 1 ]; then workers=(-v -n "$TEST_WORKERS"); prealloc=false; fi
  XLA_PYTHON_CLIENT_PREALLOCATE=$prealloc timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu tests/test_gpu.py "${workers[@]}" \
    -p no:cacheprovider -rA ${K:+-k "$K"} \
    > "$OUT/gpu-tests.log" 2>&1; r=$?; [ $r -ne 0 ] && rc=$r
  echo "gpu tests: exit $r"; tail -3 "$OUT/gpu-tests.log"
fi
if [[ " $parts " == *" bench "* ]]; then
  timeout "${BENCH_TIMEOUT:-540}" python3 -m bench.attention \
    --shapes "${SHAPES:-32x1024x12x64,8x2048x16x128,4x8192x16x128}" --reps 72 --rounds 12 \
    ${BENCH_ARGS---sync round --non-causal --warm-ms 300 --sample-ms 100} --out "$OUT/bench.json" \
    > "$OUT/bench.log" 2>&1
  r=$?; [ $r -ne 0 ] && rc=$r
  echo "bench: exit $r"; tail -12 "$OUT/bench.log"
fi
if [[ " $parts " == *" step "* ]]; then
  # fa2, fa2-stable, cuDNN and nanoGPT's own step at micro-batches 32 and 16, each run a process of
  # its own, fa2-stable at 32 profiled; runs that would not end within STEP_BUDGET are skipped (the
  # fa2-stable / nanoGPT pairs come first), and the results file is complete after every run
  # STEP_ARMS: the arms timed (default: also fa2-stable with the fastest named options measured,
  # F below, and F with the GELU's Pallas kernels); STEP_BATCH: micro-batches
  F="model.logits_dtype=bfloat16;model.layernorm=pallas;model.gelu=erf;model.gelu_from_input=true"
  F+=";model.cross_entropy=pallas;model.packed_qkv=true"
  default_arms="fa2,fa2-stable,cudnn,fa2-stable[$F],fa2-stable[${F/gelu=erf/gelu=pallas}]"
  timeout "${STEP_TIMEOUT:-540}" python3 -m bench.train_step --steps 30 --batch "${STEP_BATCH:-32,16}" \
    --rounds "${STEP_ROUNDS:-1}" \
    --arms "${STEP_ARMS:-$default_arms}" \
    --primary "${STEP_PRIMARY:-fa2-stable}" --nanogpt third_party/nanoGPT \
    --profile "$OUT/profile" ${STEP_PROFILE_ARMS:+--profile-arms "$STEP_PROFILE_ARMS"} \
    --profile-steps "${STEP_PROFILE_STEPS:-3}" \
    --budget "${STEP_BUDGET:-520}" \
    --out "$OUT/train_step.json" > "$OUT/train_step.log" 2>&1; r=$?; [ $r -ne 0 ] && rc=$r
  echo "train step: exit $r"; tail -14 "$OUT/train_step.log"
  # the profiles come back as one archive (a call returns at most 8 files); their tables are printed
  if [ -f "$OUT/profile/compare.md" ]; then
    cp "$OUT/profile/compare.md" "$OUT/profile-compare.md"; cat "$OUT/profile-compare.md"
  elif [ -f "$OUT/profile/profile.md" ]; then
    sed -n '1,16p' "$OUT/profile/profile.md"
  fi
  [ -d "$OUT/profile" ] && tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$OUT/profile"
fi
if [[ " $parts " == *" dropin "* ]]; then
  # jax_flash.dot_product_attention beside cuDNN and XLA (GQA, a window, its causal baseline),
  # kernel throughput: a round's calls back to back, one wait
  timeout "${DROPIN_TIMEOUT:-300}" python3 -m bench.attention --dropin --sync round --reps 20 --rounds 4 \
    --out "$OUT/dropin.json" > "$OUT/dropin.log" 2>&1; r=$?; [ $r -ne 0 ] && rc=$r
  echo "dropin: exit $r"; tail -32 "$OUT/dropin.log"
fi
exit $rc
