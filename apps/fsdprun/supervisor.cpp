#include "supervisor.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <vector>

#include "line_pump.h"
#include "log.h"
#include "rank_env.h"
#include "rank_process.h"

namespace fsdprun {
namespace {

using std::chrono::milliseconds;

// Upper bound on one poll(): SIGCHLD normally wakes us at once; this is only a safety net.
constexpr milliseconds kMaxPollWait{200};
// After the last rank exited: how long we keep reading output that is still in (or still entering) the pipes.
constexpr milliseconds kDrainTime{1000};
// How long we wait for processes that escaped the ranks' process groups before giving up on them.
constexpr milliseconds kOrphanWait{2000};

std::string format_seconds(double s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

class Attempt {
 public:
  Attempt(const AttemptConfig& config, SignalPipe& signals) : cfg_(config), opts_(config.opts), signals_(signals) {}

  AttemptResult run() {
    handle_signals();  // a signal that arrived between attempts: do not start anything
    if (!result_) spawn_all();
    for (;;) {
      const Clock::time_point now = Clock::now();
      if (!stopping_ && cfg_.deadline && now >= *cfg_.deadline && !all_reaped()) on_timeout();
      if (stopping_ && !killed_ && now >= kill_at_) kill_all();
      if (all_reaped()) {
        if (!drain_until_) {
          // The job is over: whatever is left in the ranks' process groups (grandchildren) ends with it.
          for (const RankProcess& r : ranks_) r.signal_group(SIGKILL);
          drain_until_ = now + kDrainTime;
        }
        const bool drained = std::none_of(pumps_.begin(), pumps_.end(), [](const StreamPump& p) { return p.open(); });
        if (drained || now >= *drain_until_) break;
      }
      wait_for_events(now);
      handle_signals();
      reap();
    }
    for (StreamPump& p : pumps_) p.finish();
    reap_orphans();
    return result_.value_or(AttemptResult{AttemptOutcome::kSucceeded, 0});
  }

 private:
  void spawn_all() {
    ranks_.reserve(static_cast<std::size_t>(opts_.nproc_per_node));
    for (int local = 0; local < opts_.nproc_per_node; ++local) {
      const int rank = opts_.global_rank(local);
      const auto env = build_rank_environment(opts_, local, cfg_.master_port, cfg_.restart_count,
                                              cfg_.launcher_serves_store);
      try {
        ranks_.push_back(RankProcess::spawn(rank, opts_.command, env, opts_.prefix_output));
      } catch (const ExecError& e) {
        say(std::string(e.what()) + " (rank " + std::to_string(rank) + ")");
        const int code = (e.error() == ENOENT || e.error() == ENOTDIR) ? 127 : 126;
        result_ = AttemptResult{AttemptOutcome::kExecFailed, code};
        stop_all(SIGTERM);
        return;
      }
      RankProcess& proc = ranks_.back();
      if (opts_.prefix_output) {
        const std::string prefix = "[rank " + std::to_string(rank) + "] ";
        pumps_.emplace_back(proc.take_stdout(), prefix, STDOUT_FILENO);
        pumps_.emplace_back(proc.take_stderr(), prefix, STDERR_FILENO);
      }
    }
  }

  bool all_reaped() const {
    return std::none_of(ranks_.begin(), ranks_.end(), [](const RankProcess& r) { return r.running(); });
  }

  void wait_for_events(Clock::time_point now) {
    Clock::time_point wake = now + kMaxPollWait;
    if (!stopping_ && cfg_.deadline) wake = std::min(wake, *cfg_.deadline);
    if (stopping_ && !killed_) wake = std::min(wake, kill_at_);
    if (drain_until_) wake = std::min(wake, *drain_until_);
    const auto wait_ms = std::chrono::ceil<milliseconds>(wake - now).count();

    std::vector<pollfd> fds{{signals_.fd(), POLLIN, 0}};
    std::vector<StreamPump*> polled;
    for (StreamPump& p : pumps_) {
      if (!p.open()) continue;
      fds.push_back({p.fd(), POLLIN, 0});
      polled.push_back(&p);
    }
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(0, wait_ms)));
    if (n <= 0) return;  // timeout, or EINTR: the caller re-checks everything
    for (std::size_t i = 0; i < polled.size(); ++i)
      if (fds[i + 1].revents != 0) polled[i]->pump();
  }

  void handle_signals() {
    for (int sig : signals_.drain())
      if (sig != SIGCHLD) on_launcher_signal(sig);  // SIGCHLD only wakes us; reap() runs every iteration
  }

  void reap() {
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid < 0 && errno == EINTR) continue;
      if (pid <= 0) return;
      // Not a rank: an orphaned grandchild re-parented to us (we are a child subreaper); just reaped.
      for (RankProcess& r : ranks_) {
        if (r.pid() == pid && r.running()) {
          r.mark_reaped(status);
          on_rank_exit(r);
        }
      }
    }
  }

  void on_rank_exit(const RankProcess& r) {
    const int status = r.wait_status();
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
    if (stopping_) return;  // ranks ending because we are stopping them are not failures of their own
    say("rank " + std::to_string(r.rank()) + " (pid " + std::to_string(r.pid()) + ") " + describe_wait_status(status));
    result_ = AttemptResult{AttemptOutcome::kRankFailed, exit_code_of(status)};
    stop_all(SIGTERM);
  }

  void on_launcher_signal(int sig) {
    if (interrupted_) {
      say(std::string("got ") + signal_name(sig) + " again; killing all ranks");
      kill_all();
      return;
    }
    interrupted_ = true;
    // The user asked to stop: this wins over a failure being handled, and nothing is restarted.
    result_ = AttemptResult{AttemptOutcome::kInterrupted, 128 + sig};
    if (ranks_.empty()) return;
    say(std::string("got ") + signal_name(sig) + "; forwarding it to all ranks");
    stop_all(sig);
  }

  void on_timeout() {
    std::string running;
    for (const RankProcess& r : ranks_) {
      if (!r.running()) continue;
      if (!running.empty()) running += ", ";
      running += std::to_string(r.rank());
    }
    say("timeout after " + format_seconds(opts_.timeout_s) + " s; killed ranks " + running);
    result_ = AttemptResult{AttemptOutcome::kTimedOut, 124};
    stop_all(SIGTERM);
  }

  // Sends `sig` to every rank's process group (exited ranks too: their grandchildren may live on) and arms
  // the SIGKILL escalation the first time.
  void stop_all(int sig) {
    for (const RankProcess& r : ranks_) r.signal_group(sig);
    if (!stopping_) {
      stopping_ = true;
      kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(opts_.kill_grace_s));
    }
  }

  void kill_all() {
    if (!all_reaped() && !killed_ && opts_.kill_grace_s > 0)
      say("ranks still running " + format_seconds(opts_.kill_grace_s) + " s after being told to stop; sending SIGKILL");
    killed_ = true;
    for (const RankProcess& r : ranks_) r.signal_group(SIGKILL);
  }

  // We are a child subreaper, so every descendant that outlived its parent is now our child. Waiting until
  // waitpid() reports ECHILD proves that no process of this attempt is left.
  void reap_orphans() {
    const Clock::time_point give_up = Clock::now() + kOrphanWait;
    for (;;) {
      int status;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0 || (pid < 0 && errno == EINTR)) continue;
      if (pid < 0) return;  // ECHILD
      if (Clock::now() >= give_up) {
        say("warning: processes started by the ranks left their process groups and are still running");
        return;
      }
      pollfd p{signals_.fd(), POLLIN, 0};
      ::poll(&p, 1, 20);
      handle_signals();
    }
  }

  const AttemptConfig& cfg_;
  const LaunchOptions& opts_;
  SignalPipe& signals_;
  std::vector<RankProcess> ranks_;
  std::vector<StreamPump> pumps_;
  std::optional<AttemptResult> result_;  // the first cause of the attempt's end, if it is not a success
  bool stopping_ = false;                // SIGTERM (or a forwarded signal) has been sent
  bool killed_ = false;                  // SIGKILL has been sent
  bool interrupted_ = false;             // fsdprun itself got SIGINT/SIGTERM/SIGHUP
  Clock::time_point kill_at_{};
  std::optional<Clock::time_point> drain_until_;
};

}  // namespace

AttemptResult run_attempt(const AttemptConfig& config, SignalPipe& signals) {
  return Attempt(config, signals).run();
}

}  // namespace fsdprun
