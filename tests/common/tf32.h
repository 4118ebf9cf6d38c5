// The float a value becomes when truncated to TF32 (10 mantissa bits, toward zero): the CPU
// references' own truncation (kernels/layout.h), for tests that build TF32 operands.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/layout.h"

namespace cudp::testing {

inline float tf32_truncated(float v) {
  const uint32_t bits = kernels::detail::f32_to_tf32_bits(v);
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

}  // namespace cudp::testing
