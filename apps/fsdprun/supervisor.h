// Runs one attempt of the job: start every rank, pump their output, and stop the whole group when one rank
// fails, the launcher is signalled, or the job's deadline passes.
#pragma once

#include <chrono>
#include <optional>

#include "options.h"
#include "signals.h"

namespace fsdprun {

using Clock = std::chrono::steady_clock;

enum class AttemptOutcome {
  kSucceeded,    // every rank exited 0
  kRankFailed,   // a rank exited non-zero or died by a signal (restartable)
  kExecFailed,   // the program could not be executed (not restarted: it would fail the same way)
  kTimedOut,     // the job's deadline passed
  kInterrupted,  // fsdprun got SIGINT/SIGTERM/SIGHUP
};

struct AttemptResult {
  AttemptOutcome outcome;
  int exit_code;  // what fsdprun returns if this attempt is the last one
};

struct AttemptConfig {
  const LaunchOptions& opts;
  int restart_count;  // TORCHELASTIC_RESTART_COUNT of this attempt
  int master_port;
  bool launcher_serves_store;  // the store at master_port is fsdprun's (standalone), not rank 0's
  std::optional<Clock::time_point> deadline;  // from --timeout, shared by all attempts
};

// Returns once every rank has been reaped, their output drained, and no process of theirs is left (or a short
// grace for escaped ones has passed). Reports the first failure on stderr.
AttemptResult run_attempt(const AttemptConfig& config, SignalPipe& signals);

}  // namespace fsdprun
