#!/usr/bin/env bash
# Fault-tolerant training on this machine ([fault_tolerance], docs/trainer.md): fsdp-lighthouse and FSDP_FT_GROUPS
# replica groups (default 2) of FSDP_FT_RANKS ranks each (default 1), each an fsdp-train job of its own under fsdprun
# --max-restarts 3, on the embedded default config. Extra arguments go to every fsdp-train (e.g. --training.steps 50).
#   FSDP_FT_KILL_AFTER=8 bash scripts/train_ft.sh   # SIGKILL replica 1's rank 0 8 s in: watch it restart and heal
# Sets up (apt, venv, build) when needed. Ctrl-C stops every group and the lighthouse. Each group writes under
# <job.dump_folder>/replica_<id>/; the groups' output is in <dump_folder>/replica_<id>.log, replica 0's also here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FSDP_BUILD_TARGETS="fsdp-train fsdprun fsdp-lighthouse" bash "$ROOT/scripts/setup.sh"
BUILD_DIR="${FSDP_BUILD_DIR:-$ROOT/build}"
GROUPS_N="${FSDP_FT_GROUPS:-2}"
RANKS="${FSDP_FT_RANKS:-1}"
TRAIN="$BUILD_DIR/apps/fsdp-train/fsdp-train"
cd "$ROOT"
CONFIG="$("$TRAIN" --print-config "$@")"
DUMP="$(sed -n 's/^dump_folder = "\(.*\)"$/\1/p' <<< "$CONFIG")"
# The global batch is split over every rank of every group (docs/trainer.md, "Data rule"): with more data ranks
# than the config's local batch allows (the default job: 16 = 8 x 2 ranks), each rank takes a smaller local batch
# so that the run trains on the same global batches — unless --training.local_batch_size was given.
training_value() { awk -v key="$1" '/^\[/ { section = $0 } section == "[training]" && $1 == key { print $3 }' <<< "$CONFIG"; }
GLOBAL="$(training_value global_batch_size)"
LOCAL="$(training_value local_batch_size)"
DATA_RANKS=$((GROUPS_N * RANKS))
BATCH=()
if [[ " $* " != *local_batch_size* ]] && [ "${GLOBAL:--1}" -gt 0 ] && [ $((GLOBAL % (DATA_RANKS * LOCAL))) -ne 0 ] &&
   [ $((GLOBAL % DATA_RANKS)) -eq 0 ]; then
  BATCH=(--training.local_batch_size $((GLOBAL / DATA_RANKS)))
  echo "train_ft.sh: global batch $GLOBAL over $DATA_RANKS data ranks: ${BATCH[*]}"
fi
mkdir -p "$DUMP"

pids=()
cleanup() {
  trap - INT TERM EXIT
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'cleanup; exit 130' INT TERM
trap cleanup EXIT

# The coordinator first, on a free port it prints.
"$BUILD_DIR/apps/fsdp-lighthouse/fsdp-lighthouse" --port 0 > "$DUMP/lighthouse.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  ADDR="$(sed -n 's/^fsdp-lighthouse: serving on \(.*\)$/\1/p' "$DUMP/lighthouse.log")"
  [ -n "$ADDR" ] && break
  sleep 0.1
done
[ -n "$ADDR" ] || { echo "train_ft.sh: fsdp-lighthouse did not start (see $DUMP/lighthouse.log)" >&2; exit 1; }
echo "train_ft.sh: fsdp-lighthouse on $ADDR; $GROUPS_N replica groups of $RANKS rank(s)"

for ((r = GROUPS_N - 1; r >= 0; r--)); do
  cmd=("$BUILD_DIR/apps/fsdprun/fsdprun" --nproc-per-node "$RANKS" --max-restarts 3 "$TRAIN"
       --fault_tolerance.enable --fault_tolerance.group_size "$GROUPS_N" --fault_tolerance.replica_id "$r"
       --fault_tolerance.lighthouse "$ADDR" "${BATCH[@]}" "$@")
  if [ "$r" -eq 0 ]; then
    "${cmd[@]}" 2>&1 | tee "$DUMP/replica_0.log" &
  else
    "${cmd[@]}" > "$DUMP/replica_$r.log" 2>&1 &
  fi
  pids+=($!)
done

if [ -n "${FSDP_FT_KILL_AFTER:-}" ] && [ "$GROUPS_N" -gt 1 ]; then
  sleep "$FSDP_FT_KILL_AFTER"
  victim="$(pgrep -f -- "--fault_tolerance.replica_id 1 " | while read -r p; do
              [ "$(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^RANK=//p')" = 0 ] &&
              [ "$(basename "$(readlink "/proc/$p/exe")")" = fsdp-train ] && echo "$p"; done | head -1)"
  if [ -n "$victim" ]; then
    echo "train_ft.sh: SIGKILL replica 1's rank 0 (pid $victim)"
    kill -KILL "$victim"
  fi
fi

status=0
for p in "${pids[@]:1}"; do wait "$p" || status=$?; done
for ((r = 1; r < GROUPS_N; r++)); do
  echo "train_ft.sh: replica $r: $(grep -E 'healed from|final loss' "$DUMP/replica_$r.log" | tr '\n' ' ' | sed 's/\[rank 0\] //g')"
done
exit "$status"
