#pragma once
// The message of a caught exception without c10::Error's backtrace: for errors that wrap another error's text in
// their own context (a collective that failed, a step abandoned after an exception), where the inner backtrace
// would bury the context.
#include <c10/util/Exception.h>

#include <exception>

namespace fsdp::detail {

inline const char* message_of(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  return ce ? ce->what_without_backtrace() : e.what();
}

}  // namespace fsdp::detail
