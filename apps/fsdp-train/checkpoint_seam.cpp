// fsdp-train's Checkpointer on libfsdp distributed checkpoints (see checkpoint_seam.h, docs/trainer.md).
#include "checkpoint_seam.h"

#include "config.h"
#include "data.h"
#include "model_spec.h"

#include <fsdp/checkpoint/async_save.h>
#include <fsdp/checkpoint/checkpoint.h>
#include <fsdp/checkpoint/optimizer.h>
#include <fsdp/util/timer.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

namespace fsdp_train {
namespace {

namespace ckpt = fsdp::checkpoint;
namespace fs = std::filesystem;
using Clock = fsdp::util::SteadyClock;
using fsdp::util::seconds_since;

// checkpoint.async_mode as libfsdp's (the same three modes, TorchTitan's names).
ckpt::AsyncMode async_mode_of(AsyncMode mode) {
  switch (mode) {
    case AsyncMode::Async: return ckpt::AsyncMode::Async;
    case AsyncMode::AsyncWithPinnedMem: return ckpt::AsyncMode::AsyncWithPinnedMem;
    case AsyncMode::Disabled: break;
  }
  return ckpt::AsyncMode::Disabled;
}

// Whether the checkpoint in `dir` holds the training state (step, optimizer, ...), not only the model.
bool holds_train_state(const std::string& dir) { return ckpt::inspect(dir).values.count("train_state.step") > 0; }

std::string hex(const at::Tensor& bytes) {
  static const char* digits = "0123456789abcdef";
  const auto* p = bytes.data_ptr<uint8_t>();
  std::string out;
  for (int64_t i = 0; i < bytes.numel(); ++i) {
    out += digits[p[i] >> 4];
    out += digits[p[i] & 15];
  }
  return out;
}

// `where`: the value's name in errors ("<metadata file>: rng.cpu").
at::Tensor unhex(const std::string& s, const std::string& where) {
  auto digit = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    TORCH_CHECK(false, where, ": must be lowercase hex digits, holds '", std::string(1, c), "'");
    return 0;
  };
  TORCH_CHECK(s.size() % 2 == 0, where, ": must be an even number of hex digits, has ", s.size());
  at::Tensor t = at::empty({static_cast<int64_t>(s.size() / 2)}, at::kByte);
  auto* p = t.data_ptr<uint8_t>();
  for (size_t i = 0; i < s.size(); i += 2) p[i / 2] = static_cast<uint8_t>(digit(s[i]) << 4 | digit(s[i + 1]));
  return t;
}

// The file that holds a checkpoint's values (named in errors about them).
std::string metadata_file(const std::string& dir) {
  const auto format = ckpt::checkpoint_format(dir);
  return (fs::path(dir) / (format == ckpt::Format::PytorchDcp ? ".metadata" : "metadata.json")).string();
}

// The rank of a "dataloader.dp_rank_<N>" key: plain decimal digits that fit 63 bits, else nullopt.
std::optional<int64_t> loader_rank_of(const std::string& key, const std::string& prefix) {
  if (key.size() <= prefix.size() || key.size() > prefix.size() + 18) return std::nullopt;
  int64_t rank = 0;
  for (size_t i = prefix.size(); i < key.size(); ++i) {
    if (key[i] < '0' || key[i] > '9') return std::nullopt;
    rank = rank * 10 + (key[i] - '0');
  }
  return rank;
}

// An integer value of a checkpoint (its JSON text `text`) checked as untrusted input: one line naming the file,
// the key and the rule.
int64_t checked_int(const std::string& text, const std::string& file, const std::string& key, int64_t min) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_number_integer() && !(j.is_number_unsigned() && j.get<uint64_t>() > uint64_t(INT64_MAX)), file, ": ",
              key, " must be an integer, is a ", j.is_discarded() ? "malformed value" : j.type_name());
  const int64_t v = j.get<int64_t>();
  TORCH_CHECK(v >= min, file, ": ", key, " = ", v, ": must be >= ", min);
  return v;
}

class DistributedCheckpointer final : public Checkpointer {
 public:
  DistributedCheckpointer(const JobConfig& config, int rank, fsdp::ProcessGroupPtr group)
      : cfg_(config.checkpoint), hf_(train_spec(config.model.name).hf), base_lr_(config.optimizer.lr), rank_(rank), world_(group ? group->size() : 1),
        job_group_(std::move(group)) {
    folder_ = (fs::path(config.job.dump_folder) / cfg_.folder).string();
    const ckpt::AsyncMode mode = async_mode_of(cfg_.async_mode);
    // Background saves talk on their own group so that they never interleave with the training collectives.
    if (cfg_.enable && job_group_ && world_ > 1) {
      std::vector<int> ranks(static_cast<size_t>(world_));
      for (int i = 0; i < world_; ++i) ranks[static_cast<size_t>(i)] = i;
      group_ = fsdp::new_group(ranks, "checkpoint");
    }
    // The snapshot is taken on the saver's thread while the next forward/backward runs (both only read the
    // parameters and optimizer state); the loop waits for it before the optimizer step changes them.
    saver_ = std::make_unique<ckpt::AsyncSaver>(group_, mode, ckpt::Staging::Background);
    if (mode == ckpt::AsyncMode::AsyncWithPinnedMem && rank_ == 0)
      std::cout << "checkpoint: async_with_pinned_mem on CPU tensors = async (pinned memory only helps device copies)"
                << std::endl;
  }

  ~DistributedCheckpointer() override {
    try {
      wait();
    } catch (const std::exception& e) {
      std::cerr << "checkpoint: background save failed: " << e.what() << std::endl;
    }
  }

  bool load(TrainState& s) override {
    if (!cfg_.enable) return false;
    std::string dir;
    bool from_initial = false;
    if (cfg_.load_step >= 0) {
      dir = ckpt::step_path(folder_, cfg_.load_step);
      TORCH_CHECK(ckpt::checkpoint_format(dir).has_value(),
                  "checkpoint.load_step = ", cfg_.load_step, ": ", dir, " is not a complete checkpoint");
    } else if (auto latest = ckpt::latest_step(folder_)) {
      // Resume from the newest checkpoint that holds the training state. The last save is model-only by
      // default (last_save_model_only): restarting from it would reset step, optimizer and data order, and
      // then overwrite the earlier step folders. It is used only when nothing else exists.
      dir = ckpt::step_path(folder_, *latest);
      const auto steps = ckpt::complete_steps(folder_);
      for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
        const std::string candidate = ckpt::step_path(folder_, *it);
        if (!holds_train_state(candidate)) continue;
        if (*it != *latest && rank_ == 0) {
          std::printf("checkpoint: %s is model-only (checkpoint.last_save_model_only); resuming from %s, the newest "
                      "with training state\n", dir.c_str(), candidate.c_str());
        }
        dir = candidate;
        break;
      }
    } else if (!cfg_.initial_load_path.empty()) {
      dir = cfg_.initial_load_path;
      from_initial = true;
      if (cfg_.initial_load_in_hf) return load_hf(s, dir);
    } else {
      return false;
    }
    const auto t0 = Clock::now();
    const auto summary = ckpt::inspect(dir);
    // A model-only checkpoint (the last save by default, or a seed) restores only the model.
    const bool has_train_state = summary.values.count("train_state.step") > 0;
    const bool model_only = !has_train_state || (from_initial && cfg_.initial_load_model_only);
    std::vector<std::string> exclude;
    // The data loader entry every rank reads when the rank count changed: the lowest data rank's (dp_rank_0, or
    // under [fault_tolerance] the first data rank of this replica group, which saved only its own ranks').
    const std::string loader_prefix = "dataloader.dp_rank_";
    int64_t lowest = -1;
    for (const auto& [key, value] : summary.values) {
      if (key.rfind(loader_prefix, 0) != 0) continue;
      const auto rank = loader_rank_of(key, loader_prefix);
      TORCH_CHECK(rank, metadata_file(dir), ": value '", key, "' is not named ", loader_prefix, "<rank>");
      if (lowest < 0 || *rank < lowest) lowest = *rank;
    }
    loader_key_ = loader_prefix + std::to_string(std::max<int64_t>(lowest, 0));
    // A TorchTitan (PyTorch DCP) checkpoint has no rng.cpu, and its data loader state is pickled Python
    // (never loaded): those parts start fresh.
    for (const std::string& part : {std::string("rng.cpu"), loader_key_}) {
      if (model_only || summary.values.count(part)) continue;
      const std::string prefix = std::string(part).substr(0, std::string(part).find('.') + 1);
      exclude.push_back(prefix);
      if (rank_ == 0) {
        std::printf("checkpoint: %s has no readable %s%s; that state starts fresh\n", dir.c_str(), part.c_str(),
                    summary.unreadable_values.count(part) ? " (pickled Python data)" : "");
      }
    }
    for (const CheckpointPart part : cfg_.exclude_from_loading) {  // names checked where the config was read
      const std::string prefix = std::string(to_string(part)) + ".";  // the part's entries: "<part>.*"
      if (std::find(exclude.begin(), exclude.end(), prefix) == exclude.end()) exclude.push_back(prefix);
    }
    ckpt::StateDict sd = state_dict(s, model_only, /*for_save=*/false);
    ckpt::LoadOptions lo;
    lo.group = group_;
    lo.local_only = !job_group_;
    lo.exclude_prefixes = exclude;
    lo.strict = false;  // other ranks' dataloader entries are expected extras; missing keys are checked below
    ckpt::LoadResult res;
    try {
      res = ckpt::load(sd, dir, lo);
    } catch (const c10::Error& e) {
      // Say how to get going again: a damaged newest checkpoint need not end the run's history.
      std::string earlier;
      for (int64_t step : ckpt::complete_steps(folder_)) {
        const std::string other = ckpt::step_path(folder_, step);
        if (other == dir) continue;
        earlier += (earlier.empty() ? "" : ", ") + std::to_string(step);
        try {
          if (!holds_train_state(other)) earlier += " (model only)";
        } catch (const std::exception&) {
          earlier += " (unreadable)";
        }
      }
      TORCH_CHECK(false, e.what_without_backtrace(), "\n  loading ", dir, " failed; check it with `fsdp-ckpt verify ",
                  dir, "`. ", earlier.empty() ? std::string("No other complete checkpoint is in ") + folder_ + "."
                  : "To resume from an earlier one, pass --checkpoint.load_step N (complete: " + earlier +
                  ") or move this one aside.");
    }
    std::vector<std::string> missing;
    for (const auto& k : res.missing) missing.push_back(k);
    TORCH_CHECK(missing.empty(), "checkpoint: ", dir, " lacks ", missing.size(), " entries of this job, e.g. '",
                missing.front(), "' (a different model or optimizer?)");
    ckpt::load_model_state_dict(s.parts, sd);
    if (!model_only) {
      try {
        ckpt::load_optimizer_state_dict(s.parts, *s.optimizer, sd);
      } catch (const c10::Error& e) {  // a hyperparameter of the wrong type: name the file too
        TORCH_CHECK(false, metadata_file(dir), ": ", e.what_without_backtrace());
      }
      restore_train_state(s, sd, exclude, dir);
    }
    const double dt = seconds_since(t0);
    if (rank_ == 0) {
      std::printf("checkpoint: loaded %s%s in %.3f s (%.1f MB read by rank 0, %.2f GB/s)\n", dir.c_str(),
                  model_only ? " (model only)" : "", dt, res.bytes_read / 1e6, res.bytes_read / 1e9 / std::max(dt, 1e-9));
      std::fflush(stdout);
    }
    return true;
  }

  void maybe_save(TrainState& s, bool last) override {
    if (!cfg_.enable) return;
    surface_background_error();
    const bool due = s.step % cfg_.interval == 0 || last || (cfg_.enable_first_step_checkpoint && s.step == 1);
    if (!due) return;
    wait();  // at most one save in flight
    const bool model_only = last && cfg_.last_save_model_only;
    std::optional<at::ScalarType> cast;
    if (model_only && cfg_.export_dtype == ExportDtype::BFloat16) cast = at::kBFloat16;
    if (model_only && cfg_.export_dtype == ExportDtype::Float16) cast = at::kHalf;
    const std::string dir = ckpt::step_path(folder_, s.step);
    if (model_only && cfg_.last_save_in_hf) {
      save_hf(s, dir, cast);
      return;
    }
    ckpt::StateDict sd = state_dict(s, model_only, /*for_save=*/true);
    ckpt::SaveOptions so;
    so.group = group_;
    so.local_only = !job_group_;
    so.saved_on = "fsdp-train step " + std::to_string(s.step);
    so.format = cfg_.format == CheckpointFormat::Dcp ? ckpt::Format::PytorchDcp : ckpt::Format::Libfsdp;
    so.direct_io = cfg_.direct_io;
    const auto t0 = Clock::now();
    if (saver_->mode() != ckpt::AsyncMode::Disabled && !last) {
      // Snapshot, save and purge on the saver's thread; the loop waits for the snapshot before the next step.
      const auto started = saver_->save(sd, dir, so, [this, t0](const ckpt::SaveResult& r) {
        report(r, t0, "background ");
        purge();
      }, cast);
      if (rank_ == 0) {
        std::printf("checkpoint: step %lld: snapshot and write of %s in the background (%.3f s to start)\n",
                    static_cast<long long>(s.step), dir.c_str(), started.stage_seconds);
        std::fflush(stdout);
      }
      return;
    }
    // Synchronous: async_mode disabled, or the last save (TorchTitan makes the final save synchronous).
    report(cast ? ckpt::save(ckpt::snapshot(sd, cast), dir, so) : ckpt::save(sd, dir, so), t0, last ? "last step " : "");
    // keep_latest_k purge runs in the background (rank 0), never deleting the newest complete checkpoint.
    purger_ = std::thread([this] {
      try {
        purge();
      } catch (...) {
        purge_error_ = std::current_exception();
      }
    });
  }

  void before_optimizer_step() override {
    const double waited = saver_->wait_staged();
    if (waited > 0.001 && rank_ == 0) {
      std::printf("checkpoint: waited %.3f s for the async snapshot before the optimizer step\n", waited);
      std::fflush(stdout);
    }
  }

  void wait() override {
    saver_->wait();
    if (purger_.joinable()) purger_.join();
    surface_background_error();
  }

 private:
  // Raises the error of a finished background save or purge; one still running reports at a later call.
  void surface_background_error() {
    saver_->check();
    if (purger_.joinable()) return;
    if (purge_error_) {
      auto e = purge_error_;
      purge_error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  void purge() {
    if (rank_ != 0 || cfg_.keep_latest_k <= 0) return;
    for (const auto& d : ckpt::purge(folder_, cfg_.keep_latest_k)) std::printf("checkpoint: purged %s\n", d.c_str());
    std::fflush(stdout);
  }

  void report(const ckpt::SaveResult& r, Clock::time_point t0, const char* what) {
    if (rank_ != 0) return;
    const double dt = seconds_since(t0);
    std::printf("checkpoint: %ssave of %s done in %.3f s (%.1f MB, %.2f GB/s)\n", what, r.path.c_str(), dt,
                r.total_bytes / 1e6, r.total_bytes / 1e9 / std::max(dt, 1e-9));
    std::fflush(stdout);
  }

  // Under pipeline parallelism: the stages this rank trains (the whole model holds the others on `meta`); empty
  // when the model is the one part.
  static std::vector<torch::nn::Module*> stage_parts(const TrainState& s) {
    if (s.parts.size() == 1 && s.parts.front() == s.model) return {};
    return s.parts;
  }

  // initial_load_in_hf: Hugging Face weights (model only) through the family's adapter (model_spec.h), each rank
  // reading only its rows (under PP: of its stages).
  bool load_hf(TrainState& s, const std::string& dir) {
    const auto t0 = Clock::now();
    ckpt::SafetensorsImportOptions io;
    io.parts = stage_parts(s);
    const auto r = hf_.import_weights(*s.model, dir, io);
    if (rank_ == 0) {
      std::printf("checkpoint: loaded Hugging Face weights %s (model only) in %.3f s (%.1f MB read by rank 0)\n",
                  dir.c_str(), seconds_since(t0), r.bytes_read / 1e6);
      std::fflush(stdout);
    }
    return true;
  }

  // last_save_in_hf: the final model as Hugging Face safetensors (+ index, config.json) in step-N, through the
  // family's adapter: one tensor gathered at a time (under PP by its stage's ranks, sent to rank 0).
  void save_hf(TrainState& s, const std::string& dir, std::optional<at::ScalarType> cast) {
    const auto t0 = Clock::now();
    ckpt::SafetensorsExportOptions eo;
    eo.dtype = cast;
    eo.parts = stage_parts(s);
    const auto r = hf_.export_weights(*s.model, dir, eo);
    if (rank_ == 0) {
      std::printf("checkpoint: last step Hugging Face save of %s done in %.3f s (%.1f MB, %zu files)\n", dir.c_str(),
                  seconds_since(t0), r.total_bytes / 1e6, r.files.size());
      std::fflush(stdout);
    }
  }

  ckpt::StateDict state_dict(TrainState& s, bool model_only, bool for_save) {
    ckpt::StateDict sd = ckpt::model_state_dict(s.parts);
    if (model_only) return sd;
    sd.merge(ckpt::optimizer_state_dict(s.parts, *s.optimizer));
    if (for_save) {
      // TorchTitan's LambdaLR adds initial_lr to every param group; its dcp.load needs the key (we ignore it).
      std::vector<std::string> lr_keys;
      for (const auto& [k, v] : sd.values) {
        if (k.rfind("optimizer.param_groups.", 0) == 0 && k.size() > 3 && k.compare(k.size() - 3, 3, ".lr") == 0)
          lr_keys.push_back(k);
      }
      for (const auto& k : lr_keys) sd.values[k.substr(0, k.size() - 2) + "initial_lr"] = nlohmann::json(base_lr_).dump();
    }
    const auto& opt = s.data->options();
    sd.values["train_state.step"] = std::to_string(s.step);
    sd.values["train_state.ntokens_seen"] = std::to_string(s.ntokens_seen);
    sd.values["lr_scheduler.last_epoch"] = std::to_string(s.step);
    sd.values["dataloader.world_size"] = std::to_string(opt.dp_degree);
    // Loading asks for the lowest data rank's entry only (present whatever the saved rank count); a rank's own
    // entry is read in restore_train_state when the rank count is unchanged.
    if (for_save) sd.values["dataloader.dp_rank_" + std::to_string(opt.dp_rank)] = s.data->state().dump();
    else sd.values[loader_key_] = "null";
    at::Tensor rng = at::detail::getDefaultCPUGenerator().get_state();
    sd.values["rng.cpu"] = nlohmann::json(hex(rng)).dump();
    return sd;
  }

  void restore_train_state(TrainState& s, const ckpt::StateDict& sd, const std::vector<std::string>& exclude,
                           const std::string& dir) {
    // Saved state is input like any other: each value is checked (type, range, agreement with the run and with
    // the other counters) before the run uses it, and refused with one line naming the file, the key and the rule.
    auto excluded = [&](const std::string& p) { return std::find(exclude.begin(), exclude.end(), p) != exclude.end(); };
    const std::string file = metadata_file(dir);
    auto text = [&](const std::string& k) -> const std::string& { return sd.values.at(k); };
    const bool train_state = !excluded("train_state.");
    int64_t step = s.step, ntokens = s.ntokens_seen;
    if (train_state) {
      // A negative step would run steps -99..0 with a negative learning rate; ntokens_seen only counts.
      step = checked_int(text("train_state.step"), file, "train_state.step", 0);
      ntokens = checked_int(text("train_state.ntokens_seen"), file, "train_state.ntokens_seen", 0);
    }
    at::Tensor rng;
    if (!excluded("rng.")) {
      const auto j = nlohmann::json::parse(text("rng.cpu"), nullptr, /*allow_exceptions=*/false);
      TORCH_CHECK(j.is_string(), file, ": rng.cpu must be a hex string, is a ",
                  j.is_discarded() ? "malformed value" : j.type_name());
      rng = unhex(j.get_ref<const std::string&>(), file + ": rng.cpu");
      const at::Tensor current = at::detail::getDefaultCPUGenerator().get_state();
      TORCH_CHECK(rng.numel() == current.numel(), file, ": rng.cpu holds ", rng.numel(),
                  " bytes, a CPU generator state has ", current.numel());
    }
    if (!excluded("dataloader.")) {
      const auto& opt = s.data->options();
      const int64_t saved_world = checked_int(text("dataloader.world_size"), file, "dataloader.world_size", 1);
      // The same data-parallel degree: this rank's own entry (bit for bit, whatever else changed); another degree:
      // the lowest saved rank's, repositioned by DataLoader::load_state at the same global sample (the global batch
      // must be unchanged; local batch and accumulation may differ).
      const std::string key =
          saved_world == opt.dp_degree ? "dataloader.dp_rank_" + std::to_string(opt.dp_rank) : loader_key_;
      const std::string state_text = saved_world == opt.dp_degree ? ckpt::read_value(dir, key) : text(key);
      const auto st = nlohmann::json::parse(state_text, nullptr, /*allow_exceptions=*/false);
      TORCH_CHECK(!st.is_discarded(), file, ": ", key, " is not valid JSON");
      try {
        s.data->load_state(st, file + ": " + key);
      } catch (const std::runtime_error& e) {
        TORCH_CHECK(false, e.what());
      }
      // The loader's counters and the step counter move together: step N of the run read N steps of data.
      if (train_state) {
        const int64_t data_step = s.data->micro_batches() / opt.grad_accum_steps;
        TORCH_CHECK(s.data->micro_batches() % opt.grad_accum_steps == 0 && data_step == step, file, ": ", key,
                    " is at micro-batch ", s.data->micro_batches(), " (step ", data_step, " at ", opt.grad_accum_steps,
                    " per step) but train_state.step = ", step, ": the counters disagree");
      }
    }
    s.step = step;
    s.ntokens_seen = ntokens;
    if (rng.defined()) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      gen.set_state(rng);
    }
  }

  JobConfig::Checkpoint cfg_;
  HfAdapter hf_;  // model.name's Hugging Face adapter
  double base_lr_;
  int rank_;
  int world_;
  fsdp::ProcessGroupPtr job_group_, group_;
  std::string folder_;
  std::string loader_key_ = "dataloader.dp_rank_0";  // see load()
  std::unique_ptr<ckpt::AsyncSaver> saver_;
  std::thread purger_;
  std::exception_ptr purge_error_;
};

}  // namespace

std::unique_ptr<Checkpointer> make_checkpointer(const JobConfig& config, int rank, fsdp::ProcessGroupPtr group) {
  return std::make_unique<DistributedCheckpointer>(config, rank, std::move(group));
}

}  // namespace fsdp_train
