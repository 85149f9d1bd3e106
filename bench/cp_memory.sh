#!/usr/bin/env bash
# Context parallelism's memory, through fsdp-train itself under fsdprun (issue 38, "Memory"):
#   bash bench/cp_memory.sh [extra fsdp-train args]
# 1. One long sequence (FSDP_BENCH_SEQ=8192 tokens of cpu_tiny, global batch 1, fp32) at cp 1, 2 and 4 (cp ranks =
#    world size), for each rotate method in FSDP_BENCH_METHODS ("alltoall allgather"): this rank's activations
#    (live tensor bytes at the end of forward minus the step's start) and step peak above the start, the maximum over
#    the ranks, at step 2 of 2. The bytes are the trainer's counting CPU allocator's (metrics.tensor_memory,
#    apps/fsdp-train/tensor_memory.h): exact live tensor bytes, no malloc retention, no gloo buffers. Both should be
#    the cp 1 value / cp within 15%.
# 2. A fixed budget (FSDP_BENCH_BUDGET_MIB=64: the step's highest live tensor bytes on the busiest rank, parameters
#    and optimizer states included): the longest sequence that fits, per cp, by doubling from 1024 tokens and then
#    bisecting to FSDP_BENCH_GRAIN=256 tokens (a multiple of 2 cp for every cp here, as head-tail chunks need).
#    The issue asks for >= 3x from cp 1 to cp 4.
# Prints a markdown section for bench/RESULTS.md on stdout; progress on stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
[ -x "$BUILD_DIR/apps/fsdp-train/fsdp-train" ] && [ -x "$BUILD_DIR/apps/fsdprun/fsdprun" ] ||
  FSDP_BUILD_TARGETS="fsdp-train fsdprun" bash "$ROOT/scripts/setup.sh"
SEQ="${FSDP_BENCH_SEQ:-8192}"
METHODS="${FSDP_BENCH_METHODS:-alltoall allgather}"
BUDGET_MIB="${FSDP_BENCH_BUDGET_MIB:-64}"
GRAIN="${FSDP_BENCH_GRAIN:-256}"
FLAVOR="${FSDP_BENCH_FLAVOR:-cpu_tiny}"
TRAIN="$BUILD_DIR/apps/fsdp-train/fsdp-train"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
EXTRA=("$@")

mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }

# measure CP METHOD SEQ: prints "activations peak_above_start peak seconds" (bytes: the maximum over the ranks of
# step 2; seconds: the run's wall time).
measure() {
  local cp="$1" method="$2" seq="$3" dir="$OUT/cp$1-$2-$3" t0 t1
  t0="$(date +%s.%N)"
  # shellcheck disable=SC2046
  "$BUILD_DIR/apps/fsdprun/fsdprun" --nproc-per-node "$cp" --timeout 1200 "$TRAIN" --model.flavor "$FLAVOR" \
    --training.seq_len "$seq" --training.local_batch_size 1 --training.global_batch_size 1 --training.steps 2 \
    --metrics.log_freq 1 --metrics.tensor_memory true --metrics.save_for_all_ranks true --validation.enable false \
    --parallelism.context_parallel_degree "$cp" --parallelism.context_parallel_rotate_method "$method" \
    --job.dump_folder "$dir" ${EXTRA[@]+"${EXTRA[@]}"} > "$dir.log" 2>&1 || { cat "$dir.log" >&2; exit 1; }
  t1="$(date +%s.%N)"
  local act=0 above=0 peak=0 line s fwd p file
  for file in "$dir"/metrics_rank*.jsonl; do
    line="$(grep '"tensor_peak_bytes"' "$file" | tail -1)"
    s="$(echo "$line" | sed -n 's/.*"tensor_start_bytes":\([0-9]*\).*/\1/p')"
    p="$(echo "$line" | sed -n 's/.*"tensor_peak_bytes":\([0-9]*\).*/\1/p')"
    fwd="$(echo "$line" | sed -n 's/.*"tensor_forward_bytes":\([0-9]*\).*/\1/p')"
    [ $((fwd - s)) -gt "$act" ] && act=$((fwd - s))
    [ $((p - s)) -gt "$above" ] && above=$((p - s))
    [ "$p" -gt "$peak" ] && peak="$p"
  done
  echo "$act $above $peak $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')"
  echo "  cp $cp $method seq $seq: activations $(mib "$act") MiB, peak above start $(mib "$above") MiB," \
       "peak $(mib "$peak") MiB" >&2
}

budget=$((BUDGET_MIB * 1048576))
fits() { local m; m="$(measure "$1" "$2" "$3")"; [ "$(echo "$m" | cut -d' ' -f3)" -le "$budget" ]; }
# longest CP METHOD: the longest multiple of GRAIN whose step peak fits the budget.
longest() {
  local cp="$1" method="$2" lo=0 hi=1024
  while fits "$cp" "$method" "$hi"; do lo="$hi"; hi=$((hi * 2)); done
  while [ $((hi - lo)) -gt "$GRAIN" ]; do
    local mid=$(((lo + hi) / 2 / GRAIN * GRAIN))
    if fits "$cp" "$method" "$mid"; then lo="$mid"; else hi="$mid"; fi
  done
  echo "$lo"
}

echo "### One sequence of $SEQ tokens per step, per rank (fsdp-train $FLAVOR, fp32, step 2 of 2, max over ranks)"
echo
echo "| rotate method | cp | tokens per rank | activations (MiB) | / cp 1 | (ideal) | step peak above start (MiB) | / cp 1 | wall time of the run (s) |"
echo "|---|---|---|---|---|---|---|---|---|"
declare -A base_act base_above
for method in $METHODS; do
  for cp in 1 2 4; do
    read -r act above _ secs <<< "$(measure "$cp" "$method" "$SEQ")"
    [ "$cp" = 1 ] && { base_act[$method]="$act"; base_above[$method]="$above"; }
    printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n" "$method" "$cp" "$((SEQ / cp))" "$(mib "$act")" \
      "$(ratio "$act" "${base_act[$method]}")" "$(ratio 1 "$cp")" "$(mib "$above")" \
      "$(ratio "$above" "${base_above[$method]}")" "$secs"
  done
done
echo
echo "### The longest sequence whose step peak fits $BUDGET_MIB MiB per rank (live tensor bytes, all included)"
echo
echo "| rotate method | cp 1 | cp 2 | cp 4 | cp 4 / cp 1 |"
echo "|---|---|---|---|---|"
l1="$(longest 1 alltoall)"  # one rank: no rotation
for method in $METHODS; do
  l2="$(longest 2 "$method")"
  l4="$(longest 4 "$method")"
  printf "| %s | %s | %s | %s | %s |\n" "$method" "$l1" "$l2" "$l4" "$(ratio "$l4" "$l1")"
done
