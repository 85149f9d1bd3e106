#!/usr/bin/env bash
# fsdp-train on 4 ranks: FSDP over 4 ranks (dp 4) vs FSDP 2 x tensor parallel 2 (dp 2, tp 2), the same global
# batch, side by side in one run, with fsdp-plan's prediction beside each measurement:
#   tokens/s per rank (TorchTitan's: the tp ranks of a data-parallel rank share its tokens), measured live tensor
#   bytes at the step start and the step peak above it (metrics.tensor_memory: a counting allocator around
#   libtorch's CPU allocator), and the planner's bytes per step per mesh dim.
#   bash bench/tp_vs_dp.sh [extra fsdp-train args]     (FSDP_BENCH_STEPS=30, FSDP_BENCH_ROUNDS=2 by default)
# The two layouts alternate FSDP_BENCH_ROUNDS times (the machine is noisy); the best tokens/s of each is kept.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
[ -x "$BUILD_DIR/apps/fsdp-train/fsdp-train" ] || bash "$ROOT/scripts/setup.sh"
STEPS="${FSDP_BENCH_STEPS:-30}"
ROUNDS="${FSDP_BENCH_ROUNDS:-2}"
FLAVOR="${FSDP_BENCH_FLAVOR:-cpu_small}"
SEQ="${FSDP_BENCH_SEQ:-128}"
GLOBAL="${FSDP_BENCH_GLOBAL_BATCH:-16}"
TRAIN="$BUILD_DIR/apps/fsdp-train/fsdp-train"
PLAN="$BUILD_DIR/apps/fsdp-plan/fsdp-plan"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
# planned <label> from fsdp-plan's text: "params (sharded)" + "optimizer states" (the step start), and
# "peak above them" (the step peak above the start).
plan_field() { sed -n "s/.*$1 *\([0-9.]*\) MiB.*/\1/p" "$2" | head -1; }

declare -A best_tps
for round in $(seq 1 "$ROUNDS"); do
  for layout in dp4 dp2_tp2; do
    tp=1; [ "$layout" = dp2_tp2 ] && tp=2
    dir="$OUT/$layout-$round"
    "$BUILD_DIR/apps/fsdprun/fsdprun" --nproc-per-node 4 --timeout 900 "$TRAIN" --model.flavor "$FLAVOR" \
      --training.seq_len "$SEQ" --training.global_batch_size "$GLOBAL" --training.local_batch_size $((GLOBAL * tp / 4)) \
      --training.steps "$STEPS" --metrics.log_freq 5 --metrics.tensor_memory true --validation.enable false \
      --parallelism.tensor_parallel_degree "$tp" --job.dump_folder "$dir" "$@" > "$dir.log" 2>&1 ||
      { cat "$dir.log"; exit 1; }
    tps="$(sed -n 's/.*throughput: *\([0-9.]*\) tokens\/s per rank.*/\1/p' "$dir.log")"
    prev="${best_tps[$layout]:-0}"
    best_tps[$layout]="$(awk -v a="$tps" -v b="$prev" 'BEGIN { print (a > b ? a : b) }')"
    echo "round $round $layout: $tps tokens/s per rank" >&2
    cp "$dir/metrics.jsonl" "$OUT/$layout.jsonl"
    cp "$dir.log" "$OUT/$layout.log"
  done
done

printf "| layout | tokens/s per rank (best of %s) | tokens/s total | step start measured / planned (MiB) | step peak above start measured / planned (MiB) | planned comm per step: dp / tp (MiB) | final loss |\n" "$ROUNDS"
echo "|---|---|---|---|---|---|---|"
for layout in dp4 dp2_tp2; do
  tp=1; shard=4; [ "$layout" = dp2_tp2 ] && { tp=2; shard=2; }
  "$PLAN" --flavor "$FLAVOR" --shard "$shard" --tp "$tp" --local-batch $((GLOBAL * tp / 4)) --seq "$SEQ" --vocab 258 \
    --keep-last-block --ac none > "$OUT/$layout.plan" 2>&1
  last="$(grep '"tensor_peak_bytes"' "$OUT/$layout.jsonl" | tail -1)"
  start="$(echo "$last" | sed -n 's/.*"tensor_start_bytes":\([0-9]*\).*/\1/p')"
  peak="$(echo "$last" | sed -n 's/.*"tensor_peak_bytes":\([0-9]*\).*/\1/p')"
  p_params="$(plan_field 'params (sharded)' "$OUT/$layout.plan")"
  p_optim="$(plan_field 'optimizer states' "$OUT/$layout.plan")"
  p_start="$(awk -v a="$p_params" -v b="$p_optim" 'BEGIN { printf "%.2f", a + b }')"
  p_peak="$(sed -n 's/.*peak above them: *\([0-9.]*\) MiB.*/\1/p' "$OUT/$layout.plan")"
  p_dp="$(sed -n 's/^  total  *\([0-9.]*\) MiB.*/\1/p' "$OUT/$layout.plan")"
  p_tp="$(sed -n 's/^  tp total  *\([0-9.]*\) MiB.*/\1/p' "$OUT/$layout.plan")"
  loss="$(sed -n 's/.*final loss: *\([0-9.]*\) nats.*/\1/p' "$OUT/$layout.log")"
  tps="${best_tps[$layout]}"
  printf "| %s | %.0f | %.0f | %s / %s | %s / %s | %s / %s | %s |\n" "${layout/_/, }" "$tps" \
    "$(awk -v t="$tps" 'BEGIN { print t * 4 }')" "$(mib "$start")" "$p_start" "$(mib $((peak - start)))" "$p_peak" \
    "$p_dp" "${p_tp:-0}" "$loss"
done
