// A stand-in for a slow or unreachable DNS resolver, for lighthouse_test.py (LD_PRELOAD): every getnameinfo call that
// asks for a host *name* (no NI_NUMERICHOST) sleeps SLOW_RESOLVER_SECONDS (default 2) first, as a reverse lookup
// does when the name server does not answer, then answers numerically. Each call appends "lookup" or "numeric" to
// the file SLOW_RESOLVER_LOG (when set), so the test can tell that the calls did reach it and what they asked for.

#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" int getnameinfo(const struct sockaddr* addr, socklen_t addr_len, char* host, socklen_t host_len,
                           char* serv, socklen_t serv_len, int flags) {
  using Fn = int (*)(const struct sockaddr*, socklen_t, char*, socklen_t, char*, socklen_t, int);
  static const Fn next = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "getnameinfo"));
  const bool lookup = host != nullptr && host_len > 0 && !(flags & NI_NUMERICHOST);
  if (const char* log = std::getenv("SLOW_RESOLVER_LOG")) {
    const int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      const char* line = lookup ? "lookup\n" : "numeric\n";
      (void)!write(fd, line, std::strlen(line));
      close(fd);
    }
  }
  if (lookup) {
    const char* s = std::getenv("SLOW_RESOLVER_SECONDS");
    const double seconds = s ? std::atof(s) : 2.0;
    usleep(static_cast<useconds_t>(seconds * 1e6));
  }
  if (next == nullptr) return EAI_SYSTEM;
  return next(addr, addr_len, host, host_len, serv, serv_len, flags | NI_NUMERICHOST);
}
