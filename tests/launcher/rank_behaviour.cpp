// Test helper started by fsdprun in tests/launcher: one process per rank whose behaviour is chosen per rank.
//
//   rank_behaviour DIR SPEC...     SPEC = "<rank>:<action>[,<action>...]" or "*:<actions>"
//
// A rank runs the actions of the spec naming its RANK, else those of "*", then exits 0. Arguments that are not
// specs are ignored (the "args" action prints them). On start it writes DIR/start.r<R>.a<A> holding its pid
// (A = TORCHELASTIC_RESTART_COUNT), so tests can count starts and check that every process is gone.
//
// Actions:
//   env            print the launcher's variables as KEY=VALUE on stdout, "stderr of rank R" on stderr
//   args           print argv as "arg[i]=..." lines
//   partial=TEXT   write TEXT to stdout without a newline
//   exit=N         exit with code N
//   abort          abort() (SIGABRT)
//   segv           write through a null pointer (SIGSEGV)
//   signal=N       raise signal N on itself
//   hang           sleep forever
//   sleep=MS       sleep MS milliseconds
//   grandchild     fork a child that sleeps forever; its pid goes to DIR/grandchild.r<R>.a<A>
//   ready          create DIR/ready.r<R>.a<A>
//   await=N        wait (at most 10 s) until N ready.*.a<A> files exist in DIR
//   trap           on SIGINT/SIGTERM/SIGHUP create DIR/sig<N>.r<R>.a<A> and exit 128+N
//   ignore_term    ignore SIGTERM (so only SIGKILL stops the rank)
//   succeed_from=A exit 0 if TORCHELASTIC_RESTART_COUNT >= A, else exit 1
//   store          probe the rendezvous port (an IPv4 MASTER_ADDR) and write DIR/store.r<R>.a<A>:
//                  "port=P listening=L bindable=B sockets=S[ previous_listening=Q]": L = 1 if a TCP connect to
//                  MASTER_ADDR:MASTER_PORT succeeds, B = 1 if this process could bind that port itself, S = sockets
//                  among its open descriptors before probing (inherited ones), Q = L for the port the same rank
//                  wrote at attempt A-1
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "port_probe.h"

namespace {

struct Context {
  std::string dir;
  int rank = -1;
  int attempt = 0;
  std::string tag() const { return ".r" + std::to_string(rank) + ".a" + std::to_string(attempt); }
  std::string path(const std::string& name) const { return dir + "/" + name + tag(); }
};

void write_file(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    std::perror(tmp.c_str());
    std::exit(90);
  }
  std::fputs(content.c_str(), f);
  std::fclose(f);
  std::rename(tmp.c_str(), path.c_str());  // readers never see a half-written pid
}

int count_files(const std::string& dir, const std::string& prefix, const std::string& suffix) {
  int n = 0;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() >= prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      ++n;
  }
  ::closedir(d);
  return n;
}

[[noreturn]] void hang() {
  for (;;) ::pause();
}

// Signal marker paths, prepared before the handler can run (a handler may only use async-signal-safe calls).
char g_marker_path[3][4096];
constexpr int kTrapped[3] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void on_trapped(int sig) {
  for (int i = 0; i < 3; ++i) {
    if (kTrapped[i] != sig) continue;
    const int fd = ::open(g_marker_path[i], O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) ::close(fd);
  }
  ::_exit(128 + sig);
}

void trap(const Context& ctx) {
  for (int i = 0; i < 3; ++i) {
    const std::string p = ctx.path("sig" + std::to_string(kTrapped[i]));
    std::snprintf(g_marker_path[i], sizeof g_marker_path[i], "%s", p.c_str());
    struct sigaction sa {};
    sa.sa_handler = on_trapped;
    sigemptyset(&sa.sa_mask);
    ::sigaction(kTrapped[i], &sa, nullptr);
  }
}

int open_sockets() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (const dirent* e = ::readdir(d)) {
    char target[256];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t len = ::readlink(link.c_str(), target, sizeof target - 1);
    if (len > 0 && std::string(target, static_cast<std::size_t>(len)).rfind("socket:", 0) == 0) ++n;
  }
  ::closedir(d);
  return n;
}

void probe_store(const Context& ctx) {
  const int sockets = open_sockets();
  const char* addr_text = std::getenv("MASTER_ADDR");
  const char* port_text = std::getenv("MASTER_PORT");
  const std::string addr = addr_text != nullptr ? addr_text : "";
  const int port = port_text != nullptr ? std::atoi(port_text) : 0;
  std::ostringstream line;
  line << "port=" << port << " listening=" << launcher_test::accepts_connections(addr, port)
       << " bindable=" << launcher_test::can_bind(addr, port) << " sockets=" << sockets;
  if (ctx.attempt > 0) {
    std::ifstream previous(ctx.dir + "/store.r" + std::to_string(ctx.rank) + ".a" + std::to_string(ctx.attempt - 1));
    std::string word;
    if (previous >> word && word.rfind("port=", 0) == 0)
      line << " previous_listening=" << launcher_test::accepts_connections(addr, std::atoi(word.c_str() + 5));
  }
  write_file(ctx.path("store"), line.str());
}

void print_env(const Context& ctx) {
  for (const char* key : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                          "OMP_NUM_THREADS"}) {
    const char* v = std::getenv(key);
    std::cout << key << "=" << (v != nullptr ? v : "<unset>") << "\n";
  }
  std::cout << std::flush;
  std::cerr << "stderr of rank " << ctx.rank << std::endl;
}

void run_action(const Context& ctx, const std::string& action, int argc, char** argv) {
  const auto eq = action.find('=');
  const std::string name = action.substr(0, eq);
  const std::string arg = eq == std::string::npos ? "" : action.substr(eq + 1);
  if (name == "env") {
    print_env(ctx);
  } else if (name == "args") {
    for (int i = 0; i < argc; ++i) std::cout << "arg[" << i << "]=" << argv[i] << "\n";
    std::cout << std::flush;
  } else if (name == "partial") {
    std::cout << arg << std::flush;
  } else if (name == "exit") {
    std::cout << std::flush;
    std::exit(std::atoi(arg.c_str()));
  } else if (name == "abort") {
    std::abort();
  } else if (name == "segv") {
    volatile int* null = nullptr;
    *null = 1;
  } else if (name == "signal") {
    std::raise(std::atoi(arg.c_str()));
  } else if (name == "hang") {
    hang();
  } else if (name == "sleep") {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(arg.c_str())));
  } else if (name == "grandchild") {
    const pid_t pid = ::fork();
    if (pid == 0) {
      for (int sig : kTrapped) ::signal(sig, SIG_DFL);  // the grandchild must not write the rank's markers
      hang();
    }
    write_file(ctx.path("grandchild"), std::to_string(pid));
  } else if (name == "ready") {
    write_file(ctx.path("ready"), "");
  } else if (name == "await") {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    const std::string suffix = ".a" + std::to_string(ctx.attempt);
    while (count_files(ctx.dir, "ready.", suffix) < std::atoi(arg.c_str())) {
      if (std::chrono::steady_clock::now() > give_up) {
        std::cerr << "await: timed out" << std::endl;
        std::exit(91);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  } else if (name == "trap") {
    trap(ctx);
  } else if (name == "ignore_term") {
    ::signal(SIGTERM, SIG_IGN);
  } else if (name == "store") {
    probe_store(ctx);
  } else if (name == "succeed_from") {
    std::exit(ctx.attempt >= std::atoi(arg.c_str()) ? 0 : 1);
  } else {
    std::cerr << "rank_behaviour: unknown action '" << action << "'" << std::endl;
    std::exit(92);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: rank_behaviour DIR SPEC..." << std::endl;
    return 93;
  }
  // Crashes are intended here; do not spend seconds writing core files.
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);

  Context ctx;
  ctx.dir = argv[1];
  const char* rank = std::getenv("RANK");
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  ctx.rank = rank != nullptr ? std::atoi(rank) : -1;
  ctx.attempt = attempt != nullptr ? std::atoi(attempt) : 0;
  write_file(ctx.path("start"), std::to_string(::getpid()));

  std::string actions;
  for (int i = 2; i < argc; ++i) {
    const std::string spec = argv[i];
    const auto colon = spec.find(':');
    if (colon == std::string::npos) continue;
    const std::string who = spec.substr(0, colon);
    if (who == std::to_string(ctx.rank)) {
      actions = spec.substr(colon + 1);
      break;  // a rank's own spec wins over "*"
    }
    if (who == "*") actions = spec.substr(colon + 1);
  }
  std::stringstream list(actions);
  for (std::string action; std::getline(list, action, ',');)
    if (!action.empty()) run_action(ctx, action, argc, argv);
  return 0;
}
