#!/usr/bin/env bash
# Independent jobs ("lanes") side by side on a multi-GPU machine, one GPU each, and everything they
# write packed into one archive, $OUT/lanes.tgz (the device returns at most 8 files).
# Usage on the device machine: bash experiments/gpu/lanes.sh TOTAL_S "lane 0 command" "lane 1 command" ...
# Lane i runs with CUDA_VISIBLE_DEVICES=i, OUT=<stage>/g<i> and DEADLINE (epoch seconds, 30 s before
# TOTAL_S is up: repro_seq.sh ends its arms by then); it is killed 20 s before TOTAL_S so that the
# archive is always written. Its stdout and stderr go to <stage>/g<i>.log (tail printed at the end).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; TOTAL=$1; shift
STAGE=$(mktemp -d); DEADLINE=$(($(date +%s) + TOTAL - 30)); export DEADLINE
i=0
for lane in "$@"; do
  mkdir -p "$STAGE/g$i"
  (CUDA_VISIBLE_DEVICES=$i OUT="$STAGE/g$i" timeout $((TOTAL - 20)) bash -c "$lane") > "$STAGE/g$i.log" 2>&1 &
  i=$((i + 1))
done
wait
mkdir -p "$OUT"; tar czf "$OUT/lanes.tgz" -C "$STAGE" .
for f in "$STAGE"/g*.log; do echo "== $f"; tail -n 20 "$f"; done
