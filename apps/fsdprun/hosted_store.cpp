#include "hosted_store.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <stdexcept>

#include "free_port.h"
#include "signals.h"

namespace fsdprun {

struct HostedStore::Server {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

HostedStore::HostedStore(const std::string& addr) {
  ListeningSocket listener = listen_on_free_port(addr);
  port_ = listener.port;
  c10d::TCPStoreOptions so;
  so.isServer = true;
  so.port = static_cast<std::uint16_t>(listener.port);
  so.masterListenFd = listener.fd.get();  // bound to `addr` only; c10d takes it over (and closes it)
  so.waitWorkers = false;                 // the ranks are started after the store is up, and wait for each other
  so.timeout = std::chrono::seconds(30);  // the server's own client connecting to it, nothing else
  try {
    // The store's threads inherit this mask: the launcher's signals (SIGCHLD, SIGTERM, ...) go to its own loop
    // and never interrupt the server's event loop.
    const BlockAllSignals blocked;
    auto store = c10::make_intrusive<c10d::TCPStore>(addr, so);
    listener.fd.release();  // owned by the store now
    server_ = std::make_unique<Server>(Server{std::move(store)});
  } catch (const c10::Error& e) {
    throw std::runtime_error("cannot serve the rendezvous store on " + addr + ":" + std::to_string(port_) + ": " +
                             e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::runtime_error("cannot serve the rendezvous store on " + addr + ":" + std::to_string(port_) + ": " +
                             e.what());
  }
}

HostedStore::~HostedStore() = default;

}  // namespace fsdprun
