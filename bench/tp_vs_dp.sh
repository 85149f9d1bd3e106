#!/usr/bin/env bash
# fsdp-train on 4 ranks: FSDP over 4 ranks (dp 4) vs FSDP 2 x tensor parallel 2 (dp 2, tp 2), the same global
# batch, side by side in one run, with fsdp-plan's prediction beside each measurement (bench/layouts_lib.sh):
#   bash bench/tp_vs_dp.sh [extra fsdp-train args]     (FSDP_BENCH_STEPS=30, FSDP_BENCH_ROUNDS=2 by default)
# tokens/s per rank are TorchTitan's: the tp ranks of a data-parallel rank share its tokens.
source "$(dirname "${BASH_SOURCE[0]}")/layouts_lib.sh"
FLAVOR="${FSDP_BENCH_FLAVOR:-cpu_small}"
tp_of() { [ "$1" = dp2_tp2 ] && echo 2 || echo 1; }
train_args() {
  local tp; tp="$(tp_of "$1")"
  echo "--model.flavor $FLAVOR --training.local_batch_size $((GLOBAL * tp / 4)) --parallelism.tensor_parallel_degree $tp"
}
plan_args() {
  local tp; tp="$(tp_of "$1")"
  echo "--flavor $FLAVOR --shard $((4 / tp)) --tp $tp --local-batch $((GLOBAL * tp / 4))"
}
plan_comm() {  # dp / tp totals
  local dp tp
  dp="$(sed -n 's/^  total  *\([0-9.]*\) MiB.*/\1/p' "$2")"
  tp="$(sed -n 's/^  tp total  *\([0-9.]*\) MiB.*/\1/p' "$2")"
  echo "dp $dp / tp ${tp:-0}"
}
compare_layouts dp4 dp2_tp2 -- "$@"
