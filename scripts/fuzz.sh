#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (a separate build: FSDP_FUZZ=ON builds nothing else) and
# runs each for a bounded time. Exit 0: no crash, no sanitizer report; 77: clang/libFuzzer missing (skip).
#
#   scripts/fuzz.sh [--seconds N] [--target REGEX] [--build-dir DIR] [--jobs J] [--torch-dir DIR] [--libfsdp SO]
#
# --libfsdp: the main build's libfsdp.so, which the hf_config target links for the model (default:
# <build-dir>/../src/libfsdp.so, i.e. build/src/libfsdp.so; without it that one target is left out).
#
# CI runs it through the ctest fuzz_smoke with --seconds 4; the longer campaign in docs/reliability.md is
#   scripts/fuzz.sh --seconds 600
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_EACH=10 TARGET="" TORCH_DIR="" LIBFSDP="" BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}/fuzz" JOBS="${FSDP_BUILD_JOBS:-2}"
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    --target) TARGET=$2; shift 2 ;;
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --torch-dir) TORCH_DIR=$2; shift 2 ;;
    --libfsdp) LIBFSDP=$2; shift 2 ;;
    *) echo "fuzz.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
CLANGXX="${FSDP_FUZZ_CXX:-clang++}"
if ! command -v "$CLANGXX" >/dev/null; then
  echo "fuzz.sh: SKIP: $CLANGXX not found (Debian: apt-get install clang; scripts/setup.sh installs it)"; exit 77
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/p.cpp"
if ! "$CLANGXX" -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" 2>"$probe/err"; then
  echo "fuzz.sh: SKIP: $CLANGXX cannot link libFuzzer+ASan+UBSan: $(head -c 400 "$probe/err")"; exit 77
fi
VENV="${FSDP_VENV:-$ROOT/.venv}"
[ -n "$TORCH_DIR" ] || TORCH_DIR="$("$VENV/bin/python" -c 'import torch, os; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
mkdir -p "$BUILD_DIR"
[ -n "$LIBFSDP" ] || LIBFSDP="$(cd "$BUILD_DIR/.." && pwd)/src/libfsdp.so"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DFSDP_FUZZ=ON -DCMAKE_CXX_COMPILER="$CLANGXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "${launcher[@]}" -DTorch_DIR="$TORCH_DIR" -DFSDP_FUZZ_SECONDS="$SECONDS_EACH" \
  -DFSDP_FUZZ_LIBFSDP="$LIBFSDP" >"$BUILD_DIR/configure.log" 2>&1 ||
  { cat "$BUILD_DIR/configure.log"; exit 1; }
grep -h "^-- fuzz target .* skipped" "$BUILD_DIR/configure.log" || true
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
cmake --build "$BUILD_DIR" -j "$JOBS"
cd "$BUILD_DIR"
args=(--output-on-failure -V -L fuzz)
[ -n "$TARGET" ] && args+=(-R "$TARGET")
set +e
ctest "${args[@]}" >fuzz-ctest.log 2>&1
rc=$?
set -e
grep -E '^[0-9]+: fuzz fuzz_|^[0-9]+: reproducer|^[0-9]+: SUMMARY:|tests passed|tests failed' fuzz-ctest.log || true
[ $rc -ne 0 ] && tail -n 80 fuzz-ctest.log
exit $rc
