// Checked size arithmetic for numbers that come from outside: file headers, checkpoints, the command
// line.
//
// Why: a shape or a batch size read from a file is attacker-controlled. Multiplied unchecked, it
// wraps to a small number, a small buffer is allocated, and the code that trusts the product writes
// past it (a huge --batch-size did exactly that in the loader). Every product or sum of such sizes
// goes through these, which throw ValueError naming what was computed instead of wrapping.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/error.h"

namespace cudp {

// a * b for non-negative a and b; throws ValueError naming `what` when either is negative or the
// product does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &out)) {
    CUDP_THROW(ValueError, what, ": ", a, " x ", b,
               (a < 0 || b < 0 ? " has a negative factor" : " overflows 64-bit sizes"));
  }
  return out;
}

// a + b for non-negative a and b; throws ValueError naming `what` when either is negative or the sum
// does not fit in int64.
inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t out = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &out)) {
    CUDP_THROW(ValueError, what, ": ", a, " + ", b,
               (a < 0 || b < 0 ? " has a negative term" : " overflows 64-bit sizes"));
  }
  return out;
}

}  // namespace cudp
