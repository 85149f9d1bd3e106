// Layer probe (tests/layers/CMakeLists.txt): fully_shard's internal header — the one src/nn/sequential.cpp used
// to include. Compiles with fully_shard's flags, not with those of a lower layer (comm).
#include "fully_shard/state_holder.h"

int layers_probe_internal() { return sizeof(fsdp::detail::FSDPStateHolder) > 0 ? 0 : 1; }
