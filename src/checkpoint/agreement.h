#pragma once
// The few collectives the checkpoint layers use to agree across ranks: which group to use, every rank's
// string (chunk lists, errors), rank 0's string (the coordinator's outcome), "did any rank fail". Each is a
// no-op for a null group or a group of one. Plus the text helpers of the errors they agree on.

#include <fsdp/process_group.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// `g` when given, else the world when initialized, else null (a single process).
ProcessGroupPtr resolve_group(const ProcessGroupPtr& g);
// The message of an exception without c10's backtrace.
std::string error_text(const std::exception& e);
// "'a', 'b', 'c' and 7 more": key lists in error messages.
std::string list_names(const std::vector<std::string>& names, size_t max = 20);
// Every rank's string, in group-rank order.
std::vector<std::string> all_gather_strings(const ProcessGroupPtr& group, const std::string& mine);
// Rank 0's string on every rank.
std::string broadcast_string(const ProcessGroupPtr& group, const std::string& s);
// True on every rank when any rank passes true.
bool any_rank(const ProcessGroupPtr& group, bool mine);
// The first non-empty string of any rank (lowest rank first), on every rank; empty when all are empty.
std::string first_error(const ProcessGroupPtr& group, const std::string& mine);
// The end of a collective save (every format): the coordinator runs `commit`, which writes the metadata, commits
// `tmp` and returns the checkpoint's total bytes; if it throws, `tmp` is removed and the error becomes the outcome.
// Every rank then learns the outcome: the total bytes, or the same "<what> to <final_dir> failed: ..." error.
int64_t commit_on_coordinator(const ProcessGroupPtr& group, bool coordinator, const std::string& tmp,
                              const std::string& what, const std::string& final_dir,
                              const std::function<int64_t()>& commit);

}  // namespace fsdp::checkpoint::detail
