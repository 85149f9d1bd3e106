#include "relay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fsdp_lighthouse {
namespace {

constexpr size_t kReadChunk = 64 * 1024;  // bytes read per readiness event: each connection gets its turn
constexpr int kAcceptsPerWake = 64;

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Bytes waiting to be sent: appended at the back, sent from `sent`; compacted so that it never holds much more
// than what is unsent.
struct OutBuffer {
  std::vector<uint8_t> bytes;
  size_t sent = 0;
  size_t unsent() const { return bytes.size() - sent; }
  void append(const uint8_t* p, size_t n) { bytes.insert(bytes.end(), p, p + n); }
  void advance(size_t n) {
    sent += n;
    if (sent == bytes.size()) {
      bytes.clear();
      sent = 0;
    } else if (sent >= kReadChunk && sent * 2 >= bytes.size()) {
      bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(sent));
      sent = 0;
    }
  }
  void release() {  // give the memory back (after a large burst)
    if (bytes.empty() && bytes.capacity() > 4 * kReadChunk) std::vector<uint8_t>().swap(bytes);
  }
};

std::string peer_name(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "?";
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
    return std::string(text) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
    return "[" + std::string(text) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  return "?";
}

void no_delay(int fd) {
  const int on = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);  // small replies go out at once
}

bool would_block(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

}  // namespace

struct Relay::Impl {
  struct Conn {
    explicit Conn(const RequestLimits& limits) : framer(limits) {}
    uint64_t id = 0;
    Fd client, upstream;
    std::string peer;
    RequestFramer framer;
    ReplyTracker replies;
    std::vector<uint8_t> in;  // the client's bytes not forwarded yet, from `in_start` (a request boundary)
    size_t in_start = 0;
    OutBuffer to_upstream, to_client;
    bool connected = false;    // the upstream connect() completed
    bool client_gone = false;  // EOF from the client: what it sent is forwarded, then the pair is closed
    uint32_t client_events = 0, upstream_events = 0;  // the epoll interest registered
    size_t in_unforwarded() const { return in.size() - in_start; }
  };

  Impl(int listen_fd, const sockaddr_in& store, const RelayLimits& limits, std::FILE* log)
      : listener(listen_fd), store(store), limits(limits), log(log) {
    epoll = Fd(epoll_create1(EPOLL_CLOEXEC));
    wake = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll || !wake) throw std::runtime_error(std::string("relay: epoll/eventfd: ") + std::strerror(errno));
    // Non-blocking: a client that resets between the readiness and accept() must not block the loop.
    ::fcntl(listener.get(), F_SETFL, ::fcntl(listener.get(), F_GETFL, 0) | O_NONBLOCK);
    add(listener.get(), EPOLLIN, kListenerTag);
    add(wake.get(), EPOLLIN, kWakeTag);
  }

  static constexpr uint64_t kListenerTag = 1, kWakeTag = 2;  // connection tags are (id << 1) | side, id >= 2
  static uint64_t tag(uint64_t id, bool upstream) { return (id << 1) | (upstream ? 1 : 0); }

  void add(int fd, uint32_t events, uint64_t data) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = data;
    epoll_ctl(epoll.get(), EPOLL_CTL_ADD, fd, &ev);
  }
  void modify(int fd, uint32_t& current, uint32_t wanted, uint64_t data) {
    if (current == wanted) return;
    epoll_event ev{};
    ev.events = wanted;
    ev.data.u64 = data;
    epoll_ctl(epoll.get(), EPOLL_CTL_MOD, fd, &ev);
    current = wanted;
  }

  void log_close(const Conn& c, const std::string& why) {
    std::fprintf(log, "fsdp-lighthouse: closed the connection from %s: %s\n", c.peer.c_str(), why.c_str());
  }

  void accept_clients();
  void open(Fd client);
  void close(uint64_t id) { conns.erase(id); }
  void on_event(uint64_t data, uint32_t events);
  // Moves what can move for `c` (forward requests, send, receive) and sets its epoll interest. Returns false when
  // the connection pair is to be closed.
  bool pump(Conn& c);
  bool forward_requests(Conn& c);
  bool flush(int fd, OutBuffer& out);

  Fd listener;
  sockaddr_in store;
  RelayLimits limits;
  std::FILE* log;
  Fd epoll, wake;
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns;
  uint64_t next_id = 2;
  bool listening = true;
  std::chrono::steady_clock::time_point listen_again{};
  bool stopping = false;
};

void Relay::Impl::accept_clients() {
  for (int i = 0; i < kAcceptsPerWake; ++i) {
    const int fd = accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Out of descriptors: stop accepting for a moment rather than spin on a listener that stays readable.
        std::fprintf(log, "fsdp-lighthouse: cannot accept a connection (%s): pausing accepts for 100 ms\n",
                     std::strerror(errno));
        uint32_t current = EPOLLIN;
        modify(listener.get(), current, 0, kListenerTag);
        listening = false;
        listen_again = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      }
      return;  // EAGAIN: none left; others (ECONNABORTED, ...): that one client's problem
    }
    Fd client(fd);
    if (conns.size() >= limits.max_connections) {
      std::fprintf(log, "fsdp-lighthouse: refused the connection from %s: --max-connections (%zu) reached\n",
                   peer_name(fd).c_str(), limits.max_connections);
      continue;
    }
    open(std::move(client));
  }
}

void Relay::Impl::open(Fd client) {
  auto c = std::make_unique<Conn>(limits.request);
  c->id = next_id++;
  c->peer = peer_name(client.get());
  no_delay(client.get());
  c->upstream = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!c->upstream) {
    log_close(*c, std::string("cannot open a connection to the store: ") + std::strerror(errno));
    return;
  }
  no_delay(c->upstream.get());
  if (::connect(c->upstream.get(), reinterpret_cast<const sockaddr*>(&store), sizeof store) == 0) {
    c->connected = true;
  } else if (errno != EINPROGRESS) {
    log_close(*c, std::string("cannot connect to the store: ") + std::strerror(errno));
    return;
  }
  c->client = std::move(client);
  add(c->client.get(), 0, tag(c->id, false));
  add(c->upstream.get(), 0, tag(c->id, true));
  Conn& ref = *c;
  conns.emplace(c->id, std::move(c));
  if (!pump(ref)) close(ref.id);
}

bool Relay::Impl::flush(int fd, OutBuffer& out) {
  while (out.unsent() > 0) {
    const ssize_t n = ::send(fd, out.bytes.data() + out.sent, out.unsent(), MSG_NOSIGNAL);
    if (n < 0) {
      if (would_block(errno)) return true;
      return false;
    }
    out.advance(static_cast<size_t>(n));
  }
  out.release();
  return true;
}

// Forwards the client's complete requests while the rules allow: none while a reply is awaited (but CANCEL_WAIT
// after a WAIT), none while the client has too many reply bytes unsent or the store has not taken the last ones.
bool Relay::Impl::forward_requests(Conn& c) {
  while (true) {
    const auto status = c.framer.next(c.in.data() + c.in_start, c.in_unforwarded());
    if (status == RequestFramer::Status::kRefused) {
      log_close(c, c.framer.error());
      return false;
    }
    if (status == RequestFramer::Status::kNeedMore) break;
    const uint8_t command = c.framer.command();
    const bool cancel = command == static_cast<uint8_t>(StoreCommand::kCancelWait);
    if (c.replies.awaiting() && !(cancel && c.replies.wait_pending())) break;
    if (c.to_client.unsent() >= limits.max_unsent_reply_bytes) break;
    if (c.to_upstream.unsent() >= limits.request.max_request_bytes) break;
    const size_t bytes = c.framer.request_bytes();
    c.to_upstream.append(c.in.data() + c.in_start, bytes);
    c.in_start += bytes;
    c.replies.expect(command, c.framer.key_count());
    c.framer.consumed();
  }
  // Keep `in` from holding much more than the unforwarded bytes.
  if (c.in_start == c.in.size()) {
    c.in.clear();
    c.in_start = 0;
    if (c.in.capacity() > 4 * kReadChunk) std::vector<uint8_t>().swap(c.in);
  } else if (c.in_start >= kReadChunk && c.in_start * 2 >= c.in.size()) {
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(c.in_start));
    c.in_start = 0;
  }
  return true;
}

bool Relay::Impl::pump(Conn& c) {
  if (!forward_requests(c)) return false;
  if (c.connected && !flush(c.upstream.get(), c.to_upstream)) return false;  // the store went away
  if (c.client_gone) {
    // Everything the client sent that can be forwarded is; close once the store has it.
    if (c.to_upstream.unsent() == 0) return false;
    modify(c.upstream.get(), c.upstream_events, EPOLLOUT, tag(c.id, true));
    return true;
  }
  if (!flush(c.client.get(), c.to_client)) return false;
  const bool replies_room = c.to_client.unsent() < limits.max_unsent_reply_bytes;
  // The client's requests are read while there is room for one more request beyond a held one and its replies
  // are being taken; the store's replies while the client takes them.
  const bool read_client = replies_room && c.in_unforwarded() < limits.request.max_request_bytes + kReadChunk;
  const uint32_t in = EPOLLIN, out = EPOLLOUT, none = 0;
  const uint32_t client_wanted = (read_client ? in : none) | (c.to_client.unsent() > 0 ? out : none);
  const uint32_t upstream_wanted = (replies_room ? in : none) | (!c.connected || c.to_upstream.unsent() > 0 ? out : none);
  modify(c.client.get(), c.client_events, client_wanted, tag(c.id, false));
  modify(c.upstream.get(), c.upstream_events, upstream_wanted, tag(c.id, true));
  return true;
}

void Relay::Impl::on_event(uint64_t data, uint32_t events) {
  const uint64_t id = data >> 1;
  const bool upstream_side = data & 1;
  const auto it = conns.find(id);
  if (it == conns.end()) return;  // closed earlier in this batch
  Conn& c = *it->second;
  uint8_t chunk[kReadChunk];
  if (upstream_side) {
    if (!c.connected && (events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(c.upstream.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        log_close(c, std::string("cannot connect to the store: ") + std::strerror(err));
        return close(id);
      }
      c.connected = true;
    }
    const bool room = !c.client_gone && c.to_client.unsent() < limits.max_unsent_reply_bytes;
    if ((events & (EPOLLHUP | EPOLLERR)) && !room) return close(id);  // not read again: it would keep reporting
    if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && room) {
      const ssize_t n = ::recv(c.upstream.get(), chunk, sizeof chunk, 0);
      if (n == 0 || (n < 0 && !would_block(errno))) {
        // The store closed this client's connection (c10d drops a client whose request fails, e.g. ADD on a
        // value that is not a number): pass on what it answered, then close.
        flush(c.client.get(), c.to_client);
        return close(id);
      }
      if (n > 0) {
        c.to_client.append(chunk, static_cast<size_t>(n));
        c.replies.feed(chunk, static_cast<size_t>(n));
      }
    }
  } else if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
    const size_t room = limits.request.max_request_bytes + kReadChunk - std::min(c.in_unforwarded(),
                                                                                limits.request.max_request_bytes + kReadChunk);
    const ssize_t n = room == 0 ? -2 : ::recv(c.client.get(), chunk, std::min(room, sizeof chunk), 0);
    // (A hang-up while nothing more is read: the client can take no reply either.)
    const bool hung_up = room == 0 && (events & (EPOLLHUP | EPOLLERR));
    if (n == 0 || (n == -1 && !would_block(errno)) || hung_up) {
      c.client_gone = true;
      epoll_ctl(epoll.get(), EPOLL_CTL_DEL, c.client.get(), nullptr);
      c.client.reset();
      c.to_client = OutBuffer();
    } else if (n > 0) {
      c.in.insert(c.in.end(), chunk, chunk + n);
    }
  }
  if (!pump(c)) close(id);
}

Relay::Relay(int listen_fd, const sockaddr_in& store, const RelayLimits& limits, std::FILE* log)
    : impl_(std::make_unique<Impl>(listen_fd, store, limits, log)) {}

Relay::~Relay() = default;

void Relay::stop() {
  const uint64_t one = 1;
  const ssize_t n = ::write(impl_->wake.get(), &one, sizeof one);
  (void)n;
}

void Relay::run() {
  Impl& r = *impl_;
  std::vector<epoll_event> events(256);
  while (!r.stopping) {
    int timeout_ms = -1;
    if (!r.listening) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(r.listen_again -
                                                                              std::chrono::steady_clock::now());
      timeout_ms = static_cast<int>(std::max<int64_t>(0, left.count()));
    }
    const int n = epoll_wait(r.epoll.get(), events.data(), static_cast<int>(events.size()), timeout_ms);
    if (n < 0 && errno != EINTR) {
      std::fprintf(r.log, "fsdp-lighthouse: relay: epoll_wait: %s\n", std::strerror(errno));
      return;
    }
    if (!r.listening && std::chrono::steady_clock::now() >= r.listen_again) {
      uint32_t current = 0;
      r.modify(r.listener.get(), current, EPOLLIN, Impl::kListenerTag);
      r.listening = true;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t data = events[i].data.u64;
      if (data == Impl::kWakeTag) {
        r.stopping = true;
      } else if (data == Impl::kListenerTag) {
        if (r.listening) r.accept_clients();
      } else {
        r.on_event(data, events[i].events);
      }
    }
  }
  r.conns.clear();
}

}  // namespace fsdp_lighthouse
