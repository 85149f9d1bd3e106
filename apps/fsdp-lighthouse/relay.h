// fsdp-lighthouse's framing relay: the clients' connections end here, and only complete, well-formed requests within
// the limits reach c10d's TCPStore server behind it (on loopback, an ephemeral port). Why: c10d's libuv server keeps
// an unfinished request's bytes without bound and parses them again from the start at every 4 KiB read, so one
// client sending a large request held its event loop for a minute and stalled every other client (and it leaks
// 4 KiB per connection it drops for a malformed message). The relay frames requests incrementally
// (store_framing.h), bounds what each connection may hold in either direction, and closes a client that breaks a
// rule with one log line; c10d stays the store.
//
// One thread, epoll, non-blocking sockets. Each client gets its own upstream connection to the store, opened when
// the client is accepted; bytes flow: client -> framer -> upstream (one request with a reply in flight at a time, as
// c10d's own client does), upstream -> client unchanged.
#pragma once

#include "store_framing.h"

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>

namespace fsdp_lighthouse {

struct RelayLimits {
  RequestLimits request;
  size_t max_connections = 1024;
  // A client's replies not yet taken by it: over this, the relay stops reading its requests and its store replies.
  size_t max_unsent_reply_bytes = 1024 * 1024;
};

class Relay {
 public:
  // `listen_fd`: the listening socket clients connect to (taken over, closed by the relay); `store`: the address
  // of c10d's server; `log` gets one line per refused client. Throws std::runtime_error if epoll or the wake-up
  // eventfd cannot be created.
  Relay(int listen_fd, const sockaddr_in& store, const RelayLimits& limits, std::FILE* log = stderr);
  ~Relay();
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  void run();   // serves until stop()
  void stop();  // from any thread

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp_lighthouse
