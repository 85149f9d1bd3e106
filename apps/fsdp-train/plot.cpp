// Metric plots (see plot.h).
#include "plot.h"

#include "png.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace fsdp_train {
namespace {

std::string tick_label(double v) {
  char buf[32];
  const double a = std::abs(v);
  if (a != 0 && (a >= 1e5 || a < 1e-3)) std::snprintf(buf, sizeof buf, "%.2e", v);
  else if (a >= 100) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

void draw_panel(Canvas& c, const Series& s, int top, int height) {
  const Rgb axis{60, 60, 60}, grid{225, 225, 225}, ink{30, 90, 200}, title{0, 0, 0};
  const int left = 80, right = c.width() - 20, y0 = top + 28, y1 = top + height - 30;
  c.text(left, top + 8, s.title, title, 2);
  if (s.x.empty()) return;
  double xmin = *std::min_element(s.x.begin(), s.x.end()), xmax = *std::max_element(s.x.begin(), s.x.end());
  double ymin = *std::min_element(s.y.begin(), s.y.end()), ymax = *std::max_element(s.y.begin(), s.y.end());
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) {
    ymax += std::max(1e-9, std::abs(ymax) * 0.05);
    ymin -= std::max(1e-9, std::abs(ymin) * 0.05);
  }
  auto px = [&](double x) { return left + (x - xmin) / (xmax - xmin) * (right - left); };
  auto py = [&](double y) { return y1 - (y - ymin) / (ymax - ymin) * (y1 - y0); };
  for (int k = 0; k <= 4; ++k) {  // horizontal grid lines with value labels
    const double v = ymin + (ymax - ymin) * k / 4.0;
    const int y = static_cast<int>(std::lround(py(v)));
    c.line(left, y, right, y, grid);
    const std::string l = tick_label(v);
    c.text(left - 6 - Canvas::text_width(l), y - 3, l, axis);
  }
  for (int k = 0; k <= 5; ++k) {  // step labels
    const double v = xmin + (xmax - xmin) * k / 5.0;
    const std::string l = tick_label(std::round(v));
    const int x = static_cast<int>(std::lround(px(v)));
    c.line(x, y1, x, y1 + 4, axis);
    c.text(x - Canvas::text_width(l) / 2, y1 + 8, l, axis);
  }
  c.rect(left, y0, right, y1, axis);
  for (size_t i = 1; i < s.x.size(); ++i) c.line(px(s.x[i - 1]), py(s.y[i - 1]), px(s.x[i]), py(s.y[i]), ink, 2);
  if (s.x.size() == 1) c.line(px(s.x[0]) - 2, py(s.y[0]), px(s.x[0]) + 2, py(s.y[0]), ink, 3);
}

}  // namespace

void plot_series(const std::vector<Series>& series, const std::string& png_path, int width, int panel_height) {
  Canvas c(width, panel_height * static_cast<int>(series.size()));
  for (size_t i = 0; i < series.size(); ++i) draw_panel(c, series[i], static_cast<int>(i) * panel_height, panel_height);
  write_png(png_path, c);
}

int plot_metrics(const std::string& jsonl_path, const std::string& png_path) {
  std::ifstream in(jsonl_path);
  if (!in) throw std::runtime_error("plot: cannot open '" + jsonl_path + "'");
  Series loss{"loss (nats/token) vs step", {}, {}}, tps{"tokens/s per rank vs step", {}, {}}, lr{"learning rate vs step", {}, {}},
      val{"validation loss (nats/token) vs step", {}, {}};
  std::string line;
  int n = 0, lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error("plot: " + jsonl_path + ":" + std::to_string(lineno) + ": " + e.what());
    }
    if (!j.contains("step")) continue;
    const double step = j["step"].get<double>();
    if (j.contains("loss")) loss.x.push_back(step), loss.y.push_back(j["loss"].get<double>());
    if (j.contains("tps")) tps.x.push_back(step), tps.y.push_back(j["tps"].get<double>());
    if (j.contains("lr")) lr.x.push_back(step), lr.y.push_back(j["lr"].get<double>());
    if (j.contains("validation_loss")) val.x.push_back(step), val.y.push_back(j["validation_loss"].get<double>());
    ++n;
  }
  if (n == 0) throw std::runtime_error("plot: no records with a \"step\" in '" + jsonl_path + "'");
  std::vector<Series> panels = {loss, tps, lr};
  if (!val.x.empty()) panels.insert(panels.begin() + 1, val);  // [validation] enabled: under the training loss
  plot_series(panels, png_path);
  return n;
}

}  // namespace fsdp_train
