#include "signals.h"

#include <cstring>
#include <stdexcept>

namespace fsdprun {
namespace {

constexpr int kHandled[4] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

// The one piece of global mutable state in fsdprun: a signal handler can reach nothing else. It is the write
// end of the self-pipe, or -1 when no SignalPipe exists.
volatile sig_atomic_t g_signal_write_fd = -1;

extern "C" void on_signal(int sig) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  const int fd = g_signal_write_fd;
  // Non-blocking: if the pipe were ever full, dropping a byte is harmless (SIGCHLD is also polled, and a
  // pending SIGINT/SIGTERM byte is already queued).
  if (fd >= 0) (void)!::write(fd, &byte, 1);
  errno = saved_errno;
}

}  // namespace

SignalPipe::SignalPipe() : pipe_(make_pipe(O_NONBLOCK)) {
  if (g_signal_write_fd != -1) throw std::logic_error("fsdprun: only one SignalPipe may exist");
  g_signal_write_fd = pipe_.write.get();
  for (int i = 0; i < 4; ++i) {
    struct sigaction sa{};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | (kHandled[i] == SIGCHLD ? SA_NOCLDSTOP : 0);
    ::sigaction(kHandled[i], &sa, &old_[i]);
  }
}

SignalPipe::~SignalPipe() {
  for (int i = 0; i < 4; ++i) ::sigaction(kHandled[i], &old_[i], nullptr);
  g_signal_write_fd = -1;
}

std::vector<int> SignalPipe::drain() {
  std::vector<int> sigs;
  unsigned char buf[64];
  for (;;) {
    const ssize_t n = ::read(pipe_.read.get(), buf, sizeof buf);
    if (n > 0) {
      sigs.insert(sigs.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return sigs;  // EAGAIN: empty
  }
}

BlockAllSignals::BlockAllSignals() {
  sigset_t all;
  sigfillset(&all);
  ::sigprocmask(SIG_SETMASK, &all, &previous_);
}

BlockAllSignals::~BlockAllSignals() { ::sigprocmask(SIG_SETMASK, &previous_, nullptr); }

void reset_signals_in_child() {
  for (int sig : kHandled) ::signal(sig, SIG_DFL);
  ::signal(SIGPIPE, SIG_DFL);  // the launcher ignores SIGPIPE; the program should not inherit that
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGKILL: return "SIGKILL";
    default: return "signal";
  }
}

}  // namespace fsdprun
