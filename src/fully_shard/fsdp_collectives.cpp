#include "fully_shard/fsdp_collectives.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace fsdp::detail {
namespace {

// Byte alignment of each parameter inside a slot: views of any dtype (up to complex128) stay aligned.
constexpr int64_t kAlignBytes = 16;

int64_t align_up(int64_t n) { return (n + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// [dim0, row_sizes...] view of a full tensor: the shard dim first (0-dim tensors are one row).
at::Tensor as_rows(const at::Tensor& t, const ShardGeometry& g) { return g.rows_view(t); }

// Copies between a full tensor's rows and a rank-major [n_ranks, chunk_rows, row_sizes...] block for ranks
// [first_rank, first_rank + n_ranks). Trailing ranks own fewer (or no) rows; padding rows are left alone.
void copy_rank_rows(const ShardGeometry& g, const at::Tensor& full_rows, const at::Tensor& block,
                    int64_t first_rank, bool to_block) {
  const int64_t n_ranks = block.size(0);
  if (g.replicated) {
    // Every rank's slot holds the whole (one-row) tensor: fill each slot, or read one back (all are equal).
    for (int64_t k = 0; k < (to_block ? n_ranks : std::min<int64_t>(n_ranks, 1)); ++k) {
      at::Tensor blk = block.select(0, k).narrow(0, 0, g.dim0);
      to_block ? blk.copy_(full_rows) : full_rows.copy_(blk);
    }
    return;
  }
  for (int64_t r = first_rank; r < first_rank + n_ranks;) {
    // Ranks that own a complete chunk are contiguous in both layouts: copy them in one go.
    int64_t run = 0;
    while (r + run < first_rank + n_ranks && g.rows_of(r + run) == g.chunk_rows && g.chunk_rows > 0) ++run;
    if (run > 0) {
      // (Splitting dim 0 is a view for any strides, so this also works on a moved shard dim.)
      at::Tensor rows = full_rows.narrow(0, g.offset_of(r), run * g.chunk_rows).unflatten(0, {run, g.chunk_rows});
      at::Tensor blk = block.narrow(0, r - first_rank, run);
      to_block ? blk.copy_(rows) : rows.copy_(blk);
      r += run;
      continue;
    }
    const int64_t rows_here = g.rows_of(r);
    if (rows_here > 0) {
      at::Tensor rows = full_rows.narrow(0, g.offset_of(r), rows_here);
      at::Tensor blk = block.select(0, r - first_rank).narrow(0, 0, rows_here);
      to_block ? blk.copy_(rows) : rows.copy_(blk);
    }
    ++r;
  }
}

// [n_ranks, chunk_rows, row_sizes...] view (in `dtype`) of parameter `i`'s bytes in a rank-major byte buffer.
at::Tensor param_block(const at::Tensor& bytes_2d, const AllGatherLayout& layout, size_t i, const ShardGeometry& g,
                       c10::ScalarType dtype) {
  at::Tensor b = bytes_2d.narrow(1, layout.byte_offsets[i], layout.byte_sizes[i]).view(dtype);
  return b.view(g.rows_shape({bytes_2d.size(0), g.chunk_rows}));
}

}  // namespace

AllGatherLayout make_all_gather_layout(const std::vector<FSDPParam*>& params) {
  AllGatherLayout layout;
  for (const FSDPParam* p : params) {
    const int64_t bytes = p->geometry().padded_numel() * static_cast<int64_t>(c10::elementSize(p->param_dtype()));
    layout.byte_offsets.push_back(layout.per_rank_bytes);
    layout.byte_sizes.push_back(bytes);
    layout.per_rank_bytes += align_up(bytes);
  }
  return layout;
}

void pack_sharded(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout, const at::Tensor& slot) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    if (layout.byte_sizes[i] == 0) continue;
    at::Tensor dst = slot.narrow(0, layout.byte_offsets[i], layout.byte_sizes[i]).view(p.param_dtype());
    // Host-to-device copy when the shard is offloaded to CPU; cast to the compute dtype.
    dst.copy_(p.sharded_padded().reshape({-1}), /*non_blocking=*/p.sharded_padded().is_pinned());
  }
}

void pack_unsharded_rows(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout, int64_t first_rank,
                         const at::Tensor& dst) {
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    if (layout.byte_sizes[i] == 0) continue;
    at::Tensor block = param_block(dst, layout, i, p.geometry(), p.param_dtype());
    block.zero_();
    copy_rank_rows(p.geometry(), as_rows(p.unsharded(), p.geometry()), block, first_rank, /*to_block=*/true);
  }
}

void unpack_all_gather(const std::vector<FSDPParam*>& params, const AllGatherLayout& layout,
                       const at::Tensor& output) {
  c10::NoGradGuard no_grad;
  const int64_t world = output.numel() / std::max<int64_t>(layout.per_rank_bytes, 1);
  at::Tensor out_2d = output.view({world, layout.per_rank_bytes});
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    if (layout.byte_sizes[i] == 0) continue;
    at::Tensor block = param_block(out_2d, layout, i, p.geometry(), p.param_dtype());
    copy_rank_rows(p.geometry(), as_rows(p.unsharded(), p.geometry()), block, 0, /*to_block=*/false);
  }
}

ReduceScatterLayout make_reduce_scatter_layout(const std::vector<FSDPParam*>& params,
                                               const std::vector<at::Tensor>& grads) {
  ReduceScatterLayout layout;
  std::optional<c10::ScalarType> dtype;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads[i].defined()) {
      layout.offsets.push_back(-1);
      continue;
    }
    const c10::ScalarType d = params[i]->reduce_dtype();
    TORCH_CHECK(!dtype || *dtype == d, "fsdp: one parameter group reduces gradients in both ", *dtype, " and ", d,
                " (parameter '", params[i]->fqn(), "'); give such parameters their own fully_shard call");
    dtype = d;
    layout.offsets.push_back(layout.per_rank_numel);
    layout.per_rank_numel += params[i]->geometry().padded_numel();
  }
  if (dtype) layout.dtype = *dtype;
  return layout;
}

at::Tensor pack_reduce_scatter_input(const std::vector<FSDPParam*>& params, const std::vector<at::Tensor>& grads,
                                     const ReduceScatterLayout& layout, c10::Device device) {
  c10::NoGradGuard no_grad;
  TORCH_CHECK(!params.empty(), "fsdp internal: empty reduce-scatter");
  const ShardGeometry& g0 = params.front()->geometry();
  const int64_t world = g0.world;
  // Not zero-filled: every element is written below, the gradient rows by the copy and only the padding rows
  // of trailing ranks (uneven shards) by zero_.
  at::Tensor input = at::empty({world, layout.per_rank_numel}, at::TensorOptions().dtype(layout.dtype).device(device));
  for (size_t i = 0; i < params.size(); ++i) {
    if (layout.offsets[i] < 0) continue;
    const ShardGeometry& g = params[i]->geometry();
    at::Tensor block = input.narrow(1, layout.offsets[i], g.padded_numel()).view(g.rows_shape({world, g.chunk_rows}));
    copy_rank_rows(g, as_rows(grads[i], g), block, 0, /*to_block=*/true);
    for (int64_t r = 0; r < world; ++r) {
      const int64_t rows = g.rows_of(r);
      if (rows < g.chunk_rows) block.select(0, r).narrow(0, rows, g.chunk_rows - rows).zero_();
    }
  }
  return input.view({-1});
}

at::Tensor reduced_local_grad(const FSDPParam& param, const ReduceScatterLayout& layout, size_t index,
                              const at::Tensor& output) {
  const ShardGeometry& g = param.geometry();
  at::Tensor rows = output.narrow(0, layout.offsets[index], g.padded_numel()).view(g.rows_shape({g.chunk_rows}));
  return g.from_rows(rows.narrow(0, 0, g.rows_of(param.shard_rank())));
}

}  // namespace fsdp::detail
