#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/core/error.h"
#include "kernels/layout.h"
#include "kernels/pool.h"

namespace cudp::kernels {

int max_pool2d_output_size(int in, int kernel, int stride, int pad) {
  CUDP_CHECK(kernel >= 1, "max_pool2d: kernel size must be >= 1, got ", kernel);
  CUDP_CHECK(stride >= 1, "max_pool2d: stride must be >= 1, got ", stride);
  CUDP_CHECK(pad >= 0 && pad <= kernel / 2,
             "max_pool2d: pad should be at most half of kernel size ", "(pad ", pad, ", kernel ",
             kernel, ")");
  const int out = (in + 2 * pad - kernel) / stride + 1;
  CUDP_CHECK(in >= 1 && in + 2 * pad >= kernel, "max_pool2d: input size ", in, " with pad ", pad,
             " is smaller than the kernel ", kernel, ": output size is too small");
  return out;
}

namespace detail {

void check_max_pool2d(int n, int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                      int pad_h, int pad_w) {
  CUDP_CHECK(n >= 0, "max_pool2d: batch size must be >= 0, got ", n);
  CUDP_CHECK(h >= 1, "max_pool2d: height must be >= 1, got ", h);
  CUDP_CHECK(w >= 1, "max_pool2d: width must be >= 1, got ", w);
  CUDP_CHECK(c >= 1, "max_pool2d: channels must be >= 1, got ", c);
  max_pool2d_output_size(h, kh, stride_h, pad_h);
  max_pool2d_output_size(w, kw, stride_w, pad_w);
}

void check_adaptive_avg_pool2d(int n, int h, int w, int c, int out_h, int out_w) {
  CUDP_CHECK(n >= 0, "adaptive_avg_pool2d: batch size must be >= 0, got ", n);
  CUDP_CHECK(h >= 1, "adaptive_avg_pool2d: height must be >= 1, got ", h);
  CUDP_CHECK(w >= 1, "adaptive_avg_pool2d: width must be >= 1, got ", w);
  CUDP_CHECK(c >= 1, "adaptive_avg_pool2d: channels must be >= 1, got ", c);
  CUDP_CHECK(out_h >= 1, "adaptive_avg_pool2d: output height must be >= 1, got ", out_h);
  CUDP_CHECK(out_w >= 1, "adaptive_avg_pool2d: output width must be >= 1, got ", out_w);
}

}  // namespace detail

template <typename T>
void max_pool2d_forward_cpu(const T* x, std::type_identity_t<T>* y, int32_t* indices, int n, int h,
                            int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                            int pad_w) {
  detail::check_max_pool2d(n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const int oh_count = max_pool2d_output_size(h, kh, stride_h, pad_h);
  const int ow_count = max_pool2d_output_size(w, kw, stride_w, pad_w);
  for (int b = 0; b < n; ++b) {
    for (int oh = 0; oh < oh_count; ++oh) {
      for (int ow = 0; ow < ow_count; ++ow) {
        for (int ch = 0; ch < c; ++ch) {
          // Every position of the padded window, padding included: a padded one is -inf and never
          // wins under `>`; the initial index is the first real position, as in PyTorch.
          const int h0 = oh * stride_h - pad_h, w0 = ow * stride_w - pad_w;
          T best = -std::numeric_limits<T>::infinity();
          int32_t arg = std::max(h0, 0) * w + std::max(w0, 0);
          for (int ih = h0; ih < h0 + kh; ++ih) {
            for (int iw = w0; iw < w0 + kw; ++iw) {
              if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
              const T v = x[((int64_t(b) * h + ih) * w + iw) * c + ch];
              if (v > best || std::isnan(v)) {
                best = v;
                arg = ih * w + iw;
              }
            }
          }
          const int64_t o = ((int64_t(b) * oh_count + oh) * ow_count + ow) * c + ch;
          y[o] = best;
          indices[o] = arg;
        }
      }
    }
  }
}

template <typename T>
void max_pool2d_backward_cpu(const T* dy, const int32_t* indices, std::type_identity_t<T>* dx,
                             int n, int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                             int pad_h, int pad_w) {
  detail::check_max_pool2d(n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const int oh_count = max_pool2d_output_size(h, kh, stride_h, pad_h);
  const int ow_count = max_pool2d_output_size(w, kw, stride_w, pad_w);
  // Scatter (the GPU gathers): each output sends its gradient to the element it took.
  std::vector<double> acc(size_t(n) * h * w * c, 0.0);
  for (int b = 0; b < n; ++b) {
    for (int o = 0; o < oh_count * ow_count; ++o) {
      for (int ch = 0; ch < c; ++ch) {
        const int64_t out = (int64_t(b) * oh_count * ow_count + o) * c + ch;
        const int32_t at = indices[out];
        CUDP_CHECK(at >= 0 && at < h * w, "max_pool2d_backward: index ", at, " at output ", out,
                   " is outside the ", h, "x", w, " input plane");
        acc[(int64_t(b) * h * w + at) * c + ch] += double(dy[out]);
      }
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) dx[i] = T(acc[i]);
}

// The codes from the general forward's indices: the element the window took, and bit 2 where its
// value is <= 0.
template <typename T>
void max_pool2d_2x2_forward_cpu(const T* x, std::type_identity_t<T>* y, uint8_t* codes, int n,
                                int h, int w, int c) {
  detail::check_max_pool2d(n, h, w, c, 2, 2, 2, 2, 0, 0);
  const int oh_count = h / 2, ow_count = w / 2;
  std::vector<int32_t> indices(size_t(n) * oh_count * ow_count * c);
  max_pool2d_forward_cpu<T>(x, y, indices.data(), n, h, w, c, 2, 2, 2, 2, 0, 0);
  for (size_t i = 0; i < indices.size(); ++i) {
    const int64_t ow = int64_t(i / size_t(c)) % ow_count;
    const int64_t oh = int64_t(i / (size_t(c) * ow_count)) % oh_count;
    const int dh = int(indices[i] / w - 2 * oh), dw = int(indices[i] % w - 2 * ow);
    CUDP_CHECK(dh >= 0 && dh < 2 && dw >= 0 && dw < 2, "max_pool2d_2x2_forward: index ", indices[i],
               " outside window (", oh, ", ", ow, ")");
    codes[i] = uint8_t(2 * dh + dw + (y[i] <= T(0) ? 4 : 0));
  }
}

template <typename T>
void max_pool2d_2x2_backward_cpu(const T* dy, const uint8_t* codes, std::type_identity_t<T>* dx,
                                 int n, int h, int w, int c, bool relu_mask) {
  detail::check_max_pool2d(n, h, w, c, 2, 2, 2, 2, 0, 0);
  const int oh_count = h / 2, ow_count = w / 2;
  std::fill(dx, dx + size_t(n) * h * w * c, T(0));
  // Scatter (the GPU gathers): each output sends its gradient to the element its code names.
  for (int b = 0; b < n; ++b) {
    for (int oh = 0; oh < oh_count; ++oh) {
      for (int ow = 0; ow < ow_count; ++ow) {
        for (int ch = 0; ch < c; ++ch) {
          const int64_t out = ((int64_t(b) * oh_count + oh) * ow_count + ow) * c + ch;
          const int code = codes[out];
          CUDP_CHECK(code < 8, "max_pool2d_2x2_backward: code ", code, " at output ", out,
                     " is not a 2x2 window code (0-7)");
          const int ih = 2 * oh + (code & 3) / 2, iw = 2 * ow + (code & 1);
          dx[((int64_t(b) * h + ih) * w + iw) * c + ch] =
              relu_mask && (code & 4) != 0 ? T(0) : dy[out];
        }
      }
    }
  }
}

namespace {
// PyTorch's adaptive windows: [floor(i*in/out), ceil((i+1)*in/out)).
int window_start(int i, int in, int out) {
  return int(int64_t(i) * in / out);
}
int window_end(int i, int in, int out) {
  return int((int64_t(i + 1) * in + out - 1) / out);
}
}  // namespace

template <typename T>
void adaptive_avg_pool2d_forward_cpu(const T* x, std::type_identity_t<T>* y, int n, int h, int w,
                                     int c, int out_h, int out_w) {
  detail::check_adaptive_avg_pool2d(n, h, w, c, out_h, out_w);
  for (int b = 0; b < n; ++b) {
    for (int oh = 0; oh < out_h; ++oh) {
      const int h0 = window_start(oh, h, out_h), h1 = window_end(oh, h, out_h);
      for (int ow = 0; ow < out_w; ++ow) {
        const int w0 = window_start(ow, w, out_w), w1 = window_end(ow, w, out_w);
        for (int ch = 0; ch < c; ++ch) {
          double sum = 0;
          for (int ih = h0; ih < h1; ++ih) {
            for (int iw = w0; iw < w1; ++iw)
              sum += double(x[((int64_t(b) * h + ih) * w + iw) * c + ch]);
          }
          y[((int64_t(b) * out_h + oh) * out_w + ow) * c + ch] =
              T(sum / double((h1 - h0) * (w1 - w0)));
        }
      }
    }
  }
}

template <typename T>
void adaptive_avg_pool2d_backward_cpu(const T* dy, std::type_identity_t<T>* dx, int n, int h, int w,
                                      int c, int out_h, int out_w) {
  detail::check_adaptive_avg_pool2d(n, h, w, c, out_h, out_w);
  // Scatter (the GPU gathers): each output spreads its gradient evenly over its window.
  std::vector<double> acc(size_t(n) * h * w * c, 0.0);
  for (int b = 0; b < n; ++b) {
    for (int oh = 0; oh < out_h; ++oh) {
      const int h0 = window_start(oh, h, out_h), h1 = window_end(oh, h, out_h);
      for (int ow = 0; ow < out_w; ++ow) {
        const int w0 = window_start(ow, w, out_w), w1 = window_end(ow, w, out_w);
        const double area = double((h1 - h0) * (w1 - w0));
        for (int ch = 0; ch < c; ++ch) {
          const double g = double(dy[((int64_t(b) * out_h + oh) * out_w + ow) * c + ch]) / area;
          for (int ih = h0; ih < h1; ++ih) {
            for (int iw = w0; iw < w1; ++iw) acc[((int64_t(b) * h + ih) * w + iw) * c + ch] += g;
          }
        }
      }
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) dx[i] = T(acc[i]);
}

#define CUDP_POOL_INSTANTIATE(T)                                                                  \
  template void max_pool2d_forward_cpu<T>(const T*, T*, int32_t*, int, int, int, int, int, int,   \
                                          int, int, int, int);                                    \
  template void max_pool2d_backward_cpu<T>(const T*, const int32_t*, T*, int, int, int, int, int, \
                                           int, int, int, int, int);                              \
  template void max_pool2d_2x2_forward_cpu<T>(const T*, T*, uint8_t*, int, int, int, int);        \
  template void max_pool2d_2x2_backward_cpu<T>(const T*, const uint8_t*, T*, int, int, int, int,  \
                                               bool);                                             \
  template void adaptive_avg_pool2d_forward_cpu<T>(const T*, T*, int, int, int, int, int, int);   \
  template void adaptive_avg_pool2d_backward_cpu<T>(const T*, T*, int, int, int, int, int, int);
CUDP_POOL_INSTANTIATE(float)
CUDP_POOL_INSTANTIATE(double)
#undef CUDP_POOL_INSTANTIATE

void max_pool2d_forward_cpu(const __nv_bfloat16* x, __nv_bfloat16* y, int32_t* indices, int n,
                            int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                            int pad_h, int pad_w) {
  detail::check_max_pool2d(n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const int64_t out = int64_t(n) * max_pool2d_output_size(h, kh, stride_h, pad_h) *
                      max_pool2d_output_size(w, kw, stride_w, pad_w) * c;
  std::vector<float> xf(size_t(n) * h * w * c), yf(static_cast<size_t>(out));
  bf16_to_f32_cpu(x, xf.data(), int64_t(xf.size()));
  max_pool2d_forward_cpu<float>(xf.data(), yf.data(), indices, n, h, w, c, kh, kw, stride_h,
                                stride_w, pad_h, pad_w);
  f32_to_bf16_cpu(yf.data(), y, out);
}

void max_pool2d_backward_cpu(const __nv_bfloat16* dy, const int32_t* indices, __nv_bfloat16* dx,
                             int n, int h, int w, int c, int kh, int kw, int stride_h, int stride_w,
                             int pad_h, int pad_w) {
  detail::check_max_pool2d(n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const int64_t out = int64_t(n) * max_pool2d_output_size(h, kh, stride_h, pad_h) *
                      max_pool2d_output_size(w, kw, stride_w, pad_w) * c;
  std::vector<float> dyf(static_cast<size_t>(out)), dxf(size_t(n) * h * w * c);
  bf16_to_f32_cpu(dy, dyf.data(), out);
  max_pool2d_backward_cpu<float>(dyf.data(), indices, dxf.data(), n, h, w, c, kh, kw, stride_h,
                                 stride_w, pad_h, pad_w);
  f32_to_bf16_cpu(dxf.data(), dx, int64_t(dxf.size()));
}

}  // namespace cudp::kernels
