// The shape of a layer the dense 2 x 2 form takes (kernels/conv2d_dense.h), for its host and GPU
// tests.
#pragma once

#include "kernels/conv2d.h"

namespace cudp::testing {

// n images of 2 x 2 x c through 3 x 3 filters to k channels, stride 1, padding 1.
inline kernels::Conv2dShape dense_2x2_shape(int n, int c, int k) {
  kernels::Conv2dShape s;
  s.n = n;
  s.h = s.w = 2;
  s.c = c;
  s.k = k;
  s.r = s.s = 3;
  s.pad_h = s.pad_w = 1;
  return s;
}

}  // namespace cudp::testing
