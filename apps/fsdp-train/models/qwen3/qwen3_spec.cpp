// See qwen3_spec.h.
#include "qwen3_spec.h"

#include "models/llama3/decoder_spec.h"

#include <fsdp/models/hf_qwen3.h>
#include <fsdp/models/qwen3.h>

namespace fsdp_train::qwen3 {

TrainSpec train_spec() {
  return llama3::decoder_train_spec("qwen3", fsdp::models::llama::qwen3_flavor_names(), fsdp::models::hf::import_qwen3,
                                    fsdp::models::hf::export_qwen3);
}

}  // namespace fsdp_train::qwen3
