// The request framing of the c10d TCPStore wire protocol, as fsdp-lighthouse's relay sees it (relay.h): which bytes
// a client sent make one complete request, whether that request is within the lighthouse's limits, and how long the
// server's reply to it is. Only the framing: keys and values are never interpreted, the store stays c10d's.
//
// The format is the one c10d's libuv server parses (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp, QueryType
// in TCPStoreBackend.hpp): a command byte, then the command's fields — integers little-endian, a key or a value as
// a u64 length and that many bytes, CHECK/WAIT/MULTI_GET a u64 count and that many keys, MULTI_SET a count and that
// many key/value pairs. A connection's first request must be VALIDATE with c10d's magic number.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fsdp_lighthouse {

enum class StoreCommand : uint8_t {
  kValidate = 0, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kGetNumKeys, kDeleteKey, kAppend, kMultiGet,
  kMultiSet, kCancelWait, kPing, kQueuePush, kQueuePop, kQueueLen, kListKeys, kBarrier,
};
const char* command_name(uint8_t command);

// What the relay accepts in one request (fsdp-lighthouse --help lists them with their defaults).
struct RequestLimits {
  uint64_t max_key_bytes = 8 * 1024;            // one key (c10d's own limit)
  uint64_t max_value_bytes = 1024 * 1024;       // one value
  uint64_t max_keys = 16 * 1024;                // keys of one CHECK, WAIT, MULTI_GET or MULTI_SET
  uint64_t max_request_bytes = 4 * 1024 * 1024; // one request, command byte included
};

// Frames one connection's requests, incrementally: next() is given the bytes received since the last complete
// request (the same prefix, grown, while it is incomplete) and resumes where it stopped, so a large request is
// parsed once in all, not once per read.
class RequestFramer {
 public:
  enum class Status { kNeedMore, kComplete, kRefused };
  explicit RequestFramer(const RequestLimits& limits) : limits_(limits) {}

  // kComplete: the first request_bytes() bytes of `data` are one well-formed request (command() says which);
  // call consumed() before framing what follows. kRefused: malformed or over a limit, error() says which rule
  // (the connection is to be closed: there is no resynchronising on this protocol). kNeedMore: incomplete so far.
  Status next(const uint8_t* data, size_t size);
  void consumed();  // after kComplete: the next call starts a new request

  size_t request_bytes() const { return offset_; }
  uint8_t command() const { return command_; }
  uint64_t key_count() const { return count_; }  // of the complete CHECK/WAIT/MULTI_GET/MULTI_SET
  const std::string& error() const { return error_; }

 private:
  enum class Field : uint8_t { kU32, kI64, kCount, kKey, kValue };
  Status refuse(std::string why);
  bool plan(uint8_t command);  // the fields of `command` (false: unknown command)

  RequestLimits limits_;
  bool validated_ = false;  // the connection's VALIDATE came
  // The request being framed: its fields in order (the repeated part of CHECK/WAIT/MULTI_* from repeat_from_).
  Field fields_[4] = {};
  int field_count_ = 0;
  int field_ = 0;          // the field being read
  int repeat_from_ = -1;   // fields_[repeat_from_ ..] repeat count_ times
  uint64_t count_ = 0;     // the request's key count
  uint64_t repeats_left_ = 0;
  uint64_t body_left_ = 0; // bytes of a key's/value's body still to come (after its length)
  bool in_body_ = false;
  size_t offset_ = 0;      // bytes of the request framed so far
  uint8_t command_ = 0;
  std::string error_;
};

// Follows the server's replies on one upstream connection, to know when the reply to the last forwarded request is
// complete: the relay forwards a client's next request only then (c10d's own client never has two requests with
// replies in flight), which bounds what the server can queue for a client that does not read. WAIT and BARRIER are
// answered by one byte whenever the keys arrive; CANCEL_WAIT may follow a WAIT still pending, and then the server
// sends STOP_WAITING (if the keys came first) and WAIT_CANCELED.
class ReplyTracker {
 public:
  // A request was forwarded; `key_count` is its key count for MULTI_GET. Returns whether a reply is now awaited.
  bool expect(uint8_t command, uint64_t key_count);
  // Consumes reply bytes; bytes nobody awaits (the server's, trusted) are passed over.
  void feed(const uint8_t* data, size_t size);
  bool awaiting() const { return wait_pending_ || cancel_pending_ || phase_ != Phase::kIdle; }
  bool wait_pending() const { return wait_pending_; }  // a WAIT/BARRIER: only CANCEL_WAIT may follow it

 private:
  // Where in the awaited reply the bytes are: a fixed-size field, an 8-byte count (LIST_KEYS), an 8-byte queue
  // length (QUEUE_POP: a value follows if it is > 0), a value's 8-byte length, a value's body.
  enum class Phase : uint8_t { kIdle, kFixed, kCount, kQueueSize, kValueLength, kValueBody };
  void header_done(uint64_t value);
  Phase phase_ = Phase::kIdle;
  uint64_t left_ = 0;         // bytes of the fixed field or of the value's body still to come
  uint64_t header_ = 0;       // the 8-byte length/count being read, little-endian
  int header_have_ = 0;
  uint64_t values_left_ = 0;  // values of the reply still to come (this one included)
  bool wait_pending_ = false;
  bool cancel_pending_ = false;
};

}  // namespace fsdp_lighthouse
