#pragma once
// Llama 3 (torchtitan/models/llama3): model.name = "llama3", its flavors (fsdp/models/llama.h) and the Hugging Face
// LlamaForCausalLM adapter (fsdp/models/hf_llama.h).

#include "model_spec.h"

namespace fsdp_train::llama3 {

TrainSpec train_spec();

}  // namespace fsdp_train::llama3
