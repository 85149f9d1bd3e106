#pragma once
// DeepSeek-V3 cut into pipeline stages as TorchTitan cuts it (the same pipeline_module_split as Llama 3: the model's
// chain is tok_embeddings, layers.0 .. layers.<n-1>, norm, output, so the split of <fsdp/models/llama_pipeline.h>
// applies unchanged). A stage shares the whole model's submodules, so its parameters keep the whole model's FQNs
// and a checkpoint of the stages is a checkpoint of the whole model.

#include <fsdp/models/deepseek_v3.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::models::deepseek_v3 {

class DeepSeekV3StageImpl : public torch::nn::Module {
 public:
  // Shares `whole`'s modules: tok_embeddings when `first`, blocks [begin, end), norm and output when `last`.
  DeepSeekV3StageImpl(DeepSeekV3Impl& whole, int64_t begin, int64_t end, bool first, bool last);
  // First stage: tokens [B, S] -> hidden; middle: hidden -> hidden; last: hidden -> logits. document_ids: the
  // microbatch's llama::document_ids [B, S] (full length), given exactly when the model is block_causal.
  at::Tensor forward(const at::Tensor& x, const std::optional<at::Tensor>& document_ids = std::nullopt);

  // The hidden states between stages are split along the sequence over this many ranks (sequence parallel);
  // RoPE and the mask need the full length. Set by the tensor-parallel plan's user (1 = not split).
  int64_t sequence_shards = 1;
  // Context parallelism, as on the whole model (DeepSeekV3Impl::rope_positions / document_mask): the global RoPE
  // positions (int64 [S]) of the S tokens of this rank's chunks, and block_causal's mask of the microbatch's
  // document ids as the blocks' attention kernel takes it (every cp rank's ids, for the masked ring). Unset:
  // positions 0 .. S-1, llama::block_causal_mask(ids).
  std::function<at::Tensor(int64_t seq_len)> rope_positions;
  std::function<at::Tensor(const at::Tensor& document_ids)> document_mask;

  bool first() const { return first_; }
  bool last() const { return last_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  std::vector<TransformerBlock>& blocks() { return blocks_; }

  llama::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleDict layers{nullptr};
  llama::RMSNorm norm{nullptr};
  llama::Linear output{nullptr};

 private:
  DeepSeekV3Args args_;
  bool first_, last_;
  int64_t begin_, end_;
  std::vector<TransformerBlock> blocks_;
  at::Tensor rope_cos_, rope_sin_;
};
TORCH_MODULE(DeepSeekV3Stage);

}  // namespace fsdp::models::deepseek_v3
