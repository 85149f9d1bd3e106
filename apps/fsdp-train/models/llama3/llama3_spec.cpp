// See llama3_spec.h.
#include "llama3_spec.h"

#include "decoder_spec.h"

#include <fsdp/models/hf_llama.h>
#include <fsdp/models/llama.h>

namespace fsdp_train::llama3 {

TrainSpec train_spec() {
  return decoder_train_spec("llama3", fsdp::models::llama::llama3_flavor_names(), fsdp::models::hf::import_llama,
                            fsdp::models::hf::export_llama);
}

}  // namespace fsdp_train::llama3
