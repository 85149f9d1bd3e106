#include "rank_process.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <system_error>

#include "signals.h"

namespace fsdprun {
namespace {

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Runs in the forked child; only async-signal-safe calls until exec. Never returns.
[[noreturn]] void exec_child(pid_t launcher, char* const* argv, char* const* envp, int out_fd, int err_fd,
                             int exec_error_fd) {
  reset_signals_in_child();
  ::setpgid(0, 0);
  // Die with the launcher even if it is SIGKILLed; re-check the parent in case it died before prctl.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(127);
  if (out_fd >= 0 && ::dup2(out_fd, STDOUT_FILENO) < 0) ::_exit(127);
  if (err_fd >= 0 && ::dup2(err_fd, STDERR_FILENO) < 0) ::_exit(127);
  ::execvpe(argv[0], argv, envp);
  const int err = errno;
  (void)!::write(exec_error_fd, &err, sizeof err);
  ::_exit(127);
}

}  // namespace

ExecError::ExecError(const std::string& program, int err)
    : std::runtime_error("cannot execute '" + program + "': " + std::strerror(err)), err_(err) {}

RankProcess RankProcess::spawn(int rank, const std::vector<std::string>& argv, const std::vector<std::string>& env,
                               bool capture_output) {
  const std::vector<char*> argv_c = c_strings(argv);
  const std::vector<char*> env_c = c_strings(env);
  Pipe out, err;
  if (capture_output) {
    out = make_pipe();
    err = make_pipe();
  }
  // Close-on-exec: EOF on the read end means exec succeeded; an int means it failed with that errno.
  Pipe exec_error = make_pipe();
  const pid_t launcher = ::getpid();

  pid_t pid;
  {
    const BlockAllSignals blocked;
    pid = ::fork();
    if (pid == 0)
      exec_child(launcher, argv_c.data(), env_c.data(), out.write.get(), err.write.get(), exec_error.write.get());
  }
  if (pid < 0) throw std::system_error(errno, std::generic_category(), "fork");
  // Also from the parent: no window in which signal_group() could miss the child.
  ::setpgid(pid, pid);
  RankProcess proc(rank, pid);
  exec_error.write.reset();
  out.write.reset();
  err.write.reset();
  proc.stdout_ = std::move(out.read);
  proc.stderr_ = std::move(err.read);

  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(exec_error.read.get(), &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof exec_errno)) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    proc.mark_reaped(status);
    throw ExecError(argv.front(), exec_errno);
  }
  return proc;
}

RankProcess::RankProcess(RankProcess&& other) noexcept
    : rank_(other.rank_),
      pid_(std::exchange(other.pid_, -1)),
      reaped_(other.reaped_),
      status_(other.status_),
      stdout_(std::move(other.stdout_)),
      stderr_(std::move(other.stderr_)) {}

RankProcess::~RankProcess() {
  if (pid_ <= 0) return;
  signal_group(SIGKILL);
  if (!reaped_) {
    int status;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

void RankProcess::signal_group(int sig) const {
  if (pid_ > 0) ::killpg(pid_, sig);  // ESRCH (group already gone) is fine
}

void RankProcess::mark_reaped(int wait_status) {
  reaped_ = true;
  status_ = wait_status;
}

std::string describe_wait_status(int wait_status) {
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    return "was killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(wait_status));
}

int exit_code_of(int wait_status) {
  return WIFSIGNALED(wait_status) ? 128 + WTERMSIG(wait_status) : WEXITSTATUS(wait_status);
}

}  // namespace fsdprun
