// Crash safety: 2 saving ranks (started directly, in their own process group) are killed with SIGKILL at a
// random moment while they save checkpoint after checkpoint (and purge old ones). After every kill, every
// complete checkpoint left behind must verify and hold exactly the values of its step; leftovers of the
// interrupted save are never taken for a complete checkpoint. CheckpointCrash.Quick runs 10 trials,
// CheckpointCrash.Many (label slow) 60.
#include <fsdp/checkpoint/checkpoint.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "loopback_port.h"
#include <torch/torch.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;

namespace {

// Starts `world` ranks of `ckpt_worker saveloop folder <world>` in a new process group; returns its id.
pid_t start_ranks(const std::string& folder, int world) {
  const int port = fsdp_test::free_loopback_port();
  pid_t group = 0;
  for (int r = 0; r < world; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, group);
      const std::string out = folder + ".rank" + std::to_string(r) + ".log";
      FILE* f = std::freopen(out.c_str(), "w", stdout);
      (void)f;
      ::dup2(STDOUT_FILENO, STDERR_FILENO);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      const std::string ws = std::to_string(world);
      ::execl(CKPT_WORKER, CKPT_WORKER, "saveloop", folder.c_str(), ws.c_str(), "-", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    if (r == 0) group = pid;
    ::setpgid(pid, group);
  }
  return group;
}

void check_folder(const std::string& folder, int trial) {
  const auto steps = ckpt::complete_steps(folder);
  for (int64_t step : steps) {
    const std::string dir = ckpt::step_path(folder, step);
    EXPECT_EQ(ckpt::verify(dir), std::vector<std::string>{}) << "trial " << trial << ": " << dir;
    EXPECT_EQ(ckpt::read_value(dir, "step"), std::to_string(step)) << dir;
    for (int i = 0; i < 3; ++i) {
      at::Tensor t = ckpt::read_tensor(dir, "t" + std::to_string(i));
      EXPECT_TRUE(torch::equal(t, torch::full({3000, 100}, static_cast<float>(step * 10 + i)))) << dir << " t" << i;
    }
  }
}

void run_trials(int trials) {
  const fs::path root = fs::temp_directory_path() / ("fsdp_ckpt_crash_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  std::mt19937 rng(12345);
  int with_checkpoint = 0, killed_mid_save = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const std::string folder = (root / ("t" + std::to_string(trial))).string();
    fs::create_directories(folder);
    const pid_t group = start_ranks(folder, 2);
    // Let it reach the saving loop (startup ~0.5 s), then kill at a random moment of it.
    const int delay_ms = 600 + static_cast<int>(rng() % 1500);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(-group, SIGKILL);
    while (::waitpid(-group, nullptr, 0) > 0) {
    }
    check_folder(folder, trial);
    if (!ckpt::complete_steps(folder).empty()) ++with_checkpoint;
    for (const auto& e : fs::directory_iterator(folder)) {
      if (e.path().filename().string().find(".partial") != std::string::npos) ++killed_mid_save;
    }
    fs::remove_all(folder);
  }
  std::cout << trials << " trials: " << with_checkpoint << " left complete checkpoints, " << killed_mid_save
            << " were killed in the middle of a save\n";
  EXPECT_GE(with_checkpoint, std::max(1, trials / 4)) << "the kills came too early to test anything";
  if (trials >= 50) EXPECT_GT(killed_mid_save, 0) << "no kill landed inside a save";  // ~20% of kills do
  fs::remove_all(root);
}

}  // namespace

TEST(CheckpointCrash, Quick) { run_trials(10); }
TEST(CheckpointCrash, Many) { run_trials(60); }
