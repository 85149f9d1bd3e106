// The metrics plot (see plot.h): metrics.jsonl -> a grid of cairo-drawn panels.
#include "plot.h"

#include "plot_canvas.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <utility>

namespace fsdp_train {
namespace {

constexpr int kPanelWidth = 560, kPanelHeight = 340, kHeaderHeight = 40, kColumns = 2;
// The plot area inside a panel: room on the left for tick labels and the rotated y label, at the top for the
// title, at the bottom for tick labels and the x label.
constexpr double kAreaLeft = 84, kAreaRight = 20, kAreaTop = 34, kAreaBottom = 52;
constexpr int kMarkerMaxPoints = 40;  // sparse series (validation every N steps) also get a dot per point
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct MetricSeries {
  MetricSeries(std::string n, Colour c, bool d = false) : name(std::move(n)), colour(c), dashed(d) {}
  std::string name;
  Colour colour;
  bool dashed;
  std::vector<double> x, y;  // y NaN = a gap (the record had null: NaN or inf in the run)
  bool has_data() const {
    return std::any_of(y.begin(), y.end(), [](double v) { return std::isfinite(v); });
  }
};

struct PanelSpec {
  PanelSpec(std::string t, std::string y, std::vector<const MetricSeries*> s)
      : title(std::move(t)), ylabel(std::move(y)), series(std::move(s)) {}
  std::string title, ylabel;
  std::vector<const MetricSeries*> series;
  double reference = kNaN;  // a dashed grey horizontal line (the balanced expert load, 1.0)
  std::string reference_name;
};

// One metrics.jsonl line's fields; errors name the file and line.
class RecordReader {
 public:
  RecordReader(const std::string& path, int line, const nlohmann::json& j) : path_(path), line_(line), j_(j) {}
  std::string where() const { return "plot: " + path_ + ":" + std::to_string(line_) + ": "; }
  // false when absent; NaN for null; throws when not a number.
  bool number(const char* key, double* out) const {
    const auto it = j_.find(key);
    if (it == j_.end()) return false;
    if (it->is_null()) *out = kNaN;
    else if (it->is_number()) *out = it->get<double>();
    else throw std::runtime_error(where() + "\"" + key + "\" is " + it->type_name() + ", expected a number");
    return true;
  }
  bool numbers(const char* key, std::vector<double>* out) const {
    const auto it = j_.find(key);
    if (it == j_.end()) return false;
    if (!it->is_array()) throw std::runtime_error(where() + "\"" + key + "\" is " + it->type_name() + ", expected an array");
    out->clear();
    for (const auto& v : *it) {
      if (v.is_null()) out->push_back(kNaN);
      else if (v.is_number()) out->push_back(v.get<double>());
      else throw std::runtime_error(where() + "\"" + key + "\" holds a " + v.type_name() + ", expected numbers");
    }
    return true;
  }

 private:
  const std::string& path_;
  int line_;
  const nlohmann::json& j_;
};

Rect plot_area(int index) {
  const double cx = (index % kColumns) * kPanelWidth, cy = kHeaderHeight + (index / kColumns) * kPanelHeight;
  return {cx + kAreaLeft, cy + kAreaTop, kPanelWidth - kAreaLeft - kAreaRight, kPanelHeight - kAreaTop - kAreaBottom};
}

// The legend goes into the corner of the plot area that covers the fewest data points.
Rect legend_corner(const PlotCanvas& canvas, const Axes& axes, const std::vector<LegendEntry>& entries,
                   const std::vector<const MetricSeries*>& series) {
  const Rect size = legend_size(canvas, entries);
  const Rect& a = axes.area;
  const std::array<Rect, 4> corners = {Rect{a.x + a.w - size.w - 8, a.y + 8, size.w, size.h},
                                       Rect{a.x + 8, a.y + 8, size.w, size.h},
                                       Rect{a.x + a.w - size.w - 8, a.y + a.h - size.h - 8, size.w, size.h},
                                       Rect{a.x + 8, a.y + a.h - size.h - 8, size.w, size.h}};
  size_t best = 0, best_count = std::numeric_limits<size_t>::max();
  for (size_t c = 0; c < corners.size(); ++c) {
    size_t count = 0;
    for (const auto* s : series)
      for (size_t i = 0; i < s->x.size(); ++i) {
        const double px = axes.px(s->x[i]), py = axes.py(s->y[i]);
        count += std::isfinite(s->y[i]) && px >= corners[c].x && px <= corners[c].x + corners[c].w &&
                 py >= corners[c].y && py <= corners[c].y + corners[c].h;
      }
    if (count < best_count) best = c, best_count = count;
  }
  return corners[best];
}

PlotPanel draw_panel(PlotCanvas& canvas, const PanelSpec& spec, int index, double xmin, double xmax) {
  PlotPanel out;
  out.title = spec.title;
  Axes axes;
  axes.area = plot_area(index);
  out.x = axes.area.x, out.y = axes.area.y, out.width = axes.area.w, out.height = axes.area.h;
  axes.x0 = xmin, axes.x1 = xmax;

  double ymin = std::numeric_limits<double>::infinity(), ymax = -ymin;
  std::vector<const MetricSeries*> drawn;
  for (const auto* s : spec.series) {
    if (!s->has_data()) continue;
    drawn.push_back(s);
    for (double v : s->y)
      if (std::isfinite(v)) ymin = std::min(ymin, v), ymax = std::max(ymax, v);
  }
  if (drawn.empty()) {
    draw_axes(canvas, axes, {spec.title, "step", spec.ylabel, /*y_ticks=*/false});
    canvas.text(axes.area.x + axes.area.w / 2, axes.area.y + axes.area.h / 2, "no data", 16, rgb_hex(0x808080),
                Align::kCentre, Align::kCentre);
    return out;
  }
  if (std::isfinite(spec.reference)) ymin = std::min(ymin, spec.reference), ymax = std::max(ymax, spec.reference);
  // 5% of the range as a margin so that the curve does not run along the frame; a flat series gets +-5%.
  const double pad = ymax > ymin ? 0.05 * (ymax - ymin) : std::max(1e-12, 0.05 * std::abs(ymax));
  axes.y0 = ymin - pad, axes.y1 = ymax + pad;
  draw_axes(canvas, axes, {spec.title, "step", spec.ylabel, true});

  cairo_t* cr = canvas.cr();
  cairo_save(cr);
  cairo_rectangle(cr, axes.area.x, axes.area.y, axes.area.w, axes.area.h);
  cairo_clip(cr);
  if (std::isfinite(spec.reference))
    canvas.line(axes.area.x, axes.py(spec.reference), axes.area.x + axes.area.w, axes.py(spec.reference),
                rgb_hex(0x7F7F7F), 1.5, true);
  for (const auto* s : drawn) {
    cairo_set_source_rgb(cr, s->colour.r, s->colour.g, s->colour.b);
    cairo_set_line_width(cr, 2);
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    if (s->dashed) {
      const double dash[] = {6, 4};
      cairo_set_dash(cr, dash, 2, 0);
    } else {
      cairo_set_dash(cr, nullptr, 0, 0);
    }
    bool pen_down = false;  // a non-finite value lifts the pen: a gap, not a line through it
    int points = 0;
    for (size_t i = 0; i < s->x.size(); ++i) {
      if (!std::isfinite(s->y[i])) {
        pen_down = false;
        continue;
      }
      ++points;
      if (pen_down) cairo_line_to(cr, axes.px(s->x[i]), axes.py(s->y[i]));
      else cairo_move_to(cr, axes.px(s->x[i]), axes.py(s->y[i]));
      pen_down = true;
    }
    cairo_stroke(cr);
    if (points <= kMarkerMaxPoints)
      for (size_t i = 0; i < s->x.size(); ++i) {
        if (!std::isfinite(s->y[i])) continue;
        cairo_new_sub_path(cr);
        cairo_arc(cr, axes.px(s->x[i]), axes.py(s->y[i]), 3, 0, 2 * M_PI);
        cairo_fill(cr);
      }
    out.series.push_back(s->name);
    out.points.push_back(points);
  }
  cairo_restore(cr);

  std::vector<LegendEntry> entries;
  for (const auto* s : drawn) entries.push_back({s->name, s->colour, false, s->dashed});
  if (std::isfinite(spec.reference)) entries.push_back({spec.reference_name, rgb_hex(0x7F7F7F), false, true});
  if (entries.size() >= 2) {
    const Rect at = legend_corner(canvas, axes, entries, drawn);
    draw_legend(canvas, at.x, at.y, entries);
  }
  return out;
}

}  // namespace

PlotFigure plot_metrics(const std::string& jsonl_path, const std::string& out_path) {
  std::ifstream in(jsonl_path);
  if (!in) throw std::runtime_error("plot: cannot open '" + jsonl_path + "'");
  MetricSeries loss{"training loss", rgb_hex(0x1F77B4)}, val{"validation loss", rgb_hex(0xFF7F0E)},
      lr{"learning rate", rgb_hex(0x2CA02C)}, tps{"tokens/s per rank", rgb_hex(0xD62728)},
      mem{"peak RSS, rank 0", rgb_hex(0x9467BD)}, mem_max{"peak RSS, max over ranks", rgb_hex(0x8C564B), true},
      tensors{"live tensors, step peak", rgb_hex(0xE377C2)}, moe_max{"busiest expert / mean", rgb_hex(0xBCBD22)},
      moe_min{"idlest expert / mean", rgb_hex(0x17BECF)};
  std::string text;
  int records = 0, lineno = 0;
  double xmin = std::numeric_limits<double>::infinity(), xmax = -xmin;
  while (std::getline(in, text)) {
    ++lineno;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw std::runtime_error("plot: " + jsonl_path + ":" + std::to_string(lineno) + ":" + std::to_string(e.byte) +
                               ": not JSON: " + json_error_reason(e.what()));
    }
    const RecordReader r(jsonl_path, lineno, j);
    if (!j.is_object()) throw std::runtime_error(r.where() + "expected a JSON object, got " + j.type_name());
    double step = 0, v = 0;
    if (!r.number("step", &step)) continue;  // not a step record
    if (!std::isfinite(step)) throw std::runtime_error(r.where() + "\"step\" is null");
    ++records;
    xmin = std::min(xmin, step), xmax = std::max(xmax, step);
    const auto add = [&](MetricSeries& s, double value) { s.x.push_back(step), s.y.push_back(value); };
    if (r.number("loss", &v)) add(loss, v);
    if (r.number("validation_loss", &v)) add(val, v);
    if (r.number("lr", &v)) add(lr, v);
    if (r.number("tps", &v)) add(tps, v);
    if (r.number("memory_gib", &v)) add(mem, v);
    if (r.number("memory_max_gib", &v)) add(mem_max, v);
    if (r.number("tensor_peak_bytes", &v) && !(v < 0)) add(tensors, v / (1024.0 * 1024 * 1024));
    std::vector<double> mins, maxs;
    double mean = 0;
    if (r.numbers("expert_tokens_max", &maxs) && r.numbers("expert_tokens_min", &mins) &&
        r.number("expert_tokens_mean", &mean)) {
      // The most unbalanced layer: its busiest expert and (over all layers) the idlest, against an even split.
      double worst = kNaN, idlest = kNaN;
      if (mean > 0 && !maxs.empty()) {
        worst = *std::max_element(maxs.begin(), maxs.end()) / mean;
        idlest = mins.empty() ? kNaN : *std::min_element(mins.begin(), mins.end()) / mean;
      }
      add(moe_max, worst);
      add(moe_min, idlest);
    }
  }
  if (records == 0) throw std::runtime_error("plot: no records with a \"step\" in '" + jsonl_path + "'");
  char header[512];
  std::snprintf(header, sizeof header, "fsdp-train: %s  (%d records, steps %.0f to %.0f)",
                std::filesystem::path(jsonl_path).filename().c_str(), records, xmin, xmax);
  if (xmax == xmin) xmin -= 1, xmax += 1;  // one step: an axis around it

  std::vector<PanelSpec> specs = {{"Loss", "nats / token", {&loss, &val}},
                                  {"Learning rate", "lr", {&lr}},
                                  {"Throughput", "tokens / s per rank", {&tps}},
                                  {"Memory", "GiB", {&mem, &mem_max, &tensors}}};
  if (!moe_max.x.empty()) {
    PanelSpec moe{"MoE expert load", "tokens / mean per expert", {&moe_max, &moe_min}};
    moe.reference = 1.0;
    moe.reference_name = "balanced (1.0)";
    specs.push_back(moe);
  }
  const int rows = (static_cast<int>(specs.size()) + kColumns - 1) / kColumns;
  PlotCanvas canvas(out_path, kColumns * kPanelWidth, kHeaderHeight + rows * kPanelHeight);
  canvas.text(16, kHeaderHeight / 2.0, header, 15, rgb_hex(0x000000), Align::kStart, Align::kCentre, true);

  PlotFigure figure;
  figure.width = canvas.width(), figure.height = canvas.height(), figure.records = records;
  for (size_t i = 0; i < specs.size(); ++i)
    figure.panels.push_back(draw_panel(canvas, specs[i], static_cast<int>(i), xmin, xmax));
  canvas.save();
  return figure;
}

}  // namespace fsdp_train
