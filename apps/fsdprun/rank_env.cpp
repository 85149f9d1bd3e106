#include "rank_env.h"

#include <map>

extern char** environ;

namespace fsdprun {

std::vector<std::string> build_rank_environment(const LaunchOptions& opts, int local_rank, int master_port,
                                                int restart_count, bool launcher_serves_store) {
  const std::map<std::string, std::string> ours = {
      {"RANK", std::to_string(opts.global_rank(local_rank))},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(opts.world_size())},
      {"LOCAL_WORLD_SIZE", std::to_string(opts.nproc_per_node)},
      {"GROUP_RANK", std::to_string(opts.node_rank)},
      {"MASTER_ADDR", opts.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(opts.max_restarts)},
      {"TORCHELASTIC_RUN_ID", opts.run_id},
      {"TORCHELASTIC_USE_AGENT_STORE", launcher_serves_store ? "True" : "False"},
  };
  std::vector<std::string> env;
  bool has_omp = false;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    if (ours.count(key) != 0) continue;  // a stale value from an outer launcher must not leak through
    has_omp = has_omp || key == "OMP_NUM_THREADS";
    env.push_back(entry);
  }
  for (const auto& [key, value] : ours) env.push_back(key + "=" + value);
  // torchrun does the same: N ranks each using every core would oversubscribe the machine.
  if (!has_omp) env.push_back("OMP_NUM_THREADS=1");
  return env;
}

}  // namespace fsdprun
