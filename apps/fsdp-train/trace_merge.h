#pragma once
// `fsdp-train merge-traces`: the per-rank files of a profiled step ([profiling], profiling.h: Kineto traces and
// CPU memory timelines) as one Chrome trace, every rank a process of its own on one time axis. No torch headers.

#include <cstddef>
#include <string>
#include <vector>

namespace fsdp_train {

struct MergedTrace {
  size_t files = 0;
  size_t events = 0;
  std::vector<int> ranks;  // ascending, each once
};

// `inputs`: trace files, or folders whose *.json files with "trace" or "timeline" in their name are taken (sorted by
// name; profiling.h's rank<r>_comm.json summaries are not traces). A file's rank is its
// "distributedInfo"."rank" (Kineto writes it under a process group; profiling.h's memory timelines too), else the
// number after "rank" in its name, else its position. Timestamps are rebased from each file's
// "baseTimeNanoseconds" (0 when absent) to the earliest, so ranks of one host line up as they ran (across hosts,
// as far as their clocks agree). Each (rank, pid) becomes the process "rank R (<name>)"; a rank's trace and memory
// timeline, written by the same process, share it. Writes `out_path` whole (through a temporary file) and throws,
// naming the file, on a bad input.
MergedTrace merge_traces(const std::vector<std::string>& inputs, const std::string& out_path);

}  // namespace fsdp_train
