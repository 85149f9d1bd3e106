#pragma once
// The error check the tests share: `f` must throw an `Error` whose message contains `needle` (the reason, not just
// any failure). Another exception type escapes (the test fails with it); no exception is a failure naming what was
// expected. error_of / expect_message_has check one message for several parts.

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <initializer_list>
#include <string>

namespace fsdp_test {

template <class Error>
void expect_error_containing(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
}

// The message of what `f` throws (any std::exception), or "" when it returns.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// `message` is an error (not empty) that holds every one of `parts` (the place and the rule, say).
inline void expect_message_has(const std::string& message, std::initializer_list<const char*> parts) {
  EXPECT_FALSE(message.empty()) << "no error; expected one mentioning '" << *parts.begin() << "'";
  for (const char* part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
}

}  // namespace fsdp_test
