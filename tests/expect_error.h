#pragma once
// The error check the tests share: `f` must throw an `Error` whose message contains `needle` (the reason, not just
// any failure). Another exception type escapes (the test fails with it); no exception is a failure naming what was
// expected.

#include <gtest/gtest.h>

#include <functional>
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

}  // namespace fsdp_test
