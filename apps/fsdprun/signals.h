// Signal handling for the launcher: the self-pipe trick, so that the supervisor's poll() loop sees signals as
// readable bytes instead of running logic inside a handler.
#pragma once

#include <signal.h>

#include <vector>

#include "unique_fd.h"

namespace fsdprun {

// Installs handlers for SIGINT, SIGTERM, SIGHUP (to forward them) and SIGCHLD (to wake the loop when a rank
// exits even if a grandchild keeps its pipes open). Each delivered signal becomes one byte in a pipe. Only one
// instance may exist at a time; the destructor restores the previous dispositions.
class SignalPipe {
 public:
  SignalPipe();
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int fd() const { return pipe_.read.get(); }
  // The signals received since the last call, in arrival order (SIGCHLD included).
  std::vector<int> drain();

 private:
  Pipe pipe_;
  struct sigaction old_[4];
};

// Blocks every signal for its lifetime: held across fork() so that the child never runs the launcher's handler
// before it has reset its dispositions.
class BlockAllSignals {
 public:
  BlockAllSignals();
  ~BlockAllSignals();
  BlockAllSignals(const BlockAllSignals&) = delete;
  BlockAllSignals& operator=(const BlockAllSignals&) = delete;

 private:
  sigset_t previous_;
};

// In a freshly forked child (async-signal-safe): default dispositions for the launcher's handled/ignored
// signals and an empty signal mask, so the program starts like it would from a shell.
void reset_signals_in_child();

// "SIGINT", "SIGTERM", ... for messages.
const char* signal_name(int sig);

}  // namespace fsdprun
