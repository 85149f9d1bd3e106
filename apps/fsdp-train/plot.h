#pragma once
// `fsdp-train plot <metrics.jsonl> <out.png|out.svg>`: the training curves as a grid of panels (loss with the
// validation loss overlaid, learning rate, tokens/s, memory; MoE runs add the expert load), and
// `fsdp-train plot-trace <trace.json>... <out.png|out.svg>`: a per-rank timeline of a Chrome trace, compute
// and communication in two colours. Drawn with cairo (plot_canvas.h). No torch headers.

#include <string>
#include <vector>

namespace fsdp_train {

// Where a drawn chart put things, in pixels of the output, so callers (and tests) can find each panel.
struct PlotPanel {
  std::string title;
  double x = 0, y = 0, width = 0, height = 0;  // the plot area (inside the frame); a trace row's bar band
  std::vector<std::string> series;             // the series drawn in it, legend order (only those with data)
  std::vector<int> points;                     // per series: points (metrics) or events (trace) drawn
  bool has_data() const { return !series.empty(); }
};
struct PlotFigure {
  int width = 0, height = 0;
  std::vector<PlotPanel> panels;
  int records = 0;  // metrics records with a "step" / trace events drawn
};

// Metrics panels, in this order, two per row, 560 x 340 pixels each under a 40-pixel header:
//   "Loss"           training loss (loss, #1f77b4) and validation loss (validation_loss, #ff7f0e)
//   "Learning rate"  lr (#2ca02c)
//   "Throughput"     tps (#d62728)
//   "Memory"         peak RSS of rank 0 (memory_gib, #9467bd), max over ranks (memory_max_gib, #8c564b, dashed),
//                    live tensor peak (tensor_peak_bytes, #e377c2)
//   "MoE expert load" (only when records carry expert_tokens_*) busiest expert / mean of the worst layer
//                    (#bcbd22), idlest expert / mean (#17becf)
// All against step on one shared step axis; a panel whose series are all absent says "no data". JSON null values
// (NaN / inf written by nlohmann::json) leave a gap. Throws, naming the file and line, on a malformed line or a
// wrongly typed field, and when no record has a "step".
PlotFigure plot_metrics(const std::string& jsonl_path, const std::string& out_path);

// Complete events ("ph": "X", or "B"/"E" pairs) of Chrome trace JSON files ({"traceEvents": [...]} or a bare
// array; ts and dur in microseconds, as PyTorch's profiler and Perfetto write them), one row per (file, pid, tid),
// named by the "process_name"/"thread_name" metadata events when present. Events whose name contains
// all_gather, reduce_scatter, all_reduce, all_to_all, allgather, reducescatter, allreduce, alltoall, send, recv,
// broadcast, wait, nccl, gloo, c10d or record_param_comms (case-insensitive) are communication (#e45756, drawn
// on top); the rest compute (#4c78a8). The time axis spans exactly the first start to the last end, in ms.
// Each row's panel is its bar band; its series are "compute" and "communication" (those with events).
// Throws naming the file (and line:column for JSON syntax errors, the event index otherwise) on bad input.
PlotFigure plot_trace(const std::vector<std::string>& trace_paths, const std::string& out_path);

}  // namespace fsdp_train
