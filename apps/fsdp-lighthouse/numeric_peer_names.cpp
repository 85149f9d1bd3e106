// No name lookups on the store's event loop.
//
// c10d's TCPStore server names every peer it accepts with getnameinfo(..., NI_NUMERICSERV) (c10d's socket.cpp,
// formatSockAddr: called by the libuv backend's UvTcpSocket::startRead and by the classic backend's accept, once per
// connection, whatever the log level). Without NI_NUMERICHOST that is a reverse DNS query, made on the server's one
// event-loop thread: with a resolver that is slow or unreachable every connection froze the lighthouse — and every
// fault-tolerant job waiting on it — for the resolver's timeout (200 connections opened and closed stalled it 20 s).
// Neither backend has an option to skip it, so the lighthouse defines getnameinfo itself: the dynamic linker binds
// libtorch's call to the executable's definition first (the symbol is exported, CMakeLists.txt), and this one asks
// the C library for the numeric form only, which never leaves the process. c10d prints the name only in its log
// lines; nothing else in the lighthouse needs a host name for a peer.

#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>

namespace {

using GetNameInfo = int (*)(const struct sockaddr*, socklen_t, char*, socklen_t, char*, socklen_t, int);

GetNameInfo next_getnameinfo() {
  // The next definition after this executable's in the lookup order: the C library's (or a preloaded one's).
  static const GetNameInfo next = reinterpret_cast<GetNameInfo>(dlsym(RTLD_NEXT, "getnameinfo"));
  return next;
}

}  // namespace

extern "C" int getnameinfo(const struct sockaddr* addr, socklen_t addr_len, char* host, socklen_t host_len,
                           char* serv, socklen_t serv_len, int flags) {
  const GetNameInfo next = next_getnameinfo();
  if (next == nullptr) return EAI_SYSTEM;
  // NI_NAMEREQD asks for a name or an error; a caller that insists on a name gets the error here.
  if (flags & NI_NAMEREQD) return EAI_NONAME;
  return next(addr, addr_len, host, host_len, serv, serv_len, flags | NI_NUMERICHOST | NI_NUMERICSERV);
}

namespace fsdp_lighthouse {

// Whether the process's lookups of getnameinfo (libtorch's among them) reach the definition above.
bool peer_names_are_numeric() {
  return reinterpret_cast<void*>(dlsym(RTLD_DEFAULT, "getnameinfo")) == reinterpret_cast<void*>(&::getnameinfo);
}

}  // namespace fsdp_lighthouse
