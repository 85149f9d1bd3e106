// fsdp-lighthouse: serves the c10d TCPStore in which fault-tolerant replica groups form their quorums
// (fsdp::ft::Manager, include/fsdp/fault_tolerance.h). A process of its own, apart from every replica group's
// fsdprun, so that no replica's failure takes the coordinator down; it keeps no state besides the store's keys.
//
//   fsdp-lighthouse [--host ADDR] [--port N]      (port 0 = any free port; default 29510, torchft's)
//
// Prints "fsdp-lighthouse: serving on HOST:PORT" once it accepts connections (what replicas put in FSDP_LIGHTHOUSE)
// and runs until SIGTERM or SIGINT, then exits 0.

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace {

int usage(const char* why) {
  std::fprintf(stderr, "fsdp-lighthouse: %s\nusage: fsdp-lighthouse [--host ADDR] [--port N]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1";  // what it prints for the replicas; c10d serves on every interface
  long port = 29510;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--host" || arg == "--port") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--host") {
        host = value;
      } else {
        char* end = nullptr;
        port = std::strtol(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || port < 0 || port > 65535) return usage(("bad --port '" + value + "'").c_str());
      }
    } else if (arg == "--help" || arg == "-h") {
      return usage("the coordinator store of fault-tolerant replica groups");
    } else {
      return usage(("unknown argument '" + arg + "'").c_str());
    }
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
    so.port = static_cast<std::uint16_t>(port);
    so.isServer = true;
    so.waitWorkers = false;  // replicas come and go; none is awaited
    c10d::TCPStore store(host, so);
    std::printf("fsdp-lighthouse: serving on %s:%u\n", host.c_str(), static_cast<unsigned>(store.getPort()));
    std::fflush(stdout);
    int sig = 0;
    sigwait(&stop, &sig);
    std::printf("fsdp-lighthouse: %s, stopping\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    std::fflush(stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-lighthouse: cannot serve on %s:%ld: %s\n", host.c_str(), port, e.what());
    return 1;
  }
  return 0;
}
