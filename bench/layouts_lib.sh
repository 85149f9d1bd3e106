# Shared by bench/tp_vs_dp.sh and bench/ep_vs_fsdp.sh (source it): fsdp-train on 4 ranks in several layouts of the
# same global batch, side by side in one run, with fsdp-plan's prediction beside each measurement:
#   tokens/s per rank, measured live tensor bytes at the step start and the step peak above it
#   (metrics.tensor_memory: a counting allocator around libtorch's CPU allocator), and the planner's bytes per
#   step per mesh dim.
# The caller defines train_args LAYOUT (extra fsdp-train arguments), plan_args LAYOUT (fsdp-plan arguments) and
# plan_comm LAYOUT PLANFILE (the planned communication column), then calls compare_layouts LAYOUT... The layouts
# alternate FSDP_BENCH_ROUNDS times (the machine is noisy); the best tokens/s of each is kept.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
[ -x "$BUILD_DIR/apps/fsdp-train/fsdp-train" ] && [ -x "$BUILD_DIR/apps/fsdp-plan/fsdp-plan" ] ||
  FSDP_BUILD_TARGETS="fsdp-train fsdprun fsdp-plan" bash "$ROOT/scripts/setup.sh"
STEPS="${FSDP_BENCH_STEPS:-30}"
ROUNDS="${FSDP_BENCH_ROUNDS:-2}"
SEQ="${FSDP_BENCH_SEQ:-128}"
GLOBAL="${FSDP_BENCH_GLOBAL_BATCH:-16}"
TRAIN="$BUILD_DIR/apps/fsdp-train/fsdp-train"
PLAN="$BUILD_DIR/apps/fsdp-plan/fsdp-plan"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
# A number from fsdp-plan's text: "<label> ... N MiB".
plan_field() { sed -n "s/.*$1 *\([0-9.]*\) MiB.*/\1/p" "$2" | head -1; }

# compare_layouts LAYOUT... [-- extra fsdp-train args]
compare_layouts() {
  local layouts=() extra=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do layouts+=("$1"); shift; done
  [ $# -gt 0 ] && { shift; extra=("$@"); }
  declare -A best_tps
  for round in $(seq 1 "$ROUNDS"); do
    for layout in "${layouts[@]}"; do
      local dir="$OUT/$layout-$round"
      # shellcheck disable=SC2046
      "$BUILD_DIR/apps/fsdprun/fsdprun" --nproc-per-node 4 --timeout 900 "$TRAIN" --training.seq_len "$SEQ" \
        --training.global_batch_size "$GLOBAL" --training.steps "$STEPS" --metrics.log_freq 5 \
        --metrics.tensor_memory true --validation.enable false --job.dump_folder "$dir" $(train_args "$layout") \
        ${extra[@]+"${extra[@]}"} > "$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
      local tps prev
      tps="$(sed -n 's/.*throughput: *\([0-9.]*\) tokens\/s per rank.*/\1/p' "$dir.log")"
      prev="${best_tps[$layout]:-0}"
      best_tps[$layout]="$(awk -v a="$tps" -v b="$prev" 'BEGIN { print (a > b ? a : b) }')"
      echo "round $round $layout: $tps tokens/s per rank" >&2
      cp "$dir/metrics.jsonl" "$OUT/$layout.jsonl"
      cp "$dir.log" "$OUT/$layout.log"
    done
  done
  printf "| layout | tokens/s per rank (best of %s) | tokens/s total | step start measured / planned (MiB) | step peak above start measured / planned (MiB) | planned comm per step (MiB) | final loss |\n" "$ROUNDS"
  echo "|---|---|---|---|---|---|---|"
  for layout in "${layouts[@]}"; do
    # shellcheck disable=SC2046
    "$PLAN" $(plan_args "$layout") --seq "$SEQ" --vocab 258 --keep-last-block --ac none > "$OUT/$layout.plan" 2>&1 ||
      { cat "$OUT/$layout.plan"; exit 1; }
    local last start peak p_params p_optim p_start p_peak loss tps
    last="$(grep '"tensor_peak_bytes"' "$OUT/$layout.jsonl" | tail -1)"
    start="$(echo "$last" | sed -n 's/.*"tensor_start_bytes":\([0-9]*\).*/\1/p')"
    peak="$(echo "$last" | sed -n 's/.*"tensor_peak_bytes":\([0-9]*\).*/\1/p')"
    p_params="$(plan_field 'params (sharded)' "$OUT/$layout.plan")"
    p_optim="$(plan_field 'optimizer states' "$OUT/$layout.plan")"
    p_start="$(awk -v a="$p_params" -v b="$p_optim" 'BEGIN { printf "%.2f", a + b }')"
    p_peak="$(sed -n 's/.*peak above them: *\([0-9.]*\) MiB.*/\1/p' "$OUT/$layout.plan")"
    loss="$(sed -n 's/.*final loss: *\([0-9.]*\) nats.*/\1/p' "$OUT/$layout.log")"
    tps="${best_tps[$layout]}"
    printf "| %s | %.0f | %.0f | %s / %s | %s / %s | %s | %s |\n" "$layout" "$tps" \
      "$(awk -v t="$tps" 'BEGIN { print t * 4 }')" "$(mib "$start")" "$p_start" "$(mib $((peak - start)))" "$p_peak" \
      "$(plan_comm "$layout" "$OUT/$layout.plan")" "$loss"
  done
}
