// Pooling kernels. One thread per output vector (forward) or per input vector (backward, a gather),
// V = 4 consecutive channels per thread when C % 4 == 0 and the pointers are aligned to 4 elements
// (16 bytes of floats or indices, 8 of bf16, 4 of codes), else 1. Flat indices are 32-bit when the
// element count allows (cheaper division), 64-bit otherwise. Conventions and the reasons for them:
// kernels/pool.h.
#include <climits>

#include <cuda_bf16.h>

#include "engine/core/launch.cuh"
#include "kernels/bias.h"
#include "kernels/common.h"
#include "kernels/pool.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride loops beyond this

struct Geometry {
  int h, w, c;       // input plane and channels
  int out_h, out_w;  // output plane
  int kh, kw, sh, sw, ph, pw;
};

template <int V>
__device__ __forceinline__ void load(const float* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    v[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void load(const int32_t* p, int32_t (&v)[V]) {
  if constexpr (V == 4) {
    const int4 t = *reinterpret_cast<const int4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    v[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void store(float* p, const float (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    *p = v[0];
  }
}

// bf16: 4 elements are 8 bytes; the values go through float, which holds every bf16 exactly.
template <int V>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&t);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  } else {
    v[0] = __bfloat162float(*p);
  }
}

template <int V>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float (&v)[V]) {
  if constexpr (V == 4) {
    uint2 t;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&t);
    h[0] = __floats2bfloat162_rn(v[0], v[1]);
    h[1] = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = t;
  } else {
    *p = __float2bfloat16_rn(v[0]);
  }
}

template <int V>
__device__ __forceinline__ void store(int32_t* p, const int32_t (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<int4*>(p) = make_int4(v[0], v[1], v[2], v[3]);
  } else {
    *p = v[0];
  }
}

// The 2x2 windows' codes (kernels/pool.h): one byte per output, 4 bytes a vector.
template <int V>
__device__ __forceinline__ void load(const uint8_t* p, int (&v)[V]) {
  if constexpr (V == 4) {
    const uchar4 t = *reinterpret_cast<const uchar4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    v[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void store(uint8_t* p, const int (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<uchar4*>(p) =
        make_uchar4(uint8_t(v[0]), uint8_t(v[1]), uint8_t(v[2]), uint8_t(v[3]));
  } else {
    *p = uint8_t(v[0]);
  }
}

// Splits a flat NHWC index over [batch, rows, cols, vectors] (vectors fastest).
template <typename I>
__device__ __forceinline__ void split(I i, int vectors, int cols, int rows, int64_t& b, int& row,
                                      int& col, int& vec) {
  vec = int(i % I(vectors));
  i /= I(vectors);
  col = int(i % I(cols));
  i /= I(cols);
  row = int(i % I(rows));
  b = int64_t(i / I(rows));
}

template <typename I>
__device__ __forceinline__ I first_index() {
  return I(blockIdx.x) * blockDim.x + threadIdx.x;
}
template <typename I>
__device__ __forceinline__ I grid_stride() {
  return I(gridDim.x) * blockDim.x;
}

// `v > best || isnan(v)`: the first maximum wins ties, a NaN always wins (PyTorch's test).
__device__ __forceinline__ bool takes(float v, float best) {
  return v > best || isnan(v);
}

template <typename T, int V, typename I>
__global__ void max_pool_forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                                        int32_t* __restrict__ indices, Geometry g, I total) {
  kernel_entry();
  const int vectors = g.c / V;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int oh, ow, cv;
    split(i, vectors, g.out_w, g.out_h, b, oh, ow, cv);
    int h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
    const int h1 = min(h0 + g.kh, g.h), w1 = min(w0 + g.kw, g.w);
    h0 = max(h0, 0);
    w0 = max(w0, 0);
    const T* plane = x + b * g.h * g.w * g.c + cv * V;
    float best[V];
    int32_t arg[V];
    for (int k = 0; k < V; ++k) best[k] = -INFINITY, arg[k] = h0 * g.w + w0;
    for (int ih = h0; ih < h1; ++ih) {
      for (int iw = w0; iw < w1; ++iw) {
        float v[V];
        load<V>(plane + (int64_t(ih) * g.w + iw) * g.c, v);
        for (int k = 0; k < V; ++k) {
          if (takes(v[k], best[k])) best[k] = v[k], arg[k] = ih * g.w + iw;
        }
      }
    }
    store<V>(y + int64_t(i) * V, best);
    store<V>(indices + int64_t(i) * V, arg);
  }
}

// 2x2 windows, stride 2, no padding: four loads, no bounds tests (every window lies inside). It
// writes the int32 indices or the windows' codes (kernels/pool.h), whichever is not null.
template <typename T, int V, typename I>
__global__ void max_pool_2x2_forward_kernel(const T* __restrict__ x, T* __restrict__ y,
                                            int32_t* __restrict__ indices,
                                            uint8_t* __restrict__ codes, Geometry g, I total) {
  kernel_entry();
  const int vectors = g.c / V;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int oh, ow, cv;
    split(i, vectors, g.out_w, g.out_h, b, oh, ow, cv);
    const int ih = 2 * oh, iw = 2 * ow;
    const T* p = x + ((b * g.h + ih) * g.w + iw) * g.c + cv * V;
    const int64_t row = int64_t(g.w) * g.c;
    float v00[V], v01[V], v10[V], v11[V];
    load<V>(p, v00);
    load<V>(p + g.c, v01);
    load<V>(p + row, v10);
    load<V>(p + row + g.c, v11);
    float best[V];
    int at[V];  // 0..3: the maximum's place in window order
    for (int k = 0; k < V; ++k) {
      best[k] = v00[k], at[k] = 0;  // what `takes` gives against -inf, NaN or not
      if (takes(v01[k], best[k])) best[k] = v01[k], at[k] = 1;
      if (takes(v10[k], best[k])) best[k] = v10[k], at[k] = 2;
      if (takes(v11[k], best[k])) best[k] = v11[k], at[k] = 3;
    }
    store<V>(y + int64_t(i) * V, best);
    if (indices != nullptr) {
      int32_t arg[V];
      for (int k = 0; k < V; ++k) arg[k] = (ih + at[k] / 2) * g.w + iw + at[k] % 2;
      store<V>(indices + int64_t(i) * V, arg);
    }
    if (codes != nullptr) {
      for (int k = 0; k < V; ++k) at[k] |= best[k] <= 0.f ? 4 : 0;
      store<V>(codes + int64_t(i) * V, at);
    }
  }
}

// One thread per input vector: sums dy over the windows that contain it and took it as their max.
template <typename T, int V, typename I>
__global__ void max_pool_backward_kernel(const T* __restrict__ dy,
                                         const int32_t* __restrict__ indices, T* __restrict__ dx,
                                         Geometry g, I total) {
  kernel_entry();
  const int vectors = g.c / V;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int ih, iw, cv;
    split(i, vectors, g.w, g.h, b, ih, iw, cv);
    // Window oh covers rows [oh*sh - ph, oh*sh - ph + kh): those containing ih are
    // ceil((ih + ph - kh + 1) / sh) <= oh <= (ih + ph) / sh.
    const int oh0 = ih + g.ph < g.kh ? 0 : (ih + g.ph - g.kh) / g.sh + 1;
    const int ow0 = iw + g.pw < g.kw ? 0 : (iw + g.pw - g.kw) / g.sw + 1;
    const int oh1 = min((ih + g.ph) / g.sh + 1, g.out_h);
    const int ow1 = min((iw + g.pw) / g.sw + 1, g.out_w);
    const int32_t self = ih * g.w + iw;
    float acc[V];
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    for (int oh = oh0; oh < oh1; ++oh) {
      for (int ow = ow0; ow < ow1; ++ow) {
        const int64_t o = ((b * g.out_h + oh) * g.out_w + ow) * g.c + cv * V;
        float d[V];
        int32_t at[V];
        load<V>(dy + o, d);
        load<V>(indices + o, at);
        for (int k = 0; k < V; ++k) {
          if (at[k] == self) acc[k] += d[k];
        }
      }
    }
    store<V>(dx + int64_t(i) * V, acc);
  }
}

// 2x2 stride 2, no padding: windows do not overlap, so one thread per window (ceil(H/2) x ceil(W/2)
// of them, the partial ones at an odd edge have no output) reads dy and the index once and writes
// its up-to-four dx elements.
template <typename T, int V, typename I>
__global__ void max_pool_2x2_backward_kernel(const T* __restrict__ dy,
                                             const int32_t* __restrict__ indices,
                                             T* __restrict__ dx, Geometry g, I total) {
  kernel_entry();
  const int vectors = g.c / V;
  const int windows_h = (g.h + 1) / 2, windows_w = (g.w + 1) / 2;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int wh, ww, cv;
    split(i, vectors, windows_w, windows_h, b, wh, ww, cv);
    float d[V];
    int32_t at[V];
    for (int k = 0; k < V; ++k) d[k] = 0.f, at[k] = -1;
    if (wh < g.out_h && ww < g.out_w) {
      const int64_t o = ((b * g.out_h + wh) * g.out_w + ww) * g.c + cv * V;
      load<V>(dy + o, d);
      load<V>(indices + o, at);
    }
    for (int dh = 0; dh < 2; ++dh) {
      const int ih = 2 * wh + dh;
      if (ih >= g.h) break;
      for (int dw = 0; dw < 2; ++dw) {
        const int iw = 2 * ww + dw;
        if (iw >= g.w) break;
        float out[V];
        for (int k = 0; k < V; ++k) out[k] = at[k] == ih * g.w + iw ? d[k] : 0.f;
        store<V>(dx + ((b * g.h + ih) * g.w + iw) * g.c + cv * V, out);
      }
    }
  }
}

// 2x2 stride 2, no padding, from the windows' codes: dy goes to the element a window's code names
// and the window's other elements get 0. One thread per window, as above. With `relu_mask` (the
// pool's input is a fused ReLU's output) dy goes there only where the code's bit 2 is clear: the
// ReLU's backward (relu_grad's select) applied to dx in the same pass.
//
// kSums: the thread also adds up the values it stores, per channel (its channels are the same
// vector at every step: the launch's threads are a multiple of the vectors per pixel), and the
// block writes one row of `partial` (C floats): the thread sums added in thread order. Those rows,
// added in block order (bias_grad_from_partials), are the column sums of dx: the bias gradient of
// the layer whose output x is, with no pass over dx of its own. Deterministic: the rows depend on
// the shape and the data alone.
template <typename T, int V, typename I, bool kSums>
__global__ void max_pool_2x2_backward_codes_kernel(const T* __restrict__ dy,
                                                   const uint8_t* __restrict__ codes,
                                                   T* __restrict__ dx, Geometry g, I total,
                                                   bool relu_mask, float* __restrict__ partial) {
  kernel_entry();
  const int vectors = g.c / V;
  [[maybe_unused]] float sums[V] = {};
  const int windows_h = (g.h + 1) / 2, windows_w = (g.w + 1) / 2;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int wh, ww, cv;
    split(i, vectors, windows_w, windows_h, b, wh, ww, cv);
    float d[V];
    int at[V];  // 0..3: which of the window's elements took the max; -1: no window (odd edge)
    for (int k = 0; k < V; ++k) d[k] = 0.f, at[k] = -1;
    if (wh < g.out_h && ww < g.out_w) {
      const int64_t o = ((b * g.out_h + wh) * g.out_w + ww) * g.c + cv * V;
      int code[V];
      load<V>(dy + o, d);
      load<V>(codes + o, code);
      for (int k = 0; k < V; ++k) {
        at[k] = code[k] & 3;
        if (relu_mask && (code[k] & 4) != 0) d[k] = 0.f;
        if constexpr (kSums) sums[k] += d[k];
      }
    }
    for (int dh = 0; dh < 2; ++dh) {
      const int ih = 2 * wh + dh;
      if (ih >= g.h) break;
      for (int dw = 0; dw < 2; ++dw) {
        const int iw = 2 * ww + dw;
        if (iw >= g.w) break;
        float out[V];
        for (int k = 0; k < V; ++k) out[k] = at[k] == 2 * dh + dw ? d[k] : 0.f;
        store<V>(dx + ((b * g.h + ih) * g.w + iw) * g.c + cv * V, out);
      }
    }
  }
  if constexpr (kSums) {
    __shared__ float block[kThreads][V];
    for (int k = 0; k < V; ++k) block[threadIdx.x][k] = sums[k];
    __syncthreads();
    if (int(threadIdx.x) < vectors) {
      float total_v[V] = {};
      for (int t = threadIdx.x; t < kThreads; t += vectors) {
        for (int k = 0; k < V; ++k) total_v[k] += block[t][k];
      }
      for (int k = 0; k < V; ++k) {
        partial[int64_t(blockIdx.x) * g.c + threadIdx.x * V + k] = total_v[k];
      }
    }
  }
}

// PyTorch's adaptive windows: [floor(i*in/out), ceil((i+1)*in/out)).
__device__ __forceinline__ int window_start(int i, int in, int out) {
  return int(int64_t(i) * in / out);
}
__device__ __forceinline__ int window_end(int i, int in, int out) {
  return int((int64_t(i + 1) * in + out - 1) / out);
}

template <int V, typename I>
__global__ void adaptive_avg_forward_kernel(const float* __restrict__ x, float* __restrict__ y,
                                            Geometry g, I total) {
  kernel_entry();
  const int vectors = g.c / V;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int oh, ow, cv;
    split(i, vectors, g.out_w, g.out_h, b, oh, ow, cv);
    const int h0 = window_start(oh, g.h, g.out_h), h1 = window_end(oh, g.h, g.out_h);
    const int w0 = window_start(ow, g.w, g.out_w), w1 = window_end(ow, g.w, g.out_w);
    const float* plane = x + b * g.h * g.w * g.c + cv * V;
    float sum[V];
    for (int k = 0; k < V; ++k) sum[k] = 0.f;
    for (int ih = h0; ih < h1; ++ih) {
      for (int iw = w0; iw < w1; ++iw) {
        float v[V];
        load<V>(plane + (int64_t(ih) * g.w + iw) * g.c, v);
        for (int k = 0; k < V; ++k) sum[k] += v[k];
      }
    }
    const float area = float((h1 - h0) * (w1 - w0));
    for (int k = 0; k < V; ++k) sum[k] /= area;
    store<V>(y + int64_t(i) * V, sum);
  }
}

// One thread per input vector. The windows containing row ih are exactly
// [floor(ih*out_h/H), ceil((ih+1)*out_h/H)) (the same formula with in and out swapped).
template <int V, typename I>
__global__ void adaptive_avg_backward_kernel(const float* __restrict__ dy, float* __restrict__ dx,
                                             Geometry g, I total) {
  kernel_entry();
  const int vectors = g.c / V;
  for (I i = first_index<I>(); i < total; i += grid_stride<I>()) {
    int64_t b;
    int ih, iw, cv;
    split(i, vectors, g.w, g.h, b, ih, iw, cv);
    const int oh0 = window_start(ih, g.out_h, g.h), oh1 = window_end(ih, g.out_h, g.h);
    const int ow0 = window_start(iw, g.out_w, g.w), ow1 = window_end(iw, g.out_w, g.w);
    float acc[V];
    for (int k = 0; k < V; ++k) acc[k] = 0.f;
    for (int oh = oh0; oh < oh1; ++oh) {
      const int rows = window_end(oh, g.h, g.out_h) - window_start(oh, g.h, g.out_h);
      for (int ow = ow0; ow < ow1; ++ow) {
        const int cols = window_end(ow, g.w, g.out_w) - window_start(ow, g.w, g.out_w);
        const float area = float(rows * cols);
        float d[V];
        load<V>(dy + ((b * g.out_h + oh) * g.out_w + ow) * g.c + cv * V, d);
        for (int k = 0; k < V; ++k) acc[k] += d[k] / area;
      }
    }
    store<V>(dx + int64_t(i) * V, acc);
  }
}

bool aligned16(const void* p) {
  return detail::aligned(p, 16);
}

// A vector of four elements: 16 bytes of floats, 8 of bf16.
template <typename T>
constexpr uintptr_t kVecBytes = 4 * sizeof(T);

// Calls body.template operator()<V, I>(total) with V = 4 when `vec4`, else 1, and I the narrowest
// index type that holds `items` (counted in vectors of V).
template <typename Body>
void dispatch(bool vec4, int64_t elements, Body&& body) {
  const int64_t items = vec4 ? elements / 4 : elements;
  const bool narrow = items <= INT32_MAX;
  if (vec4 && narrow)
    body.template operator()<4, uint32_t>(uint32_t(items));
  else if (vec4)
    body.template operator()<4, int64_t>(items);
  else if (narrow)
    body.template operator()<1, uint32_t>(uint32_t(items));
  else
    body.template operator()<1, int64_t>(items);
}

unsigned blocks_for(int64_t items) {
  return unsigned(std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
}

Geometry max_geometry(int h, int w, int c, int kh, int kw, int sh, int sw, int ph, int pw) {
  return {h,
          w,
          c,
          max_pool2d_output_size(h, kh, sh, ph),
          max_pool2d_output_size(w, kw, sw, pw),
          kh,
          kw,
          sh,
          sw,
          ph,
          pw};
}

bool is_2x2_stride_2(const Geometry& g) {
  return g.kh == 2 && g.kw == 2 && g.sh == 2 && g.sw == 2 && g.ph == 0 && g.pw == 0;
}

}  // namespace

namespace {

template <typename T>
void max_pool2d_forward_impl(const T* x, T* y, int32_t* indices, uint8_t* codes, int n, int h,
                             int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                             int pad_w, cudaStream_t stream) {
  detail::check_max_pool2d(n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const Geometry g = max_geometry(h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const bool fast = is_2x2_stride_2(g);
  if (n == 0) return;  // an empty batch (whose tensors may have null data)
  CUDP_CHECK(indices != nullptr || codes != nullptr,
             "max_pool2d_forward: indices is null (2x2 windows of stride 2 may keep one byte per "
             "output instead: max_pool2d_2x2_forward)");
  const bool vec4 = c % 4 == 0 && detail::aligned<kVecBytes<T>>(x) &&
                    detail::aligned<kVecBytes<T>>(y) && aligned16(indices) &&
                    detail::aligned<4>(codes);
  dispatch(vec4, int64_t(n) * g.out_h * g.out_w * c, [&]<int V, typename I>(I items) {
    if (fast) {
      launch("max_pool_2x2_forward_kernel", max_pool_2x2_forward_kernel<T, V, I>, blocks_for(items),
             kThreads, 0, stream, x, y, indices, codes, g, items);
    } else {
      launch("max_pool_forward_kernel", max_pool_forward_kernel<T, V, I>, blocks_for(items),
             kThreads, 0, stream, x, y, indices, g, items);
    }
  });
}

template <typename T>
void max_pool2d_backward_impl(const T* dy, const int32_t* indices, T* dx, int n, int h, int w,
                              int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                              int pad_w, cudaStream_t stream) {
  detail::check_max_pool2d(n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const Geometry g = max_geometry(h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w);
  const bool vec4 = c % 4 == 0 && detail::aligned<kVecBytes<T>>(dy) && aligned16(indices) &&
                    detail::aligned<kVecBytes<T>>(dx);
  if (is_2x2_stride_2(g)) {
    const int64_t windows = int64_t(n) * ((h + 1) / 2) * ((w + 1) / 2) * c;
    dispatch(vec4, windows, [&]<int V, typename I>(I items) {
      launch("max_pool_2x2_backward_kernel", max_pool_2x2_backward_kernel<T, V, I>,
             blocks_for(items), kThreads, 0, stream, dy, indices, dx, g, items);
    });
  } else {
    dispatch(vec4, int64_t(n) * h * w * c, [&]<int V, typename I>(I items) {
      launch("max_pool_backward_kernel", max_pool_backward_kernel<T, V, I>, blocks_for(items),
             kThreads, 0, stream, dy, indices, dx, g, items);
    });
  }
}

// Blocks of the kSums launch: few enough that their partial rows cost little to add up (the
// threads loop over the windows), enough to fill an H100/H200 (8 blocks of 256 threads per SM).
constexpr int64_t kSumBlocks = 1024;

template <typename T>
void max_pool2d_2x2_backward_impl(const T* dy, const uint8_t* codes, T* dx, int n, int h, int w,
                                  int c, cudaStream_t stream, bool relu_mask, float* dbias) {
  detail::check_max_pool2d(n, h, w, c, 2, 2, 2, 2, 0, 0);
  const Geometry g = max_geometry(h, w, c, 2, 2, 2, 2, 0, 0);
  const bool vec4 = c % 4 == 0 && detail::aligned<kVecBytes<T>>(dy) && detail::aligned<4>(codes) &&
                    detail::aligned<kVecBytes<T>>(dx);
  const int64_t windows = int64_t(n) * ((h + 1) / 2) * ((w + 1) / 2) * c;
  CUDP_CHECK(codes != nullptr || windows == 0, "max_pool2d_2x2_backward: codes are null");
  // The column sums on the way need every thread on one channel vector throughout.
  const int vectors = vec4 ? c / 4 : c;
  const bool sums = dbias != nullptr && kThreads % vectors == 0 && windows > 0;
  dispatch(vec4, windows, [&]<int V, typename I>(I items) {
    if (!sums) {
      launch("max_pool_2x2_backward_codes_kernel",
             max_pool_2x2_backward_codes_kernel<T, V, I, false>, blocks_for(items), kThreads, 0,
             stream, dy, codes, dx, g, items, relu_mask, nullptr);
      return;
    }
    const unsigned blocks = unsigned(std::min<int64_t>(blocks_for(items), kSumBlocks));
    Workspace ws(size_t(blocks) * size_t(c) * sizeof(float), stream,
                 "max pooling's partial column sums of its input gradient");
    launch("max_pool_2x2_backward_codes_kernel", max_pool_2x2_backward_codes_kernel<T, V, I, true>,
           blocks, kThreads, 0, stream, dy, codes, dx, g, items, relu_mask, ws.get());
    bias_grad_from_partials(std::move(ws), dbias, blocks, c, 1.0f, stream);  // or queued
  });
  if (dbias != nullptr && !sums && windows > 0) {
    // Channel vectors that do not divide the block: a pass of its own, the same sums.
    bias_grad(dx, dbias, int64_t(n) * h * w, c, 1.0f, stream);
  }
}

}  // namespace

void max_pool2d_2x2_forward(const float* x, float* y, uint8_t* codes, int n, int h, int w, int c,
                            cudaStream_t stream) {
  max_pool2d_forward_impl(x, y, nullptr, codes, n, h, w, c, 2, 2, 2, 2, 0, 0, stream);
}

void max_pool2d_2x2_forward(const __nv_bfloat16* x, __nv_bfloat16* y, uint8_t* codes, int n, int h,
                            int w, int c, cudaStream_t stream) {
  max_pool2d_forward_impl(x, y, nullptr, codes, n, h, w, c, 2, 2, 2, 2, 0, 0, stream);
}

void max_pool2d_2x2_backward(const float* dy, const uint8_t* codes, float* dx, int n, int h, int w,
                             int c, cudaStream_t stream, bool relu_mask, float* dbias) {
  max_pool2d_2x2_backward_impl(dy, codes, dx, n, h, w, c, stream, relu_mask, dbias);
}

void max_pool2d_2x2_backward(const __nv_bfloat16* dy, const uint8_t* codes, __nv_bfloat16* dx,
                             int n, int h, int w, int c, cudaStream_t stream, bool relu_mask,
                             float* dbias) {
  max_pool2d_2x2_backward_impl(dy, codes, dx, n, h, w, c, stream, relu_mask, dbias);
}

void max_pool2d_forward(const float* x, float* y, int32_t* indices, int n, int h, int w, int c,
                        int kh, int kw, int stride_h, int stride_w, int pad_h, int pad_w,
                        cudaStream_t stream) {
  max_pool2d_forward_impl(x, y, indices, nullptr, n, h, w, c, kh, kw, stride_h, stride_w, pad_h,
                          pad_w, stream);
}

void max_pool2d_forward(const __nv_bfloat16* x, __nv_bfloat16* y, int32_t* indices, int n, int h,
                        int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                        int pad_w, cudaStream_t stream) {
  max_pool2d_forward_impl(x, y, indices, nullptr, n, h, w, c, kh, kw, stride_h, stride_w, pad_h,
                          pad_w, stream);
}

void max_pool2d_backward(const float* dy, const int32_t* indices, float* dx, int n, int h, int w,
                         int c, int kh, int kw, int stride_h, int stride_w, int pad_h, int pad_w,
                         cudaStream_t stream) {
  max_pool2d_backward_impl(dy, indices, dx, n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w,
                           stream);
}

void max_pool2d_backward(const __nv_bfloat16* dy, const int32_t* indices, __nv_bfloat16* dx, int n,
                         int h, int w, int c, int kh, int kw, int stride_h, int stride_w, int pad_h,
                         int pad_w, cudaStream_t stream) {
  max_pool2d_backward_impl(dy, indices, dx, n, h, w, c, kh, kw, stride_h, stride_w, pad_h, pad_w,
                           stream);
}

void adaptive_avg_pool2d_forward(const float* x, float* y, int n, int h, int w, int c, int out_h,
                                 int out_w, cudaStream_t stream) {
  detail::check_adaptive_avg_pool2d(n, h, w, c, out_h, out_w);
  const Geometry g{h, w, c, out_h, out_w, 0, 0, 0, 0, 0, 0};
  const bool vec4 = c % 4 == 0 && aligned16(x) && aligned16(y);
  dispatch(vec4, int64_t(n) * out_h * out_w * c, [&]<int V, typename I>(I items) {
    launch("adaptive_avg_forward_kernel", adaptive_avg_forward_kernel<V, I>, blocks_for(items),
           kThreads, 0, stream, x, y, g, items);
  });
}

void adaptive_avg_pool2d_backward(const float* dy, float* dx, int n, int h, int w, int c, int out_h,
                                  int out_w, cudaStream_t stream) {
  detail::check_adaptive_avg_pool2d(n, h, w, c, out_h, out_w);
  const Geometry g{h, w, c, out_h, out_w, 0, 0, 0, 0, 0, 0};
  const bool vec4 = c % 4 == 0 && aligned16(dy) && aligned16(dx);
  dispatch(vec4, int64_t(n) * h * w * c, [&]<int V, typename I>(I items) {
    launch("adaptive_avg_backward_kernel", adaptive_avg_backward_kernel<V, I>, blocks_for(items),
           kThreads, 0, stream, dy, dx, g, items);
  });
}

}  // namespace cudp::kernels
