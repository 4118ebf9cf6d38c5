// Host entry points of the sm_90a tensor-core kernels (kernels/sm90/*.cu, built for sm_90a only).
// kernels/matmul.cu calls them after validating the problem and choosing the plan; nothing else
// should. Each precision's entry points live in a translation unit of their own
// (matmul_sm90_bf16.cu, _tf32.cu), the kernels they launch in several more (matmul_sm90.cuh).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/matmul.h"

namespace cudp::kernels::sm90 {

// The implicit-GEMM view of a convolution (kernels/conv2d.h): A is im2col(x), m = n*P*Q output
// pixels by k = R*S*C, gathered by the producer warpgroup; B is the K x RSC weight matrix.
// kConvTma's tiling of the output pixels: a tile is a patch of wb x hb x nb pixels (q, p, n; the
// product is the tile's 128 rows); tiles_q * tiles_p * tiles_n patches cover the output. wb = 0
// means rows are not patches (every other mode).
struct PatchTiles {
  int wb = 0, hb = 0, nb = 0;
  int tiles_q = 0, tiles_p = 0, tiles_n = 0;
  int q = 0, p = 0, n = 0;  // output extent
  int s = 0, pad_h = 0, pad_w = 0, c_blocks = 0;  // filter width, padding, C / k-block
  int r = 0;  // filter height (kWgradTma: taps past R*S are not loaded from x)
  // kWgradShift: the width of the padded pixel grid both K-major copies are laid out on (a
  // multiple of 4); filter row r is the shift r * grid_w along it, and x^T holds one copy of x per
  // filter column s, shifted by s (grid_w 0 for an explicit im2col copy, whose taps are rows).
  int grid_w = 0;
  // kConvTma / kConvTmaBT (bf16): whether the filters may be kept whole in shared memory when they
  // fit (one tile column of few k-blocks: VGG's 64-channel layers), read from there by every tile
  // instead of streamed with each k-block. Off only to compare the two (tests, bench_conv2d).
  bool filters_resident = true;
  // kWgradTma / kWgradTmaT with split-K: the work items split-major (the blocks running at one time
  // share a k-range of pixels, so x and dy come from memory about once) rather than tile-major
  // (each running block streams its own k-range). The same items either way, so the same bits.
  bool split_major = true;
  // kConvTma / kConvTmaBT (bf16) with a C of 64 channels: the operands' roles swapped (the filters
  // as wgmma's A, the tile's 128 pixels as its N), where conv_swapped_applies. Off only to compare
  // the two (tests, bench_conv2d --swap).
  bool swapped = true;
  // Halo tiles (set by halo_tiles, where conv_halo_applies): the swapped kernels of a 3 x 3, C = 64
  // layer load each tile's input patch once with its border (one TMA box of (wb + 2) x (hb + 2)
  // pixels, wb = 8, hb = 16, nb = 1) and read the nine taps as views of it shifted by whole pixels,
  // instead of nine boxes (a ninth of the traffic from L2). The tiling's own wb x hb x nb is then
  // the output patch.
  bool halo = false;
};

// Halo tiles' geometry (kConvHaloSwap, kConvHaloBTSwap): output patches of 8 x 16 pixels, the input
// box over them 10 x 18 (3 x 3 filters), 128 bytes (64 bf16 channels) a pixel.
constexpr int kHaloTileW = 8, kHaloTileH = 16;
constexpr int kHaloPitch = kHaloTileW + 2;  // pixels from one row of the input box to the next
constexpr int kHaloRows = kHaloTileH + 2;

struct ConvGather {
  const void* x;  // NHWC, in the math's operand type; C a multiple of 16 bytes' worth
  int n, h, w, c, p, q, r, s;
  int stride_h, stride_w, pad_h, pad_w;
};

// Enqueues the mainloop for `plan`; with plan.splits > 1 it writes fp32 partial tiles to
// `workspace` ([split][m][n]) and, where plan.sum_in_kernel, adds them up into C itself;
// otherwise the caller runs the split-K reduction.
void matmul_bf16(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream);
void matmul_tf32(const MatmulProblem& problem, const MatmulPlan& plan, float* workspace,
                 cudaStream_t stream);

// The convolution on the same mainloop: `problem` is the GEMM view (m = n*P*Q, n = K, k = R*S*C,
// B = the weights, C = y as an (n*P*Q) x K matrix); A comes from `conv` instead of problem.a.
void conv_bf16(const MatmulProblem& problem, const ConvGather& conv, const MatmulPlan& plan,
               float* workspace, cudaStream_t stream);
void conv_tf32(const MatmulProblem& problem, const ConvGather& conv, const MatmulPlan& plan,
               float* workspace, cudaStream_t stream);

// The forward convolution with A by 4-D TMA boxes (stride 1, C a multiple of the k-block).
// `unrotated` (backward-data's view): problem.b is the forward's K x R*S*C filters, read per tap
// rotated by 180 degrees (kConvTmaBT), not the rotated C x R*S*K copy. bf16 filters of one tile
// column and at most 18 (tile width 64) or 9 (128) k-blocks stay resident in shared memory
// (patch.filters_resident): the stages then carry x alone, a third less traffic from L2 for a
// 64-channel layer, whose 128 x 64 tiles read 9 boxes of x and 9 of filters each. Swapped tiles
// (conv_swapped_applies) keep 32 KB for their output: 9 k-blocks resident at most, 10-18 streamed.
// Whether backward-data's column sums (MatmulProblem::column_sums) can be taken in the epilogue of
// conv_tma_bf16 or conv_tma_tf32 under `plan`: a ReLU mask, whole tiles, no split-K (the one rule
// of the launchers' checks and kernels/matmul.cu's choice).
inline bool column_sums_in_epilogue(const MatmulProblem& p, const MatmulPlan& plan) {
  return p.mask != nullptr && plan.splits == 1 && p.n % plan.tile_n == 0 && p.ldc % 2 == 0 &&
         p.beta == 0.f;
}

// Whether conv_tma_bf16 runs `problem` under `plan` with the operands' roles swapped
// (kConvTmaSwap / kConvTmaBTSwap: a C of 64 bf16 channels written whole, no split-K, beta 0, C and
// the mask 16-byte aligned for their TMA maps). Its column sums then come as one row of partial
// sums per tile instead of 8.
inline bool conv_swapped_applies(const MatmulProblem& p, const MatmulPlan& plan,
                                 const PatchTiles& t) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return t.swapped && p.math == Math::BF16 && p.n == 64 && plan.tile_n == 64 && plan.splits == 1 &&
         p.beta == 0.f && p.ldc == 64 && p.c_type == DType::BF16 && t.wb * t.hb * t.nb == 128 &&
         aligned(p.c) && (p.mask == nullptr || (aligned(p.mask) && p.bias == nullptr && !p.relu));
}

// Whether the swapped tiles of `problem` could read their taps from halo tiles (PatchTiles::halo):
// the swapped kernels with the filters resident (9 k-blocks: one block of 64 reduction channels,
// 3 x 3 taps, so a tile's whole input is one box), unit padding at most 2, and an output at least
// one halo tile wide and tall (smaller ones would load mostly padding). `t` is the tiling the
// launch would otherwise take; halo_tiles gives the one it takes instead.
inline bool conv_halo_applies(const MatmulProblem& p, const MatmulPlan& plan, const PatchTiles& t) {
  return t.filters_resident && conv_swapped_applies(p, plan, t) && t.c_blocks == 1 && t.r == 3 &&
         t.s == 3 && t.pad_h <= 2 && t.pad_w <= 2 && t.q >= kHaloTileW && t.p >= kHaloTileH &&
         p.k == 9 * 64;
}

// The wide layers' halo tilings (conv_halo_kernel: two rings, the input box of a channel block held
// while its 9 filter k-blocks stream): `tall`, patches of 8 x 16 pixels of one image (input boxes
// of 10 x 18), or `pairs`, patches of 8 x 8 pixels over two images (boxes of 10 x 10 x 2: each
// 64-row half of a tile is one image's 8 x 8), for outputs whose height is a multiple of 8 but not
// of 16 (VGG's 56 x 56).
enum class HaloTiling { none, tall, pairs };

// Which of them the wide kernels give `problem`: bf16, 3 x 3 filters over whole blocks of 64
// channels, padding up to 2, tiles 128 or 256 wide without split-K, and an output the patches tile
// exactly: `tall` where 8 x 16 patches do (VGG's 224, 112, 32 and 16 wide layers), `pairs` (if
// asked for) where 8 x 8 patches of image pairs do. With `covering`, also `tall` patches hanging
// over the output's edges where they cover at least 7/8 of it: by measurement
// (bench/NOTES-tensor-cores.md) the idle eighth at 56 x 56 costs more than the halo saves, so only
// the tests ask for it. For layers whose filters are not resident (resident_filter_blocks: the
// caller's check).
inline HaloTiling conv_halo_wide_tiling(const MatmulProblem& p, const MatmulPlan& plan,
                                        const PatchTiles& t, bool pairs, bool covering) {
  const bool applies = p.math == Math::BF16 && (plan.tile_n == 128 || plan.tile_n == 256) &&
                       plan.splits == 1 && t.r == 3 && t.s == 3 && t.pad_h <= 2 && t.pad_w <= 2 &&
                       t.c_blocks >= 1 && p.k == 9 * 64 * t.c_blocks && t.q >= kHaloTileW &&
                       !conv_swapped_applies(p, plan, t);
  if (!applies) return HaloTiling::none;
  if (t.q % kHaloTileW == 0 && t.p % kHaloTileH == 0) return HaloTiling::tall;
  if (pairs && t.q % kHaloTileW == 0 && t.p % 8 == 0 && t.n % 2 == 0) return HaloTiling::pairs;
  const int64_t covered = int64_t((t.q + kHaloTileW - 1) / kHaloTileW * kHaloTileW) *
                          ((t.p + kHaloTileH - 1) / kHaloTileH * kHaloTileH);
  if (covering && t.p >= kHaloTileH && 8 * int64_t(t.q) * t.p >= 7 * covered) {
    return HaloTiling::tall;
  }
  return HaloTiling::none;
}

// The halo tiling of the output `t` covers: patches of kHaloTileW x kHaloTileH pixels of one image,
// or (`pairs`) of 8 x 8 pixels over two images.
inline PatchTiles halo_tiles(const PatchTiles& t, bool pairs = false) {
  PatchTiles h = t;
  h.wb = kHaloTileW;
  h.hb = pairs ? 8 : kHaloTileH;
  h.nb = pairs ? 2 : 1;
  h.tiles_q = (t.q + h.wb - 1) / h.wb;
  h.tiles_p = (t.p + h.hb - 1) / h.hb;
  h.tiles_n = (t.n + h.nb - 1) / h.nb;
  h.halo = true;
  return h;
}

// column_partials: (see MainloopParams) or null.
void conv_tma_bf16(const MatmulProblem& problem, const ConvGather& conv, const PatchTiles& patch,
                   const MatmulPlan& plan, float* workspace, cudaStream_t stream,
                   bool unrotated = false, float* column_partials = nullptr);
// The k-blocks of resident filters conv_tma_bf16 gives `problem` under `plan` and `patch` (the
// capacity of the kernel it takes: 9 or 18), or 0 where they are streamed.
int resident_filter_blocks(const MatmulProblem& problem, const MatmulPlan& plan,
                           const PatchTiles& patch);
// column_partials: as conv_tma_bf16's.
void conv_tma_tf32(const MatmulProblem& problem, const ConvGather& conv, const PatchTiles& patch,
                   const MatmulPlan& plan, float* workspace, cudaStream_t stream,
                   float* column_partials = nullptr);

// Backward-weight (bf16): problem is dw = dy^T im2col(x) (m = K, n = R*S*C, k = n*P*Q, A = dy
// with lda = K); `alt` selects the other assignment of the MN-major descriptor offsets. With
// `patch` (stride 1, C a multiple of 64) both operands come by 4-D TMA boxes over patches of 64
// output pixels instead (kWgradTma): problem.k is then patches * 64. `transposed` (with `patch`)
// runs dw^T = im2col(x)^T dy instead: m = R*S*C, n = K, B = dy with ldb = K, C = dw^T.
// `bias_partials` (with `patch` only, or null): the bias gradient taken on the way, as
// plan.splits x K fp32 sums of dy over each split's pixels (the caller adds up the splits).
void conv_wgrad_bf16(const MatmulProblem& problem, const ConvGather& conv, const MatmulPlan& plan,
                     float* workspace, cudaStream_t stream, bool alt,
                     const PatchTiles* patch = nullptr, bool transposed = false,
                     float* bias_partials = nullptr);

// Backward-weight in TF32 (kWgradShift): both operands are K-major fp32 copies laid out on one
// padded pixel grid (kernels/conv2d_tc.cu): dy^T (K rows) and x^T (patch.s copies of
// patch.c_blocks * 64 rows, copy s shifted by s; tap (r, s) of row c at column offset
// r * patch.grid_w in copy s). Not `transposed`: dw = dy^T x^T'
// (problem.a = dy^T, problem.b = x^T, m = K, n = R*S*C'); `transposed`: dw^T (problem.a = x^T,
// problem.b = dy^T, m = R*S*C', n = K). problem.k is the grid's length.
void conv_wgrad_tf32(const MatmulProblem& problem, const PatchTiles& patch, const MatmulPlan& plan,
                     float* workspace, cudaStream_t stream, bool transposed);
// Backward-weight in TF32 by patch boxes (kWgradTma / kWgradTmaT with fp32 operands): as
// conv_wgrad_bf16's patch feed, over patches of 32 output pixels and boxes of 32 channels, each box
// transposed in place in shared memory to the K-major layout TF32 wgmma reads; no copies.
void conv_wgrad_tf32_patch(const MatmulProblem& problem, const ConvGather& conv,
                           const PatchTiles& patch, const MatmulPlan& plan, float* workspace,
                           cudaStream_t stream, bool transposed);

// Lets `kernel` take `bytes` of dynamic shared memory on the current device (once per kernel and
// device; above 48 KB a kernel must ask).
void allow_shared_memory(const void* kernel, int bytes);

}  // namespace cudp::kernels::sm90
