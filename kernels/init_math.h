// The per-element formulas shared by init.cu and init_ref.cpp, so both compute the same value.
#pragma once

#include <cmath>

#include "kernels/philox.h"

namespace cudp::kernels::detail {

CUDP_HD inline float uniform_at(uint64_t seed, uint64_t index, float lo, float hi) {
  const Philox4 r = philox(seed, index);
  return lo + (hi - lo) * uniform01(r.v[0]);
}

CUDP_HD inline float normal_at(uint64_t seed, uint64_t index, float mean, float std) {
  const Philox4 r = philox(seed, index);
  // u1 in (0, 1] so that log(u1) is finite.
  const float u1 = 1.0f - uniform01(r.v[0]);
  const float u2 = uniform01(r.v[1]);
  const float radius = sqrtf(-2.0f * logf(u1));
  return mean + std * radius * cosf(6.28318530717958647692f * u2);
}

}  // namespace cudp::kernels::detail
