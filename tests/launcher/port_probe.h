// Probes of a TCP port on an IPv4 address, shared by the launcher tests and rank_behaviour: is the rendezvous store
// there, and could a rank still bind the port itself?
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace launcher_test {

// Applies `op` (::connect or ::bind) to a fresh TCP socket and ipv4:port; whether it succeeded. The socket is closed.
inline bool on_fresh_socket(const std::string& ipv4, int port, int (*op)(int, const sockaddr*, socklen_t)) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ipv4.c_str(), &sa.sin_addr) != 1) return false;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = fd >= 0 && op(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// Whether something at ipv4:port accepts a TCP connection now.
inline bool accepts_connections(const std::string& ipv4, int port) { return on_fresh_socket(ipv4, port, ::connect); }

// Whether this process could bind ipv4:port (as rank 0 serving the store would have to).
inline bool can_bind(const std::string& ipv4, int port) { return on_fresh_socket(ipv4, port, ::bind); }

}  // namespace launcher_test
