// The environment one rank is started with: the launcher's own, plus torchrun's variables.
#pragma once

#include <string>
#include <vector>

#include "options.h"

namespace fsdprun {

// Returns "KEY=VALUE" entries: the launcher's environment with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID and
// TORCHELASTIC_USE_AGENT_STORE ("True" when the launcher serves the store at MASTER_PORT, torchrun's spelling)
// replaced, and OMP_NUM_THREADS=1 added unless the launcher's environment already sets it.
std::vector<std::string> build_rank_environment(const LaunchOptions& opts, int local_rank, int master_port,
                                                int restart_count, bool launcher_serves_store);

}  // namespace fsdprun
