// The dense 2 x 2 form's tests (host and GPU): the layer's shape, a 3 x 3 layer of stride 1 and
// padding 1 on a 2 x 2 image (kernels/conv2d_dense.h), and their random operands.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/conv2d.h"
#include "kernels/layout.h"

namespace cudp::kernels::testing_dense {

inline Conv2dShape dense_2x2_shape(int n, int c, int k) {
  Conv2dShape s;
  s.n = n;
  s.h = s.w = 2;
  s.c = c;
  s.k = k;
  s.r = s.s = 3;
  s.pad_h = s.pad_w = 1;
  return s;
}

// n values uniform in [-1, 1) from `seed`.
inline std::vector<float> uniform(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// uniform(n, seed) rounded to bf16: the bf16 bits and the floats they stand for.
struct Bf16Values {
  std::vector<__nv_bfloat16> bits;
  std::vector<float> values;
};
inline Bf16Values random_bf16(size_t n, uint32_t seed) {
  const std::vector<float> raw = uniform(n, seed);
  Bf16Values out{std::vector<__nv_bfloat16>(n), std::vector<float>(n)};
  f32_to_bf16_cpu(raw.data(), out.bits.data(), int64_t(n));
  bf16_to_f32_cpu(out.bits.data(), out.values.data(), int64_t(n));
  return out;
}

}  // namespace cudp::kernels::testing_dense
