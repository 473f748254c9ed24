// Shared by the model tests: a call that must fail with a message naming what went wrong.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace fp4sim::test {

// Runs call(), which must throw E with every needle in its message; if it returns, the failure
// reads `if_no_error`.
template <class E, class Call>
void expect_error_containing(const Call& call, const std::vector<std::string>& needles,
                             const std::string& if_no_error) {
  try {
    call();
    ADD_FAILURE() << if_no_error;
  } catch (const E& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace fp4sim::test
