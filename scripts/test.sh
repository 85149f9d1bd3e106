#!/usr/bin/env bash
# The whole test suite: set up (when needed), build, run ctest. FSDP_SKIP_SLOW=1 leaves out tests labelled slow.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
args=(--output-on-failure -j "${FSDP_TEST_JOBS:-2}" --timeout 600)
[ "${FSDP_SKIP_SLOW:-0}" = 1 ] && args+=(-LE slow)
cd "$BUILD_DIR" && ctest "${args[@]}" "$@"
