#!/usr/bin/env bash
# One command for the side-by-side benchmark against PyTorch FSDP2: builds our bench program and the launcher,
# then runs both sides at world sizes 1, 2 and 4 (run.py's defaults) and prints the table.
#   bash bench/vs_pytorch/run.sh [run.py args, e.g. --steps 50 --flavor debugmodel --markdown out.md]
# FSDP_BUILD_DIR picks the build directory (default ./build); the project venv provides torch 2.13.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
VENV="${FSDP_VENV:-$ROOT/.venv}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  FSDP_BUILD_DIR="$BUILD_DIR" bash "$ROOT/scripts/setup.sh"
fi
cmake --build "$BUILD_DIR" -j "${FSDP_BUILD_JOBS:-2}" --target fsdp-bench-ours fsdprun >&2
exec "$VENV/bin/python" "$ROOT/bench/vs_pytorch/run.py" --build-dir "$BUILD_DIR" "$@"
