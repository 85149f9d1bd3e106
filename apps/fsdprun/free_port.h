// Picks a free TCP port for rank 0's store in standalone mode.
#pragma once

#include <string>

namespace fsdprun {

// Binds port 0 on `addr`, reads back the port the kernel chose and releases it (torchrun --standalone does
// the same; the tiny window before rank 0 binds it again is accepted). Throws std::runtime_error on failure.
int find_free_port(const std::string& addr);

}  // namespace fsdprun
