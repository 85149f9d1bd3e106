// See llama3_spec.h.
#include "llama3_spec.h"

#include "decoder_spec.h"

#include <fsdp/models/hf_llama.h>
#include <fsdp/models/llama.h>

namespace fsdp_train::llama3 {
namespace {

fsdp::nn::llama::TransformerImpl& llama_of(torch::nn::Module& model, const char* what) {
  auto* m = dynamic_cast<fsdp::nn::llama::TransformerImpl*>(&model);
  TORCH_CHECK(m, what, ": the model is not a Llama 3 decoder (the llama3 Hugging Face adapter's model)");
  return *m;
}

}  // namespace

TrainSpec train_spec() {
  HfAdapter hf;
  hf.import_weights = [](torch::nn::Module& model, const std::string& dir) {
    return fsdp::checkpoint::hf::import_llama(llama_of(model, "checkpoint.initial_load_in_hf"), dir);
  };
  hf.export_weights = [](torch::nn::Module& model, const std::string& dir,
                         const fsdp::checkpoint::SafetensorsExportOptions& options) {
    return fsdp::checkpoint::hf::export_llama(llama_of(model, "checkpoint.last_save_in_hf"), dir, options);
  };
  return decoder_train_spec("llama3", fsdp::nn::llama::llama3_flavor_names(), std::move(hf));
}

}  // namespace fsdp_train::llama3
