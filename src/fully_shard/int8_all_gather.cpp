// ZeRO++'s quantized weight all-gather (see <fsdp/fully_shard_extensions.h>).
#include <fsdp/fully_shard_extensions.h>

#include <ATen/ATen.h>

namespace fsdp {

std::vector<AllGatherTransform::TensorSpec> Int8RowwiseAllGather::input_specs(c10::IntArrayRef padded_shard_sizes,
                                                                              c10::ScalarType shard_dtype) const {
  TORCH_CHECK(padded_shard_sizes.size() >= 2, "Int8RowwiseAllGather: needs a parameter of 2 or more dims (rows x "
              "columns), got a shard of shape ", padded_shard_sizes);
  TORCH_CHECK(at::isFloatingType(shard_dtype), "Int8RowwiseAllGather: needs a floating-point parameter, got ",
              shard_dtype);
  return {{padded_shard_sizes.vec(), at::kChar}, {{padded_shard_sizes[0]}, at::kFloat}};
}

std::vector<at::Tensor> Int8RowwiseAllGather::pre_all_gather(const at::Tensor& padded_shard) const {
  at::Tensor rows = padded_shard.to(at::kFloat).flatten(1);
  // One scale per row; an all-zero row (padding included) gets scale 1 and quantizes to zeros.
  at::Tensor scale = rows.abs().amax(1) / 127.0;
  scale = at::where(scale > 0, scale, at::ones_like(scale));
  at::Tensor q = (rows / scale.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar);
  return {q.view(padded_shard.sizes()), scale};
}

at::Tensor Int8RowwiseAllGather::post_all_gather(const std::vector<at::Tensor>& gathered,
                                                 c10::ScalarType param_dtype) const {
  TORCH_CHECK(gathered.size() == 2, "Int8RowwiseAllGather: expected 2 gathered tensors, got ", gathered.size());
  const at::Tensor& q = gathered[0];
  const at::Tensor& scale = gathered[1];
  std::vector<int64_t> scale_shape(q.dim(), 1);
  scale_shape[0] = scale.size(0);
  return (q.to(at::kFloat) * scale.reshape(scale_shape)).to(param_dtype);
}

}  // namespace fsdp
