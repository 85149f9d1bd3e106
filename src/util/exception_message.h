#pragma once
// The message of a caught exception without c10::Error's backtrace: for errors that wrap another error's text in
// their own context (a collective that failed, a step abandoned after an exception), where the inner backtrace
// would bury the context.
#include <c10/util/Exception.h>

#include <exception>
#include <string>

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer's dynamic annotations (provided by its runtime).
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace fsdp::detail {

// A copy, not a pointer into the exception: the exception may be one that a c10d backend thread created and
// handed over through libtorch's own (uninstrumented) synchronisation, which ThreadSanitizer cannot see. Under
// TSan the copy's reads of that object are the only ones ignored (docs/reliability.md, "Sanitizers").
inline std::string message_of(const std::exception& e) {
#if defined(__SANITIZE_THREAD__)
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
#endif
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string message = ce ? ce->what_without_backtrace() : e.what();
#if defined(__SANITIZE_THREAD__)
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  return message;
}

}  // namespace fsdp::detail
