// plot.h in a build without cairo (apps/fsdp-train/CMakeLists.txt: cairo or pkg-config not found, e.g. the lent GPU
// machines, which carry only the trainer's other dependencies): the subcommands say what is missing.
#include "plot.h"

#include <stdexcept>

namespace fsdp_train {
namespace {

[[noreturn]] void no_cairo(const char* subcommand) {
  throw std::runtime_error(std::string("fsdp-train ") + subcommand + ": this build has no cairo (Debian: libcairo2-dev, "
                           "found through pkg-config); plot metrics.jsonl / the traces on a machine that has it");
}

}  // namespace

PlotFigure plot_metrics(const std::string&, const std::string&) { no_cairo("plot"); }
PlotFigure plot_trace(const std::vector<std::string>&, const std::string&) { no_cairo("plot-trace"); }

}  // namespace fsdp_train
