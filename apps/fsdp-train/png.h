#pragma once
// A minimal raster canvas and PNG encoder (zlib for the deflate stream) for `fsdp-train plot`: no plotting
// library, no Python. No torch headers.

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_train {

struct Rgb {
  uint8_t r, g, b;
};

class Canvas {
 public:
  Canvas(int width, int height, Rgb background = {255, 255, 255});
  int width() const { return w_; }
  int height() const { return h_; }
  void set(int x, int y, Rgb c);  // ignores points outside
  Rgb get(int x, int y) const;
  void line(double x0, double y0, double x1, double y1, Rgb c, int thickness = 1);
  void rect(int x0, int y0, int x1, int y1, Rgb c);  // outline
  // Text in a built-in 5x7 pixel font (digits, letters, . - + / : % and space), scaled by `scale`.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 1);
  static int text_width(const std::string& s, int scale = 1) { return static_cast<int>(s.size()) * 6 * scale; }
  const std::vector<uint8_t>& pixels() const { return px_; }  // RGB, row-major

 private:
  int w_, h_;
  std::vector<uint8_t> px_;
};

// PNG (8-bit RGB, no interlace) bytes of the canvas.
std::vector<uint8_t> encode_png(const Canvas& canvas);
void write_png(const std::string& path, const Canvas& canvas);

}  // namespace fsdp_train
