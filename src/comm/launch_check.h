#pragma once
// Private: startup agreement through the rendezvous store. A mismatched launch (another job on the same port,
// different world sizes, library versions, configs or model shapes) is reported here, naming the ranks and their
// values, instead of deadlocking or corrupting the first collective. Only the store is used — no collective.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace fsdp::comm {

struct StoreView {
  c10::intrusive_ptr<c10d::Store> store;
  int rank = 0;
  int world_size = 1;
  std::string endpoint;  // "addr:port", for messages
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// Rank 0's listening socket for the TCPStore, bound to `addr` only (c10d's TCPStore alone listens on every
// interface); handed to the store through TCPStoreOptions::masterListenFd, which takes ownership. Throws naming the
// address and port when the bind fails (e.g. another job already uses the port).
int listen_socket(const std::string& addr, int port);

// Rank 0 claims the store for `run_id`; every other rank checks the claim before writing anything else into the
// store, and refuses (throws) when the store belongs to another run: a second job on the same MASTER_PORT.
void claim_or_check_run(const StoreView& s, const std::string& run_id);

// Every rank publishes `value` under a fresh key of this run (`seq` distinguishes successive checks); rank r > 0
// compares with rank 0's value, rank 0 with every rank's. Throws naming `what`, the differing ranks and values.
// Ranks that do not publish within the timeout are named as missing.
void check_agreement(const StoreView& s, const std::string& run_id, int64_t seq, const std::string& what,
                     const std::string& value);

}  // namespace fsdp::comm
