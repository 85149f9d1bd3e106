#pragma once
// `fsdp-train plot <metrics.jsonl> <out.png>`: line charts of loss, throughput and learning rate against step,
// rasterised with png.h. No torch headers.

#include <string>
#include <vector>

namespace fsdp_train {

struct Series {
  std::string title;
  std::vector<double> x, y;
};

// Reads metrics.jsonl records ({"step":..., "loss":..., "tps":..., "lr":...} and validation records
// {"step":..., "validation_loss":...}; other fields ignored) and writes a PNG with one panel per quantity (the
// validation loss only when there is one). Returns the number of records plotted; throws on an empty or unreadable file.
int plot_metrics(const std::string& jsonl_path, const std::string& png_path);

// One chart per series, stacked vertically.
void plot_series(const std::vector<Series>& series, const std::string& png_path, int width = 900, int panel_height = 260);

}  // namespace fsdp_train
