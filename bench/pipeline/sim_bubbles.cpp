// The simulator's bubble fraction of the two-stages-per-rank schedules side by side (bench/RESULTS.md, issue 37):
// fsdp::pipeline::simulate with unit costs (F = 1, B = 2, I = W = 1, no latency; an OVERLAP_F_B costs its F + B)
// on the lowered lists, for each (pp, microbatches) given, one markdown row per schedule.
//   fsdp-bench-pp-sim [--pp 2 4 8] [--microbatches 8 16 32] [--schedules Interleaved1F1B ZBVZeroBubble DualPipeV]
#include <fsdp/pipeline/schedule.h>

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  namespace pl = fsdp::pipeline;
  std::vector<int> pps{2, 4, 8}, microbatches{8, 16, 32};
  std::vector<std::string> schedules{"Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"};
  CLI::App app{"simulated bubble fraction per schedule (unit costs)"};
  app.add_option("--pp", pps, "pipeline ranks");
  app.add_option("--microbatches", microbatches, "microbatches per step");
  app.add_option("--schedules", schedules, "torch's schedule names (2 stages per rank)");
  CLI11_PARSE(app, argc, argv);
  std::printf("| schedule | pp | microbatches | bubble fraction | makespan (F = 1) |\n|---|---|---|---|---|\n");
  for (int pp : pps) {
    for (int m : microbatches) {
      for (const std::string& name : schedules) {
        try {
          const pl::PipelineSchedule s = pl::build_schedule({pl::parse_schedule_name(name), pp, 2, m});
          const pl::SimResult r = pl::simulate(s, pl::SimCosts{});
          std::printf("| %s | %d | %d | %.4f | %.0f |\n", name.c_str(), pp, m, r.bubble_fraction, r.makespan);
        } catch (const c10::Error& e) {  // e.g. DualPipeV with fewer microbatches than stages
          std::printf("| %s | %d | %d | refused | |\n", name.c_str(), pp, m);
        }
      }
    }
  }
  return 0;
}
