#pragma once
// The forwards a family's TrainModel takes from its model (model_spec.h): the model's own forward through
// fsdp::nn::call (forward hooks run), with the documents' ids under block_causal attention. Shared by the family
// folders under models/ whose model takes (tokens[, document ids]) (the Llama 3 decoder's and DeepSeek-V3's
// build_model), so that the block_causal and context-parallel forwards are written once.

#include "model_spec.h"

#include <fsdp/models/llama.h>
#include <fsdp/nn/module_call.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace fsdp_train {

// out.forward, and under block_causal (`block_causal`; `eos_id`: the tokenizer's EOS, which ends a document)
// out.document_ids, a forward that builds them from the tokens, and out.forward_with_document_ids (context
// parallel: this rank's chunks of the tokens with their chunks of the whole rows' ids).
template <class ModelHolder>
void set_model_forwards(TrainModel& out, const ModelHolder& model, bool block_causal, int64_t eos_id) {
  if (!block_causal) {
    out.forward = [model](const at::Tensor& tokens) { return fsdp::nn::call(model, tokens); };
    return;
  }
  TORCH_CHECK(eos_id >= 0, "block_causal attention needs the tokenizer's EOS (ModelShape::eos_id)");
  out.document_ids = [eos_id](const at::Tensor& tokens) { return fsdp::models::llama::document_ids(tokens, eos_id); };
  out.forward = [model, ids = out.document_ids](const at::Tensor& tokens) {
    return fsdp::nn::call(model, tokens, std::optional<at::Tensor>(ids(tokens)));
  };
  out.forward_with_document_ids = [model](const at::Tensor& tokens, const at::Tensor& ids) {
    return fsdp::nn::call(model, tokens, std::optional<at::Tensor>(ids));
  };
}

}  // namespace fsdp_train
