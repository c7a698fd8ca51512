#!/usr/bin/env bash
# The kernel work of one GPU call (docs/PERF_NOTES.md "The next GPU call"), on a machine of its own.
# Earlier sessions' versions are in git history (the fourteenth's, the k128 forward's SASS with
# stall samples: commit 5e212b7; the fifteenth session's third to sixth calls: commits 13610c4,
# 27abc1c, 585f9b0 (the rule's call), and this one's predecessor; its first two ran the commands of
# docs/PERF_NOTES.md "v15"). This version, the fifteenth session's last call ("The 32×1024 call" in
# docs/PERF_NOTES.md): run 1 (back to back) selects among the shipped Triton stable forward and two
# candidates at 32×1024; run 2 (per call, back to back) judges the selected one.
# Everything under $OUT is packed into $OUT/kernel_lane.tgz (the device returns at most 8 files).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; STAGE=$(mktemp -d)
V=new,new:stable,new@sf-d64:stable,new@ti-ps-d64:stable
E=bench/entries-stable.json
run() {  # $1: label, $2: sync
  timeout 100 python3 -m bench.ab run --entries $E --sync "$2" --variants $V \
    --shapes 32x1024x12x64 --passes fwd+bwd --rounds 20 --reps 6 \
    --out "$STAGE/ab-d64-$1-$2.json" 2>&1 | grep " ms " | tail -4
  for v in new:stable new@sf-d64:stable new@ti-ps-d64:stable; do
    python3 -m bench.ab ratio "$STAGE/ab-d64-$1-$2.json" --variant $v | tail -1 | sed "s/^/$v /"
  done
}
run select round
run judge call
run judge round
mkdir -p "$OUT"; tar czf "$OUT/kernel_lane.tgz" -C "$STAGE" .
true
