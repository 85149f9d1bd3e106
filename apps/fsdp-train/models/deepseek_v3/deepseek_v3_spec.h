#pragma once
// DeepSeek-V3 (torchtitan/models/deepseek_v3): model.name = "deepseek_v3", TorchTitan's flavors (debugmodel, 16B,
// 236B, 671B) and our cpu_tiny (fsdp/models/deepseek_v3.h: multi-head latent attention, MoE with shared experts
// and group-limited routing), its parallelize step (parallelize_deepseek_v3.h) and the Hugging Face
// DeepseekV3ForCausalLM adapter (fsdp/models/hf_deepseek_v3.h). Registered in model_registry.cpp.

#include "model_spec.h"

namespace fsdp_train::deepseek_v3 {

TrainSpec train_spec();

}  // namespace fsdp_train::deepseek_v3
