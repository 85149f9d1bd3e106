#!/usr/bin/env bash
# fsdp-train throughput of the default job on 1 and 2 ranks: tokens/s per rank and MFU (TorchTitan's FLOPs per
# token against the per-rank fp32 matmul peak measured at startup), averaged after the first log window.
#   bash bench/train_throughput.sh [extra fsdp-train args]     (FSDP_BENCH_STEPS=60 by default)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
STEPS="${FSDP_BENCH_STEPS:-60}"
TRAIN="$BUILD_DIR/apps/fsdp-train/fsdp-train"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
printf "%-6s %-60s %12s %12s %8s %10s\n" ranks parallelism "tok/s/rank" "tok/s total" "MFU %" "loss"
for n in 1 2; do
  log="$OUT/np$n.log"
  "$BUILD_DIR/apps/fsdprun/fsdprun" --nproc-per-node "$n" "$TRAIN" --training.steps "$STEPS" \
    --metrics.log_freq 10 --job.dump_folder "$OUT/np$n" "$@" > "$log" 2>&1 || { cat "$log"; exit 1; }
  plan="$(sed -n 's/.*  ranks     [0-9]* ([^)]*); \(.*\)$/\1/p' "$log" | cut -c1-60)"
  tps="$(sed -n 's/.*throughput: *\([0-9.]*\) tokens\/s per rank, MFU \([0-9.]*\)%.*/\1/p' "$log")"
  mfu="$(sed -n 's/.*throughput: *\([0-9.]*\) tokens\/s per rank, MFU \([0-9.]*\)%.*/\2/p' "$log")"
  loss="$(sed -n 's/.*final loss: *\([0-9.]*\) nats.*/\1/p' "$log")"
  printf "%-6s %-60s %12s %12.0f %8s %10s\n" "$n" "${plan:0:60}" "$tps" "$(awk -v t="$tps" -v n="$n" 'BEGIN { print t * n }')" "$mfu" "$loss"
done
