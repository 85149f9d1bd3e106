// The config schema and its parsers (TOML via toml++, command-line overrides). See config.h.
#include "config.h"

#include <algorithm>
#include <cctype>

#include "file_content.h"
#include "toml_workaround.h"  // toml++ itself, with the workaround for its 3.3 bug

#include <cerrno>
#include <functional>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <variant>

namespace fsdp_train {
namespace {

// The spellings of each string-choice enum (config.h), in the order the errors and docs list them.
template <class E>
struct ChoiceName {
  E value;
  const char* text;
};
template <class E>
struct Choices;  // names: the table; case_insensitive: how a text is matched
struct ExactNames {  // the names match exactly (case included), as TorchTitan compares them
  static constexpr bool case_insensitive = false;
};
template <>
struct Choices<MoeScoreFunc> : ExactNames {
  static constexpr ChoiceName<MoeScoreFunc> names[] = {
      {MoeScoreFunc::FlavorDefault, ""}, {MoeScoreFunc::Softmax, "softmax"}, {MoeScoreFunc::Sigmoid, "sigmoid"}};
};
template <>
struct Choices<MoeRouteNorm> : ExactNames {
  static constexpr ChoiceName<MoeRouteNorm> names[] = {
      {MoeRouteNorm::FlavorDefault, ""}, {MoeRouteNorm::On, "true"}, {MoeRouteNorm::Off, "false"}};
};
template <>
struct Choices<OptimizerName> : ExactNames {
  static constexpr ChoiceName<OptimizerName> names[] = {{OptimizerName::AdamW, "AdamW"}, {OptimizerName::Adam, "Adam"}};
};
template <>
struct Choices<DecayType> : ExactNames {
  static constexpr ChoiceName<DecayType> names[] = {
      {DecayType::Linear, "linear"}, {DecayType::Sqrt, "sqrt"}, {DecayType::Cosine, "cosine"}};
};
template <>
struct Choices<Dataset> : ExactNames {
  static constexpr ChoiceName<Dataset> names[] = {{Dataset::CommonLicenses, "common_licenses"},
                                                  {Dataset::CommonLicensesValidation, "common_licenses_validation"},
                                                  {Dataset::Text, "text"},
                                                  {Dataset::Jsonl, "jsonl"},
                                                  {Dataset::Tokens, "tokens"}};
};
template <>
struct Choices<BadRecords> : ExactNames {
  static constexpr ChoiceName<BadRecords> names[] = {{BadRecords::Skip, "skip"}, {BadRecords::Error, "error"}};
};
template <>
struct Choices<MixedPrecision> : ExactNames {
  static constexpr ChoiceName<MixedPrecision> names[] = {{MixedPrecision::Float32, "float32"},
                                                         {MixedPrecision::BFloat16, "bfloat16"}};
};
template <>
struct Choices<ReshardAfterForward> : ExactNames {
  static constexpr ChoiceName<ReshardAfterForward> names[] = {{ReshardAfterForward::Default, "default"},
                                                              {ReshardAfterForward::Always, "always"},
                                                              {ReshardAfterForward::Never, "never"}};
};
template <>
struct Choices<PipelineSchedule> {
  static constexpr bool case_insensitive = true;  // torch's get_schedule_class lowercases the name
  static constexpr ChoiceName<PipelineSchedule> names[] = {{PipelineSchedule::GPipe, "GPipe"},
                                                           {PipelineSchedule::OneFOneB, "1F1B"},
                                                           {PipelineSchedule::LoopedBFS, "LoopedBFS"},
                                                           {PipelineSchedule::Interleaved1F1B, "Interleaved1F1B"},
                                                           {PipelineSchedule::InterleavedZeroBubble, "InterleavedZeroBubble"},
                                                           {PipelineSchedule::ZBVZeroBubble, "ZBVZeroBubble"},
                                                           {PipelineSchedule::DualPipeV, "DualPipeV"}};
};
template <>
struct Choices<ExportDtype> : ExactNames {
  static constexpr ChoiceName<ExportDtype> names[] = {
      {ExportDtype::Float32, "float32"}, {ExportDtype::BFloat16, "bfloat16"}, {ExportDtype::Float16, "float16"}};
};
template <>
struct Choices<AsyncMode> : ExactNames {
  static constexpr ChoiceName<AsyncMode> names[] = {{AsyncMode::Disabled, "disabled"},
                                                    {AsyncMode::Async, "async"},
                                                    {AsyncMode::AsyncWithPinnedMem, "async_with_pinned_mem"}};
};
template <>
struct Choices<CheckpointFormat> : ExactNames {
  static constexpr ChoiceName<CheckpointFormat> names[] = {{CheckpointFormat::Libfsdp, "libfsdp"},
                                                           {CheckpointFormat::Dcp, "dcp"}};
};
template <>
struct Choices<AcMode> : ExactNames {
  static constexpr ChoiceName<AcMode> names[] = {{AcMode::Selective, "selective"}, {AcMode::Full, "full"}, {AcMode::None, "none"}};
};
template <>
struct Choices<AttnMaskType> : ExactNames {
  static constexpr ChoiceName<AttnMaskType> names[] = {{AttnMaskType::Causal, "causal"},
                                                       {AttnMaskType::BlockCausal, "block_causal"}};
};
template <>
struct Choices<CpRotateMethod> : ExactNames {
  static constexpr ChoiceName<CpRotateMethod> names[] = {{CpRotateMethod::AllGather, "allgather"},
                                                         {CpRotateMethod::AllToAll, "alltoall"}};
};
template <>
struct Choices<CpLoadBalancer> : ExactNames {
  static constexpr ChoiceName<CpLoadBalancer> names[] = {{CpLoadBalancer::HeadTail, "headtail"},
                                                         {CpLoadBalancer::None, "none"}};
};
template <>
struct Choices<CheckpointPart> : ExactNames {
  static constexpr ChoiceName<CheckpointPart> names[] = {{CheckpointPart::Optimizer, "optimizer"},
                                                         {CheckpointPart::LrScheduler, "lr_scheduler"},
                                                         {CheckpointPart::Dataloader, "dataloader"},
                                                         {CheckpointPart::TrainState, "train_state"},
                                                         {CheckpointPart::Rng, "rng"}};
};

template <class E>
const char* name_of(E value) {
  for (const auto& n : Choices<E>::names)
    if (n.value == value) return n.text;
  return "?";  // unreachable for a value of the enum: every enumerator is in its table (the schema test prints all)
}

bool same_text(std::string_view a, std::string_view b, bool case_insensitive) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto x = static_cast<unsigned char>(a[i]), y = static_cast<unsigned char>(b[i]);
    if (case_insensitive ? std::tolower(x) != std::tolower(y) : x != y) return false;
  }
  return true;
}

// "one of a | b | c" for the errors ("" is shown as "\"\"").
template <class E>
std::string choice_list() {
  std::string list;
  for (const auto& n : Choices<E>::names) list += (list.empty() ? "" : " | ") + std::string(*n.text ? n.text : "\"\"");
  return "one of " + list + (Choices<E>::case_insensitive ? " (case-insensitive)" : "");
}

// A key whose TOML value is a string (or an array of strings) parsed into a typed field where it is read.
struct ParsedString {
  std::function<std::string()> text;  // the field as its TOML string
  // Sets the field from `text`; else returns what was expected ("one of a | b").
  std::function<std::optional<std::string>(const std::string& text)> parse;
};
struct ParsedStringList {
  std::function<std::vector<std::string>()> texts;
  std::function<void()> clear;
  std::function<std::optional<std::string>(const std::string& text)> append;
};

template <class E>
ParsedString choice(E* field) {
  return {[field] { return std::string(name_of(*field)); },
          [field](const std::string& text) -> std::optional<std::string> {
            const auto value = parse_choice<E>(text);
            if (!value) return choice_list<E>();
            *field = *value;
            return std::nullopt;
          }};
}

template <class E>
ParsedStringList choices(std::vector<E>* field) {
  return {[field] {
            std::vector<std::string> out;
            for (E v : *field) out.push_back(name_of(v));
            return out;
          },
          [field] { field->clear(); },
          [field](const std::string& text) -> std::optional<std::string> {
            const auto value = parse_choice<E>(text);
            if (!value) return choice_list<E>();
            field->push_back(*value);
            return std::nullopt;
          }};
}

ParsedString selective_ac(SelectiveAcOption* field) {
  return {[field] { return field->to_string(); },
          [field](const std::string& text) -> std::optional<std::string> {
            *field = SelectiveAcOption::parse(text);  // an unparsed text is refused by validate() in selective mode
            return std::nullopt;
          }};
}

using FieldPtr = std::variant<bool*, int64_t*, double*, std::string*, std::optional<double>*, std::vector<std::string>*,
                              std::vector<std::vector<std::string>>*, ParsedString, ParsedStringList>;

struct Field {
  const char* section;
  const char* key;
  FieldPtr ptr;
  const char* help;
  bool implemented = true;
};

// The schema: every key the trainer accepts, bound to one JobConfig instance. Section order = TOML/doc order.
std::vector<Field> fields(JobConfig& c) {
  return {
      {"job", "dump_folder", &c.job.dump_folder, "folder for metrics.jsonl, the effective config.toml and checkpoints"},
      {"job", "description", &c.job.description, "free text, printed at startup"},
      {"model", "name", &c.model.name,
       "model family: a name in fsdp-train's model registry (docs/models.md lists them); an unknown name is an "
       "error listing the registered ones"},
      {"model", "flavor", &c.model.flavor,
       "llama3: cpu_tiny, cpu_small, cpu_medium, debugmodel, 1B, 3B, 8B, 70B, 405B; qwen3: cpu_tiny, cpu_small, "
       "cpu_tiny_moe, cpu_small_moe, debugmodel, debugmodel_moe, 0.6B ... 32B, 30B-A3B, 235B-A22B"},
      {"model", "moe_score_func", choice(&c.model.moe_score_func), "MoE flavors: \"\" (the flavor's) | softmax | sigmoid"},
      {"model", "moe_shared_experts", &c.model.moe_shared_experts, "MoE flavors: shared experts; -1 = the flavor's"},
      {"model", "moe_route_norm", choice(&c.model.moe_route_norm),
       "MoE flavors: \"\" (the flavor's) | true | false: divide the top-k scores by their sum"},
      {"model", "moe_route_scale", &c.model.moe_route_scale, "MoE flavors: routed weights scale; 0 = the flavor's"},
      {"model", "moe_load_balance_coeff", &c.model.moe_load_balance_coeff,
       "MoE flavors: DeepSeek-V3 aux-loss-free bias step; -1 = the flavor's (1e-3), 0 = off"},
      {"model", "moe_num_expert_groups", &c.model.moe_num_expert_groups,
       "MoE flavors: DeepSeek-V3 group-limited routing, the number of expert groups (0 = off)"},
      {"model", "moe_num_limited_groups", &c.model.moe_num_limited_groups,
       "MoE flavors: with moe_num_expert_groups, the best groups (by their two best scores) a token may use"},
      {"model", "moe_sequence_aux_loss_coeff", &c.model.moe_sequence_aux_loss_coeff,
       "MoE flavors: DeepSeek-V3's sequence-wise balance loss weight alpha (1e-4 there), added to the training loss; "
       "0 = off"},
      {"model", "tokenizer_path", &c.model.tokenizer_path,
       "\"\" = byte-level tokenizer (256 bytes + BOS + EOS); else a Hugging Face tokenizer.json (byte-level BPE). "
       "The model's vocab_size is set to the tokenizer's, as TorchTitan does"},
      {"model", "attn_mask_type", choice(&c.model.attn_mask_type),
       "causal | block_causal: attend only within the document (packed samples split after each tokenizer EOS)"},
      {"optimizer", "name", choice(&c.optimizer.name), "AdamW or Adam"},
      {"optimizer", "lr", &c.optimizer.lr, "peak learning rate"},
      {"optimizer", "beta1", &c.optimizer.beta1, "Adam beta1"},
      {"optimizer", "beta2", &c.optimizer.beta2, "Adam beta2"},
      {"optimizer", "eps", &c.optimizer.eps, "Adam epsilon"},
      {"optimizer", "weight_decay", &c.optimizer.weight_decay, "decoupled weight decay (AdamW)"},
      {"lr_scheduler", "warmup_steps", &c.lr_scheduler.warmup_steps, "linear warmup steps (capped at training.steps)"},
      {"lr_scheduler", "decay_ratio", &c.lr_scheduler.decay_ratio,
       "unset = decay over every step after warmup; a value in [0,1] = warmup-stable-decay with that share of steps decaying"},
      {"lr_scheduler", "decay_type", choice(&c.lr_scheduler.decay_type), "linear | sqrt | cosine"},
      {"lr_scheduler", "min_lr_factor", &c.lr_scheduler.min_lr_factor, "the decay ends at lr x min_lr_factor"},
      {"training", "dataset", choice(&c.training.dataset),
       "common_licenses (Debian's /usr/share/common-licenses, always installed, less the held-out Apache-2.0) | "
       "common_licenses_validation (only Apache-2.0) | text (text files; also JSON Lines by name) | jsonl (JSON Lines "
       "files only: *.jsonl, *.ndjson) | tokens (pre-tokenized files). Text and JSON Lines files may be gzip-compressed (*.gz)"},
      {"training", "dataset_path", &c.training.dataset_path,
       "file, directory or comma-separated list; \"\" = the dataset's default location. *.tok/*.u16/*.u32 files are "
       "pre-tokenized, *.jsonl/*.ndjson are JSON Lines, anything else is text; a trailing .gz is decompressed"},
      {"training", "dataset_text_field", &c.training.dataset_text_field,
       "JSON Lines: the field of each record holding its text (each record is one document, framed by BOS/EOS)"},
      {"training", "bad_records", choice(&c.training.bad_records),
       "a JSON Lines record that is not an object with a string text field: skip (reported with file:line, counted) | error"},
      {"training", "local_batch_size", &c.training.local_batch_size, "samples per rank per micro-batch"},
      {"training", "global_batch_size", &c.training.global_batch_size,
       "samples per optimizer step over all ranks; -1 = local x dp degree. Gradient accumulation = global / (local x dp)"},
      {"training", "seq_len", &c.training.seq_len, "tokens per sample"},
      {"training", "max_norm", &c.training.max_norm, "gradient clipping: max global L2 norm"},
      {"training", "steps", &c.training.steps, "optimizer steps"},
      {"training", "mixed_precision_param", choice(&c.training.mixed_precision_param),
       "float32 | bfloat16: FSDP all-gathers and computes in this dtype (only when FSDP is applied)"},
      {"training", "mixed_precision_reduce", choice(&c.training.mixed_precision_reduce), "float32 | bfloat16: gradient reduction dtype (FSDP)"},
      {"training", "enable_cpu_offload", &c.training.enable_cpu_offload, "FSDP CPU offload policy (no effect on a CPU run)"},
      {"training", "device", &c.training.device,
       "cpu | cuda | cuda:N: the mesh's device (FSDP's parameters and collectives); not a TorchTitan key (TorchTitan "
       "takes CUDA when present). An unavailable device is an error at start"},
      {"validation", "enable", &c.validation.enable, "validate every `freq` steps (and at step 1) on a held-out stream"},
      {"validation", "dataset", choice(&c.validation.dataset),
       "common_licenses_validation (the license held out of common_licenses) | any training.dataset kind"},
      {"validation", "dataset_path", &c.validation.dataset_path, "as training.dataset_path; \"\" = the dataset's default location"},
      {"validation", "freq", &c.validation.freq, "validate when step % freq == 0 (and at step 1), as TorchTitan"},
      {"validation", "steps", &c.validation.steps,
       "-1 = one full pass over the held-out stream (its last batch padded); N = N batches of local_batch_size per rank (the stream wraps)"},
      {"validation", "local_batch_size", &c.validation.local_batch_size, "samples per rank per validation batch"},
      {"validation", "seq_len", &c.validation.seq_len, "tokens per validation sample"},
      {"parallelism", "data_parallel_replicate_degree", &c.parallelism.data_parallel_replicate_degree,
       "replicas (HSDP's replicate dim; plain DDP when the shard degree is 1)"},
      {"parallelism", "data_parallel_shard_degree", &c.parallelism.data_parallel_shard_degree,
       "FSDP shard group size; -1 = the ranks left over"},
      {"parallelism", "fsdp_reshard_after_forward", choice(&c.parallelism.fsdp_reshard_after_forward), "default | always | never"},
      {"parallelism", "tensor_parallel_degree", &c.parallelism.tensor_parallel_degree,
       "TorchTitan's Llama TP plan with sequence parallel over this many ranks (innermost mesh dim); FSDP over the rest"},
      {"parallelism", "disable_loss_parallel", &c.parallelism.disable_loss_parallel,
       "with TP: gather the logits (Replicate) instead of the vocabulary-sharded loss-parallel cross entropy"},
      {"parallelism", "expert_parallel_degree", &c.parallelism.expert_parallel_degree,
       "MoE models: routed experts split over this many ranks of each data-parallel shard group (must divide "
       "data_parallel_shard_degree and the expert count); experts' FSDP over the shard ranks left"},
      {"parallelism", "context_parallel_degree", &c.parallelism.context_parallel_degree,
       "context parallelism: each sequence split over this many ranks (mesh dim cp: [pp, dp_replicate, dp_shard, "
       "cp, tp]), attention by ring attention; FSDP shards over dp_shard x cp. seq_len must divide by 2 x degree "
       "(headtail) or the degree (none)"},
      {"parallelism", "context_parallel_rotate_method", choice(&c.parallelism.context_parallel_rotate_method),
       "allgather (K and V all-gathered once per attention) | alltoall (K and V passed around the ring)"},
      {"parallelism", "context_parallel_load_balancer", choice(&c.parallelism.context_parallel_load_balancer),
       "headtail (rank i holds chunks i and 2cp-1-i of 2cp: even causal work) | none (cp contiguous chunks)"},
      {"parallelism", "pipeline_parallel_degree", &c.parallelism.pipeline_parallel_degree,
       "pipeline ranks (outermost mesh dim: [pp, dp_replicate, dp_shard, tp]); each holds one or more stages"},
      {"parallelism", "pipeline_parallel_schedule", choice(&c.parallelism.pipeline_parallel_schedule),
       "GPipe | 1F1B | LoopedBFS | Interleaved1F1B | InterleavedZeroBubble | ZBVZeroBubble | DualPipeV (torch's "
       "names)"},
      {"parallelism", "pipeline_parallel_schedule_csv", &c.parallelism.pipeline_parallel_schedule_csv,
       "a compute-only schedule file, one row per pipeline rank (torch's _dump_csv(format=\"compute_only\")); "
       "replaces pipeline_parallel_schedule, its stage placement is the file's"},
      {"parallelism", "pipeline_parallel_microbatch_size", &c.parallelism.pipeline_parallel_microbatch_size,
       "samples per pipeline microbatch: local_batch_size / this microbatches per step"},
      {"parallelism", "num_pp_microbatches", &c.parallelism.num_pp_microbatches,
       "microbatches per step (TorchTitan's newer key); 0 = from pipeline_parallel_microbatch_size"},
      {"parallelism", "pipeline_parallel_layers_per_stage", &c.parallelism.pipeline_parallel_layers_per_stage,
       "layers per stage (stages = ceil((layers + first + last less) / this), a multiple of the degree); 0 = the "
       "schedule's stages per rank"},
      {"parallelism", "module_fqns_per_model_part", &c.parallelism.module_fqns_per_model_part,
       "explicit stages: one list of module FQNs per stage, in order ([[\"tok_embeddings\", \"layers.0\"], "
       "[\"layers.1\", \"norm\", \"output\"]]; on the command line groups split by ';', FQNs by ','); overrides "
       "layers_per_stage"},
      {"parallelism", "pipeline_parallel_first_stage_less_layers",
       &c.parallelism.pipeline_parallel_first_stage_less_layers, "the embedding counts as this many layers"},
      {"parallelism", "pipeline_parallel_last_stage_less_layers", &c.parallelism.pipeline_parallel_last_stage_less_layers,
       "norm + output count as this many layers"},
      {"checkpoint", "enable", &c.checkpoint.enable, "save checkpoints and resume from the latest complete one"},
      {"checkpoint", "folder", &c.checkpoint.folder, "under job.dump_folder; one step-N folder per save"},
      {"checkpoint", "interval", &c.checkpoint.interval, "steps between saves (and the last step)"},
      {"checkpoint", "initial_load_path", &c.checkpoint.initial_load_path, "checkpoint to start from when the folder has none"},
      {"checkpoint", "initial_load_model_only", &c.checkpoint.initial_load_model_only, "load only the model from initial_load_path"},
      {"checkpoint", "last_save_model_only", &c.checkpoint.last_save_model_only, "final save without optimizer and trainer state"},
      {"checkpoint", "export_dtype", choice(&c.checkpoint.export_dtype), "dtype of a model-only save: float32 | bfloat16 | float16"},
      {"checkpoint", "async_mode", choice(&c.checkpoint.async_mode), "disabled | async | async_with_pinned_mem (= async on CPU)"},
      {"checkpoint", "keep_latest_k", &c.checkpoint.keep_latest_k, "older checkpoints are deleted in the background (0 = keep all)"},
      {"checkpoint", "load_step", &c.checkpoint.load_step, "-1 = latest"},
      {"checkpoint", "exclude_from_loading", choices(&c.checkpoint.exclude_from_loading), "optimizer | lr_scheduler | dataloader | train_state | rng"},
      {"checkpoint", "enable_first_step_checkpoint", &c.checkpoint.enable_first_step_checkpoint, "also save after step 1"},
      {"checkpoint", "format", choice(&c.checkpoint.format),
       "libfsdp | dcp: format of the saves (dcp = PyTorch DCP, loadable by dcp.load and TorchTitan); loading reads both"},
      {"checkpoint", "initial_load_in_hf", &c.checkpoint.initial_load_in_hf,
       "initial_load_path is a Hugging Face Llama directory (safetensors + index; model only)"},
      {"checkpoint", "last_save_in_hf", &c.checkpoint.last_save_in_hf,
       "write the last save as Hugging Face Llama safetensors + config.json (needs last_save_model_only)"},
      {"checkpoint", "direct_io", &c.checkpoint.direct_io, "write data files with O_DIRECT (false: through the page cache)"},
      {"activation_checkpoint", "mode", choice(&c.activation_checkpoint.mode),
       "none | full (every block) | selective (selective_ac_option), applied to each block before fully_shard"},
      {"activation_checkpoint", "selective_ac_option", selective_ac(&c.activation_checkpoint.selective_ac_option),
       "\"op\" = op-level SAC (every 2nd matmul kept) | \"k\" = full AC on every k-th block (\"0\"/\"1\" = all)"},
      {"metrics", "log_freq", &c.metrics.log_freq, "log every N steps (and the first and last step)"},
      {"metrics", "enable_tensorboard", &c.metrics.enable_tensorboard,
       "also write TensorBoard event files with TorchTitan's scalar names (metrics.jsonl is always written)"},
      {"metrics", "save_tb_folder", &c.metrics.save_tb_folder,
       "TensorBoard folder under job.dump_folder; each run writes into <save_tb_folder>/<YYYYmmdd-HHMM>"},
      {"metrics", "save_for_all_ranks", &c.metrics.save_for_all_ranks,
       "every rank writes metrics_rank<r>.jsonl (and TensorBoard events under .../rank_<r>)"},
      {"metrics", "peak_tflops", &c.metrics.peak_tflops, "per-rank peak for MFU; 0 = measure with a matmul benchmark at startup"},
      {"metrics", "tensor_memory", &c.metrics.tensor_memory,
       "count live CPU tensor bytes per step (start, end of forward, peak) into metrics.jsonl"},
      {"profiling", "enable_profiling", &c.profiling.enable_profiling,
       "every profile_freq steps, a Chrome trace of the step per rank (libtorch's Kineto profiler; FSDP's collectives, "
       "copies and waits and the pipeline's actions as named ranges) and the step's communication overlap"},
      {"profiling", "save_traces_folder", &c.profiling.save_traces_folder,
       "under job.dump_folder: iteration_<step>/rank<r>_trace.json and rank<r>_comm.json"},
      {"profiling", "profile_freq", &c.profiling.profile_freq, "profile the steps that are multiples of this"},
      {"profiling", "enable_memory_snapshot", &c.profiling.enable_memory_snapshot,
       "with the same steps, a memory timeline: on the CPU the live tensor bytes (a counting allocator) at every "
       "allocation and free of the step, as a Chrome trace counter track"},
      {"profiling", "save_memory_snapshot_folder", &c.profiling.save_memory_snapshot_folder,
       "under job.dump_folder: iteration_<step>/rank<r>_memory_timeline.json"},
      {"fault_tolerance", "enable", &c.fault_tolerance.enable,
       "this job is one replica group of a fault-tolerant run (fsdp::ft::Manager; start fsdp-lighthouse first)"},
      {"fault_tolerance", "replica_id", &c.fault_tolerance.replica_id,
       "this replica group's id, 0 .. group_size-1 (its share of every global batch)"},
      {"fault_tolerance", "group_size", &c.fault_tolerance.group_size, "the number of replica groups of the run"},
      {"fault_tolerance", "min_replica_size", &c.fault_tolerance.min_replica_size,
       "a step needs at least this many replica groups in its quorum"},
      {"fault_tolerance", "lighthouse", &c.fault_tolerance.lighthouse,
       "fsdp-lighthouse's host:port; empty = the environment variable FSDP_LIGHTHOUSE"},
      {"fault_tolerance", "process_group_timeout_ms", &c.fault_tolerance.process_group_timeout_ms,
       "cross-group gradient all-reduce, healing transfers and the commit vote"},
      {"fault_tolerance", "join_timeout_ms", &c.fault_tolerance.join_timeout_ms,
       "how long a quorum round waits for the groups of the previous quorum"},
      {"fault_tolerance", "quorum_timeout_seconds", &c.fault_tolerance.quorum_timeout_seconds,
       "fail when no quorum of min_replica_size groups forms within this"},
      {"comm", "init_timeout_seconds", &c.comm.init_timeout_seconds, "rendezvous and first collectives"},
      {"comm", "train_timeout_seconds", &c.comm.train_timeout_seconds, "collectives after the first step"},
      {"comm", "backend", &c.comm.backend,
       "auto | gloo | nccl: the process group on a CUDA training.device (auto = NCCL where libfsdp has it, else Gloo "
       "on CUDA tensors; gloo lets ranks share one GPU). The CPU always takes Gloo. Not a TorchTitan key"},
      {"debug", "seed", &c.debug.seed, "model init and anything random"},
      {"debug", "deterministic", &c.debug.deterministic, "torch deterministic algorithms"},
  };
}

const char* type_name(const FieldPtr& p) {
  switch (p.index()) {
    case 0: return "boolean";
    case 1: return "integer";
    case 2: return "float";
    case 3: return "string";
    case 4: return "float (optional)";
    case 5: return "array of strings";
    case 6: return "array of arrays of strings";
    case 7: return "string";
    default: return "array of strings";
  }
}

std::string format_double(double v) {
  // Shortest text that reads back to the same double, always with a '.' or exponent so TOML keeps it a float.
  std::string s;
  for (int prec = 6; prec <= 17; ++prec) {
    std::ostringstream os;
    os.precision(prec);
    os << v;
    s = os.str();
    if (std::strtod(s.c_str(), nullptr) == v) break;
  }
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// A TOML basic string that parses back to `s`, written by toml++ itself: every control character escaped
// (a hand-written quote() missed "\r", so a config with one was accepted but its re-written config.toml was not;
// found by fuzzing), no multi-line form (format_flags::none), non-ASCII as \uXXXX escapes.
std::string quote(const std::string& s) {
  std::ostringstream os;
  os << toml::toml_formatter(toml::table{{"k", s}}, toml::format_flags::none);
  std::string line = os.str();  // k = "..."
  const size_t start = line.find('"');
  const size_t end = line.rfind('"');
  return line.substr(start, end - start + 1);
}

std::string value_text(const FieldPtr& p) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
        if constexpr (std::is_same_v<T, ParsedString>) {
          return quote(v.text());
        } else if constexpr (std::is_same_v<T, ParsedStringList>) {
          std::string s = "[";
          for (const auto& t : v.texts()) s += (s.size() > 1 ? ", " : "") + quote(t);
          return s + "]";
        } else if constexpr (std::is_same_v<T, bool>) return *v ? "true" : "false";
        else if constexpr (std::is_same_v<T, int64_t>) return std::to_string(*v);
        else if constexpr (std::is_same_v<T, double>) return format_double(*v);
        else if constexpr (std::is_same_v<T, std::string>) return quote(*v);
        else if constexpr (std::is_same_v<T, std::optional<double>>) return v->has_value() ? format_double(**v) : "";
        else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          std::string s = "[";
          for (size_t i = 0; i < v->size(); ++i) s += (i ? ", " : "") + quote((*v)[i]);
          return s + "]";
        } else {
          std::string s = "[";
          for (size_t i = 0; i < v->size(); ++i) {
            s += i ? ", [" : "[";
            for (size_t j = 0; j < (*v)[i].size(); ++j) s += (j ? ", " : "") + quote((*v)[i][j]);
            s += "]";
          }
          return s + "]";
        }
      },
      p);
}

std::string known_keys(const std::vector<Field>& fs, const std::string& section) {
  std::string s;
  for (const auto& f : fs)
    if (section == f.section) s += (s.empty() ? "" : ", ") + std::string(f.key);
  return s;
}

std::string known_sections(const std::vector<Field>& fs) {
  std::string s, last;
  for (const auto& f : fs) {
    if (last == f.section) continue;
    last = f.section;
    s += (s.empty() ? "" : ", ") + last;
  }
  return s;
}

Field* find_field(std::vector<Field>& fs, const std::string& section, const std::string& key) {
  for (auto& f : fs)
    if (section == f.section && key == f.key) return &f;
  return nullptr;
}

bool has_section(const std::vector<Field>& fs, const std::string& section) {
  for (const auto& f : fs)
    if (section == f.section) return true;
  return false;
}

std::string where(const toml::source_region& src) {
  std::ostringstream os;
  os << (src.path ? *src.path : std::string("<config>")) << ":" << src.begin.line << ":" << src.begin.column;
  return os.str();
}

const char* toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    default: return "a date/time";
  }
}

void set_from_node(const Field& f, const toml::node& n) {
  const std::string name = std::string(f.section) + "." + f.key;
  auto fail = [&]() {
    throw ConfigError("config error: " + name + ": expected " + type_name(f.ptr) + ", got " + toml_type_name(n) + " (" +
                      where(n.source()) + ")");
  };
  // A string-choice value not among the choices: the key, the value, the choices and where.
  auto parse_text = [&](const auto& parse, const toml::node& e) {
    const std::string text = e.as_string()->get();
    if (const auto expected = parse(text))
      throw ConfigError("config error: " + name + ": expected " + *expected + ", got '" + text + "' (" +
                        where(e.source()) + ")");
  };
  std::visit(
      [&](const auto& v) {
        using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
        if constexpr (std::is_same_v<T, ParsedString>) {
          if (!n.is_string()) fail();
          parse_text(v.parse, n);
        } else if constexpr (std::is_same_v<T, ParsedStringList>) {
          if (!n.is_array()) fail();
          for (const auto& e : *n.as_array())
            if (!e.is_string()) fail();
          v.clear();
          for (const auto& e : *n.as_array()) parse_text(v.append, e);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!n.is_boolean()) fail();
          *v = n.as_boolean()->get();
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!n.is_integer()) fail();
          *v = n.as_integer()->get();
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::optional<double>>) {
          if (n.is_integer()) *v = static_cast<double>(n.as_integer()->get());
          else if (n.is_floating_point()) *v = n.as_floating_point()->get();
          else fail();
        } else if constexpr (std::is_same_v<T, std::string>) {
          if (!n.is_string()) fail();
          *v = n.as_string()->get();
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          if (!n.is_array()) fail();
          v->clear();
          for (const auto& e : *n.as_array()) {
            if (!e.is_string()) fail();
            v->push_back(e.as_string()->get());
          }
        } else {
          if (!n.is_array()) fail();
          v->clear();
          for (const auto& row : *n.as_array()) {
            if (!row.is_array()) fail();
            v->emplace_back();
            for (const auto& e : *row.as_array()) {
              if (!e.is_string()) fail();
              v->back().push_back(e.as_string()->get());
            }
          }
        }
      },
      f.ptr);
}

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points above U+10FFFF), as TOML
// requires of a file; a command-line value must be too, or to_toml() would write an escape that reads back as
// other text (found by fuzzing: "/tmp/fu\xC7zz" came back as "/tmp/fu\u00C7zz").
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b >> 6) != 0x2) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    const uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

void set_from_text(const Field& f, const std::string& text, const std::string& origin) {
  const std::string name = std::string(f.section) + "." + f.key;
  if (!valid_utf8(text)) throw ConfigError("config error: " + name + ": the value is not valid UTF-8 (" + origin + ")");
  auto fail = [&]() {
    throw ConfigError("config error: " + name + ": expected " + type_name(f.ptr) + ", got '" + text + "' (" + origin + ")");
  };
  auto parse_text = [&](const auto& parse, const std::string& item) {
    if (const auto expected = parse(item))
      throw ConfigError("config error: " + name + ": expected " + *expected + ", got '" + item + "' (" + origin + ")");
  };
  std::visit(
      [&](const auto& v) {
        using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
        if constexpr (std::is_same_v<T, ParsedString>) {
          parse_text(v.parse, text);
        } else if constexpr (std::is_same_v<T, ParsedStringList>) {
          v.clear();  // as for other lists: comma-separated, empty items dropped
          std::stringstream ss(text);
          std::string item;
          while (std::getline(ss, item, ','))
            if (!item.empty()) parse_text(v.append, item);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (text == "true" || text == "1") *v = true;
          else if (text == "false" || text == "0") *v = false;
          else fail();
        } else if constexpr (std::is_same_v<T, int64_t>) {
          char* end = nullptr;
          errno = 0;
          long long x = std::strtoll(text.c_str(), &end, 10);
          if (text.empty() || *end != '\0' || errno == ERANGE) fail();
          *v = x;
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::optional<double>>) {
          if constexpr (std::is_same_v<T, std::optional<double>>) {
            if (text.empty() || text == "none" || text == "None") {
              v->reset();
              return;
            }
          }
          char* end = nullptr;
          double x = std::strtod(text.c_str(), &end);
          if (text.empty() || *end != '\0') fail();
          *v = x;
        } else if constexpr (std::is_same_v<T, std::string>) {
          *v = text;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          v->clear();
          std::stringstream ss(text);
          std::string item;
          while (std::getline(ss, item, ','))
            if (!item.empty()) v->push_back(item);
        } else {
          // On the command line: groups separated by ';', items by ',' ("tok_embeddings,layers.0;layers.1,norm").
          v->clear();
          std::stringstream groups(text);
          std::string group;
          while (std::getline(groups, group, ';')) {
            v->emplace_back();
            std::stringstream items(group);
            std::string item;
            while (std::getline(items, item, ','))
              if (!item.empty()) v->back().push_back(item);
          }
        }
      },
      f.ptr);
}

void check(bool ok, const std::string& msg) {
  if (!ok) throw ConfigError("config error: " + msg);
}

}  // namespace

template <class E>
std::optional<E> parse_choice(std::string_view text) {
  for (const auto& n : Choices<E>::names)
    if (same_text(text, n.text, Choices<E>::case_insensitive)) return n.value;
  return std::nullopt;
}

// One to_string and one parse_choice per string-choice enum (the template's only instances).
#define FSDP_TRAIN_CHOICE_ENUM(E)                                      \
  const char* to_string(E v) { return name_of(v); }                  \
  template std::optional<E> parse_choice<E>(std::string_view text);
FSDP_TRAIN_CHOICE_ENUM(MoeScoreFunc)
FSDP_TRAIN_CHOICE_ENUM(MoeRouteNorm)
FSDP_TRAIN_CHOICE_ENUM(OptimizerName)
FSDP_TRAIN_CHOICE_ENUM(DecayType)
FSDP_TRAIN_CHOICE_ENUM(Dataset)
FSDP_TRAIN_CHOICE_ENUM(BadRecords)
FSDP_TRAIN_CHOICE_ENUM(MixedPrecision)
FSDP_TRAIN_CHOICE_ENUM(ReshardAfterForward)
FSDP_TRAIN_CHOICE_ENUM(PipelineSchedule)
FSDP_TRAIN_CHOICE_ENUM(ExportDtype)
FSDP_TRAIN_CHOICE_ENUM(AsyncMode)
FSDP_TRAIN_CHOICE_ENUM(CheckpointFormat)
FSDP_TRAIN_CHOICE_ENUM(AcMode)
FSDP_TRAIN_CHOICE_ENUM(AttnMaskType)
FSDP_TRAIN_CHOICE_ENUM(CpRotateMethod)
FSDP_TRAIN_CHOICE_ENUM(CpLoadBalancer)
FSDP_TRAIN_CHOICE_ENUM(CheckpointPart)
#undef FSDP_TRAIN_CHOICE_ENUM

SelectiveAcOption SelectiveAcOption::parse(const std::string& text) {
  if (text == "op") return op();
  // At most 9 digits: any k fits int64_t (and no real model has more blocks).
  const bool every_k = !text.empty() && text.size() <= 9 &&
                       std::all_of(text.begin(), text.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  if (every_k) return every_kth(std::stoll(text));
  return {Kind::Unparsed, 0, text};
}

std::string SelectiveAcOption::to_string() const {
  switch (kind) {
    case Kind::Op: return "op";
    case Kind::EveryKth: return std::to_string(k);
    default: return unparsed;
  }
}

std::vector<KeyInfo> config_schema() {
  JobConfig defaults;
  std::vector<KeyInfo> out;
  for (const auto& f : fields(defaults)) {
    std::string def = value_text(f.ptr);
    out.push_back({f.section, f.key, type_name(f.ptr), def.empty() ? "(unset)" : def, f.help, f.implemented});
  }
  return out;
}

JobConfig parse_toml(std::string_view text, const std::string& source) {
  reject_non_ascii_outside_strings(text, source);
  JobConfig config;
  auto fs = fields(config);
  toml::table tbl;
  try {
    tbl = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError("config error: invalid TOML: " + std::string(e.description()) + " (" + where(e.source()) + ")");
  }
  for (const auto& [section_key, section_node] : tbl) {
    const std::string section(section_key.str());
    if (!has_section(fs, section))
      throw ConfigError("config error: unknown section [" + section + "] (" + where(section_key.source()) +
                        "); known sections: " + known_sections(fs));
    if (!section_node.is_table())
      throw ConfigError("config error: " + section + ": expected a table [" + section + "], got " +
                        toml_type_name(section_node) + " (" + where(section_node.source()) + ")");
    for (const auto& [key, node] : *section_node.as_table()) {
      const std::string k(key.str());
      Field* f = find_field(fs, section, k);
      if (!f)
        throw ConfigError("config error: unknown key '" + section + "." + k + "' (" + where(key.source()) +
                          "); known keys in [" + section + "]: " + known_keys(fs, section));
      set_from_node(*f, node);
    }
  }
  return config;
}

void apply_overrides(JobConfig& config, const std::vector<std::string>& args) {
  auto fs = fields(config);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0)
      throw ConfigError("config error: unexpected argument '" + arg + "' (expected --section.key value)");
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "config" || name == "job.config_file") {  // consumed by load_config
      if (!has_value) ++i;
      continue;
    }
    const auto dot = name.find('.');
    const std::string section = dot == std::string::npos ? name : name.substr(0, dot);
    const std::string key = dot == std::string::npos ? "" : name.substr(dot + 1);
    Field* f = find_field(fs, section, key);
    if (!f) {
      if (!has_section(fs, section))
        throw ConfigError("config error: unknown command-line option '--" + name + "'; known sections: " + known_sections(fs));
      throw ConfigError("config error: unknown key '" + name + "' (command line); known keys in [" + section +
                        "]: " + known_keys(fs, section));
    }
    if (!has_value) {
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      if (std::holds_alternative<bool*>(f->ptr) && !next_is_value) {
        value = "true";  // a bare boolean flag
      } else {
        if (i + 1 >= args.size())
          throw ConfigError("config error: --" + name + ": missing value (expected " + type_name(f->ptr) + ")");
        value = args[++i];
      }
    }
    set_from_text(*f, value, "command line --" + name);
  }
}

JobConfig load_config(const std::vector<std::string>& args) {
  std::string path;
  for (size_t i = 0; i < args.size(); ++i) {
    for (const std::string opt : {"--config", "--job.config_file"}) {
      if (args[i] == opt) {
        if (i + 1 >= args.size()) throw ConfigError("config error: " + opt + ": missing file name");
        path = args[i + 1];
      } else if (args[i].rfind(opt + "=", 0) == 0) {
        path = args[i].substr(opt.size() + 1);
      }
    }
  }
  JobConfig config;
  if (path.empty()) {
    config = parse_toml(embedded_default_config(), "<embedded configs/debug.toml>");
  } else {
    // Bounded (a job config is a few kB; --config /dev/zero must not fill the memory), and a directory is an
    // error, not an empty file that would train on the defaults.
    std::string text;
    try {
      text = read_bounded_file(path, kMaxConfigFileBytes, "--config");
    } catch (const std::runtime_error& e) {
      throw ConfigError(std::string("config error: ") + e.what());
    }
    config = parse_toml(text, path);
  }
  apply_overrides(config, args);
  validate(config);
  return config;
}

std::string to_toml(const JobConfig& config_in) {
  JobConfig config = config_in;  // fields() binds non-const pointers
  std::ostringstream os;
  std::string last;
  for (const auto& f : fields(config)) {
    if (last != f.section) {
      os << (last.empty() ? "" : "\n") << "[" << f.section << "]\n";
      last = f.section;
    }
    const std::string v = value_text(f.ptr);
    if (v.empty()) os << "# " << f.key << " = (unset)\n";
    else os << f.key << " = " << v << "\n";
  }
  return os.str();
}

namespace {

// Context parallelism's rule for a sequence length (the library's check_context_parallel_seq_len, said in the
// config's keys): head-tail cuts each sequence into 2 x cp chunks, none into cp.
void check_context_parallel_seq_len(const char* key, int64_t seq_len, const JobConfig::Parallelism& p) {
  const int64_t cp = p.context_parallel_degree;
  const bool head_tail = p.context_parallel_load_balancer == CpLoadBalancer::HeadTail;
  const int64_t chunks = head_tail ? 2 * cp : cp;
  check(seq_len % chunks == 0,
        std::string(key) + " (" + std::to_string(seq_len) + ") must be divisible by " +
            (head_tail ? "2 x parallelism.context_parallel_degree = " : "parallelism.context_parallel_degree = ") +
            std::to_string(chunks) +
            (head_tail ? " (context_parallel_load_balancer = \"headtail\" cuts each sequence into 2 x cp chunks, "
                         "rank i holding chunks i and 2cp-1-i)"
                       : " (context_parallel_load_balancer = \"none\" cuts each sequence into cp chunks)"));
}

void check_context_parallel(const JobConfig& c) {
  const auto& p = c.parallelism;
  check(p.context_parallel_degree >= 1,
        "parallelism.context_parallel_degree: expected >= 1, got " + std::to_string(p.context_parallel_degree));
  if (p.context_parallel_degree == 1) return;
  check_context_parallel_seq_len("training.seq_len", c.training.seq_len, p);
  if (c.validation.enable) check_context_parallel_seq_len("validation.seq_len", c.validation.seq_len, p);
  // With sequence parallel each cp rank's part of the sequence is split again over the tp ranks.
  const int64_t tp = p.tensor_parallel_degree;
  check(tp == 1 || c.training.seq_len % (p.context_parallel_degree * tp) == 0, "training.seq_len (" + std::to_string(c.training.seq_len) + ") must be divisible by "
                 "parallelism.context_parallel_degree x tensor_parallel_degree = " +
                     std::to_string(p.context_parallel_degree * tp) +
                     " (each cp rank's part of the sequence is split over the tp ranks for sequence parallel)");
}

}  // namespace

void validate(const JobConfig& c) {
  check(c.model.moe_shared_experts >= -1, "model.moe_shared_experts: expected >= 0 (or -1 = the flavor's), got " +
                                              std::to_string(c.model.moe_shared_experts));
  check(c.model.moe_sequence_aux_loss_coeff >= 0, "model.moe_sequence_aux_loss_coeff: expected >= 0, got " +
                                                      std::to_string(c.model.moe_sequence_aux_loss_coeff));
  check(c.parallelism.expert_parallel_degree >= 1,
        "parallelism.expert_parallel_degree: expected >= 1, got " + std::to_string(c.parallelism.expert_parallel_degree));
  check(!c.training.dataset_text_field.empty(), "training.dataset_text_field: expected a field name, got \"\"");
  check(c.validation.freq > 0, "validation.freq: expected > 0, got " + std::to_string(c.validation.freq));
  check(c.validation.steps == -1 || c.validation.steps > 0,
        "validation.steps: expected -1 (one full pass) or > 0, got " + std::to_string(c.validation.steps));
  check(c.validation.local_batch_size > 0,
        "validation.local_batch_size: expected > 0, got " + std::to_string(c.validation.local_batch_size));
  check(c.validation.seq_len > 0, "validation.seq_len: expected > 0, got " + std::to_string(c.validation.seq_len));
  {
    const std::string& d = c.training.device;
    const bool cuda_index = d.size() > 5 && d.compare(0, 5, "cuda:") == 0 && d.size() <= 8 &&
                            std::all_of(d.begin() + 5, d.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    check(d == "cpu" || d == "cuda" || cuda_index,
          "training.device: expected \"cpu\", \"cuda\" or \"cuda:N\", got \"" + d + "\"");
#ifndef FSDP_TRAIN_WITH_CUDA
    // The timeline counts CPU tensors only: on a GPU it would show almost nothing and look like an answer; the
    // CUDA caching allocator's snapshot needs a CUDA build of libtorch (cuda_support.h).
    check(!c.profiling.enable_memory_snapshot || d == "cpu",
          "profiling.enable_memory_snapshot: on training.device \"" + d + "\" TorchTitan writes the CUDA caching "
          "allocator's snapshot, which this build of fsdp-train cannot (libtorch without CUDA); the memory timeline "
          "it writes counts CPU tensors (training.device = \"cpu\")");
#endif
    const std::string& b = c.comm.backend;
    check(b == "auto" || b == "gloo" || b == "nccl",
          "comm.backend: expected \"auto\", \"gloo\" or \"nccl\", got \"" + b + "\"");
    check(b != "nccl" || d != "cpu",
          "comm.backend = \"nccl\" with training.device = \"cpu\": NCCL works on CUDA tensors only (use \"gloo\" or "
          "\"auto\", or training.device = \"cuda\")");
  }
  check(!c.checkpoint.last_save_in_hf || c.checkpoint.last_save_model_only,
        "checkpoint.last_save_in_hf needs checkpoint.last_save_model_only = true (as TorchTitan)");
  check(c.checkpoint.interval > 0, "checkpoint.interval: expected > 0");
  check(c.checkpoint.keep_latest_k != 1, "checkpoint.keep_latest_k: 1 is not allowed (the newest may still be in flight); use 0 or >= 2");
  if (c.activation_checkpoint.mode == AcMode::Selective) {
    const SelectiveAcOption& opt = c.activation_checkpoint.selective_ac_option;
    check(opt.kind != SelectiveAcOption::Kind::Unparsed,
          "activation_checkpoint.selective_ac_option: expected \"op\" (op-level selective AC) or a non-negative "
          "integer k as a string (full AC on every k-th block), got \"" + opt.unparsed + "\"");
  }
  check(c.optimizer.lr > 0, "optimizer.lr: expected > 0, got " + format_double(c.optimizer.lr));
  check(c.lr_scheduler.warmup_steps >= 0, "lr_scheduler.warmup_steps: expected >= 0");
  if (c.lr_scheduler.decay_ratio)
    check(*c.lr_scheduler.decay_ratio >= 0 && *c.lr_scheduler.decay_ratio <= 1,
          "lr_scheduler.decay_ratio: expected a value in [0, 1], got " + format_double(*c.lr_scheduler.decay_ratio));
  check(c.lr_scheduler.min_lr_factor >= 0 && c.lr_scheduler.min_lr_factor <= 1,
        "lr_scheduler.min_lr_factor: expected a value in [0, 1]");
  check(c.training.local_batch_size > 0, "training.local_batch_size: expected > 0, got " + std::to_string(c.training.local_batch_size));
  check(c.training.global_batch_size == -1 || c.training.global_batch_size > 0,
        "training.global_batch_size: expected -1 or > 0, got " + std::to_string(c.training.global_batch_size));
  check(c.training.seq_len > 0, "training.seq_len: expected > 0, got " + std::to_string(c.training.seq_len));
  check(!c.job.dump_folder.empty(), "job.dump_folder: expected a folder (\".\" for the working directory), got \"\"");
  // Sizes checked before anything is allocated from them (a huge value would otherwise end in std::bad_alloc).
  auto check_micro_batch = [](const char* section, int64_t local_batch, int64_t seq_len) {
    const std::string s(section);
    check(seq_len <= kMaxSeqLen, s + ".seq_len: expected <= " + std::to_string(kMaxSeqLen) + " tokens, got " +
                                     std::to_string(seq_len));
    int64_t tokens = 0;
    const bool overflow = __builtin_mul_overflow(local_batch, seq_len, &tokens);
    check(!overflow && tokens <= kMaxMicroBatchTokens,
          s + ".local_batch_size x " + s + ".seq_len: expected <= " + std::to_string(kMaxMicroBatchTokens) +
              " tokens per micro-batch, got " + std::to_string(local_batch) + " x " + std::to_string(seq_len) +
              (overflow ? " (overflows)" : " = " + std::to_string(tokens)));
  };
  if (c.training.local_batch_size > 0 && c.training.seq_len > 0)
    check_micro_batch("training", c.training.local_batch_size, c.training.seq_len);
  if (c.validation.local_batch_size > 0 && c.validation.seq_len > 0)
    check_micro_batch("validation", c.validation.local_batch_size, c.validation.seq_len);
  check(c.training.steps > 0, "training.steps: expected > 0, got " + std::to_string(c.training.steps));
  check(c.training.max_norm > 0, "training.max_norm: expected > 0");
  check(c.metrics.log_freq > 0, "metrics.log_freq: expected > 0");
  check(c.profiling.profile_freq > 0, "profiling.profile_freq: expected > 0");
  check(c.metrics.peak_tflops >= 0, "metrics.peak_tflops: expected >= 0");
  check(c.parallelism.data_parallel_replicate_degree >= 1,
        "parallelism.data_parallel_replicate_degree: expected >= 1, got " +
            std::to_string(c.parallelism.data_parallel_replicate_degree));
  check(c.parallelism.data_parallel_shard_degree == -1 || c.parallelism.data_parallel_shard_degree >= 1,
        "parallelism.data_parallel_shard_degree: expected -1 or >= 1, got " +
            std::to_string(c.parallelism.data_parallel_shard_degree));
  check(c.parallelism.pipeline_parallel_degree >= 1, "parallelism.pipeline_parallel_degree: expected >= 1, got " +
                                                         std::to_string(c.parallelism.pipeline_parallel_degree));
  check(c.parallelism.pipeline_parallel_microbatch_size >= 1,
        "parallelism.pipeline_parallel_microbatch_size: expected >= 1, got " +
            std::to_string(c.parallelism.pipeline_parallel_microbatch_size));
  check(c.parallelism.num_pp_microbatches >= 0,
        "parallelism.num_pp_microbatches: expected >= 0 (0 = from pipeline_parallel_microbatch_size), got " +
            std::to_string(c.parallelism.num_pp_microbatches));
  check(c.parallelism.pipeline_parallel_layers_per_stage >= 0,
        "parallelism.pipeline_parallel_layers_per_stage: expected >= 0 (0 = unset), got " +
            std::to_string(c.parallelism.pipeline_parallel_layers_per_stage));
  check(c.parallelism.pipeline_parallel_first_stage_less_layers >= 0 &&
            c.parallelism.pipeline_parallel_last_stage_less_layers >= 0,
        "parallelism.pipeline_parallel_first/last_stage_less_layers: expected >= 0");
  check(c.parallelism.tensor_parallel_degree >= 1,
        "parallelism.tensor_parallel_degree: expected >= 1, got " + std::to_string(c.parallelism.tensor_parallel_degree));
  if (c.fault_tolerance.enable) {
    const auto& ft = c.fault_tolerance;
    check(ft.group_size >= 1, "fault_tolerance.group_size: expected >= 1 (the number of replica groups) when "
                              "fault_tolerance.enable, got " + std::to_string(ft.group_size));
    check(ft.replica_id >= 0 && ft.replica_id < ft.group_size,
          "fault_tolerance.replica_id: expected 0 .. group_size-1 = " + std::to_string(ft.group_size - 1) + ", got " +
              std::to_string(ft.replica_id));
    check(ft.min_replica_size >= 1 && ft.min_replica_size <= ft.group_size,
          "fault_tolerance.min_replica_size: expected 1 .. group_size = " + std::to_string(ft.group_size) + ", got " +
              std::to_string(ft.min_replica_size));
    check(ft.process_group_timeout_ms > 0 && ft.join_timeout_ms > 0 && ft.quorum_timeout_seconds > 0,
          "fault_tolerance.process_group_timeout_ms / join_timeout_ms / quorum_timeout_seconds: expected > 0");
    // What the replica groups replace, and what has not been made fault-tolerant yet: said, not run wrongly.
    check(c.parallelism.data_parallel_replicate_degree == 1,
          "fault_tolerance.enable with parallelism.data_parallel_replicate_degree > 1: the replica groups are the "
          "replicate dimension (each group shards with FSDP inside); set data_parallel_replicate_degree = 1");
    // Any other layout inside a replica group (FSDP, TP, PP, EP, CP) is fine: torchft replicates whole groups, the
    // cross-group average and healing pair the ranks of the same coordinates.
  }
  check_context_parallel(c);
  check(c.training.seq_len % c.parallelism.tensor_parallel_degree == 0,
        "training.seq_len (" + std::to_string(c.training.seq_len) + ") must be divisible by "
        "parallelism.tensor_parallel_degree (" + std::to_string(c.parallelism.tensor_parallel_degree) +
        ") for sequence parallel");
  check(!c.validation.enable || c.validation.seq_len % c.parallelism.tensor_parallel_degree == 0,
        "validation.seq_len (" + std::to_string(c.validation.seq_len) + ") must be divisible by "
        "parallelism.tensor_parallel_degree (" + std::to_string(c.parallelism.tensor_parallel_degree) +
        ") for sequence parallel");
}

}  // namespace fsdp_train
