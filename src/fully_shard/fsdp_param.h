#pragma once
// FSDPParam: one parameter managed by fully_shard.
//
// Identity: the module's registered tensor (`param()`) is never replaced — optimizers, tied references and
// autograd all hold that one TensorImpl. FSDP switches what it *shows*: in the sharded state it is this
// rank's dim-0 shard (a narrow of a zero-padded buffer, so the padding stays internal); in the unsharded
// state it is the full parameter in a persistent storage that is freed (resized to 0 bytes) between uses.
// The switch is Tensor::set_data (Python's `param.data = ...`), which keeps autograd metadata and the
// version counter, so an optimizer sees shards, a forward sees full parameters, and saved activations stay
// valid across free / re-gather.

#include <fsdp/fully_shard.h>
#include <fsdp/fully_shard_extensions.h>
#include <fsdp/process_group.h>
#include <fsdp/tensor_parallel_spec.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

// torch.chunk-style sharding on one dim (dim 0 unless shard_placement_fn picked another): chunk =
// ceil(size / world) "rows" (slices along the shard dim); rank r owns rows [r*chunk, min(size, (r+1)*chunk)),
// which may be empty for trailing ranks. Internally every buffer (padded shard, all-gather and reduce-scatter
// slots) holds a parameter in "rows layout": the shard dim moved to the front, [rows, other dims...], so
// dim-0 and dim-k sharding share one code path; a dim-k shard is shown as a strided view of that storage.
// (PyTorch requires even sizes for Shard(k>0); uneven sizes are padded here like dim 0.)
// A 0-dim parameter (a learnable scale) has no dim to shard: it is replicated inside the group — every rank
// holds it as its one-row shard, so the same all-gather and reduce-scatter layouts carry it (each rank's slot
// holds the full value; the reduce-scatter hands every rank the sum).
struct ShardGeometry {
  int64_t dim0 = 0;          // size of the shard dim ("rows")
  int64_t chunk_rows = 0;    // rows of every rank's padded shard
  int64_t row_numel = 1;     // elements per row
  int64_t world = 1;
  int64_t shard_dim = 0;     // the parameter's dim that is sharded
  std::vector<int64_t> row_sizes;  // the other dims, in order (one row's shape)
  bool replicated = false;   // 0-dim: every rank holds the single row

  static ShardGeometry make(c10::IntArrayRef sizes, int64_t world, int64_t shard_dim = 0);
  int64_t rows_of(int64_t rank) const;    // unpadded rows held by `rank`
  int64_t offset_of(int64_t rank) const;  // first global row of `rank`
  int64_t padded_numel() const { return chunk_rows * row_numel; }
  // [n, rows...]: shape of n rows in rows layout ({n_ranks, chunk_rows} for a rank-major block).
  std::vector<int64_t> rows_shape(std::initializer_list<int64_t> leading) const;
  // A tensor of the parameter's full shape seen in rows layout (a view: writes go through).
  at::Tensor rows_view(const at::Tensor& full) const;
  // Rows in rows layout seen in the parameter's own layout (a view), e.g. a shard [k, rest] -> Shard(dim) shape.
  at::Tensor from_rows(const at::Tensor& rows) const;
};

enum class ShardedState { Sharded, Unsharded };

class FSDPParam {
 public:
  // shard_dim: the dim to shard (shard_placement_fn's answer; negative counts from the end).
  FSDPParam(at::Tensor param, std::string fqn, int64_t shard_rank, int64_t shard_world, c10::Device device,
            const MixedPrecisionPolicy& mp, const OffloadPolicy& offload, int64_t shard_dim = 0,
            std::shared_ptr<const AllGatherTransform> transform = nullptr);

  const at::Tensor& param() const { return param_; }
  const std::string& fqn() const { return fqn_; }
  void set_fqn(std::string fqn) { fqn_ = std::move(fqn); }
  const ShardGeometry& geometry() const { return geometry_; }
  const std::vector<int64_t>& unsharded_sizes() const { return unsharded_sizes_; }
  // Read at run time: freezing or unfreezing after fully_shard takes effect at the next forward.
  bool requires_grad() const { return param_.requires_grad(); }
  bool is_replicated() const { return geometry_.replicated; }
  ShardedState state() const { return state_; }
  c10::ScalarType orig_dtype() const { return orig_dtype_; }
  c10::ScalarType param_dtype() const { return param_dtype_; }   // dtype of the unsharded parameter
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; } // dtype of gradient reduction
  int64_t shard_rank() const { return shard_rank_; }

  int64_t shard_dim() const { return geometry_.shard_dim; }
  // What this parameter sends in the all-gather instead of its shard, and how it is rebuilt (null: its shard,
  // cast to param_dtype).
  const AllGatherTransform* all_gather_transform() const { return transform_.get(); }

  // 2-D (FSDP over tensor parallel): the parameter was TP-sharded before fully_shard, so what FSDP shards —
  // and all-gathers over its own (data-parallel) group only — is this rank's TP piece. The global tensor is
  // described over the concatenated [fsdp mesh dims..., tp] mesh with placements ([Replicate(),] dp, tp), the
  // dp placement a _StridedShard when TP splits the same dim (PyTorch's _init_sharding_spec_tp), so state
  // dicts and checkpoints reassemble and reshard the global tensor.
  struct GlobalLayout {
    DeviceMesh mesh;
    Placements placements;
    std::vector<int64_t> global_shape;
  };
  void set_tensor_parallel(const TensorParallelSpec& tp, const DeviceMesh& fsdp_mesh);
  const std::optional<GlobalLayout>& tensor_parallel_layout() const { return tp_layout_; }
  // World-size-1 fast path: nothing is sharded (shard group of one rank), cast (param dtype = original dtype)
  // or moved (no offload), so the unsharded parameter *is* the shard: unsharded() aliases sharded_local(),
  // alloc/free_unsharded are no-ops and an unshard needs no copy and no collective. Decided whenever the
  // storage is (re)created (construction, materialize, convert_dtype). Dim-0 (or 0-dim) sharding only, so the
  // shown full parameter stays contiguous.
  bool aliases_shard() const { return aliases_shard_; }
  // This rank's zero-padded shard [chunk_rows, row_sizes...] (rows layout) in the original dtype (all-gather
  // input source).
  const at::Tensor& sharded_padded() const { return sharded_padded_; }
  // The visible local shard: the parameter's shape with rows_of(rank) on the shard dim (a view of
  // sharded_padded(); strided when the shard dim is not 0).
  const at::Tensor& sharded_local() const { return sharded_local_; }
  // This rank's part of a tensor of the parameter's full shape, shaped like sharded_local() (a view).
  at::Tensor local_part_of(const at::Tensor& full) const;
  // The unsharded parameter's persistent storage, a tensor of its own (writing into it does not bump the
  // parameter's version counter). Allocated only between alloc_unsharded() and free_unsharded().
  const at::Tensor& unsharded() const { return unsharded_; }

  void alloc_unsharded();
  void free_unsharded();

  // Show the full parameter (after its data was copied into unsharded()). Stashes the sharded gradient so
  // that backward accumulates a fresh unsharded one.
  void to_unsharded();
  // Show the local shard again; restores the stashed sharded gradient.
  void to_sharded();

  // The gradient that backward produced on the unsharded parameter (undefined if none), plus what earlier
  // no-sync micro-batches accumulated. Clears both.
  at::Tensor take_unsharded_grad();
  // No-sync micro-batch: keep the unsharded gradient for the next synchronized backward.
  void accumulate_unsharded_grad();
  bool has_accumulated_unsharded_grad() const { return accumulated_unsharded_grad_.defined(); }
  // Adds (or sets) this rank's reduced gradient shard (sharded_local()'s shape) into the sharded gradient.
  // Returns true when it started a non-blocking device-to-host copy (offloaded to pinned memory, nothing to
  // add to): the host must wait on an event recorded after it before anything reads the gradient.
  bool accumulate_sharded_grad(const at::Tensor& local_grad);

  // HSDP with set_requires_all_reduce(false): the shard-group reduced rows ([padded rows] in the reduce
  // dtype, not yet averaged) kept apart until the next all-reduce, so replicas never diverge.
  at::Tensor& partial_reduce_output() { return partial_reduce_output_; }

  // After an exception: drops the unsharded gradient, no-sync accumulations and partial reductions.
  void drop_internal_grads();

  // module->to(dtype) after fully_shard: the shard (already converted by libtorch when it lives in a child
  // module visited first, otherwise converted here) becomes the new padded shard storage.
  void convert_dtype(c10::ScalarType dtype, const MixedPrecisionPolicy& mp);

  // After an optimizer or user replaced the sharded data in place nothing is needed; but if the user
  // called module->to() etc. the param may have been re-pointed: this checks it still shows our storage.
  void check_identity(const char* where) const;

  // Meta-device init: give a parameter created on `meta` real (zeroed) shard storage on `device` (CPU when
  // offloaded), and an unsharded storage there. No-op for parameters that are not on meta.
  void materialize(c10::Device device, const OffloadPolicy& offload);
  // Initialization with full parameters (meta-device init): shows a full tensor in the *original* dtype
  // (fp32 masters stay exact under mixed precision): zeros when the shards are known zeros (materialized from
  // meta and untouched since), else the current values gathered over `group` (collective, in this dtype);
  // end_full_init keeps this rank's rows.
  void begin_full_init(ProcessGroup& group);
  void end_full_init();
  // Autograd edges into this parameter's gradient accumulator when it was last resharded (-1: not tracked).
  // More edges later, while it still shows its shard, mean autograd used it outside its module's forward.
  void record_accumulator_uses();
  bool used_while_sharded() const;
  bool known_zero() const { return known_zero_ && param_._version() == known_zero_version_; }
  void forget_known_zero() { known_zero_ = false; }

 private:
  // (Re)creates the padded shard, its visible narrow and the (freed) unsharded storage.
  void allocate_storage(c10::Device sharded_device, c10::Device unsharded_device, const OffloadPolicy& offload,
                        c10::Device compute_device, bool copy_from_param);

  at::Tensor param_;
  std::shared_ptr<const AllGatherTransform> transform_;
  std::optional<GlobalLayout> tp_layout_;
  bool aliases_shard_ = false;
  std::string fqn_;
  std::vector<int64_t> unsharded_sizes_;
  ShardGeometry geometry_;
  int64_t shard_rank_;
  c10::ScalarType orig_dtype_;
  c10::ScalarType param_dtype_;
  c10::ScalarType reduce_dtype_;
  ShardedState state_ = ShardedState::Sharded;

  at::Tensor sharded_padded_;
  at::Tensor sharded_local_;
  at::Tensor unsharded_;
  at::Tensor stashed_sharded_grad_;
  at::Tensor accumulated_unsharded_grad_;
  at::Tensor partial_reduce_output_;
  at::Tensor full_init_;  // between begin_full_init and end_full_init
  int64_t accumulator_uses_at_reshard_ = -1;
  bool known_zero_ = false;  // shards are the zeros materialize() wrote (while the version is unchanged)
  uint32_t known_zero_version_ = 0;
};

}  // namespace fsdp::detail
