// [profiling] of fsdp-train (profiling.h): libtorch's Kineto profiler around a step, record_timeline beside it,
// and the CPU memory timeline.
#include "profiling.h"

#include "cuda_support.h"
#include "tensor_memory.h"
#include "trace_file.h"

#include <fsdp/comm_stats.h>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>

namespace fsdp_train {
namespace {

namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::filesystem::path step_folder(const std::string& dump, const std::string& folder, int64_t step) {
  auto path = std::filesystem::path(dump) / folder / ("iteration_" + std::to_string(step));
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  TORCH_CHECK(!ec, "fsdp-train: [profiling] cannot create ", path.string(), ": ", ec.message());
  return path;
}

// JSON string contents: group names and collective names are plain, but nothing here may break the file.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) < 0x20) continue;
    out += ch;
  }
  return out + "\"";
}

double seconds(fsdp::CollectiveSpan::Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

struct StepProfiler::Recording {
  int64_t step = 0;
  bool kineto = false;
  bool memory = false;         // the CPU's live-tensor timeline
  bool cuda_snapshot = false;  // the CUDA caching allocator's snapshot at the step's end
  fsdp::CollectiveSpan::Clock::time_point start = fsdp::CollectiveSpan::Clock::now();
};

StepProfiler::StepProfiler(const JobConfig& config, int rank, std::vector<fsdp::ProcessGroupPtr> groups,
                           const c10::Device& device)
    : options_(config.profiling), dump_folder_(config.job.dump_folder), rank_(rank), cuda_(device.is_cuda()) {
  for (auto& g : groups) {
    if (g && std::find(groups_.begin(), groups_.end(), g) == groups_.end()) groups_.push_back(std::move(g));
  }
}

StepProfiler::~StepProfiler() {
  if (!recording_) return;
  try {
    if (recording_->kineto) kineto::disableProfiler();
    for (auto& g : groups_) fsdp::record_timeline(*g, false);
  } catch (...) {
    // Unwinding from a failed step: the recording is dropped either way.
  }
  if (recording_->memory) tensor_memory::stop_timeline();
}

std::string StepProfiler::write_cuda_snapshot(const std::string& iteration_folder) {
  const auto folder = std::filesystem::path(dump_folder_) / options_.save_memory_snapshot_folder / iteration_folder;
  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  TORCH_CHECK(!ec, "fsdp-train: [profiling] cannot create ", folder.string(), ": ", ec.message());
  const auto path = folder / ("rank" + std::to_string(rank_) + "_memory_snapshot.pickle");
  write_file_whole(path.string(), cuda_support::memory_snapshot_pickle(), "fsdp-train: [profiling]");
  wrote_memory_ = true;
  return path.string();
}

void StepProfiler::dump_memory_snapshot_on_oom(int64_t step) {
  if (!options_.enable_memory_snapshot || !cuda_) return;
  try {
    const std::string path = write_cuda_snapshot("iteration_" + std::to_string(step) + "_exit");
    std::fprintf(stderr, "fsdp-train: rank %d ran out of device memory in step %lld; the CUDA memory snapshot is in %s\n",
                 rank_, static_cast<long long>(step), path.c_str());
  } catch (const std::exception& e) {
    // The out-of-memory error is what the run reports; a snapshot that could not be written must not replace it.
    std::fprintf(stderr, "fsdp-train: rank %d: no memory snapshot after the out-of-memory error: %s\n", rank_,
                 e.what());
  }
}

bool StepProfiler::records(int64_t step) const {
  return (options_.enable_profiling || options_.enable_memory_snapshot) && step % options_.profile_freq == 0;
}

void StepProfiler::begin_step(int64_t step) {
  if (!records(step)) return;
  TORCH_CHECK(!recording_, "fsdp-train: [profiling] step ", step, " begins while step ", recording_->step,
              " is still recorded");
  auto rec = std::make_unique<Recording>();
  rec->step = step;
  if (options_.enable_profiling) {
    for (auto& g : groups_) {
      fsdp::record_timeline(*g, false);  // drops an earlier step's spans
      fsdp::record_timeline(*g, true);
    }
    // TorchTitan records shapes; the collectives' sizes travel as range arguments, which Kineto keeps with them.
    const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true, /*profile_memory=*/false);
    // On a GPU also the device's activities (kernels, memcpy, memset), as TorchTitan's profiler records them.
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda_) activities.insert(ActivityType::CUDA);
    kineto::prepareProfiler(config, activities);
    kineto::enableProfiler(config, activities);
    rec->kineto = true;
  }
  if (options_.enable_memory_snapshot && cuda_) {
    rec->cuda_snapshot = true;  // the allocator records its history since the trainer started: nothing to begin
  } else if (options_.enable_memory_snapshot) {
    TORCH_CHECK(tensor_memory::installed(), "fsdp-train: [profiling] enable_memory_snapshot needs the counting "
                                            "allocator, installed before the model is built");
    tensor_memory::start_timeline();
    rec->memory = true;
  }
  rec->start = fsdp::CollectiveSpan::Clock::now();
  recording_ = std::move(rec);
}

void StepProfiler::end_step(int64_t step) {
  if (!recording_ || recording_->step != step) return;
  const std::unique_ptr<Recording> rec = std::move(recording_);
  const std::string r = std::to_string(rank_);
  // TorchTitan's MemoryProfiler.step: the snapshot as the step ends, with the history leading up to it.
  if (rec->cuda_snapshot) write_cuda_snapshot("iteration_" + std::to_string(step));
  if (rec->memory) {
    const std::vector<tensor_memory::Sample> samples = tensor_memory::stop_timeline();
    const int64_t base_ns = samples.front().unix_ns / 1000000000 * 1000000000;  // whole seconds, as Kineto's
    std::ostringstream out;
    out << std::fixed << std::setprecision(3);
    const long pid = static_cast<long>(::getpid());  // the trace's pid for this process: merged, they share a row
    out << "{\"schemaVersion\": 1, \"displayTimeUnit\": \"ms\", \"baseTimeNanoseconds\": " << base_ns
        << ", \"distributedInfo\": {\"rank\": " << rank_ << "}, \"traceEvents\": [\n"
        << "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " << pid << ", \"tid\": 0, \"args\": {\"name\": "
        << quoted("rank " + r) << "}}";
    for (const auto& s : samples) {
      out << ",\n{\"ph\": \"C\", \"name\": \"live tensor bytes\", \"pid\": " << pid << ", \"tid\": 0, \"ts\": "
          << static_cast<double>(s.unix_ns - base_ns) / 1000.0 << ", \"args\": {\"bytes\": " << s.live_bytes << "}}";
    }
    out << "\n]}\n";
    write_file_whole((step_folder(dump_folder_, options_.save_memory_snapshot_folder, step) /
                      ("rank" + r + "_memory_timeline.json"))
                         .string(),
                     out.str(), "fsdp-train: [profiling]");
    wrote_memory_ = true;
  }
  if (rec->kineto) {
    // The transfers' events reach the profiler from the groups' lane threads a little after the waits: all of them
    // before it stops (on a loaded machine the lanes may not have run at all by the end of a short step).
    for (auto& g : groups_) {
      if (!fsdp::flush_profiler_reports(*g, std::chrono::seconds(30)))
        std::fprintf(stderr, "fsdp-train: [profiling] rank %d, step %lld: transfers of group %s still in flight; the "
                     "trace may lack them\n", rank_, static_cast<long long>(step), g->name().c_str());
    }
    const std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
    const auto folder = step_folder(dump_folder_, options_.save_traces_folder, step);
    const auto trace = folder / ("rank" + r + "_trace.json");
    result->save(trace.string());
    TORCH_CHECK(std::filesystem::exists(trace), "fsdp-train: [profiling] the profiler wrote no ", trace.string());
    // The same step as record_timeline saw it: what was in flight and what the training thread waited for.
    double in_flight = 0, exposed = 0;
    int64_t collectives = 0;
    std::ostringstream spans;
    spans << std::fixed << std::setprecision(6);
    std::ostringstream names;
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      fsdp::ProcessGroup& g = *groups_[gi];
      names << (gi ? ", " : "") << quoted(g.name());
      for (const fsdp::CollectiveSpan& s : fsdp::comm_timeline(g)) {
        if (s.completed == fsdp::CollectiveSpan::Clock::time_point{}) continue;  // still running: not this step's
        const double flight = seconds(s.completed - s.issued);
        const double waited = s.wait_end == fsdp::CollectiveSpan::Clock::time_point{}
                                  ? 0.0
                                  : seconds(s.wait_end - s.wait_begin);
        in_flight += flight;
        exposed += waited;
        spans << (collectives++ ? ",\n" : "\n") << "  {\"group\": " << quoted(g.name())
              << ", \"collective\": " << quoted(s.collective) << ", \"bytes\": " << s.bytes
              << ", \"issued_s\": " << seconds(s.issued - rec->start) << ", \"in_flight_s\": " << flight
              << ", \"waited_s\": " << waited << "}";
      }
      fsdp::record_timeline(g, false);
    }
    last_hidden_fraction_ = in_flight > 0 ? 1.0 - exposed / in_flight : -1;
    std::ostringstream out;
    out << std::fixed << std::setprecision(6);
    out << "{\"rank\": " << rank_ << ", \"step\": " << step << ", \"groups\": [" << names.str()
        << "], \"collectives\": " << collectives << ", \"in_flight_s\": " << in_flight << ", \"exposed_s\": " << exposed
        << ", \"hidden_fraction\": " << last_hidden_fraction_ << ", \"spans\": [" << spans.str() << "\n]}\n";
    write_file_whole((folder / ("rank" + r + "_comm.json")).string(), out.str(), "fsdp-train: [profiling]");
    wrote_traces_ = true;
  }
}

std::vector<std::pair<std::string, std::string>> StepProfiler::outputs() const {
  std::vector<std::pair<std::string, std::string>> out;
  const std::filesystem::path dump(dump_folder_);
  if (wrote_traces_) out.push_back({"profiler traces", (dump / options_.save_traces_folder).string()});
  if (wrote_memory_)
    out.push_back({cuda_ ? "memory snapshots" : "memory timelines", (dump / options_.save_memory_snapshot_folder).string()});
  return out;
}

}  // namespace fsdp_train
