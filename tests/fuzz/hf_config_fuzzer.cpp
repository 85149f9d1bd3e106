// Fuzz target: a Hugging Face model directory as import_llama / import_qwen3 read it (config.json checked against
// the model, then model.safetensors). Input byte 0: bit 0 picks which file is the fuzz input (0: config.json,
// 1: model.safetensors) — the other one is a valid file of the same tiny model, written once by export_*; bit 1
// picks the model (0: Llama, 1: Qwen3). The rest is the file. A refused directory is the expected outcome; an
// accepted one has been loaded into the model.
//
// The readers' sources (hf_common, hf_llama, hf_qwen3, safetensors) are compiled into this target with the
// sanitizers; the rest of libfsdp (the model, model_safetensors) comes from the main build's libfsdp.so
// (tests/fuzz/CMakeLists.txt, FSDP_FUZZ_LIBFSDP), whose copies of those functions this executable overrides.
#include <fsdp/models/hf_llama.h>
#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>

#include <sys/stat.h>

#include <cstdint>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>

#include "fuzz_input.h"

namespace hf = fsdp::models::hf;
namespace llama = fsdp::models::llama;

namespace {

struct Tiny {
  llama::Transformer model{nullptr};
  std::string config, weights;  // a valid config.json and model.safetensors of this model
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Dimension 8, one layer, 2 heads (1 kv head), vocabulary 16: every tensor kind of the adapter, a few hundred
// bytes of weights.
Tiny make(bool qwen3) {
  llama::LlamaArgs a = qwen3 ? llama::qwen3_flavor("cpu_tiny") : llama::llama3_flavor("cpu_tiny");
  a.dim = 8, a.n_layers = 1, a.n_heads = 2, a.n_kv_heads = 1, a.vocab_size = 16, a.max_seq_len = 16;
  a.explicit_ffn_hidden = 16;
  if (qwen3) a.explicit_head_dim = 4;
  a.moe.reset();
  Tiny t;
  t.model = llama::Transformer(a);
  t.model->init_weights(1);
  const std::string dir = fsdp_fuzz::scratch_dir() + (qwen3 ? "/export_qwen3" : "/export_llama");
  if (qwen3) hf::export_qwen3(*t.model, dir);
  else hf::export_llama(*t.model, dir);
  t.config = slurp(dir + "/config.json");
  t.weights = slurp(dir + "/model.safetensors");
  return t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool fuzz_weights = data[0] & 1, qwen3 = data[0] & 2;
  static Tiny llama_model = make(false), qwen3_model = make(true);
  Tiny& t = qwen3 ? qwen3_model : llama_model;
  const std::string dir = fsdp_fuzz::scratch_dir() + "/import";
  static const int made = ::mkdir(dir.c_str(), 0755);
  (void)made;
  const auto* rest = data + 1;
  const size_t n = size - 1;
  const auto* fixed_config = reinterpret_cast<const uint8_t*>(t.config.data());
  const auto* fixed_weights = reinterpret_cast<const uint8_t*>(t.weights.data());
  fsdp_fuzz::write_scratch("import/config.json", fuzz_weights ? fixed_config : rest,
                           fuzz_weights ? t.config.size() : n);
  fsdp_fuzz::write_scratch("import/model.safetensors", fuzz_weights ? rest : fixed_weights,
                           fuzz_weights ? n : t.weights.size());
  try {
    if (qwen3) (void)hf::import_qwen3(*t.model, dir);
    else (void)hf::import_llama(*t.model, dir);
  } catch (const std::exception&) {
  }
  return 0;
}
