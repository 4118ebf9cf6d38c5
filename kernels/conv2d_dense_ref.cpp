// CPU references of the dense 2 x 2 form's two kernels (kernels/conv2d_dense.h): a gather of the
// filters and a fold of the weight gradient in a fixed order, so the GPU's bits are these.
#include <cmath>
#include <vector>

#include "engine/core/error.h"
#include "kernels/conv2d_dense.h"
#include "kernels/layout.h"

namespace cudp::kernels {

void detail::check_conv2d_dense_2x2(const char* what, const Conv2dShape& shape) {
  shape.validate();
  CUDP_CHECK(conv2d_dense_2x2_applies(shape), what,
             ": the dense form takes a 3x3 convolution of stride 1 and padding 1 on a 2x2 input "
             "with C and K multiples of 8; got input ",
             shape.h, "x", shape.w, ", filters ", shape.r, "x", shape.s, ", stride ",
             shape.stride_h, ", padding ", shape.pad_h, ", C ", shape.c, ", K ", shape.k);
}

bool conv2d_dense_2x2_applies(const Conv2dShape& s) {
  return s.h == 2 && s.w == 2 && s.r == 3 && s.s == 3 && s.stride_h == 1 && s.stride_w == 1 &&
         s.pad_h == 1 && s.pad_w == 1 && s.c > 0 && s.k > 0 && s.c % 8 == 0 && s.k % 8 == 0;
}

bool conv2d_dense_2x2_view_applies(const Conv2dShape& s) {
  return conv2d_dense_2x2_applies(s) && s.k % 256 == 0 && s.c % 64 == 0;
}

void conv2d_dense_2x2_filters_cpu(const __nv_bfloat16* w, const Conv2dShape& shape,
                                  __nv_bfloat16* w_eff, const float* bias, float* bias_eff) {
  detail::check_conv2d_dense_2x2("conv2d_dense_2x2_filters_cpu", shape);
  const int64_t K = shape.k, C = shape.c;
  for (int p = 0; p < 4; ++p) {
    for (int64_t k = 0; k < K; ++k) {
      __nv_bfloat16* row = w_eff + (p * K + k) * 4 * C;
      for (int q = 0; q < 4; ++q) {
        const __nv_bfloat16* filter = w + (k * 9 + dense_2x2_tap(p, q)) * C;
        for (int64_t c = 0; c < C; ++c) row[q * C + c] = filter[c];
      }
      if (bias != nullptr) bias_eff[p * K + k] = bias[k];
    }
  }
}

void conv2d_dense_2x2_filters_cpu(const float* w, const Conv2dShape& shape, __nv_bfloat16* w_eff,
                                  const float* bias, float* bias_eff) {
  std::vector<__nv_bfloat16> rounded(static_cast<size_t>(shape.w_size()));
  f32_to_bf16_cpu(w, rounded.data(), shape.w_size());
  conv2d_dense_2x2_filters_cpu(rounded.data(), shape, w_eff, bias, bias_eff);
}

void conv2d_dense_2x2_fold_cpu(const float* dw_eff, const Conv2dShape& shape, float* dw,
                               float beta) {
  detail::check_conv2d_dense_2x2("conv2d_dense_2x2_fold_cpu", shape);
  const int64_t K = shape.k, C = shape.c;
  for (int64_t k = 0; k < K; ++k) {
    for (int tap = 0; tap < 9; ++tap) {
      for (int64_t c = 0; c < C; ++c) {
        float sum = 0.f;
        for (int p = 0; p < 4; ++p) {
          for (int q = 0; q < 4; ++q) {
            if (dense_2x2_tap(p, q) == tap) sum += dw_eff[(p * K + k) * 4 * C + q * C + c];
          }
        }
        float& out = dw[(k * 9 + tap) * C + c];
        out = beta != 0.f ? std::fma(beta, out, sum) : sum;
      }
    }
  }
}

}  // namespace cudp::kernels
