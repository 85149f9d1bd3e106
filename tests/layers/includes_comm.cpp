// Layer probe (tests/layers/CMakeLists.txt): comm's own internal and public headers, with comm's flags.
#include "comm/process_group_impl.h"

#include <fsdp/process_group.h>

int layers_probe_comm() { return sizeof(fsdp::ProcessGroup) > 0 ? 0 : 1; }
