#include "free_port.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstring>
#include <memory>
#include <stdexcept>

namespace fsdprun {
namespace {

int port_of(const sockaddr_storage& bound) {
  if (bound.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  if (bound.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port);
  return 0;
}

}  // namespace

ListeningSocket listen_on_free_port(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), "0", &hints, &found);
  if (rc != 0)
    throw std::runtime_error("cannot resolve --master-addr '" + addr + "': " + ::gai_strerror(rc));
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> list(found, &::freeaddrinfo);

  std::string last_error = "no address";
  for (const addrinfo* ai = list.get(); ai != nullptr; ai = ai->ai_next) {
    UniqueFd sock(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    // The backlog of c10d's own listener: every rank of a large node connects at once.
    if (!sock.valid() || ::bind(sock.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(sock.get(), 2048) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int port = port_of(bound);
    if (port != 0) return ListeningSocket{std::move(sock), port};
    last_error = "not an IP address";
  }
  throw std::runtime_error("cannot listen on --master-addr '" + addr + "': " + last_error);
}

}  // namespace fsdprun
