// Rendezvous and the group registry: init_process_group, new_group, world, destroy_process_group.
//
// The registry below is the library's only global mutable state (allowed by design: process groups are
// process-wide, like torch.distributed's default group). Everything else hangs off ProcessGroup objects.

#include "comm/launch_check.h"
#include <fsdp/fake_process_group.h>
#include <fsdp/launch_check.h>
#include "comm/process_group_impl.h"
#include "comm/store_group.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#ifdef FSDP_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>

namespace fsdp {
namespace {

struct Registry {
  std::mutex mu;
  c10::intrusive_ptr<c10d::Store> store;  // null when the world has one rank
  ProcessGroupPtr world;
  std::string backend;  // "gloo" or "nccl"
  c10::Device device{c10::kCPU};
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::shared_ptr<::gloo::transport::Device> gloo_device;  // one transport device shared by all Gloo groups
  int64_t groups_created = 0;  // advances identically on every rank: names the key space of each new group
  comm::StoreView launch;       // for check_same_on_all_ranks (store null when the world has one rank)
  std::string run_id;           // TORCHELASTIC_RUN_ID, "none" when unset
  int64_t checks_done = 0;      // advances identically on every rank: names the key space of each check
};

Registry& registry() {
  static Registry r;
  return r;
}

const char* getenv_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int parse_int(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  TORCH_CHECK(end != value && *end == '\0' && errno == 0 && v >= INT32_MIN && v <= INT32_MAX,
              "fsdp: environment variable ", name, "='", value, "' is not an integer");
  return static_cast<int>(v);
}

// "1" = on, unset/"0" = off; anything else is an error naming the variable.
bool env_flag(const char* name) {
  const char* v = getenv_or_null(name);
  if (!v) return false;
  const std::string value(v);
  TORCH_CHECK(value == "0" || value == "1", "fsdp: environment variable ", name, "='", value, "' must be 0 or 1");
  return value == "1";
}

int require_env_int(const char* name) {
  const char* v = getenv_or_null(name);
  TORCH_CHECK(v != nullptr, "fsdp: environment variable ", name,
              " is not set (start the program with fsdprun/torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, "
              "MASTER_PORT, or fill fsdp::InitOptions)");
  return parse_int(name, v);
}

// TORCHELASTIC_USE_AGENT_STORE as torch.distributed reads it (rendezvous.py: the value must be exactly "True").
bool agent_serves_store() {
  const char* v = getenv_or_null("TORCHELASTIC_USE_AGENT_STORE");
  return v != nullptr && std::string(v) == "True";
}

std::string resolve_backend(const std::string& requested) {
  if (requested == "gloo") return "gloo";
  if (requested == "nccl") {
#ifdef FSDP_WITH_NCCL
    TORCH_CHECK(at::hasCUDA(), "fsdp: backend 'nccl' requested but CUDA is not available");
    return "nccl";
#else
    TORCH_CHECK(false, "fsdp: backend 'nccl' is unavailable: libfsdp was built without NCCL support "
                       "(configure with FSDP_WITH_NCCL on a CUDA build of libtorch), use 'gloo'");
#endif
  }
  if (requested == "auto") {
#ifdef FSDP_WITH_NCCL
    if (at::hasCUDA()) return "nccl";
#endif
    return "gloo";
  }
  TORCH_CHECK(false, "fsdp: unknown backend '", requested, "' (expected 'auto', 'gloo' or 'nccl')");
}

// InitOptions.device: empty = the backend's own device; otherwise "cpu" (Gloo only) or "cuda[:N]".
c10::Device resolve_device(const std::string& backend, const std::string& requested) {
  if (requested.empty()) {
    return backend == "nccl" ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env_local_rank()))
                             : c10::Device(c10::kCPU);
  }
  std::optional<c10::Device> d;
  try {
    d = c10::Device(requested);
  } catch (const std::exception&) {
  }
  TORCH_CHECK(d && (d->is_cpu() || d->is_cuda()), "fsdp: InitOptions.device '", requested,
              "' is not a device (expected 'cpu', 'cuda' or 'cuda:N')");
  TORCH_CHECK(!(backend == "nccl" && d->is_cpu()), "fsdp: InitOptions.device 'cpu' with backend 'nccl': NCCL works "
              "on CUDA tensors only (use backend 'gloo' for the CPU)");
  if (!d->is_cuda()) return *d;
  TORCH_CHECK(at::hasCUDA(), "fsdp: InitOptions.device '", requested, "' (backend ", backend,
              "): CUDA is not available in this process");
  // No index: the same default as NCCL's, one GPU per local rank.
  return d->has_index() ? *d : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env_local_rank()));
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device() {
  // Same choice as torch.distributed: GLOO_SOCKET_IFNAME pins the interface, else the host's address.
  if (const char* ifname = getenv_or_null("GLOO_SOCKET_IFNAME")) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// What a new group is built from: the world's settings (make_group below) or a caller's store (group_over_store).
struct GroupSetup {
  c10::intrusive_ptr<c10d::Store> store;
  std::string backend;
  c10::Device device{c10::kCPU};
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  bool name_missing_ranks = true;  // StoreGroupSpec::name_missing_ranks
};

// Builds a group over `r.store` under `prefix`. `ranks` are the members' ranks in whatever numbering the caller
// uses (world ranks, or member indices for group_over_store); `group_rank` is ours in the group.
ProcessGroupPtr build_group(const GroupSetup& r, const std::string& prefix, const std::string& name,
                            const std::vector<int>& ranks, int group_rank) {
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->rank = group_rank;
  impl->size = static_cast<int>(ranks.size());
  impl->name = name;
  impl->global_ranks = ranks;
  impl->backend_name = r.backend;
  impl->device = r.device;
  impl->timeout = r.timeout;
  c10::intrusive_ptr<c10d::Backend> communicator;  // none for a size-1 group: its collectives are local
  if (r.backend == "fake") {
    // No peers, no store (FakeWorld): collectives that complete at once, whatever the size.
    impl->collectives = comm::make_collective_backend(nullptr, "fake", r.device, false);
    return std::make_shared<ProcessGroup>(std::move(impl));
  }
  if (impl->size > 1) {
    auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, r.store);
    if (r.name_missing_ranks) impl->store = store;  // comm::missing_ranks asks it after a failure
    try {
      if (r.backend == "gloo") {
        auto opts = c10d::ProcessGroupGloo::Options::create(r.timeout);
        opts->devices = {r.gloo_device};
        communicator = c10::make_intrusive<c10d::ProcessGroupGloo>(store, group_rank, impl->size, opts);
      } else {
#ifdef FSDP_WITH_NCCL
        auto opts = c10d::ProcessGroupNCCL::Options::create();
        opts->timeout = r.timeout;
        communicator = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, group_rank, impl->size, opts);
#else
        TORCH_CHECK(false, "fsdp: NCCL support not compiled in");
#endif
      }
      // Store-based barrier (as torch.distributed does after new_group): a member that finished connecting
      // must not return — and possibly destroy the group — while a peer is still inside connectFullMesh,
      // which then fails with "Connection closed by peer".
      store->set(c10::str("ready/", group_rank), std::vector<uint8_t>{1});
      std::vector<std::string> ready;
      for (int i = 0; i < impl->size; ++i) ready.push_back(c10::str("ready/", i));
      store->wait(ready, r.timeout);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "fsdp: creating ", r.backend, " ", impl->describe(), " failed (timeout ", r.timeout.count(),
                  " ms): ", message_of(e));
    }
  }
  // The way this group runs its collectives, fixed for its lifetime (comm/collective_backend.h).
  impl->collectives = comm::make_collective_backend(std::move(communicator), r.backend, r.device,
                                                    env_flag("FSDP_NATIVE_COLLECTIVES"));
  return std::make_shared<ProcessGroup>(std::move(impl));
}

// Builds a group of the world (caller holds the registry lock).
ProcessGroupPtr make_group(Registry& r, const std::string& prefix, const std::string& name,
                           const std::vector<int>& ranks, int group_rank) {
  return build_group(GroupSetup{r.store, r.backend, r.device, r.timeout, r.gloo_device}, prefix, name, ranks,
                     group_rank);
}

}  // namespace

std::string library_version() {
  // FSDP_LIBRARY_VERSION_OVERRIDE exists for the launch-mismatch test only (two builds cannot be made in one test).
  if (const char* fake = getenv_or_null("FSDP_LIBRARY_VERSION_OVERRIDE")) return fake;
  return c10::str("libfsdp ", FSDP_VERSION_STRING, " (libtorch ", TORCH_VERSION, ")");
}

void check_same_on_all_ranks(const std::string& what, const std::string& value) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(r.world != nullptr, "fsdp: check_same_on_all_ranks before init_process_group");
  if (!r.launch.store) return;  // one rank
  comm::check_agreement(r.launch, r.run_id, r.checks_done++, what, value);
}

int env_rank() { return require_env_int("RANK"); }
int env_world_size() { return require_env_int("WORLD_SIZE"); }
int env_local_rank() {
  const char* v = getenv_or_null("LOCAL_RANK");
  return v ? parse_int("LOCAL_RANK", v) : 0;
}

ProcessGroupPtr init_process_group(const InitOptions& options) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(r.world == nullptr, "fsdp: init_process_group called twice (call destroy_process_group first)");
  TORCH_CHECK(options.timeout.count() > 0, "fsdp: InitOptions.timeout must be positive");

  const int rank = options.rank >= 0 ? options.rank : env_rank();
  const int world_size = options.world_size >= 0 ? options.world_size : env_world_size();
  TORCH_CHECK(world_size >= 1, "fsdp: world size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "fsdp: rank ", rank, " is outside the world of size ", world_size);
  const std::string backend = resolve_backend(options.backend);

  c10::intrusive_ptr<c10d::Store> store;
  if (world_size > 1) {
    std::string addr = options.master_addr;
    if (addr.empty()) {
      const char* v = getenv_or_null("MASTER_ADDR");
      TORCH_CHECK(v != nullptr, "fsdp: environment variable MASTER_ADDR is not set (start the program with "
                                "fsdprun/torchrun, or fill fsdp::InitOptions.master_addr)");
      addr = v;
    }
    const int port = options.master_port >= 0 ? options.master_port : require_env_int("MASTER_PORT");
    TORCH_CHECK(port > 0 && port < 65536, "fsdp: MASTER_PORT ", port, " is not a valid TCP port");
    // torchrun's contract: TORCHELASTIC_USE_AGENT_STORE=True means the launcher already serves the store at
    // MASTER_ADDR:MASTER_PORT (fsdprun does in standalone mode), so every rank, rank 0 too, is only a client. A port
    // given in InitOptions is the program's own rendezvous, which no launcher serves.
    const bool launcher_serves = options.master_port < 0 && agent_serves_store();
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(port);
    so.isServer = rank == 0 && !launcher_serves;
    so.numWorkers = static_cast<std::size_t>(world_size);
    so.waitWorkers = true;
    so.timeout = options.timeout;
    // Rank 0 listens only where MASTER_ADDR says (c10d alone would listen on every interface).
    if (so.isServer) so.masterListenFd = comm::listen_socket(addr, port);
    try {
      store = c10::make_intrusive<c10d::TCPStore>(addr, so);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "fsdp: rendezvous at ", addr, ":", port, " failed for rank ", rank, " of ", world_size,
                  " (timeout ", options.timeout.count(), " ms): ", message_of(e));
    }
    // Before any collective: the store is ours (not another job's on the same port), and every rank agrees on
    // the world size and the library. A mismatch is an error on the ranks that see it, not a deadlock.
    const char* run = getenv_or_null("TORCHELASTIC_RUN_ID");
    r.run_id = run ? run : "none";
    r.checks_done = 0;
    r.launch = comm::StoreView{store, rank, world_size, c10::str(addr, ":", port), options.timeout};
    try {
      comm::claim_or_check_run(r.launch, r.run_id);
      comm::check_agreement(r.launch, r.run_id, r.checks_done++, "world size (WORLD_SIZE)", std::to_string(world_size));
      comm::check_agreement(r.launch, r.run_id, r.checks_done++, "library version", library_version());
    } catch (...) {
      r.launch = {};
      throw;
    }
  }

  r.store = store;
  r.backend = backend;
  r.timeout = options.timeout;
  r.groups_created = 0;
  r.device = resolve_device(backend, options.device);
  if (backend == "gloo" && world_size > 1 && !r.gloo_device) r.gloo_device = make_gloo_device();
  std::vector<int> all(world_size);
  for (int i = 0; i < world_size; ++i) all[i] = i;
  try {
    r.world = make_group(r, "fsdp/world", "world", all, rank);
  } catch (...) {
    r.store.reset();
    throw;
  }
  return r.world;
}

bool is_initialized() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.world != nullptr;
}

ProcessGroupPtr world() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(r.world != nullptr, "fsdp: the process group is not initialized (call fsdp::init_process_group)");
  return r.world;
}

ProcessGroupPtr new_group(const std::vector<int>& ranks, const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(r.world != nullptr, "fsdp: new_group before init_process_group");
  const int world_size = r.world->size();
  TORCH_CHECK(!ranks.empty(), "fsdp: new_group needs at least one rank");
  std::set<int> seen;
  int me = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && ranks[i] < world_size, "fsdp: new_group: rank ", ranks[i],
                " is outside the world of size ", world_size);
    TORCH_CHECK(seen.insert(ranks[i]).second, "fsdp: new_group: rank ", ranks[i], " listed twice");
    if (ranks[i] == r.world->rank()) me = static_cast<int>(i);
  }
  // Every rank advances the counter, members or not, so group k has the same key space everywhere.
  const int64_t id = r.groups_created++;
  if (me < 0) return nullptr;
  return make_group(r, c10::str("fsdp/group", id), name.empty() ? c10::str("group", id) : name, ranks, me);
}

ProcessGroupPtr comm::group_over_store(const StoreGroupSpec& spec) {
  TORCH_CHECK(spec.store, "fsdp: group_over_store '", spec.name, "': no store");
  TORCH_CHECK(spec.size >= 1 && spec.rank >= 0 && spec.rank < spec.size, "fsdp: group_over_store '", spec.name,
              "': rank ", spec.rank, " is outside a group of size ", spec.size);
  TORCH_CHECK(spec.timeout.count() > 0, "fsdp: group_over_store '", spec.name, "': timeout must be positive");
  GroupSetup setup;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    // The same backend and device as the world's collectives when there is a world (a replica group's ranks are a
    // world of their own), Gloo on the CPU otherwise. The Gloo transport device is the registry's one, made here
    // when the world has a single rank and never needed one.
    setup.backend = r.world ? r.backend : "gloo";
    setup.device = r.world ? r.device : c10::Device(c10::kCPU);
    if (setup.backend == "gloo" && spec.size > 1) {
      if (!r.gloo_device) r.gloo_device = make_gloo_device();
      setup.gloo_device = r.gloo_device;
    }
  }
  setup.store = spec.store;
  setup.timeout = spec.timeout;
  setup.name_missing_ranks = spec.name_missing_ranks;
  std::vector<int> members(spec.size);
  for (int i = 0; i < spec.size; ++i) members[i] = i;
  // Outside the registry lock: connecting waits for the other members (up to the timeout), and the world's own
  // group creation must not wait behind it.
  return build_group(setup, spec.prefix, spec.name, members, spec.rank);
}

// What a FakeWorld sets aside: the registry as it was (a real world, or none).
struct FakeWorld::SetAside {
  c10::intrusive_ptr<c10d::Store> store;
  ProcessGroupPtr world;
  std::string backend;
  c10::Device device{c10::kCPU};
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  int64_t groups_created = 0;
  comm::StoreView launch;
  std::string run_id;
  int64_t checks_done = 0;
};

FakeWorld::FakeWorld(int rank, int world_size, c10::Device device) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "fsdp: FakeWorld: rank ", rank,
              " is outside a world of size ", world_size);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  TORCH_CHECK(r.backend != "fake" || !r.world, "fsdp: FakeWorld inside another FakeWorld (one at a time)");
  set_aside_ = std::make_unique<SetAside>(
      SetAside{r.store, r.world, r.backend, r.device, r.timeout, r.groups_created, r.launch, r.run_id, r.checks_done});
  r.store.reset();
  r.backend = "fake";
  r.device = device;
  r.groups_created = 0;
  r.launch = {};
  r.checks_done = 0;
  std::vector<int> all(world_size);
  for (int i = 0; i < world_size; ++i) all[i] = i;
  r.world = make_group(r, "fsdp/world", "world", all, rank);
  world_ = r.world;
}

FakeWorld::~FakeWorld() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  SetAside& s = *set_aside_;
  r.store = std::move(s.store);
  r.world = std::move(s.world);
  r.backend = std::move(s.backend);
  r.device = s.device;
  r.timeout = s.timeout;
  r.groups_created = s.groups_created;
  r.launch = std::move(s.launch);
  r.run_id = std::move(s.run_id);
  r.checks_done = s.checks_done;
}

void destroy_process_group() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // Groups handed out earlier stay usable while referenced: each keeps its backend and store alive.
  r.world.reset();
  r.store.reset();
  r.launch = {};
  r.groups_created = 0;
}

}  // namespace fsdp
