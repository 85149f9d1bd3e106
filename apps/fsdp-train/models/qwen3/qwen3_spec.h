#pragma once
// Qwen3 and Qwen3-MoE (torchtitan/models/qwen3): model.name = "qwen3", its dense and *_moe flavors
// (fsdp/models/qwen3.h) on the Llama 3 decoder with QK-norm, and the Hugging Face Qwen3ForCausalLM /
// Qwen3MoeForCausalLM adapter (fsdp/models/hf_qwen3.h).

#include "model_spec.h"

namespace fsdp_train::qwen3 {

TrainSpec train_spec();

}  // namespace fsdp_train::qwen3
