// fsdprun: torchrun's job for libfsdp programs. See docs/launcher.md.
#include <signal.h>
#include <sys/prctl.h>

#include <exception>
#include <sstream>

#include "free_port.h"
#include "log.h"
#include "options.h"
#include "signals.h"
#include "supervisor.h"

namespace fsdprun {
namespace {

int run_job(const LaunchOptions& opts) {
  // A closed stdout must not kill the launcher (it would orphan the ranks' supervision); writes just fail.
  ::signal(SIGPIPE, SIG_IGN);
  // Descendants whose parent rank died are re-parented to us instead of init, so we can reap them and know
  // when none is left.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  SignalPipe signals;

  std::optional<Clock::time_point> deadline;
  if (opts.timeout_s > 0)
    deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(opts.timeout_s));

  for (int restart = 0;; ++restart) {
    // Standalone mode: a fresh free port per attempt, so a port still in TIME_WAIT never blocks a restart.
    const int port = opts.master_port != 0 ? opts.master_port : find_free_port(opts.master_addr);
    const AttemptResult result = run_attempt(AttemptConfig{opts, restart, port, deadline}, signals);
    if (result.outcome != AttemptOutcome::kRankFailed || restart >= opts.max_restarts) return result.exit_code;
    if (deadline && Clock::now() >= *deadline) {
      std::ostringstream os;
      os << "timeout after " << opts.timeout_s << " s; not restarting";
      say(os.str());
      return 124;
    }
    say("restarting (attempt " + std::to_string(restart + 1) + "/" + std::to_string(opts.max_restarts) + ")");
  }
}

}  // namespace
}  // namespace fsdprun

int main(int argc, char** argv) {
  auto parsed = fsdprun::parse_options(argc, argv);
  if (const int* code = std::get_if<int>(&parsed)) return *code;
  try {
    return fsdprun::run_job(std::get<fsdprun::LaunchOptions>(parsed));
  } catch (const std::exception& e) {
    fsdprun::say(std::string("error: ") + e.what());
    return 1;
  }
}
