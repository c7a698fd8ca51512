#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's: 1828c32, cccfe3c, c816cba, b497f6a, 8dfa135; the seventeenth's first,
# the top-2 tie test: 12c59f0). This version, the seventeenth session's second call
# (docs/PERF_NOTES.md "v17b"), at 32×1024:
#  1. the compiled ftz exp2 against libdevice's exp2 (bitwise O and L, base and stable);
#  2. forward only, back to back: base and stable, each with and without exp2_ftz;
#  3. fwd+bwd, back to back and per call, 20 rounds: the same four (the rule's decision);
#  4. the ftz base and stable forwards' SASS with stall samples (Nsight Compute).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
E=bench/entries-stable-d64.json; S=${S:-32x1024x12x64}; R=${R:-20}  # (a CPU dry run sets small S, R)
V=new,new:stable,new@d64-ftz,new@d64-ftz:stable
ratio() {  # $1: file, $2: pass, variants...
  f=$1; p=$2; shift 2
  for v in "$@"; do
    python3 -m bench.ab ratio "$f" --variant "$v" | grep "| $p |" | sed "s/^/$v /"
  done
}
timeout 200 python3 -m pytest -q -s -m gpu tests/test_gpu.py -k "exp2_ftz" -p no:cacheprovider \
  > "$STAGE/gpu-tests.log" 2>&1; tail -4 "$STAGE/gpu-tests.log"
timeout 150 python3 -m bench.ab run --entries $E --sync round --variants $V --shapes $S \
  --passes fwd --rounds $R --reps 6 --out "$STAGE/fwd-round.json" 2>&1 | grep " ms " | tail -4
ratio "$STAGE/fwd-round.json" fwd new:stable new@d64-ftz
python3 -m bench.ab ratio "$STAGE/fwd-round.json" --variant new@d64-ftz:stable --base new@d64-ftz | tail -1
for sync in round call; do
  timeout 180 python3 -m bench.ab run --entries $E --sync $sync --variants $V --shapes $S \
    --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/judge-$sync.json" 2>&1 | grep " ms " | tail -4
  ratio "$STAGE/judge-$sync.json" fwd+bwd new:stable new@d64-ftz | sed "s/^/$sync /"
  python3 -m bench.ab ratio "$STAGE/judge-$sync.json" --variant new@d64-ftz:stable --base new@d64-ftz \
    | tail -1 | sed "s/^/$sync ftz-stable\/ftz /"
done
SOURCE=1 OUT=$STAGE NCU_TIMEOUT=150 bash experiments/gpu/ncu_profile.sh "$S:fa2:0:fwd:d64-ftz" "$S:fa2:1:fwd:d64-ftz" 2>&1 | tail -3
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
