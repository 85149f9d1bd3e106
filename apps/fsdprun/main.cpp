// fsdprun: torchrun's job for libfsdp programs. See docs/launcher.md.
#include <signal.h>
#include <sys/prctl.h>

#include <exception>
#include <optional>
#include <sstream>

#include "hosted_store.h"
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
    // Standalone mode: fsdprun serves the rendezvous store itself (torchrun's agent store), a fresh one on a port
    // the kernel picks for every attempt: no key of a failed attempt is seen by the next, and the port is held
    // from the moment it is chosen (a port chosen here and bound later by rank 0 could be taken in between).
    // With --master-port, rank 0 serves it there (multi-node: only node 0 has rank 0).
    std::optional<HostedStore> store;
    if (opts.master_port == 0) store.emplace(opts.master_addr);
    const int port = store ? store->port() : opts.master_port;
    const AttemptResult result =
        run_attempt(AttemptConfig{opts, restart, port, store.has_value(), deadline}, signals);
    store.reset();  // every rank is gone: close the port before a restart or the exit
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
