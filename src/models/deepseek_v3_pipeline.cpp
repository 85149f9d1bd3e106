#include <fsdp/models/deepseek_v3_pipeline.h>

#include <fsdp/nn/module_call.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::models::deepseek_v3 {

DeepSeekV3StageImpl::DeepSeekV3StageImpl(DeepSeekV3Impl& whole, int64_t begin, int64_t end, bool first, bool last)
    : args_(whole.args()), first_(first), last_(last), begin_(begin), end_(end) {
  TORCH_CHECK(0 <= begin && begin <= end && end <= args_.n_layers, "deepseek_v3 stage: layers [", begin, ", ", end,
              ") are outside the model's ", args_.n_layers, " layers");
  if (first) tok_embeddings = register_module("tok_embeddings", whole.tok_embeddings);
  layers = register_module("layers", torch::nn::ModuleDict());
  for (int64_t i = begin; i < end; ++i) {
    blocks_.push_back(whole.blocks()[static_cast<size_t>(i)]);
    layers->update({{std::to_string(i), blocks_.back().ptr()}});
  }
  if (last) {
    norm = register_module("norm", whole.norm);
    output = register_module("output", whole.output);
  }
}

at::Tensor DeepSeekV3StageImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& document_ids) {
  const bool block_causal = args_.attn_mask_type == llama::AttnMaskType::BlockCausal;
  TORCH_CHECK(block_causal == (document_ids.has_value() && document_ids->defined()), "deepseek_v3 stage: ",
              block_causal ? "a block_causal model needs the microbatch's document ids"
                           : "document ids given to a causal model (attn_mask_type is causal)");
  at::Tensor h;
  int64_t seq_len;
  if (first_) {
    TORCH_CHECK(x.dim() == 2, "deepseek_v3 stage 0: tokens must be [batch, seq], got ", x.sizes());
    seq_len = x.size(1);
    h = fsdp::nn::call(tok_embeddings, x);
  } else {
    TORCH_CHECK(x.dim() == 3, "deepseek_v3 stage (layers ", begin_, "..", end_ - 1, "): hidden states must be ",
                "[batch, seq, dim], got ", x.sizes());
    seq_len = x.size(1) * sequence_shards;
    h = x;
  }
  llama::AttentionMask mask;
  if (block_causal) {
    TORCH_CHECK(document_ids->size(0) == x.size(0) && document_ids->size(1) == seq_len, "deepseek_v3 stage: ",
                "document ids ", document_ids->sizes(), " do not fit ", x.size(0), " sequences of ", seq_len);
    mask = document_mask ? document_mask(*document_ids) : llama::block_causal_mask(*document_ids);
  }
  // RoPE at positions 0 .. seq_len-1, or (context parallel) at the global positions of this rank's chunks.
  at::Tensor positions;
  int64_t table_len = seq_len;
  if (rope_positions) {
    positions = rope_positions(seq_len).to(h.device());
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == seq_len, "deepseek_v3 stage: rope_positions gave ",
                positions.sizes(), " for ", seq_len, " tokens");
    table_len = positions.max().item<int64_t>() + 1;
  }
  // The whole model's RoPE table (DeepSeekV3Impl::rope_tables): only the qk_rope_head_dim part is rotated.
  if (!rope_cos_.defined() || rope_cos_.size(0) < table_len || rope_cos_.device() != h.device()) {
    auto [c, s] = llama::precompute_rope(args_.qk_rope_head_dim, std::max(table_len, args_.max_seq_len),
                                         args_.rope_theta, args_.rope_scaling);
    rope_cos_ = c.to(h.device());
    rope_sin_ = s.to(h.device());
  }
  const at::Tensor cos = positions.defined() ? rope_cos_.index_select(0, positions) : rope_cos_.slice(0, 0, seq_len);
  const at::Tensor sin = positions.defined() ? rope_sin_.index_select(0, positions) : rope_sin_.slice(0, 0, seq_len);
  for (auto& block : blocks_) h = mask ? fsdp::nn::call(block, h, cos, sin, mask) : fsdp::nn::call(block, h, cos, sin);
  if (!last_) return h;
  return fsdp::nn::call(output, fsdp::nn::call(norm, h));
}

}  // namespace fsdp::models::deepseek_v3
