// See qwen3_spec.h.
#include "qwen3_spec.h"

#include "models/llama3/decoder_spec.h"

#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/llama.h>
#include <fsdp/models/qwen3.h>

namespace fsdp_train::qwen3 {
namespace {

fsdp::nn::llama::TransformerImpl& qwen3_of(torch::nn::Module& model, const char* what) {
  auto* m = dynamic_cast<fsdp::nn::llama::TransformerImpl*>(&model);
  TORCH_CHECK(m, what, ": the model is not a Qwen3 decoder (the qwen3 Hugging Face adapter's model)");
  return *m;
}

}  // namespace

TrainSpec train_spec() {
  HfAdapter hf;
  hf.import_weights = [](torch::nn::Module& model, const std::string& dir) {
    return fsdp::checkpoint::hf::import_qwen3(qwen3_of(model, "checkpoint.initial_load_in_hf"), dir);
  };
  hf.export_weights = [](torch::nn::Module& model, const std::string& dir,
                         const fsdp::checkpoint::SafetensorsExportOptions& options) {
    return fsdp::checkpoint::hf::export_qwen3(qwen3_of(model, "checkpoint.last_save_in_hf"), dir, options);
  };
  return llama3::decoder_train_spec("qwen3", fsdp::nn::llama::qwen3_flavor_names(), std::move(hf));
}

}  // namespace fsdp_train::qwen3
