// cairo drawing for the plots (see plot_canvas.h).
#include "plot_canvas.h"

#include <cairo-svg.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace fsdp_train {
namespace {

constexpr Colour kFrame = rgb_hex(0x404040), kGrid = rgb_hex(0xE6E6E6), kTickText = rgb_hex(0x303030),
                 kLegendBorder = rgb_hex(0xA0A0A0), kWhite = rgb_hex(0xFFFFFF);
constexpr double kTitleSize = 14, kLabelSize = 12, kTickSize = 11, kLegendSize = 11;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void set_colour(cairo_t* cr, Colour c) { cairo_set_source_rgb(cr, c.r, c.g, c.b); }

void set_font(cairo_t* cr, double size, bool bold) {
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

}  // namespace

std::string lowercase(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

PlotCanvas::PlotCanvas(const std::string& out_path, int width, int height)
    : path_(out_path), width_(width), height_(height) {
  const std::string lower = lowercase(out_path);
  if (ends_with(lower, ".svg")) {
    svg_ = true;
    surface_.reset(cairo_svg_surface_create(out_path.c_str(), width, height));
  } else if (ends_with(lower, ".png")) {
    // RGB without alpha: a plot on a white page, and PNG viewers show it the same everywhere.
    surface_.reset(cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height));
  } else {
    throw std::runtime_error("plot: output '" + out_path + "' must end in .png or .svg");
  }
  if (cairo_surface_status(surface_.get()) != CAIRO_STATUS_SUCCESS)
    throw std::runtime_error("plot: cannot create '" + out_path +
                             "': " + cairo_status_to_string(cairo_surface_status(surface_.get())));
  cr_.reset(cairo_create(surface_.get()));
  set_colour(cr(), kWhite);
  cairo_paint(cr());
}

void PlotCanvas::text(double x, double y, const std::string& s, double size, Colour c, Align h, Align v, bool bold,
                      double angle) {
  cairo_t* g = cr();
  set_font(g, size, bold);
  cairo_text_extents_t te;
  cairo_text_extents(g, s.c_str(), &te);
  cairo_font_extents_t fe;
  cairo_font_extents(g, &fe);
  // Vertical placement from the font's ascent/descent rather than the string's ink, so that labels with and
  // without descenders share a baseline.
  const double dx = h == Align::kStart ? 0 : h == Align::kCentre ? -te.x_advance / 2 : -te.x_advance;
  const double dy = v == Align::kStart ? fe.ascent : v == Align::kCentre ? (fe.ascent - fe.descent) / 2 : -fe.descent;
  cairo_save(g);
  cairo_translate(g, x, y);
  cairo_rotate(g, angle);
  cairo_move_to(g, dx, dy);
  set_colour(g, c);
  cairo_show_text(g, s.c_str());
  cairo_restore(g);
}

double PlotCanvas::text_width(const std::string& s, double size, bool bold) const {
  set_font(cr(), size, bold);
  cairo_text_extents_t te;
  cairo_text_extents(cr(), s.c_str(), &te);
  return te.x_advance;
}

void PlotCanvas::line(double x0, double y0, double x1, double y1, Colour c, double width, bool dashed) {
  cairo_t* g = cr();
  cairo_save(g);
  set_colour(g, c);
  cairo_set_line_width(g, width);
  if (dashed) {
    const double dash[] = {6, 4};
    cairo_set_dash(g, dash, 2, 0);
  }
  cairo_move_to(g, x0, y0);
  cairo_line_to(g, x1, y1);
  cairo_stroke(g);
  cairo_restore(g);
}

void PlotCanvas::fill_rect(const Rect& r, Colour c) {
  set_colour(cr(), c);
  cairo_rectangle(cr(), r.x, r.y, r.w, r.h);
  cairo_fill(cr());
}

void PlotCanvas::stroke_rect(const Rect& r, Colour c, double width) {
  cairo_save(cr());
  set_colour(cr(), c);
  cairo_set_line_width(cr(), width);
  cairo_rectangle(cr(), r.x, r.y, r.w, r.h);
  cairo_stroke(cr());
  cairo_restore(cr());
}

void PlotCanvas::save() {
  if (cairo_status(cr()) != CAIRO_STATUS_SUCCESS)
    throw std::runtime_error("plot: drawing '" + path_ + "' failed: " + cairo_status_to_string(cairo_status(cr())));
  cairo_status_t status;
  if (svg_) {
    cairo_surface_finish(surface_.get());  // the SVG surface writes its file here
    status = cairo_surface_status(surface_.get());
  } else {
    cairo_surface_flush(surface_.get());
    status = cairo_surface_write_to_png(surface_.get(), path_.c_str());
  }
  if (status != CAIRO_STATUS_SUCCESS)
    throw std::runtime_error("plot: cannot write '" + path_ + "': " + cairo_status_to_string(status));
}

std::vector<double> nice_ticks(double lo, double hi, int target, double* step) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double s = 10 * mag;
  for (double m : {1.0, 2.0, 2.5, 5.0})
    if (m * mag >= raw * (1 - 1e-9)) {
      s = m * mag;
      break;
    }
  *step = s;
  std::vector<double> ticks;
  // Bounded: where the range is tiny against the values themselves, k + 1 == k in double precision.
  for (double k = std::ceil(lo / s - 1e-9); k * s <= hi + s * 1e-9 && ticks.size() < 50; k += 1)
    ticks.push_back(k * s == 0 ? 0 : k * s);
  return ticks;
}

std::string tick_label(double v, double step, double largest) {
  char buf[48];
  const int step_exp = static_cast<int>(std::floor(std::log10(step) + 1e-12));
  const double mantissa = step / std::pow(10.0, step_exp);
  const int extra = std::abs(mantissa - 2.5) < 1e-6 ? 1 : 0;  // 2.5 x 10^k needs one more digit
  const int decimals = std::max(0, -step_exp + extra);
  if (decimals > 4 || largest >= 1e6) {
    // Scientific, every tick of the axis with the mantissa digits the spacing needs at the largest magnitude.
    if (v == 0) return "0";
    const int largest_exp = largest > 0 ? static_cast<int>(std::floor(std::log10(largest) + 1e-12)) : step_exp;
    std::snprintf(buf, sizeof buf, "%.*e", std::clamp(largest_exp - step_exp + extra, 0, 6), v);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  }
  return buf;
}

void draw_axes(PlotCanvas& canvas, const Axes& axes, const AxisLabels& labels) {
  const Rect& a = axes.area;
  const double bottom = a.y + a.h, right = a.x + a.w;
  double xs = 1, ys = 1;
  const auto largest = [](const std::vector<double>& ticks) {
    double m = 0;
    for (double t : ticks) m = std::max(m, std::abs(t));
    return m;
  };
  const auto xt = nice_ticks(axes.x0, axes.x1, 6, &xs);
  for (double t : xt) {
    const double x = std::round(axes.px(t)) + 0.5;  // on the pixel grid: crisp 1-pixel lines
    canvas.line(x, a.y, x, bottom, kGrid);
    canvas.line(x, bottom, x, bottom + 4, kFrame);
    canvas.text(x, bottom + 6, tick_label(t, xs, largest(xt)), kTickSize, kTickText, Align::kCentre, Align::kStart);
  }
  double widest = 0;  // of the y tick labels: the y label goes left of them
  if (labels.y_ticks) {
    const auto yt = nice_ticks(axes.y0, axes.y1, 5, &ys);
    for (double t : yt) {
      const double y = std::round(axes.py(t)) + 0.5;
      const std::string label = tick_label(t, ys, largest(yt));
      canvas.line(a.x, y, right, y, kGrid);
      canvas.line(a.x - 4, y, a.x, y, kFrame);
      canvas.text(a.x - 6, y, label, kTickSize, kTickText, Align::kEnd, Align::kCentre);
      widest = std::max(widest, canvas.text_width(label, kTickSize));
    }
  }
  canvas.stroke_rect({std::round(a.x) + 0.5, std::round(a.y) + 0.5, std::round(a.w), std::round(a.h)}, kFrame);
  if (!labels.title.empty())
    canvas.text(a.x + a.w / 2, a.y - 8, labels.title, kTitleSize, rgb_hex(0x000000), Align::kCentre, Align::kEnd, true);
  if (!labels.xlabel.empty())
    canvas.text(a.x + a.w / 2, bottom + 22, labels.xlabel, kLabelSize, rgb_hex(0x000000), Align::kCentre, Align::kStart);
  if (!labels.ylabel.empty())
    canvas.text(std::max(4.0, a.x - 6 - widest - 8 - kLabelSize * 1.2), a.y + a.h / 2, labels.ylabel, kLabelSize, rgb_hex(0x000000), Align::kCentre, Align::kStart,
                false, -M_PI / 2);
}

Rect legend_size(const PlotCanvas& canvas, const std::vector<LegendEntry>& entries) {
  double w = 0;
  for (const auto& e : entries) w = std::max(w, canvas.text_width(e.name, kLegendSize));
  return {0, 0, w + 46, 8.0 + 17.0 * static_cast<double>(entries.size())};
}

Rect draw_legend(PlotCanvas& canvas, double x, double y, const std::vector<LegendEntry>& entries) {
  Rect r = legend_size(canvas, entries);
  r.x = std::round(x) + 0.5;
  r.y = std::round(y) + 0.5;
  canvas.fill_rect(r, kWhite);
  canvas.stroke_rect(r, kLegendBorder);
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    const double cy = r.y + 4 + 17.0 * static_cast<double>(i) + 8.5;
    if (e.box) canvas.fill_rect({r.x + 8, cy - 5, 24, 10}, e.colour);
    else canvas.line(r.x + 8, cy, r.x + 32, cy, e.colour, 2, e.dashed);
    canvas.text(r.x + 38, cy, e.name, kLegendSize, kTickText, Align::kStart, Align::kCentre);
  }
  return r;
}

}  // namespace fsdp_train
