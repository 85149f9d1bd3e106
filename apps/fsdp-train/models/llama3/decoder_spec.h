#pragma once
// The model seam's entries (model_spec.h) for a family built on the Llama 3 decoder (fsdp::models::llama::Transformer):
// how to build, initialise, parallelize (parallelize_llama.h), split and TP-plan it. A family on this decoder
// gives its name, its flavors and its Hugging Face adapter functions; Llama 3 (llama3_spec.h) and Qwen3
// (../qwen3) do.

#include "model_spec.h"

#include <string>
#include <vector>

namespace fsdp::models::llama {
class TransformerImpl;
}  // namespace fsdp::models::llama

namespace fsdp_train::llama3 {

// A Hugging Face adapter's import / export of the decoder (fsdp/models/hf_llama.h, hf_qwen3.h).
using DecoderImport = fsdp::checkpoint::SafetensorsImportResult (*)(fsdp::models::llama::TransformerImpl&,
                                                                     const std::string&,
                                                                     const fsdp::checkpoint::SafetensorsImportOptions&);
using DecoderExport = fsdp::checkpoint::SafetensorsExportResult (*)(fsdp::models::llama::TransformerImpl&,
                                                                     const std::string&,
                                                                     const fsdp::checkpoint::SafetensorsExportOptions&);

TrainSpec decoder_train_spec(std::string name, std::vector<std::string> flavors, DecoderImport import_hf,
                             DecoderExport export_hf);

}  // namespace fsdp_train::llama3
