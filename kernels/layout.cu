// The batched tiled transpose behind the four layout conversions, and the bf16 conversions.
//
// Transpose: src is `batch` row-major [rows][cols] matrices, dst the `batch` [cols][rows] matrices.
// A block of 32x8 threads moves a 32x32 tile: each thread reads 4 elements of the tile's source
// rows (a warp reads 32 consecutive floats of one row), the tile goes through shared memory with
// one column of padding (so that reading it transposed hits 32 different banks), and each thread
// writes 4 elements of the destination's rows (again 32 consecutive floats per warp). The grid is
// (column tiles, row tiles, batch), each dimension a grid-stride loop so that any size fits the
// grid's limits without divisions in the kernel.
//
// bf16: 4 elements per access (a float4 against 8 bytes of bf16) on the body that
// detail::vector_split() finds, scalars on the head and tail; the rounding is the hardware's
// cvt.rn.bf16x2.f32 (round to nearest even), checked bit for bit against the CPU reference's
// arithmetic by the GPU tests; widening is a shift of the bits.
#include <algorithm>
#include <cstring>

#include "engine/core/launch.cuh"
#include "kernels/elementwise.h"
#include "kernels/layout.h"

namespace cudp::kernels {
namespace {

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads per tile column; each moves kTile / kTileRows elements
constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;

// T: float, or __nv_bfloat16 (Flatten's bf16 activations: the elements are moved, not converted).
template <typename T>
__global__ void __launch_bounds__(kTile* kTileRows, 8)
    transpose_kernel(const T* src, T* dst, int64_t batch, int64_t rows, int64_t cols) {
  kernel_entry();
  __shared__ T tile[kTile][kTile + 1];
  const int64_t tiles_r = (rows + kTile - 1) / kTile;
  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t matrix = rows * cols;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const T* s = src + b * matrix;
    T* d = dst + b * matrix;
    for (int64_t tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
      for (int64_t tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
        const int64_t r0 = tr * kTile, c0 = tc * kTile;
        // Read: source column c0 + tx of rows r0 + ty, r0 + ty + 8, ...
        const int64_t c = c0 + tx;
        const T* from = s + (r0 + ty) * cols + c;
#pragma unroll
        for (int j = 0; j < kTile; j += kTileRows) {
          if (c < cols && r0 + ty + j < rows) {
            tile[ty + j][tx] = from[j * cols];
          }
        }
        __syncthreads();
        // Write: destination row c0 + ty + j (a source column), column r0 + tx (a source row).
        const int64_t r = r0 + tx;
        T* to = d + (c0 + ty) * rows + r;
#pragma unroll
        for (int j = 0; j < kTile; j += kTileRows) {
          if (r < rows && c0 + ty + j < cols) {
            to[j * rows] = tile[tx][ty + j];
          }
        }
        __syncthreads();  // the tile is rewritten by the next iteration
      }
    }
  }
}

template <typename T>
void transpose(const char* op, const T* src, T* dst, int64_t batch, int64_t rows, int64_t cols,
               cudaStream_t stream) {
  if (batch == 0 || rows == 0 || cols == 0) {
    return;
  }
  const int64_t tiles_r = (rows + kTile - 1) / kTile;
  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles_c, int64_t(1) << 30)),
                  static_cast<unsigned>(std::min<int64_t>(tiles_r, 65535)),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  launch(op, transpose_kernel<T>, grid, dim3(kTile, kTileRows), 0, stream, src, dst, batch, rows,
         cols);
}

__device__ __forceinline__ uint32_t pack(__nv_bfloat162 v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  return bits;
}

// Widening is exact: the bf16 bits become the high half of the float (NaN payloads included; the
// cvt.f32.bf16 instruction that __bfloat162float uses on sm_90 is not relied on for NaNs).
__device__ __forceinline__ float widen(uint32_t bf16_bits) {
  return __uint_as_float(bf16_bits << 16);
}

__global__ void f32_to_bf16_kernel(const float* src, __nv_bfloat16* dst, int64_t n, int64_t head,
                                   int64_t vectors) {
  kernel_entry();
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const auto* s4 = reinterpret_cast<const float4*>(src + head);
  auto* d4 = reinterpret_cast<uint2*>(dst + head);
  for (int64_t v = start; v < vectors; v += stride) {
    const float4 a = s4[v];
    d4[v] =
        make_uint2(pack(__floats2bfloat162_rn(a.x, a.y)), pack(__floats2bfloat162_rn(a.z, a.w)));
  }
  for (int64_t i = start; i < head; i += stride) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
  for (int64_t i = head + 4 * vectors + start; i < n; i += stride) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void bf16_to_f32_kernel(const __nv_bfloat16* src, float* dst, int64_t n, int64_t head,
                                   int64_t vectors) {
  kernel_entry();
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const auto* s4 = reinterpret_cast<const uint2*>(src + head);
  auto* d4 = reinterpret_cast<float4*>(dst + head);
  const auto* s1 = reinterpret_cast<const uint16_t*>(src);
  for (int64_t v = start; v < vectors; v += stride) {
    const uint2 a = s4[v];  // elements 0, 1 in a.x (low half first), 2, 3 in a.y
    d4[v] =
        make_float4(widen(a.x & 0xFFFFu), widen(a.x >> 16), widen(a.y & 0xFFFFu), widen(a.y >> 16));
  }
  for (int64_t i = start; i < head; i += stride) {
    dst[i] = widen(s1[i]);
  }
  for (int64_t i = head + 4 * vectors + start; i < n; i += stride) {
    dst[i] = widen(s1[i]);
  }
}

unsigned blocks_for(int64_t n, const detail::VectorSplit& split) {
  const int64_t work = std::max(split.vectors, n - 4 * split.vectors);
  return std::min(grid_for(work, kThreads), kMaxBlocks);
}

}  // namespace

void nchw_to_nhwc(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w,
                  cudaStream_t stream) {
  detail::check_transpose_args("nchw_to_nhwc", src, dst, n, c, h, w);
  transpose("nchw_to_nhwc", src, dst, n, c, h * w, stream);
}

void nhwc_to_nchw(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w,
                  cudaStream_t stream) {
  detail::check_transpose_args("nhwc_to_nchw", src, dst, n, c, h, w);
  transpose("nhwc_to_nchw", src, dst, n, h * w, c, stream);
}

void nchw_to_nhwc(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                  int64_t w, cudaStream_t stream) {
  detail::check_transpose_args("nchw_to_nhwc", src, dst, n, c, h, w);
  transpose("nchw_to_nhwc", src, dst, n, c, h * w, stream);
}

void nhwc_to_nchw(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                  int64_t w, cudaStream_t stream) {
  detail::check_transpose_args("nhwc_to_nchw", src, dst, n, c, h, w);
  transpose("nhwc_to_nchw", src, dst, n, h * w, c, stream);
}

void oihw_to_krsc(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s,
                  cudaStream_t stream) {
  detail::check_transpose_args("oihw_to_krsc", src, dst, k, c, r, s);
  transpose("oihw_to_krsc", src, dst, k, c, r * s, stream);
}

void krsc_to_oihw(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s,
                  cudaStream_t stream) {
  detail::check_transpose_args("krsc_to_oihw", src, dst, k, c, r, s);
  transpose("krsc_to_oihw", src, dst, k, r * s, c, stream);
}

void f32_to_bf16(const float* src, __nv_bfloat16* dst, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("f32_to_bf16", n, {src, dst});
  if (n == 0) {
    return;
  }
  const detail::VectorSplit split = detail::vector_split(n, {{src, 4}, {dst, 2}});
  launch("f32_to_bf16", f32_to_bf16_kernel, blocks_for(n, split), kThreads, 0, stream, src, dst, n,
         split.head, split.vectors);
}

void bf16_to_f32(const __nv_bfloat16* src, float* dst, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("bf16_to_f32", n, {src, dst});
  if (n == 0) {
    return;
  }
  const detail::VectorSplit split = detail::vector_split(n, {{src, 2}, {dst, 4}});
  launch("bf16_to_f32", bf16_to_f32_kernel, blocks_for(n, split), kThreads, 0, stream, src, dst, n,
         split.head, split.vectors);
}

}  // namespace cudp::kernels
