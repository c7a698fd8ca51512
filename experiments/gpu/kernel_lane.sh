#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's first: 1828c32). This version, the sixteenth session's second call
# (docs/PERF_NOTES.md "v16"), at 32×1024 unless said:
#  1. Nsight Compute with SASS per instruction of the forward: base, stable, and stable with the
#     bits forms of the tie test (~3 min); read with `python -m experiments.gpu.ncu_sass`;
#  2. selects (fwd+bwd, back to back, 16 rounds) among the shipped stable forward and the two bits
#     forms, then judges the selected one per call and back to back (20 rounds);
#  3. the bits form in the Mosaic k128 forward at 4×8192 (back to back, 12 rounds).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
S=${S:-32x1024x12x64}; R=${R:-20}  # (a CPU dry run sets a small S and R)
ratio() {  # $1: file, $2: pass, variants...
  f=$1; p=$2; shift 2
  for v in "$@"; do
    python3 -m bench.ab ratio "$f" --variant "$v" | grep "| $p |" | sed "s/^/$v /"
  done
}
[ "${NCU:-1}" = 1 ] && OUT="$STAGE" SOURCE=1 NCU_TIMEOUT=100 bash experiments/gpu/ncu_profile.sh \
  $S:fa2:0:fwd $S:fa2:1:fwd $S:fa2:1:fwd:d64-bits $S:fa2:1:fwd:d64-bits-asm
gzip -f "$STAGE"/ncu/*-sass.csv "$STAGE"/ncu/*-raw.csv 2>/dev/null
E=bench/entries-stable-d64.json
CANDS=new:stable,new@d64-bits:stable,new@d64-bits-asm:stable
timeout 120 python3 -m bench.ab run --entries $E --sync round --variants new,$CANDS --shapes $S \
  --passes fwd+bwd --rounds $((R * 4 / 5)) --reps 6 --out "$STAGE/ab-select-round.json" 2>&1 | grep " ms " | tail -4
ratio "$STAGE/ab-select-round.json" fwd+bwd ${CANDS//,/ }
SEL=$(python3 - "$STAGE/ab-select-round.json" "$CANDS" "$S" <<'PY'
import json, sys
from bench.ab import paired_ratio
recs = json.load(open(sys.argv[1]))
shape = tuple(map(int, sys.argv[3].split("x")))
got = {v: paired_ratio(recs, v, "new", shape, "fwd+bwd")[0] for v in sys.argv[2].split(",")}
print(min(got, key=got.get))
PY
)
echo "selected: $SEL"
J=new,new:stable
[ "$SEL" != new:stable ] && J=$J,$SEL
for sync in round call; do
  timeout 120 python3 -m bench.ab run --entries $E --sync $sync --variants $J --shapes $S \
    --passes fwd,fwd+bwd --rounds $R --reps 6 --out "$STAGE/ab-judge-$sync.json" 2>&1 | grep " ms " | tail -6
  ratio "$STAGE/ab-judge-$sync.json" fwd+bwd $(echo "${J#new,}" | tr , ' ') | sed "s/^/$sync /"
done
timeout 120 python3 -m bench.ab run --entries bench/entries-stable.json --sync round \
  --variants new,new:stable,new@k128-bits:stable --shapes ${S2:-4x8192x16x128} --passes fwd,fwd+bwd \
  --rounds 12 --reps 6 --out "$STAGE/ab-k128-bits-round.json" 2>&1 | grep " ms " | tail -6
ratio "$STAGE/ab-k128-bits-round.json" fwd+bwd new:stable new@k128-bits:stable
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
