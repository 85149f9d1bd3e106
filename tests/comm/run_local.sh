#!/usr/bin/env bash
# Runs an executable as N local ranks with torchrun's variables (a stand-in for fsdprun during development):
#   tests/comm/run_local.sh <nproc> <timeout-seconds> <exe> [args...]
# Every rank is bounded by `timeout`; if one fails the others are killed; exit status is the first failure.
set -uo pipefail
n="$1"; t="$2"; shift 2
port=$(( 20000 + RANDOM % 20000 ))
pids=()
for ((r = 0; r < n; r++)); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout -k 5 "$t" "$@" > >(sed "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid"; rc=$?
  if [ $rc -ne 0 ]; then
    [ $status -eq 0 ] && status=$rc
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  fi
done
exit $status
