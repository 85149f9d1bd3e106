// fsdp-lighthouse: serves the c10d TCPStore in which fault-tolerant replica groups form their quorums
// (fsdp::ft::Manager, include/fsdp/fault_tolerance.h). A process of its own, apart from every replica group's
// fsdprun, so that no replica's failure takes the coordinator down; it keeps no state besides the store's keys.
//
//   fsdp-lighthouse [--host ADDR] [--port N] [--allow-any-interface] [limits: see usage()]
//
// Listens on ADDR only (default 127.0.0.1: a run on one machine). The store has no authentication — whoever reaches
// the port can read and rewrite every quorum — so a wildcard address (0.0.0.0, ::) is refused unless
// --allow-any-interface says it is meant. Port 0 = any free port; default 29510, torchft's. Prints
// "fsdp-lighthouse: serving on ADDR:PORT" once it accepts connections (what replicas put in FSDP_LIGHTHOUSE) and
// runs until SIGTERM or SIGINT, then exits 0.
//
// The clients' connections end in the framing relay (relay.h), which forwards only complete requests within the
// limits to c10d's server, listening on 127.0.0.1 on an ephemeral port of its own.

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "relay.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <sys/resource.h>
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
#include <thread>

namespace fsdp_lighthouse {
bool peer_names_are_numeric();  // numeric_peer_names.cpp
}

namespace {

constexpr const char* kUsage =
    "usage: fsdp-lighthouse [--host ADDR] [--port N] [--allow-any-interface] [--max-key-bytes N]\n"
    "                       [--max-value-bytes N] [--max-keys N] [--max-request-bytes N] [--max-connections N]\n"
    "                       [--max-unsent-reply-bytes N]\n"
    "  --host ADDR              listen on ADDR only (default 127.0.0.1); a wildcard needs --allow-any-interface\n"
    "  --port N                 0..65535, 0 = any free port (default 29510)\n"
    "Limits of the relay in front of the store (a client over one is disconnected with one log line, its request\n"
    "never reaches the store):\n"
    "  --max-key-bytes N        one key (default 8192, c10d's own limit)\n"
    "  --max-value-bytes N      one value (default 1048576)\n"
    "  --max-keys N             keys of one CHECK/WAIT/MULTI_GET/MULTI_SET (default 16384)\n"
    "  --max-request-bytes N    one request, buffered until complete (default 4194304)\n"
    "  --max-connections N      clients at once (default 1024)\n"
    "  --max-unsent-reply-bytes N  a client's replies it has not read: its requests wait above it (default 1048576)\n";

int usage(const std::string& why) {
  std::fprintf(stderr, "fsdp-lighthouse: %s\n%s", why.c_str(), kUsage);
  return 2;
}

// A positive integer flag value within [1, max].
bool parse_count(const std::string& text, uint64_t max, uint64_t& out) {
  if (text.empty() || text[0] == '-' || text[0] == '+') return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (*end != '\0' || errno != 0 || v == 0 || v > max) return false;
  out = v;
  return true;
}

// Each client costs three descriptors in this process (its socket, the relay's connection to the store and the
// store's end of it): raise the soft limit towards the hard one, and lower --max-connections if that is not enough.
size_t fit_connections(size_t wanted) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return wanted;
  const rlim_t needed = static_cast<rlim_t>(wanted) * 3 + 64;
  if (lim.rlim_cur < needed) {
    lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? needed : std::min<rlim_t>(needed, lim.rlim_max);
    setrlimit(RLIMIT_NOFILE, &lim);
    getrlimit(RLIMIT_NOFILE, &lim);
  }
  if (lim.rlim_cur >= needed) return wanted;
  const size_t fits = lim.rlim_cur > 3 * 64 ? static_cast<size_t>((lim.rlim_cur - 64) / 3) : 16;
  std::fprintf(stderr, "fsdp-lighthouse: warning: the descriptor limit (%llu) allows %zu connections, not "
                       "--max-connections %zu\n", static_cast<unsigned long long>(lim.rlim_cur), fits, wanted);
  return fits;
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
  fsdp_lighthouse::RelayLimits limits;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    // The limit flags: name, where the value goes, its upper bound.
    struct LimitFlag {
      const char* name;
      uint64_t max;
      uint64_t* value;
    };
    uint64_t max_connections = limits.max_connections, max_unsent = limits.max_unsent_reply_bytes;
    const LimitFlag flags[] = {
        {"--max-key-bytes", 1ull << 30, &limits.request.max_key_bytes},
        {"--max-value-bytes", 1ull << 32, &limits.request.max_value_bytes},
        {"--max-keys", 1ull << 24, &limits.request.max_keys},
        {"--max-request-bytes", 1ull << 34, &limits.request.max_request_bytes},
        {"--max-connections", 1ull << 20, &max_connections},
        {"--max-unsent-reply-bytes", 1ull << 34, &max_unsent},
    };
    const LimitFlag* flag = nullptr;
    for (const LimitFlag& f : flags) {
      if (arg == f.name) flag = &f;
    }
    if (flag != nullptr) {
      if (i + 1 >= argc) return usage(arg + " needs a value");
      const std::string value = argv[++i];
      if (!parse_count(value, flag->max, *flag->value)) {
        return usage("bad " + arg + " '" + value + "' (expected an integer in 1.." + std::to_string(flag->max) + ")");
      }
      limits.max_connections = static_cast<size_t>(max_connections);
      limits.max_unsent_reply_bytes = static_cast<size_t>(max_unsent);
    } else if ((arg == "--host" || arg == "--port") && i + 1 < argc) {
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
      std::printf("fsdp-lighthouse: the coordinator store of fault-tolerant replica groups\n%s", kUsage);
      return 0;
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
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
  const unsigned public_port = ntohs(local.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&local)->sin_port
                                                                : reinterpret_cast<sockaddr_in6*>(&local)->sin6_port);
  // c10d's server: on loopback, an ephemeral port only the relay is told (its own binding would take every
  // interface, so it gets a socket bound here).
  std::string store_bound;
  bool store_wildcard = false;
  const int store_fd = listen_on("127.0.0.1", 0, false, store_bound, store_wildcard, error);
  if (store_fd < 0) {
    close(fd);
    std::fprintf(stderr, "fsdp-lighthouse: the store's own socket: %s\n", error.c_str());
    return 1;
  }
  sockaddr_in store_addr{};
  len = sizeof store_addr;
  getsockname(store_fd, reinterpret_cast<sockaddr*>(&store_addr), &len);
  limits.max_connections = fit_connections(limits.max_connections);
  if (!fsdp_lighthouse::peer_names_are_numeric()) {
    std::fprintf(stderr, "fsdp-lighthouse: warning: the store may look up a host name for every connection on its "
                         "event loop (getnameinfo is not this executable's; see numeric_peer_names.cpp)\n");
  }
  // Block the stop signals before any thread exists (the store's and the relay's threads inherit the mask), then
  // wait for them synchronously: no handler, no flag.
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
    so.masterListenFd = store_fd;
    so.port = ntohs(store_addr.sin_port);
    c10d::TCPStore store("127.0.0.1", so);  // (the server side also connects to itself as a client)
    fsdp_lighthouse::Relay relay(fd, store_addr, limits);
    std::thread relay_thread([&relay] { relay.run(); });
    if (wildcard) {
      std::fprintf(stderr, "fsdp-lighthouse: warning: listening on every interface (--allow-any-interface): anyone who "
                           "reaches port %u can read and rewrite every quorum\n", public_port);
    }
    std::printf("fsdp-lighthouse: serving on %s:%u\n", bound.c_str(), public_port);
    std::fflush(stdout);
    int sig = 0;
    sigwait(&stop, &sig);
    std::printf("fsdp-lighthouse: %s, stopping\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    std::fflush(stdout);
    relay.stop();
    relay_thread.join();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-lighthouse: cannot serve on %s:%ld: %s\n", bound.c_str(), port, e.what());
    return 1;
  }
  return 0;
}
