// all_to_all_single with uneven splits (fsdp/all_to_all.h): the checks every backend shares, then the group's
// CollectiveBackend.
#include <fsdp/all_to_all.h>

#include "comm/process_group_impl.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <numeric>

namespace fsdp {

Work all_to_all_single(ProcessGroup& group, at::Tensor output, at::Tensor input,
                       const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits) {
  ProcessGroup::Impl& g = detail::ProcessGroupAccess::impl(group);
  const std::string where = "fsdp: all_to_all_single on " + g.describe();
  for (const at::Tensor* t : {&output, &input}) {
    TORCH_CHECK(t->defined() && t->dim() >= 1, where, ": tensors need at least one dim (rows)");
    TORCH_CHECK(t->is_contiguous(), where, ": tensors must be contiguous");
    TORCH_CHECK(t->device().type() == g.device.type(), where, ": a tensor is on ", t->device(), ", the group works on ",
                g.device);
  }
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), where, ": output dtype ", output.scalar_type(),
              " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(output.sizes().slice(1) == input.sizes().slice(1), where, ": output rows of shape ",
              output.sizes().slice(1), " differ from input rows of shape ", input.sizes().slice(1));
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t, const char* name) {
    TORCH_CHECK(static_cast<int>(splits.size()) == g.size, where, ": ", name, " has ", splits.size(),
                " entries for ", g.size, " ranks");
    for (int64_t s : splits) TORCH_CHECK(s >= 0, where, ": ", name, " has a negative entry ", s);
    const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    TORCH_CHECK(total == t.size(0), where, ": ", name, " sum to ", total, " rows, the tensor has ", t.size(0));
  };
  check_splits(output_splits, output, "output_splits");
  check_splits(input_splits, input, "input_splits");
  g.stats.all_to_all_calls++;
  const int64_t row_bytes = input.numel() == 0 ? 0 : input.nbytes() / std::max<int64_t>(input.size(0), 1);
  const int64_t sent_rows =
      std::accumulate(input_splits.begin(), input_splits.end(), int64_t{0}) - input_splits[static_cast<size_t>(g.rank)];
  g.stats.bytes_sent += sent_rows * row_bytes;
  if (g.size == 1) {
    TORCH_CHECK(output_splits[0] == input_splits[0], where, ": one rank sends itself ", input_splits[0],
                " rows but expects ", output_splits[0]);
  }
  return g.collectives->all_to_all_uneven(g, std::move(output), std::move(input), output_splits, input_splits);
}

}  // namespace fsdp
