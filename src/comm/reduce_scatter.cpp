// Reduce-scatter as a pipelined direct exchange over Gloo point-to-point.
//
// Every rank sends chunk r of its input straight to rank r, split into pieces; each rank reduces the pieces
// it receives into its output as they arrive. Why not c10d's alltoall_base plus a local sum (the previous
// implementation): that needs a receive buffer as large as the whole input, runs the sum only after the last
// byte arrived, and upcasts the whole [size, n] buffer to fp32 for bf16/fp16 — at 2 ranks it reached a third
// of the all-gather's bandwidth. Here:
//  - the bytes on the wire are the same ((s-1)/s of the input: each chunk travels once, to its owner);
//  - receive memory is bounded: `depth` pieces per peer (FSDP_RS_PIECE_BYTES, default 1 MiB, and
//    FSDP_RS_PIPELINE_DEPTH, default 2; both must be equal on every rank, as any launcher's environment is);
//  - Gloo's transport thread receives piece j+1 while this group's progress thread reduces piece j, and the
//    caller's thread is free until wait();
//  - low-precision floats (bf16, fp16) accumulate in an fp32 scratch of one piece and are rounded once, as
//    before (256 + 1 + 1 + 1 in bf16 gives bf16(259));
//  - contributions are added in rank order 0, 1, ..., s-1 whatever order they arrive in, so the result is
//    deterministic and equal to the previous sum over rows.
// Gloo matches a send with the receive of the same (peer, tag) and only transfers once the receive is posted,
// so sending every piece up front costs no memory on the receiver.

#include "comm/process_group_impl.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace fsdp::comm {
namespace {

int64_t env_int(const char* name, int64_t fallback, int64_t min_value) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(v, &end, 10);
  TORCH_CHECK(end && *end == '\0' && parsed >= min_value, "fsdp: ", name, "=", v, " must be an integer >= ",
              min_value);
  return parsed;
}

int64_t piece_bytes() {
  static const int64_t bytes = env_int("FSDP_RS_PIECE_BYTES", int64_t{1} << 20, 1);
  return bytes;
}

int64_t pipeline_depth() {
  static const int64_t depth = env_int("FSDP_RS_PIPELINE_DEPTH", 2, 1);
  return depth;
}

// Everything one reduce-scatter needs after launch; shared by the caller's Work and the progress task.
struct Exchange {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string what;
  at::Tensor in_flat;   // [s * n], read by the sends until they complete
  at::Tensor out_flat;  // [n]
  at::Tensor slots;     // [depth, s - 1, piece]: receive buffers, peer p at index p < rank ? p : p - 1
  at::Tensor scratch;   // [piece] fp32 for bf16/fp16, else undefined
  ReduceOp op;
  int rank = 0, size = 1;
  int64_t n = 0, piece = 0, pieces = 0, depth = 1;
  uint32_t tag_base = 0;
  BufferPool* pool = nullptr;  // the group's; outlives the exchange (the group joins its progress thread first)
  std::chrono::milliseconds timeout{0};
  // recvs[j % depth][k]: the receive of piece j from peer index k.
  std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> recvs;

  int tag(int64_t j) const { return static_cast<int>((tag_base + static_cast<uint32_t>(j)) & 0x3fffffff); }
  int64_t len(int64_t j) const { return std::min(piece, n - j * piece); }
  int64_t peer_index(int peer) const { return peer < rank ? peer : peer - 1; }

  void post_recvs(int64_t j) {
    auto& row = recvs[j % depth];
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      const int64_t k = peer_index(peer);
      std::vector<at::Tensor> buf{slots.select(0, j % depth).select(0, k).narrow(0, 0, len(j))};
      row[k] = launch(what, [&] { return backend->recv(buf, peer, tag(j)); });
    }
  }

  // Rank r's contribution to piece j, once it is here: our own input, or (after waiting for its receive) what
  // peer r sent.
  at::Tensor contribution(int r, int64_t j) {
    if (r == rank) return in_flat.narrow(0, static_cast<int64_t>(rank) * n + j * piece, len(j));
    auto& w = recvs[j % depth][peer_index(r)];
    if (w) {
      TORCH_CHECK(w->wait(timeout), "the receive was aborted");
      w.reset();
    }
    return slots.select(0, j % depth).select(0, peer_index(r)).narrow(0, 0, len(j));
  }

  // Adds the contributions in rank order as each arrives: with more than two ranks, the sums of the early
  // ranks' pieces run while the later ones are still in transfer, instead of all after the last byte.
  void reduce_piece(int64_t j) {
    at::Tensor out = out_flat.narrow(0, j * piece, len(j));
    const bool upcast = scratch.defined() && (op == ReduceOp::Sum || op == ReduceOp::Avg);
    at::Tensor acc = upcast ? scratch.narrow(0, 0, len(j)) : out;
    int first_unreduced = 1;
    if (!upcast && (op == ReduceOp::Sum || op == ReduceOp::Avg)) {
      // Ranks 0 and 1 in one pass (read both, write once) instead of a copy then an add (which reads and
      // writes the output a second time): the last piece's reduction cannot overlap the transfer. Same order
      // of additions, so the same result.
      const at::Tensor c0 = contribution(0, j);
      at::add_out(acc, c0, contribution(1, j));
      first_unreduced = 2;
    } else {
      acc.copy_(contribution(0, j));
    }
    for (int r = first_unreduced; r < size; ++r) {
      const at::Tensor c = contribution(r, j);
      switch (op) {
        case ReduceOp::Sum:
        case ReduceOp::Avg: acc.add_(c); break;
        case ReduceOp::Max: at::maximum_out(acc, acc, c); break;
        case ReduceOp::Min: at::minimum_out(acc, acc, c); break;
      }
    }
    if (op == ReduceOp::Avg) acc.div_(size);
    if (upcast) out.copy_(acc);
  }

  // On the progress thread: reduce each piece as its contributions arrive, reuse its slots for a later piece.
  void run() {
    // Tensors created under InferenceMode may only be modified under it.
    c10::InferenceMode inference(out_flat.is_inference());
    for (int64_t j = 0; j < pieces; ++j) {
      reduce_piece(j);  // waits for every receive of piece j
      if (j + depth < pieces) post_recvs(j + depth);
    }
    // Every receive completed: nothing writes into the buffers any more. (After a failure they are never
    // reused: a receive may still be pending.)
    pool->give_back(std::move(slots).reshape({-1}));
    pool->give_back(std::move(scratch));
  }
};

}  // namespace

Work pipelined_reduce_scatter(ProcessGroup::Impl& g, const c10::intrusive_ptr<c10d::Backend>& communicator,
                              std::string what, const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  auto ex = std::make_shared<Exchange>();
  ex->backend = communicator;
  ex->what = what;
  ex->in_flat = input.view({-1});
  ex->out_flat = output.view({-1});
  ex->op = op;
  ex->rank = g.rank;
  ex->size = g.size;
  ex->n = ex->out_flat.numel();
  ex->piece = std::max<int64_t>(1, std::min(ex->n, piece_bytes() / static_cast<int64_t>(input.element_size())));
  ex->pieces = (ex->n + ex->piece - 1) / ex->piece;
  ex->depth = std::min(pipeline_depth(), ex->pieces);
  ex->timeout = g.timeout;
  // One tag per piece; every rank advances the counter by the same amount (same sizes everywhere).
  ex->tag_base = g.next_p2p_tag;
  g.next_p2p_tag += static_cast<uint32_t>(ex->pieces);
  ex->pool = &g.scratch;
  ex->slots = g.scratch.take(ex->depth * (g.size - 1) * ex->piece, input.options()).view({ex->depth, g.size - 1, ex->piece});
  const auto dt = input.scalar_type();
  if (dt == at::kBFloat16 || dt == at::kHalf) ex->scratch = g.scratch.take(ex->piece, input.options().dtype(at::kFloat));
  ex->recvs.assign(ex->depth, std::vector<c10::intrusive_ptr<c10d::Work>>(g.size - 1));

  auto impl = std::make_shared<Work::Impl>();
  impl->what = std::move(what);
  impl->timeout = g.timeout;
  comm::stamp(*impl, g);
  // Every piece for every peer, staggered so the ranks do not all send to rank 0 first. Gloo transfers a
  // piece once its receiver posted the matching receive.
  for (int step = 1; step < g.size; ++step) {
    const int to = (g.rank + step) % g.size;
    for (int64_t j = 0; j < ex->pieces; ++j) {
      std::vector<at::Tensor> buf{ex->in_flat.narrow(0, static_cast<int64_t>(to) * ex->n + j * ex->piece, ex->len(j))};
      impl->pending.push_back(launch(impl->what, [&] { return communicator->send(buf, to, ex->tag(j)); }));
    }
  }
  for (int64_t j = 0; j < ex->depth; ++j) ex->post_recvs(j);
  comm::trace(g, *impl, "reduce_scatter_tensor", static_cast<int64_t>(input.numel() * input.element_size()),
              /*own_task=*/true);
  impl->task = g.progress_thread().submit([ex, log = impl->span_log, span = impl->span, watch = impl->watch] {
    ex->run();
    if (span) log->stamp(*span, &CollectiveSpan::completed);
    if (watch) watch->completed_us = profiler_clock_us();
  });
  report_when_done(g, *impl);
  // The sends read `input` and the task writes `output` until they complete: keep both alive with the work.
  impl->on_complete = [ex] {};
  return Work(std::move(impl));
}

}  // namespace fsdp::comm

namespace fsdp {

comm::ProgressThread& ProcessGroup::Impl::progress_thread() {
  if (!progress) progress = std::make_unique<comm::ProgressThread>("fsdp-" + name);
  return *progress;
}

comm::ProgressThread& ProcessGroup::Impl::lane(const char* collective) {
  auto& thread = lanes[collective];
  if (!thread) thread = std::make_unique<comm::ProgressThread>(comm::lane_name(collective, name));
  return *thread;
}

}  // namespace fsdp
