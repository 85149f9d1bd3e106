#!/usr/bin/env bash
# Builds libfsdp on a lent GPU machine and runs the device tests (ctest -L device) on its one GPU.
#
#   bash scripts/gpu-check.sh prepare   # here (Debian 12, apt): download the Debian header packages into
#                                       # .gpu-debs/ (git-ignored), for the device tool to carry along
#   bash scripts/gpu-check.sh run       # there, from the repository root, with .gpu-debs carried: unpack them
#                                       # into /tmp/gpu-deps (never into /), configure build-gpu/ against the
#                                       # machine's python3 torch with FSDP_WITH_NCCL=ON, build, run the tests,
#                                       # write a summary to $OUT/gpu-check.txt when $OUT is set
#   bash scripts/gpu-check.sh all       # there: every check of issue 36 in one command (build, tests, fsdp-train
#                                       # on CUDA, the comparisons with FSDP2, the pipeline bubble, fsdp-plan),
#                                       # each stage under its own time budget; `all --dry-run` rehearses it on
#                                       # the CPU (scripts/gpu-check-all.sh, docs/gpu-runs/README.md)
#   bash scripts/gpu-check.sh bench     # there, after run (same machine): the checkpoint benchmarks — the
#                                       # async-save stall with the model on the GPU (fsdp-bench-ckpt --device
#                                       # cuda:0, 2 ranks), then bench/checkpoint/run.sh against python3's DCP
#                                       # on that machine's disk; output in $OUT/gpu-bench.txt
#
# The GPU machines have torch (CUDA) in python3, CMake, ninja and nvcc, but no network and no apt: the build's
# other dependencies (gloo's headers, xxHash, nlohmann-json, CLI11, GoogleTest) come as .deb files. Only the
# library, fsdprun, the benchmarks and the tests/{device,comm} directories are built (FSDP_TEST_DIRS, default
# overridable by FSDP_GPU_TEST_DIRS; FSDP_APPS_EXCLUDE): fsdp-train's protobuf/crcutil/zlib and fsdp-plan are
# not needed for the device tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEBS="$ROOT/.gpu-debs"
DEPS="${FSDP_GPU_DEPS:-/tmp/gpu-deps}"
BUILD="$ROOT/build-gpu"
# fsdp-train's: zlib, protobuf (headers, library, protoc and its library), crcutil, toml++ (cairo is left out: its
# X11/glib tree is large, and fsdp-train builds without its `plot` subcommands when cairo is missing).
PKGS=(libgloo-dev libxxhash-dev libxxhash0 nlohmann-json3-dev libcli11-dev libgtest-dev
      zlib1g-dev libprotobuf-dev libprotobuf32 protobuf-compiler libprotoc32 libcrcutil-dev libcrcutil0
      libtomlplusplus-dev)
log() { echo "[gpu-check] $*" >&2; }
die() { echo "gpu-check: $*" >&2; exit 2; }

prepare() {
  command -v apt-get >/dev/null || die "prepare needs apt-get (run it on the Debian machine, not the GPU one)"
  mkdir -p "$DEBS"
  rm -f "$DEBS"/*.deb
  log "downloading ${PKGS[*]} into $DEBS"
  (cd "$DEBS" && apt-get download "${PKGS[@]}" >&2)
  for p in "${PKGS[@]}"; do
    ls "$DEBS/${p}"_*.deb >/dev/null 2>&1 || die "no .deb for $p in $DEBS"
  done
  du -sh "$DEBS"
  log "now carry .gpu-debs to the GPU machine and run: bash scripts/gpu-check.sh run"
}

run() {
  local py="${FSDP_GPU_PYTHON:-python3}"
  command -v "$py" >/dev/null || die "no $py (the machine's python with a CUDA torch); set FSDP_GPU_PYTHON"
  for tool in cmake ninja dpkg; do command -v "$tool" >/dev/null || die "$tool is not installed"; done
  ls "$DEBS"/*.deb >/dev/null 2>&1 || die "no .deb files in $DEBS: run 'bash scripts/gpu-check.sh prepare' on the \
Debian machine first and carry .gpu-debs along"
  "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    die "$py's torch sees no CUDA device (torch $("$py" -c 'import torch; print(torch.__version__)'))"

  # Unpack without installing (dpkg -x never runs maintainer scripts or touches /var/lib/dpkg).
  rm -rf "$DEPS" && mkdir -p "$DEPS"
  for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$DEPS"; done
  [ -f "$DEPS/usr/include/gloo/algorithm.h" ] || die "gloo headers missing in $DEPS (libgloo-dev)"
  [ -f "$DEPS/usr/include/nlohmann/json.hpp" ] || die "nlohmann/json.hpp missing in $DEPS (nlohmann-json3-dev)"
  local gtest_dir
  gtest_dir="$(dirname "$(find "$DEPS" -name GTestConfig.cmake | head -1)")"
  [ -n "$gtest_dir" ] && [ "$gtest_dir" != . ] || die "GTestConfig.cmake missing in $DEPS (libgtest-dev)"
  local xxhash_lib
  xxhash_lib="$(find "$DEPS" -name 'libxxhash.so.0*' -type f | head -1)"
  [ -n "$xxhash_lib" ] || die "libxxhash.so.0 missing in $DEPS (libxxhash0)"
  # libxxhash-dev's libxxhash.so is a link to libxxhash.so.0: both unpacked side by side, found via the prefix.

  local torch_dir nccl_root torch_version cuda_root
  torch_dir="$("$py" -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"
  torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
  nccl_root="$("$py" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)"
  [ -n "$nccl_root" ] && [ -f "$nccl_root/include/nccl.h" ] || die "no nccl.h from the nvidia-nccl pip package in $py"
  export PATH="$PATH:/usr/local/cuda/bin"
  command -v nvcc >/dev/null || die "no nvcc on PATH or in /usr/local/cuda/bin"
  cuda_root="${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}"
  # c10d's ProcessGroupNCCL.hpp pulls in cuBLAS/cuSOLVER/cuSPARSE headers (ATen/cuda/CUDAContextLight.h); a
  # minimal toolkit may lack them, the pip packages torch depends on (nvidia/cu13/include) have them.
  local cxx_flags="-isystem $DEPS/usr/include" math_inc out="${OUT:-}" logs
  logs="${out:-$BUILD}"
  mkdir -p "$logs"
  math_inc="$("$py" -c 'import nvidia, os
for p in nvidia.__path__:
    d = os.path.join(p, "cu13", "include")
    if os.path.isfile(os.path.join(d, "cusparse.h")): print(d); break' 2>/dev/null || true)"
  [ -n "$math_inc" ] && cxx_flags="$cxx_flags -isystem $math_inc"
  log "torch $torch_version ($torch_dir), NCCL headers $nccl_root, CUDA $cuda_root, math headers ${math_inc:-from the toolkit}"

  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTorch_DIR="$torch_dir" -DFSDP_WITH_NCCL=ON -DFSDP_NCCL_ROOT="$nccl_root" -DFSDP_PYTHON="$(command -v "$py")" \
    -DCUDA_TOOLKIT_ROOT_DIR="$cuda_root" -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" \
    -DCMAKE_PREFIX_PATH="$DEPS/usr" -DGTest_DIR="$gtest_dir" \
    -DCMAKE_CXX_FLAGS="$cxx_flags" \
    -DCMAKE_BUILD_RPATH="$(dirname "$xxhash_lib")" \
    -DFSDP_TEST_DIRS="${FSDP_GPU_TEST_DIRS:-device;comm}" \
    -DFSDP_APPS_EXCLUDE="${FSDP_GPU_APPS_EXCLUDE-fsdp-plan;fsdp-ckpt}" \
    > "$logs/gpu-configure.log" 2>&1 || { tail -40 "$logs/gpu-configure.log" >&2; die "cmake configure failed"; }
  # `all` configures through here, then builds and runs its stages itself (scripts/gpu-check-all.sh).
  [ -z "${FSDP_GPU_CONFIGURE_ONLY:-}" ] || { log "configured $BUILD"; return 0; }
  # -k 0: one unit that does not compile must not hide what the others would show; the tests of what did build
  # still run, and the failure is in the summary.
  local rc=0 t0=$SECONDS
  ninja -C "$BUILD" -k 0 -j "${FSDP_BUILD_JOBS:-$(nproc)}" > "$logs/gpu-build.log" 2>&1 || {
    rc=1
    log "BUILD FAILED (continuing with what built); the first errors:"
    grep -m 20 -E "error|FAILED" "$logs/gpu-build.log" >&2 || true
  }
  log "build took $((SECONDS - t0)) s"

  local log_file="$logs/gpu-check-ctest.log"
  # The device tests, then the comm collectives on the same build (cheap, CPU Gloo, a few seconds).
  (cd "$BUILD" && ctest -L device -V --timeout 300) 2>&1 | tee "$log_file" || rc=1
  (cd "$BUILD" && ctest -R '^comm_' -j8 --output-on-failure) 2>&1 | tee -a "$log_file" >&2 || rc=1
  if [ -n "$out" ]; then  # $out is $logs, created above
    {
      echo "libfsdp gpu-check, $(date -u +%FT%TZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
      nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
      echo "torch $torch_version, nvcc: $(nvcc --version | tail -1)"
      grep -E "Test +#|tests passed|Skipped|Failed|\[gloo-cuda parity\]|\[nccl world 1\]|recorded steps" "$log_file" || true
    } > "$out/gpu-check.txt"
    log "summary in $out/gpu-check.txt"
  fi
  [ "$rc" = 0 ] && log "OK: device tests passed" || log "FAILED: see $log_file"
  return "$rc"
}

bench() {
  local fsdprun="$BUILD/apps/fsdprun/fsdprun" ckpt_bench="$BUILD/bench/fsdp-bench-ckpt" rc=0
  [ -x "$fsdprun" ] && [ -x "$ckpt_bench" ] || die "no $fsdprun or $ckpt_bench: run 'bash scripts/gpu-check.sh run' first"
  local out_file="${OUT:-$BUILD}/gpu-bench.txt" dir="${FSDP_CKPT_BENCH_DIR:-/tmp/fsdp_ckpt_bench}"
  mkdir -p "$(dirname "$out_file")" "$dir"
  {
    echo "libfsdp gpu-check bench, $(date -u +%FT%TZ), commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi -L 2>&1 || true
    echo "## async-save stall, model on cuda:0 (2 ranks, Gloo on CUDA), ${FSDP_GPU_STALL_GB:-1.07} GB fp32 + AdamW"
  } > "$out_file"
  OMP_NUM_THREADS=4 timeout 300 "$fsdprun" --nproc-per-node 2 "$ckpt_bench" --device cuda:0 --gb "${FSDP_GPU_STALL_GB:-1.07}" \
    --dir "$dir" 2>&1 | tee -a "$out_file" >&2 || rc=1
  echo "## checkpoint save/load vs DCP (python3's torch), CPU state, this machine's disk" >> "$out_file"
  FSDP_BENCH_PYTHON="${FSDP_GPU_PYTHON:-python3}" timeout 300 bash "$ROOT/bench/checkpoint/run.sh" "${FSDP_GPU_CKPT_GB:-0.5}" "$BUILD" \
    2>&1 | tee -a "$out_file" >&2 || rc=1
  log "bench output in $out_file"
  return "$rc"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  bench) bench ;;
  all) shift; exec bash "$ROOT/scripts/gpu-check-all.sh" "$@" ;;
  *) echo "usage: bash scripts/gpu-check.sh prepare|run|bench|all [--dry-run] [--build-dir DIR]" >&2; exit 2 ;;
esac
