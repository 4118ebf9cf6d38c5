// The float a value becomes when rounded to bf16 (to nearest, ties to even): the kernels' own
// rounding (kernels/layout.h), for tests that build bf16 operands or their CPU references; and the
// floats that bf16 bit patterns stand for (exact), for tests that read bf16 outputs back.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/layout.h"

namespace cudp::testing {

inline float bf16_widened(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

inline std::vector<float> bf16_widened(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_widened(bits[i]);
  return out;
}

inline float bf16_rounded(float v) {
  return bf16_widened(kernels::detail::f32_to_bf16_bits(v));
}

}  // namespace cudp::testing
