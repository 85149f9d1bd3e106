// The PNG writer: a valid PNG (signature, IHDR, IDAT inflating to the canvas, CRCs) and plotted lines.
#include "plot.h"
#include "png.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <fstream>

using namespace fsdp_train;

namespace {
uint32_t be32(const uint8_t* p) { return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3]; }

// Parses the chunks, checks each CRC, and inflates IDAT into raw scanlines.
std::vector<uint8_t> decode_rgb(const std::vector<uint8_t>& png, int* w, int* h) {
  const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  EXPECT_EQ(std::vector<uint8_t>(png.begin(), png.begin() + 8), std::vector<uint8_t>(sig, sig + 8));
  size_t pos = 8;
  std::vector<uint8_t> idat;
  while (pos + 12 <= png.size()) {
    const uint32_t len = be32(&png[pos]);
    const std::string type(png.begin() + static_cast<long>(pos) + 4, png.begin() + static_cast<long>(pos) + 8);
    const uint8_t* data = &png[pos + 8];
    EXPECT_EQ(crc32(0, &png[pos + 4], len + 4), be32(data + len)) << type;
    if (type == "IHDR") {
      *w = static_cast<int>(be32(data));
      *h = static_cast<int>(be32(data + 4));
      EXPECT_EQ(data[8], 8);  // bit depth
      EXPECT_EQ(data[9], 2);  // RGB
    } else if (type == "IDAT") {
      idat.insert(idat.end(), data, data + len);
    }
    pos += 12 + len;
  }
  std::vector<uint8_t> raw(static_cast<size_t>(*h) * (1 + 3 * *w));
  uLongf n = raw.size();
  EXPECT_EQ(uncompress(raw.data(), &n, idat.data(), idat.size()), Z_OK);
  EXPECT_EQ(n, raw.size());
  std::vector<uint8_t> rgb;
  for (int y = 0; y < *h; ++y) {
    EXPECT_EQ(raw[static_cast<size_t>(y) * (1 + 3 * *w)], 0);  // filter: none
    rgb.insert(rgb.end(), raw.begin() + static_cast<long>(y) * (1 + 3 * *w) + 1, raw.begin() + static_cast<long>(y + 1) * (1 + 3 * *w));
  }
  return rgb;
}
}  // namespace

TEST(Png, EncodesTheCanvasLosslessly) {
  Canvas c(7, 5, {10, 20, 30});
  c.set(3, 2, {255, 0, 128});
  c.set(6, 4, {1, 2, 3});
  int w = 0, h = 0;
  const auto rgb = decode_rgb(encode_png(c), &w, &h);
  EXPECT_EQ(w, 7);
  EXPECT_EQ(h, 5);
  EXPECT_EQ(rgb, c.pixels());
}

TEST(Plot, MetricsFileBecomesAChartWithItsLine) {
  const std::string jsonl = ::testing::TempDir() + "/fsdp_train_metrics.jsonl", png = ::testing::TempDir() + "/fsdp_train_plot.png";
  {
    std::ofstream out(jsonl);
    for (int s = 1; s <= 50; ++s) out << "{\"step\": " << s << ", \"loss\": " << 5.0 / s << ", \"tps\": " << 1000 + s << ", \"lr\": 0.001}\n";
  }
  EXPECT_EQ(plot_metrics(jsonl, png), 50);
  std::ifstream in(png, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int w = 0, h = 0;
  const auto rgb = decode_rgb(bytes, &w, &h);
  ASSERT_EQ(w, 900);
  ASSERT_EQ(h, 3 * 260);
  // The loss curve's ink colour appears in the first panel.
  int ink = 0;
  for (int y = 0; y < 260; ++y)
    for (int x = 0; x < w; ++x) {
      const size_t i = (static_cast<size_t>(y) * w + x) * 3;
      ink += rgb[i] == 30 && rgb[i + 1] == 90 && rgb[i + 2] == 200;
    }
  EXPECT_GT(ink, 500);
  EXPECT_THROW(plot_metrics("/nonexistent.jsonl", png), std::runtime_error);
}
