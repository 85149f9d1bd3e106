// The ways a process group runs its collectives (see comm/collective_backend.h): one class per way, picked once
// by make_collective_backend when the group is created.
//
// Every c10d call gets the group's current timeout explicitly. Collectives that reach a communicator are
// numbered (comm::stamp) and traced (comm::trace) in the order they are issued, the same on every rank.

#include "comm/collective_backend.h"
#include "comm/process_group_impl.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace fsdp::comm {
namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

std::string label(const ProcessGroup::Impl& g, const char* coll, const std::string& detail) {
  return c10::str(coll, "(", detail, ") on ", g.describe());
}
std::string all_gather_label(const ProcessGroup::Impl& g, const at::Tensor& input) {
  return label(g, "all_gather_into_tensor", c10::str(input.numel(), " x ", input.scalar_type(), " per rank"));
}
std::string reduce_scatter_label(const ProcessGroup::Impl& g, const at::Tensor& input, ReduceOp op) {
  return label(g, "reduce_scatter_tensor", c10::str(to_string(op), ", ", input.numel(), " x ", input.scalar_type()));
}

// Copies `input` into `output` unless they are the same memory (one contributor: the collective's result is
// its own input).
void copy_unless_aliased(at::Tensor& output, const at::Tensor& input) {
  if (output.data_ptr() != input.data_ptr()) output.view({-1}).copy_(input.view({-1}));
}

// Size-1 groups: every collective's result is this rank's own contribution, so nothing is sent and no
// communicator exists. Sum/Avg/Max/Min of a single value is the value.
class LocalCollectives final : public CollectiveBackend {
 public:
  Work all_gather_into_tensor(ProcessGroup::Impl&, at::Tensor output, at::Tensor input) override {
    copy_unless_aliased(output, input);
    return Work();
  }
  Work reduce_scatter_tensor(ProcessGroup::Impl&, at::Tensor output, at::Tensor input, ReduceOp) override {
    copy_unless_aliased(output, input);
    return Work();
  }
  Work all_reduce(ProcessGroup::Impl&, at::Tensor, ReduceOp) override { return Work(); }
  Work broadcast(ProcessGroup::Impl&, at::Tensor, int) override { return Work(); }
  Work all_to_all(ProcessGroup::Impl&, at::Tensor output, at::Tensor input) override {
    copy_unless_aliased(output, input);
    return Work();
  }
  Work all_to_all_uneven(ProcessGroup::Impl&, at::Tensor output, at::Tensor input, std::vector<int64_t>,
                         std::vector<int64_t>) override {
    copy_unless_aliased(output, input);  // one rank: its own rows, all of them
    return Work();
  }
  Work barrier(ProcessGroup::Impl&) override { return Work(); }
  Work send(ProcessGroup::Impl& g, at::Tensor, int, int) override { no_peer(g); }
  Work recv(ProcessGroup::Impl& g, at::Tensor, int, int) override { no_peer(g); }
  void set_timeout(std::chrono::milliseconds) override {}

 private:
  [[noreturn]] static void no_peer(const ProcessGroup::Impl& g) {
    TORCH_CHECK(false, "fsdp: point-to-point on ", g.describe(), ", which has no other rank");
  }
};

// A fake group's (fsdp/fake_process_group.h): no peers; every collective completes at once and leaves its outputs
// as they are (they may be meta tensors). Point-to-point too: there is no one to wait for.
class FakeCollectives final : public CollectiveBackend {
 public:
  Work all_gather_into_tensor(ProcessGroup::Impl&, at::Tensor, at::Tensor) override { return Work(); }
  Work reduce_scatter_tensor(ProcessGroup::Impl&, at::Tensor, at::Tensor, ReduceOp) override { return Work(); }
  Work all_reduce(ProcessGroup::Impl&, at::Tensor, ReduceOp) override { return Work(); }
  Work broadcast(ProcessGroup::Impl&, at::Tensor, int) override { return Work(); }
  Work all_to_all(ProcessGroup::Impl&, at::Tensor, at::Tensor) override { return Work(); }
  Work all_to_all_uneven(ProcessGroup::Impl&, at::Tensor, at::Tensor, std::vector<int64_t>,
                         std::vector<int64_t>) override {
    return Work();
  }
  Work barrier(ProcessGroup::Impl&) override { return Work(); }
  Work send(ProcessGroup::Impl&, at::Tensor, int, int) override { return Work(); }
  Work recv(ProcessGroup::Impl&, at::Tensor, int, int) override { return Work(); }
  void set_timeout(std::chrono::milliseconds) override {}
};

// c10d's own collective for every call.
class C10dCollectives : public CollectiveBackend {
 public:
  // Facts about the communicator, fixed by its kind.
  struct Traits {
    bool averages = false;      // Avg inside the collective (NCCL's ncclAvg); else Sum, then divide locally
    bool blocking_wait = true;  // c10d's wait blocks the CPU (Gloo); NCCL's makes the current stream wait
    // Gloo's _reduce_scatter_base always sums, whatever op it is given (PyTorch issue 162338).
    bool reduce_scatter_sums_only = false;
    bool p2p_host_only = false;  // point-to-point reads and writes host memory only (Gloo)
  };

  C10dCollectives(c10::intrusive_ptr<c10d::Backend> communicator, Traits traits)
      : communicator_(std::move(communicator)), traits_(traits) {}

  Work all_gather_into_tensor(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input) override {
    // One collective kernel on the backend's stream (in place when `input` is `output`'s own slot).
    const std::string what = all_gather_label(g, input);
    at::Tensor out_flat = output.view({-1});
    at::Tensor in_flat = input.view({-1});
    c10d::AllgatherOptions opts;
    opts.timeout = g.timeout;
    auto w = launch(what, [&] { return communicator_->_allgather_base(out_flat, in_flat, opts); });
    // The collective reads `input` and writes `output` until it completes: keep both alive with the work.
    return make_work(g, "all_gather_into_tensor", nbytes(input), what, std::move(w), [output, input] {});
  }

  Work reduce_scatter_tensor(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input, ReduceOp op) override {
    const std::string what = reduce_scatter_label(g, input, op);
    if (traits_.reduce_scatter_sums_only && (op == ReduceOp::Max || op == ReduceOp::Min))
      return reduce_scatter_op_not_native(g, what, output, input, op);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = g.timeout;
    at::Tensor out_flat = output.view({-1});
    at::Tensor in_flat = input.view({-1});
    auto w = launch(what, [&] { return communicator_->_reduce_scatter_base(out_flat, in_flat, opts); });
    return make_work(g, "reduce_scatter_tensor", nbytes(input), what, std::move(w),
                     divide_after(g, op, output, [output, input] {}));
  }

  Work all_reduce(ProcessGroup::Impl& g, at::Tensor tensor, ReduceOp op) override {
    const auto what =
        label(g, "all_reduce", c10::str(to_string(op), ", ", tensor.numel(), " x ", tensor.scalar_type()));
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = g.timeout;
    auto w = launch(what, [&] { return communicator_->allreduce(ts, opts); });
    return make_work(g, "all_reduce", nbytes(tensor), what, std::move(w), divide_after(g, op, tensor, nullptr));
  }

  Work broadcast(ProcessGroup::Impl& g, at::Tensor tensor, int root) override {
    const auto what = label(g, "broadcast", c10::str("root ", root, ", ", tensor.numel(), " x ", tensor.scalar_type()));
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.rootTensor = 0;
    opts.timeout = g.timeout;
    auto w = launch(what, [&] { return communicator_->broadcast(ts, opts); });
    return make_work(g, "broadcast", nbytes(tensor), what, std::move(w));
  }

  Work all_to_all(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input) override {
    const auto what = label(g, "all_to_all", c10::str(input.numel(), " x ", input.scalar_type()));
    at::Tensor out_flat = output.view({-1});
    at::Tensor in_flat = input.view({-1});
    std::vector<int64_t> equal_splits;
    c10d::AllToAllOptions opts;
    opts.timeout = g.timeout;
    auto w = launch(what, [&] {
      return communicator_->alltoall_base(out_flat, in_flat, equal_splits, equal_splits, opts);
    });
    return make_work(g, "all_to_all", nbytes(input), what, std::move(w));
  }

  Work all_to_all_uneven(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input,
                         std::vector<int64_t> output_splits, std::vector<int64_t> input_splits) override {
    const auto what = label(g, "all_to_all", c10::str("uneven, ", input.size(0), " rows out, ", output.size(0),
                                                      " rows in, ", input.scalar_type()));
    c10d::AllToAllOptions opts;
    opts.timeout = g.timeout;
    auto w = launch(what, [&] {
      return communicator_->alltoall_base(output, input, output_splits, input_splits, opts);
    });
    return make_work(g, "all_to_all", nbytes(input), what, std::move(w), [output, input] {});
  }

  Work barrier(ProcessGroup::Impl& g) override {
    const auto what = label(g, "barrier", "");
    c10d::BarrierOptions opts;
    opts.timeout = g.timeout;
    auto w = launch(what, [&] { return communicator_->barrier(opts); });
    return make_work(g, "barrier", 0, what, std::move(w));
  }

  Work send(ProcessGroup::Impl& g, at::Tensor tensor, int peer, int tag) override {
    const auto what = label(g, "send", c10::str("to rank ", peer, ", ", tensor.numel(), " x ", tensor.scalar_type()));
    // Gloo's point-to-point reads host memory only: a CUDA tensor goes through a host copy.
    at::Tensor wire = traits_.p2p_host_only && !tensor.is_cpu() ? tensor.to(at::kCPU) : tensor;
    std::vector<at::Tensor> ts{wire};
    auto w = launch(what, [&] { return communicator_->send(ts, peer, tag); });
    return make_work(g, "send", nbytes(tensor), what, std::move(w), [wire] {}, /*numbered=*/false);
  }

  Work recv(ProcessGroup::Impl& g, at::Tensor tensor, int peer, int tag) override {
    const auto what =
        label(g, "recv", c10::str("from rank ", peer, ", ", tensor.numel(), " x ", tensor.scalar_type()));
    const bool staged = traits_.p2p_host_only && !tensor.is_cpu();
    at::Tensor wire = staged ? at::empty(tensor.sizes(), tensor.options().device(at::kCPU)) : tensor;
    std::vector<at::Tensor> ts{wire};
    auto w = launch(what, [&] { return communicator_->recv(ts, peer, tag); });
    std::function<void()> done = [wire, tensor]() mutable {
      if (!wire.is_same(tensor)) tensor.copy_(wire);
    };
    return make_work(g, "recv", nbytes(tensor), what, std::move(w), std::move(done), /*numbered=*/false);
  }

  void set_timeout(std::chrono::milliseconds timeout) override { communicator_->setTimeout(timeout); }

 protected:
  // A Max/Min reduce-scatter the communicator would silently turn into a sum. Here: an error (Gloo on CUDA
  // tensors has no other way); Gloo on the CPU overrides it with the exchange.
  virtual Work reduce_scatter_op_not_native(ProcessGroup::Impl& g, const std::string& what, const at::Tensor& output,
                                            const at::Tensor& input, ReduceOp op) {
    TORCH_CHECK(false, "fsdp: ", what, ": ", to_string(op), " is not supported on a Gloo group on ", g.device,
                " (c10d Gloo's reduce-scatter only sums; use Sum or Avg, or NCCL)");
  }

  // `numbered`: a collective every rank of the group calls (stamped with the group's sequence number, which
  // missing-rank reports compare); point-to-point transfers involve two ranks and are not numbered.
  Work make_work(ProcessGroup::Impl& g, const char* collective, int64_t bytes, std::string what,
                 c10::intrusive_ptr<c10d::Work> w, std::function<void()> on_complete = nullptr,
                 bool numbered = true) const {
    auto impl = std::make_shared<Work::Impl>();
    impl->what = std::move(what);
    impl->pending.push_back(std::move(w));
    impl->on_complete = std::move(on_complete);
    impl->timeout = g.timeout;
    impl->cpu_blocking_wait = traits_.blocking_wait;
    if (numbered) comm::stamp(*impl, g);
    comm::trace(g, *impl, collective, bytes);
    return Work(std::move(impl));
  }

  const c10::intrusive_ptr<c10d::Backend>& communicator() const { return communicator_; }

 private:
  c10d::ReduceOp reduce_op(ReduceOp op) const {
    switch (op) {
      case ReduceOp::Sum: return c10d::ReduceOp(c10d::ReduceOp::SUM);
      case ReduceOp::Avg:
        // Without a native average: Sum here, divided in divide_after (Gloo's AVG support varies by version).
        return c10d::ReduceOp(traits_.averages ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM);
      case ReduceOp::Max: return c10d::ReduceOp(c10d::ReduceOp::MAX);
      case ReduceOp::Min: return c10d::ReduceOp(c10d::ReduceOp::MIN);
    }
    TORCH_CHECK(false, "fsdp: unknown ReduceOp");
  }

  // The completion step of a reduction: `keep_alive` (holds the tensors the collective uses), then the division
  // of an Avg the communicator ran as a Sum.
  std::function<void()> divide_after(const ProcessGroup::Impl& g, ReduceOp op, at::Tensor result,
                                     std::function<void()> keep_alive) const {
    if (op != ReduceOp::Avg || traits_.averages) return keep_alive;
    const int64_t s = g.size;
    return [result, s, keep_alive]() mutable {
      if (keep_alive) keep_alive();
      result.div_(s);
    };
  }

  c10::intrusive_ptr<c10d::Backend> communicator_;
  Traits traits_;
};

// Gloo on CPU tensors, the default: all-gather and reduce-scatter as direct exchanges over Gloo's point-to-point
// (the rest as c10d Gloo's own collectives).
class GlooExchangeCollectives final : public C10dCollectives {
 public:
  using C10dCollectives::C10dCollectives;

  Work all_gather_into_tensor(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input) override {
    // This rank's input goes to every peer and every peer's input lands straight in its slot of `output`.
    // c10d Gloo's _allgather_base would gather into a temporary flat buffer as large as the output and copy
    // out afterwards (one extra unsharded-size allocation per all-gather in flight); the exchange needs none
    // and sends the same (size - 1) x input bytes.
    at::Tensor out_flat = output.view({-1});
    at::Tensor in_flat = input.view({-1});
    const int64_t n = in_flat.numel();
    at::Tensor own_slot = out_flat.narrow(0, g.rank * n, n);
    if (own_slot.data_ptr() != in_flat.data_ptr()) own_slot.copy_(in_flat);
    auto impl = std::make_shared<Work::Impl>();
    impl->what = all_gather_label(g, input);
    impl->timeout = g.timeout;
    comm::stamp(*impl, g);
    const int tag = static_cast<int>(g.next_p2p_tag++ & 0x3fffffff);
    const auto& gloo = communicator();
    for (int step = 1; step < g.size; ++step) {
      // Staggered peer order spreads the traffic instead of everyone sending to rank 0 first.
      const int to = (g.rank + step) % g.size;
      const int from = (g.rank - step + g.size) % g.size;
      std::vector<at::Tensor> send_buf{in_flat};
      std::vector<at::Tensor> recv_buf{out_flat.narrow(0, static_cast<int64_t>(from) * n, n)};
      impl->pending.push_back(launch(impl->what, [&] { return gloo->send(send_buf, to, tag); }));
      impl->pending.push_back(launch(impl->what, [&] { return gloo->recv(recv_buf, from, tag); }));
    }
    // The exchange reads `input` and writes `output` until it completes: keep both alive with the work.
    impl->on_complete = [output, input] {};
    comm::trace(g, *impl, "all_gather_into_tensor", nbytes(input));
    return Work(std::move(impl));
  }

  Work reduce_scatter_tensor(ProcessGroup::Impl& g, at::Tensor output, at::Tensor input, ReduceOp op) override {
    // Exactly the bytes of a ring reduce-scatter and every op honoured, where c10d Gloo's moves twice the bytes
    // (an all-reduce) and only sums.
    return pipelined_reduce_scatter(g, communicator(), reduce_scatter_label(g, input, op), output, input, op);
  }
};

// Gloo on CPU tensors under FSDP_NATIVE_COLLECTIVES=1: c10d's own collectives, as NCCL runs them, except the
// Max/Min reduce-scatters c10d Gloo cannot do, which keep the exchange.
class GlooNativeCollectives final : public C10dCollectives {
 public:
  using C10dCollectives::C10dCollectives;

 protected:
  Work reduce_scatter_op_not_native(ProcessGroup::Impl& g, const std::string& what, const at::Tensor& output,
                                    const at::Tensor& input, ReduceOp op) override {
    return pipelined_reduce_scatter(g, communicator(), what, output, input, op);
  }
};

}  // namespace

std::unique_ptr<CollectiveBackend> make_collective_backend(c10::intrusive_ptr<c10d::Backend> communicator,
                                                           const std::string& kind, c10::Device device,
                                                           bool native_on_gloo_cpu) {
  if (kind == "fake") return std::make_unique<FakeCollectives>();
  if (!communicator) return std::make_unique<LocalCollectives>();
  if (kind == "nccl") {
    return std::make_unique<C10dCollectives>(
        std::move(communicator),
        C10dCollectives::Traits{/*averages=*/true, /*blocking_wait=*/false, /*reduce_scatter_sums_only=*/false,
                                /*p2p_host_only=*/false});
  }
  TORCH_CHECK(kind == "gloo", "fsdp: unknown communicator kind '", kind, "' (expected 'gloo' or 'nccl')");
  const C10dCollectives::Traits gloo{/*averages=*/false, /*blocking_wait=*/true, /*reduce_scatter_sums_only=*/true,
                                    /*p2p_host_only=*/true};
  // Gloo on CUDA tensors: c10d Gloo's own collectives (they stage through host memory); the exchanges hand tensor
  // pointers to Gloo's point-to-point send/recv, which read host memory only.
  if (device.is_cuda()) return std::make_unique<C10dCollectives>(std::move(communicator), gloo);
  if (native_on_gloo_cpu) return std::make_unique<GlooNativeCollectives>(std::move(communicator), gloo);
  return std::make_unique<GlooExchangeCollectives>(std::move(communicator), gloo);
}

}  // namespace fsdp::comm
