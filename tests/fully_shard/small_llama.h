#pragma once
// The small Llama the meta-device init tests build twice (on the CPU as the reference, on the meta device to be
// sharded and materialized): uneven on purpose (dim 40, 53 rows of vocabulary) so shards are uneven on 2-4 ranks.
#include <fsdp/models/llama.h>

namespace fsdp_test {

inline fsdp::models::llama::LlamaArgs small_llama_args(c10::Device device) {
  fsdp::models::llama::LlamaArgs a;
  a.dim = 40;
  a.n_layers = 3;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 53;
  a.multiple_of = 16;
  a.device = device;
  return a;
}

}  // namespace fsdp_test
