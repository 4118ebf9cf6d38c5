// Expectations on the errors cudp throws: that a statement throws, of the given type, with a
// message that says the given thing. On a failure the message actually thrown is printed.
//
//   EXPECT_THROW_WITH(net.forward(x), "expects 4-d input");        // any std::exception
//   EXPECT_VALUE_ERROR(sgd_step_cpu(...), "lr must be >= 0");      // a cudp::ValueError
//
// An exception of another type is not caught: the test fails with it.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "engine/core/error.h"

#define CUDP_EXPECT_THROW_OF(statement, Type, fragment)                          \
  do {                                                                           \
    try {                                                                        \
      statement;                                                                 \
      ADD_FAILURE() << "expected a " #Type " containing: " << (fragment);        \
    } catch (const Type& e) {                                                    \
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)         \
          << "message: " << e.what() << "\nexpected to contain: " << (fragment); \
    }                                                                            \
  } while (0)

#define EXPECT_THROW_WITH(statement, fragment) \
  CUDP_EXPECT_THROW_OF(statement, std::exception, fragment)
#define EXPECT_VALUE_ERROR(statement, fragment) \
  CUDP_EXPECT_THROW_OF(statement, ::cudp::ValueError, fragment)
