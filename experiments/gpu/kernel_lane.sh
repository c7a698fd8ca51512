#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's calls: commits 13610c4, 27abc1c, 585f9b0 and
# bb4df75; the sixteenth's first four: 1828c32, cccfe3c, c816cba, b497f6a). This version, the
# sixteenth session's fifth call (docs/PERF_NOTES.md "v16", "The factor form, exps first"):
#  1. decides, per shape: the factor form with the exps first in program order (new@…-sf, or the
#     shipped form at 8×2048) against the shipped stable form and the factor form before the reorder
#     (old = b497f6a, carried as build/ab/b497f6a); 16 rounds, back to back and per call;
#  2. judges the stable target with the forms so chosen at the three shapes (20 rounds, both modes).
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
E=bench/entries-stable.json; OLD="--old build/ab/b497f6a"; R=${R:-20}
declare -A V=(
  [${S1:-32x1024x12x64}]="new,new:stable,new@sf-d64:stable,old@sf-d64:stable"
  [${S2:-8x2048x16x128}]="new,new:stable,old:stable,new@k128:stable"
  [${S3:-4x8192x16x128}]="new,new:stable,new@k128-sf:stable,old@k128-sf:stable")
for s in "${!V[@]}"; do
  for sync in round call; do
    timeout 100 python3 -m bench.ab run $OLD --entries $E --sync $sync --variants "${V[$s]}" --shapes $s \
      --passes fwd,fwd+bwd --rounds $((R * 4 / 5)) --reps 6 --out "$STAGE/decide-$s-$sync.json" 2>&1 \
      | grep " ms " | tail -8
  done
done
# per shape: the stable form with the lowest fwd+bwd ratio in both modes, else the shipped one
python3 - "$STAGE" "${!V[@]}" > "$STAGE/chosen.txt" <<'PY'
import json, sys
from bench.ab import paired_ratio
stage, shapes = sys.argv[1], sys.argv[2:]
for s in shapes:
    shape = tuple(map(int, s.split("x")))
    r = {m: json.load(open(f"{stage}/decide-{s}-{m}.json")) for m in ("round", "call")}
    stables = [v for v in {x["variant"] for x in r["round"]} if v.endswith(":stable")]
    ratio = {v: {m: paired_ratio(r[m], v, "new", shape, "fwd+bwd")[0] for m in r} for v in stables}
    for v in sorted(ratio):
        print(f"# {s} {v} round ×{ratio[v]['round']:.4f} call ×{ratio[v]['call']:.4f}")
    best = [v for v in stables if all(ratio[v][m] < ratio["new:stable"][m] for m in r)]
    best = min(best, key=lambda v: ratio[v]["round"] + ratio[v]["call"]) if best else "new:stable"
    print(s, best)
PY
cat "$STAGE/chosen.txt"
grep -v "^#" "$STAGE/chosen.txt" | while read -r s v; do
  for sync in round call; do
    timeout 100 python3 -m bench.ab run $OLD --entries $E --sync $sync --variants "new,$v" --shapes $s \
      --passes fwd+bwd --rounds $R --reps 6 --out "$STAGE/judge-$s-$sync.json" 2>&1 | grep " ms " | tail -2
    python3 -m bench.ab ratio "$STAGE/judge-$s-$sync.json" --variant "$v" | tail -1 | sed "s/^/judge $sync $v /"
  done
done
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
