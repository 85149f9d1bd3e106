// Startup agreement through the rendezvous store (see launch_check.h).
#include "comm/launch_check.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <sstream>
#include <vector>

namespace fsdp::comm {
namespace {

constexpr const char* kOwnerKey = "fsdp/launch/run_id";

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> as_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// A value short enough for one error line: long values (model shape lists) show the first line that differs from
// `reference` with its line number.
std::string shown(const std::string& value, const std::string& reference) {
  if (value.size() <= 160 && value.find('\n') == std::string::npos) return "'" + value + "'";
  std::istringstream a(value), b(reference);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool ga = static_cast<bool>(std::getline(a, la));
    const bool gb = static_cast<bool>(std::getline(b, lb));
    if (!ga && !gb) return "'" + value.substr(0, 160) + "'";
    if (!ga || !gb || la != lb) {
      if (!ga) la = "<end>";
      if (la.size() > 160) la = la.substr(0, 160) + "...";
      return c10::str("line ", line, ": '", la, "'");
    }
  }
}

std::string key_of(const std::string& run_id, int64_t seq, int rank) {
  return c10::str("fsdp/launch/", run_id, "/check", seq, "/rank", rank);
}

// Waits for the keys; on timeout throws naming the ranks whose keys never appeared.
void wait_for_ranks(const StoreView& s, const std::string& what, const std::vector<std::string>& keys,
                    const std::vector<int>& ranks) {
  try {
    s.store->wait(keys, s.timeout);
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (size_t i = 0; i < keys.size(); ++i)
      if (!s.store->check({keys[i]})) missing.push_back(ranks[i]);
    TORCH_CHECK(false, "fsdp: launch check '", what, "' at ", s.endpoint, ": rank(s) ", c10::Join(", ", missing),
                " of ", s.world_size, " did not arrive within ", s.timeout.count(),
                " ms (not started, crashed, or started with a different MASTER_ADDR/MASTER_PORT)");
  }
}

}  // namespace

int listen_socket(const std::string& addr, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int gai = getaddrinfo(addr.c_str(), service.c_str(), &hints, &found);
  TORCH_CHECK(gai == 0 && found != nullptr, "fsdp: MASTER_ADDR '", addr, "' does not resolve: ", gai_strerror(gai));
  std::string errors;
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd, 2048) != 0) {
      errors += std::string(errors.empty() ? "" : "; ") + std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  TORCH_CHECK(fd >= 0, "fsdp: rank 0 cannot listen on MASTER_ADDR:MASTER_PORT = ", addr, ":", port, " (", errors,
              ")", errors.find("in use") != std::string::npos ? ": another job is using this port" : "");
  return fd;
}

void claim_or_check_run(const StoreView& s, const std::string& run_id) {
  if (s.rank == 0) {
    s.store->set(kOwnerKey, as_bytes(run_id));
    return;
  }
  wait_for_ranks(s, "run id", {kOwnerKey}, {0});
  const std::string owner = as_string(s.store->get(kOwnerKey));
  TORCH_CHECK(owner == run_id, "fsdp: rank ", s.rank, " refuses the rendezvous store at ", s.endpoint,
              ": it belongs to run '", owner, "' but this rank is in run '", run_id,
              "' — a second job is using the same MASTER_PORT (give each job its own port, or let fsdprun pick "
              "one; TORCHELASTIC_RUN_ID / fsdprun --rdzv-id names the run)");
}

void check_agreement(const StoreView& s, const std::string& run_id, int64_t seq, const std::string& what,
                     const std::string& value) {
  s.store->set(key_of(run_id, seq, s.rank), as_bytes(value));
  std::vector<int> ranks;
  if (s.rank == 0) {
    for (int r = 1; r < s.world_size; ++r) ranks.push_back(r);
  } else {
    ranks.push_back(0);
  }
  std::vector<std::string> keys;
  for (int r : ranks) keys.push_back(key_of(run_id, seq, r));
  if (keys.empty()) return;
  wait_for_ranks(s, what, keys, ranks);
  const std::vector<std::vector<uint8_t>> values = s.store->multiGet(keys);
  std::ostringstream diff;
  int differing = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string other = as_string(values[i]);
    if (other == value) continue;
    if (differing++ < 8) diff << "; rank " << ranks[i] << " has " << shown(other, value);
  }
  if (differing == 0) return;
  const std::string& reference = s.rank == 0 ? value : as_string(values[0]);
  TORCH_CHECK(false, "fsdp: launch mismatch detected at startup (rendezvous ", s.endpoint, "): ", what,
              " differs across ranks: rank ", s.rank, " has ", shown(value, reference), diff.str(),
              differing > 8 ? c10::str(" (and ", differing - 8, " more ranks)") : std::string(),
              ". Every rank must run the same program, configuration and world size.");
}

}  // namespace fsdp::comm
