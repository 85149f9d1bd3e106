// [profiling] (apps/fsdp-train/profiling.h) on 2 ranks: the step's Chrome trace parses as JSON and holds every
// collective with its size on every rank — the counts and byte sizes computed here by hand from the model's
// parameter shapes (FSDP's per-rank shard: ceil(dim0 / world) rows, each parameter 16-byte aligned in the
// all-gather buffer) —, FSDP's named steps and the training thread's waits; its overlap figure (1 - waited / in
// flight, from the trace's events) agrees with fsdp::record_timeline's (rank<r>_comm.json) within 5%; the CPU memory
// timeline reaches exactly the step's live-tensor peak that metrics.tensor_memory reports; merge-traces puts both
// ranks in one file on one clock. Under pipeline parallelism the trace holds each action ("PP:...") and the
// activations' sends and receives with their analytic size.
#include "config.h"
#include "models/llama3/parallelize_llama.h"
#include "tokenizer.h"
#include "trace_merge.h"
#include "trainer.h"
#include "train_env.h"

#include <fsdp/models/llama.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace fsdp_train {
namespace {

using test::shared_dir;
using test::world_env;

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << "missing " << path;
  return nlohmann::json::parse(in);  // throws (failing the test) when it is not JSON
}

// The job: cpu_small in float32 (4 bytes per element on the wire), 3 steps of one microbatch per rank (no
// accumulation: global batch = local x data-parallel degree), step 2 profiled.
JobConfig profiled_job(const std::string& folder, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--model.flavor", "cpu_small", "--training.seq_len", "64",
                                "--training.local_batch_size", "2", "--training.global_batch_size", "-1",
                                "--training.steps", "3",
                                "--lr_scheduler.warmup_steps", "1", "--metrics.peak_tflops", "1",
                                "--training.mixed_precision_param", "float32", "--profiling.enable_profiling",
                                "--profiling.profile_freq", "2", "--profiling.enable_memory_snapshot",
                                "--metrics.tensor_memory"};
  args.insert(args.end(), extra.begin(), extra.end());
  JobConfig c = load_config(args);
  c.job.dump_folder = folder;
  return c;
}

struct Event {
  std::string name;
  int64_t tid = 0;
  double ts = 0, dur = 0;
  std::string backend;  // transfer events: "bytes=... group=... | ..."
};

std::vector<Event> complete_events(const nlohmann::json& trace) {
  std::vector<Event> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    Event ev;
    ev.name = e.at("name").get<std::string>();
    ev.tid = e.at("tid").is_number() ? e.at("tid").get<int64_t>() : -1;
    ev.ts = e.at("ts").get<double>();
    ev.dur = e.at("dur").get<double>();
    if (e.contains("args") && e["args"].contains("Backend")) ev.backend = e["args"]["Backend"].get<std::string>();
    out.push_back(ev);
  }
  return out;
}

int64_t bytes_of(const Event& e) {
  std::smatch m;
  static const std::regex bytes("bytes=([0-9]+)");
  EXPECT_TRUE(std::regex_search(e.backend, m, bytes)) << e.name << ": no bytes in '" << e.backend << "'";
  return m.empty() ? -1 : std::stoll(m[1].str());
}

std::multiset<int64_t> sizes_of(const std::vector<Event>& events, const std::string& name) {
  std::multiset<int64_t> out;
  for (const auto& e : events)
    if (e.name == name) out.insert(bytes_of(e));
  return out;
}

int64_t count_of(const std::vector<Event>& events, const std::string& prefix) {
  return std::count_if(events.begin(), events.end(), [&](const Event& e) { return e.name.rfind(prefix, 0) == 0; });
}

// What FSDP moves for one module's parameters on `world` ranks, by hand: the all-gather input (this rank's
// shard of each parameter, ceil(dim0 / world) rows, 16-byte aligned one after the other) and the reduce-scatter
// input (world x the per-rank rows, float32, packed).
struct ModuleBytes {
  int64_t all_gather = 0, reduce_scatter = 0;
};
std::map<std::string, ModuleBytes> fsdp_bytes(const JobConfig& config, int64_t world) {
  auto args = llama3::model_args(config);
  args.vocab_size = make_tokenizer(config.model.tokenizer_path)->vocab_size();
  args.max_seq_len = config.training.seq_len;
  fsdp::models::llama::Transformer model(args);
  std::map<std::string, ModuleBytes> out;
  std::map<std::string, int64_t> rows_numel;
  for (const auto& p : model->named_parameters()) {
    std::smatch m;
    static const std::regex block("^(layers\\.[0-9]+)\\.");
    const std::string module = std::regex_search(p.key(), m, block) ? m[1].str() : "root";
    const int64_t dim0 = p.value().size(0);
    const int64_t shard_numel = (dim0 + world - 1) / world * (p.value().numel() / dim0);
    out[module].all_gather += (shard_numel * 4 + 15) / 16 * 16;
    rows_numel[module] += shard_numel;
  }
  for (auto& [module, b] : out) b.reduce_scatter = world * rows_numel[module] * 4;
  return out;
}

TEST(Profiling, TraceHoldsEveryCollectiveWithItsSizeAndAgreesWithTheTimeline) {
  const std::string dir = shared_dir("profile", "fsdp");
  const JobConfig config = profiled_job(dir);
  const TrainEnv env = world_env();
  const TrainSummary summary = run_training(config, env, false);
  fsdp::world()->barrier().wait();
  const int64_t world = env.world_size, r = env.rank;
  ASSERT_EQ(world, 2);
  const std::string step_dir = dir + "/profile_traces/iteration_2";
  // Only the multiples of profile_freq are recorded.
  EXPECT_FALSE(std::filesystem::exists(dir + "/profile_traces/iteration_1"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/profile_traces/iteration_3"));

  // The expected collectives, by hand. fully_shard on every block and the root, reshard after forward on every
  // block but the last (the root is kept): forward gathers the root and the L blocks, backward the L - 1 resharded
  // blocks again; every module's gradients are reduce-scattered once.
  const auto expected = fsdp_bytes(config, world);
  const int64_t L = static_cast<int64_t>(expected.size()) - 1;
  ASSERT_EQ(L, 4);
  std::multiset<int64_t> expected_ag, expected_rs;
  for (const auto& [module, b] : expected) {
    const bool last_block = module == "layers." + std::to_string(L - 1);
    const int gathers = module == "root" || last_block ? 1 : 2;
    for (int i = 0; i < gathers; ++i) expected_ag.insert(b.all_gather);
    expected_rs.insert(b.reduce_scatter);
  }
  ASSERT_GT(*expected_ag.begin(), 0);

  for (int64_t rank = 0; rank < world; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const auto trace = read_json(step_dir + "/rank" + std::to_string(rank) + "_trace.json");
    const auto events = complete_events(trace);
    EXPECT_EQ(sizes_of(events, "fsdp::all_gather_into_tensor"), expected_ag);
    EXPECT_EQ(sizes_of(events, "fsdp::reduce_scatter_tensor"), expected_rs);
    // The training thread: where the model's matmuls ran. Transfers are on threads of their own; the waits and
    // FSDP's steps on the training thread.
    std::set<int64_t> compute_threads, transfer_threads;
    for (const auto& e : events) {
      if (e.name == "aten::mm") compute_threads.insert(e.tid);
      if (e.name == "fsdp::all_gather_into_tensor" || e.name == "fsdp::reduce_scatter_tensor") transfer_threads.insert(e.tid);
    }
    ASSERT_EQ(compute_threads.size(), 1u);
    const int64_t training_thread = *compute_threads.begin();
    EXPECT_EQ(transfer_threads.count(training_thread), 0u);
    EXPECT_EQ(transfer_threads.size(), 2u) << "one track for all-gathers, one for reduce-scatters";
    int64_t waits_on_training_thread = 0;
    for (const auto& e : events)
      if (e.name.rfind("fsdp::wait(", 0) == 0 && e.tid == training_thread) ++waits_on_training_thread;
    EXPECT_EQ(count_of(events, "fsdp::wait(all_gather_into_tensor)"), static_cast<int64_t>(expected_ag.size()));
    EXPECT_EQ(count_of(events, "fsdp::wait(reduce_scatter_tensor)"), static_cast<int64_t>(expected_rs.size()));
    EXPECT_EQ(waits_on_training_thread, count_of(events, "fsdp::wait("));
    EXPECT_EQ(count_of(events, "FSDP::all_gather_copy_in"), static_cast<int64_t>(expected_ag.size()));
    EXPECT_EQ(count_of(events, "FSDP::all_gather_copy_out"), static_cast<int64_t>(expected_ag.size()));
    EXPECT_EQ(count_of(events, "FSDP::reduce_scatter_copy_in"), static_cast<int64_t>(expected_rs.size()));
    EXPECT_EQ(count_of(events, "FSDP::pre_forward ("), L + 1);
    EXPECT_EQ(count_of(events, "FSDP::post_backward ("), L + 1);

    // The overlap figure from the trace against record_timeline's, over the same groups.
    const auto comm = read_json(step_dir + "/rank" + std::to_string(rank) + "_comm.json");
    std::set<std::string> groups;
    for (const auto& g : comm.at("groups")) groups.insert(g.get<std::string>());
    double in_flight = 0, waited = 0;
    int64_t transfers = 0;
    for (const auto& e : events) {
      if (e.name.rfind("fsdp::wait(", 0) == 0) waited += e.dur;
      if (e.backend.empty() || e.name.rfind("fsdp::", 0) != 0) continue;
      std::smatch m;
      static const std::regex group(" group=([^ ]+) ");
      ASSERT_TRUE(std::regex_search(e.backend, m, group)) << e.backend;
      if (!groups.count(m[1].str())) continue;
      in_flight += e.dur;
      ++transfers;
    }
    EXPECT_EQ(transfers, comm.at("collectives").get<int64_t>());
    ASSERT_GT(in_flight, 0);
    const double trace_hidden = 1.0 - waited / in_flight;
    const double timeline_hidden = comm.at("hidden_fraction").get<double>();
    std::printf("rank %lld: %lld transfers, %.2f ms in flight, %.2f ms waited: hidden %.1f%% (trace) vs %.1f%% "
                "(record_timeline)\n",
                static_cast<long long>(rank), static_cast<long long>(transfers), in_flight / 1e3, waited / 1e3,
                100 * trace_hidden, 100 * timeline_hidden);
    EXPECT_GT(timeline_hidden, 0.0);
    EXPECT_LE(std::abs(trace_hidden - timeline_hidden), 0.05 * timeline_hidden);
    EXPECT_NEAR(in_flight / 1e6, comm.at("in_flight_s").get<double>(), 0.05 * comm.at("in_flight_s").get<double>());

    // The memory timeline: live tensor bytes at every allocation and free of step 2; its highest point is the
    // step's peak as metrics.tensor_memory counts it (the same allocator, read another way).
    const auto memory = read_json(dir + "/memory_snapshot/iteration_2/rank" + std::to_string(rank) +
                                  "_memory_timeline.json");
    int64_t samples = 0, high = 0, low = INT64_MAX;
    for (const auto& e : memory.at("traceEvents")) {
      if (e.value("ph", "") != "C") continue;
      const int64_t b = e.at("args").at("bytes").get<int64_t>();
      high = std::max(high, b), low = std::min(low, b), ++samples;
    }
    EXPECT_GT(samples, 100);
    EXPECT_GT(high, low);
    if (rank == r) {
      ASSERT_GE(summary.tensor_memory.size(), 2u);
      EXPECT_EQ(high, summary.tensor_memory[1].peak);
    }
  }

  // One file for both ranks, on one clock: every event kept, every rank a process of its own.
  if (r == 0) {
    const std::string merged_path = dir + "/merged.json";
    const MergedTrace merged = merge_traces({step_dir, dir + "/memory_snapshot/iteration_2"}, merged_path);
    EXPECT_EQ(merged.files, 4u);
    EXPECT_EQ(merged.ranks, (std::vector<int>{0, 1}));
    const auto all = read_json(merged_path);
    std::set<std::string> processes;
    for (const auto& e : all.at("traceEvents"))
      if (e.value("name", "") == "process_name") processes.insert(e.at("args").at("name").get<std::string>());
    EXPECT_TRUE(processes.count("rank 0 (fsdp-train)") || processes.count("rank 0")) << all.at("traceEvents").size();
    EXPECT_EQ(sizes_of(complete_events(all), "fsdp::all_gather_into_tensor").size(), world * expected_ag.size());
    // Both ranks ran the step at the same time: their all-gathers interleave on the merged clock.
    std::vector<double> starts[2];
    for (const auto& e : all.at("traceEvents"))
      if (e.value("name", "") == "fsdp::all_gather_into_tensor")
        starts[e.at("pid").get<int64_t>() / 1000].push_back(e.at("ts").get<double>());
    ASSERT_FALSE(starts[0].empty());
    ASSERT_FALSE(starts[1].empty());
    const double first0 = *std::min_element(starts[0].begin(), starts[0].end());
    const double first1 = *std::min_element(starts[1].begin(), starts[1].end());
    EXPECT_LT(std::abs(first0 - first1), 1e6) << "the ranks' first all-gathers are more than a second apart";
  }
  fsdp::world()->barrier().wait();
}

// bfloat16 parameters: libtorch's kernels then take scratch memory through the CPU allocator's raw_allocate, which
// the counting allocator must serve (it once stopped the run with an internal assert).
TEST(Profiling, MemoryTimelineUnderBfloat16) {
  const std::string dir = shared_dir("profile", "bf16");
  JobConfig config = load_config({"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size",
                                  "2", "--training.global_batch_size", "-1", "--training.steps", "1",
                                  "--metrics.peak_tflops", "1", "--training.mixed_precision_param", "bfloat16",
                                  "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "1",
                                  "--metrics.tensor_memory"});
  config.job.dump_folder = dir;
  const TrainEnv env = world_env();
  const TrainSummary summary = run_training(config, env, false);
  ASSERT_EQ(summary.tensor_memory.size(), 1u);
  const auto memory = read_json(dir + "/memory_snapshot/iteration_1/rank" + std::to_string(env.rank) +
                                "_memory_timeline.json");
  int64_t high = 0;
  for (const auto& e : memory.at("traceEvents"))
    if (e.value("ph", "") == "C") high = std::max(high, e.at("args").at("bytes").get<int64_t>());
  EXPECT_EQ(high, summary.tensor_memory[0].peak);
  EXPECT_FALSE(std::filesystem::exists(dir + "/profile_traces")) << "only the memory timeline was asked for";
  fsdp::world()->barrier().wait();
}

TEST(Profiling, PipelineActionsAndTheirSendsAndReceives) {
  const std::string dir = shared_dir("profile", "pp");
  const JobConfig config = profiled_job(dir, {"--parallelism.pipeline_parallel_degree", "2",
                                              "--parallelism.pipeline_parallel_schedule", "1F1B"});
  const TrainEnv env = world_env();
  run_training(config, env, false);
  fsdp::world()->barrier().wait();
  const auto trace = read_json(dir + "/profile_traces/iteration_2/rank" + std::to_string(env.rank) + "_trace.json");
  const auto events = complete_events(trace);
  // Microbatches of pipeline_parallel_microbatch_size (1) sample: each activation (and its gradient) is
  // [1, seq_len, dim] float32.
  const int64_t activation_bytes = 1 * config.training.seq_len * llama3::model_args(config).dim * 4;
  const int64_t microbatches = config.training.local_batch_size;
  const auto sends = sizes_of(events, "fsdp::send"), recvs = sizes_of(events, "fsdp::recv");
  // Stage 0 sends every microbatch's activations and receives their gradients; stage 1 the other way round.
  const std::vector<int64_t> each(static_cast<size_t>(microbatches), activation_bytes);
  EXPECT_EQ(sends, std::multiset<int64_t>(each.begin(), each.end()));
  EXPECT_EQ(recvs, std::multiset<int64_t>(each.begin(), each.end()));
  const std::string stage = std::to_string(env.rank);
  EXPECT_EQ(count_of(events, "PP:" + stage + "F"), microbatches);
  EXPECT_EQ(count_of(events, "PP:" + stage + "B"), microbatches);
  fsdp::world()->barrier().wait();
}

}  // namespace
}  // namespace fsdp_train
