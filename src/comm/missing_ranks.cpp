// Which ranks a failed collective was waiting for (see comm::missing_ranks in process_group_impl.h).
//
// Gloo reports a timeout or a closed connection, but not which peer never came. Every rank whose collective fails
// records "stuck at collective #N" under its own key in the group's key space of the rendezvous store; after a
// short grace, a member without a record (hung, stopped, dead) or with another number (stuck elsewhere) is named.
// The store is served by world rank 0 (unless the launcher serves it: fsdprun in standalone mode), which may itself
// be the missing rank: the query runs on a helper thread and is abandoned after a bound, so the error is never held
// back for long. The helper talks to the store over a
// connection of its own (Store::clone): c10d's TCPStore client serializes its operations under one lock, so an
// abandoned query stuck on the shared connection would block every later store call of this rank (the recovery
// exchange after a forward exception, say) for as long as the stopped rank 0 does not answer.
#include "comm/process_group_impl.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <future>
#include <memory>
#include <thread>

namespace fsdp::comm {
namespace {

std::string key_of(int group_rank) { return c10::str("stuck/rank", group_rank); }

std::string query(c10::intrusive_ptr<c10d::Store> store, std::vector<int> global_ranks, int rank, uint64_t seq,
                  std::chrono::milliseconds grace) {
  const std::string mine = std::to_string(seq);
  store->set(key_of(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  const auto deadline = std::chrono::steady_clock::now() + grace;
  std::vector<int> absent, elsewhere_rank;
  std::vector<std::string> elsewhere_seq;
  while (true) {
    absent.clear();
    elsewhere_rank.clear();
    elsewhere_seq.clear();
    for (int r = 0; r < static_cast<int>(global_ranks.size()); ++r) {
      if (r == rank) continue;
      if (!store->check({key_of(r)})) {
        absent.push_back(global_ranks[r]);
        continue;
      }
      const auto v = store->get(key_of(r));
      const std::string theirs(v.begin(), v.end());
      if (theirs != mine) {
        elsewhere_rank.push_back(global_ranks[r]);
        elsewhere_seq.push_back(theirs);
      }
    }
    if ((absent.empty() && elsewhere_rank.empty()) || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (absent.empty() && elsewhere_rank.empty())
    return c10::str(" — every member of the group reached collective #", seq, " and failed in it (a transport error)");
  std::string out = c10::str(" — missing: world rank(s) [", c10::Join(", ", absent.empty() ? elsewhere_rank : absent),
                             "]");
  if (!absent.empty()) out += c10::str(" did not report reaching collective #", seq, " of this group");
  for (size_t i = 0; i < elsewhere_rank.size(); ++i)
    out += c10::str(i == 0 && absent.empty() ? "" : ";", " world rank ", elsewhere_rank[i], " failed at collective #",
                    elsewhere_seq[i], " instead of #", seq);
  return out;
}

}  // namespace

void stamp(Work::Impl& w, const ProcessGroup::Impl& g) {
  w.seq = ++g.collectives_issued;
  w.store = g.store;
  w.global_ranks = g.global_ranks;
  w.rank = g.rank;
  w.group_failures = g.failures;
}

std::string missing_ranks(const Work::Impl& w) {
  if (!w.store || w.global_ranks.size() < 2) return "";
  // Long enough for the other members' own timeouts (they started the collective at about the same time) to fire.
  const auto grace = std::clamp(w.timeout / 4, std::chrono::milliseconds(500), std::chrono::milliseconds(3000));
  auto result = std::make_shared<std::promise<std::string>>();
  auto future = result->get_future();
  std::thread([result, store = w.store, ranks = w.global_ranks, rank = w.rank, seq = w.seq, grace] {
    try {
      result->set_value(query(store->clone(), ranks, rank, seq, grace));
    } catch (const std::exception& e) {
      result->set_value(c10::str(" — the ranks that are missing could not be determined: the rendezvous store did "
                                 "not answer (", message_of(e), ")"));
    }
  }).detach();
  if (future.wait_for(grace + std::chrono::seconds(2)) != std::future_status::ready)
    return " — the ranks that are missing could not be determined: the rendezvous store (served by world rank 0) "
           "does not answer, so world rank 0 may be the one missing";
  return future.get();
}

}  // namespace fsdp::comm
