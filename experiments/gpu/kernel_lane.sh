#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75). This version, the sixteenth session's first call (docs/PERF_NOTES.md "v16"), at 32×1024:
#  1. selects, forward only and back to back, the fastest stable forward among the shipped launch,
#     launch variants (bench/entries-stable-d64.json) and the Mosaic forward at D = 64;
#  2. judges the selected one, the per-row rewrite (new:stable) and the code before it (old:stable,
#     bb4df75, carried as build/ab/bb4df75) in fwd+bwd, per call and back to back, 20 rounds;
#  3. the rewrite against the code before it at the two D = 128 shapes (back to back).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
E=bench/entries-stable-d64.json
OLD="--old build/ab/bb4df75"
S=${S:-32x1024x12x64}; R=${R:-20}  # (a CPU dry run sets a small S and R)
CANDS=new:stable,new@d64-w4s2:stable,new@d64-w4s4:stable,new@d64-w8s2:stable,new@d64-w8s3:stable
CANDS=$CANDS,new@d64-nops:stable,new@d64-m64:stable,new@d64-m64-sf:stable
ratio() {  # $1: file, $2: pass, variants...
  f=$1; p=$2; shift 2
  for v in "$@"; do
    python3 -m bench.ab ratio "$f" --variant "$v" | grep "| $p |" | sed "s/^/$v /"
  done
}
timeout 200 python3 -m bench.ab run $OLD --entries $E --sync round --variants new,$CANDS,new@d64-m64,old:stable \
  --shapes $S --passes fwd --rounds $((R * 3 / 5)) --reps 6 --out "$STAGE/ab-select-fwd-round.json" 2>&1 | grep " ms " | tail -12
ratio "$STAGE/ab-select-fwd-round.json" fwd ${CANDS//,/ } old:stable new@d64-m64
SEL=$(python3 - "$STAGE/ab-select-fwd-round.json" "$CANDS" "$S" <<'PY'
import json, sys
from bench.ab import paired_ratio
recs = json.load(open(sys.argv[1]))
got = {}
for v in sys.argv[2].split(","):
    try:
        got[v] = paired_ratio(recs, v, "new", tuple(map(int, sys.argv[3].split("x"))), "fwd")[0]
    except KeyError:
        pass
print(min(got, key=got.get))
PY
)
echo "selected: $SEL"
J=new,new:stable,old:stable
[ "$SEL" != new:stable ] && J=$J,$SEL
for sync in round call; do
  timeout 150 python3 -m bench.ab run $OLD --entries $E --sync $sync --variants $J --shapes $S \
    --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/ab-judge-$sync.json" 2>&1 | grep " ms " | tail -4
  ratio "$STAGE/ab-judge-$sync.json" fwd+bwd $(echo "${J#new,}" | tr , ' ') | sed "s/^/$sync /"
done
timeout 120 python3 -m bench.ab run $OLD --sync round --variants new,new:stable,old:stable \
  --shapes 8x2048x16x128,4x8192x16x128 --passes fwd+bwd --rounds 12 --reps 6 \
  --out "$STAGE/ab-d128-round.json" 2>&1 | grep " ms " | tail -6
ratio "$STAGE/ab-d128-round.json" fwd+bwd new:stable old:stable
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
