// fsdp::ft::Manager: one replica group's side of the quorum protocol (coordinator.h), its quorum process group and
// the commit vote. docs/reliability.md, "Replica-group fault tolerance", says how the pieces fit.

#include <fsdp/fault_tolerance.h>

#include "comm/store_group.h"
#include "fault_tolerance/coordinator.h"
#include "util/exception_message.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <random>
#include <unistd.h>

namespace fsdp::ft {
namespace {

// The cycle every step goes through (checked: a call out of order is a bug in the caller's training loop).
enum class Phase { Idle, InStep };

// Random per Manager, so a restarted replica (same id) is told apart from its previous incarnation, whose join
// records may still be in the store.
uint64_t new_incarnation() {
  std::random_device rd;
  const uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return ((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ t ^ (static_cast<uint64_t>(::getpid()) << 16)) >> 1;
}

// Healing tags: the header, the tensors' sizes and dtypes, the data position, then one per tensor.
constexpr int kTagHeader = 1, kTagMeta = 2, kTagBlob = 3, kTagFirstTensor = 4;

}  // namespace

struct Manager::Impl {
  ManagerOptions options;
  ProcessGroupPtr replica_group;
  int shard = 0;       // this rank's index in its replica group = its rank in the quorum group
  int group_size = 1;  // ranks per replica group (the same in every member: one shard index meets one)
  uint64_t incarnation = 0;
  StorePtr store;
  std::unique_ptr<Coordinator> coordinator;
  StorePtr heartbeat_store;              // its own connection (a Gloo rendezvous may block the main one)
  std::unique_ptr<Heartbeat> heartbeat;  // this rank's beat (coordinator.h), started by the first start_quorum

  Phase phase = Phase::Idle;
  Quorum quorum;
  int64_t last_round = 0;
  int64_t calls = 0;  // start_quorum calls so far (the same count on every rank of the group)
  ProcessGroupPtr group;  // the quorum group, made in round group_round
  std::string error;      // the step's first failure
  int64_t missed = 0;
  // This step's failure key, shared by the ranks of this replica group (rank 0's incarnation and the call count name
  // it). A rank whose quorum transfer fails sets it; the others look at it before each quorum transfer of the step.
  // Without it a 2-rank group paid the timeout twice in a row: rank 1 waited `timeout` for a stopped peer while rank
  // 0 waited for rank 1 inside the group's own reduce-scatter, then rank 0 waited `timeout` again on its next
  // transfer, with a peer stuck behind the stopped rank of its group. Now every wait of a step but the first is
  // skipped, so a fault costs the survivors one timeout, whatever the group size.
  std::string step_failed_key;

  std::string who() const {
    return c10::str("replica ", options.replica_id, " rank ", shard, " (quorum ", quorum.id, ")");
  }
  void record(const std::string& what, const std::exception& e) {
    if (!error.empty()) return;
    error = c10::str(what, ": ", detail::message_of(e));
    if (group_size > 1 && !step_failed_key.empty()) {
      try {
        store->set(step_failed_key, c10::str("rank ", shard, ": ", error));
      } catch (const std::exception&) {
        // The coordinator is gone: the other ranks' own transfers and the vote fail on it as well.
      }
    }
  }
  // True when this step is lost already: this rank recorded a failure, or another rank of its group did (then its
  // reason becomes this rank's error). Called before each quorum transfer, so that none waits for a peer the step
  // cannot use any more.
  bool step_lost() {
    if (!error.empty()) return true;
    if (group_size == 1 || step_failed_key.empty()) return false;
    try {
      if (!store->check({step_failed_key})) return false;
      error = c10::str("the step is lost: ", store->get_to_str(step_failed_key), " (another rank of this replica group)");
    } catch (const std::exception& e) {
      error = c10::str("the coordinator does not answer: ", detail::message_of(e));
    }
    return true;
  }
  void check_in_step(const char* call) const {
    TORCH_CHECK(phase == Phase::InStep, "fsdp::ft::Manager::", call, " on ", who(),
                ": no step in progress (call start_quorum first; should_commit ends a step)");
  }
};

Manager::Manager(ManagerOptions options, ProcessGroupPtr replica_group) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  TORCH_CHECK(replica_group != nullptr, "fsdp::ft::Manager: replica_group is null (pass this replica group's world)");
  TORCH_CHECK(options.replica_id >= 0, "fsdp::ft::Manager: ManagerOptions.replica_id must be >= 0, got ",
              options.replica_id);
  TORCH_CHECK(options.min_replicas >= 1, "fsdp::ft::Manager: ManagerOptions.min_replicas must be >= 1, got ",
              options.min_replicas);
  TORCH_CHECK(options.expected_replicas >= 0, "fsdp::ft::Manager: ManagerOptions.expected_replicas must be >= 0, got ",
              options.expected_replicas);
  TORCH_CHECK(options.join_timeout.count() > 0 && options.quorum_timeout.count() > 0 && options.timeout.count() > 0 &&
                  options.heartbeat_timeout.count() > 0,
              "fsdp::ft::Manager: join_timeout, heartbeat_timeout, quorum_timeout and timeout must be positive");
  if (options.lighthouse.empty()) {
    const char* env = std::getenv("FSDP_LIGHTHOUSE");
    TORCH_CHECK(env && *env, "fsdp::ft::Manager: no coordinator address: set ManagerOptions.lighthouse or "
                             "FSDP_LIGHTHOUSE to the host:port fsdp-lighthouse printed");
    options.lighthouse = env;
  }
  m.options = options;
  m.replica_group = std::move(replica_group);
  m.shard = m.replica_group->rank();
  m.group_size = m.replica_group->size();
  m.store = connect_coordinator(options.lighthouse, options.timeout);
  m.coordinator = std::make_unique<Coordinator>(m.store, options);
  // Rank 0's incarnation, known to every rank of the group: it names the keys through which rank 0 tells them the
  // rounds it joined (start_quorum).
  int64_t incarnation = m.shard == 0 ? static_cast<int64_t>(new_incarnation()) : 0;
  if (m.group_size > 1) {
    at::Tensor t = at::full({1}, incarnation, at::kLong).to(m.replica_group->device());
    m.replica_group->broadcast(t, 0).wait();
    incarnation = t.cpu().item<int64_t>();
  }
  m.incarnation = static_cast<uint64_t>(incarnation);
  // Every rank beats (the group is alive only while all of its ranks are, coordinator.h), from its first
  // start_quorum on: a group still starting up is not waited for, the others train on without it meanwhile.
  m.heartbeat_store = connect_coordinator(options.lighthouse, options.timeout);
  if (m.shard == 0) {
    // The group's size first, so that whoever reads the list knows how many ranks' beats make it alive. append
    // creates the list for the first replica; a restarted replica lists its id again (read as a set).
    m.store->set(c10::str("fsdp-ft/size/", options.replica_id), std::to_string(m.group_size));
    const std::string id = std::to_string(options.replica_id) + ",";
    m.store->append("fsdp-ft/replicas", std::vector<uint8_t>(id.begin(), id.end()));
  }
}

Manager::~Manager() = default;

const Quorum& Manager::start_quorum(int64_t step) {
  Impl& m = *impl_;
  TORCH_CHECK(m.phase == Phase::Idle, "fsdp::ft::Manager::start_quorum on ", m.who(),
              ": the previous step was not ended (call should_commit first)");
  TORCH_CHECK(step >= 0, "fsdp::ft::Manager::start_quorum: step must be >= 0, got ", step);
  m.error.clear();
  if (!m.heartbeat) m.heartbeat = std::make_unique<Heartbeat>(m.heartbeat_store, m.options.replica_id, m.shard);

  // Rank 0 joins for the whole replica group and tells its ranks which round (and how many join positions) closed
  // with it inside, through a key of its own in the store (not a collective of the replica group: joining may take
  // up to quorum_timeout, longer than the group's collective timeout); every rank then reads the same membership.
  // Rank 0 joins only once every rank of its group has arrived here (torchft's manager server waits for all its
  // workers alike): a group with a hung rank (stopped, or stuck in a collective) stays out of the rounds, so the
  // others drop it after join_timeout instead of taking it in and failing every step on its missing rank.
  ClosedRound round;
  try {
    const std::string told =
        c10::str("fsdp-ft/replica/", m.options.replica_id, "/", m.incarnation, "/call/", m.calls++);
    m.step_failed_key = told + "/failed";
    if (m.shard == 0) {
      if (m.group_size > 1) {
        std::vector<std::string> arrived;
        for (int r = 1; r < m.group_size; ++r) arrived.push_back(c10::str(told, "/arrived/", r));
        const auto limit = m.options.quorum_timeout + m.options.timeout;
        try {
          m.store->wait(arrived, limit);
        } catch (const std::exception& e) {
          TORCH_CHECK(false, "fsdp::ft: ", m.who(), ": not every rank of this replica group reached step ", step,
                      "'s quorum within ", limit.count(), " ms (a rank hung?): ", detail::message_of(e));
        }
        for (const auto& key : arrived) m.store->deleteKey(key);
      }
      round = m.coordinator->join(Member{m.options.replica_id, step, m.incarnation, 0}, m.last_round, m.missed);
      if (m.group_size > 1) m.store->set(told, c10::str(round.id, " ", round.positions));
    } else {
      m.store->set(c10::str(told, "/arrived/", m.shard), "1");
      try {
        m.store->wait({told}, m.options.quorum_timeout + m.options.timeout);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "fsdp::ft: ", m.who(), ": rank 0 of this replica group did not report a quorum within ",
                    (m.options.quorum_timeout + m.options.timeout).count(), " ms: ", detail::message_of(e));
      }
      const std::string value = m.store->get_to_str(told);
      int64_t id = 0, positions = 0;
      TORCH_CHECK(std::sscanf(value.c_str(), "%" SCNd64 " %" SCNd64, &id, &positions) == 2, "fsdp::ft: ", m.who(),
                  ": malformed round record '", value, "' under ", told);
      round = m.coordinator->read_round(id, positions);
    }
  } catch (const c10::DistError& e) {
    // The store connection broke (the timeouts above are reported as such): the coordinator process is gone.
    TORCH_CHECK(false, "fsdp::ft: ", m.who(), ": lost the coordinator (fsdp-lighthouse at ", m.options.lighthouse,
                ") while joining step ", step, "'s quorum: ", detail::message_of(e),
                ". No replica group can train without it (it holds every quorum): start it again, then the groups");
  }
  m.last_round = round.id;

  Quorum q;
  q.id = round.id;
  for (const Member& mem : round.members) {
    q.replica_ids.push_back(mem.replica_id);
    q.max_step = std::max(q.max_step, mem.step);
  }
  const auto mine = std::find(q.replica_ids.begin(), q.replica_ids.end(), m.options.replica_id);
  TORCH_CHECK(mine != q.replica_ids.end(), "fsdp::ft: ", m.who(), ": round ", round.id,
              " does not list this replica (two replica groups use the same replica_id?)");
  q.replica_index = static_cast<int>(mine - q.replica_ids.begin());
  // Healing pairs: the members behind max_step, each from an up-to-date member, round-robin (torchft's rule).
  std::vector<int> behind, current;
  for (int i = 0; i < q.num_participants(); ++i) {
    (round.members[i].step < q.max_step ? behind : current).push_back(i);
  }
  for (size_t k = 0; k < behind.size(); ++k) {
    const int source = current[k % current.size()];
    if (behind[k] == q.replica_index) {
      q.heal = true;
      q.heal_source = source;
    }
    if (source == q.replica_index) q.heal_targets.push_back(behind[k]);
  }

  // The quorum group: kept while the membership holds and the last step committed (every member decides that from
  // the store alike), else made anew in a key space of its own round.
  const bool keep = m.group && m.group->size() == q.num_participants() && m.coordinator->keeps_group(round);
  if (!keep) {
    m.group.reset();  // the old group's connections go before the new ones are made
    q.group_rebuilt = true;
    try {
      m.group = comm::group_over_store(comm::StoreGroupSpec{
          m.store, Coordinator::group_prefix(round.id, m.shard),
          c10::str("quorum ", round.id, " [shard ", m.shard, "]"), q.replica_index, q.num_participants(),
          m.options.timeout, /*name_missing_ranks=*/false});
    } catch (const std::exception& e) {
      m.record(c10::str("creating the quorum group of round ", round.id), e);
    }
  }
  m.quorum = std::move(q);
  m.phase = Phase::InStep;
  return m.quorum;
}

const Quorum& Manager::quorum() const { return impl_->quorum; }

void Manager::allreduce_average(at::Tensor& tensor) {
  Impl& m = *impl_;
  m.check_in_step("allreduce_average");
  if (!m.group || m.step_lost()) return;  // the step is lost already: no more traffic on a broken group
  try {
    m.group->all_reduce(tensor, ReduceOp::Sum).wait();
    tensor.div_(m.quorum.num_participants());
  } catch (const std::exception& e) {
    m.record("allreduce_average", e);
  }
}

void Manager::send_state(const std::vector<at::Tensor>& tensors, int64_t step, const std::string& data_position) {
  Impl& m = *impl_;
  m.check_in_step("send_state");
  if (!m.group || m.step_lost()) return;
  const int64_t n = static_cast<int64_t>(tensors.size());
  at::Tensor header = at::tensor({step, static_cast<int64_t>(data_position.size()), n}, at::kLong);
  std::vector<int64_t> meta;
  for (const at::Tensor& t : tensors) meta.push_back(t.numel());
  for (const at::Tensor& t : tensors) meta.push_back(static_cast<int64_t>(t.scalar_type()));
  at::Tensor meta_t = at::tensor(meta, at::kLong);
  at::Tensor blob = at::empty({static_cast<int64_t>(data_position.size())}, at::kByte);
  std::copy(data_position.begin(), data_position.end(), blob.data_ptr<uint8_t>());
  const auto dev = m.group->device();
  try {
    for (int target : m.quorum.heal_targets) {
      std::vector<Work> works;
      // Kept alive until the sends complete (they read from these tensors).
      std::vector<at::Tensor> staged = {header.to(dev), meta_t.to(dev), blob.to(dev)};
      works.push_back(m.group->send(staged[0], target, kTagHeader));
      works.push_back(m.group->send(staged[1], target, kTagMeta));
      if (blob.numel() > 0) works.push_back(m.group->send(staged[2], target, kTagBlob));
      for (int64_t i = 0; i < n; ++i) {
        staged.push_back(tensors[i].detach().contiguous().to(dev));
        works.push_back(m.group->send(staged.back(), target, kTagFirstTensor + static_cast<int>(i)));
      }
      for (Work& w : works) w.wait();
    }
  } catch (const std::exception& e) {
    m.record("send_state", e);
  }
}

std::optional<HealedState> Manager::receive_state(std::vector<at::Tensor>& tensors) {
  Impl& m = *impl_;
  m.check_in_step("receive_state");
  TORCH_CHECK(m.quorum.heal, "fsdp::ft::Manager::receive_state on ", m.who(),
              ": this replica is not behind (Quorum.heal is false), nobody will send to it");
  if (!m.group || m.step_lost()) return std::nullopt;
  const int source = m.quorum.heal_source;
  const auto dev = m.group->device();
  // Failures of the transfer are recorded (the step is lost, the vote says so); a state that does not match the
  // caller's tensors is the caller's bug and throws.
  at::Tensor header, meta;
  try {
    header = at::empty({3}, at::kLong).to(dev);
    m.group->recv(header, source, kTagHeader).wait();
    header = header.cpu();
    meta = at::empty({2 * header[2].item<int64_t>()}, at::kLong).to(dev);
    m.group->recv(meta, source, kTagMeta).wait();
    meta = meta.cpu();
  } catch (const std::exception& e) {
    m.record("receive_state", e);
    return std::nullopt;
  }
  const int64_t step = header[0].item<int64_t>(), blob_size = header[1].item<int64_t>(), n = header[2].item<int64_t>();
  TORCH_CHECK(n == static_cast<int64_t>(tensors.size()), "fsdp::ft::Manager::receive_state on ", m.who(),
              ": the source (replica index ", source, ") sends ", n, " tensors, this replica expects ", tensors.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = meta[i].item<int64_t>();
    const auto dtype = static_cast<at::ScalarType>(meta[n + i].item<int64_t>());
    TORCH_CHECK(numel == tensors[i].numel() && dtype == tensors[i].scalar_type(), "fsdp::ft::Manager::receive_state on ",
                m.who(), ": tensor ", i, " is ", numel, " x ", dtype, " at the source, ", tensors[i].numel(), " x ",
                tensors[i].scalar_type(), " here (both sides must list the same state in the same order)");
  }
  try {
    HealedState out;
    out.step = step;
    if (blob_size > 0) {
      at::Tensor blob = at::empty({blob_size}, at::kByte).to(dev);
      m.group->recv(blob, source, kTagBlob).wait();
      blob = blob.cpu();
      out.data_position.assign(reinterpret_cast<const char*>(blob.data_ptr<uint8_t>()), blob_size);
    }
    for (int64_t i = 0; i < n; ++i) {
      at::Tensor& dst = tensors[i];
      // Received into a contiguous buffer on the group's device, then copied in: the caller's tensor may be a view.
      at::Tensor buf = at::empty({dst.numel()}, dst.options().device(dev));
      m.group->recv(buf, source, kTagFirstTensor + static_cast<int>(i)).wait();
      dst.detach().copy_(buf.view(dst.sizes()));
    }
    return out;
  } catch (const std::exception& e) {
    m.record("receive_state", e);
  }
  return std::nullopt;
}

bool Manager::should_commit(bool local_ok) {
  Impl& m = *impl_;
  m.check_in_step("should_commit");
  const bool ok = local_ok && m.error.empty();
  if (!local_ok && m.error.empty()) m.error = "the caller voted not ok (should_commit(false))";
  bool commit = false;
  try {
    const auto decision = m.coordinator->vote(m.quorum.id, m.quorum.replica_index, m.shard,
                                              m.quorum.num_participants(), m.group_size, ok);
    commit = decision.commit;
    if (!commit && m.error.empty()) m.error = c10::str("round ", m.quorum.id, " aborted: ", decision.why);
  } catch (const std::exception& e) {
    m.record("the commit vote", e);  // the coordinator is unreachable: never apply a step nobody confirmed
  }
  m.phase = Phase::Idle;
  return commit;
}

const std::string& Manager::error() const { return impl_->error; }
ProcessGroupPtr Manager::quorum_group() const { return impl_->group; }
int64_t Manager::rounds_missed() const { return impl_->missed; }

}  // namespace fsdp::ft
