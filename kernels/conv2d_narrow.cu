// The forward and backward-weight convolutions of a layer with few input channels (VGG's first: 3,
// padded to one 16-byte chunk per pixel, 8 bf16 or 4 fp32) on tensor cores, bf16 or TF32 operands,
// without the GEMM mainloop.
//
// Why kernels of their own: with C = 8 the implicit GEMM's reduction is R*S*8 = 72 for a 3x3
// filter, about one k-block, so the mainloop's pipeline never fills, its gather moves one 16-byte
// chunk per pixel and tap, and 44% of each 128-wide k-block is padding. The layer's real cost is
// writing y (at 224^2 and batch 64: 411 MB of bf16, ~0.09 ms at HBM bandwidth); the mainloop took
// 0.31 ms. Here a block owns a 4 x 32 patch of output pixels and all 64 output channels (two
// blocks an SM):
//   - the patch's input halo ((4 + R - 1) x (32 + S - 1) pixels of 16 bytes) comes to shared
//     memory with cp.async, zero-filled outside the image (the padding), double-buffered across
//     the block's tiles (persistent blocks);
//   - warp w computes output row w / 2 of the tile for the 32 output channels of half w % 2, 16
//     pixels at a time, with mma.sync (bf16 m16n8k16 or TF32 m16n8k8, fp32 accumulation): the
//     reduction index is tap * C + channel, so a k step is two taps, and an A fragment is one
//     ldmatrix.x4 whose lanes point at the 16-byte pixels of the halo that the two taps read (a
//     tap past R*S points at a zero chunk). The filters (B) live in registers, loaded once per
//     block. With paired taps (narrow_paired_taps: bf16, 3 x 3, x's channels past 4 zeros) a
//     k step is a whole filter row instead, three steps where there were five;
//   - the epilogue adds the bias and applies the ReLU exactly as the mainloop's epilogue does
//     (kernels/matmul_epilogue.cuh: each step rounded on its own), rounds once, and writes each
//     warp's 16 pixels x 32 channels through shared memory of the warp's own, so that global
//     stores are whole 16-byte chunks and no barrier of the block waits on them (one per tile, for
//     the halo).
// Requirements (narrow_forward_applies): x with one 16-byte chunk of channels (C = 8 bf16 or 4
// fp32), filters of the same type, K = 64, R and S at most 3, stride 1, no mask; any H, W, padding
// and batch. Sums run in a fixed order: deterministic on a given GPU (backward-weight's partials
// are one per block, so their count follows the number of SMs).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "engine/core/launch.cuh"
#include "kernels/conv2d_narrow.h"
#include "kernels/matmul.h"
#include "kernels/matmul_epilogue.cuh"
#include "kernels/sm90/matmul_sm90.h"
#include "kernels/workspace.h"

namespace cudp::kernels::detail {
namespace {

// Input channels: one 16-byte chunk per pixel, 8 bf16 or 4 fp32 (TF32 products).
template <typename Elem>
constexpr int kChannels = 16 / int(sizeof(Elem));
constexpr int kC = kChannels<__nv_bfloat16>;  // the bf16 kernels'
constexpr int kK = 64;                        // output channels
// Output pixels of a block's tile: kTileH x kTileW. Four rows, so that two blocks share an SM (a
// block's registers are a fourth of the SM's at 117 per thread): one block's epilogue and stores
// overlap the other's products. With one block of eight rows per SM the forward took 0.27 ms at
// 224^2, about three times the time its output takes to write.
constexpr int kTileH = 4, kTileW = 32;
constexpr int kBlocksPerSm = 2;
constexpr int kMaxR = 3, kMaxS = 3;
constexpr int kSteps = (kMaxR * kMaxS + 1) / 2;  // k steps (k16 bf16, k8 TF32): two taps each
constexpr int kHaloH = kTileH + kMaxR - 1, kHaloW = kTileW + kMaxS - 1;
constexpr int kHaloChunks = kHaloH * kHaloW + 1;  // + one zero chunk for taps past R*S
constexpr int kWarps = 2 * kTileH;                // (row, half of the channels)
constexpr int kThreads = 32 * kWarps;
// A warp stages its 16 pixels x 32 channels in shared memory of its own, 40 elements a pixel (80
// or 160 bytes: the fragment writes, bf16 pairs or float pairs, then fall in different banks, and
// each pixel's half-row stays 16-byte aligned for the reads back).
constexpr int kStageStride = 40;

// What every narrow kernel knows of its convolution: the shape, and the output cut into tiles of
// tile_h x kTileW pixels (tiles_q across, tiles_p down, per image); each tap's offset in the halo.
struct NarrowGeometry {
  int n, h, w_in, p, q, r, s, pad_h, pad_w;
  int tiles_q, tiles_p, tiles;
  int tap_off[kMaxR * kMaxS + 1];  // per tap: r * kHaloW + s (0 past R*S)
};

// Paired taps (the kernels' kPaired; bf16, 3 x 3, channels 4..7 of x and w zero: the layer's
// padding of 3 or 4 channels, narrow_paired_taps). Each pixel's real half-chunk also goes, with its
// right neighbour's, into a second array of the halo (chunk i: channels 0..3 of pixels i and
// i + 1), so that one 16-byte row holds taps s = 0 and 1 of a filter row and a k16 step is the
// whole row: taps (r, 0), (r, 1) from the pairs and (r, 2) from the halo as it is (its channels
// 4..7 are zeros of x and of w). Three k steps instead of five in the forward, three products
// instead of five in backward-weight.

struct NarrowArgs : NarrowGeometry {
  const void* x;      // n x h x w x 8 bf16, or 4 fp32
  const void* w;      // 64 x r x s x 8 bf16, or 4 fp32
  const float* bias;  // 64 or null
  void* y;            // n x p x q x 64
  int relu;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies the lower 8 bytes of the pixel at `src` (zeros where `inside` is false) to the pairs
// array's chunk `at` (lower half) and, past the row's first column, to chunk at - 1's upper half.
__device__ __forceinline__ void load_pair_halves(uint4* pairs, int at, bool first_column,
                                                 const void* src, bool inside) {
  const uint32_t dst = smem_u32(pairs + at);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src),
               "r"(inside ? 8 : 0)
               : "memory");
  if (!first_column) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst - 8u), "l"(src),
                 "r"(inside ? 8 : 0)
                 : "memory");
  }
}

// Starts the copies of tile `tile`'s input halo into `halo` (kHaloH x kHaloW chunks of 16 bytes,
// row stride kHaloW; x has one 16-byte chunk a pixel), zero-filled outside the image, and with
// kPaired its pairs into the kHaloChunks after it; `threads` threads share the copies. The caller
// commits them.
template <bool kPaired>
__device__ __forceinline__ void copy_halo(const NarrowGeometry& g, const void* x, int tile,
                                          uint4* halo, int threads) {
  const int tq = tile % g.tiles_q;
  const int rest = tile / g.tiles_q;
  const int tp = rest % g.tiles_p, img = rest / g.tiles_p;
  const int h0 = tp * kTileH - g.pad_h, w0 = tq * kTileW - g.pad_w;
  const int rows = kTileH + g.r - 1, cols = kTileW + g.s - 1;
  const uint4* pixels = static_cast<const uint4*>(x);
  for (int i = threadIdx.x; i < rows * cols; i += threads) {
    const int hy = i / cols, hx = i - hy * cols;
    const int h = h0 + hy, w = w0 + hx;
    const bool inside = unsigned(h) < unsigned(g.h) && unsigned(w) < unsigned(g.w_in);
    const uint4* src = inside ? pixels + (int64_t(img) * g.h + h) * g.w_in + w : pixels;
    asm volatile(
        "cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(halo + hy * kHaloW + hx)),
        "l"(src), "r"(inside ? 16 : 0)
        : "memory");
    if constexpr (kPaired) {
      load_pair_halves(halo + kHaloChunks, hy * kHaloW + hx, hx == 0, src, inside);
    }
  }
}

// The forward's copies of a tile's halo (and pairs), as one commit group.
template <bool kPaired>
__device__ __forceinline__ void load_halo(const NarrowArgs& a, int tile, uint4* halo) {
  copy_halo<kPaired>(a, a.x, tile, halo, kThreads);
  asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// TF32: m16n8k8, fp32 bit patterns as operands (the tensor cores read their TF32 part, as the
// wgmma path's operands).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename Elem>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (sizeof(Elem) == 2) {
    mma_bf16(d, a, b0, b1);
  } else {
    mma_tf32(d, a, b0, b1);
  }
}

// Elem: bf16 (m16n8k16: a k step is two taps of 8 channels) or float (TF32, m16n8k8: two taps of 4
// channels). Either way a k step's A fragment is one ldmatrix.x4 of 16-byte pixels: for TF32 the
// b16 matrix's 8 x 8 is 8 pixels x 4 floats, and the thread's 32-bit word (row lane/4, word
// lane%4) is the fragment's element (pixel lane/4, channel lane%4).
// kPaired (bf16): three k steps, one a filter row (paired taps, above NarrowArgs).
template <typename Elem, typename Out, bool kPaired>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    narrow_forward_kernel(const NarrowArgs a) {
  kernel_entry();
  static_assert(!kPaired || sizeof(Elem) == 2, "paired taps are bf16's");
  constexpr int kCe = kChannels<Elem>;
  constexpr int kStepsUsed = kPaired ? kMaxR : kSteps;
  // Per buffer: the halo, then (kPaired) its pairs.
  constexpr int kBufferChunks = kPaired ? 2 * kHaloChunks : kHaloChunks;
  __shared__ uint4 halo[2][kBufferChunks];
  __shared__ __align__(16) Out stages[kWarps][16][kStageStride];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = warp / 2, half = warp % 2;  // output row of the tile, 32-channel half
  Out(&stage)[16][kStageStride] = stages[warp];
  const int taps = a.r * a.s;
  if (threadIdx.x < 2) halo[threadIdx.x][kHaloChunks - 1] = make_uint4(0, 0, 0, 0);

  // B fragments (col-major k x n8, n = lane/4; bf16: the thread holds k = 2*(lane%4) + {0,1}
  // (+8), TF32: k = lane%4 (+4)): b[j][t][e] = w[channel][tap 2t + e][the thread's channels] for
  // channel = 32*half + 8j + lane/4.
  // kPaired: step t is filter row t; the thread's k = 2*(lane%4) + {0,1} is tap (t, k / 4),
  // channels k % 4 (+1), and its k + 8 tap (t, 2), channels 2*(lane%4) (+1).
  uint32_t b[4][kStepsUsed][2];
  const Elem* wt = static_cast<const Elem*>(a.w);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int channel = 32 * half + 8 * j + lane / 4;
#pragma unroll
    for (int t = 0; t < kStepsUsed; ++t) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int tap, c;
        if constexpr (kPaired) {
          tap = t * kMaxS + (e == 0 ? (lane % 4) / 2 : 2);
          c = e == 0 ? 2 * (lane % 2) : 2 * (lane % 4);
        } else {
          tap = 2 * t + e;
          c = (lane % 4) * (kCe / 4);
        }
        const Elem* at = wt + (int64_t(channel) * taps + tap) * kCe + c;
        b[j][t][e] = tap < taps ? __ldg(reinterpret_cast<const unsigned int*>(at)) : 0u;
      }
    }
  }
  float bias[4][2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int channel = 32 * half + 8 * j + 2 * (lane % 4);
    bias[j][0] = a.bias ? __ldg(a.bias + channel) : 0.f;
    bias[j][1] = a.bias ? __ldg(a.bias + channel + 1) : 0.f;
  }
  // The halo offset of the pixel this lane addresses for ldmatrix, per k16 step: lanes 8i..8i+7
  // give the rows of matrix i = (pixel block (i & 1), tap 2t + (i >> 1)); -1 for a tap past R*S.
  // kPaired: matrix i's rows are the pairs of taps (t, 0..1) for i < 2, the halo's tap (t, 2) for
  // i >= 2.
  const int matrix = lane / 8;
  const int pixel = (matrix & 1) * 8 + lane % 8;  // within the 16-pixel block
  int tap_at[kStepsUsed];
#pragma unroll
  for (int t = 0; t < kStepsUsed; ++t) {
    if constexpr (kPaired) {
      tap_at[t] = (matrix >> 1) == 0 ? kHaloChunks + (row + t) * kHaloW + pixel
                                     : (row + t) * kHaloW + pixel + 2;
    } else {
      const int tap = 2 * t + (matrix >> 1);
      const int r = tap / a.s, s = tap - (tap / a.s) * a.s;
      tap_at[t] = tap < taps ? (row + r) * kHaloW + pixel + s : -1;
    }
  }

  int buffer = 0;
  if (blockIdx.x < a.tiles) load_halo<kPaired>(a, blockIdx.x, halo[0]);
  for (int tile = blockIdx.x; tile < a.tiles; tile += gridDim.x) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    // The tile's halo is complete for every thread, and every warp is past its reads of the other
    // buffer (the last tile's), which the next tile's copies may now refill.
    __syncthreads();
    const int next = tile + gridDim.x;
    if (next < a.tiles) load_halo<kPaired>(a, next, halo[buffer ^ 1]);
    const uint32_t halo_base = smem_u32(halo[buffer]);
    const int tq = tile % a.tiles_q;
    const int rest = tile / a.tiles_q;
    const int tp = rest % a.tiles_p, img = rest / a.tiles_p;
    const int pp = tp * kTileH + row;
#pragma unroll 1
    for (int block = 0; block < kTileW / 16; ++block) {
      float acc[4][4] = {};
#pragma unroll
      for (int t = 0; t < kStepsUsed; ++t) {
        const uint32_t at =
            halo_base + 16u * uint32_t(tap_at[t] >= 0 ? tap_at[t] + 16 * block : kHaloChunks - 1);
        uint32_t frag[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                     : "r"(at)
                     : "memory");
#pragma unroll
        for (int j = 0; j < 4; ++j) mma<Elem>(acc[j], frag, b[j][t][0], b[j][t][1]);
      }
      // acc[j]: pixels lane/4 (elements 0, 1) and lane/4 + 8 (2, 3) of the block, channels
      // 32*half + 8j + 2*(lane%4) + {0, 1}.
      __syncwarp();  // the warp's reads of its stage (the last block's) are done
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          float v0 = acc[j][2 * hh], v1 = acc[j][2 * hh + 1];
          if (a.bias) {
            v0 = __fadd_rn(v0, bias[j][0]);
            v1 = __fadd_rn(v1, bias[j][1]);
          }
          if (a.relu) {
            v0 = relu_keep_nan(v0);
            v1 = relu_keep_nan(v1);
          }
          Out* dst = &stage[lane / 4 + 8 * hh][8 * j + 2 * (lane % 4)];
          if constexpr (sizeof(Out) == 2) {
            *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
          } else {
            *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
          }
        }
      }
      __syncwarp();  // the warp's 16 pixels x 32 channels are staged
      // 16-byte chunks of the 16 pixels' half-rows, consecutive chunks to consecutive lanes.
      constexpr int kChunks = 32 * int(sizeof(Out)) / 16;  // per pixel's half-row
      if (pp < a.p) {
#pragma unroll
        for (int i = lane; i < 16 * kChunks; i += 32) {
          const int pixel = i / kChunks, chunk = i - pixel * kChunks;
          const int qq = tq * kTileW + 16 * block + pixel;
          if (qq >= a.q) continue;
          const uint4 v = *reinterpret_cast<const uint4*>(&stage[pixel][chunk * 16 / sizeof(Out)]);
          Out* y = static_cast<Out*>(a.y) + ((int64_t(img) * a.p + pp) * a.q + qq) * kK + 32 * half;
          reinterpret_cast<uint4*>(y)[chunk] = v;
        }
      }
    }
    buffer ^= 1;
  }
}

// ---- backward-weight ------------------------------------------------------------------------
//
// dw[k][tap][c] = sum over output pixels of dy[pixel][k] * x[pixel shifted by tap][c]: a product of
// M = 64 output channels by N = R*S*8 (one n8 tile per tap) over the pixels. A block takes the same
// 4 x 32 output tiles as the forward; per tile it copies dy's 128 x 64 (16 KB) and x's halo to
// shared memory (three stages: the copies run two tiles ahead of the products), and its 8 warps
// (warp % 4: 16 output channels, warp / 4: half of the tile's eight 16-pixel rows) run mma.sync
// with both fragments from ldmatrix.trans (the pixels, the reduction, are the rows of both
// tensors); with paired taps, two n8 tiles per filter row instead of three. dy's 16-byte chunks are
// XOR-swizzled by pixel so that the eight pixels of one ldmatrix matrix fall in different banks.
// Each block keeps its sums over all its tiles in registers and writes one partial dw; a second
// kernel adds the blocks' partials in a fixed order (deterministic), with beta. Output pixels past
// the edge of the output read dy as zeros there, so they add nothing (as the mainloop's zero fill;
// a non-finite x there would add NaN, which a training step with non-finite activations has lost
// anyway).
constexpr int kWgradThreads = 256;
constexpr int kWgradBlocksPerSm = 3;
constexpr int kWgradStages = 3;
constexpr int kTileRows = kTileH * (kTileW / 16);  // 16-pixel rows of a tile
constexpr int kDyChunks = kTileH * kTileW * 8;     // chunk j of pixel i at i * 8 + (j ^ (i & 7))
constexpr int kWgradStageChunks = kDyChunks + 2 * kHaloChunks;  // dy, the halo, its pairs
constexpr int kWgradSharedBytes = kWgradStages * kWgradStageChunks * 16;
// add_sets' scratch (4 x 10 x 4 x 32 floats) fits in the stages.
static_assert(kWgradSharedBytes >= 4 * (kMaxR * kMaxS + 1) * 4 * 32 * int(sizeof(float)));

struct NarrowWgradArgs : NarrowGeometry {
  const __nv_bfloat16* x;   // n x h x w x 8
  const __nv_bfloat16* dy;  // n x p x q x 64
  float* partial;           // [block][64][taps * 8]
};

// Adds warp set 1's accumulators to set 0's (each set summed half of a block's pixels) through
// shared memory `scratch` (free once every warp is past its last tile). True in set 0's warps,
// whose acc then holds the block's sums (set 0's + set 1's, in that order).
template <int kN>
__device__ __forceinline__ bool add_sets(float (&acc)[kN][4], float* scratch, int set, int mt,
                                         int lane) {
  __syncthreads();
  if (set == 1) {
#pragma unroll
    for (int t = 0; t < kN; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) scratch[((mt * kN + t) * 4 + e) * 32 + lane] = acc[t][e];
    }
  }
  __syncthreads();
  if (set != 0) return false;
#pragma unroll
  for (int t = 0; t < kN; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[t][e] = __fadd_rn(acc[t][e], scratch[((mt * kN + t) * 4 + e) * 32 + lane]);
    }
  }
  return true;
}

// Starts the copies of tile `tile`'s x halo and dy block into `halo` and `dys` (the caller commits
// them as one group).
template <bool kPaired>
__device__ __forceinline__ void load_wgrad_tile(const NarrowWgradArgs& a, int tile, uint4* halo,
                                                uint4* dys) {
  copy_halo<kPaired>(a, a.x, tile, halo, kWgradThreads);
  const int tq = tile % a.tiles_q;
  const int rest = tile / a.tiles_q;
  const int tp = rest % a.tiles_p, img = rest / a.tiles_p;
  for (int i = threadIdx.x; i < kTileH * kTileW * 8; i += kWgradThreads) {
    const int pixel = i / 8, chunk = i % 8;
    const int pp = tp * kTileH + pixel / kTileW, qq = tq * kTileW + pixel % kTileW;
    const bool inside = pp < a.p && qq < a.q;
    const __nv_bfloat16* src =
        inside ? a.dy + ((int64_t(img) * a.p + pp) * a.q + qq) * kK + chunk * 8 : a.dy;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     smem_u32(dys + pixel * 8 + (chunk ^ (pixel & 7)))),
                 "l"(src), "r"(inside ? 16 : 0)
                 : "memory");
  }
}

// The tiles' copies run kWgradStages - 1 tiles ahead of the products, in dynamic shared memory:
// kWgradStages stages of dy's block then x's halo.
// kPaired: per filter row one ldmatrix and two products, taps (r, 0..1) from the pairs
// and (r, 2) from the halo (paired taps, above NarrowArgs); acc[2r] then holds channels 0..3 of
// taps (r, 0) and (r, 1), acc[2r + 1] the eight of tap (r, 2).
template <bool kPaired>
__global__ void __launch_bounds__(kWgradThreads, kWgradBlocksPerSm)
    narrow_wgrad_kernel(const NarrowWgradArgs a) {
  kernel_entry();
  extern __shared__ uint4 wgrad_smem[];
  const auto dys = [](int stage) { return wgrad_smem + stage * kWgradStageChunks; };
  const auto halo = [](int stage) { return wgrad_smem + stage * kWgradStageChunks + kDyChunks; };
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mt = warp % 4, set = warp / 4;
  const int taps = a.r * a.s;
  const int matrix = lane / 8, j8 = lane % 8;
  float acc[kMaxR * kMaxS + 1][4] = {};
  // The first kWgradStages - 1 tiles' copies, a commit group each (empty past the block's tiles).
#pragma unroll
  for (int k = 0; k < kWgradStages - 1; ++k) {
    const int tile = blockIdx.x + k * gridDim.x;
    if (tile < a.tiles) load_wgrad_tile<kPaired>(a, tile, halo(k), dys(k));
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  int stage = 0;
  for (int tile = blockIdx.x; tile < a.tiles; tile += gridDim.x) {
    // The tile kWgradStages - 1 ahead into the stage the last tile read (free since the barrier
    // that ended the last iteration), then wait for this tile's group.
    const int ahead = tile + (kWgradStages - 1) * gridDim.x;
    const int refill = (stage + kWgradStages - 1) % kWgradStages;
    if (ahead < a.tiles) load_wgrad_tile<kPaired>(a, ahead, halo(refill), dys(refill));
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group %0;" ::"n"(kWgradStages - 1) : "memory");
    __syncthreads();  // the tile's copies are complete for every thread
    const uint32_t halo_base = smem_u32(halo(stage)), dy_base = smem_u32(dys(stage));
#pragma unroll 1
    for (int g = set * (kTileRows / 2); g < (set + 1) * (kTileRows / 2); ++g) {
      const int row = g / (kTileW / 16), block = g % (kTileW / 16);
      // A = dy^T (m16 x k16): matrix i holds channels 16*mt + 8*(i & 1).., pixels 8*(i >> 1)..
      const int a_pixel = row * kTileW + 16 * block + 8 * (matrix >> 1) + j8;
      const int a_chunk = 2 * mt + (matrix & 1);
      uint32_t frag[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                   : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                   : "r"(dy_base + 16u * uint32_t(a_pixel * 8 + (a_chunk ^ (a_pixel & 7))))
                   : "memory");
      // B = the taps' x (k16 x n8 per tap): matrix i holds tap 2u + (i >> 1), pixels 8*(i & 1)..
      const int b_pixel = row * kHaloW + 16 * block + 8 * (matrix & 1) + j8;
      if constexpr (kPaired) {
        // Matrices 0-1: the pairs of taps (r, 0..1); 2-3: the halo's tap (r, 2).
        const int at = (matrix >> 1) == 0 ? kHaloChunks + b_pixel : b_pixel + 2;
#pragma unroll
        for (int r = 0; r < kMaxR; ++r) {
          uint32_t bf[4];
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                       : "=r"(bf[0]), "=r"(bf[1]), "=r"(bf[2]), "=r"(bf[3])
                       : "r"(halo_base + 16u * uint32_t(at + r * kHaloW))
                       : "memory");
          mma_bf16(acc[2 * r], frag, bf[0], bf[1]);
          mma_bf16(acc[2 * r + 1], frag, bf[2], bf[3]);
        }
      } else {
#pragma unroll
        for (int u = 0; u < (kMaxR * kMaxS + 1) / 2; ++u) {
          if (2 * u >= taps) break;
          const int off = (matrix >> 1) ? a.tap_off[2 * u + 1] : a.tap_off[2 * u];
          uint32_t bf[4];
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                       : "=r"(bf[0]), "=r"(bf[1]), "=r"(bf[2]), "=r"(bf[3])
                       : "r"(halo_base + 16u * uint32_t(b_pixel + off))
                       : "memory");
          mma_bf16(acc[2 * u], frag, bf[0], bf[1]);
          if (2 * u + 1 < taps) mma_bf16(acc[2 * u + 1], frag, bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // the stage's reads are done before a later tile's copies refill it
    stage = (stage + 1) % kWgradStages;
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");  // no copy may land in add_sets' scratch
  if (add_sets(acc, reinterpret_cast<float*>(wgrad_smem), set, mt, lane)) {
    const int cols = taps * 8;
    float* out = a.partial + int64_t(blockIdx.x) * kK * cols;
    if constexpr (kPaired) {
      // acc[2r]'s column n is channel n % 4 of tap (r, n / 4), whose channels 4..7 are zeros of x;
      // acc[2r + 1]'s is channel n of tap (r, 2).
#pragma unroll
      for (int r = 0; r < kMaxR; ++r) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = 16 * mt + lane / 4 + 8 * (e >> 1), n = 2 * (lane % 4) + (e & 1);
          const int pair_at = (r * kMaxS + n / 4) * 8 + n % 4;
          out[m * cols + pair_at] = acc[2 * r][e];
          out[m * cols + pair_at + 4] = 0.f;
          out[m * cols + (r * kMaxS + 2) * 8 + n] = acc[2 * r + 1][e];
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < kMaxR * kMaxS + 1; ++t) {
        if (t >= taps) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = acc[t][e];
          const int m = 16 * mt + lane / 4 + 8 * (e >> 1), n = t * 8 + 2 * (lane % 4) + (e & 1);
          out[m * cols + n] = v;
        }
      }
    }
  }
}

// dw[m][tap][c] = beta * dw + the blocks' partials, for the c < channels of each tap's `padded`
// partial columns. A warp per element: lane l adds up the partials of blocks l, l + 32, ... in
// that order, and the 32 lane sums meet in a fixed butterfly (deterministic; beta 0: dw is not
// read). A thread per element, summing the 2-3 partials per SM one after the other, took 23 us at
// 224^2: a chain of dependent loads.
__global__ void narrow_wgrad_sum_kernel(const float* __restrict__ partial, int blocks, int taps,
                                        int channels, int padded, float beta,
                                        float* __restrict__ dw) {
  kernel_entry();
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int i = static_cast<int>(thread / 32), lane = static_cast<int>(thread % 32);
  if (i >= kK * taps * channels) return;  // whole warps: i is the same across a warp
  const int m = i / (taps * channels), rest = i - m * taps * channels;
  const int tap = rest / channels, c = rest - tap * channels;
  const int size = kK * taps * padded, at = (m * taps + tap) * padded + c;
  float sum = 0.f;
  for (int b = lane; b < blocks; b += 32) sum = __fadd_rn(sum, partial[int64_t(b) * size + at]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
  }
  if (lane == 0) dw[i] = beta == 0.f ? sum : __fmaf_rn(beta, dw[i], sum);
}

// Backward-weight in TF32 (m16n8k8): fp32 x of 1 to 4 channels (each pixel's channels copied to a
// 16-byte halo slot, zero past C) and fp32 dy; tiles of 4 x 32 output pixels (dy's 128 x 64 floats
// are 32 KB). A k8 step is 8 pixels; an n8 tile is two taps of 4 channels. TF32 fragments are
// 32-bit words, which ldmatrix.trans cannot transpose, so both come by 32-bit shared loads: dy's
// 16-byte chunks are XOR-swizzled by (pixel % 4) so that the 4 pixels x 8 channels of a load fall
// in 32 different banks.
constexpr int kTf32TileH = 4;

struct NarrowWgradTf32Args : NarrowGeometry {
  const float* x;   // n x h x w x c (c <= 4)
  const float* dy;  // n x p x q x 64
  float* partial;   // [block][64][taps * 4]
  int c;
};

__global__ void __launch_bounds__(kWgradThreads, kWgradBlocksPerSm)
    narrow_wgrad_tf32_kernel(const NarrowWgradTf32Args a) {
  kernel_entry();
  constexpr int kPixels = kTf32TileH * kTileW;
  constexpr int kTiles = (kMaxR * kMaxS + 1) / 2;  // n8 tiles: two taps each
  __shared__ float4 halo[(kTf32TileH + kMaxR - 1) * kHaloW];
  __shared__ float4 dys[kPixels * 16];  // chunk j of pixel i at i * 16 + (j ^ ((i & 3) << 1))
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int mt = warp % 4, set = warp / 4;
  const int g = lane / 4, t = lane % 4;
  const int taps = a.r * a.s;
  float acc[kTiles][4] = {};
  for (int tile = blockIdx.x; tile < a.tiles; tile += gridDim.x) {
    const int tq = tile % a.tiles_q;
    const int rest = tile / a.tiles_q;
    const int tp = rest % a.tiles_p, img = rest / a.tiles_p;
    __syncthreads();  // the last tile's reads are done
    const int h0 = tp * kTf32TileH - a.pad_h, w0 = tq * kTileW - a.pad_w;
    const int rows = kTf32TileH + a.r - 1, cols = kTileW + a.s - 1;
    for (int i = threadIdx.x; i < rows * cols * 4; i += kWgradThreads) {
      const int slot = i / 4, c = i % 4;
      const int hy = slot / cols, hx = slot - hy * cols;
      const int h = h0 + hy, w = w0 + hx;
      const bool inside = c < a.c && unsigned(h) < unsigned(a.h) && unsigned(w) < unsigned(a.w_in);
      const float* src = inside ? a.x + ((int64_t(img) * a.h + h) * a.w_in + w) * a.c + c : a.x;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(
                       smem_u32(reinterpret_cast<float*>(halo + hy * kHaloW + hx) + c)),
                   "l"(src), "r"(inside ? 4 : 0)
                   : "memory");
    }
    for (int i = threadIdx.x; i < kPixels * 16; i += kWgradThreads) {
      const int pixel = i / 16, chunk = i % 16;
      const int pp = tp * kTf32TileH + pixel / kTileW, qq = tq * kTileW + pixel % kTileW;
      const bool inside = pp < a.p && qq < a.q;
      const float* src =
          inside ? a.dy + ((int64_t(img) * a.p + pp) * a.q + qq) * kK + chunk * 4 : a.dy;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                       smem_u32(dys + pixel * 16 + (chunk ^ ((pixel & 3) << 1)))),
                   "l"(src), "r"(inside ? 16 : 0)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    const float* dyf = reinterpret_cast<const float*>(dys);
    const float* hf = reinterpret_cast<const float*>(halo);
#pragma unroll 1
    for (int grp = set * (kPixels / 16); grp < (set + 1) * (kPixels / 16); ++grp) {
      const int row = grp / (kTileW / 8), q8 = (grp % (kTileW / 8)) * 8;
      // A = dy^T (m16 x k8): a0 (channel g, pixel t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t +
      // 4).
      uint32_t frag[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pixel = row * kTileW + q8 + t + 4 * (e >> 1);
        const int ch = 16 * mt + g + 8 * (e & 1);
        const int chunk = (ch / 4) ^ ((pixel & 3) << 1);
        frag[e] = __float_as_uint(dyf[pixel * 64 + chunk * 4 + ch % 4]);
      }
      // B (k8 x n8 per pair of taps): b0 (pixel t, tap 2u + g/4, channel g%4), b1 (pixel t + 4).
      const int b_pixel = row * kHaloW + q8 + t;
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        if (2 * u >= taps) break;
        const int tap = 2 * u + g / 4;
        const bool real = tap < taps;
        const int at = (b_pixel + (g / 4 ? a.tap_off[2 * u + 1] : a.tap_off[2 * u])) * 4 + g % 4;
        const uint32_t b0 = real ? __float_as_uint(hf[at]) : 0u;
        const uint32_t b1 = real ? __float_as_uint(hf[at + 16]) : 0u;  // 4 pixels further
        mma_tf32(acc[u], frag, b0, b1);
      }
    }
  }
  if (add_sets(acc, reinterpret_cast<float*>(dys), set, mt, lane)) {
    const int cols = taps * 4;
    float* out = a.partial + int64_t(blockIdx.x) * kK * cols;
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // C fragment: rows g (+8 for e >= 2), columns 2t + (e & 1) of tile u: tap 2u + col / 4.
        const int m = 16 * mt + g + 8 * (e >> 1), col = 2 * t + (e & 1);
        const int n = (2 * u + col / 4) * 4 + col % 4;
        if (n < cols) {
          out[m * cols + n] = acc[u][e];
        }
      }
    }
  }
}

int sm_count() {
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  return multiprocessor_count(device);
}

NarrowGeometry narrow_geometry(const Conv2dShape& s, int tile_h, const char* what) {
  NarrowGeometry g;
  g.n = s.n;
  g.h = s.h;
  g.w_in = s.w;
  g.p = s.p();
  g.q = s.q();
  g.r = s.r;
  g.s = s.s;
  g.pad_h = s.pad_h;
  g.pad_w = s.pad_w;
  for (int t = 0; t <= kMaxR * kMaxS; ++t) {
    g.tap_off[t] = t < s.r * s.s ? (t / s.s) * kHaloW + t % s.s : 0;
  }
  g.tiles_q = (g.q + kTileW - 1) / kTileW;
  g.tiles_p = (g.p + tile_h - 1) / tile_h;
  const int64_t tiles = int64_t(g.tiles_q) * g.tiles_p * s.n;
  CUDP_CHECK(tiles <= (int64_t(1) << 30), what, ": ", tiles,
             " tiles are too many for one launch; split the batch");
  g.tiles = static_cast<int>(tiles);
  return g;
}

// Runs a backward-weight kernel on a.tiles tiles (kWgradBlocksPerSm blocks per SM at most, one
// partial each) and sums the partials into dw (`padded` columns per tap in a partial, of which the
// first `channels` are dw's), with `shared_bytes` of dynamic shared memory a block.
template <typename Args>
void run_wgrad(const char* name, void (*kernel)(Args), Args a, int padded, int channels, float beta,
               float* dw, int shared_bytes, cudaStream_t stream) {
  const int blocks = std::min(a.tiles, kWgradBlocksPerSm * sm_count());
  const int taps = a.r * a.s;
  Workspace partial(size_t(blocks) * size_t(kK) * size_t(taps * padded) * sizeof(float), stream,
                    "the first layer's backward-weight partial sums");
  a.partial = partial.get();
  if (shared_bytes > 0)
    sm90::allow_shared_memory(reinterpret_cast<const void*>(kernel), shared_bytes);
  launch(name, kernel, blocks, kWgradThreads, shared_bytes, stream, a);
  launch("narrow_wgrad_sum_kernel", narrow_wgrad_sum_kernel,
         grid_for(int64_t(kK) * taps * channels * 32, 256), 256, 0, stream, partial.get(), blocks,
         taps, channels, padded, beta, dw);
}

// The shape every narrow kernel takes, whatever its channels: 64 output channels, a filter of at
// most kMaxR x kMaxS, stride 1.
bool narrow_shape(const Conv2dShape& s) {
  return s.k == kK && s.r <= kMaxR && s.s <= kMaxS && s.stride_h == 1 && s.stride_w == 1;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

bool narrow_paired_taps(const Conv2dShape& s, int live_channels) {
  return s.c == kC && live_channels > 0 && live_channels <= kC / 2 && s.r == kMaxR && s.s == kMaxS;
}

bool narrow_forward_applies(const Conv2dShape& s, const ConvOperands& ops) {
  const bool channels = ops.math == Math::BF16   ? s.c == kChannels<__nv_bfloat16>
                        : ops.math == Math::TF32 ? s.c == kChannels<float>
                                                 : false;
  return channels && narrow_shape(s) && ops.mask == nullptr && aligned16(ops.x) &&
         aligned16(ops.w) && aligned16(ops.y);
}

void conv2d_forward_narrow(const Conv2dShape& s, const ConvOperands& ops, cudaStream_t stream) {
  CUDP_CHECK(narrow_forward_applies(s, ops),
             "conv2d_forward_narrow: needs bf16 operands with C = 8 or TF32 with C = 4, K = 64, a "
             "filter of at most 3 x 3, stride 1, no mask and 16-byte aligned tensors");
  NarrowArgs a;
  static_cast<NarrowGeometry&>(a) = narrow_geometry(s, kTileH, "conv2d_forward_narrow");
  a.x = ops.x;
  a.w = ops.w;
  a.bias = ops.bias;
  a.y = ops.y;
  a.relu = ops.relu ? 1 : 0;
  // TF32's C of 4 never pairs: narrow_paired_taps asks for 8 bf16 channels.
  const bool paired = narrow_paired_taps(s, ops.live_channels);
  const unsigned grid = static_cast<unsigned>(std::min(a.tiles, kBlocksPerSm * sm_count()));
  const bool bf16_out = ops.y_type == DType::BF16;
  using Bf16 = __nv_bfloat16;
  if (paired) {
    launch("narrow_forward_kernel",
           bf16_out ? narrow_forward_kernel<Bf16, Bf16, true>
                    : narrow_forward_kernel<Bf16, float, true>,
           grid, kThreads, 0, stream, a);
  } else if (ops.math == Math::BF16) {
    launch("narrow_forward_kernel",
           bf16_out ? narrow_forward_kernel<Bf16, Bf16, false>
                    : narrow_forward_kernel<Bf16, float, false>,
           grid, kThreads, 0, stream, a);
  } else {
    launch("narrow_forward_kernel",
           bf16_out ? narrow_forward_kernel<float, Bf16, false>
                    : narrow_forward_kernel<float, float, false>,
           grid, kThreads, 0, stream, a);
  }
}

bool narrow_wgrad_applies(const Conv2dShape& s, const void* x, const void* dy) {
  return s.c == kC && narrow_shape(s) && aligned16(x) && aligned16(dy);
}

void conv2d_backward_weight_narrow(const Conv2dShape& s, const void* x, const void* dy, float* dw,
                                   float beta, cudaStream_t stream, int live_channels) {
  CUDP_CHECK(narrow_wgrad_applies(s, x, dy) && dw != nullptr,
             "conv2d_backward_weight_narrow: needs bf16 x with C = 8 and dy with K = 64, a filter "
             "of at most 3 x 3, stride 1 and 16-byte aligned tensors");
  NarrowWgradArgs a;
  static_cast<NarrowGeometry&>(a) = narrow_geometry(s, kTileH, "conv2d_backward_weight_narrow");
  a.x = static_cast<const __nv_bfloat16*>(x);
  a.dy = static_cast<const __nv_bfloat16*>(dy);
  run_wgrad(
      "narrow_wgrad_kernel",
      narrow_paired_taps(s, live_channels) ? narrow_wgrad_kernel<true> : narrow_wgrad_kernel<false>,
      a, kC, kC, beta, dw, kWgradSharedBytes, stream);
}

bool narrow_wgrad_tf32_applies(const Conv2dShape& s, const float* dy) {
  return s.c <= kChannels<float> && narrow_shape(s) && aligned16(dy);
}

void conv2d_backward_weight_narrow_tf32(const Conv2dShape& s, const float* x, const float* dy,
                                        float* dw, float beta, cudaStream_t stream) {
  CUDP_CHECK(narrow_wgrad_tf32_applies(s, dy) && x && dy && dw,
             "conv2d_backward_weight_narrow_tf32: needs fp32 x with at most 4 channels, dy with K "
             "= 64 (16-byte aligned), a filter of at most 3 x 3 and stride 1");
  NarrowWgradTf32Args a;
  static_cast<NarrowGeometry&>(a) =
      narrow_geometry(s, kTf32TileH, "conv2d_backward_weight_narrow_tf32");
  a.x = x;
  a.dy = dy;
  a.c = s.c;
  run_wgrad("narrow_wgrad_tf32_kernel", narrow_wgrad_tf32_kernel, a, kChannels<float>, s.c, beta,
            dw, 0, stream);
}

}  // namespace cudp::kernels::detail
