// fsdp-train plot / plot-trace: the images are read back with cairo's PNG reader and looked at: their size, each
// panel's series drawn in its documented colour inside that panel only and running the right way, "no data"
// for a panel without data, the trace's events at their times in their rows; bad input names file and line.
#include "plot.h"

#include <cairo.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>

using namespace fsdp_train;

namespace {

struct Rgb {
  int r, g, b;
};
// The colours plot.h documents (matplotlib's tab10 and the trace's two).
constexpr Rgb kLossBlue{0x1F, 0x77, 0xB4}, kValOrange{0xFF, 0x7F, 0x0E}, kLrGreen{0x2C, 0xA0, 0x2C},
    kTpsRed{0xD6, 0x27, 0x28}, kMemPurple{0x94, 0x67, 0xBD}, kMemMaxBrown{0x8C, 0x56, 0x4B},
    kMoeOlive{0xBC, 0xBD, 0x22}, kNoDataGrey{0x80, 0x80, 0x80}, kCompute{0x4C, 0x78, 0xA8}, kComm{0xE4, 0x57, 0x56};

struct SurfaceDeleter {
  void operator()(cairo_surface_t* s) const { cairo_surface_destroy(s); }
};

// A PNG read back through cairo (an independent decoder of what was written).
class Image {
 public:
  explicit Image(const std::string& path) : s_(cairo_image_surface_create_from_png(path.c_str())) {
    if (cairo_surface_status(s_.get()) != CAIRO_STATUS_SUCCESS)
      throw std::runtime_error("cannot read " + path + ": " + cairo_status_to_string(cairo_surface_status(s_.get())));
    cairo_surface_flush(s_.get());
  }
  int width() const { return cairo_image_surface_get_width(s_.get()); }
  int height() const { return cairo_image_surface_get_height(s_.get()); }
  Rgb at(int x, int y) const {
    const auto* row = cairo_image_surface_get_data(s_.get()) + static_cast<ptrdiff_t>(y) * cairo_image_surface_get_stride(s_.get());
    const uint32_t p = reinterpret_cast<const uint32_t*>(row)[x];  // RGB24 / ARGB32: native-endian 0x..RRGGBB
    return {static_cast<int>((p >> 16) & 0xFF), static_cast<int>((p >> 8) & 0xFF), static_cast<int>(p & 0xFF)};
  }
  // Pixels within `tol` per channel of c in [x0, x1) x [y0, y1), and the mean y of those pixels.
  int count(double x0, double y0, double x1, double y1, Rgb c, int tol = 24, double* mean_y = nullptr) const {
    int n = 0;
    double ysum = 0;
    for (int y = std::max(0, static_cast<int>(y0)); y < std::min(height(), static_cast<int>(y1)); ++y)
      for (int x = std::max(0, static_cast<int>(x0)); x < std::min(width(), static_cast<int>(x1)); ++x) {
        const Rgb p = at(x, y);
        if (std::abs(p.r - c.r) <= tol && std::abs(p.g - c.g) <= tol && std::abs(p.b - c.b) <= tol) ++n, ysum += y;
      }
    if (mean_y) *mean_y = n ? ysum / n : -1;
    return n;
  }
  int count_in(const PlotPanel& p, Rgb c, int tol = 24) const { return count(p.x, p.y, p.x + p.width, p.y + p.height, c, tol); }

 private:
  std::unique_ptr<cairo_surface_t, SurfaceDeleter> s_;
};

std::string temp(const std::string& name) { return ::testing::TempDir() + "/fsdp_plot_" + name; }

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

// 100 logged steps: a decaying loss, a warmup-then-flat lr, tokens/s, memory; validation every 25 steps.
std::string synthetic_metrics(bool with_validation, bool with_memory, bool with_moe) {
  std::ostringstream out;
  for (int s = 1; s <= 100; ++s) {
    const double loss = 1.0 + 4.0 * std::exp(-s / 25.0);
    out << "{\"step\": " << s << ", \"loss\": " << loss << ", \"lr\": " << 1e-3 * std::min(1.0, s / 20.0)
        << ", \"tps\": " << 5000 + 300 * std::sin(s / 7.0);
    if (with_memory) out << ", \"memory_gib\": " << 0.30 + 0.001 * s << ", \"memory_max_gib\": " << 0.32 + 0.001 * s;
    if (with_moe) out << ", \"expert_tokens_min\": [10, 20], \"expert_tokens_max\": [" << 90 - s % 10 << ", 60], \"expert_tokens_mean\": 40";
    out << "}\n";
    if (with_validation && s % 25 == 0)
      out << "{\"step\": " << s << ", \"validation_loss\": " << loss + 0.2 << ", \"validation_perplexity\": 9.0}\n";
  }
  return out.str();
}

const PlotPanel& panel(const PlotFigure& f, const std::string& title) {
  for (const auto& p : f.panels)
    if (p.title == title) return p;
  throw std::runtime_error("no panel " + title);
}

}  // namespace

TEST(PlotMetrics, EveryPanelShowsItsSeriesInItsOwnArea) {
  const std::string jsonl = temp("metrics.jsonl"), png = temp("metrics.png");
  write_file(jsonl, synthetic_metrics(true, true, false));
  const PlotFigure f = plot_metrics(jsonl, png);
  EXPECT_EQ(f.records, 104);  // 100 steps + 4 validation records
  const Image img(png);
  // plot.h: two 560 x 340 panels per row under a 40-pixel header; four panels = two rows.
  EXPECT_EQ(img.width(), 1120);
  EXPECT_EQ(img.height(), 40 + 2 * 340);
  ASSERT_EQ(f.panels.size(), 4u);
  EXPECT_EQ(f.panels[0].title, "Loss");
  EXPECT_EQ(f.panels[1].title, "Learning rate");
  EXPECT_EQ(f.panels[2].title, "Throughput");
  EXPECT_EQ(f.panels[3].title, "Memory");
  for (const auto& p : f.panels) {  // each plot area inside its grid cell
    const int i = static_cast<int>(&p - f.panels.data());
    EXPECT_GE(p.x, (i % 2) * 560);
    EXPECT_LE(p.x + p.width, (i % 2 + 1) * 560);
    EXPECT_GE(p.y, 40 + (i / 2) * 340);
    EXPECT_LE(p.y + p.height, 40 + (i / 2 + 1) * 340);
  }
  const PlotPanel &loss = f.panels[0], &lr = f.panels[1], &tps = f.panels[2], &mem = f.panels[3];
  EXPECT_EQ(loss.series, (std::vector<std::string>{"training loss", "validation loss"}));
  EXPECT_EQ(loss.points, (std::vector<int>{100, 4}));
  // Each series is drawn (hundreds of pixels for a 2-pixel line across ~450 pixels) inside its panel.
  EXPECT_GT(img.count_in(loss, kLossBlue), 300);
  EXPECT_GT(img.count_in(loss, kValOrange), 40);  // 4 dots and the 3 segments between them
  EXPECT_GT(img.count_in(lr, kLrGreen), 300);
  EXPECT_GT(img.count_in(tps, kTpsRed), 300);
  EXPECT_GT(img.count_in(mem, kMemPurple), 150);
  EXPECT_GT(img.count_in(mem, kMemMaxBrown), 150);  // dashed
  // ... and in no other panel (the legend's samples sit inside the loss and memory panels only).
  EXPECT_EQ(img.count_in(lr, kLossBlue) + img.count_in(tps, kLossBlue) + img.count_in(mem, kLossBlue), 0);
  EXPECT_EQ(img.count_in(loss, kLrGreen) + img.count_in(tps, kLrGreen) + img.count_in(mem, kLrGreen), 0);
  EXPECT_EQ(img.count_in(loss, kTpsRed) + img.count_in(lr, kTpsRed) + img.count_in(mem, kTpsRed), 0);
  // The right way up: the loss falls (its pixels low on the right, y grows downwards), the lr warms up.
  double left_y = 0, right_y = 0;
  ASSERT_GT(img.count(loss.x, loss.y, loss.x + loss.width * 0.1, loss.y + loss.height, kLossBlue, 24, &left_y), 0);
  ASSERT_GT(img.count(loss.x + loss.width * 0.9, loss.y, loss.x + loss.width, loss.y + loss.height, kLossBlue, 24, &right_y), 0);
  EXPECT_LT(left_y, loss.y + loss.height * 0.3);
  EXPECT_GT(right_y, loss.y + loss.height * 0.7);
  ASSERT_GT(img.count(lr.x, lr.y, lr.x + lr.width * 0.05, lr.y + lr.height, kLrGreen, 24, &left_y), 0);
  ASSERT_GT(img.count(lr.x + lr.width * 0.5, lr.y, lr.x + lr.width, lr.y + lr.height, kLrGreen, 24, &right_y), 0);
  EXPECT_GT(left_y, lr.y + lr.height * 0.7);
  EXPECT_LT(right_y, lr.y + lr.height * 0.3);
  // Text was rendered (the header, titles, tick labels): dark pixels above the first panel's plot area.
  EXPECT_GT(img.count(0, 0, 1120, 40, {0, 0, 0}, 60), 100);
}

TEST(PlotMetrics, PanelWithoutDataSaysSoAndMoeAddsAPanel) {
  const std::string jsonl = temp("sparse.jsonl"), png = temp("sparse.png");
  write_file(jsonl, synthetic_metrics(/*validation=*/false, /*memory=*/false, /*moe=*/true));
  const PlotFigure f = plot_metrics(jsonl, png);
  const Image img(png);
  ASSERT_EQ(f.panels.size(), 5u);  // + "MoE expert load": three rows
  EXPECT_EQ(img.height(), 40 + 3 * 340);
  const PlotPanel &loss = panel(f, "Loss"), &mem = panel(f, "Memory"), &moe = panel(f, "MoE expert load");
  EXPECT_EQ(loss.series, std::vector<std::string>{"training loss"});  // no validation: the training loss alone
  EXPECT_EQ(img.count_in(loss, kValOrange), 0);
  EXPECT_FALSE(mem.has_data());
  EXPECT_EQ(img.count_in(mem, kMemPurple) + img.count_in(mem, kMemMaxBrown), 0);
  // "no data" in grey, centred in the empty plot area.
  const double cx = mem.x + mem.width / 2, cy = mem.y + mem.height / 2;
  EXPECT_GT(img.count(cx - 50, cy - 15, cx + 50, cy + 15, kNoDataGrey, 40), 30);
  EXPECT_EQ(img.count(mem.x, mem.y, mem.x + mem.width, cy - 20, kNoDataGrey, 40), 0);
  EXPECT_TRUE(moe.has_data());
  EXPECT_GT(img.count_in(moe, kMoeOlive), 300);
}

TEST(PlotMetrics, SvgOutput) {
  const std::string jsonl = temp("svg.jsonl"), svg = temp("metrics.svg");
  write_file(jsonl, synthetic_metrics(true, true, false));
  const PlotFigure f = plot_metrics(jsonl, svg);
  std::ifstream in(svg);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("width=\"1120pt\""), std::string::npos) << text.substr(0, 300);
  EXPECT_EQ(f.width, 1120);
  EXPECT_GT(text.size(), 10000u);  // paths of four panels and their glyphs
}

TEST(PlotMetrics, BadInputNamesFileAndLine) {
  const std::string jsonl = temp("bad.jsonl"), png = temp("bad.png");
  const auto message = [&](const std::string& content, const std::string& out) {
    write_file(jsonl, content);
    try {
      plot_metrics(jsonl, out);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string m = message("{\"step\": 1, \"loss\": 2}\n\n{\"step\": 2, \"loss\": 1.9\n", png);
  EXPECT_NE(m.find(jsonl + ":3:"), std::string::npos) << m;
  m = message("{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": \"low\"}\n", png);
  EXPECT_NE(m.find(jsonl + ":2:"), std::string::npos) << m;
  EXPECT_NE(m.find("\"loss\" is string"), std::string::npos) << m;
  m = message("[1, 2]\n", png);
  EXPECT_NE(m.find(jsonl + ":1: expected a JSON object"), std::string::npos) << m;
  m = message("{\"loss\": 2}\n", png);
  EXPECT_NE(m.find("no records with a \"step\""), std::string::npos) << m;
  m = message("{\"step\": 1, \"loss\": 2}\n", temp("plot.jpg"));
  EXPECT_NE(m.find("must end in .png or .svg"), std::string::npos) << m;
  // A NaN loss is written by nlohmann::json as null: a gap in the curve, not an error.
  m = message("{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": null}\n{\"step\": 3, \"loss\": 1.5}\n", png);
  EXPECT_EQ(m, "no error");
  EXPECT_THROW(plot_metrics("/nonexistent/metrics.jsonl", png), std::runtime_error);
}

namespace {
// Two ranks (pids 100 and 101) as PyTorch's profiler writes them, one file each; times in us.
// Rank r: ProfilerStep (the whole step, compute) encloses aten::mm, then nccl:all_gather, then aten::addmm; a
// second thread runs c10d::reduce_scatter_ as a B/E pair.
std::string synthetic_trace(int rank) {
  const int pid = 100 + rank, o = rank * 500;  // rank 1 starts 0.5 ms later
  std::ostringstream t;
  t << "{\"traceEvents\": [\n"
    << "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " << pid << ", \"args\": {\"name\": \"rank " << rank << "\"}},\n"
    << "{\"ph\": \"X\", \"name\": \"ProfilerStep#1\", \"pid\": " << pid << ", \"tid\": 1, \"ts\": " << 1000 + o << ", \"dur\": 12000},\n"
    << "{\"ph\": \"X\", \"name\": \"aten::mm\", \"pid\": " << pid << ", \"tid\": 1, \"ts\": " << 1000 + o << ", \"dur\": 4000},\n"
    << "{\"ph\": \"X\", \"name\": \"nccl:all_gather\", \"pid\": " << pid << ", \"tid\": 1, \"ts\": " << 5000 + o << ", \"dur\": 2000},\n"
    << "{\"ph\": \"X\", \"name\": \"aten::addmm\", \"pid\": " << pid << ", \"tid\": 1, \"ts\": " << 7000 + o << ", \"dur\": 3000},\n"
    << "{\"ph\": \"B\", \"name\": \"c10d::reduce_scatter_\", \"pid\": " << pid << ", \"tid\": 2, \"ts\": " << 10000 + o << "},\n"
    << "{\"ph\": \"E\", \"pid\": " << pid << ", \"tid\": 2, \"ts\": " << 12500 + o << "},\n"
    << "{\"ph\": \"i\", \"name\": \"marker\", \"pid\": " << pid << ", \"tid\": 1, \"ts\": 3000, \"s\": \"t\"}\n"
    << "]}\n";
  return t.str();
}
}  // namespace

TEST(PlotTrace, RowsPerRankAndThreadWithEventsAtTheirTimes) {
  const std::string t0 = temp("rank0.json"), t1 = temp("rank1.json"), png = temp("trace.png");
  write_file(t0, synthetic_trace(0));
  write_file(t1, synthetic_trace(1));
  const PlotFigure f = plot_trace({t0, t1}, png);
  const Image img(png);
  EXPECT_EQ(img.width(), f.width);
  EXPECT_EQ(img.height(), f.height);
  EXPECT_EQ(img.width(), 1200);
  EXPECT_EQ(f.records, 10);  // 4 X + 1 B/E per rank; metadata and instants are not drawn
  ASSERT_EQ(f.panels.size(), 4u);  // (rank 0, tid 1), (rank 0, tid 2), (rank 1, tid 1), (rank 1, tid 2)
  EXPECT_EQ(f.panels[0].title, "fsdp_plot_rank0: rank 0 / tid 1");
  EXPECT_EQ(f.panels[3].title, "fsdp_plot_rank1: rank 1 / tid 2");
  EXPECT_EQ(f.panels[0].series, (std::vector<std::string>{"compute", "communication"}));
  EXPECT_EQ(f.panels[0].points, (std::vector<int>{3, 1}));
  EXPECT_EQ(f.panels[1].series, std::vector<std::string>{"communication"});
  // The axis spans the first start (1000 us) to the last end (13000 + 500 us); the colour at the middle of each
  // event's interval in its row, computed here from the event times.
  const double first = 1000, last = 13500;
  const auto colour_at = [&](const PlotPanel& p, double us) {
    return img.at(static_cast<int>(p.x + (us - first) / (last - first) * p.width), static_cast<int>(p.y + p.height / 2));
  };
  const auto same = [](Rgb a, Rgb b) { return std::abs(a.r - b.r) <= 8 && std::abs(a.g - b.g) <= 8 && std::abs(a.b - b.b) <= 8; };
  for (int r = 0; r < 2; ++r) {
    const PlotPanel &main = f.panels[2 * r], &side = f.panels[2 * r + 1];
    const double o = 500.0 * r;
    EXPECT_TRUE(same(colour_at(main, 3000 + o), kCompute)) << r;  // aten::mm
    EXPECT_TRUE(same(colour_at(main, 6000 + o), kComm)) << r;     // nccl:all_gather, over ProfilerStep
    EXPECT_TRUE(same(colour_at(main, 8500 + o), kCompute)) << r;  // aten::addmm
    EXPECT_TRUE(same(colour_at(main, 11500 + o), kCompute)) << r;  // ProfilerStep alone
    EXPECT_TRUE(same(colour_at(side, 11000 + o), kComm)) << r;    // the B/E reduce-scatter
    EXPECT_FALSE(same(colour_at(side, 5000 + o), kComm)) << r;    // nothing there on the side thread
    EXPECT_FALSE(same(colour_at(side, 5000 + o), kCompute)) << r;
  }
  // Rank 1's all-gather starts later than rank 0's: a column where rank 0 communicates and rank 1 computes.
  EXPECT_TRUE(same(colour_at(f.panels[0], 5200), kComm));
  EXPECT_TRUE(same(colour_at(f.panels[2], 5200), kCompute));
}

TEST(PlotTrace, BadInputNamesFileAndWhere) {
  const std::string trace = temp("bad_trace.json"), png = temp("bad_trace.png");
  const auto message = [&](const std::string& content) {
    write_file(trace, content);
    try {
      plot_trace({trace}, png);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string m = message("{\"traceEvents\": [\n{\"ph\": \"X\", \"ts\": 1, \"dur\": 2},\n{\"ph\": \"X\" \"ts\": 1}\n]}\n");
  EXPECT_NE(m.find(trace + ":3:"), std::string::npos) << m;
  m = message("{\"traceEvents\": [{\"ph\": \"X\", \"name\": \"a\", \"ts\": 1, \"dur\": 2}, {\"ph\": \"X\", \"name\": \"b\", \"ts\": 5}]}");
  EXPECT_NE(m.find(trace + ": traceEvents[1] (\"b\"): \"dur\" missing"), std::string::npos) << m;
  m = message("{\"traceEvents\": [{\"ph\": \"E\", \"ts\": 5}]}");
  EXPECT_NE(m.find("traceEvents[0]: an \"E\" event without a \"B\""), std::string::npos) << m;
  m = message("{\"traceEvents\": [{\"ph\": \"i\", \"ts\": 5}]}");
  EXPECT_NE(m.find("no complete"), std::string::npos) << m;
  m = message("{\"events\": []}");
  EXPECT_NE(m.find("expected a Chrome trace"), std::string::npos) << m;
}

// A real trace: PyTorch FSDP2 on 2 CPU ranks under PyTorch's profiler (scripts/trace_example.py). The test reads
// the two files itself: every complete event is drawn, one row per (rank, thread) named by the metadata, and
// each Gloo collective (gloo:all_gather, gloo:all_reduce) long enough to span a few pixels is red at its middle.
TEST(PlotTrace, PyTorchFsdp2ProfilerTrace) {
  const std::string dir = temp("pytorch_trace");
  std::filesystem::remove_all(dir);
  const std::string cmd = "MASTER_PORT=" + std::to_string(20000 + getpid() % 20000) + " " + FSDP_TEST_PYTHON + " " +
                          FSDP_SOURCE_DIR + "/scripts/trace_example.py " + dir + " > " + dir + ".log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "see " << dir << ".log";
  const std::vector<std::string> files = {dir + "/rank0.json", dir + "/rank1.json"};
  const std::string png = temp("pytorch_trace.png");
  const PlotFigure f = plot_trace(files, png);
  const Image img(png);

  struct Event {
    std::string row;
    double start, end;
  };
  std::vector<Event> gloo;
  std::map<std::string, int> rows;  // label -> X events
  double first = 1e300, last = -1e300;
  int complete = 0;
  for (size_t r = 0; r < files.size(); ++r) {
    std::ifstream in(files[r]);
    const auto j = nlohmann::json::parse(in);
    std::map<std::string, std::string> process, thread;
    for (const auto& e : j["traceEvents"]) {
      if (e.value("ph", "") != "M") continue;
      if (e["name"] == "process_name") process[e["pid"].dump()] = e["args"]["name"];
      if (e["name"] == "thread_name") thread[e["pid"].dump() + "/" + e["tid"].dump()] = e["args"]["name"];
    }
    for (const auto& e : j["traceEvents"]) {
      if (e.value("ph", "") != "X") continue;
      if (e.value("cat", "") == "Trace") continue;  // Kineto's span of the whole recording: documented as not drawn
      const std::string pid = e["pid"].dump(), tid = e["tid"].dump();
      const auto unquote = [](std::string s) { return s.size() > 1 && s[0] == '"' ? s.substr(1, s.size() - 2) : s; };
      const std::string p = process.count(pid) ? process[pid] : "pid " + unquote(pid);
      const std::string t = thread.count(pid + "/" + tid) ? thread[pid + "/" + tid] : "tid " + unquote(tid);
      const std::string label = "rank" + std::to_string(r) + ": " + p + " / " + t;
      const double ts = e["ts"].get<double>(), end = ts + e["dur"].get<double>();
      first = std::min(first, ts), last = std::max(last, end);
      ++rows[label], ++complete;
      const std::string name = e["name"];
      if (name == "gloo:all_gather" || name == "gloo:all_reduce") gloo.push_back({label, ts, end});
    }
  }
  EXPECT_EQ(f.records, complete);
  ASSERT_EQ(f.panels.size(), rows.size());
  std::map<std::string, const PlotPanel*> by_title;
  for (const auto& p : f.panels) by_title[p.title] = &p;
  for (const auto& [label, n] : rows) {
    ASSERT_TRUE(by_title.count(label)) << label;
    int drawn = 0;
    for (int k : by_title[label]->points) drawn += k;
    EXPECT_EQ(drawn, n) << label;
  }
  std::map<std::string, int> checked;  // per rank
  for (const auto& e : gloo) {
    const PlotPanel& p = *by_title.at(e.row);
    if ((e.end - e.start) / (last - first) * p.width < 4) continue;  // too narrow to sample its middle cleanly
    const Rgb c = img.at(static_cast<int>(p.x + ((e.start + e.end) / 2 - first) / (last - first) * p.width),
                         static_cast<int>(p.y + p.height / 2));
    EXPECT_TRUE(std::abs(c.r - kComm.r) <= 8 && std::abs(c.g - kComm.g) <= 8 && std::abs(c.b - kComm.b) <= 8)
        << e.row << " at " << e.start;
    ++checked[e.row.substr(0, 5)];
  }
  EXPECT_GE(checked["rank0"], 2);
  EXPECT_GE(checked["rank1"], 2);
}
