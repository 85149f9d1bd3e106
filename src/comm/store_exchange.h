#pragma once
// Out-of-band helpers of a process group for the library's own recovery (fully_shard's reset after an exception):
// they work while a collective is stuck or the ranks are out of step, because they go through the rendezvous store
// or the group's local record, never through the backend. Not part of the public API.

#include <fsdp/comm_stats.h>  // collectives_called(group): what the ranks exchange to check they are in step
#include <fsdp/process_group.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::comm {

// The error of the first collective of `group` that failed on this rank (timeout, peer gone), or nothing. After
// one, the ranks are out of step for good: no later collective of the group can be trusted.
std::optional<std::string> first_failure(const ProcessGroup& group);

// Every rank of the group publishes `value` and receives every rank's value (indexed by group rank) through the
// rendezvous store. Calls pair up by their order on each rank (the n-th call of every rank meets the n-th);
// `what` names the purpose in errors. Throws naming the ranks that did not arrive within `timeout`.
std::vector<std::string> exchange_through_store(ProcessGroup& group, const std::string& what, const std::string& value,
                                                std::chrono::milliseconds timeout);

}  // namespace fsdp::comm
