#!/usr/bin/env bash
# Hardware counters of the jax-flash kernels (Nsight Compute), to see what bounds them: speed of
# light, pipe use, warp stalls, instruction mix, occupancy, per kernel of one attention call.
# Usage on the device machine: bash lab/ncu_profile.sh [CASE ...]
# CASE = SHAPE:POLICY:STABLE:PASS[:ENTRY], e.g. 4x8192x16x128:fa2:1:fwd (default: the four below);
# PASS: fwd (one jax_flash kernel per call) or fwd+bwd (three: forward, dK/dV, dQ);
# ENTRY: a candidate of lab/entries.json (e.g. k128: its launch, and its tiles as call arguments)
# instead of the shipped table's launch (variants as in lab.ab: new@ENTRY).
# POLICY cudnn profiles cuDNN's kernels through jax.nn.dot_product_attention instead (its forward
# kernel; fwd+bwd: forward and backward), e.g. 4x8192x16x128:cudnn:0:fwd+bwd.
# CASE = row:SPEC profiles one of the model's row kernels instead: SPEC a lab.row_kernels variant
# of ours (e.g. row:ln-bwd:reload=1, row:gelu-bwd), at $TOKENS tokens (32768).
# Writes $OUT/ncu/<case>.csv (details page: speed of light, pipes, warp stalls, instruction mix)
# and <case>-raw.csv (every raw metric), and a one-line summary per kernel to stdout.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# a kernel that writes memory it reads (cuDNN's backward) is replayed with device memory saved and
# restored each pass; with JAX's preallocated pool (75 % of the GPU) cuDNN's backward at 4x8192
# outlasted a 200-s limit, so JAX allocates what the pass needs only
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-out}; mkdir -p "$OUT/ncu"
CASES=("$@")
[ ${#CASES[@]} -eq 0 ] && CASES=(4x8192x16x128:fa2:0:fwd+bwd 4x8192x16x128:fa2:1:fwd
                                 8x2048x16x128:fa2:0:fwd 8x2048x16x128:fa2:1:fwd)
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats
          --section InstructionStats --section Occupancy --section LaunchStats --section SchedulerStats"
# SOURCE=1: also sample warp stalls per SASS instruction and write <case>-sass.csv (which load or
# barrier a kernel's stalls sit on; read it with python -m lab.ncu_sass)
[ "${SOURCE:-0}" = 1 ] && SECTIONS="$SECTIONS --section SourceCounters"
DRIVER=$(mktemp --suffix=.py)
cat > "$DRIVER" <<'PY'
# Runs one attention pass three times; the profiler skips the first (compile, warm-up) call's kernels.
import json, sys
import jax, jax.numpy as jnp, numpy as np
import jax_flash as jf
from bench.attention import _jax_pass
from lab import ab
shape, policy, stable, pss, entry = sys.argv[1:6]
spec = "new" + (f"@{entry}" if entry else "") + (":stable" if stable == "1" else "")
spec = "cudnn" if policy == "cudnn" else spec
shape = tuple(int(x) for x in shape.split("x"))
q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal(shape), jnp.bfloat16) for i in range(3))
g = _jax_pass(ab._attention_fn(spec, {"new": jf}, ab.candidate_entries(), True, policy), pss)
if spec != "cudnn":
    plan = jf.plan(q, k, v, **ab.call_kwargs(spec, ab.candidate_entries(), True, policy))
    print(spec, json.dumps(plan.to_dict()))  # into the case's log: what ran
for _ in range(3):
    jax.block_until_ready(g(q, k, v))
PY
ROW_DRIVER=$(mktemp --suffix=.py)
cat > "$ROW_DRIVER" <<'PY'
# Runs one row-kernel variant of lab.row_kernels three times (one kernel a call).
import sys
import jax
from lab import row_kernels
f, args, _ = row_kernels.build(sys.argv[1], int(sys.argv[2]))
for _ in range(3):
    jax.block_until_ready(f(*args))
PY
for case in "${CASES[@]}"; do
  name=$(echo "$case" | tr ':+;=' '____')
  rep=$(mktemp -d)/prof
  if [[ "$case" == row:* ]]; then  # one model kernel a call: skip the first call's
    # shellcheck disable=SC2086
    timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --target-processes all -k regex:model_ \
      --launch-skip 1 --launch-count 1 $SECTIONS -o "$rep" \
      python3 "$ROW_DRIVER" "${case#row:}" "${TOKENS:-32768}" > "$OUT/ncu/$name.log" 2>&1
  else
    IFS=: read -r shape policy stable pss entry <<< "$case"
    case "$pss" in fwd|fwd+bwd) ;; *) echo "$case: PASS must be fwd or fwd+bwd"; continue ;; esac
    n=$([ "$pss" = fwd ] && echo 1 || echo 3)  # jax_flash kernels a call: fwd; or fwd, dK/dV, dQ
    kernels=jax_flash
    if [ "$policy" = cudnn ]; then  # cuDNN's generated kernels: fprop; or fprop, bprop
      kernels=cudnn_generated; n=$([ "$pss" = fwd ] && echo 1 || echo 2)
    fi
    # shellcheck disable=SC2086
    timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --target-processes all -k regex:$kernels \
      --launch-skip "$n" --launch-count "$n" $SECTIONS -o "$rep" \
      python3 "$DRIVER" "$shape" "$policy" "$stable" "$pss" "${entry:-}" > "$OUT/ncu/$name.log" 2>&1
  fi
  echo "$case: ncu exit $?"
  if [ -f "$rep.ncu-rep" ]; then
    ncu --import "$rep.ncu-rep" --csv --page details > "$OUT/ncu/$name.csv" 2>/dev/null
    ncu --import "$rep.ncu-rep" --csv --page raw > "$OUT/ncu/$name-raw.csv" 2>/dev/null
    [ "${SOURCE:-0}" = 1 ] && { ncu --import "$rep.ncu-rep" --csv --page source --print-source sass \
      > "$OUT/ncu/$name-sass.csv" 2>&1 || echo "sass page export failed (see $name-sass.csv)"; }
    # the few numbers that answer "what bounds it", per kernel
    python3 - "$OUT/ncu/$name.csv" <<'PY'
import csv, sys
want = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "Registers Per Thread",
        "Achieved Occupancy", "Issue Slots Busy", "Executed Ipc Active", "No Eligible")
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    if any(r.get("Metric Name", "").startswith(w) for w in want):
        rows.setdefault(r["Kernel Name"][:40], []).append(f"{r['Metric Name']} {r['Metric Value']} {r.get('Metric Unit', '')}")
for k, v in rows.items():
    print(" ", k, "|", "; ".join(v))
PY
  else
    tail -5 "$OUT/ncu/$name.log"
  fi
done
rm -f "$DRIVER" "$ROW_DRIVER"
