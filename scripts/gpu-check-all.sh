#!/usr/bin/env bash
# scripts/gpu-check.sh all [--dry-run] [--build-dir DIR]: every GPU check of issue 36 in one command, for a lent
# machine (16 cores, one H100/H200, python3 with a CUDA torch, nvcc, no network), within 8 minutes wall.
# docs/gpu-runs/README.md says what each stage does, its budget and its figures.
#
#   bash scripts/gpu-check.sh prepare                   # here: the Debian packages to carry (.gpu-debs)
#   bash scripts/gpu-check.sh all                       # there: build-gpu/, every stage, summary into $OUT
#   bash scripts/gpu-check.sh all --dry-run             # here: the same stages on the CPU at tiny sizes
#   bash scripts/gpu-check.sh all --dry-run --build-dir build   # the same against an already-built tree (CI)
#   bash scripts/gpu-check.sh all --stages compare_w1,plan       # only these stages (the others: "skipped")
#
# Stages (each under its own `timeout`; a failed or overrun stage is reported with its first error lines and
# the next stage runs): build, tests, train, compare_w1, compare_w2, pipeline, plan. The dry run differs from the
# real run only in the device (cpu), the sizes and the budgets: the same binaries, the same Python scripts, the
# same flags. Output: summary.md, summary.json and logs.tar.gz in $OUT when set (the device tool brings back at
# most 8 files), else in <build dir>/gpu-check/.
set -uo pipefail  # no -e: a stage's failure is recorded, never fatal
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SELF="$ROOT/scripts/gpu-check-all.sh"
log() { echo "[gpu-check all] $*" >&2; }

# ---------------------------------------------------------------------------------------------------------------
# One stage's body, run as its own process under `timeout` (bash "$SELF" --stage NAME), so that killing it on
# overrun takes its launchers and ranks with it (timeout signals its whole process group).
# ---------------------------------------------------------------------------------------------------------------
fsdprun() { "$BUILD/apps/fsdprun/fsdprun" "$@"; }
report() { "$PY" "$ROOT/scripts/gpu_check_report.py" "$@"; }

stage_build() {
  local targets=(fsdp fsdprun fsdp-train fsdp-plan fsdp-bench-ours fsdp-bench-pp)
  if [ -n "$PREBUILT" ]; then
    # CI: the tree is built already; check that every target of the run is there and up to date, build nothing.
    local missing=() t
    for t in apps/fsdprun/fsdprun apps/fsdp-train/fsdp-train apps/fsdp-plan/fsdp-plan bench/fsdp-bench-ours \
             bench/fsdp-bench-pp; do
      [ -x "$BUILD/$t" ] || missing+=("$t")
    done
    local stale
    stale="$(ninja -C "$BUILD" -n "${targets[@]}" 2>/dev/null | grep -c '^\[' || true)"
    report figures --stage build --set mode=prebuilt --set "build_dir=$BUILD" --set "missing=${missing[*]:-none}" \
      --set "out_of_date_steps=$stale" --set seconds=0
    [ ${#missing[@]} = 0 ] || { echo "error: missing binaries in $BUILD: ${missing[*]}"; return 1; }
    return 0
  fi
  local t0=$SECONDS rc=0
  if [ "$DRY" = 1 ]; then
    # Here: the ordinary CPU tree (scripts/setup.sh configures it), only the targets this run needs.
    [ -f "$BUILD/build.ninja" ] || FSDP_BUILD_TARGETS=fsdprun FSDP_BUILD_JOBS="${FSDP_BUILD_JOBS:-1}" bash "$ROOT/scripts/setup.sh"
  else
    # There: gpu-check.sh's configuration (carried .debs, the machine's CUDA torch, NCCL), fsdp-train and
    # fsdp-plan included. Without fsdp-train's packages the configure step fails: then again without it, so that
    # every other stage still runs, and the summary says so.
    OUT="" FSDP_GPU_CONFIGURE_ONLY=1 FSDP_GPU_APPS_EXCLUDE="fsdp-ckpt" bash "$ROOT/scripts/gpu-check.sh" run || {
      echo "error: configure with fsdp-train failed (its Debian packages carried? see .gpu-debs); again without it"
      rm -f "$BUILD/CMakeCache.txt"
      OUT="" FSDP_GPU_CONFIGURE_ONLY=1 FSDP_GPU_APPS_EXCLUDE="fsdp-train;fsdp-ckpt" bash "$ROOT/scripts/gpu-check.sh" run ||
        return 1
      targets=(fsdp fsdprun fsdp-bench-ours fsdp-bench-pp)  # fsdp-plan plans through fsdp-train's model seam
      rc=1
    }
  fi
  # The device and comm test executables: every target under tests/device and tests/comm.
  local test_targets
  test_targets="$(ninja -C "$BUILD" -t targets all 2>/dev/null |
    sed -nE 's#^(tests/(device|comm)/[A-Za-z0-9_]+): CXX_EXECUTABLE_LINKER.*#\1#p' | sort -u | tr '\n' ' ')"
  # -k 0: a unit that does not compile must not hide what the others would show.
  # shellcheck disable=SC2086
  ninja -C "$BUILD" -k 0 -j "${FSDP_BUILD_JOBS:-$(nproc)}" "${targets[@]}" $test_targets > "$STAGE_DIR/build.log" 2>&1 || {
    rc=1
    grep -m 20 -E "error|FAILED" "$STAGE_DIR/build.log"
  }
  report figures --stage build --set mode=built --set "build_dir=$BUILD" --set "targets=${targets[*]} $test_targets" \
    --set "seconds=$((SECONDS - t0))" --set "jobs=${FSDP_BUILD_JOBS:-$(nproc)}"
  return "$rc"
}

stage_tests() {
  local rc=0
  # The device tests skip themselves without CUDA (reported as skipped, never as passed), so the dry run runs
  # the same ctest command. One at a time: their ranks share the one GPU, and the overlap test measures timing.
  (cd "$BUILD" && ctest -L device --timeout 120 --output-on-failure) > "$STAGE_DIR/device.log" 2>&1 || rc=1
  (cd "$BUILD" && ctest -R '^comm_' -j "$JOBS" --timeout 120 --output-on-failure) > "$STAGE_DIR/comm.log" 2>&1 || rc=1
  report ctest --stage tests --log "device=$STAGE_DIR/device.log" --log "comm=$STAGE_DIR/comm.log"
  [ "$rc" = 0 ] || grep -hE "\(Failed\)|\(Timeout\)|Error|error:" "$STAGE_DIR/device.log" "$STAGE_DIR/comm.log" | head -8
  return "$rc"
}

# fsdp-train's flags common to both runs of stage train: a byte-level text corpus made of this repository's docs
# (no dataset download, no dependency on the machine's /usr/share), bf16 compute (TorchTitan's
# mixed_precision_param), no validation, every step logged.
train_flags() {  # flavor local_batch seq steps dump_folder
  local peak=()
  [ -n "$PEAK_TFLOPS" ] && peak=(--metrics.peak_tflops "$PEAK_TFLOPS")
  echo --model.flavor "$1" --training.local_batch_size "$2" --training.global_batch_size -1 \
    --training.seq_len "$3" --training.steps "$4" --job.dump_folder "$5" \
    --training.mixed_precision_param bfloat16 --training.dataset text --training.dataset_path "$WORK/corpus.txt" \
    --validation.enable false --metrics.log_freq 1 --lr_scheduler.warmup_steps 1 "${peak[@]}"
}

# The figures of a stage from what its commands left (also after the stage was killed on overrun: the driver
# then calls report_<stage> alone, bash "$SELF" --report NAME).
report_train() {  # w1 | w2 (both when none is given)
  local rc=0 run runs=("$@")
  [ $# -gt 0 ] || runs=(w1 w2)
  for run in "${runs[@]}"; do
    [ -f "$STAGE_DIR/$run.log" ] || continue
    if [ "$run" = w1 ]; then
      report train --stage train --run w1 --log "$STAGE_DIR/w1.log" --metrics "$STAGE_DIR/w1/metrics.jsonl" \
        --set "flavor=$TRAIN_FLAVOR" --set "local_batch=$TRAIN_LB" --set "seq=$TRAIN_SEQ" \
        --set "device=$DEVICE" || rc=1
    else
      report train --stage train --run w2 --log "$STAGE_DIR/w2.log" --metrics "$STAGE_DIR/w2/metrics.jsonl" \
        --set "flavor=$TRAIN2_FLAVOR" --set "local_batch=$TRAIN2_LB" --set "seq=$TRAIN_SEQ" \
        --set "device=$([ "$DEVICE" = cuda ] && echo cuda:0 || echo cpu)" \
        --set "backend=$(cat "$STAGE_DIR/w2.backend" 2>/dev/null || echo '?')" || rc=1
    fi
  done
  return "$rc"
}

stage_train() {
  local rc=0 train="$BUILD/apps/fsdp-train/fsdp-train" dev1="$DEVICE" dev2="$DEVICE" extra=()
  [ -x "$train" ] || { echo "error: no $train (stage build)"; return 1; }
  cat "$ROOT"/docs/*.md "$ROOT"/README.md > "$WORK/corpus.txt"
  # On the CPU the trainer's counting allocator gives the live-tensor peak that stage plan compares with; on CUDA
  # the caching allocator's figures in the log line are that peak.
  [ "$DEVICE" = cpu ] && extra=(--metrics.tensor_memory true)
  # World 1: NCCL on CUDA (the trainer's default backend there), Gloo on the CPU.
  # shellcheck disable=SC2046
  # fsdprun's own bounds split the stage's budget (60 % / 30 %), so a slow world-1 run leaves time for the other.
  fsdprun --nproc-per-node 1 --timeout "$((BUDGET_TRAIN * 6 / 10))" "$train" \
    $(train_flags "$TRAIN_FLAVOR" "$TRAIN_LB" "$TRAIN_SEQ" "$TRAIN_STEPS" "$STAGE_DIR/w1") \
    --training.device "$dev1" "${extra[@]}" > "$STAGE_DIR/w1.log" 2>&1 || rc=1
  report_train w1 || rc=1
  # Two ranks sharing the one GPU: Gloo on CUDA tensors (NCCL refuses two ranks on one device).
  local backend_note="comm.backend gloo"
  if [ "$DEVICE" = cuda ]; then
    dev2="cuda:0"
    if "$train" --print-config --comm.backend gloo > /dev/null 2>&1; then
      extra=(--comm.backend gloo)
    else
      extra=()
      backend_note="fsdp-train has no comm.backend key: its default backend for 2 ranks on cuda:0"
    fi
  else
    extra=()
    backend_note="Gloo (the CPU's only backend)"
  fi
  # shellcheck disable=SC2046
  fsdprun --nproc-per-node 2 --timeout "$((BUDGET_TRAIN * 3 / 10))" "$train" \
    $(train_flags "$TRAIN2_FLAVOR" "$TRAIN2_LB" "$TRAIN_SEQ" "$TRAIN_STEPS" "$STAGE_DIR/w2") \
    --training.device "$dev2" "${extra[@]}" > "$STAGE_DIR/w2.log" 2>&1 || rc=1
  echo "$backend_note" > "$STAGE_DIR/w2.backend"
  report_train w2 || rc=1
  [ "$rc" = 0 ] || grep -hm 6 -E "error|Error|refused|unknown key" "$STAGE_DIR/w1.log" "$STAGE_DIR/w2.log"
  return "$rc"
}

# bench/vs_pytorch/run.py, both sides in one run: ours (fully_shard under fsdprun), FSDP2 (torchrun), plain
# training (`single`), same weights and batches.
compare() {  # name flavor world global_batch steps warmup [extra run.py flags...]
  local name=$1 flavor=$2 world=$3 gb=$4 steps=$5 warmup=$6
  shift 6
  local peak=()
  [ -n "$PEAK_TFLOPS" ] && peak=(--peak-tflops "$PEAK_TFLOPS")
  OMP_NUM_THREADS="$THREADS" "$PY" "$ROOT/bench/vs_pytorch/run.py" --build-dir "$BUILD" --device "$DEVICE" \
    --mp bf16 --flavor "$flavor" --world-sizes "$world" --global-batch "$gb" --seq "$CMP_SEQ" --steps "$steps" \
    --warmup "$warmup" --threads "$THREADS" --timeout "$CMP_TIMEOUT" --work-dir "$STAGE_DIR/$name" \
    --markdown "$STAGE_DIR/$name.md" "${peak[@]}" "$@" > "$STAGE_DIR/$name.log" 2>&1
}

report_compare_w1() {
  report compare --stage compare_w1 --run "debugmodel=$STAGE_DIR/debugmodel" --run "big=$STAGE_DIR/big" \
    --set "big_flavor=$CMP_BIG_FLAVOR (tied embeddings)" --set "seq=$CMP_SEQ"
}

stage_compare_w1() {
  local rc=0
  compare debugmodel debugmodel 1 "$CMP_GB" "$CMP_STEPS" "$CMP_WARMUP" || rc=1
  # The GPU-sized model: Llama 3.2 1B's shapes, tied embeddings (FSDP2 shards the shared weight in its root group).
  compare big "$CMP_BIG_FLAVOR" 1 "$CMP_BIG_GB" "$CMP_STEPS" "$CMP_WARMUP" --tie-embeddings || rc=1
  report_compare_w1 || rc=1
  [ "$rc" = 0 ] || grep -hm 6 -E "FAILED|Error|error" "$STAGE_DIR"/*.log
  return "$rc"
}

report_compare_w2() {
  report compare --stage compare_w2 --run "debugmodel_w2=$STAGE_DIR/debugmodel_w2" --set "seq=$CMP_SEQ" \
    --set "rtol=1e-4" --rtol 1e-4
}

stage_compare_w2() {
  local rc=0
  # Loss parity with FSDP2 at bf16: 1e-4 relative, every step (run.py exits 1 beyond it, the report stays).
  compare debugmodel_w2 debugmodel 2 "$CMP_GB" "$CMP_STEPS" "$CMP_WARMUP" --check-rtol 1e-4 --no-roofline || rc=1
  report_compare_w2 || rc=1
  [ "$rc" = 0 ] || grep -hm 6 -E "FAIL|Error|error" "$STAGE_DIR"/*.log
  return "$rc"
}

report_pipeline() {  # run.py writes its summary.json after every schedule: a killed run keeps the finished ones
  report pipeline --stage pipeline --summary "$STAGE_DIR/runs/summary.json" --set "microbatches=8" --set "pp=4"
}

stage_pipeline() {
  # The machine's quiet cores, no GPU (fsdp-bench-pp would take NCCL and cuda:1..3 on a CUDA build): Gloo, 4
  # stages x 8 microbatches, every schedule; a torch-side failure leaves our row (bench/pipeline/run.py says why).
  local rc=0
  CUDA_VISIBLE_DEVICES="" "$PY" "$ROOT/bench/pipeline/run.py" --build-dir "$BUILD" --layouts 4x1 --microbatches 8 \
    --dim "$PP_DIM" --layers 8 --global-batch "$PP_GB" --steps "$PP_STEPS" --warmup "$PP_WARMUP" \
    --timeout "$PP_TIMEOUT" --work-dir "$STAGE_DIR/runs" --markdown "$STAGE_DIR/pipeline.md" \
    > "$STAGE_DIR/pipeline.log" 2>&1 || rc=1
  report_pipeline || rc=1
  [ "$rc" = 0 ] || grep -m 6 -E "FAIL|Error|error" "$STAGE_DIR/pipeline.log"
  return "$rc"
}

stage_plan() {
  local plan="$BUILD/apps/fsdp-plan/fsdp-plan"
  [ -x "$plan" ] || { echo "error: no $plan (stage build)"; return 1; }
  # fsdp-train's run of stage train, world 1: shard 1, fp32 params / bf16 compute / fp32 reduce, AdamW fp32,
  # its byte-level vocabulary (258), the last block kept unsharded (reshard "default"), the loss on fp32 logits.
  "$plan" --flavor "$TRAIN_FLAVOR" --shard 1 --param-dtype fp32 --compute-dtype bf16 --reduce-dtype fp32 \
    --local-batch "$TRAIN_LB" --seq "$TRAIN_SEQ" --vocab 258 --keep-last-block --loss-upcast \
    > "$STAGE_DIR/plan.txt" 2>&1 || { cat "$STAGE_DIR/plan.txt"; return 1; }
  report plan --stage plan --plan "$STAGE_DIR/plan.txt" --train "$WORK/train/figures.json" --device "$DEVICE"
}

if [ "${1:-}" = --stage ]; then
  "stage_$2"
  exit $?
fi
if [ "${1:-}" = --report ]; then
  if declare -F "report_$2" > /dev/null; then "report_$2"; fi
  exit $?
fi

# ---------------------------------------------------------------------------------------------------------------
# The driver.
# ---------------------------------------------------------------------------------------------------------------
DRY=0 PREBUILT="${FSDP_GPU_CHECK_BUILD_DIR:-}" ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stages) ONLY=",${2:?--stages needs a list, e.g. build,compare_w1},"; shift ;;
    --build-dir) PREBUILT="$(cd "${2:?--build-dir needs a folder}" && pwd)" || exit 2; shift ;;
    *) echo "gpu-check all: unknown argument '$1' (expected --dry-run, --build-dir DIR, --stages LIST)" >&2; exit 2 ;;
  esac
  shift
done

if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  PY="${FSDP_GPU_PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}"
  BUILD="${PREBUILT:-$ROOT/build}"
  # Tiny sizes, 2 steps: minutes on 2 shared cores. The "GPU-sized" slot takes cpu_small, tied like 1B.
  TRAIN_FLAVOR=cpu_small TRAIN_LB=2 TRAIN2_FLAVOR=cpu_tiny TRAIN2_LB=1 TRAIN_SEQ=64 TRAIN_STEPS=2
  CMP_SEQ=64 CMP_GB=2 CMP_BIG_FLAVOR=cpu_small CMP_BIG_GB=2 CMP_STEPS=2 CMP_WARMUP=0 CMP_TIMEOUT=240
  PP_DIM=64 PP_GB=32 PP_STEPS=2 PP_WARMUP=0 PP_TIMEOUT=120
  THREADS=1 JOBS=2 PEAK_TFLOPS=""
  # Budgets (s) on a 2-core machine under load (about twice what each stage took alone, docs/gpu-runs/README.md),
  # 1130 s in all with a prebuilt tree (ctest's bound for gpu_check_dry_run: 1200 s); the real run's are below.
  BUDGET_BUILD=$([ -n "$PREBUILT" ] && echo 60 || echo 3600) BUDGET_TESTS=240 BUDGET_TRAIN=120
  BUDGET_COMPARE_W1=200 BUDGET_COMPARE_W2=120 BUDGET_PIPELINE=360 BUDGET_PLAN=30
else
  DEVICE=cuda
  PY="${FSDP_GPU_PYTHON:-python3}"
  BUILD="${PREBUILT:-$ROOT/build-gpu}"
  TRAIN_FLAVOR=1B TRAIN_LB=2 TRAIN2_FLAVOR=debugmodel TRAIN2_LB=2 TRAIN_SEQ=2048 TRAIN_STEPS=6
  CMP_SEQ=2048 CMP_GB=4 CMP_BIG_FLAVOR=1B CMP_BIG_GB=2 CMP_STEPS=10 CMP_WARMUP=3 CMP_TIMEOUT=150
  PP_DIM=256 PP_GB=256 PP_STEPS=4 PP_WARMUP=1 PP_TIMEOUT=40
  THREADS=4 JOBS=8
  # MFU's denominator: the GPU's dense bf16 peak (H100/H200 SXM: 989.4 TFLOP/s, TorchTitan's figure); another
  # GPU: measured by a matmul (fsdp-train and run.py each measure when none is given).
  PEAK_TFLOPS="${FSDP_GPU_PEAK_TFLOPS:-}"
  if [ -z "$PEAK_TFLOPS" ] && nvidia-smi -L 2>/dev/null | grep -qE "H100|H200"; then PEAK_TFLOPS=989.4; fi
  # 8 minutes in all on 16 cores: build 139 s measured for library+benchmarks+device/comm tests (issue 36); the
  # tests' 20 s measured then, plus ~10 s for the ring attention on CUDA (issue 38, not yet run on a GPU).
  BUDGET_BUILD=190 BUDGET_TESTS=45 BUDGET_TRAIN=55 BUDGET_COMPARE_W1=110 BUDGET_COMPARE_W2=35 BUDGET_PIPELINE=50
  BUDGET_PLAN=5
fi
# FSDP_GPU_BUDGET_<STAGE>=seconds overrides one stage's budget (e.g. a rerun of one stage on a warm machine).
for stage in BUILD TESTS TRAIN COMPARE_W1 COMPARE_W2 PIPELINE PLAN; do
  override="FSDP_GPU_BUDGET_$stage"
  [ -z "${!override:-}" ] || printf -v "BUDGET_$stage" '%s' "${!override}"
done
OUTDIR="${OUT:-$BUILD/gpu-check}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
export ROOT SELF DRY PREBUILT DEVICE PY BUILD WORK TRAIN_FLAVOR TRAIN_LB TRAIN2_FLAVOR TRAIN2_LB TRAIN_SEQ TRAIN_STEPS \
  CMP_SEQ CMP_GB CMP_BIG_FLAVOR CMP_BIG_GB CMP_STEPS CMP_WARMUP CMP_TIMEOUT PP_DIM PP_GB PP_STEPS PP_WARMUP \
  PP_TIMEOUT THREADS JOBS PEAK_TFLOPS BUDGET_TRAIN
mkdir -p "$OUTDIR" || { echo "gpu-check all: cannot create $OUTDIR" >&2; exit 2; }
command -v "$PY" > /dev/null || { echo "gpu-check all: no python '$PY' (set FSDP_GPU_PYTHON)" >&2; exit 2; }
log "$([ "$DRY" = 1 ] && echo "DRY RUN on the CPU" || echo "device cuda"), build $BUILD, python $PY, work $WORK, output $OUTDIR"

T_START=$SECONDS
run_stage() {  # name budget_s
  local name=$1 budget=$2 dir="$WORK/$1" t0=$SECONDS rc=0 status
  mkdir -p "$dir"
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then
    log "stage $name: skipped (--stages)"
    "$PY" "$ROOT/scripts/gpu_check_report.py" stage --work "$WORK" --stage "$name" --status skipped --rc 0 \
      --seconds 0 --budget "$budget" --log /dev/null
    return
  fi
  log "stage $name (budget ${budget}s) ..."
  STAGE_DIR="$dir" timeout --kill-after=10 "$budget" bash "$SELF" --stage "$name" > "$dir/stage.log" 2>&1 || rc=$?
  case "$rc" in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  log "stage $name: $status in $((SECONDS - t0)) s"
  # Killed on overrun: the figures of whatever finished before (a stage that failed has recorded them itself).
  [ "$status" != timeout ] || STAGE_DIR="$dir" timeout 30 bash "$SELF" --report "$name" >> "$dir/stage.log" 2>&1 || true
  "$PY" "$ROOT/scripts/gpu_check_report.py" stage --work "$WORK" --stage "$name" --status "$status" --rc "$rc" \
    --seconds "$((SECONDS - t0))" --budget "$budget" --log "$dir/stage.log" || log "could not record stage $name"
}

run_stage build "$BUDGET_BUILD"
run_stage tests "$BUDGET_TESTS"
run_stage train "$BUDGET_TRAIN"
run_stage compare_w1 "$BUDGET_COMPARE_W1"
run_stage compare_w2 "$BUDGET_COMPARE_W2"
run_stage pipeline "$BUDGET_PIPELINE"
run_stage plan "$BUDGET_PLAN"

machine="$(nproc) cores, Linux $(uname -r)$(nvidia-smi -L 2>/dev/null | head -1 | sed 's/^/, /'), $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
"$PY" "$ROOT/scripts/gpu_check_report.py" summary --work "$WORK" --out "$OUTDIR" --dry-run "$DRY" \
  --device "$DEVICE" --wall "$((SECONDS - T_START))" --machine "$machine" \
  --commit "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')" ||
  log "could not write the summary (the stage logs are in $WORK)"
# Every log and result file, compressed: the third and last file that comes back.
tar -czf "$OUTDIR/logs.tar.gz" -C "$WORK" --exclude='*.safetensors' --exclude='*.bin' --exclude='corpus.txt' \
  --exclude='*.pt' . 2>/dev/null || log "could not pack the logs"
rm -rf "$WORK"
log "summary: $OUTDIR/summary.md ($((SECONDS - T_START)) s)"
# The exit status: every stage ok with every figure (the dry run's ctest, gpu_check_dry_run, relies on it).
"$PY" "$ROOT/scripts/gpu_check_report.py" check "$OUTDIR/summary.json"
