#!/usr/bin/env bash
# Idempotent set-up: apt packages, the project venv with torch 2.13.0 (CPU wheel on this machine's disk),
# and a CMake/Ninja/ccache build in ./build. Every step is skipped when already done, so the README's commands
# can call this unconditionally. Prints what it does to stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
VENV="${FSDP_VENV:-$ROOT/.venv}"
BUILD_TYPE="${FSDP_BUILD_TYPE:-RelWithDebInfo}"
log() { echo "[setup] $*" >&2; }

APT_PKGS=(cmake ninja-build ccache g++ python3-venv libgloo-dev libgtest-dev libgmock-dev
          libtomlplusplus-dev nlohmann-json3-dev libcli11-dev zlib1g-dev libxxhash-dev
          clang  # clang: libFuzzer targets (scripts/fuzz.sh; Debian's clang ships libFuzzer and the sanitizers)
          libprotobuf-dev protobuf-compiler libcrcutil-dev  # fsdp-train's TensorBoard event files
          gdb)  # the fault tests print a hung rank's threads before killing it (tests/fault/fault_util.py)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is a Debian name; a pyenv python ships venv itself, so only insist when `python3 -m venv` fails.
if [ ${#missing[@]} -gt 0 ]; then
  if [[ " ${missing[*]} " == *" python3-venv "* ]] && python3 -c 'import venv, ensurepip' 2>/dev/null; then
    missing=("${missing[@]/python3-venv}")
  fi
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sed '/^$/d')
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing apt packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq "${missing[@]}" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  log "installing torch==2.13.0 (CPU wheel) and numpy into $VENV"
  "$VENV/bin/pip" install -q torch==2.13.0 numpy >&2
fi
# tensorboard: tests read fsdp-train's event files with it (it does not depend on torch).
if ! "$VENV/bin/python" -c 'import tensorboard' 2>/dev/null; then
  log "installing tensorboard into $VENV"
  "$VENV/bin/pip" install -q tensorboard >&2
fi
# transformers: the Hugging Face interop tests compare logits with LlamaForCausalLM (tests/checkpoint/interop).
# It does not depend on torch; torch stays the pinned 2.13.0.
if ! "$VENV/bin/python" -c 'import transformers' 2>/dev/null; then
  log "installing transformers into $VENV (Hugging Face interop tests)"
  "$VENV/bin/pip" install -q transformers >&2
  "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' ||
    { log "installing transformers changed torch; reinstall torch==2.13.0"; exit 1; }
fi
TORCH_DIR="$("$VENV/bin/python" -c 'import torch, os; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')"

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  log "configuring $BUILD_DIR ($BUILD_TYPE)"
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DTorch_DIR="$TORCH_DIR" \
    -DFSDP_PYTHON="$VENV/bin/python" >&2
fi
# FSDP_BUILD_TARGETS: only these targets (and what they need), e.g. the main job's "fsdp-train fsdprun" instead of
# every test and benchmark; empty = everything.
read -r -a targets <<< "${FSDP_BUILD_TARGETS:-}"
log "building ${targets[*]:-everything}"
# Compile results are shared between clones (CI builds a fresh clone each time): paths under the tree are
# hashed relative to it, and the working directory is left out of the hash.
export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1
cmake --build "$BUILD_DIR" -j "${FSDP_BUILD_JOBS:-$(nproc)}" ${targets[@]:+--target "${targets[@]}"} >&2
