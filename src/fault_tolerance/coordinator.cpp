// The quorum protocol over the coordinator's store (coordinator.h has the key layout and the why).

#include "fault_tolerance/coordinator.h"

#include "util/exception_message.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <iterator>
#include <set>
#include <sstream>

namespace fsdp::ft {
namespace {

using Clock = std::chrono::steady_clock;
// How often a waiting joiner or voter looks at the store again: short against the join timeout (seconds), long
// enough that a handful of waiting replicas do not keep the store busy.
constexpr std::chrono::milliseconds kPoll{10};
constexpr std::chrono::milliseconds kBeat{100};

std::string round_key(int64_t q, const std::string& what) {
  return "fsdp-ft/round/" + std::to_string(q) + "/" + what;
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

bool exists(c10d::Store& store, const std::string& key) { return store.check({key}); }

int64_t parse_int(const std::string& s, const std::string& key) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, "fsdp::ft: coordinator key '", key, "' holds '", s, "', not an integer (is another program "
              "using this store?)");
}

std::string encode(const Member& m) {
  return std::to_string(m.replica_id) + " " + std::to_string(m.step) + " " + std::to_string(m.incarnation);
}

Member decode(const std::string& s, const std::string& key, int64_t position) {
  std::istringstream in(s);
  Member m;
  in >> m.replica_id >> m.step >> m.incarnation;
  TORCH_CHECK(in && m.replica_id >= 0, "fsdp::ft: coordinator key '", key, "' holds '", s,
              "', not 'replica_id step incarnation'");
  m.position = position;
  return m;
}

}  // namespace

StorePtr connect_coordinator(const std::string& address, std::chrono::milliseconds timeout) {
  const auto colon = address.rfind(':');
  TORCH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < address.size(),
              "fsdp::ft: coordinator address '", address, "' is not host:port (ManagerOptions.lighthouse or "
              "FSDP_LIGHTHOUSE)");
  const std::string host = address.substr(0, colon);
  const int64_t port = parse_int(address.substr(colon + 1), "port of " + address);
  TORCH_CHECK(port > 0 && port < 65536, "fsdp::ft: coordinator address '", address, "': ", port,
              " is not a TCP port");
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, so);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp::ft: cannot reach the coordinator (fsdp-lighthouse) at ", address, " within ",
                timeout.count(), " ms: ", detail::message_of(e));
  }
}

Heartbeat::Heartbeat(StorePtr store, int replica_id, int rank)
    : store_(std::move(store)),
      key_("fsdp-ft/hb/" + std::to_string(replica_id) + "/" + std::to_string(rank)),
      thread_([this] { run(); }) {}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Heartbeat::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      store_->add(key_, 1);
    } catch (const std::exception&) {
      // The coordinator is unreachable: the quorum calls report it with context; a missed beat only makes this
      // replica look dead to the others, which is the truth as far as they can tell.
    }
    lock.lock();
    wake_.wait_for(lock, kBeat, [this] { return stop_; });
  }
}

Coordinator::Coordinator(StorePtr store, const ManagerOptions& options)
    : store_(std::move(store)), options_(options), watching_since_(Clock::now()) {}

std::vector<int> Coordinator::live_replicas(Clock::time_point now) {
  std::set<int> ids;
  if (exists(*store_, "fsdp-ft/replicas")) {
    std::istringstream in(text(store_->get("fsdp-ft/replicas")));
    std::string item;
    while (std::getline(in, item, ',')) {
      if (!item.empty()) ids.insert(static_cast<int>(parse_int(item, "fsdp-ft/replicas")));
    }
  }
  std::vector<int> live;
  for (int id : ids) {
    const std::string size_key = "fsdp-ft/size/" + std::to_string(id);
    const int64_t ranks = exists(*store_, size_key) ? parse_int(text(store_->get(size_key)), size_key) : 1;
    // Alive = every rank's counter moved within the last heartbeat_timeout of watching: a group with one rank
    // stopped or hung cannot take part in a step, whatever its other ranks do. A rank first seen just now counts as
    // alive until it has had heartbeat_timeout to show a beat: waiting for a dead one costs time, dropping a live
    // one would split the run in two quorums.
    bool alive = true;
    for (int rank = 0; rank < ranks; ++rank) {
      const std::string key = "fsdp-ft/hb/" + std::to_string(id) + "/" + std::to_string(rank);
      const int64_t beats = exists(*store_, key) ? store_->add(key, 0) : -1;
      auto [it, first] = seen_.try_emplace({id, rank}, Seen{beats, now});
      if (!first && it->second.beats != beats) it->second = Seen{beats, now};
      alive = alive && now - it->second.changed < options_.heartbeat_timeout;
    }
    if (alive) live.push_back(id);
  }
  return live;
}

ClosedRound Coordinator::read_round(int64_t id, int64_t positions) {
  ClosedRound round;
  round.id = id;
  std::vector<Member> all;
  for (int64_t n = 1; n <= positions; ++n) {
    const std::string key = round_key(id, "member/" + std::to_string(n));
    all.push_back(decode(text(store_->get(key)), key, n));
  }
  // One member per replica id: its latest join (an earlier one is a previous incarnation that died after joining).
  for (const Member& m : all) {
    auto it = std::find_if(round.members.begin(), round.members.end(),
                           [&](const Member& o) { return o.replica_id == m.replica_id; });
    if (it == round.members.end()) {
      round.members.push_back(m);
    } else if (it->position < m.position) {
      *it = m;
    }
  }
  std::sort(round.members.begin(), round.members.end(),
            [](const Member& a, const Member& b) { return a.replica_id < b.replica_id; });
  round.positions = positions;
  return round;
}

bool Coordinator::try_round(int64_t q, const Member& me, Clock::time_point deadline, ClosedRound& out) {
  const int64_t position = store_->add(round_key(q, "joined"), 1);
  Member self = me;
  self.position = position;
  store_->set(round_key(q, "member/" + std::to_string(position)), bytes(encode(self)));
  const auto joined_at = Clock::now();
  const std::string closed_key = round_key(q, "closed");
  std::vector<int> previous;  // replica ids of round q-1, once it is closed
  bool have_previous = false;
  while (true) {
    if (exists(*store_, closed_key)) {
      out = read_round(q, parse_int(text(store_->get(closed_key)), closed_key));
      return std::any_of(out.members.begin(), out.members.end(),
                         [&](const Member& m) { return m == self && m.position == position; });
    }
    const auto now = Clock::now();
    const std::vector<int> live = live_replicas(now);  // every tick, so that the heartbeats are observed over time
    // The joiners so far, up to the first position whose record is not written yet (a joiner between its add and
    // its set): a round closes over a prefix of positions that all have records.
    const int64_t joined = store_->add(round_key(q, "joined"), 0);
    int64_t prefix = 0;
    std::set<int> ids;
    for (int64_t n = 1; n <= joined; ++n) {
      const std::string key = round_key(q, "member/" + std::to_string(n));
      if (!exists(*store_, key)) break;
      ids.insert(decode(text(store_->get(key)), key, n).replica_id);
      prefix = n;
    }
    if (!have_previous && q > 1 && exists(*store_, round_key(q - 1, "closed"))) {
      const std::string key = round_key(q - 1, "closed");
      for (const Member& m : read_round(q - 1, parse_int(text(store_->get(key)), key)).members) {
        previous.push_back(m.replica_id);
      }
      have_previous = true;
    }
    const int count = static_cast<int>(ids.size());
    bool close = false;
    if (count >= options_.min_replicas) {
      // The joiners must be more than half of the replicas alive (torchft's majority rule: a restarted replica alone
      // must not form a quorum of its own while the others are busy in a step).
      std::set<int> alive(live.begin(), live.end());
      alive.insert(ids.begin(), ids.end());
      const bool majority = 2 * count > static_cast<int>(alive.size());
      const bool live_previous_back =
          have_previous && std::all_of(previous.begin(), previous.end(), [&](int id) {
            return ids.count(id) || !std::binary_search(live.begin(), live.end(), id);
          });
      // Everyone expected is here, or everyone of the last quorum is back: no reason to wait. Members of the last
      // quorum that are gone (no heartbeat) are not waited for either; otherwise stragglers get join_timeout.
      close = (options_.expected_replicas > 0 && count >= options_.expected_replicas) ||
              (have_previous && std::all_of(previous.begin(), previous.end(), [&](int id) { return ids.count(id); })) ||
              (live_previous_back && majority) || (now - joined_at >= options_.join_timeout && majority);
    }
    if (close) {
      store_->compareSet(closed_key, {}, bytes(std::to_string(prefix)));
      // Rounds close in order (a round's members join the next one only after it closed), so this only advances.
      store_->set("fsdp-ft/latest", bytes(std::to_string(q)));
      continue;  // read back whatever closed it (ours or another joiner's)
    }
    TORCH_CHECK(now < deadline, "fsdp::ft: replica ", me.replica_id, ": no quorum of ", options_.min_replicas,
                " replica group(s) formed within ", options_.quorum_timeout.count(), " ms (round ", q, ": joined ",
                count, ", alive ", live.size(), ")");
    std::this_thread::sleep_for(kPoll);
  }
}

ClosedRound Coordinator::join(const Member& me, int64_t last_round, int64_t& missed) {
  const auto deadline = Clock::now() + options_.quorum_timeout;
  int64_t q = last_round + 1;
  while (true) {
    if (exists(*store_, "fsdp-ft/latest")) {
      q = std::max(q, parse_int(text(store_->get("fsdp-ft/latest")), "fsdp-ft/latest") + 1);
    }
    ClosedRound round;
    if (try_round(q, me, deadline, round)) return round;
    ++missed;  // closed before we joined (or without us): not ours to train, try the next one
    ++q;
  }
}

bool Coordinator::keeps_group(const ClosedRound& round) {
  const int64_t prev = round.id - 1;
  if (prev < 1) return false;
  const std::string closed = round_key(prev, "closed"), decision = round_key(prev, "decision");
  if (!exists(*store_, closed) || !exists(*store_, decision)) return false;
  if (text(store_->get(decision)) != "commit") return false;
  const ClosedRound before = read_round(prev, parse_int(text(store_->get(closed)), closed));
  return before.members == round.members;
}

Coordinator::Decision Coordinator::vote(int64_t round, int member_index, int rank, int num_members, int group_size,
                                       bool ok) {
  store_->set(round_key(round, "vote/" + std::to_string(member_index) + "/" + std::to_string(rank)),
              bytes(ok ? "1" : "0"));
  const std::string decision = round_key(round, "decision");
  const auto deadline = Clock::now() + options_.timeout;
  while (true) {
    if (exists(*store_, decision)) {
      const std::string value = text(store_->get(decision));
      // "abort: <why>" — the why of whoever decided, so that every voter can say it.
      return value == "commit" ? Decision{true, ""} : Decision{false, value.substr(std::min<size_t>(7, value.size()))};
    }
    std::string failed, missing;
    for (int i = 0; i < num_members; ++i) {
      for (int r = 0; r < group_size; ++r) {
        const std::string key = round_key(round, "vote/" + std::to_string(i) + "/" + std::to_string(r));
        const std::string who = c10::str("member ", i, " rank ", r);
        if (!exists(*store_, key)) {
          missing += (missing.empty() ? "" : ", ") + who;
        } else if (text(store_->get(key)) != "1") {
          failed += (failed.empty() ? "" : ", ") + who;
        }
      }
    }
    std::string verdict;
    if (!failed.empty()) {
      verdict = "abort: " + failed + " voted not ok";  // one failed voter decides at once
    } else if (missing.empty()) {
      verdict = "commit";
    } else if (Clock::now() >= deadline) {
      verdict = c10::str("abort: no vote from ", missing, " within ", options_.timeout.count(), " ms");  // gone or hung
    }
    if (!verdict.empty()) {
      store_->compareSet(decision, {}, bytes(verdict));  // the first verdict stored wins; everyone reads it back
      continue;
    }
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace fsdp::ft
