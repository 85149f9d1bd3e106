#include "store_framing.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

namespace fsdp_lighthouse {
namespace {

// c10d::detail::validationMagicNumber (TCPStoreBackend.hpp): the first thing a c10d client sends.
constexpr uint32_t kValidationMagic = 0x3C85F7CE;

uint64_t read_le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string bytes_text(uint64_t n) { return std::to_string(n) + " bytes"; }

}  // namespace

const char* command_name(uint8_t command) {
  static const char* const names[] = {"VALIDATE", "SET", "COMPARE_SET", "GET", "ADD", "CHECK", "WAIT",
                                      "GETNUMKEYS", "DELETE_KEY", "APPEND", "MULTI_GET", "MULTI_SET", "CANCEL_WAIT",
                                      "PING", "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN", "LIST_KEYS", "BARRIER"};
  return command < sizeof names / sizeof names[0] ? names[command] : "unknown";
}

bool RequestFramer::plan(uint8_t command) {
  using F = Field;
  auto set = [&](std::initializer_list<Field> fields, int repeat_from = -1) {
    field_count_ = 0;
    for (Field f : fields) fields_[field_count_++] = f;
    repeat_from_ = repeat_from;
  };
  switch (static_cast<StoreCommand>(command)) {
    case StoreCommand::kValidate: case StoreCommand::kPing: set({F::kU32}); break;
    case StoreCommand::kSet: case StoreCommand::kAppend: case StoreCommand::kQueuePush: set({F::kKey, F::kValue}); break;
    case StoreCommand::kCompareSet: set({F::kKey, F::kValue, F::kValue}); break;
    case StoreCommand::kGet: case StoreCommand::kDeleteKey: case StoreCommand::kQueuePop: case StoreCommand::kQueueLen:
      set({F::kKey});
      break;
    case StoreCommand::kAdd: case StoreCommand::kBarrier: set({F::kKey, F::kI64}); break;
    case StoreCommand::kCheck: case StoreCommand::kWait: case StoreCommand::kMultiGet: set({F::kCount, F::kKey}, 1); break;
    case StoreCommand::kMultiSet: set({F::kCount, F::kKey, F::kValue}, 1); break;
    case StoreCommand::kGetNumKeys: case StoreCommand::kCancelWait: case StoreCommand::kListKeys: set({}); break;
    default: return false;
  }
  return true;
}

RequestFramer::Status RequestFramer::refuse(std::string why) {
  error_ = std::move(why);
  return Status::kRefused;
}

void RequestFramer::consumed() {
  field_count_ = field_ = 0;
  repeat_from_ = -1;
  count_ = repeats_left_ = body_left_ = 0;
  in_body_ = false;
  offset_ = 0;
}

RequestFramer::Status RequestFramer::next(const uint8_t* data, size_t size) {
  if (!error_.empty()) return Status::kRefused;
  const uint64_t max_request = limits_.max_request_bytes;
  // Whether `need` more bytes from offset_ keep the request within its limit.
  auto fits = [&](uint64_t need) { return offset_ <= max_request && need <= max_request - offset_; };
  auto over = [&](uint64_t need) {
    return refuse(std::string(command_name(command_)) + " request over --max-request-bytes (" +
                  bytes_text(max_request) + "): at least " + std::to_string(offset_ + need) + " bytes announced");
  };
  if (offset_ == 0) {  // a new request: its command byte
    if (size == 0) return Status::kNeedMore;
    command_ = data[0];
    offset_ = 1;
    if (!validated_ && command_ != static_cast<uint8_t>(StoreCommand::kValidate)) {
      return refuse("the first request is " + std::string(command_name(command_)) + " (command byte " +
                    std::to_string(command_) + "), not VALIDATE");
    }
    if (validated_ && command_ == static_cast<uint8_t>(StoreCommand::kValidate)) {
      return refuse("VALIDATE after the connection was validated");
    }
    if (!plan(command_)) return refuse("unknown command byte " + std::to_string(command_));
  }
  while (true) {
    if (field_ == field_count_) {
      if (repeat_from_ >= 0 && repeats_left_ > 1) {
        --repeats_left_;
        field_ = repeat_from_;
        continue;
      }
      if (command_ == static_cast<uint8_t>(StoreCommand::kValidate)) validated_ = true;
      return Status::kComplete;
    }
    const size_t have = size - offset_;
    const Field field = fields_[field_];
    switch (field) {
      case Field::kU32:
      case Field::kI64: {
        const int width = field == Field::kU32 ? 4 : 8;
        if (!fits(width)) return over(width);
        if (have < static_cast<size_t>(width)) return Status::kNeedMore;
        if (command_ == static_cast<uint8_t>(StoreCommand::kValidate) && read_le(data + offset_, 4) != kValidationMagic) {
          return refuse("VALIDATE with a wrong magic number (not a c10d TCPStore client)");
        }
        offset_ += width;
        ++field_;
        break;
      }
      case Field::kCount: {
        if (!fits(8)) return over(8);
        if (have < 8) return Status::kNeedMore;
        count_ = read_le(data + offset_, 8);
        offset_ += 8;
        if (count_ > limits_.max_keys) {
          return refuse(std::string(command_name(command_)) + " of " + std::to_string(count_) +
                        " keys, over --max-keys (" + std::to_string(limits_.max_keys) + ")");
        }
        // Each key (and value) brings at least its 8-byte length: refuse a count the request could never hold.
        const uint64_t per_key = command_ == static_cast<uint8_t>(StoreCommand::kMultiSet) ? 16 : 8;
        if (!fits(count_ * per_key)) return over(count_ * per_key);  // count_ <= max_keys: no overflow
        ++field_;
        repeats_left_ = count_;
        if (count_ == 0) {
          field_ = field_count_;
          repeat_from_ = -1;
        }
        break;
      }
      case Field::kKey:
      case Field::kValue: {
        if (!in_body_) {
          if (!fits(8)) return over(8);
          if (have < 8) return Status::kNeedMore;
          const uint64_t length = read_le(data + offset_, 8);
          offset_ += 8;
          const bool key = field == Field::kKey;
          const uint64_t limit = key ? limits_.max_key_bytes : limits_.max_value_bytes;
          if (length > limit) {
            return refuse(std::string(command_name(command_)) + " with a " + (key ? "key" : "value") + " of " +
                          bytes_text(length) + ", over " + (key ? "--max-key-bytes" : "--max-value-bytes") + " (" +
                          bytes_text(limit) + ")");
          }
          if (!fits(length)) return over(length);
          body_left_ = length;
          in_body_ = true;
        }
        const size_t take = static_cast<size_t>(std::min<uint64_t>(body_left_, size - offset_));
        offset_ += take;
        body_left_ -= take;
        if (body_left_ > 0) return Status::kNeedMore;
        in_body_ = false;
        ++field_;
        break;
      }
    }
  }
}

bool ReplyTracker::expect(uint8_t command, uint64_t key_count) {
  auto fixed = [&](uint64_t bytes) {
    phase_ = Phase::kFixed;
    left_ = bytes;
  };
  switch (static_cast<StoreCommand>(command)) {
    case StoreCommand::kAdd: case StoreCommand::kGetNumKeys: case StoreCommand::kDeleteKey:
    case StoreCommand::kQueueLen:
      fixed(8);  // an int64
      break;
    case StoreCommand::kCheck: fixed(1); break;  // CheckResponseType
    case StoreCommand::kPing: fixed(4); break;   // the nonce back
    case StoreCommand::kGet: case StoreCommand::kCompareSet:
      values_left_ = 1;
      phase_ = Phase::kValueLength;
      break;
    case StoreCommand::kMultiGet:
      values_left_ = key_count;
      if (key_count > 0) phase_ = Phase::kValueLength;
      break;
    case StoreCommand::kListKeys: phase_ = Phase::kCount; break;
    case StoreCommand::kQueuePop: phase_ = Phase::kQueueSize; break;
    case StoreCommand::kWait: case StoreCommand::kBarrier: wait_pending_ = true; break;
    case StoreCommand::kCancelWait: cancel_pending_ = true; break;
    default: break;  // VALIDATE, SET, APPEND, MULTI_SET, QUEUE_PUSH: no reply
  }
  header_ = 0;
  header_have_ = 0;
  return awaiting();
}

void ReplyTracker::header_done(uint64_t value) {
  header_ = 0;
  header_have_ = 0;
  switch (phase_) {
    case Phase::kCount:  // LIST_KEYS: that many keys, each as a length and its bytes
      values_left_ = static_cast<int64_t>(value) > 0 ? value : 0;
      phase_ = values_left_ > 0 ? Phase::kValueLength : Phase::kIdle;
      break;
    case Phase::kQueueSize:  // QUEUE_POP: the queue's length before the pop; its front value follows if > 0
      values_left_ = static_cast<int64_t>(value) > 0 ? 1 : 0;
      phase_ = values_left_ > 0 ? Phase::kValueLength : Phase::kIdle;
      break;
    case Phase::kValueLength:
      left_ = value;
      phase_ = Phase::kValueBody;
      if (left_ == 0) phase_ = --values_left_ > 0 ? Phase::kValueLength : Phase::kIdle;
      break;
    default: break;
  }
}

void ReplyTracker::feed(const uint8_t* data, size_t size) {
  size_t at = 0;
  while (at < size) {
    switch (phase_) {
      case Phase::kIdle: {
        // WaitResponseType: STOP_WAITING (0) ends a WAIT/BARRIER, WAIT_CANCELED (1) a CANCEL_WAIT (and the wait).
        const uint8_t byte = data[at++];
        if (byte == 0 && wait_pending_) {
          wait_pending_ = false;
        } else if (byte == 1 && cancel_pending_) {
          cancel_pending_ = wait_pending_ = false;
        }
        break;
      }
      case Phase::kFixed:
      case Phase::kValueBody: {
        const size_t take = static_cast<size_t>(std::min<uint64_t>(left_, size - at));
        at += take;
        left_ -= take;
        if (left_ == 0) {
          if (phase_ == Phase::kFixed) {
            phase_ = Phase::kIdle;
          } else {
            phase_ = --values_left_ > 0 ? Phase::kValueLength : Phase::kIdle;
          }
        }
        break;
      }
      case Phase::kCount:
      case Phase::kQueueSize:
      case Phase::kValueLength:
        header_ |= static_cast<uint64_t>(data[at++]) << (8 * header_have_);
        if (++header_have_ == 8) header_done(header_);
        break;
    }
  }
}

}  // namespace fsdp_lighthouse
