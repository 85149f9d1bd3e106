// fsdp-train's parallelize step (apps/fsdp-train/parallelize.h) from configs: what each apply_* did to the model,
// read back from the model itself (fsdp::fsdp_module, fsdp::is_checkpointed, the sharded state dict's meshes,
// placements and local shapes, the pipeline stages' parameters) and compared with what the config asks for,
// worked out by hand in each test: TorchTitan's rules (AC every k-th block counted from 1, the Llama TP plan's
// colwise/rowwise/sequence-parallel layouts, FSDP's torch.chunk-style dim-0 shards, experts split over ep then
// efsdp, TorchTitan's pipeline split and the loop / V stage placement).
//
// Run alone (or .np1): activation checkpointing, the pipeline split of every schedule, FSDP on a 1-rank group.
// On 4 ranks (.np4): FSDP, HSDP, TP (x FSDP, x HSDP), EP (x FSDP, x HSDP), DDP, PP x FSDP and AC inside the
// composition, each from its [parallelism] keys.
#include "config.h"
#include "parallel_dims.h"
#include "models/llama3/parallelize_llama.h"

#include <fsdp/activation_checkpoint.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/moe.h>
#include <fsdp/nn/module_call.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <torch/torch.h>

#include "comm/dist_env.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

using namespace fsdp_train;
using namespace fsdp_train::llama3;

namespace {

JobConfig config_of(std::vector<std::string> args) {
  // The global batch follows the data-parallel degree (-1): only the parallelism keys matter here.
  std::vector<std::string> all{"--model.flavor", "cpu_tiny", "--training.seq_len", "32", "--training.local_batch_size",
                               "4", "--training.global_batch_size", "-1", "--activation_checkpoint.mode", "none",
                               "--training.mixed_precision_param", "float32"};
  all.insert(all.end(), args.begin(), args.end());
  return load_config(all);
}

// The model as the trainer builds it before parallelize_llama (whole and initialized: every plan accepts that).
fsdp::models::llama::Transformer build_model(const JobConfig& config) {
  fsdp::models::llama::Transformer model(model_args(config));
  model->init_weights(static_cast<uint64_t>(config.debug.seed));
  return model;
}

// FQNs of the modules fully_shard (or replicate) was applied to, read from the model ("" = the root).
std::set<std::string> fsdp_fqns(torch::nn::Module& root) {
  std::set<std::string> out;
  if (fsdp::fsdp_module(root)) out.insert("");
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (fsdp::fsdp_module(*item.value())) out.insert(item.key());
  }
  return out;
}

// Every block and the root: what apply_fsdp and apply_ddp wrap, by hand from the layer count.
std::set<std::string> blocks_and_root(int64_t n_layers) {
  std::set<std::string> out{""};
  for (int64_t i = 0; i < n_layers; ++i) out.insert("layers." + std::to_string(i));
  return out;
}

// torch.chunk's piece `index` of `n` rows in `k` chunks (the rows a dim-0 shard holds), by hand.
int64_t chunk_rows(int64_t n, int64_t k, int64_t index) {
  const int64_t size = (n + k - 1) / k;
  return std::max<int64_t>(0, std::min(size, n - index * size));
}

std::string dims_of(const fsdp::ShardedTensor& t) {
  std::string s;
  for (const auto& d : t.mesh().dim_names()) s += (s.empty() ? "" : ",") + d;
  return s;
}

bool is_expert(const std::string& fqn) { return fqn.find(".moe.experts.") != std::string::npos; }

// The TP layout TorchTitan's Llama plan gives a parameter on the tp dim: colwise (wq/wk/wv, w1/w3, output)
// Shard(0), rowwise (wo, w2) Shard(1), the embedding rowwise Shard(0) (vocabulary rows), norms Replicate().
std::string tp_placement(const std::string& fqn) {
  auto ends = [&](const std::string& s) {
    return fqn.size() >= s.size() && fqn.compare(fqn.size() - s.size(), s.size(), s) == 0;
  };
  for (const char* colwise : {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                              "feed_forward.w1.weight", "feed_forward.w3.weight", "output.weight",
                              "tok_embeddings.weight"}) {
    if (ends(colwise)) return "Shard(0)";
  }
  for (const char* rowwise : {"attention.wo.weight", "feed_forward.w2.weight"}) {
    if (ends(rowwise)) return "Shard(1)";
  }
  return "Replicate()";
}

int world_size() { return fsdp::world()->size(); }
int rank() { return fsdp::world()->rank(); }

struct Applied {
  ParallelDims dims;
  ParallelPlan plan;
};

Applied parallelize(fsdp::models::llama::Transformer& model, const JobConfig& config) {
  Applied a;
  a.dims = resolve_parallelism(config, world_size());
  a.plan = parallelize_llama(model, config, a.dims, fsdp::world());
  return a;
}

}  // namespace

// ---- without ranks ------------------------------------------------------------------------------------------

// [activation_checkpoint]: which blocks apply_ac wraps, by TorchTitan's rule (layer SAC: the block counted from 1
// is wrapped when its count is a multiple of k; k = 0 or 1: every block), and that the op policy saves matmuls
// where full AC saves none. debugmodel's 6 blocks, on `meta` (no compute) for the counts.
TEST(Parallelize, ApplyAcWrapsTheBlocksTheConfigNames) {
  struct Case {
    std::vector<std::string> args;
    std::vector<int> wrapped;  // 0-based block indices, by hand
  };
  const std::vector<Case> cases = {
      {{"--activation_checkpoint.mode", "none"}, {}},
      {{"--activation_checkpoint.mode", "full"}, {0, 1, 2, 3, 4, 5}},
      {{"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"}, {1, 3, 5}},
      {{"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "3"}, {2, 5}},
      {{"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "1"},
       {0, 1, 2, 3, 4, 5}},
      {{"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"},
       {0, 1, 2, 3, 4, 5}},
      {{"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"},
       {0, 1, 2, 3, 4, 5}},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args{"--model.flavor", "debugmodel"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const JobConfig config = load_config(args);
    SCOPED_TRACE(args[3] + (args.size() > 5 ? " " + args[5] : std::string()));
    auto model_args_meta = model_args(config);
    model_args_meta.device = c10::kMeta;
    fsdp::models::llama::Transformer model(model_args_meta);
    ASSERT_EQ(model->blocks().size(), 6u);
    apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option);
    std::vector<int> wrapped;
    for (size_t i = 0; i < model->blocks().size(); ++i) {
      if (fsdp::is_checkpointed(*model->blocks()[i])) wrapped.push_back(static_cast<int>(i));
    }
    EXPECT_EQ(wrapped, c.wrapped);
    EXPECT_FALSE(fsdp::is_checkpointed(*model)) << "only blocks are wrapped";
  }

  // The policy: a forward + backward of cpu_tiny (2 blocks). Full AC keeps no matmul output and recomputes both
  // blocks; op-level SAC keeps some and hands them back in the recomputation.
  for (const std::string option : {"2", "op"}) {
    const JobConfig config =
        load_config({"--model.flavor", "cpu_tiny", "--activation_checkpoint.mode", option == "op" ? "selective" : "full",
                     "--activation_checkpoint.selective_ac_option", option});
    auto model = build_model(config);
    apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option);
    auto tokens = torch::randint(model->args().vocab_size, {2, 16});
    fsdp::nn::call(model, tokens).sum().backward();
    const auto stats = fsdp::checkpoint_stats(model);
    EXPECT_EQ(stats.forwards, 2) << option;
    EXPECT_EQ(stats.recomputes, 2) << option;
    if (option == "op") {
      EXPECT_GT(stats.mm_saved, 0);
      EXPECT_GT(stats.mm_reused, 0);
    } else {
      EXPECT_EQ(stats.mm_saved, 0);
    }
  }
}

// split_pipeline: TorchTitan's stage split (effective layers = n_layers + 1 + 1, spread evenly, the first stages
// one more) and the schedule's placement (loop: stage s on rank s % pp; ZBV's V: 0..pp-1, pp-1..0), by hand for
// debugmodel's 6 layers; the stages' parameter FQNs are the whole model's.
TEST(Parallelize, SplitPipelinePlacesTheStagesTheConfigNames) {
  struct Case {
    std::vector<std::string> args;
    int64_t pp;
    std::vector<std::pair<int64_t, int64_t>> layers;  // per stage, by hand
    std::vector<std::vector<int>> stages_of_rank;     // by hand
  };
  const std::vector<Case> cases = {
      // 2 stages, 8 effective layers: 4 + 4 = (embedding + 3) + (3 + norm/output).
      {{"--parallelism.pipeline_parallel_schedule", "1F1B"}, 2, {{0, 3}, {3, 6}}, {{0}, {1}}},
      {{"--parallelism.pipeline_parallel_schedule", "GPipe"}, 2, {{0, 3}, {3, 6}}, {{0}, {1}}},
      // 4 stages of 2 effective layers: (emb + 0), (1, 2), (3, 4), (5 + norm/output); loop placement.
      {{"--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"}, 2, {{0, 1}, {1, 3}, {3, 5}, {5, 6}}, {{0, 2}, {1, 3}}},
      {{"--parallelism.pipeline_parallel_schedule", "LoopedBFS"}, 2, {{0, 1}, {1, 3}, {3, 5}, {5, 6}}, {{0, 2}, {1, 3}}},
      // ZBV: the V, rank 0 holds the first and the last stage.
      {{"--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"}, 2, {{0, 1}, {1, 3}, {3, 5}, {5, 6}}, {{0, 3}, {1, 2}}},
      // layers_per_stage 2 -> ceil(8 / 2) = 4 stages over pp 4 with 1F1B: one each.
      {{"--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_layers_per_stage", "2"},
       4, {{0, 1}, {1, 3}, {3, 5}, {5, 6}}, {{0}, {1}, {2}, {3}}},
      // 8 effective layers over 3 stages: 3, 3, 2 -> (emb + 0, 1), (2, 3, 4), (5 + norm/output).
      {{"--parallelism.pipeline_parallel_schedule", "GPipe", "--parallelism.pipeline_parallel_layers_per_stage", "3"},
       3, {{0, 2}, {2, 5}, {5, 6}}, {{0}, {1}, {2}}},
      // Explicit stages.
      {{"--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.module_fqns_per_model_part",
        "tok_embeddings,layers.0;layers.1,layers.2,layers.3,layers.4,layers.5,norm,output"},
       2, {{0, 1}, {1, 6}}, {{0}, {1}}},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args{"--model.flavor", "debugmodel"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const JobConfig config = load_config(args);
    SCOPED_TRACE(c.args[1] + (c.args.size() > 2 ? " " + c.args[3] : std::string()));
    PipelineSplitOptions o;
    o.schedule = config.parallelism.pipeline_parallel_schedule;
    o.pp = c.pp;
    o.microbatches = 8;
    o.layers_per_stage = config.parallelism.pipeline_parallel_layers_per_stage;
    o.module_fqns_per_model_part = config.parallelism.module_fqns_per_model_part;
    auto args_meta = model_args(config);
    args_meta.device = c10::kMeta;
    const PipelineSplit split = split_pipeline(args_meta, o);
    EXPECT_EQ(split.num_stages, static_cast<int64_t>(c.layers.size()));
    EXPECT_EQ(split.layers, c.layers);
    for (int r = 0; r < c.pp; ++r) EXPECT_EQ(split.schedule.stages_of_rank(r), c.stages_of_rank[static_cast<size_t>(r)]) << "rank " << r;

    // The stages' parameters: the whole model's FQNs of exactly the modules each stage holds.
    fsdp::models::llama::Transformer model(args_meta);
    for (int64_t s = 0; s < split.num_stages; ++s) {
      const auto [begin, end] = c.layers[static_cast<size_t>(s)];
      fsdp::models::llama::LlamaStage stage(*model, begin, end, s == 0, s == split.num_stages - 1);
      std::set<std::string> modules;
      for (const auto& p : stage->named_parameters()) {
        const std::string& fqn = p.key();
        const auto dot = fqn.find('.');
        modules.insert(fqn.rfind("layers.", 0) == 0 ? fqn.substr(0, fqn.find('.', dot + 1)) : fqn.substr(0, dot));
      }
      std::set<std::string> want;
      if (s == 0) want.insert("tok_embeddings");
      for (int64_t l = begin; l < end; ++l) want.insert("layers." + std::to_string(l));
      if (s == split.num_stages - 1) want.insert({"norm", "output"});
      EXPECT_EQ(modules, want) << "stage " << s;
    }
  }

  // What does not fit is refused with the key.
  PipelineSplitOptions three;
  three.schedule = PipelineSchedule::OneFOneB;
  three.pp = 2;
  three.microbatches = 4;
  three.module_fqns_per_model_part = {{"tok_embeddings"}, {"layers.0"}, {"layers.1", "norm", "output"}};
  auto tiny = model_args(load_config({"--model.flavor", "cpu_tiny"}));
  try {
    split_pipeline(tiny, three);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("module_fqns_per_model_part lists 3 stages, not a multiple of "
                                         "pipeline_parallel_degree = 2"),
              std::string::npos)
        << e.what();
  }
}

// ---- with a process group -------------------------------------------------------------------------------------

// FSDP only (data_parallel_shard_degree -1 = every rank): every block and the root wrapped, every parameter
// Shard(0) over "dp_shard" holding its torch.chunk rows. Any world size (a 1-rank group too).
TEST(Parallelize, FsdpShardsEveryParameterOverTheWorld) {
  const JobConfig config = config_of({});
  auto model = build_model(config);
  std::map<std::string, std::vector<int64_t>> full_shapes;
  for (const auto& p : model->named_parameters()) full_shapes[p.key()] = p.value().sizes().vec();
  const Applied a = parallelize(model, config);
  EXPECT_EQ(fsdp_fqns(*model), blocks_and_root(2));
  EXPECT_EQ(a.plan.fsdp_modules.size(), 3u);
  const auto sd = fsdp::sharded_state_dict(*model);
  size_t params = 0;
  for (const auto& [fqn, shape] : full_shapes) {
    SCOPED_TRACE(fqn);
    const auto& t = sd.at(fqn);
    EXPECT_EQ(dims_of(t), "dp_shard");
    EXPECT_EQ(fsdp::to_string(t.placements()), "(Shard(0))");
    EXPECT_EQ(t.sizes(), shape);
    EXPECT_EQ(t.local().size(0), chunk_rows(shape[0], world_size(), rank()));
    ++params;
  }
  EXPECT_EQ(params, 2 * 9 + 3u);  // per block: 4 attention + 3 feed-forward weights + 2 norms; + embedding, norm, output
}

TEST(Parallelize, HsdpReplicatesShardGroups) {
  if (world_size() != 4) GTEST_SKIP() << "replicate 2 x shard 2 on 4 ranks";
  const JobConfig config = config_of({"--parallelism.data_parallel_replicate_degree", "2"});
  auto model = build_model(config);
  const Applied a = parallelize(model, config);
  EXPECT_EQ(a.dims.dp_shard, 2);
  EXPECT_EQ(fsdp_fqns(*model), blocks_and_root(2));
  const int64_t shard_rank = rank() % 2;  // mesh [dp_replicate, dp_shard], row-major
  const auto sd = fsdp::sharded_state_dict(*model);
  for (const auto& p : model->named_parameters()) {
    const std::string& fqn = p.key();
    SCOPED_TRACE(fqn);
    const auto& t = sd.at(fqn);
    EXPECT_EQ(dims_of(t), "dp_replicate,dp_shard");
    EXPECT_EQ(fsdp::to_string(t.placements()), "(Replicate(), Shard(0))");
    EXPECT_EQ(t.local().size(0), chunk_rows(t.sizes()[0], 2, shard_rank));
  }
}

TEST(Parallelize, DdpReplicatesWithoutSharding) {
  if (world_size() != 4) GTEST_SKIP() << "replicate 4 on 4 ranks";
  const JobConfig config = config_of({"--parallelism.data_parallel_replicate_degree", "4",
                                      "--parallelism.data_parallel_shard_degree", "1"});
  auto model = build_model(config);
  const Applied a = parallelize(model, config);
  EXPECT_NE(a.plan.description.find("data parallel (replicate 4"), std::string::npos) << a.plan.description;
  EXPECT_EQ(a.plan.fsdp_modules.size(), 3u);  // every block, then the root
  std::set<std::string> wrapped;
  for (const auto& m : a.plan.fsdp_modules) {
    for (const auto& item : model->named_modules("", true)) {
      if (item.value().get() == &m.module()) wrapped.insert(item.key());
    }
  }
  EXPECT_EQ(wrapped, blocks_and_root(2));
  const auto sd = fsdp::sharded_state_dict(*model);
  for (const auto& p : model->named_parameters()) {
    SCOPED_TRACE(p.key());
    const auto& t = sd.at(p.key());
    EXPECT_EQ(t.local().sizes(), c10::IntArrayRef(t.sizes())) << "every replica holds the whole tensor";
  }
}

// TP 2 x FSDP 2 (and x HSDP 2 x 1): each parameter's TP layout from TorchTitan's plan, nested under FSDP's dim-0
// shard over the data-parallel dims: colwise (Shard(0) on tp) -> (_StridedShard(0, 2), Shard(0)); rowwise ->
// (Shard(0), Shard(1)); sequence-parallel norms -> (Shard(0), Replicate()).
TEST(Parallelize, TensorParallelLayoutsUnderFsdp) {
  if (world_size() != 4) GTEST_SKIP() << "tp 2 x dp 2 on 4 ranks";
  for (const bool hsdp : {false, true}) {
    SCOPED_TRACE(hsdp ? "replicate 2 x shard 1 x tp 2" : "shard 2 x tp 2");
    std::vector<std::string> args{"--parallelism.tensor_parallel_degree", "2"};
    if (hsdp) args.insert(args.end(), {"--parallelism.data_parallel_replicate_degree", "2"});
    const JobConfig config = config_of(args);
    auto model = build_model(config);
    std::map<std::string, std::vector<int64_t>> full_shapes;
    for (const auto& p : model->named_parameters()) full_shapes[p.key()] = p.value().sizes().vec();
    const Applied a = parallelize(model, config);
    EXPECT_TRUE(a.plan.tp_mesh.valid());
    EXPECT_TRUE(a.plan.loss_parallel);
    EXPECT_EQ(fsdp_fqns(*model), blocks_and_root(2));
    const int64_t tp_rank = rank() % 2, dp_shard_rank = hsdp ? 0 : rank() / 2;
    const int64_t dp_shards = hsdp ? 1 : 2;
    const auto sd = fsdp::sharded_state_dict(*model);
    for (const auto& [fqn, shape] : full_shapes) {
      SCOPED_TRACE(fqn);
      const auto& t = sd.at(fqn);
      const std::string tp = tp_placement(fqn);
      const std::string dp = tp == "Shard(0)" ? "_StridedShard(dim=0, sf=2)" : "Shard(0)";
      EXPECT_EQ(fsdp::to_string(t.placements()), (hsdp ? "(Replicate(), " : "(") + dp + ", " + tp + ")");
      EXPECT_EQ(dims_of(t), hsdp ? "dp_replicate,dp_shard,tp" : "dp_shard,tp");
      EXPECT_EQ(t.sizes(), shape);
      // The rows this rank holds: TP's piece first, then FSDP's dim-0 chunk of it.
      const int64_t rows = tp == "Shard(0)" ? chunk_rows(shape[0], 2, tp_rank) : shape[0];
      EXPECT_EQ(t.local().size(0), chunk_rows(rows, dp_shards, dp_shard_rank));
      if (tp == "Shard(1)") EXPECT_EQ(t.local().size(1), shape[1] / 2);
    }
  }
}

// EP 2 inside dp_shard 4 (and HSDP 2 x 2 with EP 2): the routed experts split over ep first (E / ep experts per
// rank), then their FSDP over the ep-peers left (efsdp); everything else FSDP over the dense mesh.
TEST(Parallelize, ExpertParallelSplitsTheRoutedExperts) {
  if (world_size() != 4) GTEST_SKIP() << "ep 2 on 4 ranks";
  for (const bool hsdp : {false, true}) {
    SCOPED_TRACE(hsdp ? "replicate 2 x shard 2, ep 2" : "shard 4, ep 2");
    std::vector<std::string> args{"--model.name", "qwen3", "--model.flavor", "cpu_tiny_moe",
                                  "--parallelism.expert_parallel_degree", "2"};
    if (hsdp) args.insert(args.end(), {"--parallelism.data_parallel_replicate_degree", "2"});
    const JobConfig config = config_of(args);
    const int64_t experts = model_args(config).moe->num_experts;
    ASSERT_EQ(experts, 8);  // qwen3 cpu_tiny_moe
    auto model = build_model(config);
    std::map<std::string, std::vector<int64_t>> full_shapes;
    for (const auto& p : model->named_parameters()) full_shapes[p.key()] = p.value().sizes().vec();
    const Applied a = parallelize(model, config);
    EXPECT_EQ(fsdp_fqns(*model), blocks_and_root(2));
    const int64_t dp_shard = hsdp ? 2 : 4, ep = 2, efsdp = dp_shard / ep;
    const int64_t shard_rank = rank() % dp_shard;          // [dp_replicate,] dp_shard
    const int64_t ep_rank = shard_rank % ep, efsdp_rank = shard_rank / ep;  // [dp_replicate,] efsdp, ep
    int64_t expert_params = 0;
    const auto sd = fsdp::sharded_state_dict(*model);
    for (const auto& [fqn, shape] : full_shapes) {
      SCOPED_TRACE(fqn);
      const auto& t = sd.at(fqn);
      EXPECT_EQ(t.sizes(), shape);
      if (is_expert(fqn)) {
        ++expert_params;
        EXPECT_EQ(shape[0], experts);
        EXPECT_EQ(fsdp::to_string(t.placements()),
                  std::string(hsdp ? "(Replicate(), " : "(") + "_StridedShard(dim=0, sf=2), Shard(0))");
        EXPECT_EQ(dims_of(t), hsdp ? "dp_replicate,efsdp,ep" : "efsdp,ep");
        // experts [ep_rank * E/ep, ...) on this ep rank, then this efsdp rank's chunk of them.
        EXPECT_EQ(t.local().size(0), chunk_rows(experts / ep, efsdp, efsdp_rank));
        EXPECT_EQ(t.local_offset()[0], ep_rank * (experts / ep) + efsdp_rank * (experts / ep / efsdp));
      } else {
        EXPECT_EQ(fsdp::to_string(t.placements()), hsdp ? "(Replicate(), Shard(0))" : "(Shard(0))");
        EXPECT_EQ(dims_of(t), hsdp ? "dp_replicate,dp_shard" : "dp_shard");
        EXPECT_EQ(t.local().size(0), chunk_rows(shape[0], dp_shard, shard_rank));
      }
    }
    EXPECT_EQ(expert_params, 2 * 3) << "w1, w2, w3 of each of the 2 MoE blocks";
  }
}

// PP 2 x dp_shard 2 with full AC: the mesh is [pp, dp_shard], pp outermost, so ranks 0-1 hold stage 0 (the
// embedding + layer 0) and ranks 2-3 stage 1 (layer 1 + norm, output); fully_shard on the stage's block and the
// stage only, Shard(0) over dp_shard; AC on every block of the whole model.
TEST(Parallelize, PipelineStagesThenFsdpPerStage) {
  if (world_size() != 4) GTEST_SKIP() << "pp 2 x dp_shard 2 on 4 ranks";
  const JobConfig config = config_of({"--parallelism.pipeline_parallel_degree", "2", "--activation_checkpoint.mode",
                                      "full", "--parallelism.pipeline_parallel_microbatch_size", "1"});
  auto model = build_model(config);
  Applied a = parallelize(model, config);
  const int stage = rank() / 2;
  EXPECT_EQ(a.plan.num_stages, 2);
  EXPECT_EQ(a.plan.stage_indices, std::vector<int>{stage});
  ASSERT_EQ(a.plan.stages.size(), 1u);
  EXPECT_EQ(a.plan.holds_first_stage, stage == 0);
  EXPECT_EQ(a.plan.holds_last_stage, stage == 1);
  const std::string block = "layers." + std::to_string(stage);
  EXPECT_EQ(fsdp_fqns(*model), std::set<std::string>{block}) << "the whole model's view: only this stage's block";
  EXPECT_TRUE(fsdp::fsdp_module(*a.plan.stages[0].module)) << "and the stage itself";
  EXPECT_EQ(a.plan.fsdp_modules.size(), 2u);
  for (const auto& b : model->blocks()) EXPECT_TRUE(fsdp::is_checkpointed(*b));
  const std::set<std::string> held = stage == 0 ? std::set<std::string>{"tok_embeddings", "layers.0"}
                                                : std::set<std::string>{"layers.1", "norm", "output"};
  size_t checked = 0;
  const auto sd = fsdp::sharded_state_dict(*a.plan.stages[0].module);
  for (const auto& p : a.plan.stages[0].module->named_parameters()) {
    const std::string& fqn = p.key();
    SCOPED_TRACE(fqn);
    const std::string module = fqn.rfind("layers.", 0) == 0 ? fqn.substr(0, fqn.find('.', 7)) : fqn.substr(0, fqn.find('.'));
    EXPECT_TRUE(held.count(module)) << "a parameter of another stage";
    const auto& t = sd.at(fqn);
    EXPECT_EQ(dims_of(t), "dp_shard");
    EXPECT_EQ(fsdp::to_string(t.placements()), "(Shard(0))");
    EXPECT_EQ(t.local().size(0), chunk_rows(t.sizes()[0], 2, rank() % 2));
    ++checked;
  }
  EXPECT_EQ(checked, stage == 0 ? 1u + 9u : 9u + 2u);  // embedding + a block's 9, or a block's 9 + norm, output
}
