// Fuzz target: the wire protocol of the c10d TCPStore as fsdp-lighthouse sees it — through its framing relay
// (apps/fsdp-lighthouse/relay.h, store_framing.h: our code, compiled here with the sanitizers and coverage) in front
// of c10d's own server. Each input is the byte stream of one client connection, checked two ways:
//  1. The relay's request framer (RequestFramer) against a reference framer written here the plain way (the whole
//     stream at once, recursive descent): the same request boundaries, commands and verdict (complete /
//     incomplete / refused), with the input fed to the framer in pieces whose sizes come from the input (as reads
//     would split it), under small limits so that each limit is reached. Every complete request is within
//     --max-request-bytes. A reply stream (the input again) through ReplyTracker must not crash it.
//  2. The bytes are sent to the relay in front of a running c10d server (one connection, half-closed, replies
//     drained, bounded in time). After every input a well-behaved client, connected through the relay for the whole
//     run, must still set and read its key within 5 s: a crash, a stall of the relay or the store, a lost key fails.
// The store is libtorch code (uninstrumented); the relay and the framer give libFuzzer its coverage.
#include "relay.h"
#include "store_framing.h"

#include <c10/util/Lazy.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

// A finding of this harness when it fed c10d's server directly (docs/reliability.md, "Fuzzing"): torch's libuv server
// leaks the 4 KiB read buffer of every connection it drops for a failing message (c10d::detail::UvTcpSocket::
// alloc_buffer; torch 2.13). The relay keeps malformed requests from it, but a well-formed one can still fail there
// (ADD to a value that is not a number), so LeakSanitizer is told to accept exactly that allocation site.
extern "C" const char* __lsan_default_suppressions() { return "leak:c10d::detail::UvTcpSocket::alloc_buffer\n"; }

namespace {

using Clock = std::chrono::steady_clock;
using fsdp_lighthouse::RequestFramer;
using fsdp_lighthouse::RequestLimits;

// Small limits, so that the fuzzer reaches each of them with short inputs.
RequestLimits fuzz_limits() {
  RequestLimits l;
  l.max_key_bytes = 64;
  l.max_value_bytes = 256;
  l.max_keys = 100;  // 100 keys' lengths alone fit in a request, 100 key/value pairs' do not
  l.max_request_bytes = 1024;
  return l;
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "store_wire: %s\n", what.c_str());
  __builtin_trap();
}

// ---- 1. the framer against a reference ----------------------------------------------------------------------------
enum class Verdict { kComplete, kNeedMore, kRefused };
struct Framing {
  std::vector<std::pair<size_t, uint8_t>> requests;  // (bytes, command) of each complete request
  Verdict last = Verdict::kComplete;                   // of what follows the last complete request
};

// The reference: each request parsed from its start over the whole stream, every rule stated once.
class ReferenceFramer {
 public:
  ReferenceFramer(const uint8_t* data, size_t size, const RequestLimits& l) : d_(data), n_(size), l_(l) {}

  Framing run() {
    Framing out;
    size_t start = 0;
    bool validated = false;
    while (start < n_) {
      at_ = start;
      const Verdict v = request(validated);
      if (v != Verdict::kComplete) {
        out.last = v;
        return out;
      }
      out.requests.emplace_back(at_ - start, d_[start]);
      validated = true;
      start = at_;
    }
    out.last = Verdict::kComplete;  // nothing after the last request (or an empty stream)
    return out;
  }

 private:
  // Reads an n-byte little-endian integer at at_ (n <= 8); false if the stream ends first.
  bool integer(int n, uint64_t& v) {
    if (n_ - at_ < static_cast<size_t>(n)) return false;
    v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | d_[at_ + i];
    at_ += n;
    return true;
  }
  // The request's bytes so far plus `more` stay within the limit.
  bool within(size_t start, uint64_t more) const { return (at_ - start) + more <= l_.max_request_bytes; }

  Verdict blob(size_t start, uint64_t limit) {  // a length, then that many bytes
    if (!within(start, 8)) return Verdict::kRefused;
    uint64_t len = 0;
    if (!integer(8, len)) return Verdict::kNeedMore;
    if (len > limit || !within(start, len)) return Verdict::kRefused;
    if (n_ - at_ < len) return Verdict::kNeedMore;
    at_ += len;
    return Verdict::kComplete;
  }
  Verdict fixed(size_t start, int width, uint64_t* value = nullptr) {
    if (!within(start, width)) return Verdict::kRefused;
    uint64_t v = 0;
    if (!integer(width, v)) return Verdict::kNeedMore;
    if (value) *value = v;
    return Verdict::kComplete;
  }

  Verdict request(bool validated) {
    const size_t start = at_;
    const uint8_t cmd = d_[at_++];
    if (validated == (cmd == 0)) return Verdict::kRefused;  // VALIDATE first, and only first
    const uint64_t K = l_.max_key_bytes, V = l_.max_value_bytes;
    Verdict v = Verdict::kComplete;
    auto then = [&](Verdict next) {
      if (v == Verdict::kComplete) v = next;
    };
    switch (cmd) {
      case 0: {  // VALIDATE: the magic number
        uint64_t magic = 0;
        v = fixed(start, 4, &magic);
        if (v == Verdict::kComplete && magic != 0x3C85F7CE) v = Verdict::kRefused;
        return v;
      }
      case 13: return fixed(start, 4);                                   // PING
      case 1: case 9: case 14: v = blob(start, K); then(blob(start, V)); return v;  // SET, APPEND, QUEUE_PUSH
      case 2: v = blob(start, K); then(blob(start, V)); then(blob(start, V)); return v;  // COMPARE_SET
      case 3: case 8: case 15: case 16: return blob(start, K);           // GET, DELETE_KEY, QUEUE_POP, QUEUE_LEN
      case 4: case 18: v = blob(start, K); then(fixed(start, 8)); return v;  // ADD, BARRIER
      case 7: case 12: case 17: return Verdict::kComplete;              // GETNUMKEYS, CANCEL_WAIT, LIST_KEYS
      case 5: case 6: case 10: case 11: {                               // CHECK, WAIT, MULTI_GET, MULTI_SET
        uint64_t count = 0;
        v = fixed(start, 8, &count);
        if (v != Verdict::kComplete) return v;
        const uint64_t per_key = cmd == 11 ? 16 : 8;
        if (count > l_.max_keys || !within(start, count * per_key)) return Verdict::kRefused;
        for (uint64_t i = 0; i < count && v == Verdict::kComplete; ++i) {
          v = blob(start, K);
          if (cmd == 11) then(blob(start, V));
        }
        return v;
      }
      default: return Verdict::kRefused;
    }
  }

  const uint8_t* d_;
  size_t n_;
  RequestLimits l_;
  size_t at_ = 0;
};

// The relay's way: bytes arrive in pieces; each piece is appended and the framer resumes.
Framing frame_in_pieces(const uint8_t* data, size_t size, const RequestLimits& limits, uint32_t seed) {
  Framing out;
  RequestFramer framer(limits);
  std::vector<uint8_t> buffered;
  size_t start = 0, fed = 0;
  while (true) {
    // The next piece: 1..64 bytes, or the rest.
    seed = seed * 1103515245u + 12345u;
    const size_t piece = (seed >> 16) % 8 == 0 ? size - fed : std::min<size_t>(size - fed, 1 + (seed >> 16) % 64);
    buffered.insert(buffered.end(), data + fed, data + fed + piece);
    fed += piece;
    while (true) {
      const auto status = framer.next(buffered.data() + start, buffered.size() - start);
      if (status == RequestFramer::Status::kRefused) {
        if (framer.error().empty()) fail("a refusal without a reason");
        out.last = Verdict::kRefused;
        return out;
      }
      if (status == RequestFramer::Status::kNeedMore) break;
      const size_t bytes = framer.request_bytes();
      if (bytes == 0 || bytes > buffered.size() - start) fail("a complete request outside the bytes received");
      if (bytes > limits.max_request_bytes) fail("a complete request over --max-request-bytes");
      out.requests.emplace_back(bytes, framer.command());
      start += bytes;
      framer.consumed();
    }
    if (fed == size) {
      out.last = start == size ? Verdict::kComplete : Verdict::kNeedMore;
      return out;
    }
  }
}

void check_framer(const uint8_t* data, size_t size) {
  const RequestLimits limits = fuzz_limits();
  const uint32_t seed = size > 0 ? data[size - 1] * 2654435761u + static_cast<uint32_t>(size) : 1;
  const Framing got = frame_in_pieces(data, size, limits, seed);
  const Framing want = ReferenceFramer(data, size, limits).run();
  if (got.requests != want.requests || got.last != want.last) {
    fail("the relay's framer (" + std::to_string(got.requests.size()) + " requests, verdict " +
         std::to_string(static_cast<int>(got.last)) + ") disagrees with the reference (" +
         std::to_string(want.requests.size()) + " requests, verdict " + std::to_string(static_cast<int>(want.last)) +
         ")");
  }
  // Replies: the same bytes as a reply stream to each framed request in turn (the store is trusted; this only
  // must not crash or hang the tracker).
  fsdp_lighthouse::ReplyTracker replies;
  for (const auto& [bytes, command] : got.requests) replies.expect(command, 2);
  replies.feed(data, size);
}

// ---- 2. the relay in front of c10d's server -----------------------------------------------------------------------
struct Server {
  std::unique_ptr<c10d::TCPStore> store;   // c10d's server, as fsdp-lighthouse opens it
  std::unique_ptr<fsdp_lighthouse::Relay> relay;
  std::thread relay_thread;
  uint16_t port = 0;                       // the relay's
  std::unique_ptr<c10d::TCPStore> client;  // the well-behaved client, through the relay
  int64_t inputs = 0;

  void stop() {
    client.reset();
    if (relay) {
      relay->stop();
      relay_thread.join();
      relay.reset();
    }
    store.reset();
  }
};

int listen_loopback(uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    fail(std::string("cannot listen on loopback: ") + std::strerror(errno));
  }
  port = ntohs(addr.sin_port);
  return fd;
}

void start(Server& s) {
  s.stop();
  uint16_t store_port = 0;
  const int store_fd = listen_loopback(store_port);
  c10d::TCPStoreOptions so;
  so.port = store_port;
  so.isServer = true;
  so.waitWorkers = false;
  so.masterListenFd = store_fd;
  s.store = std::make_unique<c10d::TCPStore>("127.0.0.1", so);
  sockaddr_in store_addr{};
  store_addr.sin_family = AF_INET;
  store_addr.sin_port = htons(store_port);
  store_addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  fsdp_lighthouse::RelayLimits limits;
  limits.request = fuzz_limits();
  limits.max_unsent_reply_bytes = 4096;
  // The relay logs one line per refused client: so many would drown the fuzzer's own output.
  static std::FILE* const quiet = std::getenv("STORE_WIRE_VERBOSE") ? stderr : std::fopen("/dev/null", "w");
  s.relay = std::make_unique<fsdp_lighthouse::Relay>(listen_loopback(s.port), store_addr, limits, quiet);
  s.relay_thread = std::thread([r = s.relay.get()] { r->run(); });
  c10d::TCPStoreOptions co;
  co.port = s.port;
  co.isServer = false;
  co.waitWorkers = false;
  co.timeout = std::chrono::seconds(5);
  s.client = std::make_unique<c10d::TCPStore>("127.0.0.1", co);
}

Server& server() {
  static Server s;
  static const bool once = [] {
    // As fsdp-lighthouse does: a write to a client already gone must not raise SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    // The store logs every failing message with a c10::Error; collecting its C++ backtrace each time would cost
    // more than the rest of the input.
    c10::SetStackTraceFetcher(
        []() -> c10::Backtrace { return std::make_shared<c10::PrecomputedLazyValue<std::string>>(std::string()); });
    std::atexit([] { s.stop(); });
    return true;
  }();
  (void)once;
  // Restarted every 5000 inputs: the keys the inputs set stay in the store's memory until then.
  if (!s.store || s.inputs++ % 5000 == 0) start(s);
  return s;
}

// One connection: send `data` (as far as the relay reads it within 1 s), half-close, drain replies (1 s).
void play(uint16_t port, const uint8_t* data, size_t size) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  auto left_ms = [&] {
    return static_cast<int>(std::max<int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return;
  }
  size_t sent = 0;
  while (sent < size && left_ms() > 0) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, left_ms()) <= 0) break;
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  char buf[4096];
  while (left_ms() > 0) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left_ms()) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) break;  // the relay closed the connection
  }
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_framer(data, size);
  Server& s = server();
  play(s.port, data, size);
  // The well-behaved client: a key no seed uses (an input would have to spell out its 23 bytes), set to a new
  // value and read back.
  static int64_t round = 0;
  const std::string value = std::to_string(++round);
  const std::string key = "fsdp-fuzz/health/7f3a9c";
  try {
    s.client->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    const auto got = s.client->get(key);
    if (std::string(got.begin(), got.end()) != value) fail("the store returned another value for the health key");
  } catch (const std::exception& e) {
    fail(std::string("the store no longer serves a well-behaved client through the relay: ") + e.what());
  }
  return 0;
}
