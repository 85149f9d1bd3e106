// The config's rules (config.h, validate()): ranges and rules across keys that need no world size, each a
// ConfigError naming the keys. resolve_parallelism (parallel_dims.cpp) adds the world-size rules, and each model
// family's check_layout its own (model_spec.h), all before any process group or model exists.
#include "config_fields.h"  // format_double

#include <algorithm>
#include <string>

namespace fsdp_train {
namespace {

void check(bool ok, const std::string& msg) {
  if (!ok) throw ConfigError("config error: " + msg);
}

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

// The moe_* keys' own ranges (a value outside them used to be taken silently as "the flavor's", or reached the MoE
// layer's check only after the rendezvous). What depends on the flavor's experts is apply_moe_overrides'.
void check_moe_keys(const JobConfig::Model& m) {
  check(m.moe_route_scale >= 0, "model.moe_route_scale: expected > 0 (or 0 = the flavor's), got " +
                                    format_double(m.moe_route_scale));
  check(m.moe_load_balance_coeff >= 0 || m.moe_load_balance_coeff == -1,
        "model.moe_load_balance_coeff: expected >= 0 (0 = off) or -1 = the flavor's, got " +
            format_double(m.moe_load_balance_coeff));
  check(m.moe_num_expert_groups >= 0, "model.moe_num_expert_groups: expected >= 0 (0 = no group-limited routing), got " +
                                          std::to_string(m.moe_num_expert_groups));
  check(m.moe_num_limited_groups >= 0,
        "model.moe_num_limited_groups: expected >= 0, got " + std::to_string(m.moe_num_limited_groups));
  check(m.moe_num_limited_groups == 0 || m.moe_num_expert_groups > 0,
        "model.moe_num_limited_groups = " + std::to_string(m.moe_num_limited_groups) +
            " needs model.moe_num_expert_groups (the groups it picks from; 0 = group-limited routing off)");
}

}  // namespace

void validate(const JobConfig& c) {
  check(c.model.moe_shared_experts >= -1, "model.moe_shared_experts: expected >= 0 (or -1 = the flavor's), got " +
                                              std::to_string(c.model.moe_shared_experts));
  check(c.model.moe_sequence_aux_loss_coeff >= 0, "model.moe_sequence_aux_loss_coeff: expected >= 0, got " +
                                                      std::to_string(c.model.moe_sequence_aux_loss_coeff));
  check_moe_keys(c.model);
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
