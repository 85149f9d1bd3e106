#pragma once
// fsdp-train's job configuration: TorchTitan's TOML sections and key names, TorchTitan's defaults, an embedded
// default file (configs/debug.toml compiled in), and `--section.key value` command-line overrides.
//
// Every key is declared once, as a row of the field table (config_fields.cpp); its member's type picks its codec
// (config_codec.cpp). Parsing, type checks, the unknown-key check, to_toml() and the docs' reference table all come
// from that one list, so they cannot drift apart; the rules are in config_rules.cpp. No torch headers here (the
// one libfsdp header, schedule_kind.h, includes nothing).

#include <fsdp/pipeline/schedule_kind.h>

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

// Limits on what a job config may ask for (docs/reliability.md, "Inputs and the limits their readers enforce").
// Beyond them a buffer allocation or the data stream's position arithmetic would fail or overflow before any
// check; they are far above any real run (TorchTitan's longest-context runs: 128 K-1 M tokens per sample).
inline constexpr int64_t kMaxConfigFileBytes = 16 << 20;  // --config: a job config is a few kB
inline constexpr int64_t kMaxSeqLen = int64_t(1) << 24;   // training/validation.seq_len: 16,777,216 tokens
inline constexpr int64_t kMaxMicroBatchTokens = int64_t(1) << 28;  // local_batch_size x seq_len (2 GiB of int64 ids)

// The string-choice keys, parsed once where the TOML or the command line is read (a bad value is a ConfigError
// naming the key, the value, the choices and where it was written); to_string() gives back TorchTitan's spelling,
// the one to_toml() and the schema print.
enum class MoeScoreFunc { FlavorDefault, Softmax, Sigmoid };  // "" (the flavor's) | softmax | sigmoid
enum class MoeRouteNorm { FlavorDefault, On, Off };           // "" (the flavor's) | true | false
enum class OptimizerName { AdamW, Adam };                     // AdamW | Adam
enum class DecayType { Linear, Sqrt, Cosine };                // linear | sqrt | cosine
enum class Dataset { CommonLicenses, CommonLicensesValidation, Text, Jsonl, Tokens };  // see config_schema()
enum class BadRecords { Skip, Error };                        // skip | error
enum class MixedPrecision { Float32, BFloat16 };              // float32 | bfloat16
enum class ReshardAfterForward { Default, Always, Never };    // default | always | never
// torch's schedule names, case-insensitive: GPipe | 1F1B | LoopedBFS | Interleaved1F1B | InterleavedZeroBubble |
// ZBVZeroBubble | DualPipeV. The library's enum itself (the kind its schedule generators take), so the config's
// value goes to the pipeline as it is; its Csv is no name of this key (a schedule file is
// pipeline_parallel_schedule_csv). Not fsdp::pipeline::PipelineSchedule, which is a built schedule.
using PipelineSchedule = fsdp::pipeline::ScheduleKind;
enum class ExportDtype { Float32, BFloat16, Float16 };        // float32 | bfloat16 | float16
enum class AsyncMode { Disabled, Async, AsyncWithPinnedMem }; // disabled | async | async_with_pinned_mem
enum class CheckpointFormat { Libfsdp, Dcp };                 // libfsdp | dcp
enum class AcMode { None, Selective, Full };                  // none | selective | full
enum class AttnMaskType { Causal, BlockCausal };              // causal | block_causal
enum class CpRotateMethod { AllGather, AllToAll };            // allgather | alltoall
enum class CpLoadBalancer { HeadTail, None };                 // headtail | none
// checkpoint.exclude_from_loading's items: optimizer | lr_scheduler | dataloader | train_state | rng.
enum class CheckpointPart { Optimizer, LrScheduler, Dataloader, TrainState, Rng };

const char* to_string(MoeScoreFunc v);
const char* to_string(MoeRouteNorm v);
const char* to_string(OptimizerName v);
const char* to_string(DecayType v);
const char* to_string(Dataset v);
const char* to_string(BadRecords v);
const char* to_string(MixedPrecision v);
const char* to_string(ReshardAfterForward v);
const char* to_string(PipelineSchedule v);
const char* to_string(ExportDtype v);
const char* to_string(AsyncMode v);
const char* to_string(CheckpointFormat v);
const char* to_string(AcMode v);
const char* to_string(AttnMaskType v);
const char* to_string(CpRotateMethod v);
const char* to_string(CpLoadBalancer v);
const char* to_string(CheckpointPart v);

// The value a string-choice key's text names (the spellings the config accepts, case rules included), or nullopt.
// For tools and tests that take the same names outside a config (fsdp-train tokenize --bad-records).
template <class Enum>
std::optional<Enum> parse_choice(std::string_view text);

// activation_checkpoint.selective_ac_option: "op" (op-level SAC) or a non-negative integer k as a string (full AC
// on every k-th block). Parsed where it is read; text that is neither is kept as written and refused by validate()
// only when activation_checkpoint.mode = selective, the only mode in which TorchTitan reads the option.
struct SelectiveAcOption {
  enum class Kind { Op, EveryKth, Unparsed };
  Kind kind = Kind::EveryKth;
  int64_t k = 2;             // Kind::EveryKth: every k-th block (0 and 1: every block)
  std::string unparsed;      // Kind::Unparsed: the text as written
  static SelectiveAcOption op() { return {Kind::Op, 0, {}}; }
  static SelectiveAcOption every_kth(int64_t k) { return {Kind::EveryKth, k, {}}; }
  static SelectiveAcOption parse(const std::string& text);
  std::string to_string() const;  // "op", "k", or the unparsed text
};

struct JobConfig {
  struct Job {
    std::string dump_folder = "./outputs";
    std::string description = "default job";
  } job;
  struct Model {
    // The model family: a name in fsdp-train's model registry (model_spec.h), not a choice fixed here, so that a
    // new family is its folder plus its registration. The registry checks it (an unknown name is a ConfigError
    // listing the registered ones) before anything else runs.
    std::string name = "llama3";
    std::string flavor = "debugmodel";
    std::string tokenizer_path;  // "" = byte-level tokenizer; else a Hugging Face tokenizer.json (byte-level BPE)
    // TorchTitan's attn_mask_type: block_causal attends within the documents packing joined (split at the
    // tokenizer's EOS, which ends its document).
    AttnMaskType attn_mask_type = AttnMaskType::Causal;
    // MoE overrides of the flavor's block (qwen3 *_moe flavors; "" / -1 = the flavor's own): DeepSeek-V3-style
    // routing is moe_score_func = "sigmoid", moe_shared_experts = 1, moe_route_norm = "true", moe_route_scale.
    MoeScoreFunc moe_score_func = MoeScoreFunc::FlavorDefault;
    int64_t moe_shared_experts = -1;
    MoeRouteNorm moe_route_norm = MoeRouteNorm::FlavorDefault;
    double moe_route_scale = 0;  // 0 = the flavor's
    double moe_load_balance_coeff = -1;  // -1 = the flavor's (1e-3); 0 = no aux-loss-free bias
    int64_t moe_num_expert_groups = 0;   // DeepSeek-V3 group-limited routing: expert groups (0 = off) ...
    int64_t moe_num_limited_groups = 0;  // ... and how many of them each token may use
    double moe_sequence_aux_loss_coeff = 0;  // DeepSeek-V3's sequence-wise balance loss alpha (1e-4 there); 0 = off
  } model;
  struct Optimizer {
    OptimizerName name = OptimizerName::AdamW;
    double lr = 8e-4;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
  } optimizer;
  struct LRScheduler {
    int64_t warmup_steps = 200;
    std::optional<double> decay_ratio;  // unset = decay over all steps after warmup; set = warmup-stable-decay
    DecayType decay_type = DecayType::Linear;
    double min_lr_factor = 0.0;
  } lr_scheduler;
  struct Training {
    Dataset dataset = Dataset::CommonLicenses;
    std::string dataset_path;  // "" = the dataset's default location
    std::string dataset_text_field = "text";  // JSON Lines: the field holding each document's text
    BadRecords bad_records = BadRecords::Skip;  // skip (report file:line, count) | error
    int64_t local_batch_size = 8;
    int64_t global_batch_size = -1;  // -1 = local_batch_size x data-parallel degree (no accumulation)
    int64_t seq_len = 2048;
    double max_norm = 1.0;
    int64_t steps = 10000;
    MixedPrecision mixed_precision_param = MixedPrecision::BFloat16;
    MixedPrecision mixed_precision_reduce = MixedPrecision::Float32;
    bool enable_cpu_offload = false;
    // The device of the mesh: FSDP's parameters and collectives (cpu | cuda | cuda:N). Not a TorchTitan key
    // (TorchTitan takes CUDA when it is there); here the CPU unless asked.
    std::string device = "cpu";
  } training;
  // TorchTitan's [validation]: a forward under no_grad over a held-out stream every `freq` steps (and step 1).
  struct Validation {
    bool enable = false;
    Dataset dataset = Dataset::CommonLicensesValidation;  // TorchTitan: c4_validation
    std::string dataset_path;                            // "" = the dataset's default location
    int64_t freq = 10;
    int64_t steps = -1;  // -1 = one full pass over the held-out stream; else this many batches (wrapping)
    int64_t local_batch_size = 8;
    int64_t seq_len = 2048;
  } validation;
  struct Parallelism {
    int64_t data_parallel_replicate_degree = 1;
    int64_t data_parallel_shard_degree = -1;  // -1 = the ranks left over by the other degrees
    ReshardAfterForward fsdp_reshard_after_forward = ReshardAfterForward::Default;
    int64_t tensor_parallel_degree = 1;   // TorchTitan's Llama TP plan (with sequence parallel) over this many ranks
    bool disable_loss_parallel = false;   // with TP: gather the logits instead of a vocabulary-sharded loss
    // Expert parallelism (MoE models): routed experts split over this many ranks, borrowed from the data-parallel
    // shard dim (TorchTitan: ep divides dp_shard); their FSDP shards over the dp_shard / ep ranks left.
    int64_t expert_parallel_degree = 1;
    // Context parallelism (TorchTitan's keys): each sequence split over this many ranks (mesh dim "cp", between
    // dp_shard and tp), attention by ring attention; FSDP shards over dp_shard x cp (docs/context_parallel.md).
    int64_t context_parallel_degree = 1;
    CpRotateMethod context_parallel_rotate_method = CpRotateMethod::AllGather;
    CpLoadBalancer context_parallel_load_balancer = CpLoadBalancer::HeadTail;
    // Pipeline parallelism (TorchTitan's keys): the outermost mesh dim.
    int64_t pipeline_parallel_degree = 1;
    PipelineSchedule pipeline_parallel_schedule = PipelineSchedule::OneFOneB;
    // A compute-only schedule file (torch's _load_csv; docs/pipeline.md); when set it replaces the schedule above.
    std::string pipeline_parallel_schedule_csv;
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
    ExportDtype export_dtype = ExportDtype::Float32;
    AsyncMode async_mode = AsyncMode::Disabled;
    int64_t keep_latest_k = 10;
    int64_t load_step = -1;
    std::vector<CheckpointPart> exclude_from_loading;  // the model is always loaded
    bool enable_first_step_checkpoint = false;
    CheckpointFormat format = CheckpointFormat::Libfsdp;  // dcp: PyTorch DCP, readable by dcp.load / TorchTitan
    bool initial_load_in_hf = false;  // initial_load_path holds Hugging Face Llama safetensors (model only)
    bool last_save_in_hf = false;     // the last (model-only) save is Hugging Face Llama safetensors
    bool direct_io = true;            // data files written with O_DIRECT (fsdp::checkpoint::SaveOptions::direct_io)
  } checkpoint;
  struct ActivationCheckpoint {
    AcMode mode = AcMode::Selective;
    SelectiveAcOption selective_ac_option = SelectiveAcOption::every_kth(2);
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
  // TorchTitan's [fault_tolerance] (torchft): each replica group — this job, its ranks sharding the model with
  // FSDP — is one of group_size groups that train together through fsdp::ft::Manager (docs/reliability.md): a quorum
  // every step over the coordinator (apps/fsdp-lighthouse), gradients averaged over the quorum's groups, a commit
  // vote before the optimizer step, and a restarted group healing from a live one instead of from disk.
  struct FaultTolerance {
    bool enable = false;
    int64_t replica_id = 0;        // this group's id, 0 .. group_size-1 (its share of every global batch)
    int64_t group_size = 0;        // how many replica groups the run has (must be set when enabled)
    int64_t min_replica_size = 1;  // a step needs at least this many groups in its quorum
    std::string lighthouse;        // the coordinator's host:port; empty = environment variable FSDP_LIGHTHOUSE
    int64_t process_group_timeout_ms = 10000;  // cross-group collectives, healing transfers, the commit vote
    int64_t join_timeout_ms = 2000;            // how long a round waits for groups of the last quorum to join
    int64_t quorum_timeout_seconds = 120;      // no quorum of min_replica_size groups within this: fail
  } fault_tolerance;
  struct Comm {
    int64_t init_timeout_seconds = 300;
    int64_t train_timeout_seconds = 100;
    // auto | gloo | nccl: the process group's backend on a CUDA training.device (the CPU always takes Gloo).
    // "auto" = NCCL where libfsdp was built with it, else Gloo on CUDA tensors; "gloo" lets several ranks share
    // one GPU (training.device = "cuda:0" on every rank), which NCCL refuses.
    std::string backend = "auto";
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

// Checks of values that do not depend on the world size (ranges, rules across keys; the choices were checked on
// reading). load_config() calls it; resolve_parallelism (parallel_dims.h) adds the world-size checks.
void validate(const JobConfig& config);

}  // namespace fsdp_train
