#!/usr/bin/env bash
# Checkpoint benchmark: libfsdp vs PyTorch DCP (venv torch) on the same state, saved on 2 ranks, plus the
# disk's raw sequential bandwidth measured in the same run, the async-save stall in a real training step, and
# resharding loads of each side's 2-rank checkpoint on 3 and 4 ranks.
# Usage: bench/checkpoint/run.sh [GB of fp32 parameters] [build dir] [more fsdp-bench-ckpt flags, e.g. --no-stall]
#   (the state is 3x: + AdamW's two moments)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GB="${1:-0.5}"
BUILD="${2:-$ROOT/build}"
DIR="${FSDP_CKPT_BENCH_DIR:-/tmp/fsdp_ckpt_bench}"
cmake --build "$BUILD" --target fsdp-bench-ckpt fsdprun >&2
export OMP_NUM_THREADS=1
trap 'rm -rf "$DIR/ours" "$DIR/dcp"' EXIT
FSDPRUN="$BUILD/apps/fsdprun/fsdprun"
PY="${FSDP_BENCH_PYTHON:-$ROOT/.venv/bin/python}"  # the torch with DCP (scripts/gpu-check.sh bench: python3)
ours() { "$FSDPRUN" --nproc-per-node "$1" "$BUILD/bench/fsdp-bench-ckpt" "${@:2}" | sed -n 's/^\[rank 0\] //p'; }
theirs() { "$PY" -m torch.distributed.run --nproc-per-node "$1" "$ROOT/bench/checkpoint/dcp_bench.py" "${@:2}" 2>/dev/null; }
ours 2 --gb "$GB" --dir "$DIR" --keep "${@:3}"
theirs 2 --gb "$GB" --dir "$DIR" --keep
for m in 3 4; do
  ours "$m" --reshard-from "$DIR/ours/step-1"
  theirs "$m" --gb "$GB" --reshard-from "$DIR/dcp/step-1"
done
