// Layer probe (tests/layers/CMakeLists.txt): fully_shard's internal header. Compiles with fully_shard's flags,
// not with those of a lower layer (comm).
#include "fully_shard/fsdp_state.h"

int layers_probe_internal() { return sizeof(fsdp::FSDPState) > 0 ? 0 : 1; }
