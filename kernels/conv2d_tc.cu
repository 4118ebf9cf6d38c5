// Convolutions on tensor cores (kernels/conv2d.h, Math::TF32 / Math::BF16): the implicit GEMM runs
// on the sm_90a matmul mainloop (kernels/sm90/), with A = im2col(x) gathered by the producer
// warpgroup and B = the KRSC filters read as a K x RSC matrix by TMA. This file prepares operands:
//   - channel padding: the gather moves 16-byte chunks of one pixel, so C must be a multiple of 8
//     (bf16) or 4 (fp32); VGG's first layer (3 channels) is padded with zeros to 8 or 4, which adds
//     products of zero and changes no sum;
//   - bf16 conversion of fp32 tensors (the float launchers with Math::BF16);
//   - the 180-degree rotation of the filters for backward-data: with stride 1,
//       dx = conv(dy, w'),  w'[c][r][s][k] = w[k][R-1-r][S-1-s][c],  padding R-1-pad,
//     so backward-data is the forward kernel. The rotated copy costs one pass over the weights
//     (14.7 M values for VGG-16: tens of microseconds), far below the convolution.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/core/launch.cuh"
#include "kernels/bias.h"
#include "kernels/conv2d.h"
#include "kernels/conv2d_narrow.h"
#include "kernels/elementwise.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"
#include "kernels/sm90/matmul_sm90.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (sizeof(T) == 2) {
    return __bfloat162float(v);
  } else {
    return v;
  }
}
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (sizeof(T) == 2) {
    return __float2bfloat16_rn(v);
  } else {
    return v;
  }
}

// dst[i][j] = j < c ? src[i][j] : 0 for `rows` rows of c (src) and cp (dst) elements.
template <typename In, typename Out>
__global__ void pad_channels_kernel(const In* __restrict__ src, int64_t rows, int c, int cp,
                                    Out* __restrict__ dst) {
  kernel_entry();
  const int64_t total = rows * cp;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / cp;
    const int j = static_cast<int>(i - row * cp);
    dst[i] = from_float<Out>(j < c ? to_float(src[row * c + j]) : 0.f);
  }
}

// The same for bf16 output with cp % 8 == 0 into a 16-byte aligned dst: a thread per 16-byte chunk
// of 8 output channels, one whole store (VGG's first layer: 3 channels padded to 8, a chunk a
// pixel; the element kernel above divides and stores 2 bytes per element).
template <typename In>
__global__ void pad_channels_chunks_kernel(const In* __restrict__ src, int64_t rows, int c, int cp,
                                           uint4* __restrict__ dst) {
  kernel_entry();
  const int chunks = cp / 8;
  const int64_t total = rows * chunks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks;
    const int j0 = 8 * static_cast<int>(i - row * chunks);
    const In* from = src + row * c;
    uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + 2 * e;
      const float lo = j < c ? to_float(from[j]) : 0.f;
      const float hi = j + 1 < c ? to_float(from[j + 1]) : 0.f;
      const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
      packed[e] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    dst[i] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// w' (C x R x S x kp) from w (K x R x S x C): w'[c][r][s][k] = w[k][R-1-r][S-1-s][c], 0 for k >= K.
// Block (x, y, tap) moves the 32 x 32 tile of channels c0.. x filters k0.. of one tap through
// shared memory: read along w's c and written along w''s k, both coalesced (element by element at a
// stride of R*S*C, the reads ran at a fifth of the bandwidth: 12 launches, 0.15 ms of a TF32 224^2
// step).
template <typename In, typename Out>
__global__ void rotate_filters_kernel(const In* __restrict__ w, int k, int r, int s, int c, int kp,
                                      Out* __restrict__ out) {
  kernel_entry();
  __shared__ float tile[32][33];
  const int c0 = blockIdx.x * 32, k0 = blockIdx.y * 32;
  const int tap = blockIdx.z;  // of w'
  const int rr = tap / s, ss = tap - rr * s;
  const int64_t src_tap = int64_t(r - 1 - rr) * s + (s - 1 - ss);
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int kk = k0 + i, cc = c0 + threadIdx.x;
    tile[i][threadIdx.x] =
        kk < k && cc < c ? to_float(w[(int64_t(kk) * r * s + src_tap) * c + cc]) : 0.f;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int cc = c0 + i, kk = k0 + threadIdx.x;
    if (cc < c && kk < kp) {
      out[(int64_t(cc) * r * s + tap) * kp + kk] = from_float<Out>(tile[threadIdx.x][i]);
    }
  }
}

// dst (K x R x S x cp bf16) = w (K x R x S x C fp32) with the channels zero-padded, and, when
// `rotated` is not null, rotated (C x R x S x K bf16) = w'[c][r][s][k] = w[k][R-1-r][S-1-s][c]: the
// filters of backward-data, from the same read. Block (x, y, tap) converts the tile of filters
// k0.. x channels c0.. of one tap (r, s): rows of w and dst are read and written along c, and the
// tile goes through shared memory so that the rotated copy is written along k too (written element
// by element at a stride of K, it ran at an eighth of the bandwidth). kPair 2 (C and K even): each
// thread moves pairs (float2 in, bf16x2 out) of a 64 x 64 tile; kPair 1 (VGG's first layer, C = 3)
// single elements of a 32 x 32 tile.
constexpr int kFilterThreads = 32;

template <int kPair>
__global__ void filters_to_bf16_kernel(const float* __restrict__ w, int k, int r, int s, int c,
                                       int cp, __nv_bfloat16* __restrict__ dst,
                                       __nv_bfloat16* __restrict__ rotated) {
  kernel_entry();
  constexpr int kTile = kFilterThreads * kPair;
  __shared__ __nv_bfloat16 tile[kTile][kTile + 2];  // [filter][channel]
  const int c0 = blockIdx.x * kTile, k0 = blockIdx.y * kTile;
  const int tap = blockIdx.z;
  const int rr = tap / s, ss = tap - rr * s;
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int i = ty; i < kTile; i += blockDim.y) {
    const int kk = k0 + i, cc = c0 + kPair * tx;
    if (kk >= k || cc >= cp) continue;
    const int64_t row = (int64_t(kk) * r + rr) * s + ss;
    if constexpr (kPair == 2) {  // c even: a pair is wholly inside C or wholly padding
      const float2 v =
          cc < c ? *reinterpret_cast<const float2*>(w + row * c + cc) : make_float2(0.f, 0.f);
      const __nv_bfloat162 b = __floats2bfloat162_rn(v.x, v.y);
      *reinterpret_cast<__nv_bfloat162*>(dst + row * cp + cc) = b;
      tile[i][2 * tx] = b.x;
      tile[i][2 * tx + 1] = b.y;
    } else {
      const __nv_bfloat16 b = __float2bfloat16_rn(cc < c ? w[row * c + cc] : 0.f);
      dst[row * cp + cc] = b;
      tile[i][tx] = b;
    }
  }
  if (rotated == nullptr) return;  // uniform across the block
  __syncthreads();
  const int64_t rtap = int64_t(r - 1 - rr) * s + (s - 1 - ss);
  for (int i = ty; i < kTile; i += blockDim.y) {
    const int cc = c0 + i, kk = k0 + kPair * tx;
    if (cc >= c || kk >= k) continue;
    __nv_bfloat16* out = rotated + (int64_t(cc) * r * s + rtap) * k + kk;
    if constexpr (kPair == 2) {  // k even: kk + 1 < k
      *reinterpret_cast<__nv_bfloat162*>(out) =
          __halves2bfloat162(tile[2 * tx][i], tile[2 * tx + 1][i]);
    } else {
      *out = tile[tx][i];
    }
  }
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + 255) / 256, 1, 65536));
}

template <typename In>
void pad_channels(const In* src, int64_t rows, int c, int cp, void* dst, DType out,
                  cudaStream_t stream) {
  if constexpr (std::is_same_v<In, float>) {
    if (out == DType::BF16 && cp == c) {
      // Nothing to pad: the vectorised conversion (the general kernel below divides per element).
      f32_to_bf16(src, static_cast<__nv_bfloat16*>(dst), rows * c, stream);
      return;
    }
  }
  if (out == DType::BF16 && cp % 8 == 0 && aligned16(dst)) {
    launch("pad_channels_chunks_kernel", pad_channels_chunks_kernel<In>, blocks_for(rows * cp / 8),
           256, 0, stream, src, rows, c, cp, static_cast<uint4*>(dst));
  } else if (out == DType::BF16) {
    launch("pad_channels_kernel", pad_channels_kernel<In, __nv_bfloat16>, blocks_for(rows * cp),
           256, 0, stream, src, rows, c, cp, static_cast<__nv_bfloat16*>(dst));
  } else {
    launch("pad_channels_kernel", pad_channels_kernel<In, float>, blocks_for(rows * cp), 256, 0,
           stream, src, rows, c, cp, static_cast<float*>(dst));
  }
}

template <typename In>
void rotate_filters(const In* w, const Conv2dShape& s, int kp, void* dst, DType out,
                    cudaStream_t stream) {
  const int64_t taps = int64_t(s.r) * s.s;
  CUDP_CHECK(taps <= 65535 && (kp + 31) / 32 <= 65535,
             "conv (tensor cores): the filters' rotation takes at most 65535 taps and 2M filters, "
             "got ",
             taps, " taps and ", kp, " filters");
  const dim3 grid(static_cast<unsigned>((s.c + 31) / 32), static_cast<unsigned>((kp + 31) / 32),
                  static_cast<unsigned>(taps));
  const dim3 block(32, 8);
  if (out == DType::BF16) {
    launch("rotate_filters_kernel", rotate_filters_kernel<In, __nv_bfloat16>, grid, block, 0,
           stream, w, s.k, s.r, s.s, s.c, kp, static_cast<__nv_bfloat16*>(dst));
  } else {
    launch("rotate_filters_kernel", rotate_filters_kernel<In, float>, grid, block, 0, stream, w,
           s.k, s.r, s.s, s.c, kp, static_cast<float*>(dst));
  }
}


DType operand_type(Math math) { return math == Math::BF16 ? DType::BF16 : DType::F32; }
int chunk_elements(Math math) { return math == Math::BF16 ? 8 : 4; }

void check_tc(const char* name, const Conv2dShape& shape, Math math) {
  shape.validate();
  CUDP_CHECK(math != Math::FP32, name, ": Math::FP32 runs on the SIMT kernels");
  detail::require_tensor_cores(name, math);
}

std::atomic<detail::ConvFeed> g_feed{detail::ConvFeed::patch};
std::atomic<bool> g_wgrad_split_major{true};
// On by default, by measurement (bench/NOTES-tensor-cores.md): 64-channel layers with the filters
// as wgmma's A and 128 pixels as its N.
std::atomic<bool> g_swapped{true};
// Halo tiles for the swapped 3 x 3 layers over 64 channels (sm90::conv_halo_applies).
std::atomic<bool> g_halo{true};
// ... and for the wide layers (sm90::conv_halo_wide_applies: two rings), on the outputs that 8 x 16
// patches tile exactly and on 56 x 56 as 8 x 8 patches of image pairs: the faster, by measurement
// (bench/NOTES-tensor-cores.md).
std::atomic<detail::HaloWide> g_halo_wide{detail::HaloWide::pairs};
// The tests' tile width for the forward and backward-data products (0: the planner's).
std::atomic<int> g_tile_n{0};

// The planner's plan for `p`, or the tests' tile width and split count where they set one
// (tile_n 0: the planner's).
MatmulPlan planned_or_forced(const MatmulProblem& p, int device, int tile_n, int splits) {
  if (tile_n == 0) return plan_matmul(p, device);
  return make_matmul_plan(p, tile_n, splits, detail::multiprocessor_count(device));
}

// The plan of a forward or backward-data product: the planner's, or one of the tests' tile width
// without split-K.
MatmulPlan conv_plan(const MatmulProblem& p, int device) {
  return planned_or_forced(p, device, g_tile_n.load(), 1);
}

// `t` (run_forward's tiling for the product `p` under `plan`) as the halo tiling where the halo
// kernels take the product.
sm90::PatchTiles with_halo(const MatmulProblem& p, const MatmulPlan& plan,
                           const sm90::PatchTiles& t) {
  if (!g_halo.load() || p.math != Math::BF16) return t;
  const bool swapped = sm90::conv_halo_applies(p, plan, t);
  if (swapped) return sm90::halo_tiles(t);
  const detail::HaloWide mode = g_halo_wide.load();
  if (mode == detail::HaloWide::off || sm90::resident_filter_blocks(p, plan, t) != 0) return t;
  const sm90::HaloTiling tiling = sm90::conv_halo_wide_tiling(
      p, plan, t, mode == detail::HaloWide::pairs || mode == detail::HaloWide::covering,
      mode == detail::HaloWide::covering);
  if (tiling == sm90::HaloTiling::none) return t;
  return sm90::halo_tiles(t, tiling == sm90::HaloTiling::pairs);
}
// Off by default, by measurement (bench/NOTES-tensor-cores.md): the bias sums in the producer's
// spare warps slow the backward-weight down by more than the separate reduction costs.
std::atomic<bool> g_wgrad_bias_fusion{false};
std::atomic<detail::Tf32WgradFeed> g_tf32_wgrad_feed{detail::Tf32WgradFeed::automatic};
// detail::set_tf32_wgrad_plan: the TF32 boxes' tile width and split count (0: the planner's).
std::atomic<int> g_tf32_wgrad_tile_n{0}, g_tf32_wgrad_splits{0};

// The largest power of two that divides v, at most `cap`.
int pow2_divisor(int v, int cap) {
  int d = 1;
  while (d < cap && v % (2 * d) == 0) d *= 2;
  return d;
}

// Output pixels as patches of wb x hb x nb = `pixels` (a power of two): as wide as Q allows (a
// power of two that divides it), then as tall as P allows, then across images; for VGG's sizes (224
// .. 2) the patches tile the output exactly. The forward's tiles are 128-pixel patches (its rows),
// with C in blocks of the k-block; backward-weight's k-blocks are 64-pixel patches with C in blocks
// of 64 (bf16), or 32-pixel patches with C in blocks of 32 (TF32).
sm90::PatchTiles patch_tiles(const Conv2dShape& s, int pixels, int channel_block);

// The output pixels backward-weight's patches (of 64 pixels, or 32 in TF32) cover (the product's k,
// with the padding of patches that hang over the output's edges).
int64_t wgrad_patch_pixels(const sm90::PatchTiles& t) {
  return int64_t(t.tiles_q) * t.tiles_p * t.tiles_n * t.wb * t.hb * t.nb;
}

sm90::PatchTiles patch_tiles(const Conv2dShape& s, int pixels, int channel_block) {
  sm90::PatchTiles t;
  t.wb = pow2_divisor(s.q(), pixels);
  t.hb = pow2_divisor(s.p(), pixels / t.wb);
  t.nb = pixels / (t.wb * t.hb);
  t.q = s.q();
  t.p = s.p();
  t.n = s.n;
  t.tiles_q = (t.q + t.wb - 1) / t.wb;
  t.tiles_p = (t.p + t.hb - 1) / t.hb;
  t.tiles_n = (t.n + t.nb - 1) / t.nb;
  t.s = s.s;
  t.r = s.r;
  t.pad_h = s.pad_h;
  t.pad_w = s.pad_w;
  t.c_blocks = s.c / channel_block;
  return t;
}

// dw[i][j] = beta*dw[i][j] + t[j][i] for dw of rows x cols (t is cols x rows); beta = 0 writes
// without reading dw.
__global__ void transpose_accumulate_kernel(const float* __restrict__ t, int rows, int cols,
                                            float beta, float* __restrict__ dw) {
  kernel_entry();
  const int64_t total = int64_t(rows) * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / cols;
    const int64_t col = i - row * cols;
    const float v = t[col * rows + row];
    dw[i] = beta == 0.f ? v : fmaf(beta, dw[i], v);
  }
}

// Whether run_forward can take backward-data's view `s` with the forward's own filters (bf16, the
// TMA patches: kConvTmaBT reads them rotated per tap), so that no rotated copy is needed. The
// filters' channels (the view's k) a multiple of 8: every box starts on 16 bytes.
bool unrotated_applies(const Conv2dShape& s, const ConvOperands& ops) {
  return ops.math == Math::BF16 && g_feed.load() != detail::ConvFeed::gather && s.stride_h == 1 &&
         s.stride_w == 1 && s.c % 64 == 0 && s.k % 8 == 0 && aligned16(ops.w) &&
         !detail::narrow_forward_applies(s, ops);
}

// The forward view of backward-data: input dy (c = K padded), k = C, rotated filters.
Conv2dShape backward_data_view(const Conv2dShape& s, int kp);

// The forward convolution of typed operands whose channel count suits the gather (checked).
// `unrotated` (backward-data's view, where unrotated_applies): ops.w is the forward's K x R*S*C
// filters, not the rotated copy.
void run_forward(const Conv2dShape& s, const ConvOperands& ops, cudaStream_t stream,
                 bool unrotated = false) {
  const int chunk = chunk_elements(ops.math);
  CUDP_CHECK(s.c % chunk == 0, "conv (tensor cores): C = ", s.c, " must be a multiple of ", chunk,
             " for ", math_name(ops.math), " operands; pad the channels with zeros");
  CUDP_CHECK(ops.x && ops.w && ops.y, "conv (tensor cores): x, w and y must not be null");
  CUDP_CHECK(aligned16(ops.x) && aligned16(ops.w),
             "conv (tensor cores): x and w must be 16-byte aligned");
  MatmulProblem p;
  p.m = s.n * s.p() * s.q();
  p.n = s.k;
  p.k = s.r * s.s * s.c;
  p.math = ops.math;
  p.a = ops.x;  // unused by the gather, but keeps the problem's checks meaningful
  p.lda = p.k;
  p.b = ops.w;
  p.ldb = p.k;
  if (unrotated) {  // per tap, K rows of n channels with row stride R*S*n (validated as k x n)
    p.b_transposed = true;
    p.ldb = int64_t(s.r) * s.s * p.n;
  }
  p.c = ops.y;
  p.ldc = s.k;
  p.c_type = ops.y_type;
  p.bias = ops.bias;
  p.relu = ops.relu;
  p.mask = ops.mask;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const std::string why = matmul_unsupported_reason(p, device);
  CUDP_CHECK(why.empty(), "conv (tensor cores): ", why);
  p.column_sums = ops.column_sums;  // after the check: not a plain product's option
  // One 16-byte chunk of input channels (VGG's first layer, padded: 8 bf16 or 4 fp32): the
  // reduction is about one k-block, which the mainloop cannot pipeline; a kernel of its own
  // (kernels/conv2d_narrow.cu).
  if (!unrotated && g_feed.load() != detail::ConvFeed::gather &&
      detail::narrow_forward_applies(s, ops)) {
    detail::conv2d_forward_narrow(s, ops, stream);
    if (ops.column_sums != nullptr) {  // a pass of its own
      detail::add_column_sums(ops.y, ops.y_type, ops.column_sums, int64_t(s.n) * s.p() * s.q(), s.k,
                              stream);
    }
    return;
  }
  const sm90::ConvGather gather{ops.x,    s.n,        s.h,        s.w,     s.c,    s.p(),
                                s.q(),    s.r,        s.s,        s.stride_h, s.stride_w,
                                s.pad_h,  s.pad_w};
  const int k_block = ops.math == Math::BF16 ? 64 : 32;
  const MatmulPlan plan = conv_plan(p, device);
  // Which A feed: the TMA patches wherever they apply. Measured on the H200 over VGG-16's layers,
  // both feeds forced in one session (bench_conv2d --feed, bench/NOTES-tensor-cores.md), the
  // patches were as fast or faster on every forward and backward-data shape at 224^2 and 32^2, in
  // bf16 and in TF32 (the 28-56 wide outputs too, where an earlier measurement had favoured the
  // gather).
  const bool patch = g_feed.load() != detail::ConvFeed::gather;
  if (patch && s.stride_h == 1 && s.stride_w == 1 && s.c % k_block == 0) {
    sm90::PatchTiles patch_tiling = patch_tiles(s, 128, k_block);
    patch_tiling.filters_resident = g_feed.load() != detail::ConvFeed::patch_streamed;
    patch_tiling.swapped = g_swapped.load();
    patch_tiling = with_halo(p, plan, patch_tiling);
    detail::run_mainloop(p, plan, &gather, stream,
                         unrotated ? detail::Feed::ConvTmaUnrotated : detail::Feed::ConvTma,
                         &patch_tiling);
    return;
  }
  CUDP_CHECK(!unrotated, "conv (tensor cores): unrotated filters outside the TMA patch feed");
  detail::run_mainloop(p, plan, &gather, stream);
}

// The forward view of backward-data: input dy (c = K padded), k = C, rotated filters.
Conv2dShape backward_data_view(const Conv2dShape& s, int kp) {
  CUDP_CHECK(s.stride_h == 1 && s.stride_w == 1,
             "conv2d_backward_data (tensor cores): only stride 1 is implemented (it runs as the "
             "forward convolution of dy with rotated filters); use Math::FP32 for strided layers");
  CUDP_CHECK(s.pad_h <= s.r - 1 && s.pad_w <= s.s - 1,
             "conv2d_backward_data (tensor cores): padding larger than the filter minus one is not "
             "implemented; use Math::FP32");
  Conv2dShape v;
  v.n = s.n;
  v.h = s.p();
  v.w = s.q();
  v.c = kp;
  v.k = s.c;
  v.r = s.r;
  v.s = s.s;
  v.pad_h = s.r - 1 - s.pad_h;
  v.pad_w = s.s - 1 - s.pad_w;
  return v;
}

std::atomic<int> g_wgrad_variant{-1};

// The established MN-major descriptor assignment (see kernels/sm90/matmul_sm90.cuh, kWgrad).
constexpr bool kWgradAltByDefault = false;

// Whether the bf16 backward-weight of `s` feeds both operands by TMA over patches of output pixels:
// where the slabs of B are whole taps (C a multiple of 64) and the taps are shifts (stride 1); the
// gather elsewhere, and for the tests that pin the descriptor layout or turn the patch feed off.
bool wgrad_patch_feed(const Conv2dShape& s);

// Whether the patch feed's product takes the bias sums along (detail::set_wgrad_bias_fusion).
bool wgrad_fuses_bias(const Conv2dShape& s) {
  return g_wgrad_bias_fusion.load() && wgrad_patch_feed(s);
}

bool wgrad_patch_feed(const Conv2dShape& s) {
  return g_feed.load() != detail::ConvFeed::gather && g_wgrad_variant.load() < 0 &&
         s.stride_h == 1 && s.stride_w == 1 && s.c % 64 == 0;
}

// Whether the product of backward-weight's dw^T (64 or fewer output channels) under `plan` can
// take the bias sums along: tiles of up to 128 channels (kernels/sm90/matmul_sm90.cuh).
bool transposed_wgrad_fuses_bias(const MatmulPlan& plan) {
  return plan.tile_n <= 128;
}

// dw (fp32, K x R x S x C, row stride R*S*C) = beta*dw + dy^T im2col(x), bf16 x and dy; dbias
// (K floats, or null) += dy's column sums: fused into the patch feed's product, else bias_grad.
void run_backward_weight(const Conv2dShape& s, const void* x, const void* dy, float* dw, float beta,
                         cudaStream_t stream, float* dbias = nullptr, int live_channels = 0) {
  CUDP_CHECK(s.c % 8 == 0, "conv2d_backward_weight_tc: C = ", s.c, " must be a multiple of 8");
  CUDP_CHECK(s.k % 8 == 0, "conv2d_backward_weight_tc: K = ", s.k,
             " must be a multiple of 8 (16-byte rows of dy for TMA)");
  CUDP_CHECK(x && dy && dw, "conv2d_backward_weight_tc: x, dy and dw must not be null");
  CUDP_CHECK(aligned16(x) && aligned16(dy),
             "conv2d_backward_weight_tc: x and dy must be 16-byte aligned");
  MatmulProblem p;
  p.m = s.k;
  p.n = s.r * s.s * s.c;
  p.k = s.n * s.p() * s.q();
  p.math = Math::BF16;
  p.a = dy;
  p.lda = s.k;
  p.c = dw;
  p.ldc = p.n;
  p.c_type = DType::F32;
  p.beta = beta;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const sm90::ConvGather gather{x, s.n, s.h, s.w, s.c, s.p(), s.q(), s.r, s.s,
                                s.stride_h, s.stride_w, s.pad_h, s.pad_w};
  const int variant = g_wgrad_variant.load();
  const int64_t pixels = int64_t(s.n) * s.p() * s.q();
  const auto separate_bias_grad = [&] {
    if (dbias) bias_grad(static_cast<const __nv_bfloat16*>(dy), dbias, pixels, s.k, 1.f, stream);
  };
  // Eight input channels (VGG's first layer, padded): a kernel of its own, as for the forward.
  if (g_feed.load() != detail::ConvFeed::gather && variant < 0 &&
      detail::narrow_wgrad_applies(s, x, dy)) {
    detail::conv2d_backward_weight_narrow(s, x, dy, dw, beta, stream, live_channels);
    separate_bias_grad();
    return;
  }
  const bool alt = variant < 0 ? kWgradAltByDefault : variant == 1;
  if (wgrad_patch_feed(s)) {
    sm90::PatchTiles patch = patch_tiles(s, 64, 64);
    patch.split_major = g_wgrad_split_major.load();
    const int64_t padded = wgrad_patch_pixels(patch);
    CUDP_CHECK(padded <= std::numeric_limits<int>::max(), "conv2d_backward_weight_tc: ", padded,
               " output pixels (with the patch padding) are too many for one product");
    p.k = static_cast<int>(padded);
    p.bias_grad = wgrad_fuses_bias(s) ? dbias : nullptr;
    if (s.k > 64) {
      detail::run_mainloop(p, plan_matmul(p, device), &gather, stream, detail::Feed::WgradTma,
                           &patch);
      if (!p.bias_grad) separate_bias_grad();
      return;
    }
    // 64 or fewer output channels would fill half of each 128-row tile: compute dw^T instead
    // (R*S*C rows), then transpose it into dw (K * R*S*C elements: a small pass).
    MatmulProblem t = p;
    t.m = p.n;
    t.n = p.m;
    t.a = nullptr;
    t.lda = 0;
    t.b = dy;
    t.ldb = s.k;
    Workspace transposed(size_t(t.m) * size_t(t.n) * sizeof(float), stream);
    t.c = transposed.get();
    t.ldc = t.n;
    t.beta = 0.f;
    const MatmulPlan plan = plan_matmul(t, device);
    const bool fused_bias = t.bias_grad != nullptr && transposed_wgrad_fuses_bias(plan);
    if (!fused_bias) t.bias_grad = nullptr;
    detail::run_mainloop(t, plan, &gather, stream, detail::Feed::WgradTmaT, &patch);
    if (!fused_bias) separate_bias_grad();
    const int64_t total = int64_t(p.m) * p.n;
    launch("transpose_accumulate_kernel", transpose_accumulate_kernel, blocks_for(total), 256, 0,
           stream, transposed.get(), p.m, p.n, beta, dw);
    return;
  }
  detail::run_mainloop(p, plan_matmul(p, device), &gather, stream,
                       alt ? detail::Feed::WgradAlt : detail::Feed::Wgrad);
  separate_bias_grad();
}

// dw[k][r][s][c] = beta*dw + part[k][r][s][c] for c < C, from a part computed with cp channels.
__global__ void unpad_accumulate_kernel(const float* __restrict__ part, int64_t rows, int c, int cp,
                                        float beta, float* __restrict__ dw) {
  kernel_entry();
  const int64_t total = rows * c;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / c;
    const int j = static_cast<int>(i - row * c);
    const float v = part[row * cp + j];
    dw[i] = beta == 0.f ? v : fmaf(beta, dw[i], v);
  }
}

// ---- Backward-weight in TF32 ----------------------------------------------------------------
//
// TF32 wgmma reads only K-major operands, and backward-weight's reduction runs over output pixels,
// the rows of both NHWC tensors (MN-major). Stride-1 layers with C a multiple of 32 (every VGG
// layer but the first) take the patch boxes of the bf16 path, 32 pixels x 32 channels of fp32,
// which the kernel transposes in shared memory (kernels/sm90/matmul_sm90.cuh,
// transpose_box_in_place): run_backward_weight_tf32_boxes, the faster on every VGG-16 layer
// (bench/NOTES-tensor-cores.md). Elsewhere, or with detail::set_tf32_wgrad_feed(copies), both
// operands go through K-major fp32 copies first, laid out on one pixel grid of n x GH x GW
// positions (column j = (n * GH + hh) * GW + ww):
//   dy^T[k][j] = dy[n][hh][ww][k] where (hh, ww) is an output pixel, else 0;
//   stride 1, C a multiple of 64 (every VGG layer but the first): the grid is the zero-padded
//     input, GH = H + 2 pad_h, GW = W + 2 pad_w rounded up to a multiple of 4, and x^T holds S
//     copies of x, copy s shifted by s: x^T[s][c][j] = x[n][hh - pad_h][ww + s - pad_w][c] (0 in
//     the padding). Then im2col(x)^T's row (r, s, c) is row c of copy s shifted by r * GW: for
//     an output pixel, hh + r <= P - 1 + R - 1 < GH and ww + s < GW, so the shift stays in the
//     pixel's image; the kernel reads each tap as a 2-D box at the shifted columns
//     (kWgradShift), and no im2col is written. (One copy shifted by r * GW + s would do, but TMA
//     faults on a box whose first element is not 16-byte aligned, so the shifts along the grid
//     stay multiples of 4 floats.) Grid positions that are not output pixels have
//     dy^T = 0, so whatever x^T holds at their shift adds 0 (NOTE: non-finite values of x there
//     would add NaN from 0 * inf, which the direct sum would not see; a training step with
//     non-finite activations is already lost, and the divergence guard stops it).
//   otherwise (strided layers; C not a multiple of 64 where the narrow kernel does not apply):
//     the grid is the output, GH = P, GW = Q, and x^T is im2col(x)^T written out, R*S*C rows
//     padded with zeros to a multiple of 64 (the slab height); the kernel then runs with one tap
//     and no shift.
// The copies cost a pass over x and dy (x written S times, dy once); the product then runs at the
// K-major TF32 mainloop's rate. dw is R*S*C columns of each of K rows in both layouts (the
// explicit one after dropping the padded rows).

struct KMajorCopy {
  const float* src;  // NHWC: n x h x w x c
  int n, h, w, c;
  int r, s, stride_h, stride_w, off_h, off_w;  // taps, and where grid position (0, 0) reads
  int grid_h, grid_w;
  int rows;    // of the copy: r * s * c, padded with zero rows
  int64_t ld;  // columns of the copy: n * grid_h * grid_w, padded with zero columns
  float* dst;
};

// dst[(ri * s + si) * c + ci][j] =
//     src[n][hh * stride_h + ri - off_h][ww * stride_w + si - off_w][ci]
// for j = (n * grid_h + hh) * grid_w + ww, 0 outside src and in the padded rows and columns. 32 x
// 32 tiles through shared memory: the reads run along src's channels, the writes along the grid.
// The tile's 32 grid positions are decomposed once (32-bit: the caller keeps ld below 2^31), not
// per element: a division per element made this copy slower than the product it feeds.
__global__ void k_major_copy_kernel(const KMajorCopy a) {
  kernel_entry();
  __shared__ float tile[32][33];
  __shared__ int img_of[32], hh_of[32], ww_of[32];
  const int j0 = blockIdx.x * 32;
  const int row0 = blockIdx.y * 32;
  if (threadIdx.y == 0) {
    const int plane = a.grid_h * a.grid_w;
    const int j = j0 + threadIdx.x;
    const int img = j / plane;
    const int rest = j - img * plane;
    img_of[threadIdx.x] = img;
    hh_of[threadIdx.x] = rest / a.grid_w;
    ww_of[threadIdx.x] = rest - (rest / a.grid_w) * a.grid_w;
  }
  const int row = row0 + threadIdx.x;
  int ri = 0, si = 0, ci = 0;
  const bool row_in = row < a.r * a.s * a.c;
  if (row_in) {
    const int rs = row / a.c;
    ci = row - rs * a.c;
    ri = rs / a.s;
    si = rs - ri * a.s;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    float v = 0.f;
    const int img = img_of[i];
    if (row_in && img < a.n) {
      const int h = hh_of[i] * a.stride_h + ri - a.off_h, w = ww_of[i] * a.stride_w + si - a.off_w;
      if (unsigned(h) < unsigned(a.h) && unsigned(w) < unsigned(a.w)) {
        v = a.src[((int64_t(img) * a.h + h) * a.w + w) * a.c + ci];
      }
    }
    tile[threadIdx.x][i] = v;
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int j = j0 + threadIdx.x;
    if (row0 + i < a.rows && j < a.ld) a.dst[int64_t(row0 + i) * a.ld + j] = tile[i][threadIdx.x];
  }
}

// The copies of the stride-1 path, one read of src for all of them: dst[si * c + ci][j] =
// v(ci, j + si) for si < copies, where v(ci, j) = src[n][hh - off_h][ww - off_w][ci] for
// j = (n * grid_h + hh) * grid_w + ww (0 outside src, past the last image and in the padded rows).
// A block stages 32 channels of 128 + copies - 1 grid positions in shared memory (each pixel's 32
// channels one 128-byte read) and writes every copy's 32 rows of 128 positions from it, each warp
// instruction 128 contiguous bytes. (k_major_copy_kernel read x once per copy, at about a third of
// HBM bandwidth: bench/NOTES-tensor-cores.md.) Position j + si crossing into the next grid row is
// a position whose dy^T is 0, so what it holds does not matter.
constexpr int kCopyPositions = 128, kCopyChannels = 32, kCopyMaxCopies = 32;

__global__ void __launch_bounds__(256) shifted_copies_kernel(const KMajorCopy a, int copies) {
  kernel_entry();
  __shared__ float tile[kCopyChannels][kCopyPositions + kCopyMaxCopies + 1];  // odd row stride
  __shared__ int pixel_of[kCopyPositions + kCopyMaxCopies];
  const int j0 = blockIdx.x * kCopyPositions;
  const int c0 = blockIdx.y * kCopyChannels;
  const int span = kCopyPositions + copies - 1;
  const int tid = threadIdx.y * 32 + threadIdx.x;
  const int plane = a.grid_h * a.grid_w;
  for (int p = tid; p < span; p += 256) {
    const int j = j0 + p;  // below 2^31: the caller checks ld + copies
    const int img = j / plane;
    const int rest = j - img * plane;
    const int hh = rest / a.grid_w;
    const int h = hh - a.off_h, w = rest - hh * a.grid_w - a.off_w;
    const bool inside = img < a.n && unsigned(h) < unsigned(a.h) && unsigned(w) < unsigned(a.w);
    pixel_of[p] = inside ? (img * a.h + h) * a.w + w : -1;
  }
  __syncthreads();
  const int ci = c0 + threadIdx.x;
  for (int p = threadIdx.y; p < span; p += 8) {
    const int pixel = pixel_of[p];
    tile[threadIdx.x][p] = pixel >= 0 && ci < a.c ? a.src[int64_t(pixel) * a.c + ci] : 0.f;
  }
  __syncthreads();
  for (int r = threadIdx.y; r < copies * kCopyChannels; r += 8) {
    const int si = r / kCopyChannels, local = r - si * kCopyChannels;
    const int c = c0 + local;
    if (c >= a.c) continue;
    float* dst = a.dst + (int64_t(si) * a.c + c) * a.ld;
#pragma unroll
    for (int k = 0; k < kCopyPositions / 32; ++k) {
      const int q = 32 * k + threadIdx.x;
      if (j0 + int64_t(q) < a.ld) dst[j0 + q] = tile[local][q + si];
    }
  }
}

void shifted_copies(const KMajorCopy& a, int copies, cudaStream_t stream) {
  CUDP_CHECK(copies >= 1 && copies <= kCopyMaxCopies, "conv2d_backward_weight (TF32): ", copies,
             " filter columns are more than the copy kernel's ", kCopyMaxCopies);
  const dim3 grid(static_cast<unsigned>((a.ld + kCopyPositions - 1) / kCopyPositions),
                  static_cast<unsigned>((a.c + kCopyChannels - 1) / kCopyChannels));
  CUDP_CHECK(grid.y <= 65535, "conv2d_backward_weight (TF32): ", a.c,
             " channels are too many for the K-major copy");
  launch("shifted_copies_kernel", shifted_copies_kernel, grid, dim3(32, 8), 0, stream, a, copies);
}

void k_major_copy(const KMajorCopy& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.ld + 31) / 32),
                  static_cast<unsigned>((a.rows + 31) / 32));
  CUDP_CHECK(grid.y <= 65535, "conv2d_backward_weight (TF32): ", a.rows,
             " rows are too many for the K-major copy");
  launch("k_major_copy_kernel", k_major_copy_kernel, grid, dim3(32, 8), 0, stream, a);
}

// Whether the TF32 backward-weight of `s` reads x and dy by patch boxes transposed in shared
// memory (kWgradTma / kWgradTmaT with fp32 operands) rather than through K-major copies: stride 1,
// C a multiple of the 32-channel box, 16-byte rows of dy (K a multiple of 4) and 16-byte aligned
// tensors, unless the setting asks for the copies.
bool tf32_wgrad_boxes(const Conv2dShape& s, const float* x, const float* dy) {
  const detail::Tf32WgradFeed feed = g_tf32_wgrad_feed.load();
  return feed != detail::Tf32WgradFeed::copies && g_feed.load() != detail::ConvFeed::gather &&
         s.stride_h == 1 && s.stride_w == 1 && s.c % 32 == 0 && s.k % 4 == 0 && aligned16(x) &&
         aligned16(dy);
}

// dw = beta*dw + dy^T im2col(x) in TF32 by patch boxes (tf32_wgrad_boxes): k-blocks of 32 output
// pixels, x in boxes of 32 channels of one tap; dw^T for 64 or fewer output channels, as the bf16
// path does.
void run_backward_weight_tf32_boxes(const Conv2dShape& s, const float* x, const float* dy,
                                    float* dw, float beta, cudaStream_t stream) {
  sm90::PatchTiles patch = patch_tiles(s, 32, 32);
  patch.split_major = g_wgrad_split_major.load();
  const int64_t padded = wgrad_patch_pixels(patch);
  CUDP_CHECK(padded <= std::numeric_limits<int>::max(), "conv2d_backward_weight (TF32): ", padded,
             " output pixels (with the patch padding) are too many for one product; split the "
             "batch");
  const sm90::ConvGather gather{x,   s.n, s.h,        s.w,        s.c,     s.p(),  s.q(),
                                s.r, s.s, s.stride_h, s.stride_w, s.pad_h, s.pad_w};
  MatmulProblem p;
  p.math = Math::TF32;
  p.k = static_cast<int>(padded);
  p.c_type = DType::F32;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const auto plan_for = [&](const MatmulProblem& q) {
    return planned_or_forced(q, device, g_tf32_wgrad_tile_n.load(), g_tf32_wgrad_splits.load());
  };
  const int rsc = s.r * s.s * s.c;
  if (s.k > 64) {
    p.m = s.k;
    p.n = rsc;
    p.a = dy;
    p.lda = s.k;
    p.c = dw;
    p.ldc = rsc;
    p.beta = beta;
    detail::run_mainloop(p, plan_for(p), &gather, stream, detail::Feed::WgradTma, &patch);
    return;
  }
  p.m = rsc;
  p.n = s.k;
  p.b = dy;
  p.ldb = s.k;
  Workspace transposed(size_t(p.m) * size_t(p.n) * sizeof(float), stream,
                       "backward-weight's dw^T before its transpose (TF32)");
  p.c = transposed.get();
  p.ldc = p.n;
  detail::run_mainloop(p, plan_for(p), &gather, stream, detail::Feed::WgradTmaT, &patch);
  const int64_t total = int64_t(s.k) * rsc;
  launch("transpose_accumulate_kernel", transpose_accumulate_kernel, blocks_for(total), 256, 0,
         stream, transposed.get(), s.k, rsc, beta, dw);
}

// Which kernel the TF32 backward-weight of `s` runs under the current settings: the narrow one
// (at most 4 input channels), the patch boxes, or the K-major copies. One rule for the launcher
// and for detail::conv2d_backward_weight_tf32_boxes.
enum class Tf32Wgrad { narrow, boxes, copies };
Tf32Wgrad tf32_wgrad_kernel(const Conv2dShape& s, const float* x, const float* dy) {
  if (g_feed.load() != detail::ConvFeed::gather && detail::narrow_wgrad_tf32_applies(s, dy)) {
    return Tf32Wgrad::narrow;
  }
  return tf32_wgrad_boxes(s, x, dy) ? Tf32Wgrad::boxes : Tf32Wgrad::copies;
}

// dw (K x R*S*C) = beta*dw + the product's result, fp32 x and dy, TF32 products.
void run_backward_weight_tf32(const Conv2dShape& s, const float* x, const float* dy, float* dw,
                              float beta, cudaStream_t stream) {
  CUDP_CHECK(x && dy && dw, "conv2d_backward_weight: x, dy and dw must not be null");
  // At most 4 input channels (VGG's first layer): a kernel of its own, no copies
  // (kernels/conv2d_narrow.cu).
  const Tf32Wgrad kernel = tf32_wgrad_kernel(s, x, dy);
  if (kernel == Tf32Wgrad::narrow) {
    detail::conv2d_backward_weight_narrow_tf32(s, x, dy, dw, beta, stream);
    return;
  }
  if (kernel == Tf32Wgrad::boxes) {
    run_backward_weight_tf32_boxes(s, x, dy, dw, beta, stream);
    return;
  }
  const bool shift = s.stride_h == 1 && s.stride_w == 1 && s.c % 64 == 0;
  const int grid_h = shift ? s.h + 2 * s.pad_h : s.p();
  const int grid_w = shift ? static_cast<int>(round_up(s.w + 2 * s.pad_w, 4)) : s.q();
  const int64_t rsc = int64_t(s.r) * s.s * s.c;
  const int rows_x = shift ? s.c : static_cast<int>(round_up(rsc, 64));  // of one copy
  const int64_t ld = round_up(int64_t(s.n) * grid_h * grid_w, 4);  // 16-byte rows for TMA
  CUDP_CHECK(ld + int64_t(s.r) * grid_w + s.s + kCopyPositions <= std::numeric_limits<int>::max(),
             "conv2d_backward_weight (TF32): ", ld,
             " pixel positions are too many for one product; split the batch");
  Workspace dyt(size_t(s.k) * size_t(ld) * sizeof(float), stream,
                "backward-weight's K-major copy of dy (TF32)");
  const int copies = shift ? s.s : 1;
  Workspace xt(size_t(copies) * size_t(rows_x) * size_t(ld) * sizeof(float), stream,
               "backward-weight's K-major copy of x (TF32)");
  shifted_copies({dy, s.n, s.p(), s.q(), s.k, 1, 1, 1, 1, 0, 0, grid_h, grid_w, s.k, ld, dyt.get()},
                 1, stream);
  if (shift) {
    // Copy si's row c is x's channel c at filter column si: an im2col of one filter row.
    shifted_copies({x, s.n, s.h, s.w, s.c, 1, 1, 1, 1, s.pad_h, s.pad_w, grid_h, grid_w,
                    copies * rows_x, ld, xt.get()},
                   copies, stream);
  } else {
    k_major_copy({x, s.n, s.h, s.w, s.c, s.r, s.s, s.stride_h, s.stride_w, s.pad_h, s.pad_w, grid_h,
                  grid_w, rows_x, ld, xt.get()},
                 stream);
  }
  sm90::PatchTiles taps;
  taps.r = shift ? s.r : 1;
  taps.s = shift ? s.s : 1;
  taps.c_blocks = rows_x / 64;
  taps.grid_w = shift ? grid_w : 0;
  const int columns = static_cast<int>(int64_t(taps.r) * taps.s * rows_x);  // of im2col(x)^T
  MatmulProblem p;
  p.math = Math::TF32;
  p.k = static_cast<int>(ld);
  p.c_type = DType::F32;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  // 64 or fewer output channels would fill half of each 128-row tile: compute dw^T instead. dw
  // itself (beta in the epilogue) when neither a transpose nor padded columns stand between.
  const bool transposed = s.k <= 64;
  const bool direct = !transposed && columns == rsc;
  Workspace part(direct ? 0 : size_t(s.k) * size_t(columns) * sizeof(float), stream,
                 "backward-weight's product before its layout pass (TF32)");
  p.m = transposed ? columns : s.k;
  p.n = transposed ? s.k : columns;
  p.a = transposed ? xt.get() : dyt.get();
  p.lda = ld;
  p.b = transposed ? dyt.get() : xt.get();
  p.ldb = ld;
  p.c = direct ? static_cast<void*>(dw) : part.get();
  p.ldc = p.n;
  p.beta = direct ? beta : 0.f;
  detail::run_mainloop(p, plan_matmul(p, device), nullptr, stream,
                       transposed ? detail::Feed::WgradShiftT : detail::Feed::WgradShift, &taps);
  if (direct) return;
  const int64_t total = int64_t(s.k) * rsc;
  if (transposed) {  // part is columns x K; its first R*S*C rows are dw^T
    launch("transpose_accumulate_kernel", transpose_accumulate_kernel, blocks_for(total), 256, 0,
           stream, part.get(), s.k, static_cast<int>(rsc), beta, dw);
  } else {  // part is K x columns; its first R*S*C columns are dw's
    launch("unpad_accumulate_kernel", unpad_accumulate_kernel, blocks_for(total), 256, 0, stream,
           part.get(), int64_t(s.k), static_cast<int>(rsc), columns, beta, dw);
  }
}

}  // namespace

void conv2d_forward_tc(const Conv2dShape& shape, const ConvOperands& ops, cudaStream_t stream) {
  check_tc("conv2d_forward_tc", shape, ops.math);
  CUDP_CHECK(ops.mask == nullptr && ops.column_sums == nullptr,
             "conv2d_forward_tc: a ReLU mask and column sums are backward-data's (the ReLU and the "
             "bias before the layer); the forward takes neither");
  run_forward(shape, ops, stream);
}

void conv2d_backward_data_tc(const Conv2dShape& shape, const ConvOperands& ops,
                             cudaStream_t stream) {
  check_tc("conv2d_backward_data_tc", shape, ops.math);
  const int chunk = chunk_elements(ops.math);
  CUDP_CHECK(shape.k % chunk == 0, "conv2d_backward_data_tc: K = ", shape.k,
             " must be a multiple of ", chunk, " for ", math_name(ops.math), " operands");
  CUDP_CHECK(ops.w != nullptr, "conv2d_backward_data_tc: w must not be null");
  const Conv2dShape view = backward_data_view(shape, shape.k);
  ConvOperands v = ops;
  v.bias = nullptr;
  v.relu = false;
  v.live_channels = 0;  // a forward's claim: the view's input is dy, whose channels are all live
  if (unrotated_applies(view, v)) {  // bf16: the filters as they are, read rotated per tap
    run_forward(view, v, stream, /*unrotated=*/true);
    return;
  }
  const DType type = operand_type(ops.math);
  Workspace rotated_ws(size_t(shape.w_size() * dtype_size(type)), stream);
  void* rotated = rotated_ws.get<void>();
  if (type == DType::BF16) {
    rotate_filters(static_cast<const __nv_bfloat16*>(ops.w), shape, shape.k, rotated, type, stream);
  } else {
    rotate_filters(static_cast<const float*>(ops.w), shape, shape.k, rotated, type, stream);
  }
  v.w = rotated;
  run_forward(view, v, stream);
}

bool conv2d_backward_data_reads_filters_as_they_are(const Conv2dShape& shape) {
  if (shape.stride_h != 1 || shape.stride_w != 1 || shape.pad_h > shape.r - 1 ||
      shape.pad_w > shape.s - 1 || shape.k % 64 != 0) {
    return false;
  }
  ConvOperands ops;
  ops.math = Math::BF16;
  return unrotated_applies(backward_data_view(shape, shape.k), ops);
}

void conv2d_backward_weight_tc(const Conv2dShape& shape, const void* x, const void* dy, float* dw,
                               float beta, cudaStream_t stream, float* dbias, int live_channels) {
  check_tc("conv2d_backward_weight_tc", shape, Math::BF16);
  run_backward_weight(shape, x, dy, dw, beta, stream, dbias, live_channels);
}

void conv2d_backward_data_tc_rotated(const Conv2dShape& shape, const ConvOperands& ops,
                                     cudaStream_t stream) {
  check_tc("conv2d_backward_data_tc_rotated", shape, ops.math);
  const int chunk = chunk_elements(ops.math);
  CUDP_CHECK(shape.k % chunk == 0, "conv2d_backward_data_tc_rotated: K = ", shape.k,
             " must be a multiple of ", chunk, " for ", math_name(ops.math), " operands");
  CUDP_CHECK(ops.w != nullptr, "conv2d_backward_data_tc_rotated: w must not be null");
  ConvOperands v = ops;
  v.bias = nullptr;
  v.relu = false;
  v.live_channels = 0;  // a forward's claim: the view's input is dy, whose channels are all live
  run_forward(backward_data_view(shape, shape.k), v, stream);
}

void conv2d_filters_to_bf16(const float* w, const Conv2dShape& shape, void* dst, void* rotated,
                            cudaStream_t stream) {
  shape.validate();
  CUDP_CHECK(w && dst, "conv2d_filters_to_bf16: w and dst must not be null");
  const int cp = static_cast<int>(round_up(shape.c, 8));
  if (rotated == nullptr && cp == shape.c) {
    // No padding and no rotation: the same layout, a plain cast (vectorised; the tiled kernel
    // below, made for the rotation, took 6-7 us a layer in a bf16 step, latency more than bytes).
    f32_to_bf16(w, static_cast<__nv_bfloat16*>(dst), shape.w_size(), stream);
    return;
  }
  const auto run = [&](auto kernel, int pair) {
    const int tile = kFilterThreads * pair;
    const dim3 grid(static_cast<unsigned>((cp + tile - 1) / tile),
                    static_cast<unsigned>((shape.k + tile - 1) / tile),
                    static_cast<unsigned>(shape.r * shape.s));
    launch("filters_to_bf16_kernel", kernel, grid, dim3(kFilterThreads, 8), 0, stream, w, shape.k,
           shape.r, shape.s, shape.c, cp, static_cast<__nv_bfloat16*>(dst),
           static_cast<__nv_bfloat16*>(rotated));
  };
  if (shape.c % 2 == 0 && shape.k % 2 == 0 && reinterpret_cast<uintptr_t>(w) % 8 == 0 &&
      reinterpret_cast<uintptr_t>(dst) % 4 == 0 && reinterpret_cast<uintptr_t>(rotated) % 4 == 0) {
    run(filters_to_bf16_kernel<2>, 2);
  } else {
    run(filters_to_bf16_kernel<1>, 1);
  }
}

int bf16_channels(int c) { return static_cast<int>(round_up(c, 8)); }

void conv2d_to_bf16(const float* src, int64_t pixels, int c, void* dst, cudaStream_t stream) {
  CUDP_CHECK(pixels >= 0 && c > 0, "conv2d_to_bf16: invalid size ", pixels, " x ", c);
  CUDP_CHECK(pixels == 0 || (src && dst), "conv2d_to_bf16: src and dst must not be null");
  if (pixels == 0) return;
  pad_channels(src, pixels, c, bf16_channels(c), dst, DType::BF16, stream);
}

void conv2d_pad_bf16(const void* src, int64_t pixels, int c, void* dst, cudaStream_t stream) {
  CUDP_CHECK(pixels >= 0 && c > 0, "conv2d_pad_bf16: invalid size ", pixels, " x ", c);
  CUDP_CHECK(pixels == 0 || (src && dst), "conv2d_pad_bf16: src and dst must not be null");
  if (pixels == 0) return;
  pad_channels(static_cast<const __nv_bfloat16*>(src), pixels, c, bf16_channels(c), dst,
               DType::BF16, stream);
}

namespace detail {

void set_wgrad_descriptor_variant(int variant) { g_wgrad_variant.store(variant); }
void set_conv_feed(ConvFeed feed) {
  g_feed.store(feed);
}

void set_conv_swapped(bool on) {
  g_swapped.store(on);
}
bool conv_swapped() {
  return g_swapped.load();
}

void set_conv_halo(bool on) {
  g_halo.store(on);
}

void set_conv_halo_wide(HaloWide mode) {
  g_halo_wide.store(mode);
}

void set_conv_tile_n(int tile_n) {
  CUDP_CHECK(tile_n == 0 || tile_n == 64 || tile_n == 128 || tile_n == 256,
             "set_conv_tile_n: 0 (the planner's choice), 64, 128 or 256, got ", tile_n);
  g_tile_n.store(tile_n);
}

void set_wgrad_split_major(bool split_major) {
  g_wgrad_split_major.store(split_major);
}

void set_wgrad_bias_fusion(bool on) {
  g_wgrad_bias_fusion.store(on);
}

void set_tf32_wgrad_feed(Tf32WgradFeed feed) {
  g_tf32_wgrad_feed.store(feed);
}

void set_tf32_wgrad_plan(int tile_n, int splits) {
  CUDP_CHECK(tile_n == 0 || tile_n == 64 || tile_n == 128 || tile_n == 256,
             "set_tf32_wgrad_plan: the tile width is 64, 128 or 256 (0: the planner's), got ",
             tile_n);
  CUDP_CHECK(splits >= 1 || tile_n == 0, "set_tf32_wgrad_plan: splits must be >= 1, got ", splits);
  g_tf32_wgrad_tile_n.store(tile_n);
  g_tf32_wgrad_splits.store(splits);
}

bool conv2d_backward_weight_tf32_boxes(const Conv2dShape& shape) {
  alignas(16) static const float aligned = 0.f;  // stands for 16-byte aligned tensors
  return tf32_wgrad_kernel(shape, &aligned, &aligned) == Tf32Wgrad::boxes;
}

bool conv2d_backward_weight_fuses_bias(const Conv2dShape& s) {
  if (!wgrad_fuses_bias(s) || s.k % 8 != 0) return false;
  if (s.k > 64) return true;
  // run_backward_weight's dw^T problem: the plan depends on (math, m, n, k) alone.
  const sm90::PatchTiles patch = patch_tiles(s, 64, 64);
  MatmulProblem t;
  t.m = s.r * s.s * s.c;
  t.n = s.k;
  t.k = static_cast<int>(wgrad_patch_pixels(patch));
  t.math = Math::BF16;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  return transposed_wgrad_fuses_bias(plan_matmul(t, device));
}

namespace {

// The typed bf16 call's product for `shape` (or backward-data's view of it) as run_forward sets it
// up, for the queries below: false where it does not take the TMA patches (the plan depends on
// (math, m, n, k) alone; C stands for a dense, aligned bf16 tensor).
bool patch_problem(const Conv2dShape& shape, bool backward_data, MatmulProblem& p, MatmulPlan& plan,
                   sm90::PatchTiles& patch) {
  const Conv2dShape s = backward_data ? backward_data_view(shape, shape.k) : shape;
  // run_forward's patch condition (C a multiple of 64 rules out the narrow first-layer kernels).
  if (g_feed.load() == ConvFeed::gather || s.stride_h != 1 || s.stride_w != 1 || s.c % 64 != 0) {
    return false;
  }
  alignas(16) static const uint16_t aligned[8] = {};
  p.m = s.n * s.p() * s.q();
  p.n = s.k;
  p.k = s.r * s.s * s.c;
  p.math = Math::BF16;
  p.c = const_cast<uint16_t*>(aligned);
  p.ldc = s.k;
  p.c_type = DType::BF16;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  plan = conv_plan(p, device);
  patch = patch_tiles(s, 128, 64);
  patch.filters_resident = g_feed.load() != ConvFeed::patch_streamed;
  patch.swapped = g_swapped.load();
  patch = with_halo(p, plan, patch);
  return true;
}

}  // namespace

int conv2d_resident_filter_blocks(const Conv2dShape& shape, bool backward_data) {
  MatmulProblem p;
  MatmulPlan plan;
  sm90::PatchTiles patch;
  if (!patch_problem(shape, backward_data, p, plan, patch)) return 0;
  return sm90::resident_filter_blocks(p, plan, patch);
}

bool conv2d_swapped_tiles(const Conv2dShape& shape, bool backward_data) {
  MatmulProblem p;
  MatmulPlan plan;
  sm90::PatchTiles patch;
  if (!patch_problem(shape, backward_data, p, plan, patch)) return false;
  return sm90::conv_swapped_applies(p, plan, patch);
}

bool conv2d_halo_tiles(const Conv2dShape& shape, bool backward_data) {
  MatmulProblem p;
  MatmulPlan plan;
  sm90::PatchTiles patch;
  return patch_problem(shape, backward_data, p, plan, patch) && patch.halo;
}

void conv2d_backward_weight_tc_f32(const Conv2dShape& shape, const float* x, const float* dy,
                                   float* dw, float beta, cudaStream_t stream, Math math,
                                   const Bf16Operands& converted, float* dbias) {
  check_tc("conv2d_backward_weight", shape, math);
  if (math == Math::TF32) {
    CUDP_CHECK(!converted.x && !converted.dy,
               "conv2d_backward_weight: Math::TF32 takes fp32 x and dy, not bf16 copies");
    CUDP_CHECK(dbias == nullptr,
               "conv2d_backward_weight: TF32's bias gradient is the float launcher's reduction");
    run_backward_weight_tf32(shape, x, dy, dw, beta, stream);
    return;
  }
  CUDP_CHECK((x || converted.x) && (dy || converted.dy) && dw,
             "conv2d_backward_weight: x, dy and dw must not be null");
  const int cp = bf16_channels(shape.c);
  const int kp = bf16_channels(shape.k);
  const int64_t pixels_in = int64_t(shape.n) * shape.h * shape.w;
  const int64_t pixels_out = int64_t(shape.n) * shape.p() * shape.q();
  Workspace xb_ws(converted.x ? 0 : size_t(pixels_in * cp * 2), stream);
  Workspace dyb_ws(converted.dy ? 0 : size_t(pixels_out * kp * 2), stream);
  const void* xb = converted.x;
  const void* dyb = converted.dy;
  if (!xb) {
    conv2d_to_bf16(x, pixels_in, shape.c, xb_ws.get<void>(), stream);
    xb = xb_ws.get<void>();
  }
  if (!dyb) {
    conv2d_to_bf16(dy, pixels_out, shape.k, dyb_ws.get<void>(), stream);
    dyb = dyb_ws.get<void>();
  }
  Conv2dShape padded = shape;
  padded.c = cp;
  padded.k = kp;
  if (cp == shape.c && kp == shape.k) {
    run_backward_weight(padded, xb, dyb, dw, beta, stream, dbias);
    return;
  }
  const auto* dy_bf16 = static_cast<const __nv_bfloat16*>(dyb);
  if (dbias && kp == shape.k) {
    bias_grad(dy_bf16, dbias, pixels_out, shape.k, 1.f, stream);
  } else if (dbias) {
    // dy's bf16 copy has kp > K channels (zeros past K): its column sums, then the first K of them.
    Workspace sums(size_t(kp) * sizeof(float), stream, "the bias gradient of padded channels");
    bias_grad(dy_bf16, sums.get(), pixels_out, kp, 0.f, stream);
    kernels::axpy(1.f, sums.get(), dbias, shape.k, stream);
  }
  // Padded channels: compute the padded gradient, then keep its first C channels of the first K
  // filters.
  const int64_t rows = int64_t(kp) * shape.r * shape.s;
  Workspace part_ws(size_t(rows * cp * 4), stream);
  float* part = part_ws.get();
  run_backward_weight(padded, xb, dyb, part, 0.f, stream, nullptr, shape.c);
  const int64_t keep = int64_t(shape.k) * shape.r * shape.s;
  launch("unpad_accumulate_kernel", unpad_accumulate_kernel, blocks_for(keep * shape.c), 256, 0,
         stream, part, keep, shape.c, cp, beta, dw);
}

void conv2d_forward_tc_f32(const Conv2dShape& shape, const float* x, const float* w,
                           const float* bias, float* y, bool relu, cudaStream_t stream,
                           Math math, const Bf16Operands& converted) {
  check_tc("conv2d_forward", shape, math);
  CUDP_CHECK((x || converted.x) && w && y, "conv2d_forward: x, w and y must not be null");
  const DType type = operand_type(math);
  const int cp = static_cast<int>(round_up(shape.c, chunk_elements(math)));
  // fp32 operands are used in place when the gather and TMA can read them as they are.
  const bool direct = type == DType::F32 && cp == shape.c && aligned16(x) && aligned16(w);
  ConvOperands ops{math, x, w, y, DType::F32, bias, relu};
  const int64_t pixels = int64_t(shape.n) * shape.h * shape.w, taps = int64_t(shape.k) * shape.r * shape.s;
  Workspace xp(direct || converted.x ? 0 : size_t(pixels * cp * dtype_size(type)), stream);
  Workspace wp(direct ? 0 : size_t(taps * cp * dtype_size(type)), stream);
  if (!direct) {
    if (converted.x) {
      ops.x = converted.x;
    } else {
      pad_channels(x, pixels, shape.c, cp, xp.get<void>(), type, stream);
      ops.x = xp.get<void>();
    }
    pad_channels(w, taps, shape.c, cp, wp.get<void>(), type, stream);
    ops.w = wp.get<void>();
  }
  Conv2dShape padded = shape;
  padded.c = cp;
  ops.live_channels = shape.c;
  run_forward(padded, ops, stream);
}

void conv2d_backward_data_tc_f32(const Conv2dShape& shape, const float* dy, const float* w,
                                 float* dx, cudaStream_t stream, Math math,
                                 const Bf16Operands& converted) {
  check_tc("conv2d_backward_data", shape, math);
  CUDP_CHECK((dy || converted.dy) && w && dx,
             "conv2d_backward_data: dy, w and dx must not be null");
  const DType type = operand_type(math);
  const int kp = static_cast<int>(round_up(shape.k, chunk_elements(math)));
  const Conv2dShape view = backward_data_view(shape, kp);
  Workspace rotated(size_t(int64_t(shape.c) * shape.r * shape.s * kp * dtype_size(type)), stream);
  ConvOperands ops{math, dy, rotated.get<void>(), dx, DType::F32, nullptr, false};
  // bf16 with K a multiple of 64: the filters' bf16 copy as they are (read rotated per tap).
  const bool unrotated = kp == shape.k && unrotated_applies(view, ops);
  if (unrotated) {
    f32_to_bf16(w, rotated.get<__nv_bfloat16>(), shape.w_size(), stream);
  } else {
    rotate_filters(w, shape, kp, rotated.get<void>(), type, stream);
  }
  const bool direct = type == DType::F32 && kp == shape.k && aligned16(dy);
  const int64_t pixels = int64_t(shape.n) * shape.p() * shape.q();
  Workspace dyp(direct || converted.dy ? 0 : size_t(pixels * kp * dtype_size(type)), stream);
  if (converted.dy) {
    ops.x = converted.dy;
  } else if (!direct) {
    pad_channels(dy, pixels, shape.k, kp, dyp.get<void>(), type, stream);
    ops.x = dyp.get<void>();
  }
  run_forward(view, ops, stream, unrotated);
}

}  // namespace detail
}  // namespace cudp::kernels
