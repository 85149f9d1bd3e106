#!/usr/bin/env bash
# run_fuzzer.sh <fuzzer> <seed corpus dir> <work dir> <seconds> [libFuzzer flags...]
# Runs one libFuzzer target for a bounded time over a scratch copy of its seed corpus (the committed seeds are never
# modified), then prints one summary line. Exit status: libFuzzer's (non-zero on a crash, sanitizer report, leak,
# out-of-memory or a single input running over -timeout); the reproducer is left in the work dir.
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3 seconds=$4
shift 4
rm -rf "$work" && mkdir -p "$work/corpus" "$work/artifacts"
cp -r "$seeds"/. "$work/corpus/"
log="$work/fuzz.log"
set +e
# -timeout: one input taking > 10 s is a hang; -rss_limit_mb: libtorch alone maps a lot under ASan.
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$work/artifacts/" "$@" "$work/corpus" >"$log" 2>&1
rc=$?
set -e
runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || echo "?")
cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 || true)
echo "fuzz $(basename "$fuzzer"): ${seconds}s, ${runs} executions, $(ls "$seeds" | wc -l) seeds -> $(ls "$work/corpus" | wc -l) corpus files, ${cov:-cov: ?}, exit $rc"
if [ $rc -ne 0 ]; then
  tail -n 60 "$log"
  echo "reproducer(s): $(ls "$work/artifacts")"
fi
exit $rc
