// The shape of the dense 2 x 2 form's tests (host and GPU): a 3 x 3 layer of stride 1 and padding
// 1 on a 2 x 2 image (kernels/conv2d_dense.h).
#pragma once

#include "kernels/conv2d.h"

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

}  // namespace cudp::kernels::testing_dense
