#pragma once
// Llama 3 cut into pipeline stages as TorchTitan cuts it (pipeline_module_split / _generate_llm_fqn_per_model_part):
// stage 0 holds tok_embeddings and its first layers, the last stage its layers, norm and output, the others only
// layers; the first and last stages count their extra modules as `first_less` / `last_less` layers. A stage is a
// module of its own that shares the whole model's submodules, so its parameters keep the whole model's FQNs
// ("layers.17.attention.wq.weight" on whichever stage holds layer 17) and a checkpoint of the stages is a
// checkpoint of the whole model.

#include <fsdp/models/llama.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::models::llama {

// The layers of each stage, [begin, end) per stage (TorchTitan's split). Effective layers E = n_layers +
// first_less + last_less; every stage gets E / num_stages of them, the first E % num_stages one more; the first
// stage's first `first_less` and the last stage's last `last_less` are the embedding and norm + output. Errors
// (with the numbers) when a stage would get no effective layer or fewer than its extra modules' weight.
std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t n_layers, int64_t num_stages, int64_t first_less = 1,
                                                      int64_t last_less = 1);
// With TorchTitan's pipeline_parallel_layers_per_stage: the number of stages, ceil((n_layers + first_less +
// last_less) / layers_per_stage).
int64_t stages_for_layers_per_stage(int64_t n_layers, int64_t layers_per_stage, int64_t first_less = 1,
                                    int64_t last_less = 1);

// TorchTitan's module_fqns_per_model_part: the layers [begin, end) of each stage given as module FQNs. The stages
// must form the model's chain: "tok_embeddings" first in stage 0, then "layers.0" ... "layers.<n-1>" each once and
// in order, "norm" then "output" at the end of the last stage (a stage may hold no layer). Anything else (an
// unknown or repeated FQN, a gap, a module out of order, an empty stage list) is an error naming it and the stage.
std::vector<std::pair<int64_t, int64_t>> layers_from_fqns(const LlamaArgs& args,
                                                          const std::vector<std::vector<std::string>>& fqns_per_stage);

class LlamaStageImpl : public torch::nn::Module {
 public:
  // Shares `whole`'s modules: tok_embeddings when `first`, blocks [begin, end), norm and output when `last`.
  LlamaStageImpl(TransformerImpl& whole, int64_t begin, int64_t end, bool first, bool last);
  // First stage: tokens [B, S] -> hidden; middle: hidden -> hidden; last: hidden -> logits (hidden -> logits when
  // both first and last). document_ids: the microbatch's document_ids() [B, S] (full length), given exactly when
  // the model is BlockCausal; every stage needs them (the pipeline carries them alongside the microbatch).
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& document_ids = std::nullopt);

  // The hidden states between stages are split along the sequence over this many ranks (sequence parallel);
  // RoPE needs the full length. Set by the tensor-parallel plan's user (1 = not split).
  int64_t sequence_shards = 1;
  // Context parallelism, as on the whole model (TransformerImpl::rope_positions / document_mask): the global RoPE
  // positions (int64 [S]) of the S tokens of this rank's chunks, and the attention mask of this rank's queries
  // against every cp rank's keys from the chunks' document ids. Unset: positions 0 .. S-1, block_causal_mask(ids).
  std::function<at::Tensor(int64_t seq_len)> rope_positions;
  std::function<at::Tensor(const at::Tensor& document_ids)> document_mask;

  bool first() const { return first_; }
  bool last() const { return last_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  std::vector<TransformerBlock>& blocks() { return blocks_; }
  // The whole model's FQN prefixes this stage holds ("tok_embeddings", "layers.4", ..., "norm", "output").
  std::vector<std::string> module_fqns() const;

  Embedding tok_embeddings{nullptr};
  torch::nn::ModuleDict layers{nullptr};
  RMSNorm norm{nullptr};
  Linear output{nullptr};

 private:
  LlamaArgs args_;
  bool first_, last_;
  int64_t begin_, end_;
  std::vector<TransformerBlock> blocks_;
  at::Tensor rope_cos_, rope_sin_;
};
TORCH_MODULE(LlamaStage);

}  // namespace fsdp::models::llama
