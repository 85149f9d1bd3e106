#pragma once
// Launch checks through the rendezvous store. A job whose ranks were started differently (another job on the same
// MASTER_PORT, different world sizes, library versions, configurations or model shapes) must fail at startup with
// an error that says what differs on which ranks — not deadlock in its first collective or silently train
// something else. init_process_group already checks the world size, the library version (library_version()) and
// that the store belongs to this run (TORCHELASTIC_RUN_ID), and rank 0's store listens only on MASTER_ADDR.
// docs/reliability.md lists what is checked.
#include <string>

namespace fsdp {

// No collective, so a mismatch cannot deadlock one: every rank passes its `value` (a configuration, a list of
// parameter shapes, ...); rank r compares with rank 0, rank 0 with every rank, and each rank that sees a
// difference throws naming `what`, the ranks and their values (long values: the first differing line). Ranks that
// do not arrive within the group timeout are named as missing. Call in the same order on every rank; a no-op
// without a store (one rank).
void check_same_on_all_ranks(const std::string& what, const std::string& value);

// "libfsdp <version> (libtorch <version>)".
std::string library_version();

}  // namespace fsdp
