#!/usr/bin/env bash
# repro_seq.sh in a setting of the loss-failure search (experiments/search.py): VARIANT and
# OVERRIDES from the setting's name, no checkpoints — the command experiments.queue writes.
# Usage: bash experiments/gpu/setting_seq.sh SETTING LIMIT_S ARM:SEED:STEPS [...]
set -u
setting=$1; shift
OVERRIDES="$(python3 -m experiments.search overrides "$setting" | tr '\n' ' ')" || exit 2
CKPT_EVERY=${CKPT_EVERY:-0} VARIANT=$setting OVERRIDES=$OVERRIDES exec bash "$(dirname "$0")/repro_seq.sh" "$@"
