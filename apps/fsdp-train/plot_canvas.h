#pragma once
// The drawing layer of `fsdp-train plot` and `plot-trace`: a cairo surface chosen by the output name (.png: an
// RGB image written with cairo's PNG writer; .svg: cairo's SVG surface), text in fontconfig's sans-serif font
// through cairo's toy text API, and the pieces every chart needs (a framed plot area with "nice" ticks, a
// title, axis labels, a legend). Internal to fsdp-train; no torch headers.

#include "trace_file.h"

#include <cairo.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_train {

struct Colour {
  double r, g, b;  // 0..1
};
// 0xRRGGBB -> Colour (the series colours are matplotlib's "tab10" palette, what people expect from a plot).
constexpr Colour rgb_hex(unsigned v) {
  return {((v >> 16) & 0xFF) / 255.0, ((v >> 8) & 0xFF) / 255.0, (v & 0xFF) / 255.0};
}

struct Rect {
  double x = 0, y = 0, w = 0, h = 0;
};

enum class Align { kStart, kCentre, kEnd };

class PlotCanvas {
 public:
  // Throws when `out_path` ends in neither .png nor .svg, or the SVG file cannot be created. White background.
  PlotCanvas(const std::string& out_path, int width, int height);
  cairo_t* cr() const { return cr_.get(); }
  int width() const { return width_; }
  int height() const { return height_; }

  // Text whose anchor (x, y) sits at the given alignment of its box; angle in radians (-pi/2: reads upwards).
  void text(double x, double y, const std::string& s, double size, Colour c, Align h = Align::kStart,
            Align v = Align::kStart, bool bold = false, double angle = 0);
  double text_width(const std::string& s, double size, bool bold = false) const;
  void line(double x0, double y0, double x1, double y1, Colour c, double width = 1, bool dashed = false);
  void fill_rect(const Rect& r, Colour c);
  void stroke_rect(const Rect& r, Colour c, double width = 1);

  // Writes the PNG / completes the SVG; throws with the path when that fails. Call once, after drawing.
  void save();

 private:
  struct SurfaceDeleter {
    void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
  };
  struct ContextDeleter {
    void operator()(cairo_t* c) const { cairo_destroy(c); }
  };
  std::string path_;
  bool svg_ = false;
  int width_, height_;
  std::unique_ptr<cairo_surface_t, SurfaceDeleter> surface_;
  std::unique_ptr<cairo_t, ContextDeleter> cr_;
};

// Axis tick positions inside [lo, hi] at 1, 2, 2.5 or 5 x 10^k, about `target` of them; *step = their spacing.
std::vector<double> nice_ticks(double lo, double hi, int target, double* step);
// A tick's label with as many decimals as the spacing needs ("0.25", "12000"); scientific ("7.5e-04") for tiny
// spacings or values of a million and more, with the same mantissa digits on the whole axis (`largest`: the
// largest |tick| of the axis).
std::string tick_label(double v, double step, double largest);

// A linear data -> pixel mapping of a plot area.
struct Axes {
  Rect area;
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;  // data range shown
  double px(double x) const { return area.x + (x - x0) / (x1 - x0) * area.w; }
  double py(double y) const { return area.y + area.h - (y - y0) / (y1 - y0) * area.h; }
};

struct AxisLabels {
  std::string title, xlabel, ylabel;
  bool y_ticks = true;  // false: the caller labels the rows itself (the trace timeline)
};
// Title above the area, light grid lines and labelled ticks on both axes, axis labels, the frame.
void draw_axes(PlotCanvas& canvas, const Axes& axes, const AxisLabels& labels);

struct LegendEntry {
  std::string name;
  Colour colour;
  bool box = false;     // a filled box (bars) rather than a line sample
  bool dashed = false;  // matches a dashed series
};
// A framed legend whose top-left corner is (x, y); returns its size.
Rect draw_legend(PlotCanvas& canvas, double x, double y, const std::vector<LegendEntry>& entries);
Rect legend_size(const PlotCanvas& canvas, const std::vector<LegendEntry>& entries);

// json_error_reason: trace_file.h (the trace reader needs it in a build without cairo too).

// The lowercase copy of s (series and event names are matched case-insensitively).
std::string lowercase(std::string s);

}  // namespace fsdp_train
