// fsdp-lighthouse: serves the c10d TCPStore in which fault-tolerant replica groups form their quorums
// (fsdp::ft::Manager, include/fsdp/fault_tolerance.h). A process of its own, apart from every replica group's
// fsdprun, so that no replica's failure takes the coordinator down; it keeps no state besides the store's keys.
//
//   fsdp-lighthouse [--host ADDR] [--port N] [--allow-any-interface]
//
// Listens on ADDR only (default 127.0.0.1: a run on one machine). The store has no authentication — whoever reaches
// the port can read and rewrite every quorum — so a wildcard address (0.0.0.0, ::) is refused unless
// --allow-any-interface says it is meant. Port 0 = any free port; default 29510, torchft's. Prints
// "fsdp-lighthouse: serving on ADDR:PORT" once it accepts connections (what replicas put in FSDP_LIGHTHOUSE) and
// runs until SIGTERM or SIGINT, then exits 0.

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

namespace fsdp_lighthouse {
bool peer_names_are_numeric();  // numeric_peer_names.cpp
}

namespace {

int usage(const std::string& why) {
  std::fprintf(stderr, "fsdp-lighthouse: %s\nusage: fsdp-lighthouse [--host ADDR] [--port N] [--allow-any-interface]\n",
               why.c_str());
  return 2;
}

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};

bool is_wildcard(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (sa->sa_family == AF_INET6) {
    return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  }
  return false;
}

std::string numeric_host(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = sa->sa_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(sa)->sin_addr)
                                             : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  return inet_ntop(sa->sa_family, raw, text, sizeof text) ? text : "?";
}

// A listening socket bound to `host` (a numeric address or a name, resolved here, once, before serving) and `port`.
// Returns the descriptor, or -1 with `error` saying why; `bound` gets the address it listens on.
int listen_on(const std::string& host, long port, bool allow_any, std::string& bound, bool& wildcard,
              std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    error = "--host '" + host + "' is not an address of this machine: " + gai_strerror(rc);
    return -1;
  }
  std::unique_ptr<addrinfo, AddrInfoDeleter> list(found);
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (is_wildcard(a->ai_addr) && !allow_any) {
      error = "--host '" + host + "' listens on every interface, and anyone who reaches the port can read and rewrite "
              "every quorum (the store has no authentication): give this machine's address on the replicas' network, "
              "or pass --allow-any-interface if every interface is meant";
      return -1;
    }
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      error = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    const int on = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);  // a restarted lighthouse gets its port back at once
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
      error = "cannot listen on " + numeric_host(a->ai_addr) + ":" + service + ": " + std::strerror(errno);
      close(fd);
      continue;
    }
    bound = numeric_host(a->ai_addr);
    wildcard = is_wildcard(a->ai_addr);
    return fd;
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";
  long port = 29510;
  bool allow_any = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--host" || arg == "--port") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--host") {
        if (value.empty()) return usage("--host needs an address");
        host = value;
      } else {
        char* end = nullptr;
        errno = 0;
        port = std::strtol(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || errno != 0 || port < 0 || port > 65535) {
          return usage("bad --port '" + value + "' (expected 0..65535)");
        }
      }
    } else if (arg == "--allow-any-interface") {
      allow_any = true;
    } else if (arg == "--help" || arg == "-h") {
      return usage("the coordinator store of fault-tolerant replica groups");
    } else {
      return usage("unknown argument '" + arg + "'");
    }
  }
  std::string bound, error;
  bool wildcard = false;
  const int fd = listen_on(host, port, allow_any, bound, wildcard, error);
  if (fd < 0) {
    std::fprintf(stderr, "fsdp-lighthouse: %s\n", error.c_str());
    return 2;
  }
  if (!fsdp_lighthouse::peer_names_are_numeric()) {
    std::fprintf(stderr, "fsdp-lighthouse: warning: the store may look up a host name for every connection on its "
                         "event loop (getnameinfo is not this executable's; see numeric_peer_names.cpp)\n");
  }
  // Block the stop signals before any thread exists (the store's server threads inherit the mask), then wait for
  // them synchronously: no handler, no flag.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  // The store's libuv server writes replies with write(): a client gone before its reply (closed after sending,
  // found by tests/fuzz store_wire) raised SIGPIPE and killed the lighthouse. Ignored: the write fails instead.
  std::signal(SIGPIPE, SIG_IGN);
  try {
    c10d::TCPStoreOptions so;
    so.isServer = true;
    so.waitWorkers = false;  // replicas come and go; none is awaited
    so.masterListenFd = fd;  // c10d serves on the socket bound above (its own binding would take every interface)
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
    so.port = ntohs(local.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&local)->sin_port
                                               : reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
    // The server side of a TCPStore also connects to it as a client: through loopback when every interface is served.
    const std::string self = wildcard ? (local.ss_family == AF_INET6 ? "::1" : "127.0.0.1") : bound;
    c10d::TCPStore store(self, so);
    if (wildcard) {
      std::fprintf(stderr, "fsdp-lighthouse: warning: listening on every interface (--allow-any-interface): anyone who "
                           "reaches port %u can read and rewrite every quorum\n", static_cast<unsigned>(so.port));
    }
    std::printf("fsdp-lighthouse: serving on %s:%u\n", bound.c_str(), static_cast<unsigned>(so.port));
    std::fflush(stdout);
    int sig = 0;
    sigwait(&stop, &sig);
    std::printf("fsdp-lighthouse: %s, stopping\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    std::fflush(stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-lighthouse: cannot serve on %s:%ld: %s\n", bound.c_str(), port, e.what());
    return 1;
  }
  return 0;
}
