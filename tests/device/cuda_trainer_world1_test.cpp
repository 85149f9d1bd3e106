// fsdp-train on one GPU at world size 1, as `fsdprun --nproc 1 fsdp-train --training.device cuda` runs it: the
// world group with comm.backend "auto" (NCCL where libfsdp has it, else Gloo), fully_shard on a "cuda" mesh and
// bf16 mixed precision (training.mixed_precision_param). Against single-process fp32 training on the CPU of the
// same batches: the first step's loss within bf16's precision (2%), every loss finite. The log's memory from the
// caching allocator: the run's max active at least the fp32 parameters plus AdamW's two states (12 bytes per
// parameter, counted from the model's shapes), max reserved >= max active, both in metrics.jsonl. With
// [profiling]: the Kineto trace of step 2 holds the GPU's kernels and the batch's host-to-device copy, and the
// CUDA memory snapshot pickle loads with python3's pickle and has "segments" and "device_traces" (allocations
// recorded). Run by scripts/gpu-check.sh on a lent GPU machine; skipped without CUDA.
#include "device/cuda_trainer_util.h"

#include "model_spec.h"
#include "tokenizer.h"


#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

using namespace fsdp_device;

namespace {

std::vector<nlohmann::json> jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The output of `command` (stdout), and its exit status in `status`.
std::string run(const std::string& command, int& status) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) {
    status = -1;
    return out;
  }
  char buf[512];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  status = ::pclose(p);
  return out;
}

}  // namespace

TEST(TrainerOnCudaWorld1, Bf16StepsMemoryTraceAndSnapshot) {
  FSDP_REQUIRE_CUDA();
  DeviceWorld dw("auto", "cuda:0");
  const auto& world = dw.group();
  ASSERT_EQ(world->size(), 1);
  const std::vector<std::string> extra{"--model.flavor", "cpu_small", "--training.mixed_precision_param", "bfloat16",
                                       "--training.device", "cuda:0", "--profiling.enable_profiling",
                                       "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"};
  fsdp_train::JobConfig job = trainer_job("world1", extra, 2);
  const auto ref = cpu_reference(job);
  const auto got = fsdp_train::run_training(job, device_env(world), false);

  // bf16 through FSDP's mixed precision (the plan says so), on the GPU.
  EXPECT_NE(got.plan.find("param bfloat16"), std::string::npos) << got.plan;
  EXPECT_EQ(got.device, "cuda:0");
  ASSERT_EQ(got.losses.size(), 2u);
  for (double l : got.losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NEAR(got.losses[0], ref.losses[0], 0.02 * ref.losses[0]) << "step 1: bf16 on the GPU vs fp32 on the CPU";
  std::printf("[trainer cuda world 1] %s (%s): losses %.4f %.4f (cpu fp32 %.4f %.4f); max reserved %lld B, max "
              "active %lld B\n", got.device.c_str(), world->backend().c_str(), got.losses[0], got.losses[1],
              ref.losses[0], ref.losses[1], static_cast<long long>(got.device_max_reserved_bytes),
              static_cast<long long>(got.device_max_active_bytes));

  // Memory: the fp32 sharded parameters (world 1: whole) and AdamW's exp_avg / exp_avg_sq were all live at once.
  fsdp_train::ModelShape shape;  // the model's parameter count through the model seam (built on meta: no storage)
  shape.vocab_size = fsdp_train::make_tokenizer(job.model.tokenizer_path)->vocab_size();
  shape.max_seq_len = job.training.seq_len;
  shape.device = c10::kMeta;
  const int64_t n_params = fsdp_train::train_spec(job.model.name).build(job, shape).num_params;
  EXPECT_GE(got.device_max_active_bytes, 12 * n_params);
  EXPECT_GE(got.device_max_reserved_bytes, got.device_max_active_bytes);
  const auto records = jsonl(got.dump_folder + "/metrics.jsonl");
  ASSERT_GE(records.size(), 2u);
  for (const auto& r : records) {
    if (!r.contains("loss")) continue;
    EXPECT_EQ(r.value("memory_source", ""), "caching_allocator") << r.dump();
    EXPECT_GT(r.value("memory_max_reserved_gib", 0.0), 0.0) << r.dump();
    EXPECT_GT(r.value("memory_max_active_gib", 0.0), 0.0) << r.dump();
    EXPECT_GT(r.value("memory_max_reserved_pct", 0.0), 0.0) << r.dump();
    EXPECT_LE(r.value("memory_max_reserved_pct", 0.0), 100.0) << r.dump();
  }

  // The trace of step 2: the device's lanes (kernels; the batch's host-to-device copy).
  const std::string trace_path = got.dump_folder + "/" + job.profiling.save_traces_folder + "/iteration_2/rank0_trace.json";
  std::ifstream trace_in(trace_path);
  ASSERT_TRUE(trace_in) << trace_path;
  const nlohmann::json trace = nlohmann::json::parse(trace_in);
  std::set<std::string> categories;
  int64_t kernels = 0;
  for (const auto& e : trace.at("traceEvents")) {
    const std::string cat = e.value("cat", "");
    categories.insert(cat);
    kernels += cat == "kernel";
  }
  EXPECT_GT(kernels, 10) << "GPU kernels in the trace";
  EXPECT_TRUE(categories.count("gpu_memcpy")) << "the batch's host-to-device copy";

  // The CUDA memory snapshot of step 2, loaded as PyTorch's memory visualizer loads it.
  const std::string pickle_path =
      got.dump_folder + "/" + job.profiling.save_memory_snapshot_folder + "/iteration_2/rank0_memory_snapshot.pickle";
  ASSERT_TRUE(std::filesystem::exists(pickle_path)) << pickle_path;
  int status = 0;
  const std::string summary = run(std::string(FSDP_TEST_PYTHON) + " -c \"import pickle, sys\n"
                                  "d = pickle.load(open(sys.argv[1], 'rb'))\n"
                                  "traces = d['device_traces']\n"
                                  "print(len(d['segments']), sum(1 for t in traces for e in t if e['action'] == 'alloc'))\" " +
                                      pickle_path,
                                  status);
  ASSERT_EQ(status, 0) << "python3 could not load " << pickle_path << ": " << summary;
  long long segments = 0, allocs = 0;
  ASSERT_EQ(std::sscanf(summary.c_str(), "%lld %lld", &segments, &allocs), 2) << summary;
  EXPECT_GT(segments, 0) << "segments";
  EXPECT_GT(allocs, 0) << "alloc actions in device_traces";
  std::printf("[trainer cuda world 1] memory snapshot %s: %lld segments, %lld allocs recorded\n", pickle_path.c_str(),
              segments, allocs);
}
