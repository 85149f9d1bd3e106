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

// Whether something at ipv4:port accepts a TCP connection now (closed at once).
inline bool accepts_connections(const std::string& ipv4, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ipv4.c_str(), &sa.sin_addr) != 1) return false;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

// Whether this process could bind ipv4:port (as rank 0 serving the store would have to).
inline bool can_bind(const std::string& ipv4, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ipv4.c_str(), &sa.sin_addr) != 1) return false;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
  if (fd >= 0) ::close(fd);
  return ok;
}

}  // namespace launcher_test
