// fsdp::ProcessGroup collectives on top of a c10d::Backend (Gloo on CPU).
//
// Rules every collective follows:
//  - Tensors must be contiguous and on the group's device type; we raise instead of copying silently, because
//    FSDP works on flat buffers and a hidden copy would hide the result from the caller's tensor.
//  - Size-1 groups and empty tensors take a local fast path (copy or no-op): no communication, same result.
//    Every rank of a group sees the same sizes, so this never desynchronises the group.
//  - Calls and bytes are counted per group (bytes from comm/byte_model.h).
//  - Every c10d call gets the group's current timeout explicitly.

#include "comm/byte_model.h"
#include "comm/process_group_impl.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

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

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:  // Avg = Sum, then divide locally (Gloo's AVG support varies by version)
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::Max: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::Min: return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  TORCH_CHECK(false, "fsdp: unknown ReduceOp");
}

Work completed() { return Work(); }

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
const CommStats& ProcessGroup::stats() const { return impl_->stats; }
void ProcessGroup::reset_stats() { impl_->stats = CommStats{}; }

void ProcessGroup::set_timeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "fsdp: set_timeout on ", impl_->describe(), ": timeout must be positive, got ",
              timeout.count(), " ms");
  impl_->timeout = timeout;
  if (impl_->backend) impl_->backend->setTimeout(timeout);
}
std::chrono::milliseconds ProcessGroup::timeout() const { return impl_->timeout; }
void ProcessGroup::record_timeline(bool enable) {
  if (!enable) {
    impl_->timeline.reset();  // joins the observer once the transfers it waits on are done
  } else if (!impl_->timeline) {
    impl_->timeline = std::make_unique<comm::Timeline>();
  }
}

std::vector<CollectiveSpan> ProcessGroup::timeline() const {
  std::vector<CollectiveSpan> out;
  if (!impl_->timeline) return out;
  comm::SpanLog& log = *impl_->timeline->log;
  std::lock_guard<std::mutex> lock(log.mutex);
  for (const auto& span : log.spans) out.push_back(*span);
  return out;
}

namespace comm {
void trace(ProcessGroup::Impl& g, Work::Impl& w, const char* collective, int64_t bytes, bool own_task) {
  if (!g.timeline) return;
  auto log = g.timeline->log;
  auto span = std::make_shared<CollectiveSpan>();
  span->collective = collective;
  span->bytes = bytes;
  span->issued = CollectiveSpan::Clock::now();
  {
    std::lock_guard<std::mutex> lock(log->mutex);
    log->spans.push_back(span);
  }
  w.span_log = log;
  w.span = span;
  if (own_task || w.pending.empty()) return;
  // The observer waits on the transfers (the same bound as Work::wait's backstop) and stamps completion.
  auto pending = std::move(w.pending);
  w.pending.clear();
  const auto bound = w.timeout + std::max(std::chrono::milliseconds(1000), w.timeout / 10);
  w.task = g.timeline->observer.submit([pending, log, span, bound] {
    for (const auto& p : pending) TORCH_CHECK(p->wait(bound), "the collective was aborted");
    log->stamp(*span, &CollectiveSpan::completed);
  });
}
}  // namespace comm

int64_t ProcessGroup::collectives_called() const { return static_cast<int64_t>(impl_->collectives_issued); }

std::optional<std::string> ProcessGroup::first_failure() const {
  std::lock_guard<std::mutex> lock(impl_->failures->mutex);
  return impl_->failures->first;
}

std::vector<std::string> ProcessGroup::exchange_through_store(const std::string& what, const std::string& value,
                                                              std::chrono::milliseconds timeout) {
  Impl& g = *impl_;
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

namespace {

std::string label(const ProcessGroup::Impl& g, const char* coll, const std::string& detail) {
  return c10::str(coll, "(", detail, ") on ", g.describe());
}

Work make_work(ProcessGroup::Impl& g, const char* collective, int64_t bytes, std::string what,
               c10::intrusive_ptr<c10d::Work> w, std::function<void()> on_complete = nullptr) {
  auto impl = std::make_shared<Work::Impl>();
  impl->what = std::move(what);
  impl->pending.push_back(std::move(w));
  impl->on_complete = std::move(on_complete);
  impl->timeout = g.timeout;
  comm::stamp(*impl, g);
  impl->cpu_blocking_wait = g.cpu_blocking_wait;
  comm::trace(g, *impl, collective, bytes);
  return Work(std::move(impl));
}


}  // namespace

Work ProcessGroup::all_gather_into_tensor(at::Tensor output, at::Tensor input) {
  Impl& g = *impl_;
  const char* coll = "all_gather_into_tensor";
  check_tensor(g, coll, "output", output);
  check_tensor(g, coll, "input", input);
  check_same_dtype(g, coll, output, input);
  TORCH_CHECK(output.numel() == g.size * input.numel(), "fsdp: ", coll, " on ", g.describe(), ": output has ",
              output.numel(), " elements but needs size() * input.numel() = ", g.size, " * ", input.numel());
  g.stats.all_gather_calls++;
  if (g.size == 1 || input.numel() == 0) {
    if (output.data_ptr() != input.data_ptr()) output.view({-1}).copy_(input.view({-1}));
    return completed();
  }
  g.stats.bytes_sent += comm::all_gather_bytes(nbytes(input), g.size);
  const auto what = label(g, coll, c10::str(input.numel(), " x ", input.scalar_type(), " per rank"));
  at::Tensor out_flat = output.view({-1});
  at::Tensor in_flat = input.view({-1});
  const int64_t n = in_flat.numel();
  at::Tensor own_slot = out_flat.narrow(0, g.rank * n, n);
  if (g.native_collectives) {
    // NCCL: one collective kernel on the backend's stream (in place when `input` is `output`'s own slot).
    c10d::AllgatherOptions opts;
    opts.timeout = g.timeout;
    auto w = launch(what, [&] { return g.backend->_allgather_base(out_flat, in_flat, opts); });
    return make_work(g, coll, nbytes(input), what, std::move(w), [output, input] {});
  }
  if (own_slot.data_ptr() != in_flat.data_ptr()) own_slot.copy_(in_flat);
  // Direct exchange: this rank's input goes to every peer and every peer's input lands straight in its
  // slot of `output`. c10d Gloo's _allgather_base would gather into a temporary flat buffer as large as
  // the output and copy out afterwards (one extra unsharded-size allocation per all-gather in flight); the
  // exchange needs none and sends the same (size - 1) x input bytes.
  auto impl = std::make_shared<Work::Impl>();
  impl->what = what;
  impl->timeout = g.timeout;
  comm::stamp(*impl, g);
  const int tag = static_cast<int>(g.next_p2p_tag++ & 0x3fffffff);
  for (int step = 1; step < g.size; ++step) {
    // Staggered peer order spreads the traffic instead of everyone sending to rank 0 first.
    const int to = (g.rank + step) % g.size;
    const int from = (g.rank - step + g.size) % g.size;
    std::vector<at::Tensor> send_buf{in_flat};
    std::vector<at::Tensor> recv_buf{out_flat.narrow(0, static_cast<int64_t>(from) * n, n)};
    impl->pending.push_back(launch(what, [&] { return g.backend->send(send_buf, to, tag); }));
    impl->pending.push_back(launch(what, [&] { return g.backend->recv(recv_buf, from, tag); }));
  }
  // The exchange reads `input` and writes `output` until it completes: keep both alive with the work.
  impl->on_complete = [output, input] {};
  comm::trace(g, *impl, coll, nbytes(input));
  return Work(std::move(impl));
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
  if (g.size == 1 || input.numel() == 0) {
    // One contributor: Sum/Avg/Max/Min of a single value is the value.
    if (output.data_ptr() != input.data_ptr()) output.view({-1}).copy_(input.view({-1}));
    return completed();
  }
  g.stats.bytes_sent += comm::reduce_scatter_bytes(nbytes(input), g.size);
  const auto what = label(g, coll, c10::str(to_string(op), ", ", input.numel(), " x ", input.scalar_type()));
  // Gloo's _reduce_scatter_base drops the op (always a sum; PyTorch issue 162338): Max/Min keep the exchange.
  const bool native = g.native_collectives && (g.native_avg || op == ReduceOp::Sum || op == ReduceOp::Avg);
  if (native) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = op == ReduceOp::Avg && g.native_avg ? c10d::ReduceOp(c10d::ReduceOp::AVG) : to_c10d(op);
    opts.timeout = g.timeout;
    at::Tensor out_flat = output.view({-1});
    at::Tensor in_flat = input.view({-1});
    auto w = launch(what, [&] { return g.backend->_reduce_scatter_base(out_flat, in_flat, opts); });
    std::function<void()> post = [output, input] {};
    if (op == ReduceOp::Avg && !g.native_avg) {
      const int64_t s = g.size;
      post = [output, input, s]() mutable { output.div_(s); };
    }
    return make_work(g, coll, nbytes(input), what, std::move(w), std::move(post));
  }
  // The exchange hands tensor pointers to Gloo's send/recv, which read host memory: never with CUDA tensors.
  TORCH_CHECK(!g.device.is_cuda(), "fsdp: ", what, ": ", to_string(op), " is not supported on a Gloo group on ",
              g.device, " (c10d Gloo's reduce-scatter only sums; use Sum or Avg, or NCCL)");
  // Direct exchange reduced piece by piece as it arrives, on the group's progress thread
  // (comm/reduce_scatter.cpp).
  return comm::pipelined_reduce_scatter(g, what, output, input, op);
}

Work ProcessGroup::all_reduce(at::Tensor tensor, ReduceOp op) {
  Impl& g = *impl_;
  const char* coll = "all_reduce";
  check_tensor(g, coll, "tensor", tensor);
  check_op(g, coll, op, tensor);
  g.stats.all_reduce_calls++;
  if (g.size == 1 || tensor.numel() == 0) return completed();
  g.stats.bytes_sent += comm::all_reduce_bytes(nbytes(tensor), g.size);
  const auto what = label(g, coll, c10::str(to_string(op), ", ", tensor.numel(), " x ", tensor.scalar_type()));
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op == ReduceOp::Avg && g.native_avg ? c10d::ReduceOp(c10d::ReduceOp::AVG) : to_c10d(op);
  opts.timeout = g.timeout;
  auto w = launch(what, [&] { return g.backend->allreduce(ts, opts); });
  std::function<void()> post;
  if (op == ReduceOp::Avg && !g.native_avg) {
    const int64_t s = g.size;
    post = [tensor, s]() mutable { tensor.div_(s); };
  }
  return make_work(g, coll, nbytes(tensor), what, std::move(w), std::move(post));
}

Work ProcessGroup::broadcast(at::Tensor tensor, int root) {
  Impl& g = *impl_;
  const char* coll = "broadcast";
  check_tensor(g, coll, "tensor", tensor);
  TORCH_CHECK(root >= 0 && root < g.size, "fsdp: ", coll, " on ", g.describe(), ": root ", root,
              " is not a rank of this group of size ", g.size, " (root is a group rank, not a world rank)");
  g.stats.broadcast_calls++;
  if (g.size == 1 || tensor.numel() == 0) return completed();
  g.stats.bytes_sent += comm::broadcast_bytes(nbytes(tensor), g.size, g.rank == root);
  const auto what = label(g, coll, c10::str("root ", root, ", ", tensor.numel(), " x ", tensor.scalar_type()));
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.rootTensor = 0;
  opts.timeout = g.timeout;
  auto w = launch(what, [&] { return g.backend->broadcast(ts, opts); });
  return make_work(g, coll, nbytes(tensor), what, std::move(w));
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
  if (g.size == 1 || input.numel() == 0) {
    if (output.data_ptr() != input.data_ptr()) output.view({-1}).copy_(input.view({-1}));
    return completed();
  }
  g.stats.bytes_sent += comm::all_to_all_bytes(nbytes(input), g.size);
  const auto what = label(g, coll, c10::str(input.numel(), " x ", input.scalar_type()));
  at::Tensor out_flat = output.view({-1});
  at::Tensor in_flat = input.view({-1});
  std::vector<int64_t> equal_splits;
  c10d::AllToAllOptions opts;
  opts.timeout = g.timeout;
  auto w = launch(what, [&] { return g.backend->alltoall_base(out_flat, in_flat, equal_splits, equal_splits, opts); });
  return make_work(g, coll, nbytes(input), what, std::move(w));
}

Work ProcessGroup::barrier() {
  Impl& g = *impl_;
  g.stats.barrier_calls++;
  if (g.size == 1) return completed();
  const auto what = label(g, "barrier", "");
  c10d::BarrierOptions opts;
  opts.timeout = g.timeout;
  auto w = launch(what, [&] { return g.backend->barrier(opts); });
  return make_work(g, "barrier", 0, what, std::move(w));
}

}  // namespace fsdp
