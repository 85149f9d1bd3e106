#!/usr/bin/env bash
# The main job: fsdp-train on its embedded default config (configs/debug.toml) on 2 ranks of this machine,
# launched by fsdprun. Extra arguments go to fsdp-train (e.g. --training.steps 50, --config FILE).
# Sets up (apt, venv, build) when needed, then trains, prints the final loss next to the unigram entropy of the
# data, and draws the curves into outputs/metrics.png.
#   FSDP_TRAIN_NPROC=1 bash scripts/train.sh     # one rank (gradient accumulation makes the same batches)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Only the trainer and the launcher (and the library): a newcomer's first run does not compile the tests.
FSDP_BUILD_TARGETS="fsdp-train fsdprun" bash "$ROOT/scripts/setup.sh"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
NPROC="${FSDP_TRAIN_NPROC:-2}"
TRAIN="$BUILD_DIR/apps/fsdp-train/fsdp-train"
cd "$ROOT"
"$BUILD_DIR/apps/fsdprun/fsdprun" --nproc-per-node "$NPROC" "$TRAIN" "$@"
# Plot what rank 0 wrote (the dump folder follows --job.dump_folder when given).
DUMP="$("$TRAIN" --print-config "$@" | sed -n 's/^dump_folder = "\(.*\)"$/\1/p')"
if [ -f "$DUMP/metrics.jsonl" ]; then
  "$TRAIN" plot "$DUMP/metrics.jsonl" "$DUMP/metrics.png"
fi
