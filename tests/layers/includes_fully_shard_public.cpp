// Layer probe (tests/layers/CMakeLists.txt): fully_shard's public header. Compiles with fully_shard's flags,
// not with those of a lower layer (comm).
#include <fsdp/fully_shard.h>

int layers_probe_public() { return sizeof(fsdp::FullyShardOptions) > 0 ? 0 : 1; }
