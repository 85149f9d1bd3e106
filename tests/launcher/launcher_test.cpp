// Tests of fsdprun, run as a subprocess on rank_behaviour (see rank_behaviour.cpp for its per-rank actions).
// Expected values are computed here from the command line (rank arithmetic, exit-code conventions), never
// taken from the launcher's own output; process liveness is checked with kill(pid, 0) on the pids the ranks
// and their grandchildren wrote themselves.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loopback_port.h"
#include "port_probe.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Reaps zombies re-parented to this test process (it is a child subreaper, see LauncherTest::SetUp), so that
// kill(pid, 0) tells "alive" from "gone".
void reap_zombies() {
  while (::waitpid(-1, nullptr, WNOHANG) > 0) {
  }
}

bool gone(pid_t pid) {
  reap_zombies();
  return ::kill(pid, 0) == -1 && errno == ESRCH;
}

struct Finished {
  int exit_code = -1;  // 1000 + N if fsdprun itself died by signal N (never expected)
  std::string out;
  std::string err;
  double seconds = 0;
};

// fsdprun started with its stdout/stderr going to files in the test directory.
class Launcher {
 public:
  Launcher(const std::vector<std::string>& args, const fs::path& dir, const std::vector<std::string>& env = {})
      : out_(dir / "launcher.out"), err_(dir / "launcher.err"), start_(Clock::now()) {
    std::vector<std::string> argv{FSDPRUN_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> argv_c;
    for (auto& a : argv) argv_c.push_back(a.data());
    argv_c.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      const int out = ::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = ::open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (out < 0 || err < 0 || ::dup2(out, 1) < 0 || ::dup2(err, 2) < 0) ::_exit(200);
      ::unsetenv("OMP_NUM_THREADS");  // the tests decide it
      for (const auto& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
      ::execv(argv_c[0], argv_c.data());
      ::_exit(201);
    }
  }
  ~Launcher() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  pid_t pid() const { return pid_; }

  // Waits at most limit_s; a launcher still running then is a test failure (and is killed).
  Finished wait(double limit_s = 15) {
    Finished f;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (seconds_since(start_) > limit_s) {
        ADD_FAILURE() << "fsdprun still running after " << limit_s << " s; killing it";
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    pid_ = -1;
    f.seconds = seconds_since(start_);
    f.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
    f.out = read_text(out_);
    f.err = read_text(err_);
    return f;
  }

 private:
  fs::path out_, err_;
  Clock::time_point start_;
  pid_t pid_ = -1;
};

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Orphans of the processes under test become our children instead of init's, so we can reap them and
    // kill(pid, 0) reports ESRCH for dead ones (PID 1 in a container does not always reap).
    ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    char tmpl[] = "/tmp/fsdprun_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    // Whatever a failed test left behind must not outlive it.
    for (pid_t pid : recorded_pids()) ::kill(pid, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    reap_zombies();
    fs::remove_all(dir_);
  }

  // fsdprun <launcher_args> rank_behaviour <dir> <specs>
  std::vector<std::string> cmd(std::vector<std::string> launcher_args, const std::vector<std::string>& specs) const {
    launcher_args.push_back(RANK_BEHAVIOUR_PATH);
    launcher_args.push_back(dir_.string());
    launcher_args.insert(launcher_args.end(), specs.begin(), specs.end());
    return launcher_args;
  }

  Finished run(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    Launcher l(args, dir_, env);
    return l.wait();
  }

  bool exists(const std::string& name) const { return fs::exists(dir_ / name); }

  // Files named <prefix>.* (complete ones only).
  std::vector<fs::path> files(const std::string& prefix) const {
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string name = e.path().filename().string();
      if (name.rfind(prefix + ".", 0) == 0 && e.path().extension() != ".tmp") out.push_back(e.path());
    }
    return out;
  }

  pid_t pid_in(const std::string& name) const { return static_cast<pid_t>(std::stol(read_text(dir_ / name))); }

  std::vector<pid_t> recorded_pids() const {
    std::vector<pid_t> pids;
    for (const char* kind : {"start", "grandchild"})
      for (const auto& p : files(kind)) pids.push_back(static_cast<pid_t>(std::stol(read_text(p))));
    return pids;
  }

  // Every process any rank (or grandchild) of the test recorded is gone; expects exactly `expected` of them so
  // that the check cannot pass vacuously.
  void expect_no_survivors(std::size_t expected) const {
    const auto pids = recorded_pids();
    EXPECT_EQ(pids.size(), expected) << "processes recorded in " << dir_;
    for (pid_t pid : pids) EXPECT_TRUE(gone(pid)) << "pid " << pid << " survived fsdprun";
  }

  bool wait_for_files(const std::string& prefix, std::size_t n, double limit_s = 10) const {
    const auto start = Clock::now();
    while (files(prefix).size() < n) {
      if (seconds_since(start) > limit_s) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

  fs::path dir_;
};

// "[rank N] text" lines of a stream, per rank, plus lines without a prefix under key -1.
std::map<int, std::vector<std::string>> lines_by_rank(const std::string& text) {
  static const std::regex prefixed(R"(^\[rank (\d+)\] (.*)$)");
  std::map<int, std::vector<std::string>> out;
  std::stringstream ss(text);
  for (std::string line; std::getline(ss, line);) {
    std::smatch m;
    if (std::regex_match(line, m, prefixed)) {
      out[std::stoi(m[1])].push_back(m[2]);
    } else {
      out[-1].push_back(line);
    }
  }
  return out;
}

std::map<std::string, std::string> as_env(const std::vector<std::string>& lines) {
  std::map<std::string, std::string> env;
  for (const auto& l : lines) {
    const auto eq = l.find('=');
    if (eq != std::string::npos) env[l.substr(0, eq)] = l.substr(eq + 1);
  }
  return env;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// "key=value key=value" -> map.
std::map<std::string, std::string> fields(const std::string& line) {
  std::map<std::string, std::string> out;
  std::stringstream ss(line);
  for (std::string word; ss >> word;) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) out[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return out;
}

// ---- environment and output ----------------------------------------------------------------------------

class LauncherEnvTest : public LauncherTest, public ::testing::WithParamInterface<int> {};

TEST_P(LauncherEnvTest, EveryRankGetsTorchrunVariablesAndPrefixedOutput) {
  const int n = GetParam();
  const Finished f = run(cmd({"--nproc-per-node", std::to_string(n)}, {"*:env"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  const auto out = lines_by_rank(f.out);
  EXPECT_EQ(out.count(-1), 0u) << "unprefixed stdout:\n" << f.out;
  ASSERT_EQ(out.size(), static_cast<std::size_t>(n)) << f.out;
  std::string port;
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(out.count(r), 1u) << "no output from rank " << r;
    EXPECT_EQ(out.at(r).size(), 10u) << "rank " << r << " printed 10 variables, each on its own prefixed line";
    auto env = as_env(out.at(r));
    EXPECT_EQ(env["RANK"], std::to_string(r));  // the prefix names the rank whose RANK it is
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(r));
    EXPECT_EQ(env["WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], std::to_string(n));
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "True") << "standalone: fsdprun serves the store";
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    const int p = std::stoi(env["MASTER_PORT"]);
    EXPECT_GT(p, 0);
    EXPECT_LE(p, 65535);
    if (r == 0) port = env["MASTER_PORT"];
    EXPECT_EQ(env["MASTER_PORT"], port) << "all ranks must agree on the store's port";
  }
  const auto err = lines_by_rank(f.err);
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(err.count(r), 1u) << f.err;
    EXPECT_EQ(err.at(r), std::vector<std::string>{"stderr of rank " + std::to_string(r)});
  }
  expect_no_survivors(static_cast<std::size_t>(n));
}

INSTANTIATE_TEST_SUITE_P(NProc, LauncherEnvTest, ::testing::Values(3, 4));

TEST_F(LauncherTest, MultiNodeRanksAreOffsetByNodeRank) {
  const Finished f = run(cmd({"--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                              "29517", "--nproc-per-node", "3"},
                             {"*:env"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  const auto out = lines_by_rank(f.out);
  for (int local = 0; local < 3; ++local) {
    const int rank = 1 * 3 + local;
    ASSERT_EQ(out.count(rank), 1u) << f.out;
    auto env = as_env(out.at(rank));
    EXPECT_EQ(env["RANK"], std::to_string(rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(local));
    EXPECT_EQ(env["WORLD_SIZE"], "6");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["GROUP_RANK"], "1");
    EXPECT_EQ(env["MASTER_PORT"], "29517");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "False") << "with --master-port rank 0 serves the store";
  }
}

TEST_F(LauncherTest, PresetOmpNumThreadsIsKept) {
  const Finished f = run(cmd({"--nproc-per-node", "2"}, {"*:env"}), {"OMP_NUM_THREADS=7"});
  ASSERT_EQ(f.exit_code, 0) << f.err;
  const auto out = lines_by_rank(f.out);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(as_env(out.at(r))["OMP_NUM_THREADS"], "7");
}

TEST_F(LauncherTest, PartialLastLineIsFlushedWithPrefix) {
  const Finished f = run(cmd({"--nproc-per-node", "2"}, {"0:partial=zero-tail", "1:partial=one-tail"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  const auto out = lines_by_rank(f.out);
  EXPECT_EQ(out.at(0), std::vector<std::string>{"zero-tail"});
  EXPECT_EQ(out.at(1), std::vector<std::string>{"one-tail"});
}

TEST_F(LauncherTest, NoPrefixPassesOutputThrough) {
  const Finished f = run(cmd({"--nproc-per-node", "2", "--no-prefix"}, {"*:env"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  EXPECT_FALSE(contains(f.out, "[rank")) << f.out;
  const auto out = lines_by_rank(f.out);
  EXPECT_EQ(out.at(-1).size(), 20u) << f.out;  // 10 variables from each of 2 ranks, unprefixed
  EXPECT_TRUE(contains(f.out, "RANK=0\n"));
  EXPECT_TRUE(contains(f.out, "RANK=1\n"));
}

TEST_F(LauncherTest, ProgramFlagsAfterTheProgramPassThrough) {
  const Finished f =
      run(cmd({"--nproc-per-node", "1"}, {"*:args", "--timeout", "1", "--nproc-per-node", "9", "--help"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  const auto out = lines_by_rank(f.out);
  ASSERT_EQ(out.size(), 1u) << f.out;  // one rank: --nproc-per-node 9 went to the program
  const std::vector<std::string> expected{"arg[0]=" RANK_BEHAVIOUR_PATH, "arg[1]=" + dir_.string(), "arg[2]=*:args",
                                          "arg[3]=--timeout",           "arg[4]=1",
                                          "arg[5]=--nproc-per-node",    "arg[6]=9",
                                          "arg[7]=--help"};
  EXPECT_EQ(out.at(0), expected);
}

TEST_F(LauncherTest, UsageErrorsExitWithTwo) {
  EXPECT_EQ(run({}).exit_code, 2);                                      // no program
  EXPECT_EQ(run({"--bogus", RANK_BEHAVIOUR_PATH}).exit_code, 2);       // unknown launcher option
  EXPECT_EQ(run({"--nnodes", "2", RANK_BEHAVIOUR_PATH}).exit_code, 2);  // multi-node needs --master-port
  EXPECT_EQ(run({"--nnodes", "2", "--node-rank", "2", "--master-port", "29500", RANK_BEHAVIOUR_PATH}).exit_code, 2);
  EXPECT_EQ(run({"--nproc-per-node", "0", RANK_BEHAVIOUR_PATH}).exit_code, 2);
  const Finished help = run({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_TRUE(contains(help.out, "OMP_NUM_THREADS")) << help.out;
}

// ---- fail-fast ------------------------------------------------------------------------------------------

TEST_F(LauncherTest, CrashingRankStopsTheOthersAndTheirGrandchildren) {
  const Finished f = run(cmd({"--nproc-per-node", "3"}, {"*:grandchild,ready,hang", "1:grandchild,ready,await=3,segv"}));
  EXPECT_EQ(f.exit_code, 128 + SIGSEGV) << f.err;
  EXPECT_LT(f.seconds, 10);
  EXPECT_TRUE(contains(f.err, "fsdprun: rank 1 (pid " + std::to_string(pid_in("start.r1.a0")) +
                                  ") was killed by signal 11 (Segmentation fault)"))
      << f.err;
  expect_no_survivors(6);  // 3 ranks + 3 grandchildren
}

TEST_F(LauncherTest, NonZeroExitStopsAHangingRank) {
  const Finished f = run(cmd({"--nproc-per-node", "2"}, {"0:grandchild,ready,hang", "1:ready,await=2,exit=3"}));
  EXPECT_EQ(f.exit_code, 3) << f.err;
  EXPECT_LT(f.seconds, 10);
  EXPECT_TRUE(contains(f.err, "fsdprun: rank 1 (pid " + std::to_string(pid_in("start.r1.a0")) + ") exited with code 3"))
      << f.err;
  expect_no_survivors(3);
}

TEST_F(LauncherTest, SignalledRankStopsRanksThatIgnoreSigterm) {
  const Finished f = run(cmd({"--nproc-per-node", "3", "--kill-grace", "1"},
                             {"*:ignore_term,grandchild,ready,hang", "2:ready,await=3,signal=9"}));
  EXPECT_EQ(f.exit_code, 128 + SIGKILL) << f.err;
  EXPECT_GE(f.seconds, 0.9) << "SIGKILL must come only after the grace period";
  EXPECT_LT(f.seconds, 10);
  EXPECT_TRUE(contains(f.err, "fsdprun: rank 2 (pid " + std::to_string(pid_in("start.r2.a0")) +
                                  ") was killed by signal 9 (Killed)"))
      << f.err;
  EXPECT_TRUE(contains(f.err, "sending SIGKILL")) << f.err;
  expect_no_survivors(5);  // 3 ranks + 2 grandchildren
}

TEST_F(LauncherTest, DefaultGraceBoundsTheTeardown) {
  const Finished f = run(cmd({"--nproc-per-node", "2"}, {"0:ignore_term,ready,hang", "1:ready,await=2,abort"}));
  EXPECT_EQ(f.exit_code, 128 + SIGABRT) << f.err;
  EXPECT_GE(f.seconds, 2.9) << "default grace is 3 s";
  EXPECT_LT(f.seconds, 10);
  EXPECT_TRUE(contains(f.err, "rank 1 (pid " + std::to_string(pid_in("start.r1.a0")) + ") was killed by signal 6"))
      << f.err;
  expect_no_survivors(2);
}

// ---- signals to the launcher ----------------------------------------------------------------------------

class LauncherSignalTest : public LauncherTest, public ::testing::WithParamInterface<int> {};

TEST_P(LauncherSignalTest, IsForwardedToEveryRankAndNobodySurvives) {
  const int sig = GetParam();
  Launcher l(cmd({"--nproc-per-node", "3"}, {"*:trap,grandchild,ready,hang"}), dir_);
  ASSERT_TRUE(wait_for_files("ready", 3)) << "ranks did not start";
  ASSERT_EQ(::kill(l.pid(), sig), 0);
  const Finished f = l.wait(10);
  EXPECT_EQ(f.exit_code, 128 + sig) << f.err;
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(exists("sig" + std::to_string(sig) + ".r" + std::to_string(r) + ".a0"))
        << "rank " << r << " did not receive the forwarded signal";
  EXPECT_TRUE(contains(f.err, "forwarding it to all ranks")) << f.err;
  expect_no_survivors(6);
}

INSTANTIATE_TEST_SUITE_P(Signals, LauncherSignalTest, ::testing::Values(SIGTERM, SIGINT, SIGHUP));

TEST_F(LauncherTest, RanksDieWhenTheLauncherIsKilled) {
  Launcher l(cmd({"--nproc-per-node", "2"}, {"*:ready,hang"}), dir_);
  ASSERT_TRUE(wait_for_files("ready", 2)) << "ranks did not start";
  ASSERT_EQ(::kill(l.pid(), SIGKILL), 0);
  const Finished f = l.wait(5);
  EXPECT_EQ(f.exit_code, 1000 + SIGKILL);
  const auto pids = recorded_pids();
  ASSERT_EQ(pids.size(), 2u);
  const auto start = Clock::now();
  for (pid_t pid : pids) {
    while (!gone(pid) && seconds_since(start) < 5) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(gone(pid)) << "rank pid " << pid << " outlived a SIGKILLed launcher";
  }
}

// ---- restarts -------------------------------------------------------------------------------------------

TEST_F(LauncherTest, MaxRestartsRestartsExactlyKTimes) {
  const int k = 2;
  const Finished f = run(cmd({"--nproc-per-node", "2", "--max-restarts", std::to_string(k)},
                             {"*:ready,hang", "1:ready,await=2,exit=5"}));
  EXPECT_EQ(f.exit_code, 5) << f.err;
  EXPECT_LT(f.seconds, 10);
  // K+1 starts of each rank, the attempt number taken from the TORCHELASTIC_RESTART_COUNT each start saw.
  EXPECT_EQ(files("start").size(), static_cast<std::size_t>(2 * (k + 1)));
  for (int a = 0; a <= k; ++a)
    for (int r = 0; r < 2; ++r)
      EXPECT_TRUE(exists("start.r" + std::to_string(r) + ".a" + std::to_string(a))) << "rank " << r << " attempt " << a;
  EXPECT_TRUE(contains(f.err, "fsdprun: restarting (attempt 1/2)")) << f.err;
  EXPECT_TRUE(contains(f.err, "fsdprun: restarting (attempt 2/2)")) << f.err;
  EXPECT_FALSE(contains(f.err, "attempt 3/2")) << f.err;
  expect_no_survivors(static_cast<std::size_t>(2 * (k + 1)));
}

TEST_F(LauncherTest, SuccessfulAttemptEndsTheRestarts) {
  // Every rank fails on attempt 0 (restart count 0) and succeeds from restart count 1 on.
  const Finished f =
      run(cmd({"--nproc-per-node", "3", "--max-restarts", "5"}, {"*:ready,await=3,succeed_from=1"}));
  EXPECT_EQ(f.exit_code, 0) << f.err;
  EXPECT_EQ(files("start").size(), 6u) << "two attempts of 3 ranks";
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(exists("start.r" + std::to_string(r) + ".a1"));
  EXPECT_TRUE(contains(f.err, "fsdprun: restarting (attempt 1/5)")) << f.err;
  EXPECT_FALSE(contains(f.err, "attempt 2/5")) << f.err;
  expect_no_survivors(6);
}

TEST_F(LauncherTest, ExecFailureIsReportedAndNotRetried) {
  const std::string missing = (dir_ / "no-such-program").string();
  const Finished f = run({"--nproc-per-node", "2", "--max-restarts", "3", missing});
  EXPECT_EQ(f.exit_code, 127) << f.err;
  EXPECT_LT(f.seconds, 5);
  EXPECT_TRUE(contains(f.err, "cannot execute '" + missing + "'")) << f.err;
  EXPECT_FALSE(contains(f.err, "restarting")) << f.err;
}

// ---- timeout --------------------------------------------------------------------------------------------

TEST_F(LauncherTest, TimeoutKillsAHangingJob) {
  const Finished f = run(cmd({"--nproc-per-node", "2", "--timeout", "2"}, {"*:grandchild,ready,hang"}));
  EXPECT_EQ(f.exit_code, 124) << f.err;
  EXPECT_GE(f.seconds, 1.9);
  EXPECT_LT(f.seconds, 10);
  EXPECT_TRUE(contains(f.err, "fsdprun: timeout after 2 s; killed ranks 0, 1")) << f.err;
  expect_no_survivors(4);
}

TEST_F(LauncherTest, TimeoutEscalatesToSigkill) {
  const Finished f =
      run(cmd({"--nproc-per-node", "2", "--timeout", "1", "--kill-grace", "1"}, {"*:ignore_term,ready,hang"}));
  EXPECT_EQ(f.exit_code, 124) << f.err;
  EXPECT_GE(f.seconds, 1.9);
  EXPECT_LT(f.seconds, 10);
  expect_no_survivors(2);
}

// ---- the rendezvous store ------------------------------------------------------------------------------

// Standalone mode: fsdprun serves the store (torchrun's agent store), so the port is taken and answering before any
// rank starts; no rank could bind it (the race of a port picked free and bound later by rank 0 is gone), no rank
// inherits a socket of it, and each attempt's store is closed before the next attempt and at the end.
TEST_F(LauncherTest, StandaloneServesTheStoreAndClosesItAfterEachAttempt) {
  const Finished f =
      run(cmd({"--nproc-per-node", "2", "--max-restarts", "1"}, {"*:store,ready,await=2,succeed_from=1"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  EXPECT_TRUE(contains(f.err, "fsdprun: restarting (attempt 1/1)")) << f.err;
  std::vector<int> ports;
  for (int a = 0; a < 2; ++a) {
    for (int r = 0; r < 2; ++r) {
      const std::string name = "store.r" + std::to_string(r) + ".a" + std::to_string(a);
      ASSERT_TRUE(exists(name)) << name;
      auto probe = fields(read_text(dir_ / name));
      SCOPED_TRACE(name + ": " + read_text(dir_ / name));
      EXPECT_EQ(probe["listening"], "1") << "the store answers before the rank does anything";
      EXPECT_EQ(probe["bindable"], "0") << "the port is held by fsdprun, no other process can take it";
      EXPECT_EQ(probe["sockets"], "0") << "a rank inherits no socket of the launcher's store";
      if (a == 1) EXPECT_EQ(probe["previous_listening"], "0") << "attempt 0's store is closed before attempt 1";
      ports.push_back(std::stoi(probe["port"]));
    }
  }
  EXPECT_EQ(ports[0], ports[1]) << "both ranks of attempt 0 got the same port";
  EXPECT_EQ(ports[2], ports[3]) << "both ranks of attempt 1 got the same port";
  for (int port : ports)
    EXPECT_FALSE(launcher_test::accepts_connections("127.0.0.1", port)) << "port " << port << " served after exit";
  expect_no_survivors(4);
}

// With --master-port (multi-node, or a port the user chose) rank 0 serves the store there, as before: fsdprun
// holds no port and tells the ranks so.
TEST_F(LauncherTest, ExplicitMasterPortLeavesTheStoreToRankZero) {
  const int port = fsdp_test::free_loopback_port();
  const Finished f = run(cmd({"--nproc-per-node", "2", "--master-port", std::to_string(port)}, {"*:store,env"}));
  ASSERT_EQ(f.exit_code, 0) << f.err;
  for (int r = 0; r < 2; ++r) {
    const std::string name = "store.r" + std::to_string(r) + ".a0";
    ASSERT_TRUE(exists(name)) << name;
    auto probe = fields(read_text(dir_ / name));
    EXPECT_EQ(probe["port"], std::to_string(port));
    EXPECT_EQ(probe["listening"], "0") << read_text(dir_ / name);
    EXPECT_EQ(probe["bindable"], "1") << "rank 0 must be able to serve on it: " << read_text(dir_ / name);
    EXPECT_EQ(as_env(lines_by_rank(f.out).at(r))["TORCHELASTIC_USE_AGENT_STORE"], "False");
  }
}

// A --master-addr fsdprun cannot serve on: one clear line naming the address, no rank started, exit 1.
TEST_F(LauncherTest, StoreAddressThatCannotBeServedIsOneLine) {
  const Finished f = run(cmd({"--nproc-per-node", "2", "--master-addr", "192.0.2.1"}, {"*:env"}));
  EXPECT_EQ(f.exit_code, 1) << f.err;
  EXPECT_TRUE(contains(f.err, "fsdprun: error: cannot listen on --master-addr '192.0.2.1'")) << f.err;
  EXPECT_EQ(std::count(f.err.begin(), f.err.end(), '\n'), 1) << f.err;
  EXPECT_TRUE(files("start").empty()) << "no rank may start without a store";
}

// The race this design removes (seen once in the full suite): two standalone fsdprun started at the same instant
// got the same port, one group's rank 0 could not bind it, and the attempt was spent as a restart. Many jobs of real
// ranks (libfsdp's rendezvous and a Gloo all-reduce) started together, several rounds: every job succeeds at its
// first attempt with the analytic sum, and the jobs of a round (all running at once) served distinct ports.
class ConcurrentStandalone : public LauncherTest {};

TEST_F(ConcurrentStandalone, ManyJobsStartedAtOnceRendezvousWithoutARestart) {
  constexpr int kJobs = 8, kRanks = 2, kRounds = 3;
  const double expected_sum = kRanks * (kRanks + 1) / 2.0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<std::unique_ptr<Launcher>> jobs;
    for (int j = 0; j < kJobs; ++j) {
      const fs::path dir = dir_ / ("round" + std::to_string(round) + ".job" + std::to_string(j));
      fs::create_directories(dir);
      jobs.push_back(std::make_unique<Launcher>(
          std::vector<std::string>{"--nproc-per-node", std::to_string(kRanks), "--max-restarts", "1", "--timeout",
                                   "400", STORE_RANK_PATH},
          dir));
    }
    std::set<int> ports;
    for (int j = 0; j < kJobs; ++j) {
      const Finished f = jobs[static_cast<std::size_t>(j)]->wait(450);
      SCOPED_TRACE("job " + std::to_string(j) + " stderr:\n" + f.err);
      EXPECT_EQ(f.exit_code, 0);
      EXPECT_FALSE(contains(f.err, "restarting")) << "a restart was spent";
      const auto out = lines_by_rank(f.out);
      std::set<std::string> job_ports;
      for (int r = 0; r < kRanks; ++r) {
        ASSERT_EQ(out.count(r), 1u) << f.out;
        ASSERT_EQ(out.at(r).size(), 1u) << f.out;
        auto line = fields(out.at(r)[0]);
        EXPECT_EQ(std::stod(line["sum"]), expected_sum) << out.at(r)[0];
        EXPECT_EQ(line["restart"], "0") << out.at(r)[0];
        EXPECT_EQ(line["agent_store"], "True") << out.at(r)[0];
        job_ports.insert(line["port"]);
      }
      ASSERT_EQ(job_ports.size(), 1u) << "the ranks of one job got different ports";
      ports.insert(std::stoi(*job_ports.begin()));
    }
    EXPECT_EQ(ports.size(), static_cast<std::size_t>(kJobs)) << "jobs running at once shared a port";
    for (int port : ports)
      EXPECT_FALSE(launcher_test::accepts_connections("127.0.0.1", port)) << "port " << port << " still served";
  }
}

}  // namespace
