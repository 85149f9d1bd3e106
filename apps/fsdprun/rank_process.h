// One rank: a child process leading its own process group, with optional pipes for its stdout/stderr.
#pragma once

#include <sys/types.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "unique_fd.h"

namespace fsdprun {

// The program could not be executed (errno from execvpe, e.g. ENOENT). The child has been reaped already.
class ExecError : public std::runtime_error {
 public:
  ExecError(const std::string& program, int err);
  int error() const { return err_; }

 private:
  int err_;
};

class RankProcess {
 public:
  // Forks and execs argv[0] (searched in PATH) with `env`. The child leads a new process group (so the whole
  // group, grandchildren included, can be signalled), gets SIGKILL if the launcher dies (PR_SET_PDEATHSIG),
  // and, with capture_output, writes stdout/stderr into pipes readable via take_stdout()/take_stderr().
  // Throws ExecError if exec fails, std::system_error if fork/pipe fail.
  static RankProcess spawn(int rank, const std::vector<std::string>& argv, const std::vector<std::string>& env,
                           bool capture_output);

  // Safety net: SIGKILLs the process group and reaps the leader if the supervisor did not.
  ~RankProcess();
  RankProcess(RankProcess&& other) noexcept;
  RankProcess& operator=(RankProcess&&) = delete;
  RankProcess(const RankProcess&) = delete;
  RankProcess& operator=(const RankProcess&) = delete;

  int rank() const { return rank_; }
  pid_t pid() const { return pid_; }
  bool running() const { return !reaped_; }
  int wait_status() const { return status_; }

  // Sends `sig` to the rank's whole process group (also after the leader has exited, to reach grandchildren
  // that stayed in it). A group that no longer exists is not an error.
  void signal_group(int sig) const;
  // Records the status the supervisor got from waitpid() for pid().
  void mark_reaped(int wait_status);

  UniqueFd take_stdout() { return std::move(stdout_); }
  UniqueFd take_stderr() { return std::move(stderr_); }

 private:
  RankProcess(int rank, pid_t pid) : rank_(rank), pid_(pid) {}

  int rank_;
  pid_t pid_;
  bool reaped_ = false;
  int status_ = 0;
  UniqueFd stdout_;
  UniqueFd stderr_;
};

// "exited with code 3" / "was killed by signal 9 (Killed)".
std::string describe_wait_status(int wait_status);
// Shell convention: the exit code, or 128 + signal number.
int exit_code_of(int wait_status);

}  // namespace fsdprun
