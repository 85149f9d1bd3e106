// Qwen3 flavors (see include/fsdp/models/qwen3.h). Sizes from TorchTitan's torchtitan/models/qwen3/__init__.py.
#include <fsdp/models/qwen3.h>

#include <c10/util/Exception.h>

namespace fsdp::models::llama {

namespace {

LlamaArgs qwen3_base() {
  LlamaArgs a;
  a.norm_eps = 1e-6;
  a.rope_theta = 1e6;
  a.rope_scaling.reset();
  a.qk_norm = true;
  a.rope_layout = RopeLayout::HalfSplit;
  a.explicit_head_dim = 128;
  a.vocab_size = 151936;
  // TorchTitan's RoPE max_seq_len is 4096 for every flavor but 30B-A3B (262144); ours only sizes the RoPE
  // table computed up front, which grows to the sequences actually seen.
  a.max_seq_len = 4096;
  return a;
}

void dense(LlamaArgs& a, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn, bool tied) {
  a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.n_kv_heads = kv_heads;
  a.explicit_ffn_hidden = ffn;
  a.tie_embeddings = tied;
}

// Every layer MoE, TorchTitan's Qwen3 router (= Hugging Face's norm_topk_prob = true).
void moe(LlamaArgs& a, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t experts, int64_t top_k,
         int64_t expert_hidden) {
  a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.n_kv_heads = kv_heads;
  fsdp::models::moe::MoEOptions o;
  o.dim = dim;
  o.hidden = expert_hidden;
  o.num_experts = experts;
  o.top_k = top_k;
  o.score_func = "softmax";
  o.route_norm = true;
  o.route_scale = 1.0;
  o.load_balance_coeff = 1e-3;
  o.num_shared_experts = 0;
  a.moe = o;
}

}  // namespace

std::vector<std::string> qwen3_flavor_names() {
  return {"cpu_tiny", "cpu_small", "cpu_tiny_moe", "cpu_small_moe", "debugmodel", "debugmodel_moe", "0.6B", "1.7B",
          "4B",       "8B",        "14B",          "32B",           "30B-A3B",    "235B-A22B"};
}

LlamaArgs qwen3_flavor(const std::string& name) {
  LlamaArgs a = qwen3_base();
  if (name == "cpu_tiny" || name == "cpu_tiny_moe") {
    // llama3 cpu_tiny's sizes (FFN 192); head_dim 32 so that heads * head_dim (128) != dim, as in real Qwen3.
    a.vocab_size = 2048, a.explicit_head_dim = 32;
    if (name == "cpu_tiny") dense(a, 64, 2, 4, 2, 192, false);
    else moe(a, 64, 2, 4, 2, 8, 2, 32);
  } else if (name == "cpu_small" || name == "cpu_small_moe") {  // llama3 cpu_small's sizes (FFN 384)
    a.vocab_size = 2048, a.explicit_head_dim = 64;
    if (name == "cpu_small") dense(a, 128, 4, 4, 2, 384, false);
    else moe(a, 128, 4, 4, 2, 8, 2, 64);
  } else if (name == "debugmodel") {
    a.vocab_size = 2048;
    dense(a, 256, 8, 16, 8, 3072, true);
  } else if (name == "debugmodel_moe") {
    a.vocab_size = 2048;
    moe(a, 256, 8, 16, 8, 64, 8, 768);
  } else if (name == "0.6B") {
    dense(a, 1024, 28, 16, 8, 3072, true);
  } else if (name == "1.7B") {
    dense(a, 2048, 28, 16, 8, 6144, true);
  } else if (name == "4B") {
    dense(a, 2560, 36, 32, 8, 9728, true);
  } else if (name == "8B") {
    dense(a, 4096, 36, 32, 8, 12288, false);
  } else if (name == "14B") {
    dense(a, 5120, 40, 40, 8, 17408, false);
  } else if (name == "32B") {
    dense(a, 5120, 64, 64, 8, 25600, false);
  } else if (name == "30B-A3B") {
    moe(a, 2048, 48, 32, 4, 128, 8, 768);
  } else if (name == "235B-A22B") {
    moe(a, 4096, 94, 64, 4, 128, 8, 1536);
    a.rope_theta = 5e6;
  } else {
    std::string known;
    for (const auto& n : qwen3_flavor_names()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "unknown qwen3 flavor '", name, "' (known: ", known, ")");
  }
  return a;
}

std::vector<std::string> model_names() { return {"llama3", "qwen3"}; }

LlamaArgs model_flavor(const std::string& model_name, const std::string& flavor) {
  if (model_name == "llama3") return llama3_flavor(flavor);
  if (model_name == "qwen3") return qwen3_flavor(flavor);
  std::string known;
  for (const auto& n : model_names()) known += (known.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "unknown model '", model_name, "' (known: ", known, ")");
}

}  // namespace fsdp::models::llama
