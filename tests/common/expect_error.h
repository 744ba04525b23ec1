// The check of the bad-input tests, free of libtorch (the tokenizer and data tests build without it).
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "lt2/util/error.h"

namespace lt2::testing {

// Runs f and expects it to throw an lt2::Error whose message contains `needle`.
inline void expect_error_containing(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an lt2::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

}  // namespace lt2::testing
