#pragma once
// Qwen3 (dense and MoE) as flavors of our Llama decoder (fsdp::models::llama::Transformer): TorchTitan's
// torchtitan/models/qwen3 and Hugging Face's Qwen3ForCausalLM / Qwen3MoeForCausalLM. What differs from Llama 3
// is all in LlamaArgs: head_dim 128 independent of dim, a given FFN size, QK-norm (RMSNorm per head on q and k
// before RoPE), Hugging Face's half-split RoPE layout, norm eps 1e-6, RoPE theta 1e6 (5e6 for 235B-A22B) and,
// for the MoE flavors, every layer an MoE block (softmax router, top-k scores renormalised, no shared experts,
// aux-loss-free load balancing with coefficient 1e-3 as TorchTitan). Hugging Face weights: <fsdp/models/hf_qwen3.h>.

#include <fsdp/models/llama.h>

#include <string>
#include <vector>

namespace fsdp::models::llama {

// "debugmodel" (dense) and "debugmodel_moe", TorchTitan's; the real sizes "0.6B", "1.7B", "4B", "8B", "14B",
// "32B" (dense; 0.6B-4B tie their embeddings, as TorchTitan and the released checkpoints) and "30B-A3B",
// "235B-A22B" (MoE); small CPU flavors "cpu_tiny", "cpu_small" (dense) and "cpu_tiny_moe", "cpu_small_moe"
// (8 experts, top-2), sized like llama3's cpu_tiny / cpu_small. Throws naming the known flavors.
LlamaArgs qwen3_flavor(const std::string& name);
std::vector<std::string> qwen3_flavor_names();

// A flavor of either model family: model_name "llama3" (llama3_flavor) or "qwen3" (qwen3_flavor). Throws
// naming the known model names for another one.
LlamaArgs model_flavor(const std::string& model_name, const std::string& flavor);
std::vector<std::string> model_names();

}  // namespace fsdp::models::llama
