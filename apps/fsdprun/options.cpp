#include "options.h"

#include <CLI/CLI.hpp>

#include <iostream>
#include <random>
#include <sstream>

namespace fsdprun {
namespace {

constexpr const char* kFooter = R"(Environment set for every rank (as torchrun does):
  RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (= node rank), MASTER_ADDR, MASTER_PORT,
  TORCHELASTIC_RESTART_COUNT (restart attempt, 0 first), TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
  TORCHELASTIC_USE_AGENT_STORE, and OMP_NUM_THREADS=1 unless it is already set (like torchrun: N ranks on
  one host would otherwise oversubscribe the cores).
With --nnodes 1 and no --master-port fsdprun serves the rendezvous store itself (c10d's TCPStore, like
torchrun's agent), a fresh one for every attempt on a port the kernel picks; the ranks connect to it as
clients (TORCHELASTIC_USE_AGENT_STORE=True). With --master-port rank 0 serves it there.
Every rank runs in its own process group. When a rank fails, the others get SIGTERM and, after
--kill-grace seconds, SIGKILL (whole process groups, so grandchildren too). SIGINT/SIGTERM/SIGHUP sent to
fsdprun are forwarded to every rank.
Exit status: 0 if every rank exited 0; else the first failing rank's exit code (128+N for a death by
signal N); 124 on --timeout; 127 if the program cannot be executed; 128+N when fsdprun got signal N.)";

void validate(const LaunchOptions& o) {
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw CLI::ValidationError("--node-rank", "must be in [0, --nnodes) but is " + std::to_string(o.node_rank) +
                                                  " with --nnodes " + std::to_string(o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw CLI::ValidationError("--master-port", "is required when --nnodes > 1 (every node must agree on it)");
  if (o.command.empty()) throw CLI::ValidationError("program", "missing: usage is fsdprun [options] prog args...");
  if (o.command.front().size() > 1 && o.command.front()[0] == '-')
    throw CLI::ValidationError(o.command.front(), "unknown option (fsdprun options go before the program)");
}

}  // namespace

std::variant<LaunchOptions, int> parse_options(int argc, char** argv) {
  LaunchOptions o;
  CLI::App app{"fsdprun [options] prog [prog-args...]\n"
               "Starts N ranks of prog with torchrun's environment, prefixes their output, and stops them all "
               "when one fails.",
               "fsdprun"};
  // Everything from the first positional on belongs to the program, including its own --flags.
  app.prefix_command();
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node, "ranks on this node (default 1)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", o.nnodes, "number of nodes (default 1)")->check(CLI::Range(1, 65536));
  app.add_option("--node-rank,--node_rank", o.node_rank, "index of this node, 0..nnodes-1 (default 0)");
  app.add_option("--master-addr,--master_addr", o.master_addr, "address of rank 0 (default 127.0.0.1)");
  app.add_option("--master-port,--master_port", o.master_port,
                 "port of rank 0's store; required when --nnodes > 1, otherwise fsdprun serves the store on a port "
                 "the kernel picks")
      ->check(CLI::Range(1, 65535));
  app.add_flag("--standalone", "accepted for torchrun compatibility; implied by --nnodes 1");
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "restart the whole group at most K times after a failure (default 0)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--timeout", o.timeout_s, "wall-clock limit in seconds for the whole job, 0 = none (exit 124)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--kill-grace", o.kill_grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks (default 3)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--rdzv-id,--rdzv_id,--run-id", o.run_id,
                 "job id given to every rank as TORCHELASTIC_RUN_ID; ranks refuse a store of another run (default: "
                 "random per job with --nnodes 1, \"none\" otherwise)");
  bool no_prefix = false;
  app.add_flag("--no-prefix", no_prefix, "pass the ranks' output through unchanged instead of prefixing \"[rank N] \"");
  app.footer(kFooter);

  try {
    app.parse(argc, argv);
    o.command = app.remaining();
    if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
    o.prefix_output = !no_prefix;
    validate(o);
    if (o.run_id.empty() && o.nnodes == 1) {
      std::random_device rd;
      std::ostringstream id;
      id << "fsdprun-" << std::hex << rd() << rd();
      o.run_id = id.str();
    } else if (o.run_id.empty()) {
      o.run_id = "none";  // torchrun's default; the nodes of one job must agree
    }
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help or "error: ..." plus a hint
    return code == 0 ? 0 : 2;
  }
  return o;
}

}  // namespace fsdprun
