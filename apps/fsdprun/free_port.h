// A listening socket on a port the kernel picks, for the rendezvous store fsdprun serves in standalone mode.
#pragma once

#include <string>

#include "unique_fd.h"

namespace fsdprun {

struct ListeningSocket {
  UniqueFd fd;  // close-on-exec, so no rank inherits it
  int port = 0;
};

// Binds port 0 on `addr` only (not every interface) and listens. The socket stays open and is handed to the store,
// so no other process can take the port between choosing it and serving on it (probing a free port and binding it
// again later could: two launchers started at the same instant got the same port). Throws std::runtime_error naming
// the address.
ListeningSocket listen_on_free_port(const std::string& addr);

}  // namespace fsdprun
