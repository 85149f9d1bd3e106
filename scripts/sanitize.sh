#!/usr/bin/env bash
# Sanitizer builds (docs/reliability.md, "Sanitizers"). Each mode has its own build directory (a full rebuild of
# libfsdp and the tests with the sanitizer: long on a small machine; build only what you run).
#
#   scripts/sanitize.sh asan  [ctest args]   ASan + UBSan build in build-asan of libfsdp and the multi-rank subset
#                                            below, then runs it (about an hour on 2 cores, mostly the build)
#   scripts/sanitize.sh tsan  [ctest args]   TSan build in build-tsan, runs the asynchronous paths: FSDP prefetch /
#                                            overlap and the reduce-scatter progress thread, async checkpoints,
#                                            collectives, abandoned steps (tests/sanitizers/tsan.supp)
#   scripts/sanitize.sh launcher-asan|launcher-tsan
#                                            only fsdprun with the sanitizer (a minute to build), then the fault
#                                            tests of tests/fault/ run through it
#
# Environment: FSDP_SANITIZE_TARGETS (ninja targets to build, then run with ctest -R; default: the subsets
# below), FSDP_BUILD_JOBS. docs/reliability.md ("Sanitizers") has the last results.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode=${1:?usage: sanitize.sh asan|tsan|launcher-asan|launcher-tsan [ctest args]}
shift
VENV="${FSDP_VENV:-$ROOT/.venv}"
TORCH_DIR="$("$VENV/bin/python" -c 'import torch, os; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
JOBS="${FSDP_BUILD_JOBS:-2}"
case "$mode" in
  asan|launcher-asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" ;;
  tsan|launcher-tsan) flags="-fsanitize=thread -fno-omit-frame-pointer" ;;
  *) echo "sanitize.sh: unknown mode '$mode'" >&2; exit 2 ;;
esac
BUILD="$ROOT/build-${mode#launcher-}"
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
# ASan: libtorch is not instrumented; its allocations are freed by its own code, so no mismatches. Leak checking
# is off (libtorch's static registries and c10d's detached threads live until exit by design).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:detect_odr_violation=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tests/sanitizers/tsan.supp}"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
  -DTorch_DIR="$TORCH_DIR" -DFSDP_PYTHON="$VENV/bin/python" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >"$BUILD.configure.log" 2>&1 ||
  { cat "$BUILD.configure.log"; exit 1; }
if [[ $mode == launcher-* ]]; then
  cmake --build "$BUILD" -j "$JOBS" --target fsdprun
  normal="${FSDP_BUILD_DIR:-$ROOT/build}"
  rc=0
  for t in launch_mismatch_test kill_resume_test hang_test; do
    args=(--fsdprun "$BUILD/apps/fsdprun/fsdprun" --train "$normal/apps/fsdp-train/fsdp-train"
          --workdir "$BUILD/fault-work/$t")
    [ "$t" = kill_resume_test ] && args+=(--ckpt-tool "$normal/apps/fsdp-ckpt/fsdp-ckpt" --trials 2)
    echo "== $t with $mode fsdprun"
    log="$BUILD/fault-work/$t.log"
    mkdir -p "$BUILD/fault-work"
    "$VENV/bin/python" "$ROOT/tests/fault/$t.py" "${args[@]}" >"$log" 2>&1 || rc=1
    grep -E '^\[(FAIL|result|skip)\]|Sanitizer|runtime error' "$log" || true
  done
  exit $rc
fi
# The default subsets: building every test instrumented (~160 units against libtorch's headers) does not fit a
# small machine; these cover the multi-rank runtime (ASan) and every thread of libfsdp (TSan).
asan_default="comm_collectives_test fully_shard_runtime_test fully_shard_asymmetric_exception_test
  fully_shard_overlap_test fully_shard_state_dict_test fully_shard_parity_test checkpoint_roundtrip_test tp_fsdp_test
  nn_sequential_test"
tsan_default="fully_shard_overlap_test checkpoint_test comm_collectives_test fully_shard_asymmetric_exception_test"
if [ "$mode" = asan ]; then default=$asan_default; else default=$tsan_default; fi
targets=$(echo ${FSDP_SANITIZE_TARGETS:-$default})
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "$JOBS" --target fsdprun $targets
cd "$BUILD"
if [ $# -gt 0 ]; then
  ctest --output-on-failure --timeout 1200 "$@"
else
  ctest --output-on-failure --timeout 1200 -R "^(${targets// /|})([.]|\$)"
fi
