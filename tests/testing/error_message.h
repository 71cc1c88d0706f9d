// defines: error_message, the message of the moetrain::Error an action throws (a test failure when it throws none):
// how every refusal test reads the error it expects.
#pragma once

#include <string>
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

}  // namespace moetrain::testing
