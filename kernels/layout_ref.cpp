// CPU references of layout.h: each conversion written with its own index formula (not through the
// batched-transpose view the CUDA side uses), and bf16 rounding and TF32 truncation on the bits.
#include <cstring>

#include "engine/core/error.h"
#include "kernels/elementwise.h"
#include "kernels/layout.h"

namespace cudp::kernels {

namespace detail {

void check_transpose_args(const char* op, const void* src, const void* dst, size_t element_bytes,
                          int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
  CUDP_CHECK(d0 >= 0 && d1 >= 0 && d2 >= 0 && d3 >= 0, op, ": sizes must be >= 0, got ", d0, " x ",
             d1, " x ", d2, " x ", d3);
  const int64_t total = d0 * d1 * d2 * d3;
  check_elementwise(op, total, {src, dst});
  const auto s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  const auto bytes = static_cast<uintptr_t>(total) * element_bytes;
  CUDP_CHECK(total == 0 || s + bytes <= d || d + bytes <= s, op,
             ": source and destination overlap");
}

uint16_t f32_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return 0x7FFF;  // NaN
  }
  // Add just under half of the dropped part's unit, plus one when the kept part is odd: exact
  // halves then round to the even neighbour, everything else to the nearest. A carry into the
  // exponent is the right answer (up to inf for the largest finite values).
  const uint32_t odd = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + odd) >> 16);
}

uint32_t f32_to_tf32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return (u & 0xFFFFE000u) | 0x00400000u;  // NaN: sign and high payload kept, quiet
  }
  return u & 0xFFFFE000u;  // 1 sign + 8 exponent + 10 mantissa bits
}

}  // namespace detail

namespace {

template <typename T>
void nchw_to_nhwc_ref(const T* src, T* dst, int64_t n, int64_t c, int64_t h, int64_t w) {
  detail::check_transpose_args("nchw_to_nhwc_cpu", src, dst, n, c, h, w);
  for (int64_t in = 0; in < n; ++in) {
    for (int64_t ic = 0; ic < c; ++ic) {
      for (int64_t ih = 0; ih < h; ++ih) {
        for (int64_t iw = 0; iw < w; ++iw) {
          dst[((in * h + ih) * w + iw) * c + ic] = src[((in * c + ic) * h + ih) * w + iw];
        }
      }
    }
  }
}

template <typename T>
void nhwc_to_nchw_ref(const T* src, T* dst, int64_t n, int64_t c, int64_t h, int64_t w) {
  detail::check_transpose_args("nhwc_to_nchw_cpu", src, dst, n, c, h, w);
  for (int64_t in = 0; in < n; ++in) {
    for (int64_t ic = 0; ic < c; ++ic) {
      for (int64_t ih = 0; ih < h; ++ih) {
        for (int64_t iw = 0; iw < w; ++iw) {
          dst[((in * c + ic) * h + ih) * w + iw] = src[((in * h + ih) * w + iw) * c + ic];
        }
      }
    }
  }
}

}  // namespace

void nchw_to_nhwc_cpu(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w) {
  nchw_to_nhwc_ref(src, dst, n, c, h, w);
}
void nchw_to_nhwc_cpu(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                      int64_t w) {
  nchw_to_nhwc_ref(src, dst, n, c, h, w);
}
void nhwc_to_nchw_cpu(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w) {
  nhwc_to_nchw_ref(src, dst, n, c, h, w);
}
void nhwc_to_nchw_cpu(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                      int64_t w) {
  nhwc_to_nchw_ref(src, dst, n, c, h, w);
}

void oihw_to_krsc_cpu(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s) {
  detail::check_transpose_args("oihw_to_krsc_cpu", src, dst, k, c, r, s);
  for (int64_t ik = 0; ik < k; ++ik) {
    for (int64_t ic = 0; ic < c; ++ic) {
      for (int64_t ir = 0; ir < r; ++ir) {
        for (int64_t is = 0; is < s; ++is) {
          dst[((ik * r + ir) * s + is) * c + ic] = src[((ik * c + ic) * r + ir) * s + is];
        }
      }
    }
  }
}

void krsc_to_oihw_cpu(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s) {
  detail::check_transpose_args("krsc_to_oihw_cpu", src, dst, k, c, r, s);
  for (int64_t ik = 0; ik < k; ++ik) {
    for (int64_t ic = 0; ic < c; ++ic) {
      for (int64_t ir = 0; ir < r; ++ir) {
        for (int64_t is = 0; is < s; ++is) {
          dst[((ik * c + ic) * r + ir) * s + is] = src[((ik * r + ir) * s + is) * c + ic];
        }
      }
    }
  }
}

void f32_to_bf16_cpu(const float* src, __nv_bfloat16* dst, int64_t n) {
  detail::check_elementwise("f32_to_bf16_cpu", n, {src, dst});
  for (int64_t i = 0; i < n; ++i) {
    __nv_bfloat16_raw raw;
    raw.x = detail::f32_to_bf16_bits(src[i]);
    dst[i] = raw;
  }
}

void bf16_to_f32_cpu(const __nv_bfloat16* src, float* dst, int64_t n) {
  detail::check_elementwise("bf16_to_f32_cpu", n, {src, dst});
  for (int64_t i = 0; i < n; ++i) {
    const __nv_bfloat16_raw raw = src[i];
    const uint32_t u = static_cast<uint32_t>(raw.x) << 16;
    std::memcpy(&dst[i], &u, sizeof u);
  }
}

void f32_to_tf32_cpu(const float* src, float* dst, int64_t n) {
  detail::check_elementwise("f32_to_tf32_cpu", n, {src, dst});
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = detail::f32_to_tf32_bits(src[i]);
    std::memcpy(&dst[i], &u, sizeof u);
  }
}

}  // namespace cudp::kernels
