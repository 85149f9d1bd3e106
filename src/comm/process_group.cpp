// fsdp::ProcessGroup: what every collective does whatever the group's backend (comm/collective_backend.h).
//
// Rules every collective follows:
//  - Tensors must be contiguous and on the group's device type; we raise instead of copying silently, because
//    FSDP works on flat buffers and a hidden copy would hide the result from the caller's tensor.
//  - Empty tensors take a no-op on any group (nothing to move; every rank of a group sees the same sizes, so this
//    never desynchronises it); size-1 groups have a backend of local copies (LocalCollectives).
//  - Calls and bytes are counted per group (bytes from comm/byte_model.h; a size-1 group sends 0 by the same
//    formulas), also for the local cases; the backend numbers and traces what reaches a communicator.

#include "comm/byte_model.h"
#include "comm/process_group_impl.h"
#include "comm/store_exchange.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace fsdp {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "Sum";
    case ReduceOp::Avg: return "Avg";
    case ReduceOp::Max: return "Max";
    case ReduceOp::Min: return "Min";
  }
  return "?";
}

std::string ProcessGroup::Impl::describe() const {
  std::ostringstream os;
  os << "group '" << name << "' (world ranks [";
  for (size_t i = 0; i < global_ranks.size(); ++i) os << (i ? ", " : "") << global_ranks[i];
  os << "], this rank " << rank << ")";
  return os.str();
}

namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

void check_tensor(const ProcessGroup::Impl& g, const char* coll, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "fsdp: ", coll, " on ", g.describe(), ": ", what, " is undefined");
  TORCH_CHECK(t.is_contiguous(), "fsdp: ", coll, " on ", g.describe(), ": ", what,
              " must be contiguous (call .contiguous() and copy the result back yourself); sizes ", t.sizes(),
              ", strides ", t.strides());
  TORCH_CHECK(t.device().type() == g.device.type(), "fsdp: ", coll, " on ", g.describe(), ": ", what, " is on ",
              t.device(), " but the ", g.backend_name, " group works on ", g.device);
  TORCH_CHECK(!t.is_sparse(), "fsdp: ", coll, ": sparse tensors are not supported");
}

void check_same_dtype(const ProcessGroup::Impl& g, const char* coll, const at::Tensor& out, const at::Tensor& in) {
  TORCH_CHECK(out.scalar_type() == in.scalar_type(), "fsdp: ", coll, " on ", g.describe(), ": output dtype ",
              out.scalar_type(), " differs from input dtype ", in.scalar_type());
}

void check_op(const ProcessGroup::Impl& g, const char* coll, ReduceOp op, const at::Tensor& t) {
  TORCH_CHECK(op != ReduceOp::Avg || at::isFloatingType(t.scalar_type()), "fsdp: ", coll, " on ", g.describe(),
              ": ReduceOp::Avg needs a floating dtype, got ", t.scalar_type());
}

}  // namespace

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  TORCH_CHECK(impl_ != nullptr, "fsdp: ProcessGroup needs an implementation");
}
ProcessGroup::~ProcessGroup() = default;

int ProcessGroup::rank() const { return impl_->rank; }
int ProcessGroup::size() const { return impl_->size; }
const std::string& ProcessGroup::name() const { return impl_->name; }
const std::vector<int>& ProcessGroup::global_ranks() const { return impl_->global_ranks; }
const std::string& ProcessGroup::backend() const { return impl_->backend_name; }
c10::Device ProcessGroup::device() const { return impl_->device; }

void ProcessGroup::set_timeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "fsdp: set_timeout on ", impl_->describe(), ": timeout must be positive, got ",
              timeout.count(), " ms");
  impl_->timeout = timeout;
  impl_->collectives->set_timeout(timeout);
}
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->timeout; }

// fsdp/comm_stats.h
const CommStats& comm_stats(const ProcessGroup& group) { return detail::ProcessGroupAccess::impl(group).stats; }
void reset_comm_stats(ProcessGroup& group) { detail::ProcessGroupAccess::impl(group).stats = CommStats{}; }
int64_t collectives_called(const ProcessGroup& group) {
  return static_cast<int64_t>(detail::ProcessGroupAccess::impl(group).collectives_issued);
}

void record_timeline(ProcessGroup& group, bool enable) {
  ProcessGroup::Impl& g = detail::ProcessGroupAccess::impl(group);
  if (!enable) {
    g.timeline.reset();  // joins the observer once the transfers it waits on are done
  } else if (!g.timeline) {
    g.timeline = std::make_unique<comm::Timeline>();
  }
}

std::vector<CollectiveSpan> comm_timeline(const ProcessGroup& group) {
  const ProcessGroup::Impl& g = detail::ProcessGroupAccess::impl(group);
  std::vector<CollectiveSpan> out;
  if (!g.timeline) return out;
  comm::SpanLog& log = *g.timeline->log;
  std::lock_guard<std::mutex> lock(log.mutex);
  for (const auto& span : log.spans) out.push_back(*span);
  return out;
}

bool flush_profiler_reports(ProcessGroup& group, std::chrono::milliseconds timeout) {
  ProcessGroup::Impl& g = detail::ProcessGroupAccess::impl(group);
  // A lane runs its reports in the order they were queued: a no-op queued now runs after every one before it.
  std::vector<std::shared_ptr<comm::TaskState>> markers;
  for (auto& [collective, lane] : g.lanes) markers.push_back(lane->submit([] {}));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& marker : markers) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (!marker->wait_done(std::max(left, std::chrono::milliseconds(0)))) return false;
  }
  return true;
}

namespace comm {
void trace(ProcessGroup::Impl& g, Work::Impl& w, const char* collective, int64_t bytes, bool own_task) {
  w.collective = collective;
  if (auto profiler = listening_profiler()) {
    TransferInfo info;
    info.collective = collective;
    info.group = g.name;
    info.group_size = g.size;
    info.bytes = bytes;
    info.what = w.what;
    w.watch = std::make_shared<TransferWatch>(std::move(info), std::move(*profiler));
  }
  if (!g.timeline && !w.watch) return;
  std::shared_ptr<SpanLog> log;
  std::shared_ptr<CollectiveSpan> span;
  if (g.timeline) {
    log = g.timeline->log;
    span = std::make_shared<CollectiveSpan>();
    span->collective = collective;
    span->bytes = bytes;
    span->issued = CollectiveSpan::Clock::now();
    {
      std::lock_guard<std::mutex> lock(log->mutex);
      log->spans.push_back(span);
    }
    w.span_log = log;
    w.span = span;
  }
  if (own_task || w.pending.empty()) return;
  // The waiting task (bounded as Work::wait is) stamps completion.
  auto pending = std::move(w.pending);
  w.pending.clear();
  const auto bound = w.backstop();
  ProgressThread& waiter = w.watch ? g.lane(collective) : g.timeline->observer;
  w.task = waiter.submit([pending, log, span, watch = w.watch, bound] {
    for (const auto& p : pending) TORCH_CHECK(p->wait(bound), "the collective was aborted");
    if (span) log->stamp(*span, &CollectiveSpan::completed);
    if (watch) watch->completed_us = profiler_clock_us();
  });
  report_when_done(g, w);
}

void report_when_done(ProcessGroup::Impl& g, const Work::Impl& w) {
  if (!w.watch || !w.task) return;
  const auto bound = w.backstop();
  g.lane(w.collective).submit([task = w.task, watch = w.watch, bound] {
    try {
      if (!task->wait_done(bound)) return;
    } catch (const std::exception&) {
      return;  // failed: Work::wait reports it
    }
    report_transfer(*watch);
  });
}

// Out of band (comm/store_exchange.h): the group's local failure record and the rendezvous store.
std::optional<std::string> first_failure(const ProcessGroup& group) {
  const ProcessGroup::Impl& g = detail::ProcessGroupAccess::impl(group);
  std::lock_guard<std::mutex> lock(g.failures->mutex);
  return g.failures->first;
}

std::vector<std::string> exchange_through_store(ProcessGroup& group, const std::string& what, const std::string& value,
                                                std::chrono::milliseconds timeout) {
  ProcessGroup::Impl& g = detail::ProcessGroupAccess::impl(group);
  if (g.size == 1 || !g.store) return {value};
  const std::string base = c10::str("exchange/", g.store_exchanges++, "/");
  auto key = [&](int r) { return c10::str(base, r); };
  g.store->set(key(g.rank), std::vector<uint8_t>(value.begin(), value.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < g.size; ++r) keys.push_back(key(r));
  try {
    g.store->wait(keys, timeout);
  } catch (const std::exception& e) {
    // Name the ranks whose key is missing. If the store fails to answer once (its host, world rank 0, is gone or
    // stopped), ask it nothing more: each further check could block for the store's own timeout.
    std::string missing;
    bool store_answers = true;
    for (int r = 0; r < g.size; ++r) {
      bool present = false;
      if (store_answers) {
        try {
          present = g.store->check({key(r)});
        } catch (const std::exception&) {
          store_answers = false;
        }
      }
      if (!present) missing += c10::str(missing.empty() ? "" : ", ", r, " (world rank ", g.global_ranks[r], ")");
    }
    TORCH_CHECK(false, "fsdp: ", what, " on ", g.describe(), ": ranks [", missing, "] did not arrive within ",
                timeout.count(), " ms", store_answers ? "" : " (the rendezvous store stopped answering, so the "
                "ranks after the first unanswered one are listed as missing without being asked)",
                " (", message_of(e), ")");
  }
  std::vector<std::string> out;
  for (int r = 0; r < g.size; ++r) {
    const std::vector<uint8_t> bytes = g.store->get(key(r));
    out.emplace_back(bytes.begin(), bytes.end());
  }
  return out;
}

}  // namespace comm

Work ProcessGroup::all_gather_into_tensor(at::Tensor output, at::Tensor input) {
  Impl& g = *impl_;
  const char* coll = "all_gather_into_tensor";
  check_tensor(g, coll, "output", output);
  check_tensor(g, coll, "input", input);
  check_same_dtype(g, coll, output, input);
  TORCH_CHECK(output.numel() == g.size * input.numel(), "fsdp: ", coll, " on ", g.describe(), ": output has ",
              output.numel(), " elements but needs size() * input.numel() = ", g.size, " * ", input.numel());
  g.stats.all_gather_calls++;
  if (input.numel() == 0) return Work();
  g.stats.bytes_sent += comm::all_gather_bytes(nbytes(input), g.size);
  return g.collectives->all_gather_into_tensor(g, std::move(output), std::move(input));
}

Work ProcessGroup::reduce_scatter_tensor(at::Tensor output, at::Tensor input, ReduceOp op) {
  Impl& g = *impl_;
  const char* coll = "reduce_scatter_tensor";
  check_tensor(g, coll, "output", output);
  check_tensor(g, coll, "input", input);
  check_same_dtype(g, coll, output, input);
  check_op(g, coll, op, input);
  TORCH_CHECK(input.numel() == g.size * output.numel(), "fsdp: ", coll, " on ", g.describe(), ": input has ",
              input.numel(), " elements but needs size() * output.numel() = ", g.size, " * ", output.numel(),
              " (uneven inputs must be zero-padded by the caller to a multiple of the group size)");
  g.stats.reduce_scatter_calls++;
  if (input.numel() == 0) return Work();
  g.stats.bytes_sent += comm::reduce_scatter_bytes(nbytes(input), g.size);
  return g.collectives->reduce_scatter_tensor(g, std::move(output), std::move(input), op);
}

Work ProcessGroup::all_reduce(at::Tensor tensor, ReduceOp op) {
  Impl& g = *impl_;
  const char* coll = "all_reduce";
  check_tensor(g, coll, "tensor", tensor);
  check_op(g, coll, op, tensor);
  g.stats.all_reduce_calls++;
  if (tensor.numel() == 0) return Work();
  g.stats.bytes_sent += comm::all_reduce_bytes(nbytes(tensor), g.size);
  return g.collectives->all_reduce(g, std::move(tensor), op);
}

Work ProcessGroup::broadcast(at::Tensor tensor, int root) {
  Impl& g = *impl_;
  const char* coll = "broadcast";
  check_tensor(g, coll, "tensor", tensor);
  TORCH_CHECK(root >= 0 && root < g.size, "fsdp: ", coll, " on ", g.describe(), ": root ", root,
              " is not a rank of this group of size ", g.size, " (root is a group rank, not a world rank)");
  g.stats.broadcast_calls++;
  if (tensor.numel() == 0) return Work();
  g.stats.bytes_sent += comm::broadcast_bytes(nbytes(tensor), g.size, g.rank == root);
  return g.collectives->broadcast(g, std::move(tensor), root);
}

namespace {
// Point-to-point tags live above the exchanges' (which are below 2^30, numbered alike on every rank).
constexpr int kP2PTagBase = 1 << 30;
constexpr int kP2PTagLimit = 1 << 28;

void check_p2p(const ProcessGroup::Impl& g, const char* what, const at::Tensor& tensor, int peer, int tag) {
  check_tensor(g, what, "tensor", tensor);
  TORCH_CHECK(peer >= 0 && peer < g.size && peer != g.rank, "fsdp: ", what, " on ", g.describe(), ": peer ", peer,
              " must be another rank of this group of size ", g.size, " (a group rank, not a world rank)");
  TORCH_CHECK(tag >= 0 && tag < kP2PTagLimit, "fsdp: ", what, " on ", g.describe(), ": tag ", tag,
              " is outside [0, 2^28)");
}
}  // namespace

Work ProcessGroup::send(at::Tensor tensor, int peer, int tag) {
  Impl& g = *impl_;
  check_p2p(g, "send", tensor, peer, tag);
  g.stats.send_calls++;
  if (tensor.numel() == 0) return Work();
  g.stats.bytes_sent += nbytes(tensor);
  g.stats.p2p_bytes_sent += nbytes(tensor);
  return g.collectives->send(g, std::move(tensor), peer, kP2PTagBase + tag);
}

Work ProcessGroup::recv(at::Tensor tensor, int peer, int tag) {
  Impl& g = *impl_;
  check_p2p(g, "recv", tensor, peer, tag);
  g.stats.recv_calls++;
  if (tensor.numel() == 0) return Work();
  g.stats.p2p_bytes_received += nbytes(tensor);
  return g.collectives->recv(g, std::move(tensor), peer, kP2PTagBase + tag);
}

Work ProcessGroup::all_to_all(at::Tensor output, at::Tensor input) {
  Impl& g = *impl_;
  const char* coll = "all_to_all";
  check_tensor(g, coll, "output", output);
  check_tensor(g, coll, "input", input);
  check_same_dtype(g, coll, output, input);
  TORCH_CHECK(output.numel() == input.numel() && input.numel() % g.size == 0, "fsdp: ", coll, " on ",
              g.describe(), ": input (", input.numel(), " elements) and output (", output.numel(),
              " elements) must have the same size, a multiple of the group size ", g.size);
  g.stats.all_to_all_calls++;
  if (input.numel() == 0) return Work();
  g.stats.bytes_sent += comm::all_to_all_bytes(nbytes(input), g.size);
  return g.collectives->all_to_all(g, std::move(output), std::move(input));
}

Work ProcessGroup::barrier() {
  Impl& g = *impl_;
  g.stats.barrier_calls++;
  return g.collectives->barrier(g);
}

}  // namespace fsdp
