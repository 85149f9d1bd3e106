#pragma once
// All-to-all with uneven splits along dim 0: expert parallelism's token dispatch and combine, where each rank sends
// each other rank as many rows (tokens) as it routed to that rank's experts (PyTorch's all_to_all_single with
// output_split_sizes / input_split_sizes). Exchange the counts first (an equal-split all_to_all of one integer
// per rank) so that every rank knows its output_splits.

#include <fsdp/process_group.h>

#include <cstdint>
#include <vector>

namespace fsdp {

// input rows [sum(input_splits[:j]), + input_splits[j]) go to group rank j; group rank j's rows land at output rows
// [sum(output_splits[:j]), + output_splits[j]). Both tensors contiguous, same dtype and same shape past dim 0;
// splits have one entry per rank, >= 0, summing to the tensors' dim 0 (zero-row splits and empty tensors are
// fine). Every rank of the group calls it; the splits must agree pairwise (rank i's input_splits[j] == rank j's
// output_splits[i]), which only the transfer itself can check. Counted as an all_to_all in comm_stats.
Work all_to_all_single(ProcessGroup& group, at::Tensor output, at::Tensor input,
                       const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits);

}  // namespace fsdp
