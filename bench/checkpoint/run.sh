#!/usr/bin/env bash
# Checkpoint benchmark: libfsdp vs PyTorch DCP (venv torch) on the same state, 2 ranks, plus the disk's raw
# sequential bandwidth measured in the same run. Usage: bench/checkpoint/run.sh [GB of fp32 parameters] [build dir]
# (the state is 3x: parameters + AdamW's two moments).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GB="${1:-0.5}"
BUILD="${2:-$ROOT/build}"
DIR="${FSDP_CKPT_BENCH_DIR:-/tmp/fsdp_ckpt_bench}"
cmake --build "$BUILD" --target fsdp-bench-ckpt fsdprun >&2
export OMP_NUM_THREADS=1
"$BUILD/apps/fsdprun/fsdprun" --nproc-per-node 2 "$BUILD/bench/fsdp-bench-ckpt" --gb "$GB" --dir "$DIR" | sed -n 's/^\[rank 0\] //p'
"$ROOT/.venv/bin/python" -m torch.distributed.run --nproc-per-node 2 "$ROOT/bench/checkpoint/dcp_bench.py" --gb "$GB" --dir "$DIR" 2>/dev/null
