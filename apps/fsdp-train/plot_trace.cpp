// The trace timeline (see plot.h): Chrome trace JSON -> one row of bars per (file, pid, tid), drawn with cairo.
#include "plot.h"

#include "plot_canvas.h"
#include "trace_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {
namespace {

constexpr Colour kCompute = rgb_hex(0x4C78A8), kComm = rgb_hex(0xE45756), kBand = rgb_hex(0xF2F2F2);
constexpr int kWidth = 1200, kHeader = 60, kRowPitch = 30, kBottom = 56;
constexpr double kBarHeight = 20, kRightColumn = 160, kMaxLabelWidth = 300;

// Collective and point-to-point names of c10d, NCCL, Gloo and PyTorch's profiler (record_param_comms wraps
// every c10d collective in PyTorch's traces), and waits on them.
constexpr const char* kCommunicationWords[] = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "allgather",
                                               "reducescatter", "allreduce", "alltoall", "send", "recv", "broadcast",
                                               "wait", "nccl", "gloo", "c10d", "record_param_comms"};

bool is_communication(const std::string& name) {
  const std::string lower = lowercase(name);
  // FSDP's copy-in / copy-out around an all-gather or reduce-scatter are local copies: compute.
  if (lower.find("copy_in") != std::string::npos || lower.find("copy_out") != std::string::npos) return false;
  for (const char* w : kCommunicationWords)
    if (lower.find(w) != std::string::npos) return true;
  return false;
}

// pid / tid: numbers (PyTorch, Chrome) or strings (some Kineto device rows); numbers sort numerically.
struct Id {
  bool is_number = false;
  double number = 0;
  std::string text;
};
// Numbers before strings; within each kind ascending.
bool id_less(const Id& a, const Id& b) {
  if (a.is_number != b.is_number) return a.is_number;
  return a.is_number ? a.number < b.number : a.text < b.text;
}
struct RowKey {
  size_t file;
  Id pid, tid;
  bool operator<(const RowKey& o) const {
    if (file != o.file) return file < o.file;
    if (id_less(pid, o.pid) || id_less(o.pid, pid)) return id_less(pid, o.pid);
    return id_less(tid, o.tid);
  }
};
struct ProcessKey {
  size_t file;
  Id pid;
  bool operator<(const ProcessKey& o) const {
    if (file != o.file) return file < o.file;
    return id_less(pid, o.pid);
  }
};

struct Span {
  double start, end;  // us
  bool communication;
};
struct Row {
  std::vector<Span> spans;
  std::vector<std::pair<double, std::string>> open;  // "B" events waiting for their "E"
};

class TraceReader {
 public:
  std::map<RowKey, Row> rows;
  std::map<ProcessKey, std::string> process_names;
  std::map<RowKey, std::string> thread_names;

  void read(size_t file_index, const std::string& path) {
    const TraceFile file = read_trace_file(path, "plot-trace");
    const nlohmann::json& events = file.events();
    for (size_t i = 0; i < events.size(); ++i) add_event(file_index, path, i, events[i]);
  }

 private:
  static Id id_of(const nlohmann::json& e, const char* key) {
    Id id;
    const auto it = e.find(key);
    if (it == e.end() || it->is_null()) return id;  // absent: one row for all such events
    if (it->is_number()) id.is_number = true, id.number = it->get<double>();
    else id.text = it->is_string() ? it->get<std::string>() : it->dump();
    return id;
  }

  void add_event(size_t file, const std::string& path, size_t index, const nlohmann::json& e) {
    const auto where = [&](const std::string& name) {
      return "plot-trace: " + path + ": traceEvents[" + std::to_string(index) + "]" +
             (name.empty() ? std::string() : " (\"" + name + "\")") + ": ";
    };
    if (!e.is_object()) throw std::runtime_error(where("") + "expected an event object, got " + e.type_name());
    const auto ph_it = e.find("ph");
    if (ph_it == e.end() || !ph_it->is_string()) throw std::runtime_error(where("") + "no \"ph\" (event type) string");
    const std::string ph = ph_it->get<std::string>();
    std::string name;
    if (const auto n = e.find("name"); n != e.end()) {
      if (!n->is_string()) throw std::runtime_error(where("") + "\"name\" is " + n->type_name() + ", expected a string");
      name = n->get<std::string>();
    }
    const RowKey key{file, id_of(e, "pid"), id_of(e, "tid")};
    const auto number = [&](const char* field) {
      const auto it = e.find(field);
      if (it == e.end() || !it->is_number())
        throw std::runtime_error(where(name) + "\"" + field + "\" " + (it == e.end() ? "missing" : "is not a number") +
                                 " in a \"" + ph + "\" event");
      return it->get<double>();
    };
    if (ph == "M") {  // metadata: row names
      const auto args = e.find("args");
      if (args == e.end() || !args->is_object() || !args->contains("name") || !(*args)["name"].is_string()) return;
      if (name == "process_name") process_names[{file, key.pid}] = (*args)["name"].get<std::string>();
      if (name == "thread_name") thread_names[key] = (*args)["name"].get<std::string>();
    } else if (ph == "X") {
      // Kineto's whole-window "PyTorch Profiler (0)" span (category "Trace") is the recording, not work.
      if (const auto cat = e.find("cat"); cat != e.end() && cat->is_string() && cat->get<std::string>() == "Trace") return;
      const double ts = number("ts"), dur = number("dur");
      if (dur < 0) throw std::runtime_error(where(name) + "negative \"dur\" " + std::to_string(dur));
      rows[key].spans.push_back({ts, ts + dur, is_communication(name)});
    } else if (ph == "B") {
      rows[key].open.emplace_back(number("ts"), name);
    } else if (ph == "E") {
      const double ts = number("ts");
      auto& open = rows[key].open;
      if (open.empty()) throw std::runtime_error(where(name) + "an \"E\" event without a \"B\" on its thread");
      const auto [start, begin_name] = open.back();
      open.pop_back();
      if (ts < start) throw std::runtime_error(where(name) + "ends before its \"B\" event starts");
      rows[key].spans.push_back({start, ts, is_communication(begin_name)});
    }
    // Other phases (instant, counter, flow, async) carry no duration on a thread: not drawn.
  }
};

std::string id_text(const Id& id) {
  if (!id.is_number) return id.text;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f", id.number);
  return buf;
}

// Total length of the union of the intervals (communication overlapping other communication counts once).
double union_length(std::vector<std::pair<double, double>> iv) {
  std::sort(iv.begin(), iv.end());
  double total = 0, cur_start = 0, cur_end = -1;
  bool open = false;
  for (const auto& [s, e] : iv) {
    if (open && s <= cur_end) {
      cur_end = std::max(cur_end, e);
    } else {
      if (open) total += cur_end - cur_start;
      cur_start = s, cur_end = e, open = true;
    }
  }
  if (open) total += cur_end - cur_start;
  return total;
}

}  // namespace

PlotFigure plot_trace(const std::vector<std::string>& trace_paths, const std::string& out_path) {
  if (trace_paths.empty()) throw std::runtime_error("plot-trace: no trace files given");
  TraceReader reader;
  for (size_t f = 0; f < trace_paths.size(); ++f) reader.read(f, trace_paths[f]);
  std::vector<std::pair<RowKey, const Row*>> rows;
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  int events = 0, comm_events = 0;
  for (const auto& [key, row] : reader.rows) {
    if (row.spans.empty()) continue;
    rows.emplace_back(key, &row);
    for (const auto& s : row.spans) {
      t0 = std::min(t0, s.start), t1 = std::max(t1, s.end);
      ++events;
      comm_events += s.communication;
    }
  }
  std::string names;
  for (const auto& p : trace_paths) names += (names.empty() ? "" : ", ") + std::filesystem::path(p).filename().string();
  if (rows.empty()) throw std::runtime_error("plot-trace: no complete (\"X\" or \"B\"/\"E\") events in " + names);

  const int height = kHeader + 12 + static_cast<int>(rows.size()) * kRowPitch + kBottom;
  PlotCanvas canvas(out_path, kWidth, height);
  std::vector<std::string> labels;
  double label_w = 0;
  for (const auto& [key, row] : rows) {
    std::string process = "pid " + id_text(key.pid), thread = "tid " + id_text(key.tid);
    if (const auto it = reader.process_names.find({key.file, key.pid}); it != reader.process_names.end()) process = it->second;
    if (const auto it = reader.thread_names.find(key); it != reader.thread_names.end()) thread = it->second;
    std::string label = process + " / " + thread;
    if (trace_paths.size() > 1) label = std::filesystem::path(trace_paths[key.file]).stem().string() + ": " + label;
    if (label.size() > 48) label = label.substr(0, 45) + "...";
    label_w = std::max(label_w, canvas.text_width(label, 11));
    labels.push_back(label);
  }
  label_w = std::min(label_w, kMaxLabelWidth);

  Axes axes;
  axes.area = {std::round(16 + label_w + 12), kHeader + 12.0, 0, static_cast<double>(rows.size()) * kRowPitch};
  axes.area.w = kWidth - axes.area.x - kRightColumn;
  axes.x0 = 0, axes.x1 = std::max((t1 - t0) / 1000.0, 1e-3);
  const auto to_px = [&](double us) { return axes.px((us - t0) / 1000.0); };

  for (size_t r = 0; r < rows.size(); r += 2)  // banded rows: easier to follow a row across a wide timeline
    canvas.fill_rect({axes.area.x, axes.area.y + static_cast<double>(r) * kRowPitch, axes.area.w, kRowPitch}, kBand);
  draw_axes(canvas, axes, {"", "time (ms) since the first event", "", /*y_ticks=*/false});

  PlotFigure figure;
  figure.width = kWidth, figure.height = height, figure.records = events;
  cairo_t* cr = canvas.cr();
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row& row = *rows[r].second;
    const double band_y = axes.area.y + static_cast<double>(r) * kRowPitch + (kRowPitch - kBarHeight) / 2;
    PlotPanel panel;
    panel.title = labels[r];
    panel.x = axes.area.x, panel.y = band_y, panel.width = axes.area.w, panel.height = kBarHeight;
    int n_compute = 0, n_comm = 0;
    std::vector<std::pair<double, double>> comm;
    double row_start = std::numeric_limits<double>::infinity(), row_end = -row_start;
    cairo_save(cr);
    cairo_rectangle(cr, axes.area.x, axes.area.y, axes.area.w, axes.area.h);
    cairo_clip(cr);
    // Compute first, communication on top: nested events overlap, and the communication is what we look for.
    for (const bool communication : {false, true})
      for (const auto& s : row.spans) {
        if (s.communication != communication) continue;
        const double x0 = to_px(s.start), w = std::max(to_px(s.end) - x0, 1.0);  // a short event stays visible
        canvas.fill_rect({x0, band_y, w, kBarHeight}, communication ? kComm : kCompute);
        (communication ? n_comm : n_compute) += 1;
        if (communication) comm.emplace_back(s.start, s.end);
        row_start = std::min(row_start, s.start), row_end = std::max(row_end, s.end);
      }
    cairo_restore(cr);
    if (n_compute > 0) panel.series.push_back("compute"), panel.points.push_back(n_compute);
    if (n_comm > 0) panel.series.push_back("communication"), panel.points.push_back(n_comm);
    const double mid = band_y + kBarHeight / 2;
    canvas.text(axes.area.x - 8, mid, labels[r], 11, rgb_hex(0x303030), Align::kEnd, Align::kCentre);
    const double comm_us = union_length(comm), span_us = row_end - row_start;
    char right[64];
    std::snprintf(right, sizeof right, "comm %.1f ms (%.0f%%)", comm_us / 1000.0, span_us > 0 ? 100.0 * comm_us / span_us : 0.0);
    canvas.text(axes.area.x + axes.area.w + 8, mid, right, 11, rgb_hex(0x303030), Align::kStart, Align::kCentre);
    figure.panels.push_back(panel);
  }

  char header[512];
  std::snprintf(header, sizeof header, "Trace timeline: %s  (%d events, %d communication, %zu rows, %.1f ms)",
                names.c_str(), events, comm_events, rows.size(), (t1 - t0) / 1000.0);
  canvas.text(16, 20, header, 14, rgb_hex(0x000000), Align::kStart, Align::kCentre, true);
  const std::vector<LegendEntry> legend = {{"compute", kCompute, true}, {"communication", kComm, true}};
  const Rect size = legend_size(canvas, legend);
  draw_legend(canvas, kWidth - size.w - 16, 6, legend);
  canvas.save();
  return figure;
}

}  // namespace fsdp_train
