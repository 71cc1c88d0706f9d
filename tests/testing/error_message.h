// defines: error_message, the message of the moetrain::Error an action throws (a test failure when it throws none),
// and expect_error, which fails unless an action throws a moetrain::Error naming every one of some words:
// how every refusal test reads the error it expects.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include <gtest/gtest.h>

#include "core/error.h"

namespace moetrain::testing {

template <class Action>
std::string error_message(Action&& action) {
  try {
    std::forward<Action>(action)();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a moetrain::Error";
  return "";
}

// Fails unless `action` throws a moetrain::Error whose message holds every one of `needles`.
template <class Action>
void expect_error(Action&& action, std::initializer_list<std::string_view> needles) {
  try {
    std::forward<Action>(action)();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (std::string_view needle : needles) {
      EXPECT_NE(message.find(needle), std::string::npos) << "message '" << message << "' lacks '" << needle << "'";
    }
    return;
  }
  ADD_FAILURE() << "expected a moetrain::Error mentioning '" << (needles.size() > 0 ? *needles.begin() : "") << "'";
}

template <class Action>
void expect_error(Action&& action, std::string_view needle) {
  expect_error(std::forward<Action>(action), {needle});
}

}  // namespace moetrain::testing
