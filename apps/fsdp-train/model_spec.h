#pragma once
// The model seam (TorchTitan's TrainSpec, torchtitan/protocols/train_spec.py): one registration per model family,
// keyed by model.name, holding everything the trainer, `generate`, the checkpoint seam and the planner need to know
// about a model. Nothing outside a family's folder (models/<family>/) names its classes: the trainer holds a
// TrainModel (a module plus its forward and init) and calls the spec's functions.
//
// Adding a family: a folder models/<family>/ with a function returning its TrainSpec, and one line in
// model_registry.cpp (docs/trainer.md, "Model families").

#include "attention_memory.h"
#include "config.h"
#include "parallel_dims.h"
#include "parallelize.h"

#include <fsdp/checkpoint/model_safetensors.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace fsdp_train {

// What the trainer fixes about a model beyond its flavor: the vocabulary follows the tokenizer (TorchTitan), the
// RoPE tables the sequence length, and where the parameters live (`meta` for sharded init).
struct ModelShape {
  int64_t vocab_size = 0;
  int64_t max_seq_len = 0;
  c10::Device device = c10::kCPU;
  // The tokenizer's EOS, where model.attn_mask_type = "block_causal" splits packed samples into documents;
  // -1 = none (the trainer refuses block_causal without one).
  int64_t eos_id = -1;
};

// Runs `init` (one module's initialisation) inside whatever the caller needs around it (fsdp's
// full_params_init_scope: the same numbers as an unsharded init); empty = run it as is.
using InitScope = std::function<void(torch::nn::Module& part, const std::function<void()>& init)>;

// A built model as the trainer sees it.
struct TrainModel {
  std::shared_ptr<torch::nn::Module> module;  // the whole model (its FQNs are the checkpoint's keys)
  // tokens [B, S] (int64) -> logits [B, S, vocab] through fsdp::nn::call (forward hooks run); under block_causal
  // attention it derives the tokens' document ids itself.
  std::function<at::Tensor(const at::Tensor& tokens)> forward;
  // block_causal attention: tokens [B, S] -> their document ids [B, S], what every pipeline stage's forward takes
  // beside its input (ModelStage). Empty under causal attention.
  std::function<at::Tensor(const at::Tensor& tokens)> document_ids;
  // block_causal attention: tokens [B, S] with their document ids given -> logits. For tokens cut from longer
  // rows (context parallelism), whose ids are those of the whole rows. Empty under causal attention.
  std::function<at::Tensor(const at::Tensor& tokens, const at::Tensor& document_ids)> forward_with_document_ids;
  // TorchTitan's init_weights: the flavor's initialisation from `seed`, each part inside `scope`.
  std::function<void(uint64_t seed, const InitScope& scope)> init_weights;
  // Generation: a forward over new tokens [1, n] that keeps a KV cache of `capacity` positions between calls.
  // Empty: the family has no KV cache (generate re-runs the whole sequence per token and says so).
  std::function<std::function<at::Tensor(const at::Tensor& new_tokens)>(int64_t capacity)> cached_forward;
  std::string summary;      // one line for the log: "dim 256, 6 layers, ...", ending with the vocabulary
  int64_t num_params = 0;   // all parameters of the whole model (analytic, from the flavor)
  double flops_per_token = 0;  // TorchTitan's training FLOPs per token at shape.max_seq_len
  // One block's attention as the kernel sees it (all heads; TP divides them), for the start-up log's attention
  // memory per rank (attention_memory.h); heads 0: not reported.
  AttentionShape attention;
};

// A family's Hugging Face adapter: the model's weights from / to a Hugging Face checkpoint directory
// (safetensors + index + config.json), each rank reading or writing its own shards.
struct HfAdapter {
  std::function<fsdp::checkpoint::SafetensorsImportResult(torch::nn::Module& model, const std::string& dir,
                                                          const fsdp::checkpoint::SafetensorsImportOptions& options)>
      import_weights;
  std::function<fsdp::checkpoint::SafetensorsExportResult(torch::nn::Module& model, const std::string& dir,
                                                          const fsdp::checkpoint::SafetensorsExportOptions& options)>
      export_weights;
};

struct TrainSpec {
  std::string name;                  // model.name
  std::vector<std::string> flavors;  // model.flavor values
  // The flavor of `config` (model.flavor with the [model] overrides) built for `shape`, not initialised (on
  // `meta`: no storage). A ConfigError naming model.flavor for an unknown flavor or overrides it cannot take.
  std::function<TrainModel(const JobConfig& config, const ModelShape& shape)> build;
  // The layouts the family trains: a ConfigError naming the family, the flavor and the refused layout. No
  // collectives: fsdp-train checks it before any process group exists.
  std::function<void(const JobConfig& config, const ParallelDims& dims)> check_layout;
  // TorchTitan's parallelize_<family>: apply_tp, apply_ep, apply_ac, apply_fsdp (or apply_ddp) in that order,
  // after the pipeline split under PP. `group`: the world group, or null for one process (then only AC).
  std::function<ParallelPlan(TrainModel& model, const JobConfig& config, const ParallelDims& dims,
                             const fsdp::ProcessGroupPtr& group)>
      parallelize;
  // The pipeline split (stages and the schedule placing them); a ConfigError naming the [parallelism] keys. No
  // collectives: any rank (or the planner) computes any rank's stages.
  std::function<PipelineSplit(const TrainModel& model, const PipelineSplitOptions& options)> split_pipeline;
  // The TP plan over `tp_degree` ranks (sequence parallel; loss_parallel: logits stay sharded on the vocabulary).
  std::function<fsdp::ParallelizePlan(const TrainModel& model, int64_t tp_degree, bool loss_parallel)> tp_plan;
  HfAdapter hf;
};

// The family model.name names; a ConfigError listing the registered names for any other.
const TrainSpec& train_spec(const std::string& model_name);
// The registered families, in registration order.
std::vector<std::string> train_spec_names();

// config.model.name's layout check on `world_size` ranks (its pipeline split too), block_causal's EOS, FT's coordinator
// and the data files: what fsdp-train checks before init_distributed (a refused one is one line, no rendezvous).
// Returns whether the family's layout check ran (false: the layout does not resolve on `world_size` ranks, left to
// the Trainer).
bool check_model_layout(const JobConfig& config, int64_t world_size);

}  // namespace fsdp_train
