// Command line of fsdprun (torchrun-compatible subset).
#pragma once

#include <string>
#include <variant>
#include <vector>

namespace fsdprun {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: fsdprun serves the store, on a fresh port per attempt (standalone, nnodes == 1 only)
  int max_restarts = 0;
  double timeout_s = 0;     // wall-clock bound on the whole job, 0 = none
  double kill_grace_s = 3;  // SIGTERM -> SIGKILL escalation delay
  bool prefix_output = true;
  // TORCHELASTIC_RUN_ID of every rank: the library refuses a rendezvous store of another run (a second job on the
  // same port). --rdzv-id, else random per job with --nnodes 1, else "none" (nodes must agree; pass --rdzv-id).
  std::string run_id;
  std::vector<std::string> command;  // the program and its own arguments, untouched

  int world_size() const { return nnodes * nproc_per_node; }
  int global_rank(int local_rank) const { return node_rank * nproc_per_node + local_rank; }
};

// Parses argv. Parsing stops at the first positional argument (the program), so the program's own flags pass
// through. Returns the options, or the exit code to return when the run ends here (--help: 0, usage error: 2;
// the message has already been printed).
std::variant<LaunchOptions, int> parse_options(int argc, char** argv);

}  // namespace fsdprun
