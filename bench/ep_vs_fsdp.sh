#!/usr/bin/env bash
# fsdp-train on 4 ranks, an MoE model (qwen3 cpu_small_moe: 4 MoE layers of 8 experts, top-2): FSDP over 4 ranks
# (no EP) vs expert parallelism 2 inside the shard group (experts split over 2 ranks, their FSDP over the 2
# left), the same global batch, side by side in one run, with fsdp-plan's prediction beside each measurement
# (bench/layouts_lib.sh):
#   bash bench/ep_vs_fsdp.sh [extra fsdp-train args]     (FSDP_BENCH_STEPS=30, FSDP_BENCH_ROUNDS=2 by default)
source "$(dirname "${BASH_SOURCE[0]}")/layouts_lib.sh"
FLAVOR="${FSDP_BENCH_FLAVOR:-cpu_small_moe}"
ep_of() { echo "${1#ep}"; }
train_args() {
  echo "--model.name qwen3 --model.flavor $FLAVOR --training.local_batch_size $((GLOBAL / 4)) --parallelism.expert_parallel_degree $(ep_of "$1")"
}
plan_args() { echo "--model qwen3 --flavor $FLAVOR --shard 4 --ep $(ep_of "$1") --local-batch $((GLOBAL / 4))"; }
plan_comm() {  # FSDP totals / the ep all-to-all
  local dp ep
  dp="$(sed -n 's/^  total  *\([0-9.]*\) MiB.*/\1/p' "$2")"
  ep="$(sed -n 's/^  ep all-to-all  *\([0-9.]*\) MiB.*/\1/p' "$2")"
  echo "FSDP $dp / ep all-to-all ${ep:-0}"
}
compare_layouts ep1 ep2 -- "$@"
