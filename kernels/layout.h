// Layout and dtype conversions.
//
// Activations live in NHWC on the GPU and conv weights in KRSC, while checkpoints and PyTorch use
// NCHW and OIHW (docs/architecture.md §2.2). Each of the four conversions is a batch of 2-D
// transposes:
//   nchw_to_nhwc: n matrices [c][h*w] -> [h*w][c]
//   nhwc_to_nchw: n matrices [h*w][c] -> [c][h*w]
//   oihw_to_krsc: k matrices [c][r*s] -> [r*s][c]
//   krsc_to_oihw: k matrices [r*s][c] -> [c][r*s]
// done by one tiled kernel: a block loads a 32x32 tile with reads coalesced along the source's
// rows, puts it through shared memory (padded against bank conflicts) and stores it with writes
// coalesced along the destination's rows. Every conversion takes the tensor's logical sizes (n, c,
// h, w) or (k, c, r, s) in the same order in both directions. Source and destination must not
// overlap. Transposes of a dimension much smaller than 32 (c = 3 images, 3x3 kernels) leave most of
// a tile idle; they are correct and small, not tuned.
//
// fp32 <-> bf16: f32_to_bf16 rounds to nearest, ties to even; NaN stays NaN (the canonical bf16 NaN
// 0x7FFF, as CUDA's own conversions give), inf stays inf, and finite values that round past the
// largest bf16 become inf. bf16_to_f32 is exact. Both are vectorised (4 elements per access).
//
// fp32 -> TF32 (CPU only, the tf32 policy's CPU operands): fp32's sign, exponent and the top 10 of
// its 23 mantissa bits; the other 13 are cleared, i.e. truncation toward zero. That is what our
// kernels' operands go through: their TF32 wgmma is fed the fp32 bits as they are (no conversion
// instruction runs) and, by the usual description of the hardware, reads only the top 19 (the
// kernel tests' 2^-10 operand bound allows it). An explicit conversion (cvt.rna; cuBLAS and PyTorch
// when they convert) rounds to nearest instead, which our GPU path never does. Subnormals are
// truncated the same way, not flushed; inf stays inf; NaN stays NaN with its sign (quiet bit set,
// so that a payload only in the cleared bits does not become inf).
//
// All sizes 0 are no-ops; negative sizes or null pointers with data throw ValueError.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace cudp::kernels {

void nchw_to_nhwc(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w,
                  cudaStream_t stream);
void nchw_to_nhwc_cpu(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w);

void nhwc_to_nchw(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w,
                  cudaStream_t stream);
void nhwc_to_nchw_cpu(const float* src, float* dst, int64_t n, int64_t c, int64_t h, int64_t w);

// The same two activation transposes on bf16 elements (Flatten under the bf16 policy): the values
// are moved, not converted, so the result holds the source's bits.
void nchw_to_nhwc(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                  int64_t w, cudaStream_t stream);
void nchw_to_nhwc_cpu(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                      int64_t w);
void nhwc_to_nchw(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                  int64_t w, cudaStream_t stream);
void nhwc_to_nchw_cpu(const __nv_bfloat16* src, __nv_bfloat16* dst, int64_t n, int64_t c, int64_t h,
                      int64_t w);

void oihw_to_krsc(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s,
                  cudaStream_t stream);
void oihw_to_krsc_cpu(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s);

void krsc_to_oihw(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s,
                  cudaStream_t stream);
void krsc_to_oihw_cpu(const float* src, float* dst, int64_t k, int64_t c, int64_t r, int64_t s);

void f32_to_bf16(const float* src, __nv_bfloat16* dst, int64_t n, cudaStream_t stream);
void f32_to_bf16_cpu(const float* src, __nv_bfloat16* dst, int64_t n);

void bf16_to_f32(const __nv_bfloat16* src, float* dst, int64_t n, cudaStream_t stream);
void bf16_to_f32_cpu(const __nv_bfloat16* src, float* dst, int64_t n);

// dst[i] = src[i] truncated to TF32 (above); src == dst is allowed.
void f32_to_tf32_cpu(const float* src, float* dst, int64_t n);

namespace detail {

// The bf16 bit pattern of x rounded to nearest even (the CPU reference's arithmetic, written out on
// the bits so that it does not depend on the compiler's or CUDA's conversions).
uint16_t f32_to_bf16_bits(float x);

// The fp32 bit pattern of x truncated to TF32 (f32_to_tf32_cpu's arithmetic).
uint32_t f32_to_tf32_bits(float x);

// Checks of the four transposes: sizes >= 0, pointers non-null when there is data, no overlap.
void check_transpose_args(const char* op, const void* src, const void* dst, size_t element_bytes,
                          int64_t d0, int64_t d1, int64_t d2, int64_t d3);
template <typename T>
void check_transpose_args(const char* op, const T* src, const T* dst, int64_t d0, int64_t d1,
                          int64_t d2, int64_t d3) {
  check_transpose_args(op, static_cast<const void*>(src), static_cast<const void*>(dst), sizeof(T),
                       d0, d1, d2, d3);
}

}  // namespace detail
}  // namespace cudp::kernels
