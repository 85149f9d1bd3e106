// Context parallelism (fsdp/context_parallel.h): the sequence layouts (head-tail / contiguous chunks) and ring
// attention, an autograd function whose forward merges per-chunk attention through the log-sum-exp and whose
// backward recomputes each chunk pair from the saved global output and log-sum-exp (PyTorch's
// _templated_ring_attention and its backward; _SDPAMerger's merge rule).

#include <fsdp/context_parallel.h>

#include "context_parallel/chunk_attention.h"
#include "tensor_parallel/group_capsule.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace {

using detail::BlockResult;
using detail::attend;
using detail::attend_backward;

// Gloo pairs a send with the receive of the same tag from the same peer: one tag range per kind of transfer.
constexpr int kForwardKvTag = 0x100;
constexpr int kBackwardKvTag = 0x200;  // two tags per step (K, V)
constexpr int kBackwardGradTag = 0x400;

// The log-sum-exp merge of a chunk's partial result into the running one (_SDPAMerger), in place: acc.out and
// acc.lse are views into the call's output and log-sum-exp, so the merge allocates only its temporaries.
struct Merged {
  at::Tensor out, lse;  // views of the call's output and log-sum-exp
  bool filled = false;  // false until the first chunk landed
};

void merge_into(Merged& acc, const BlockResult& part) {
  if (!acc.filled) {
    acc.out.copy_(part.out);
    acc.lse.copy_(part.lse);
    acc.filled = true;
    return;
  }
  auto lse = at::logaddexp(acc.lse, part.lse);
  // Under a document mask a row may see no key of a chunk (lse -inf): its weight is exp(-inf - lse) = 0. Had it
  // seen none before either (both -inf), the weights are exp(-inf - 0) = 0, not exp(-inf - -inf) = NaN. (The
  // ring visits this rank's own chunks first, its diagonal among them, so that case is not reached today; the
  // guard keeps the merge right in any visiting order.)
  const auto finite_lse = lse.masked_fill(lse.isneginf(), 0.0);
  acc.out.mul_((acc.lse - finite_lse).exp_().unsqueeze(-1))
      .add_(part.out * (part.lse - finite_lse).exp_().unsqueeze(-1));
  acc.lse.copy_(lse);
}

// How a query chunk relates to a key chunk, by global chunk index.
enum class Pair { Past, Diagonal, Future };
Pair relation(int64_t q_chunk, int64_t k_chunk) {
  return q_chunk > k_chunk ? Pair::Past : q_chunk == k_chunk ? Pair::Diagonal : Pair::Future;
}

// What a query chunk attends of a key chunk: nothing (skip), all of it, the causal triangle (causal), or under
// documents (block_causal) the keys of its own document at an earlier or equal global position (mask).
struct PairMask {
  bool skip = false;
  bool causal = false;
  at::Tensor mask;  // additive [B, 1, Lq, Lk] in the queries' dtype (0 visible, -inf hidden); undefined: none
};

// q_ids, k_ids: the two chunks' document ids [B, Lq], [B, Lk] (undefined: causal attention, no documents).
// Chunks are whole ranges of global positions, so "earlier" inside a pair is the chunk relation, plus the
// triangle on the diagonal. A pair no query of which sees any key is skipped (forward and backward alike); a
// pair inside one document takes the unmasked kernel.
PairMask pair_mask(int64_t q_chunk, int64_t k_chunk, const at::Tensor& q_ids, const at::Tensor& k_ids,
                   at::ScalarType dtype) {
  const Pair pair = relation(q_chunk, k_chunk);
  if (pair == Pair::Future) return {true, false, {}};
  const bool diagonal = pair == Pair::Diagonal;
  if (!q_ids.defined()) return {false, diagonal, {}};
  at::Tensor visible = q_ids.unsqueeze(2).eq(k_ids.unsqueeze(1));  // [B, Lq, Lk]: same document
  if (visible.all().item<bool>()) return {false, diagonal, {}};
  if (diagonal) visible.logical_and_(at::ones({q_ids.size(1), k_ids.size(1)}, visible.options()).tril());
  if (!visible.any().item<bool>()) return {true, false, {}};
  at::Tensor mask = at::zeros(visible.sizes(), visible.options().dtype(dtype));
  mask.masked_fill_(visible.logical_not(), -INFINITY);
  return {false, false, mask.unsqueeze(1)};
}

// Chunk `c` of a rank's document ids [B, L] (undefined stays undefined).
at::Tensor ids_chunk(const at::Tensor& rank_ids, int64_t per, int64_t c) {
  return rank_ids.defined() ? rank_ids.chunk(per, 1)[c] : at::Tensor();
}

// One rank's view of the layout: its chunk ids, and how to cut a local [B, H, L, D] tensor into its chunks.
struct Layout {
  int64_t rank = 0, size = 1;
  CpLoadBalancer balancer = CpLoadBalancer::HeadTail;
  std::vector<int64_t> ids_of(int64_t r) const { return context_parallel_chunk_ids(r, size, balancer); }
  int64_t per_rank() const { return balancer == CpLoadBalancer::HeadTail ? 2 : 1; }
};

std::vector<at::Tensor> split_chunks(const at::Tensor& t, int64_t n) { return t.chunk(n, 2); }

std::vector<int64_t> with_leading(int64_t n, at::IntArrayRef sizes) {
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), sizes.begin(), sizes.end());
  return shape;
}

// Every rank's K and V reach this rank, one rank's chunks at a time: visit(source_rank, k, v). One rank alone:
// its own, no transfer. AllGather: two all-gathers up front (every rank's K and V held for the call).
// AllToAll: a ring, each step's transfer in flight while `visit` computes on the chunks that arrived before, so
// a rank holds at most two ranks' K and V at a time.
template <typename Visit>
void for_each_kv(const at::Tensor& k, const at::Tensor& v, ProcessGroup& group, CpRotateMethod method, int tag_base,
                 Visit&& visit) {
  const int64_t rank = group.rank(), size = group.size();
  if (size == 1) {
    visit(rank, k, v);
    return;
  }
  if (method == CpRotateMethod::AllGather) {
    at::Tensor k_all = at::empty(with_leading(size, k.sizes()), k.options());
    at::Tensor v_all = at::empty(with_leading(size, v.sizes()), v.options());
    {
      RECORD_USER_SCOPE("fsdp::context_parallel::allgather_kv");
      Work kw = group.all_gather_into_tensor(k_all, k);
      Work vw = group.all_gather_into_tensor(v_all, v);
      kw.wait();
      vw.wait();
    }
    for (int64_t t = 0; t < size; ++t) {
      const int64_t source = (rank - t + size) % size;  // own chunks first, as the ring
      visit(source, k_all[source], v_all[source]);
    }
    return;
  }
  const int next = static_cast<int>((rank + 1) % size), prev = static_cast<int>((rank - 1 + size) % size);
  at::Tensor k_cur = k, v_cur = v;
  for (int64_t t = 0; t < size; ++t) {
    at::Tensor k_next, v_next;
    std::vector<Work> transfers;
    if (t + 1 < size) {
      RECORD_USER_SCOPE("fsdp::context_parallel::rotate_kv");
      k_next = at::empty_like(k_cur);
      v_next = at::empty_like(v_cur);
      const int tag = tag_base + 2 * static_cast<int>(t);
      transfers.push_back(group.send(k_cur, next, tag));
      transfers.push_back(group.send(v_cur, next, tag + 1));
      transfers.push_back(group.recv(k_next, prev, tag));
      transfers.push_back(group.recv(v_next, prev, tag + 1));
    }
    visit((rank - t + size) % size, k_cur, v_cur);
    for (auto& w : transfers) w.wait();
    k_cur = std::move(k_next);
    v_cur = std::move(v_next);
  }
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  // document_ids: every cp rank's document ids [cp, B, L] (block_causal), or none (causal).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const std::optional<at::Tensor>& document_ids,
                            const ProcessGroupPtr& group, int64_t method, int64_t balancer, double scale) {
    const at::Tensor all_ids = document_ids.value_or(at::Tensor());
    RECORD_USER_SCOPE(all_ids.defined() ? "fsdp::context_parallel::block_causal_ring_attention"
                                        : "fsdp::context_parallel::ring_attention");
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const Layout layout{group->rank(), group->size(), static_cast<CpLoadBalancer>(balancer)};
    const auto my_ids = layout.ids_of(layout.rank);
    const at::Tensor own_ids = all_ids.defined() ? all_ids[layout.rank] : at::Tensor();
    const auto q_chunks = split_chunks(q, layout.per_rank());
    // The merged output and log-sum-exp, written in place chunk by chunk.
    auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
    auto lse = at::empty(q.sizes().slice(0, 3), q.options().dtype(at::kFloat));
    const auto out_chunks = split_chunks(out, layout.per_rank()), lse_chunks = lse.chunk(layout.per_rank(), 2);
    std::vector<Merged> acc;
    for (size_t a = 0; a < q_chunks.size(); ++a) acc.push_back({out_chunks[a], lse_chunks[a]});
    for_each_kv(k, v, *group, static_cast<CpRotateMethod>(method), kForwardKvTag,
                [&](int64_t source, const at::Tensor& ks, const at::Tensor& vs) {
                  const auto ids = layout.ids_of(source);
                  const auto k_chunks = split_chunks(ks, layout.per_rank());
                  const auto v_chunks = split_chunks(vs, layout.per_rank());
                  const at::Tensor source_ids = all_ids.defined() ? all_ids[source] : at::Tensor();
                  for (size_t a = 0; a < q_chunks.size(); ++a) {
                    for (size_t b = 0; b < ids.size(); ++b) {
                      const PairMask pm = pair_mask(my_ids[a], ids[b], ids_chunk(own_ids, layout.per_rank(), a),
                                                    ids_chunk(source_ids, layout.per_rank(), b), q.scalar_type());
                      if (pm.skip) continue;
                      merge_into(acc[a], attend(q_chunks[a], k_chunks[b], v_chunks[b], pm.causal, scale, pm.mask));
                    }
                  }
                });
    out = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse});
    detail::save_group(ctx, group);
    ctx->saved_data["method"] = method;
    ctx->saved_data["balancer"] = balancer;
    ctx->saved_data["scale"] = scale;
    if (all_ids.defined()) ctx->saved_data["document_ids"] = all_ids;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved_ids = ctx->saved_data.find("document_ids");
    const at::Tensor all_ids = saved_ids != ctx->saved_data.end() ? saved_ids->second.toTensor() : at::Tensor();
    RECORD_USER_SCOPE(all_ids.defined() ? "fsdp::context_parallel::block_causal_ring_attention_backward"
                                        : "fsdp::context_parallel::ring_attention_backward");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const auto group = detail::saved_group(ctx);
    const auto method = static_cast<CpRotateMethod>(ctx->saved_data["method"].toInt());
    const double scale = ctx->saved_data["scale"].toDouble();
    const Layout layout{group->rank(), group->size(), static_cast<CpLoadBalancer>(ctx->saved_data["balancer"].toInt())};
    const int64_t per = layout.per_rank(), size = layout.size, rank = layout.rank;
    const auto my_ids = layout.ids_of(rank);
    const at::Tensor own_ids = all_ids.defined() ? all_ids[rank] : at::Tensor();
    const auto dout = grads[0].to(q.scalar_type()).contiguous();
    const auto q_chunks = split_chunks(q, per), dout_chunks = split_chunks(dout, per);
    const auto out_chunks = split_chunks(out, per), lse_chunks = lse.chunk(per, 2);
    auto dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    const auto dq_chunks = split_chunks(dq, per);

    // Adds this rank's queries' share of dK/dV of one source rank's chunks into dkv ([2, B, H, L, D] float).
    auto add_kv_grads = [&](int64_t source, const at::Tensor& ks, const at::Tensor& vs, const at::Tensor& dkv) {
      const auto ids = layout.ids_of(source);
      const auto k_chunks = split_chunks(ks, per), v_chunks = split_chunks(vs, per);
      const auto dk_chunks = split_chunks(dkv[0], per), dv_chunks = split_chunks(dkv[1], per);
      const at::Tensor source_ids = all_ids.defined() ? all_ids[source] : at::Tensor();
      for (size_t a = 0; a < q_chunks.size(); ++a) {
        for (size_t b = 0; b < ids.size(); ++b) {
          const PairMask pm = pair_mask(my_ids[a], ids[b], ids_chunk(own_ids, per, a), ids_chunk(source_ids, per, b),
                                        q.scalar_type());
          if (pm.skip) continue;
          auto g = attend_backward(dout_chunks[a], q_chunks[a], k_chunks[b], v_chunks[b], out_chunks[a],
                                   lse_chunks[a], pm.causal, scale, pm.mask);
          dq_chunks[a].add_(g.dq);
          dk_chunks[b].add_(g.dk);
          dv_chunks[b].add_(g.dv);
        }
      }
    };

    const auto grad_options = k.options().dtype(at::kFloat);
    at::Tensor dkv_own;
    if (size == 1) {
      dkv_own = at::zeros(with_leading(2, k.sizes()), grad_options);
      add_kv_grads(rank, k, v, dkv_own);
    } else if (method == CpRotateMethod::AllGather) {
      // Every source's dK/dV from here, then one reduce-scatter sums each owner's over the ranks.
      auto all = at::zeros(with_leading(size, with_leading(2, k.sizes())), grad_options);
      for_each_kv(k, v, *group, method, kBackwardKvTag, [&](int64_t source, const at::Tensor& ks, const at::Tensor& vs) {
        add_kv_grads(source, ks, vs, all[source]);
      });
      dkv_own = at::empty(with_leading(2, k.sizes()), grad_options);
      RECORD_USER_SCOPE("fsdp::context_parallel::reduce_scatter_dkv");
      group->reduce_scatter_tensor(dkv_own, all, ReduceOp::Sum).wait();
    } else {
      // The ring: the dK/dV accumulator of source s travels with s's K and V, each rank adding its share; after
      // the last step one more hop takes it home (rank s), so the accumulator this rank receives last is its
      // own, summed over every rank.
      const int next = static_cast<int>((rank + 1) % size), prev = static_cast<int>((rank - 1 + size) % size);
      at::Tensor carried = at::zeros(with_leading(2, k.sizes()), grad_options);  // step 0: own, empty
      at::Tensor in_flight;  // the accumulator sent last, unchanged and alive until its send completes
      Work carried_in, carried_out;
      int tag = kBackwardGradTag;
      for_each_kv(k, v, *group, method, kBackwardKvTag, [&](int64_t source, const at::Tensor& ks, const at::Tensor& vs) {
        carried_in.wait();
        add_kv_grads(source, ks, vs, carried);
        carried_out.wait();
        RECORD_USER_SCOPE("fsdp::context_parallel::rotate_dkv");
        in_flight = std::move(carried);
        carried = at::empty_like(in_flight);
        carried_out = group->send(in_flight, next, tag);
        carried_in = group->recv(carried, prev, tag);
        ++tag;
      });
      carried_out.wait();
      carried_in.wait();
      dkv_own = carried;
    }
    return {dq.to(q.scalar_type()), dkv_own[0].to(k.scalar_type()), dkv_own[1].to(v.scalar_type()), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

CpRotateMethod parse_cp_rotate_method(std::string_view name) {
  if (name == "allgather") return CpRotateMethod::AllGather;
  if (name == "alltoall") return CpRotateMethod::AllToAll;
  TORCH_CHECK(false, "context_parallel_rotate_method: '", std::string(name),
              "' is not a rotate method (\"allgather\" or \"alltoall\")");
}

CpLoadBalancer parse_cp_load_balancer(std::string_view name) {
  if (name == "headtail") return CpLoadBalancer::HeadTail;
  if (name == "none" || name.empty()) return CpLoadBalancer::None;
  TORCH_CHECK(false, "context_parallel_load_balancer: '", std::string(name),
              "' is not a load balancer (\"headtail\" or \"none\")");
}

const char* to_string(CpRotateMethod method) {
  return method == CpRotateMethod::AllGather ? "allgather" : "alltoall";
}

const char* to_string(CpLoadBalancer balancer) { return balancer == CpLoadBalancer::HeadTail ? "headtail" : "none"; }

int64_t context_parallel_num_chunks(int64_t cp_size, CpLoadBalancer balancer) {
  TORCH_CHECK(cp_size >= 1, "context parallel: cp degree must be >= 1, got ", cp_size);
  return balancer == CpLoadBalancer::HeadTail ? 2 * cp_size : cp_size;
}

std::vector<int64_t> context_parallel_chunk_ids(int64_t cp_rank, int64_t cp_size, CpLoadBalancer balancer) {
  TORCH_CHECK(cp_rank >= 0 && cp_rank < cp_size, "context parallel: cp rank ", cp_rank, " is not in [0, ", cp_size,
              ")");
  if (balancer == CpLoadBalancer::HeadTail) return {cp_rank, 2 * cp_size - 1 - cp_rank};
  return {cp_rank};
}

void check_context_parallel_seq_len(int64_t seq_len, int64_t cp_size, CpLoadBalancer balancer) {
  const int64_t chunks = context_parallel_num_chunks(cp_size, balancer);
  TORCH_CHECK(seq_len > 0 && seq_len % chunks == 0, "context parallel: sequence length ", seq_len,
              " does not divide by ",
              balancer == CpLoadBalancer::HeadTail ? "2 * context_parallel_degree = " : "context_parallel_degree = ",
              chunks,
              balancer == CpLoadBalancer::HeadTail ? " (head-tail load balancing cuts the sequence into 2*cp chunks)"
                                                   : " (without load balancing the sequence is cut into cp chunks)");
}

at::Tensor context_parallel_shard(const at::Tensor& global, int64_t seq_dim, int64_t cp_rank, int64_t cp_size,
                                  CpLoadBalancer balancer) {
  seq_dim = c10::maybe_wrap_dim(seq_dim, global.dim());
  check_context_parallel_seq_len(global.size(seq_dim), cp_size, balancer);
  const auto chunks = global.chunk(context_parallel_num_chunks(cp_size, balancer), seq_dim);
  std::vector<at::Tensor> mine;
  for (int64_t id : context_parallel_chunk_ids(cp_rank, cp_size, balancer)) mine.push_back(chunks[id]);
  return at::cat(mine, seq_dim).contiguous();
}

at::Tensor context_parallel_unshard(const at::Tensor& local, int64_t seq_dim, ProcessGroup& cp_group,
                                    CpLoadBalancer balancer) {
  seq_dim = c10::maybe_wrap_dim(seq_dim, local.dim());
  const int64_t size = cp_group.size();
  const int64_t per = balancer == CpLoadBalancer::HeadTail ? 2 : 1;
  TORCH_CHECK(local.size(seq_dim) % per == 0, "context_parallel_unshard: local sequence length ",
              local.size(seq_dim), " does not divide by the ", per, " chunks each rank holds");
  const auto front = local.movedim(seq_dim, 0).contiguous();
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] *= size;
  auto gathered = at::empty(shape, front.options());
  cp_group.all_gather_into_tensor(gathered, front).wait();
  // gathered holds rank-major local layouts; put each rank's chunks at their global places.
  const auto pieces = gathered.chunk(size * per, 0);
  std::vector<at::Tensor> ordered(static_cast<size_t>(size * per));
  for (int64_t r = 0; r < size; ++r) {
    const auto ids = context_parallel_chunk_ids(r, size, balancer);
    for (int64_t j = 0; j < per; ++j) ordered[static_cast<size_t>(ids[j])] = pieces[r * per + j];
  }
  return at::cat(ordered, 0).movedim(0, seq_dim).contiguous();
}

at::Tensor context_parallel_positions(int64_t seq_len, int64_t cp_rank, int64_t cp_size, CpLoadBalancer balancer) {
  return context_parallel_shard(at::arange(seq_len, at::kLong), 0, cp_rank, cp_size, balancer);
}

namespace {

// The checks ring_attention and block_causal_ring_attention share; the scale they use.
double checked_ring_scale(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const ProcessGroupPtr& cp_group, const ContextParallelOptions& options,
                          std::optional<double> scale) {
  TORCH_CHECK(cp_group != nullptr, who, ": null cp group");
  TORCH_CHECK(q.dim() == 4, who, ": q must be [batch, heads, seq_local, head_dim], got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes() && v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3), who,
              ": q and k must have the same shape and v the same but for its head dim (repeat grouped KV heads "
              "first); got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  k.device() == q.device() && v.device() == q.device(),
              who, ": q, k, v must share dtype and device");
  const int64_t per = options.load_balancer == CpLoadBalancer::HeadTail ? 2 : 1;
  TORCH_CHECK(q.size(2) % per == 0, who, ": local sequence length ", q.size(2),
              " does not divide by 2 (head-tail load balancing: each rank holds chunks i and 2*cp-1-i)");
  TORCH_CHECK(cp_group->size() <= 128, who, ": cp degree ", cp_group->size(),
              " is above 128 (the ring's transfer tags are 0x100-0x5ff per group)");
  return scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
}

// The ring's chunk kernels (CPU flash attention) and its K/V transfers take one head dim for q, k and v. When v's
// differs (DeepSeek-V3's MLA: qk_nope + qk_rope vs v_head_dim) the narrower side is padded with zeros to the
// wider one, which changes no score and no output column (TorchTitan pads v for SDPA the same way), and the
// output is cut back to v's head dim; the scale was taken from q's own head dim before. Autograd goes through the
// pad and the cut.
template <typename Ring>
at::Tensor with_common_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Ring&& ring) {
  const int64_t dqk = q.size(3), dv = v.size(3);
  if (dqk == dv) return ring(q, k, v);
  if (dv < dqk) return ring(q, k, at::constant_pad_nd(v, {0, dqk - dv})).narrow(3, 0, dv);
  return ring(at::constant_pad_nd(q, {0, dv - dqk}), at::constant_pad_nd(k, {0, dv - dqk}), v);
}

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ProcessGroupPtr& cp_group,
                          const ContextParallelOptions& options, std::optional<double> scale) {
  const double s = checked_ring_scale("fsdp::ring_attention", q, k, v, cp_group, options, scale);
  return with_common_head_dim(q, k, v, [&](const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& vp) {
    return RingAttention::apply(qp, kp, vp, std::optional<at::Tensor>(), cp_group,
                                static_cast<int64_t>(options.rotate_method),
                                static_cast<int64_t>(options.load_balancer), s);
  });
}

at::Tensor context_parallel_gather_document_ids(const at::Tensor& document_ids, const ProcessGroupPtr& cp_group) {
  TORCH_CHECK(cp_group != nullptr, "fsdp::context_parallel_gather_document_ids: null cp group");
  TORCH_CHECK(document_ids.dim() == 2 && document_ids.scalar_type() == at::kLong,
              "fsdp::context_parallel_gather_document_ids: document ids must be int64 [batch, seq_local], got ",
              document_ids.scalar_type(), " ", document_ids.sizes());
  RECORD_USER_SCOPE("fsdp::context_parallel::allgather_document_ids");
  at::Tensor all = at::empty(with_leading(cp_group->size(), document_ids.sizes()), document_ids.options());
  cp_group->all_gather_into_tensor(all, document_ids.contiguous()).wait();
  return all;
}

at::Tensor block_causal_ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& all_document_ids, const ProcessGroupPtr& cp_group,
                                       const ContextParallelOptions& options, std::optional<double> scale) {
  const char* who = "fsdp::block_causal_ring_attention";
  const double s = checked_ring_scale(who, q, k, v, cp_group, options, scale);
  TORCH_CHECK(all_document_ids.dim() == 3 && all_document_ids.scalar_type() == at::kLong &&
                  all_document_ids.size(0) == cp_group->size() && all_document_ids.size(1) == q.size(0) &&
                  all_document_ids.size(2) == q.size(2),
              who, ": the document ids must be every cp rank's, int64 [cp ", cp_group->size(), ", batch ", q.size(0),
              ", seq_local ", q.size(2), "] (context_parallel_gather_document_ids), got ",
              all_document_ids.scalar_type(), " ", all_document_ids.sizes());
  const std::optional<at::Tensor> ids(all_document_ids.to(q.device()));
  return with_common_head_dim(q, k, v, [&](const at::Tensor& qp, const at::Tensor& kp, const at::Tensor& vp) {
    return RingAttention::apply(qp, kp, vp, ids, cp_group, static_cast<int64_t>(options.rotate_method),
                                static_cast<int64_t>(options.load_balancer), s);
  });
}

}  // namespace fsdp
