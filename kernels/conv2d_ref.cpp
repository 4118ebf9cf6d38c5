// CPU references for conv2d (docs/architecture.md §2.5): straight loops over the definition, in double.
// The backward passes are written as the adjoint of the forward loop nest (scatter each dy element
// back along the taps that produced it), not as the gathers the GPU kernels use, so the two do not
// share a mistake about which input pixel a padded, strided tap reads.
#include <algorithm>
#include <vector>

#include "kernels/conv2d.h"

namespace cudp::kernels {
namespace {

// Calls fn(ih, iw, x offset) for every tap (r, s) of output pixel (n, p, q) that lands inside the
// image, with the filter offset ((k*R + r)*S + s)*C left to the caller through (r, s).
template <class Fn>
void for_each_tap(const Conv2dShape& sh, int n, int p, int q, Fn&& fn) {
  for (int r = 0; r < sh.r; ++r) {
    const int ih = p * sh.stride_h - sh.pad_h + r;
    if (ih < 0 || ih >= sh.h) continue;
    for (int s = 0; s < sh.s; ++s) {
      const int iw = q * sh.stride_w - sh.pad_w + s;
      if (iw < 0 || iw >= sh.w) continue;
      fn(r, s, ((int64_t(n) * sh.h + ih) * sh.w + iw) * sh.c);
    }
  }
}

int64_t filter_offset(const Conv2dShape& sh, int k, int r, int s) {
  return ((int64_t(k) * sh.r + r) * sh.s + s) * sh.c;
}

}  // namespace

void conv2d_forward_cpu(const Conv2dShape& sh, const float* x, const float* w, const float* bias,
                        float* y, bool relu) {
  sh.validate();
  const int P = sh.p(), Q = sh.q();
  for (int n = 0; n < sh.n; ++n) {
    for (int p = 0; p < P; ++p) {
      for (int q = 0; q < Q; ++q) {
        float* out = y + ((int64_t(n) * P + p) * Q + q) * sh.k;
        for (int k = 0; k < sh.k; ++k) {
          double acc = bias ? bias[k] : 0.0;
          for_each_tap(sh, n, p, q, [&](int r, int s, int64_t xo) {
            const float* wk = w + filter_offset(sh, k, r, s);
            for (int c = 0; c < sh.c; ++c) acc += double(x[xo + c]) * wk[c];
          });
          out[k] = float(relu && acc <= 0.0 ? 0.0 : acc);  // NaN kept, as kernels/elementwise.h
        }
      }
    }
  }
}

void conv2d_backward_data_cpu(const Conv2dShape& sh, const float* dy, const float* w, float* dx) {
  sh.validate();
  const int P = sh.p(), Q = sh.q();
  std::vector<double> acc(size_t(sh.x_size()), 0.0);
  for (int n = 0; n < sh.n; ++n) {
    for (int p = 0; p < P; ++p) {
      for (int q = 0; q < Q; ++q) {
        const float* g = dy + ((int64_t(n) * P + p) * Q + q) * sh.k;
        for_each_tap(sh, n, p, q, [&](int r, int s, int64_t xo) {
          for (int k = 0; k < sh.k; ++k) {
            const float* wk = w + filter_offset(sh, k, r, s);
            for (int c = 0; c < sh.c; ++c) acc[xo + c] += double(g[k]) * wk[c];
          }
        });
      }
    }
  }
  std::copy(acc.begin(), acc.end(), dx);
}

void conv2d_backward_weight_cpu(const Conv2dShape& sh, const float* x, const float* dy, float* dw,
                                float beta) {
  sh.validate();
  const int P = sh.p(), Q = sh.q();
  std::vector<double> acc(size_t(sh.w_size()), 0.0);
  for (int n = 0; n < sh.n; ++n) {
    for (int p = 0; p < P; ++p) {
      for (int q = 0; q < Q; ++q) {
        const float* g = dy + ((int64_t(n) * P + p) * Q + q) * sh.k;
        for_each_tap(sh, n, p, q, [&](int r, int s, int64_t xo) {
          for (int k = 0; k < sh.k; ++k) {
            double* dwk = acc.data() + filter_offset(sh, k, r, s);
            for (int c = 0; c < sh.c; ++c) dwk[c] += double(g[k]) * x[xo + c];
          }
        });
      }
    }
  }
  // beta = 0 must not read dw: it may be uninitialised.
  for (size_t i = 0; i < acc.size(); ++i) {
    dw[i] = float(beta == 0.f ? acc[i] : double(beta) * dw[i] + acc[i]);
  }
}

}  // namespace cudp::kernels
