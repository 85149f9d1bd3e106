#pragma once
// The model seam's entries (model_spec.h) for a family built on the Llama 3 decoder (fsdp::nn::llama::Transformer):
// how to build, initialise, parallelize (parallelize_llama.h), split and TP-plan it. A family on this decoder
// gives its name, its flavors and its Hugging Face adapter; Llama 3 (llama3_spec.h) and Qwen3 (../qwen3) do.

#include "model_spec.h"

#include <string>
#include <vector>

namespace fsdp_train::llama3 {

TrainSpec decoder_train_spec(std::string name, std::vector<std::string> flavors, HfAdapter hf);

}  // namespace fsdp_train::llama3
