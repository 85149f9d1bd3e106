// See metrics.h.
#include "metrics.h"
#include "trace_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace fsdp_train {

int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      int64_t kb = 0;
      ss >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

namespace {
std::string thousands(double v) {
  std::string s = std::to_string(static_cast<int64_t>(std::llround(v)));
  for (int i = static_cast<int>(s.size()) - 3; i > 0 && s[static_cast<size_t>(i - 1)] != '-'; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}
}  // namespace

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(std::llround(s));
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(t / 3600), static_cast<long long>(t / 60 % 60));
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(t / 60), static_cast<long long>(t % 60));
  else std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(t));
  return buf;
}

std::string format_log_line(const StepMetrics& m) {
  char memory[120];
  if (m.device_memory) {
    char pct[24] = "";
    if (m.mem_max_reserved_pct >= 0) std::snprintf(pct, sizeof pct, "(%.2f%%)", m.mem_max_reserved_pct);
    std::snprintf(memory, sizeof memory, "%.2fGiB%s (max %.2fGiB) active %.2fGiB", m.mem_gib, pct, m.mem_max_gib,
                  m.mem_max_active_gib);
  } else {
    std::snprintf(memory, sizeof memory, "%.2fGiB (max %.2fGiB)", m.mem_gib, m.mem_max_gib);
  }
  char buf[480];
  std::snprintf(buf, sizeof buf,
                "step: %4lld  loss: %8.4f  grad_norm: %7.3f  lr: %.2e  memory: %s  tps: %s  "
                "tflops: %.3f  mfu: %.1f%%  elapsed: %s  eta: %s",
                static_cast<long long>(m.step), m.loss, m.grad_norm, m.lr, memory,
                thousands(m.tps).c_str(), m.tflops, m.mfu, format_duration(m.elapsed_s).c_str(),
                format_duration(m.eta_s).c_str());
  std::string line = buf;
  if (!m.expert_tokens_max.empty() && m.expert_tokens_mean > 0) {
    // The busiest expert of the most unbalanced layer against an even split (1.00 = balanced).
    double worst = 0;
    for (double v : m.expert_tokens_max) worst = std::max(worst, v / m.expert_tokens_mean);
    char moe[64];
    std::snprintf(moe, sizeof moe, "  expert load max/mean: %.2f", worst);
    line += moe;
  }
  if (m.device_memory && m.mem_alloc_retries > 0)
    line += "  alloc retries: " + std::to_string(m.mem_alloc_retries);  // TorchTitan warns on these too
  if (!m.ft_replicas.empty()) {
    line += "  replicas: ";
    for (size_t i = 0; i < m.ft_replicas.size(); ++i) line += (i ? "," : "") + std::to_string(m.ft_replicas[i]);
  }
  return line;
}

std::string format_validation_line(int64_t step, double loss, double perplexity, double tps, double seconds) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "validate step: %4lld  loss: %8.4f  perplexity: %.2f  tps: %s  time: %.1fs",
                static_cast<long long>(step), loss, perplexity, thousands(tps).c_str(), seconds);
  return buf;
}

std::string format_progress(const StepMetrics& m, double eta_s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "[%4lld/%lld]  loss %.4f  %s tok/s  ETA %s", static_cast<long long>(m.step),
                static_cast<long long>(m.total_steps), m.loss, thousands(m.tps).c_str(), format_duration(eta_s).c_str());
  return buf;
}

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  out_.open(path, std::ios::app);
  if (!out_) throw std::runtime_error("metrics: cannot write '" + path + "'");
}

void JsonlWriter::keep_before(int64_t step) {
  trimmed_ = true;
  out_.close();
  std::string kept;
  {
    std::ifstream in(path_);
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() < step)
        kept += line + "\n";
    }
  }
  // write_file_whole: a temporary of this process's own (processes that share a dump folder — several ranks'
  // single-process runs in a test, a misconfigured launch — never take each other's file). Failing to rewrite only
  // loses the trimming (the records are appended as they come), never the run.
  try {
    write_file_whole(path_, kept, "metrics");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-train: metrics: %s keeps its earlier records as they are (%s)\n", path_.c_str(), e.what());
  }
  out_.open(path_, std::ios::app);
  if (!out_) throw std::runtime_error("metrics: cannot write '" + path_ + "'");
}

void JsonlWriter::write(const StepMetrics& m) {
  if (!out_.is_open()) return;
  if (!trimmed_) keep_before(m.step);
  nlohmann::json j = {{"step", m.step},       {"loss", m.loss}, {"grad_norm", m.grad_norm}, {"lr", m.lr},
                      {"tps", m.tps},         {"tflops", m.tflops}, {"mfu", m.mfu},       {"memory_gib", m.mem_gib},
                      {"memory_max_gib", m.mem_max_gib}, {"data_s", m.data_s}, {"elapsed_s", m.elapsed_s},
                      {"tokens_seen", m.tokens_seen}};
  if (m.tensor_peak_bytes >= 0) {
    j["tensor_start_bytes"] = m.tensor_start_bytes;
    j["tensor_forward_bytes"] = m.tensor_forward_bytes;
    j["tensor_peak_bytes"] = m.tensor_peak_bytes;
  }
  if (m.device_memory) {  // the caching allocator's figures (TorchTitan's DeviceMemoryMonitor)
    j["memory_source"] = "caching_allocator";
    j["memory_max_reserved_gib"] = m.mem_gib;
    j["memory_max_active_gib"] = m.mem_max_active_gib;
    j["memory_reserved_gib"] = m.mem_reserved_gib;
    j["memory_active_gib"] = m.mem_active_gib;
    if (m.mem_max_reserved_pct >= 0) j["memory_max_reserved_pct"] = m.mem_max_reserved_pct;
    if (m.mem_max_active_pct >= 0) j["memory_max_active_pct"] = m.mem_max_active_pct;
    j["memory_alloc_retries"] = m.mem_alloc_retries;
    j["memory_ooms"] = m.mem_ooms;
  }
  if (m.eta_s >= 0) j["eta_s"] = m.eta_s;
  if (!m.expert_tokens_min.empty()) {
    j["expert_tokens_min"] = m.expert_tokens_min;  // per MoE layer
    j["expert_tokens_max"] = m.expert_tokens_max;
    j["expert_tokens_mean"] = m.expert_tokens_mean;
  }
  if (m.moe_aux_loss >= 0) j["moe_aux_loss"] = m.moe_aux_loss;
  if (!m.ft_replicas.empty()) j["ft_replicas"] = m.ft_replicas;
  out_ << j.dump() << "\n";
  out_.flush();  // a crash keeps every step written so far
}

void JsonlWriter::write_validation(int64_t step, double loss, double perplexity, int64_t tokens, double seconds) {
  if (!out_.is_open()) return;
  if (!trimmed_) keep_before(step);
  const nlohmann::json j = {{"step", step}, {"validation_loss", loss}, {"validation_perplexity", perplexity},
                            {"validation_tokens", tokens}, {"validation_s", seconds}};
  out_ << j.dump() << "\n";
  out_.flush();
}

}  // namespace fsdp_train
