// Canvas rasterisation and PNG encoding (see png.h).
#include "png.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace fsdp_train {
namespace {

struct Glyph {
  char ch;
  const char* rows[7];
};

// A 5x7 pixel font: enough for axis labels and titles.
constexpr Glyph kFont[] = {
    {'0', {"01110", "10001", "10011", "10101", "11001", "10001", "01110"}},
    {'1', {"00100", "01100", "00100", "00100", "00100", "00100", "01110"}},
    {'2', {"01110", "10001", "00001", "00010", "00100", "01000", "11111"}},
    {'3', {"11111", "00010", "00100", "00010", "00001", "10001", "01110"}},
    {'4', {"00010", "00110", "01010", "10010", "11111", "00010", "00010"}},
    {'5', {"11111", "10000", "11110", "00001", "00001", "10001", "01110"}},
    {'6', {"00110", "01000", "10000", "11110", "10001", "10001", "01110"}},
    {'7', {"11111", "00001", "00010", "00100", "01000", "01000", "01000"}},
    {'8', {"01110", "10001", "10001", "01110", "10001", "10001", "01110"}},
    {'9', {"01110", "10001", "10001", "01111", "00001", "00010", "01100"}},
    {'A', {"01110", "10001", "10001", "11111", "10001", "10001", "10001"}},
    {'B', {"11110", "10001", "10001", "11110", "10001", "10001", "11110"}},
    {'C', {"01110", "10001", "10000", "10000", "10000", "10001", "01110"}},
    {'D', {"11100", "10010", "10001", "10001", "10001", "10010", "11100"}},
    {'E', {"11111", "10000", "10000", "11110", "10000", "10000", "11111"}},
    {'F', {"11111", "10000", "10000", "11110", "10000", "10000", "10000"}},
    {'G', {"01110", "10001", "10000", "10111", "10001", "10001", "01111"}},
    {'H', {"10001", "10001", "10001", "11111", "10001", "10001", "10001"}},
    {'I', {"01110", "00100", "00100", "00100", "00100", "00100", "01110"}},
    {'J', {"00111", "00010", "00010", "00010", "00010", "10010", "01100"}},
    {'K', {"10001", "10010", "10100", "11000", "10100", "10010", "10001"}},
    {'L', {"10000", "10000", "10000", "10000", "10000", "10000", "11111"}},
    {'M', {"10001", "11011", "10101", "10101", "10001", "10001", "10001"}},
    {'N', {"10001", "10001", "11001", "10101", "10011", "10001", "10001"}},
    {'O', {"01110", "10001", "10001", "10001", "10001", "10001", "01110"}},
    {'P', {"11110", "10001", "10001", "11110", "10000", "10000", "10000"}},
    {'Q', {"01110", "10001", "10001", "10001", "10101", "10010", "01101"}},
    {'R', {"11110", "10001", "10001", "11110", "10100", "10010", "10001"}},
    {'S', {"01111", "10000", "10000", "01110", "00001", "00001", "11110"}},
    {'T', {"11111", "00100", "00100", "00100", "00100", "00100", "00100"}},
    {'U', {"10001", "10001", "10001", "10001", "10001", "10001", "01110"}},
    {'V', {"10001", "10001", "10001", "10001", "10001", "01010", "00100"}},
    {'W', {"10001", "10001", "10001", "10101", "10101", "10101", "01010"}},
    {'X', {"10001", "10001", "01010", "00100", "01010", "10001", "10001"}},
    {'Y', {"10001", "10001", "10001", "01010", "00100", "00100", "00100"}},
    {'Z', {"11111", "00001", "00010", "00100", "01000", "10000", "11111"}},
    {'.', {"00000", "00000", "00000", "00000", "00000", "01100", "01100"}},
    {',', {"00000", "00000", "00000", "00000", "01100", "00100", "01000"}},
    {'-', {"00000", "00000", "00000", "11111", "00000", "00000", "00000"}},
    {'+', {"00000", "00100", "00100", "11111", "00100", "00100", "00000"}},
    {'/', {"00000", "00001", "00010", "00100", "01000", "10000", "00000"}},
    {':', {"00000", "01100", "01100", "00000", "01100", "01100", "00000"}},
    {'%', {"11000", "11001", "00010", "00100", "01000", "10011", "00011"}},
    {'(', {"00010", "00100", "01000", "01000", "01000", "00100", "00010"}},
    {')', {"01000", "00100", "00010", "00010", "00010", "00100", "01000"}},
    {'=', {"00000", "00000", "11111", "00000", "11111", "00000", "00000"}},
    {'_', {"00000", "00000", "00000", "00000", "00000", "00000", "11111"}},
};

const Glyph* find_glyph(char c) {
  c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const auto& g : kFont)
    if (g.ch == c) return &g;
  return nullptr;  // space and unknown characters draw nothing
}

void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int k = 3; k >= 0; --k) out.push_back(static_cast<uint8_t>(v >> (8 * k)));
}

void put_chunk(std::vector<uint8_t>& out, const char* type, const std::vector<uint8_t>& data) {
  put_be32(out, static_cast<uint32_t>(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  const uLong crc = crc32(0L, out.data() + start, static_cast<uInt>(out.size() - start));
  put_be32(out, static_cast<uint32_t>(crc));
}

}  // namespace

Canvas::Canvas(int width, int height, Rgb bg) : w_(width), h_(height), px_(static_cast<size_t>(width) * height * 3) {
  for (size_t i = 0; i < px_.size(); i += 3) {
    px_[i] = bg.r;
    px_[i + 1] = bg.g;
    px_[i + 2] = bg.b;
  }
}

void Canvas::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
  const size_t i = (static_cast<size_t>(y) * w_ + x) * 3;
  px_[i] = c.r;
  px_[i + 1] = c.g;
  px_[i + 2] = c.b;
}

Rgb Canvas::get(int x, int y) const {
  const size_t i = (static_cast<size_t>(y) * w_ + x) * 3;
  return {px_[i], px_[i + 1], px_[i + 2]};
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, int thickness) {
  // Sample the segment densely (at most half a pixel apart); thickness paints a small square per sample.
  const double len = std::max(std::abs(x1 - x0), std::abs(y1 - y0));
  const int n = std::max(1, static_cast<int>(std::ceil(len * 2)));
  const int r0 = -(thickness - 1) / 2, r1 = thickness / 2;
  for (int i = 0; i <= n; ++i) {
    const double t = static_cast<double>(i) / n;
    const int x = static_cast<int>(std::lround(x0 + (x1 - x0) * t));
    const int y = static_cast<int>(std::lround(y0 + (y1 - y0) * t));
    for (int dy = r0; dy <= r1; ++dy)
      for (int dx = r0; dx <= r1; ++dx) set(x + dx, y + dy, c);
  }
}

void Canvas::rect(int x0, int y0, int x1, int y1, Rgb c) {
  line(x0, y0, x1, y0, c);
  line(x1, y0, x1, y1, c);
  line(x1, y1, x0, y1, c);
  line(x0, y1, x0, y0, c);
}

void Canvas::text(int x, int y, const std::string& s, Rgb c, int scale) {
  for (size_t k = 0; k < s.size(); ++k) {
    const Glyph* g = find_glyph(s[k]);
    if (!g) continue;
    const int gx = x + static_cast<int>(k) * 6 * scale;
    for (int row = 0; row < 7; ++row)
      for (int col = 0; col < 5; ++col)
        if (g->rows[row][col] == '1')
          for (int sy = 0; sy < scale; ++sy)
            for (int sx = 0; sx < scale; ++sx) set(gx + col * scale + sx, y + row * scale + sy, c);
  }
}

std::vector<uint8_t> encode_png(const Canvas& canvas) {
  const int w = canvas.width(), h = canvas.height();
  // Raw scanlines: a filter byte (0 = none) before each row of RGB.
  std::vector<uint8_t> raw;
  raw.reserve(static_cast<size_t>(h) * (1 + 3 * w));
  const auto& px = canvas.pixels();
  for (int y = 0; y < h; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), px.begin() + static_cast<ptrdiff_t>(y) * w * 3, px.begin() + static_cast<ptrdiff_t>(y + 1) * w * 3);
  }
  uLongf zlen = compressBound(static_cast<uLong>(raw.size()));
  std::vector<uint8_t> z(zlen);
  if (compress2(z.data(), &zlen, raw.data(), static_cast<uLong>(raw.size()), 9) != Z_OK)
    throw std::runtime_error("png: zlib compression failed");
  z.resize(zlen);

  std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, static_cast<uint32_t>(w));
  put_be32(ihdr, static_cast<uint32_t>(h));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit, truecolour RGB, deflate, filter 0, no interlace
  put_chunk(out, "IHDR", ihdr);
  put_chunk(out, "IDAT", z);
  put_chunk(out, "IEND", {});
  return out;
}

void write_png(const std::string& path, const Canvas& canvas) {
  const auto bytes = encode_png(canvas);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write '" + path + "'");
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("short write to '" + path + "'");
}

}  // namespace fsdp_train
