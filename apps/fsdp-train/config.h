#pragma once
// fsdp-train's job configuration: TorchTitan's TOML sections and key names, TorchTitan's defaults, an embedded
// default file (configs/debug.toml compiled in), and `--section.key value` command-line overrides.
//
// Every key is declared once in the schema (config.cpp): its type, default, help and whether the trainer
// implements it yet. Parsing, type checks, the unknown-key check, to_toml() and the docs' reference table all
// come from that one list, so they cannot drift apart. No torch headers here.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp_train {

// Thrown for every bad configuration; the message names the key, what was expected and where (file:line:col).
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct JobConfig {
  struct Job {
    std::string dump_folder = "./outputs";
    std::string description = "default job";
  } job;
  struct Model {
    std::string name = "llama3";
    std::string flavor = "debugmodel";
    std::string tokenizer_path;
    // MoE overrides of the flavor's block (qwen3 *_moe flavors; "" / -1 = the flavor's own): DeepSeek-V3-style
    // routing is moe_score_func = "sigmoid", moe_shared_experts = 1, moe_route_norm = "true", moe_route_scale.
    std::string moe_score_func;
    int64_t moe_shared_experts = -1;
    std::string moe_route_norm;  // "" | "true" | "false"
    double moe_route_scale = 0;  // 0 = the flavor's
    double moe_load_balance_coeff = -1;  // -1 = the flavor's (1e-3); 0 = no aux-loss-free bias
    int64_t moe_num_expert_groups = 0;   // DeepSeek-V3 group-limited routing: expert groups (0 = off) ...
    int64_t moe_num_limited_groups = 0;  // ... and how many of them each token may use
    double moe_sequence_aux_loss_coeff = 0;  // DeepSeek-V3's sequence-wise balance loss alpha (1e-4 there); 0 = off  // "" = byte-level tokenizer; else a Hugging Face tokenizer.json (byte-level BPE)
  } model;
  struct Optimizer {
    std::string name = "AdamW";
    double lr = 8e-4;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
  } optimizer;
  struct LRScheduler {
    int64_t warmup_steps = 200;
    std::optional<double> decay_ratio;  // unset = decay over all steps after warmup; set = warmup-stable-decay
    std::string decay_type = "linear";  // linear | sqrt | cosine
    double min_lr_factor = 0.0;
  } lr_scheduler;
  struct Training {
    std::string dataset = "common_licenses";
    std::string dataset_path;  // "" = the dataset's default location
    std::string dataset_text_field = "text";  // JSON Lines: the field holding each document's text
    std::string bad_records = "skip";         // skip (report file:line, count) | error
    int64_t local_batch_size = 8;
    int64_t global_batch_size = -1;  // -1 = local_batch_size x data-parallel degree (no accumulation)
    int64_t seq_len = 2048;
    double max_norm = 1.0;
    int64_t steps = 10000;
    std::string mixed_precision_param = "bfloat16";
    std::string mixed_precision_reduce = "float32";
    bool enable_cpu_offload = false;
    // The device of the mesh: FSDP's parameters and collectives (cpu | cuda | cuda:N). Not a TorchTitan key
    // (TorchTitan takes CUDA when it is there); here the CPU unless asked.
    std::string device = "cpu";
  } training;
  // TorchTitan's [validation]: a forward under no_grad over a held-out stream every `freq` steps (and step 1).
  struct Validation {
    bool enable = false;
    std::string dataset = "common_licenses_validation";  // TorchTitan: c4_validation
    std::string dataset_path;                            // "" = the dataset's default location
    int64_t freq = 10;
    int64_t steps = -1;  // -1 = one full pass over the held-out stream; else this many batches (wrapping)
    int64_t local_batch_size = 8;
    int64_t seq_len = 2048;
  } validation;
  struct Parallelism {
    int64_t data_parallel_replicate_degree = 1;
    int64_t data_parallel_shard_degree = -1;  // -1 = the ranks left over by the other degrees
    std::string fsdp_reshard_after_forward = "default";  // default | always | never
    int64_t tensor_parallel_degree = 1;   // TorchTitan's Llama TP plan (with sequence parallel) over this many ranks
    bool disable_loss_parallel = false;   // with TP: gather the logits instead of a vocabulary-sharded loss
    // Expert parallelism (MoE models): routed experts split over this many ranks, borrowed from the data-parallel
    // shard dim (TorchTitan: ep divides dp_shard); their FSDP shards over the dp_shard / ep ranks left.
    int64_t expert_parallel_degree = 1;
    // Pipeline parallelism (TorchTitan's keys): the outermost mesh dim.
    int64_t pipeline_parallel_degree = 1;
    std::string pipeline_parallel_schedule = "1F1B";  // torch's names, case-insensitive
    int64_t pipeline_parallel_microbatch_size = 1;    // microbatches = local_batch_size / this
    int64_t num_pp_microbatches = 0;                  // TorchTitan's newer key; > 0 overrides the line above
    int64_t pipeline_parallel_layers_per_stage = 0;   // 0 = the schedule's stages per rank
    int64_t pipeline_parallel_first_stage_less_layers = 1;  // the embedding counts as this many layers
    int64_t pipeline_parallel_last_stage_less_layers = 1;   // norm + output count as this many layers
    // Explicit stages: the module FQNs of each stage ("tok_embeddings", "layers.3", "norm", "output"), in order.
    std::vector<std::vector<std::string>> module_fqns_per_model_part;
  } parallelism;
  struct Checkpoint {
    bool enable = false;
    std::string folder = "checkpoint";
    int64_t interval = 500;
    std::string initial_load_path;
    bool initial_load_model_only = true;
    bool last_save_model_only = true;
    std::string export_dtype = "float32";
    std::string async_mode = "disabled";  // disabled | async | async_with_pinned_mem
    int64_t keep_latest_k = 10;
    int64_t load_step = -1;
    std::vector<std::string> exclude_from_loading;
    bool enable_first_step_checkpoint = false;
    std::string format = "libfsdp";  // libfsdp | dcp (PyTorch DCP, readable by dcp.load / TorchTitan)
    bool initial_load_in_hf = false;  // initial_load_path holds Hugging Face Llama safetensors (model only)
    bool last_save_in_hf = false;     // the last (model-only) save is Hugging Face Llama safetensors
    bool direct_io = true;            // data files written with O_DIRECT (fsdp::checkpoint::SaveOptions::direct_io)
  } checkpoint;
  struct ActivationCheckpoint {
    std::string mode = "selective";  // selective | full | none
    std::string selective_ac_option = "2";
  } activation_checkpoint;
  struct Metrics {
    int64_t log_freq = 10;
    bool enable_tensorboard = false;
    std::string save_tb_folder = "tb";
    bool save_for_all_ranks = false;
    double peak_tflops = 0.0;  // 0 = measure with a short matmul benchmark at startup
    bool tensor_memory = false;  // count live CPU tensor bytes (tensor_memory.h): start/forward/peak per step
  } metrics;
  // TorchTitan's [profiling]: every profile_freq steps (the steps with step % profile_freq == 0), a Chrome trace of
  // that step per rank from libtorch's profiler (Kineto) under <dump_folder>/<save_traces_folder>/iteration_<step>/,
  // and with enable_memory_snapshot a memory timeline of the same step under <save_memory_snapshot_folder>.
  struct Profiling {
    bool enable_profiling = false;
    std::string save_traces_folder = "profile_traces";
    int64_t profile_freq = 10;
    bool enable_memory_snapshot = false;
    std::string save_memory_snapshot_folder = "memory_snapshot";
  } profiling;
  struct Comm {
    int64_t init_timeout_seconds = 300;
    int64_t train_timeout_seconds = 100;
  } comm;
  struct Debug {
    int64_t seed = 0;
    bool deterministic = false;
  } debug;
};

// One schema entry (for docs and tooling).
struct KeyInfo {
  std::string section, key, type, default_value, help;
  bool implemented;
};
std::vector<KeyInfo> config_schema();

// The embedded default configuration (the text of configs/debug.toml at build time).
std::string_view embedded_default_config();

// Parse TOML text over the TorchTitan defaults. `source` names the text in errors (a path or "<embedded>").
JobConfig parse_toml(std::string_view text, const std::string& source);
// Apply --section.key value / --section.key=value overrides (a bool key alone means true).
void apply_overrides(JobConfig& config, const std::vector<std::string>& args);
// The whole command line: --config FILE (else the embedded default), then overrides in order.
JobConfig load_config(const std::vector<std::string>& args);
// The effective configuration as TOML (every key), for logs and the dump folder.
std::string to_toml(const JobConfig& config);

// Degrees resolved against the world size: shard -1 = leftover; gradient accumulation from the batch sizes.
struct ParallelDims {
  int64_t world_size = 1;
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t tp = 1;  // tensor-parallel degree (innermost mesh dim: ranks r*tp .. r*tp+tp-1 share a data shard)
  int64_t pp = 1;  // pipeline degree (outermost mesh dim: the pp ranks of a data-parallel rank read the same samples)
  int64_t pp_microbatches = 1;
  int64_t ep = 1;  // expert-parallel degree (inside dp_shard: ranks r*ep .. r*ep+ep-1 of a shard group split the experts)
  int64_t dp_degree() const { return dp_replicate * dp_shard; }
  // The data-parallel rank of a world rank (mesh [pp, dp_replicate, dp_shard, tp]).
  int64_t dp_rank_of(int64_t rank) const { return (rank % (dp_degree() * tp)) / tp; }
  int64_t local_batch_size = 1;
  int64_t global_batch_size = 1;
  int64_t grad_accum_steps = 1;  // global / (local x dp)
};
ParallelDims resolve_parallelism(const JobConfig& config, int64_t world_size);

// Checks of values that do not depend on the world size (enums, ranges). load_config() calls it.
void validate(const JobConfig& config);

}  // namespace fsdp_train
