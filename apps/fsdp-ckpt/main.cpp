// fsdp-ckpt: tools for libfsdp distributed checkpoints (docs/checkpoint.md).
//
//   fsdp-ckpt inspect <ckpt> [--values]         tensors, shapes, dtypes, sizes, step, the mesh it was saved on
//   fsdp-ckpt verify  <ckpt>                    completeness, file sizes, every checksum (exit 1 on a problem)
//   fsdp-ckpt convert <ckpt> <out-dir> [--max-shard-size 5GB] [--model-only] [--dtype bf16]
//                                               to safetensors, one tensor in memory at a time; above the
//                                               size threshold: model-0000i-of-0000N.safetensors + index json
//   fsdp-ckpt convert <ckpt> <out-dir> --to dcp|libfsdp [--model-only]
//                                               to PyTorch DCP (dcp.load / TorchTitan read it) or to ours, one
//                                               saved chunk at a time, keeping each rank's file
// <ckpt> is a libfsdp checkpoint or a PyTorch DCP directory (.metadata read without executing anything).
//   fsdp-ckpt diff    <a> <b> [--atol 0] [--ignore PREFIX]...
//                                               max abs/rel difference per tensor (exit 1 when they differ)
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/safetensors.h>

#include "user_errors.h"

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace ckpt = fsdp::checkpoint;
namespace fs = std::filesystem;

namespace {

std::string human(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.2f MB", b / 1e6);
  else if (b >= 1e3) std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  return buf;
}

// --max-shard-size: a positive number of bytes with an optional unit (B, KB, MB, GB, KiB, MiB, GiB; any case).
int64_t parse_size(const std::string& s) {
  const auto bad = [&](const std::string& why) -> int64_t {
    throw std::invalid_argument("fsdp-ckpt: --max-shard-size: " + why + ", got '" + s +
                                "' (expected a positive size such as 5GB, 500MB, 2GiB or a number of bytes)");
  };
  size_t digits = 0;
  while (digits < s.size() && (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.')) ++digits;
  const std::string number = s.substr(0, digits);
  if (number.find_first_of("0123456789") == std::string::npos || std::count(number.begin(), number.end(), '.') > 1)
    return bad("not a number");
  std::string unit = s.substr(digits);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit == "KB") mult = 1e3;
  else if (unit == "MB") mult = 1e6;
  else if (unit == "GB") mult = 1e9;
  else if (unit == "KIB") mult = 1024;
  else if (unit == "MIB") mult = 1 << 20;
  else if (unit == "GIB") mult = 1 << 30;
  else if (!unit.empty() && unit != "B") return bad("unknown unit '" + s.substr(digits) + "'");
  const double bytes = std::strtod(number.c_str(), nullptr) * mult;  // digits and one '.': strtod reads all of it
  // 2^62 bytes: far above any file, and the sums of file sizes stay within int64.
  if (!(bytes >= 1) || bytes > 4.6e18) return bad(bytes < 1 ? "must be at least 1 byte" : "too large");
  return static_cast<int64_t>(bytes);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

int cmd_inspect(const std::string& path, bool values) {
  const auto s = ckpt::inspect(path);
  if (s.format == ckpt::Format::PytorchDcp) {
    std::cout << path << ": PyTorch DCP checkpoint (" << s.saved_on << "), " << s.world_size << " rank file set(s)\n";
  } else {
    std::cout << path << ": libfsdp checkpoint v" << s.version << ", saved by " << s.world_size << " rank(s)"
              << (s.saved_on.empty() ? "" : " (" + s.saved_on + ")") << "\n";
  }
  for (const char* key : {"train_state.step", "train_state.ntokens_seen"}) {
    auto it = s.values.find(key);
    if (it != s.values.end()) std::cout << "  " << key << " = " << it->second << "\n";
  }
  std::cout << "  " << s.tensors.size() << " tensors, " << human(s.total_bytes) << " in " << s.files.size()
            << " file(s); " << s.values.size() << " values\n";
  size_t width = 4;
  for (const auto& t : s.tensors) width = std::max(width, t.name.size());
  for (const auto& t : s.tensors) {
    std::printf("  %-*s  %-5s %-20s %3lld chunk(s) %12s\n", static_cast<int>(width), t.name.c_str(), t.dtype.c_str(),
                shape_str(t.shape).c_str(), static_cast<long long>(t.chunks), human(t.bytes).c_str());
  }
  if (values) {
    for (const auto& [k, v] : s.values) std::cout << "  " << k << " = " << (v.size() > 200 ? v.substr(0, 200) + "..." : v) << "\n";
  }
  for (const auto& [k, why] : s.unreadable_values) std::cout << "  " << k << ": not loaded (" << why << ")\n";
  return 0;
}

int cmd_verify(const std::string& path) {
  const auto problems = ckpt::verify(path);
  if (problems.empty()) {
    const auto s = ckpt::inspect(path);
    std::cout << path << ": OK (" << s.tensors.size() << " tensors, " << human(s.total_bytes)
              << (s.format == ckpt::Format::PytorchDcp ? ", every item decoded; DCP has no checksums)\n"
                                                       : ", every checksum verified)\n");
    return 0;
  }
  std::cout << path << ": " << problems.size() << " problem(s)\n";
  for (const auto& p : problems) std::cout << "  " << p << "\n";
  return 1;
}

int cmd_convert(const std::string& path, const std::string& out, int64_t max_shard, bool model_only,
                const std::string& dtype) {
  ckpt::Reader reader(path);
  std::optional<c10::ScalarType> cast;
  if (dtype == "bf16" || dtype == "bfloat16") cast = c10::kBFloat16;
  else if (dtype == "fp16" || dtype == "float16") cast = c10::kHalf;
  else if (dtype == "fp32" || dtype == "float32") cast = c10::kFloat;
  else TORCH_CHECK(dtype.empty(), "fsdp-ckpt: --dtype must be bf16, fp16 or fp32");
  // Files: tensors in name order, a new file when the next tensor would pass the threshold.
  namespace st = fsdp::checkpoint::safetensors;
  std::vector<st::TensorSpec> specs;
  for (const auto& t : reader.summary().tensors) {
    if (model_only && t.name.rfind("optimizer.", 0) == 0) continue;
    auto dt = st::dtype_from_name(t.dtype);
    if (cast && at::isFloatingType(dt)) dt = *cast;
    specs.push_back({t.name, dt, t.shape});
  }
  const auto files = st::plan_files(specs, max_shard);
  fs::create_directories(out);
  std::map<std::string, std::string> weight_map;
  int64_t total = 0;
  const size_t n = files.size();
  for (const auto& file : files) {
    std::vector<st::TensorSpec> mine;
    for (size_t i : file.specs) {
      mine.push_back(specs[i]);
      weight_map[specs[i].name] = file.name;
    }
    total += file.bytes;
    st::save_file_streamed((fs::path(out) / file.name).string(), mine, [&](size_t i) {
      at::Tensor x = reader.read(mine[i].name);
      return x.scalar_type() == mine[i].dtype ? x : x.to(mine[i].dtype);
    }, {{"format", "pt"}});
    std::cout << "  " << file.name << ": " << mine.size() << " tensors\n";
  }
  if (n > 1) fsdp::checkpoint::safetensors::save_index((fs::path(out) / "model.safetensors.index.json").string(), weight_map, total);
  std::cout << path << " -> " << out << ": " << weight_map.size() << " tensors, " << human(total) << " in " << n
            << " file(s)\n";
  return 0;
}

int cmd_convert_checkpoint(const std::string& path, const std::string& out, const std::string& to, bool model_only) {
  ckpt::ConvertOptions o;
  TORCH_CHECK(to == "dcp" || to == "libfsdp", "fsdp-ckpt: --to must be safetensors, dcp or libfsdp, got '", to, "'");
  o.to = to == "dcp" ? ckpt::Format::PytorchDcp : ckpt::Format::Libfsdp;
  o.model_only = model_only;
  const auto r = ckpt::convert(path, out, o);
  std::cout << path << " -> " << out << " (" << ckpt::format_name(o.to) << "): " << r.tensors << " tensors in "
            << r.chunks << " chunks, " << r.values << " values, " << human(r.bytes_written) << "\n";
  for (const auto& s : r.skipped) std::cout << "  skipped " << s << "\n";
  return 0;
}

int cmd_diff(const std::string& a, const std::string& b, double atol, const std::vector<std::string>& ignore) {
  ckpt::Reader ra(a), rb(b);
  // Entries under an ignored prefix (e.g. "dataloader." of two replica groups, which read different data).
  auto ignored = [&](const std::string& key) {
    return std::any_of(ignore.begin(), ignore.end(), [&](const std::string& p) { return key.rfind(p, 0) == 0; });
  };
  std::map<std::string, ckpt::TensorSummary> ta, tb;
  for (const auto& t : ra.summary().tensors)
    if (!ignored(t.name)) ta[t.name] = t;
  for (const auto& t : rb.summary().tensors)
    if (!ignored(t.name)) tb[t.name] = t;
  int differing = 0;
  for (const auto& [name, t] : ta) {
    auto it = tb.find(name);
    if (it == tb.end()) {
      std::cout << "  only in A: " << name << "\n";
      ++differing;
      continue;
    }
    if (it->second.shape != t.shape) {
      std::cout << "  " << name << ": shape " << shape_str(t.shape) << " vs " << shape_str(it->second.shape) << "\n";
      ++differing;
      continue;
    }
    at::Tensor x = ra.read(name).to(at::kDouble), y = rb.read(name).to(at::kDouble);
    const double abs = x.numel() ? (x - y).abs().max().item<double>() : 0.0;
    const double scale = y.numel() ? y.abs().max().item<double>() : 0.0;
    const double rel = abs == 0 ? 0 : abs / std::max(scale, 1e-300);
    const bool same = abs <= atol && t.dtype == it->second.dtype;
    if (!same) ++differing;
    std::printf("  %s %-50s max abs %.3e  max rel %.3e%s\n", same ? " " : "*", name.c_str(), abs, rel,
                t.dtype == it->second.dtype ? "" : ("  dtype " + t.dtype + " vs " + it->second.dtype).c_str());
  }
  for (const auto& [name, t] : tb) {
    if (!ta.count(name)) {
      std::cout << "  only in B: " << name << "\n";
      ++differing;
    }
  }
  const auto& va = ra.summary().values;
  const auto& vb = rb.summary().values;
  std::set<std::string> keys;
  for (const auto& [k, v] : va)
    if (!ignored(k)) keys.insert(k);
  for (const auto& [k, v] : vb)
    if (!ignored(k)) keys.insert(k);
  for (const auto& k : keys) {
    auto x = va.find(k), y = vb.find(k);
    if (x != va.end() && y != vb.end() && x->second == y->second) continue;
    ++differing;
    std::cout << "  * value " << k << ": " << (x == va.end() ? "(absent)" : x->second.substr(0, 80)) << " vs "
              << (y == vb.end() ? "(absent)" : y->second.substr(0, 80)) << "\n";
  }
  std::cout << (differing ? std::to_string(differing) + " entries differ" : "identical") << "\n";
  return differing ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp_apps::hide_cpp_backtraces_unless_requested();
  CLI::App app{"fsdp-ckpt: inspect, verify, convert and diff libfsdp and PyTorch DCP checkpoints"};
  app.require_subcommand(1);
  std::string path, out, other, max_shard = "5GB", dtype, to = "safetensors";
  bool values = false, model_only = false;
  double atol = 0;
  auto* inspect = app.add_subcommand("inspect", "tensors, shapes, dtypes, sizes, step, the mesh it was saved on");
  inspect->add_option("checkpoint", path, "checkpoint directory")->required();
  inspect->add_flag("--values", values, "also print every value (optimizer hyperparameters, trainer state)");
  auto* verify = app.add_subcommand("verify", "check completeness, file sizes and every checksum");
  verify->add_option("checkpoint", path, "checkpoint directory")->required();
  auto* convert = app.add_subcommand("convert", "write the tensors as safetensors (sharded with an index above "
                                                 "--max-shard-size), or the checkpoint as PyTorch DCP / libfsdp");
  convert->add_option("checkpoint", path, "checkpoint directory")->required();
  convert->add_option("out", out, "output directory")->required();
  convert->add_option("--max-shard-size", max_shard, "largest safetensors file (e.g. 5GB, 500MB)");
  convert->add_flag("--model-only", model_only, "skip optimizer.* tensors");
  convert->add_option("--dtype", dtype, "cast floating tensors: bf16, fp16 or fp32 (safetensors)");
  convert->add_option("--to", to, "safetensors (default), dcp (PyTorch DCP) or libfsdp");
  auto* diff = app.add_subcommand("diff", "max abs/rel difference per tensor of two checkpoints");
  diff->add_option("a", path, "first checkpoint")->required();
  diff->add_option("b", other, "second checkpoint")->required();
  diff->add_option("--atol", atol, "differences up to this are equal");
  std::vector<std::string> ignore;
  diff->add_option("--ignore", ignore, "leave out entries whose key starts with this (repeatable)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (*inspect) return cmd_inspect(path, values);
    if (*verify) return cmd_verify(path);
    if (*convert && to != "safetensors") return cmd_convert_checkpoint(path, out, to, model_only);
    if (*convert) return cmd_convert(path, out, parse_size(max_shard), model_only, dtype);
    if (*diff) return cmd_diff(path, other, atol, ignore);
  } catch (const std::exception& e) {
    const std::string msg = fsdp_apps::user_message(e);
    std::cerr << (msg.rfind("fsdp-ckpt:", 0) == 0 ? "" : "fsdp-ckpt: ") << msg << "\n";
    return 2;
  }
  return 0;
}
