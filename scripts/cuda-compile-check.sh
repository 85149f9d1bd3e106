#!/usr/bin/env bash
# Compile-checks libfsdp against a CUDA build of libtorch with the NCCL backend compiled in
# (-DFSDP_WITH_NCCL=ON), on a machine without a GPU. Not part of CI (it downloads ~730 MB once and compiles
# the library against CUDA headers).
#
#   bash scripts/cuda-compile-check.sh            # the library (every src/ unit, incl. the NCCL paths)
#   FSDP_CUDA_CHECK_ALL=1 bash scripts/cuda-compile-check.sh   # also apps, tests, benchmarks (linked with
#                                                 # the CUDA libraries' own dependencies left unresolved)
#
# torch==${FSDP_CUDA_TORCH:-2.11.0} is the version the lent GPU machines carry (PyTorch 2.11 + CUDA 13): its
# PyPI Linux wheel is the CUDA 13.0 build. It and nvidia-nccl-cu13 (nccl.h) are fetched with the project
# venv's pip into .cuda-torch/ and unpacked (headers, CMake config, libraries) — never installed into the
# venv, whose CPU torch 2.13 stays as it is. The CUDA toolkit's headers come from the machine (nvcc on PATH
# or /usr/local/cuda). Build directory: build-cuda/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FSDP_VENV:-$ROOT/.venv}"
TORCH_VERSION="${FSDP_CUDA_TORCH:-2.11.0}"
NCCL_WHEEL="${FSDP_CUDA_NCCL:-nvidia-nccl-cu13==2.28.9}"
# ATen/cuda/CUDAContextLight.h (pulled in by c10d's ProcessGroupNCCL.hpp) includes the cuBLAS, cuSOLVER and
# cuSPARSE headers, which a bare CUDA toolkit install may lack: the versions torch 2.11's wheel pins
# (its METADATA: cuda-toolkit[...]==13.0.2), headers only.
MATH_LIBS="${FSDP_CUDA_MATH_LIBS:-cuda-toolkit[cublas,cusolver,cusparse]==13.0.2}"
DIR="$ROOT/.cuda-torch"
BUILD="$ROOT/build-cuda"
log() { echo "[cuda-check] $*" >&2; }

[ -x "$VENV/bin/pip" ] || bash "$ROOT/scripts/setup.sh"
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null || {
  echo "cuda-compile-check: no CUDA toolkit (nvcc) on this machine; install one (CUDA 13) first" >&2; exit 2; }
# The toolkit root (include/cuda_runtime.h, lib64/libcudart.so): CUDA_HOME, else /usr/local/cuda, else
# next to nvcc. PyTorch's CMake config uses CMake's FindCUDA, which guesses the root from nvcc's directory
# and gets it wrong when nvcc is installed elsewhere (e.g. /usr/local/bin).
CUDA_ROOT="${CUDA_HOME:-}"
if [ -z "$CUDA_ROOT" ]; then
  if [ -f /usr/local/cuda/include/cuda_runtime.h ]; then CUDA_ROOT=/usr/local/cuda
  else CUDA_ROOT="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; fi
fi
[ -f "$CUDA_ROOT/include/cuda_runtime.h" ] || {
  echo "cuda-compile-check: no cuda_runtime.h under $CUDA_ROOT/include; set CUDA_HOME" >&2; exit 2; }

mkdir -p "$DIR"
if [ ! -f "$DIR/torch/share/cmake/Torch/TorchConfig.cmake" ] || [ ! -f "$DIR/nvidia/nccl/include/nccl.h" ]; then
  log "downloading torch==$TORCH_VERSION (CUDA wheel) and $NCCL_WHEEL into $DIR"
  ls "$DIR"/torch-"$TORCH_VERSION"-*.whl "$DIR"/nvidia_nccl*.whl >/dev/null 2>&1 ||
    "$VENV/bin/pip" download -q --no-deps -d "$DIR" "torch==$TORCH_VERSION" "$NCCL_WHEEL" >&2
  "$VENV/bin/python" - "$DIR" <<'PY'
import glob, sys, zipfile
d = sys.argv[1]
for whl in glob.glob(f"{d}/torch-*.whl") + glob.glob(f"{d}/nvidia_nccl*.whl"):
    z = zipfile.ZipFile(whl)
    keep = [n for n in z.namelist() if n.startswith(("torch/include/", "torch/share/", "torch/lib/", "torch/version.py", "nvidia/"))]
    z.extractall(d, keep)
PY
fi
if [ ! -f "$DIR/nvidia/cu13/include/cusparse.h" ]; then
  log "downloading the cuBLAS/cuSOLVER/cuSPARSE wheels ($MATH_LIBS) for their headers"
  mkdir -p "$DIR/math-wheels"
  "$VENV/bin/pip" download -q -d "$DIR/math-wheels" "$MATH_LIBS" >&2
  "$VENV/bin/python" - "$DIR" <<'PY'
import glob, sys, zipfile
d = sys.argv[1]
for whl in glob.glob(f"{d}/math-wheels/nvidia_*.whl"):
    z = zipfile.ZipFile(whl)
    z.extractall(d, [n for n in z.namelist() if n.startswith("nvidia/cu13/include/")])
PY
  rm -rf "$DIR/math-wheels"  # ~800 MB of libraries nothing here links
fi
TORCH_BUILD="$(grep "^__version__" "$DIR/torch/version.py" | cut -d"'" -f2)"
log "libtorch $TORCH_BUILD"

if [ ! -f "$BUILD/build.ninja" ]; then
  log "configuring $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
    -DTorch_DIR="$DIR/torch/share/cmake/Torch" -DFSDP_WITH_NCCL=ON -DFSDP_NCCL_ROOT="$DIR/nvidia/nccl" \
    -DFSDP_PYTHON="$VENV/bin/python" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" \
    -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc" -DCMAKE_CXX_FLAGS="-isystem $DIR/nvidia/cu13/include" \
    -DCMAKE_EXE_LINKER_FLAGS="-Wl,--unresolved-symbols=ignore-in-shared-libs" >&2
fi
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
if [ "${FSDP_CUDA_CHECK_ALL:-0}" = 1 ]; then
  cmake --build "$BUILD" -j "${FSDP_BUILD_JOBS:-$(nproc)}" >&2
else
  cmake --build "$BUILD" -j "${FSDP_BUILD_JOBS:-$(nproc)}" --target fsdp >&2
fi
log "OK: compiled against libtorch $TORCH_BUILD with FSDP_WITH_NCCL=ON"
