#include <fsdp/models/llama_pipeline.h>

#include <fsdp/nn/module_call.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp::models::llama {

std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t n_layers, int64_t num_stages, int64_t first_less,
                                                      int64_t last_less) {
  TORCH_CHECK(num_stages >= 1, "llama pipeline split: num_stages must be >= 1, got ", num_stages);
  TORCH_CHECK(first_less >= 0 && last_less >= 0, "llama pipeline split: first/last stage less layers must be >= 0, "
              "got ", first_less, " and ", last_less);
  if (num_stages == 1) return {{0, n_layers}};
  const int64_t effective = n_layers + first_less + last_less;
  const int64_t per_stage = effective / num_stages, extra = effective % num_stages;
  TORCH_CHECK(per_stage > 0, "llama pipeline split: ", n_layers, " layers (+", first_less, " for the embedding, +",
              last_less, " for norm and output) are too few for ", num_stages, " stages");
  TORCH_CHECK(first_less <= per_stage && last_less <= per_stage, "llama pipeline split: with ", num_stages,
              " stages each holds about ", per_stage, " effective layers, fewer than the first/last stage's extra ",
              "weight (", first_less, " / ", last_less, "); use fewer stages or smaller less_layers values");
  std::vector<std::pair<int64_t, int64_t>> ranges;
  int64_t next = 0;
  for (int64_t s = 0; s < num_stages; ++s) {
    int64_t take = per_stage + (s < extra ? 1 : 0);
    if (s == 0) take -= first_less;
    if (s == num_stages - 1) take -= last_less;
    TORCH_CHECK(take >= 0, "llama pipeline split: stage ", s, " would hold ", take, " layers");
    ranges.emplace_back(next, next + take);
    next += take;
  }
  TORCH_CHECK(next == n_layers, "llama pipeline split: internal error: ", next, " layers placed of ", n_layers);
  return ranges;
}

int64_t stages_for_layers_per_stage(int64_t n_layers, int64_t layers_per_stage, int64_t first_less,
                                    int64_t last_less) {
  TORCH_CHECK(layers_per_stage >= 1, "pipeline_parallel_layers_per_stage must be >= 1, got ", layers_per_stage);
  const int64_t effective = n_layers + first_less + last_less;
  return (effective + layers_per_stage - 1) / layers_per_stage;
}

std::vector<std::pair<int64_t, int64_t>> layers_from_fqns(const LlamaArgs& args,
                                                          const std::vector<std::vector<std::string>>& fqns_per_stage) {
  TORCH_CHECK(!fqns_per_stage.empty(), "module_fqns_per_model_part: no stages given");
  // The chain in order: tok_embeddings, layers.0 .. layers.<n-1>, norm, output (none with tied embeddings).
  std::vector<std::string> chain{"tok_embeddings"};
  for (int64_t i = 0; i < args.n_layers; ++i) chain.push_back("layers." + std::to_string(i));
  chain.push_back("norm");
  if (!args.tie_embeddings) chain.push_back("output");
  size_t next = 0;  // position in the chain of the next expected module
  std::vector<std::pair<int64_t, int64_t>> ranges;
  const size_t last_stage = fqns_per_stage.size() - 1;
  for (size_t s = 0; s < fqns_per_stage.size(); ++s) {
    int64_t begin = -1, end = -1;
    TORCH_CHECK(!fqns_per_stage[s].empty(), "module_fqns_per_model_part: stage ", s, " holds no module");
    for (const std::string& fqn : fqns_per_stage[s]) {
      TORCH_CHECK(next < chain.size() && fqn == chain[next], "module_fqns_per_model_part: stage ", s, " lists '", fqn,
                  "', but the model's next module in order is ",
                  next < chain.size() ? "'" + chain[next] + "'" : std::string("none (all were placed)"),
                  "; stages must cover tok_embeddings, layers.0..", args.n_layers - 1,
                  ", norm and output once each, in that order");
      if (fqn.rfind("layers.", 0) == 0) {
        const int64_t layer = static_cast<int64_t>(next) - 1;
        if (begin < 0) begin = layer;
        end = layer + 1;
      }
      ++next;
    }
    if (begin < 0) {  // no layer: an empty range at the position the chain reached
      begin = end = std::clamp<int64_t>(static_cast<int64_t>(next) - 1, 0, args.n_layers);
    }
    ranges.emplace_back(begin, end);
    if (s == 0) {
      TORCH_CHECK(!fqns_per_stage[0].empty() && fqns_per_stage[0].front() == "tok_embeddings",
                  "module_fqns_per_model_part: stage 0 must start with tok_embeddings (it takes the tokens)");
    }
    if (s < last_stage) {
      TORCH_CHECK(next <= static_cast<size_t>(args.n_layers) + 1, "module_fqns_per_model_part: stage ", s,
                  " holds norm or output, which belong to the last stage (", last_stage, ")");
    }
  }
  TORCH_CHECK(next == chain.size(), "module_fqns_per_model_part: '", chain[std::min(next, chain.size() - 1)],
              "' and the modules after it are in no stage");
  return ranges;
}

LlamaStageImpl::LlamaStageImpl(TransformerImpl& whole, int64_t begin, int64_t end, bool first, bool last)
    : args_(whole.args()), first_(first), last_(last), begin_(begin), end_(end) {
  TORCH_CHECK(0 <= begin && begin <= end && end <= args_.n_layers, "llama stage: layers [", begin, ", ", end,
              ") are outside the model's ", args_.n_layers, " layers");
  TORCH_CHECK(!args_.tie_embeddings || (first && last), "llama stage: a model with tied embeddings (the output ",
              "reuses tok_embeddings.weight) cannot be split into pipeline stages: the first and last stage would ",
              "share one parameter");
  if (first) tok_embeddings = register_module("tok_embeddings", whole.tok_embeddings);
  layers = register_module("layers", torch::nn::ModuleDict());
  for (int64_t i = begin; i < end; ++i) {
    blocks_.push_back(whole.blocks()[static_cast<size_t>(i)]);
    layers->update({{std::to_string(i), blocks_.back().ptr()}});
  }
  if (last) {
    norm = register_module("norm", whole.norm);
    if (!args_.tie_embeddings) output = register_module("output", whole.output);
  }
}

std::vector<std::string> LlamaStageImpl::module_fqns() const {
  std::vector<std::string> fqns;
  if (first_) fqns.push_back("tok_embeddings");
  for (int64_t i = begin_; i < end_; ++i) fqns.push_back("layers." + std::to_string(i));
  if (last_) {
    fqns.push_back("norm");
    if (!args_.tie_embeddings) fqns.push_back("output");
  }
  return fqns;
}

at::Tensor LlamaStageImpl::forward(const at::Tensor& x, const std::optional<at::Tensor>& document_ids) {
  const bool given_ids = document_ids.has_value() && document_ids->defined();
  const AttentionMask mask = document_mask && given_ids && args_.attn_mask_type == AttnMaskType::BlockCausal
                                 ? AttentionMask(document_mask(*document_ids))
                                 : attention_mask_for(args_, document_ids, "llama stage");
  if (mask) {
    TORCH_CHECK(document_ids->size(0) == x.size(0), "llama stage: document ids for ", document_ids->size(0),
                " sequences, the microbatch has ", x.size(0));
  }
  at::Tensor h;
  int64_t seq_len;
  if (first_) {
    TORCH_CHECK(x.dim() == 2, "llama stage 0: tokens must be [batch, seq], got ", x.sizes());
    seq_len = x.size(1);
    h = fsdp::nn::call(tok_embeddings, x);
  } else {
    TORCH_CHECK(x.dim() == 3, "llama stage (layers ", begin_, "..", end_ - 1, "): hidden states must be [batch, seq, ",
                "dim], got ", x.sizes());
    seq_len = x.size(1) * sequence_shards;
    h = x;
  }
  // RoPE at positions 0 .. seq_len-1, or (context parallel) at the global positions of this rank's chunks.
  at::Tensor positions;
  int64_t table_len = seq_len;
  if (rope_positions) {
    positions = rope_positions(seq_len).to(h.device());
    TORCH_CHECK(positions.dim() == 1 && positions.size(0) == seq_len, "llama stage: rope_positions gave ",
                positions.sizes(), " for ", seq_len, " tokens");
    table_len = positions.max().item<int64_t>() + 1;
  }
  if (!rope_cos_.defined() || rope_cos_.size(0) < table_len || rope_cos_.device() != h.device()) {
    auto [c, s] = precompute_rope(args_.head_dim(), std::max(table_len, args_.max_seq_len), args_.rope_theta,
                                  args_.rope_scaling);
    rope_cos_ = c.to(h.device());
    rope_sin_ = s.to(h.device());
  }
  const at::Tensor cos = positions.defined() ? rope_cos_.index_select(0, positions) : rope_cos_.slice(0, 0, seq_len);
  const at::Tensor sin = positions.defined() ? rope_sin_.index_select(0, positions) : rope_sin_.slice(0, 0, seq_len);
  if (mask) {
    TORCH_CHECK(mask->size(2) == seq_len, "llama stage: document ids cover ", mask->size(2), " positions, the ",
                "sequence has ", seq_len);
  }
  for (auto& block : blocks_) h = mask ? fsdp::nn::call(block, h, cos, sin, mask) : fsdp::nn::call(block, h, cos, sin);
  if (!last_) return h;
  h = fsdp::nn::call(norm, h);
  if (args_.tie_embeddings) return at::linear(h, tok_embeddings->weight());
  return fsdp::nn::call(output, h);
}

}  // namespace fsdp::models::llama
