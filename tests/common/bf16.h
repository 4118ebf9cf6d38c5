// The float a value becomes when rounded to bf16 (to nearest, ties to even): the kernels' own
// rounding (kernels/layout.h), for tests that build bf16 operands or their CPU references.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/layout.h"

namespace cudp::testing {

inline float bf16_rounded(float v) {
  const uint32_t wide = uint32_t(kernels::detail::f32_to_bf16_bits(v)) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

}  // namespace cudp::testing
