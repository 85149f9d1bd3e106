// The rendezvous store fsdprun serves in standalone mode, as torchrun's agent does: c10d's TCPStore, on a port the
// kernel picks, living in the launcher for one attempt. The ranks connect to it as clients (fsdprun sets
// TORCHELASTIC_USE_AGENT_STORE=True), so no rank has to bind a port the launcher chose earlier.
#pragma once

#include <memory>
#include <string>

namespace fsdprun {

class HostedStore {
 public:
  // Serves on `addr` only. Throws std::runtime_error naming the address when it cannot.
  explicit HostedStore(const std::string& addr);
  // Stops the server and closes its port: nothing of this attempt keeps listening.
  ~HostedStore();
  HostedStore(const HostedStore&) = delete;
  HostedStore& operator=(const HostedStore&) = delete;

  int port() const { return port_; }

 private:
  struct Server;  // c10d's TCPStore, kept out of this header (it brings libtorch's headers)
  std::unique_ptr<Server> server_;
  int port_ = 0;
};

}  // namespace fsdprun
