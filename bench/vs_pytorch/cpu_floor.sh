#!/usr/bin/env bash
# CPU accounting of one world size: the CPU time per step of our fully_shard training and of the same per-rank
# work without FSDP (W concurrent single processes), from the rusage of the whole launch (all ranks, all threads).
# Two runs of each, of S1 and S2 steps; their difference removes start-up and initialisation. With W ranks on C
# cores the wall time per step is at least (CPU per step of all ranks) / C, so this gives the floor of our step
# and of a zero-overhead FSDP (the plain copies) on this machine (a floor: all cores busy, none idle).
#
# Usage: bench/vs_pytorch/cpu_floor.sh WORK_DIR W [BUILD_DIR] [GLOBAL_BATCH] [SEQ] [S1] [S2]
#   WORK_DIR: a kept `run.py --work-dir` (its init.safetensors and tokens.bin are reused)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${1:?usage: cpu_floor.sh WORK_DIR W [BUILD_DIR] [GLOBAL_BATCH] [SEQ] [S1] [S2]}"
W="${2:?world size}"
BUILD="${3:-$ROOT/build}"
GB="${4:-8}"
SEQ="${5:-128}"
S1="${6:-8}"
S2="${7:-28}"
for f in "$WORK/init.safetensors" "$WORK/tokens.bin"; do
  [[ -f "$f" ]] || { echo "cpu_floor.sh: $f missing: run bench/vs_pytorch/run.py --work-dir $WORK first" >&2; exit 2; }
done
(( GB % W == 0 )) || { echo "cpu_floor.sh: global batch $GB is not divisible by $W" >&2; exit 2; }
(( S2 > S1 )) || { echo "cpu_floor.sh: S2 ($S2) must exceed S1 ($S1)" >&2; exit 2; }
export OMP_NUM_THREADS=1
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
declare -A wall user sys
for s in "$S1" "$S2"; do
  for mode in train single; do
    mkdir -p "$OUT/$mode$s"
    /usr/bin/time -o "$OUT/$mode$s.time" -f "%e %U %S" "$BUILD/apps/fsdprun/fsdprun" --nproc-per-node "$W" \
      "$BUILD/bench/fsdp-bench-ours" "$mode" --weights "$WORK/init.safetensors" --tokens "$WORK/tokens.bin" \
      --steps "$s" --local-batch $((GB / W)) --seq "$SEQ" --out-dir "$OUT/$mode$s" --lr 0.0008 --weight-decay 0.1 \
      > "$OUT/$mode$s.log" 2>&1 || { cat "$OUT/$mode$s.log" >&2; exit 1; }
    read -r wall["$mode$s"] user["$mode$s"] sys["$mode$s"] < "$OUT/$mode$s.time"
  done
done
CORES="$(getconf _NPROCESSORS_ONLN)"  # not nproc: it honours the OMP_NUM_THREADS=1 set above
python3 - "$W" "$CORES" "$S1" "$S2" "${wall[train$S1]}" "${user[train$S1]}" "${sys[train$S1]}" \
  "${wall[train$S2]}" "${user[train$S2]}" "${sys[train$S2]}" "${wall[single$S1]}" "${user[single$S1]}" \
  "${sys[single$S1]}" "${wall[single$S2]}" "${user[single$S2]}" "${sys[single$S2]}" <<'EOF'
import sys
W, cores, s1, s2 = (int(x) for x in sys.argv[1:5])
v = [float(x) for x in sys.argv[5:]]
n = s2 - s1
def per_step(a, b): return [(b[i] - a[i]) / n * 1000 for i in range(3)]
ours = per_step(v[0:3], v[3:6])
plain = per_step(v[6:9], v[9:12])
print(f"world {W} on {cores} cores, per step (runs of {s2} minus {s1} steps), ms:")
print("| | wall | user CPU (all ranks) | sys CPU (all ranks) | CPU / rank | floor = CPU / cores |")
print("|---|---|---|---|---|---|")
for name, (w, u, s) in (("fully_shard training", ours), (f"{W} plain processes (no FSDP)", plain)):
    print(f"| {name} | {w:.1f} | {u:.1f} | {s:.1f} | {(u + s) / W:.1f} | {(u + s) / cores:.1f} |")
extra = (ours[1] + ours[2]) - (plain[1] + plain[2])
print(f"FSDP's extra CPU per step: {extra:.1f} ms over all ranks ({extra / W:.1f} per rank; "
      f"user {ours[1] - plain[1]:.1f}, sys {ours[2] - plain[2]:.1f})")
EOF
