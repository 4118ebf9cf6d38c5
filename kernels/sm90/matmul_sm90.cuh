// The Hopper tensor-core mainloop (sm_90a): C = epilogue(A * B^T), A m x k and B n x k K-major.
//
// Structure (one thread block per SM, persistent):
// - Warpgroup 0 is the producer: one thread walks the block's tiles and issues TMA loads of A and
//   B k-blocks (128 bytes of k per row, 128-byte swizzle, zero fill past the matrix edges) into a
//   ring of kStages shared-memory stages. Each stage has a "full" mbarrier (the TMA completes its
//   transaction bytes on it) and an "empty" one (the consumers arrive when they no longer read it).
//   (TF32 backward-weight by patch boxes: the TMA completes on a "loaded" barrier, and warps 1-3
//   transpose the stage in place before they arrive on "full"; transpose_stages.) The producer
//   gives most of its registers back (setmaxnreg) to the consumers.
// - Warpgroups 1 and 2 are consumers: each owns 64 rows of the 128-row tile and issues
//   wgmma m64nNk{16,8} straight from shared memory, keeping one wgmma group in flight: a stage is
//   released as soon as the group after it has been issued and the one reading it has completed.
// - While the consumers run a tile's epilogue (registers -> global, with alpha, beta, bias, ReLU
// and
//   the cast), the producer already loads the next tile's first stages.
// - Tiles are visited in groups of kGroupM tile rows, so that the blocks running at one time share
//   A rows and B columns in L2. With split-K a work item is (tile, split); partial sums go to a
//   workspace, and the last split of each tile's rows to arrive adds them up and applies the
//   epilogue (or, with plan.sum_in_kernel off, kernels/matmul.cu's reduction kernel does).
//
// Phases: a stage's barriers flip parity each time the ring wraps; the producer waits on "empty"
// with the opposite parity so that its first pass through a fresh ring does not wait.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "engine/core/error.h"
#include "engine/core/launch.cuh"
#include "kernels/conv2d_dense.h"
#include "kernels/counters.h"
#include "kernels/matmul.h"
#include "kernels/matmul_epilogue.cuh"
#include "kernels/sm90/matmul_sm90.h"
#include "kernels/sm90/wgmma.cuh"

namespace cudp::kernels::sm90 {

constexpr int kTileM = 128;        // two consumer warpgroups of 64 rows
constexpr int kRowBytes = 128;     // one k-block row: the 128-byte swizzle span
constexpr int kGroupM = 8;         // tile rows per L2 group
constexpr int kConsumers = 2;      // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kSharedBudget = 227 * 1024;

// What the kernel needs besides the two tensor maps.
struct MainloopParams {
  int m, n, k;
  int tiles_m, tiles_n, splits;
  int k_blocks;             // k blocks in all
  int k_blocks_per_split;
  // Epilogue (splits == 1) or the workspace (splits > 1: fp32, [split][m][n]).
  void* c;
  int64_t ldc;
  int c_is_bf16;
  EpilogueArgs epilogue;
  float* workspace;
  PatchTiles patch;  // kConvTma: how a tile of 128 rows maps to output pixels
  // Work items in split-major order: the blocks running at one time take the same k-range of
  // different tiles, so the operand they share (dy^T for backward-weight) is read from memory once
  // per k-range, not once per tile.
  int split_major;
  // kWgradTma / kWgradTmaT in bf16: the bias gradient taken on the way, or null (wgrad_bias_sums):
  // [split][bias_channels] fp32 sums of dy over each split's output pixels.
  float* bias_partials;
  int bias_channels;
  // kConvTma / kConvTmaBT with a ReLU mask (backward-data), or null: the column sums of the stored
  // C taken on the way, one row of n floats per 16 tile rows (a warp's): row
  // (tile_m * 2 + half) * 4 + warp, the tile's columns of it (store_whole_tile). Added up in row
  // order afterwards (bias_grad): C's column sums, deterministic. kConvTmaSwap / kConvTmaBTSwap:
  // one row of the 64 columns per tile, row tile_m (store_swapped_tile).
  float* column_partials;
  // Split-K with the sum in the kernel (MatmulPlan::sum_in_kernel), or null (kernels/matmul.cu's
  // reduction kernel runs after): one arrival counter per warp slice (16 rows) of every tile, zero
  // before the launch and left zero after it (kernels/counters.h).
  int* split_counters;
  // kGemm / kGemmBT: B's dense 2 x 2 view (MatmulProblem::b_dense_k), or 0: dense_2x2_box.
  int b_dense_k, b_dense_c;
};

// kResidentB > 0 (kConvTma, kConvTmaBT with one tile column): B is not streamed through the stages
// but loaded whole, once per block, into kResidentB k-blocks of its own shared memory that every
// tile then reads (the filters of a layer with few channels); the stages hold A alone.
// kStagingBytes (kConvTmaSwap, kConvTmaBTSwap): each consumer warpgroup's buffer for its tile of C
// on the way out (store_swapped_tile), after the resident B.
// kStageBytesA_: a stage's A (kConvHaloSwap, kConvHaloBTSwap: a halo tile's input box, padded to
// the 1024-byte swizzle atom; a k-block of A otherwise).
template <typename Elem, int kTileN, int kResidentB = 0, int kStagingBytes = 0,
          int kStageBytesA_ = kTileM* kRowBytes>
struct Config {
  static constexpr int kBlockK = kRowBytes / int(sizeof(Elem));  // 64 bf16 or 32 fp32
  static constexpr int kBlockBytesB = kTileN * kRowBytes;        // one k-block of B
  static constexpr int kStageBytesA = kStageBytesA_;
  static constexpr int kStageBytesB = kResidentB > 0 ? 0 : kBlockBytesB;
  static constexpr int kStageBytes = kStageBytesA + kStageBytesB;
  static constexpr int kResidentBytes = kResidentB * kBlockBytesB;
  static constexpr int kStagingOffset = kResidentBytes;  // from the resident B's start
  static constexpr int kStaging = kStagingBytes;
  static constexpr int kStages =
      (kSharedBudget - 4096 - kResidentBytes - kStagingBytes) / kStageBytes;
  // After the stages, the resident B and the staging: the barriers (up to 256 bytes), then 256
  // bytes of scratch for backward-weight's bias sums (wgrad_bias_sums).
  static constexpr int kScratchOffset = 256;
  static constexpr int kSharedBytes = kStages * kStageBytes + kResidentBytes + kStagingBytes +
                                      1024 /* alignment */ + kScratchOffset + 256;
  static constexpr int kAccumulators = kTileN / 2;  // fp32 per thread for m64nN
  static_assert(kStages >= 3, "too few pipeline stages");
  static_assert(kStagingBytes == 0 || (kStages * kStageBytes + kResidentBytes) % 1024 == 0,
                "the staging of C must start on a 128-byte swizzle atom (1024 bytes)");
  static_assert(16 * kStages + 8 <= kScratchOffset, "the barriers overrun the scratch");
  static_assert(kStageBytesA % 1024 == 0, "stages must start on a 128-byte swizzle atom");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// A shared-memory matrix descriptor for a K-major operand in 128-byte-swizzled 8-row atoms:
// start address, leading-byte offset 16 (unused by this layout), stride-byte offset 1024 (from one
// 8-row atom to the next), swizzle mode 1 (128 B).
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t addr, uint32_t leading = 16,
                                                    uint32_t stride = 1024) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(leading >> 4) << 16) |
         (uint64_t(stride >> 4) << 32) | (uint64_t(1) << 62);
}

// What feeds A and B:
//   kGemm   A and B by TMA, both K-major;
//   kConv_  A gathered as im2col by the producer warpgroup (forward, backward-data), B by TMA;
//   kWgrad  backward-weight: A = dy^T by TMA and B = im2col(x)^T gathered, both MN-major (the
//           reduction runs over output pixels, which are the rows of both tensors); bf16 only.
// kWgradAlt swaps the two byte offsets of the MN-major descriptors (see wgrad_descriptor).
//   kConvTma forward/backward-data of stride-1 layers whose C is a multiple of the k-block: a
//   tile's
//           128 rows are a patch of wb x hb x nb output pixels, and each k-block of A (one tap,
//           one block of channels) is one 4-D TMA box of x shifted by the tap; the padding is
//           TMA's zero fill. One producer thread, as for kGemm.
//   kWgradTma backward-weight of stride-1 layers with C a multiple of 64, without the gather: a
//           k-block is a patch of wb x hb x nb = 64 output pixels; A (dy) is two 4-D TMA boxes of
//           dy over the patch (64 output channels each), and each 64-column slab of B (one tap, 64
//           channels) one box of x over the patch shifted by the tap. A box lands as 64 rows of
//           128 bytes, 128-byte swizzled: the MN-major slab layout kWgrad's gather writes. Patches
//           that hang over the output's edge read zeros of dy there, so they add nothing.
//   kWgradTmaT the same with the roles swapped, for layers of 64 or fewer output channels (a
//           128-row tile of them would be half empty): A = im2col(x)^T, B = dy^T, C = dw^T.
//           With fp32 operands (TF32) both modes take patches of 32 pixels and boxes of 32
//           channels, and the producer's warps 1-3 transpose each landed box in place to the
//           K-major layout TF32 wgmma reads (transpose_stages); the consumers are kGemm's.
//   kWgradShift backward-weight in TF32 on K-major copies (layers the boxes do not take: TF32
//           wgmma reads K-major operands only): the reduction runs along K-major fp32 copies of
//           dy (dy^T, K rows) and x (x^T, C rows), both laid out
//           on one zero-padded pixel grid (kernels/conv2d_tc.cu), where tap (r, s) of a filter is a
//           shift of r * grid_w + s along the grid. x^T holds S copies of x, copy s already
//           shifted by s (TMA needs 16-byte aligned boxes; grid_w is a multiple of 4). A is dy^T
//           by 2-D TMA; each 64-row slab of B (one tap, 64 channels) is a 2-D box of copy s of
//           x^T at the k-block's columns plus r * grid_w. A grid position that is not an output
//           pixel holds zeros in dy^T, so what x^T holds at its shift adds nothing. kWgradShiftT
//           swaps the roles (C = dw^T) as kWgradTmaT does. K-major, so the consumers are kGemm's.
//   kGemmBT  kGemm with B stored k x n: each k-block of B is kTileN / 64 TMA boxes of 64 rows (k)
//           x 128 bytes (64 columns), the MN-major slab layout of backward-weight's operands, read
//           by wgmma with B's transpose bit (a Linear layer's backward-data, dx = dy W, reads W as
//           it is stored instead of a transposed copy). In TF32 (no transpose bit) the boxes are
//           32 x 32 and the producer's warps 1-3 transpose them in place (transpose_stages), as
//           for TF32 backward-weight's B; the consumers are kGemm's.
//   kGemmTT  kGemmBT with A stored k x m too (bf16 only): A's k-block is two such boxes (64 rows
//           each), and the consumers are backward-weight's (both operands MN-major; a Linear
//           layer's backward-weight, dW = dy^T x, reads dy and x as they are stored).
//   kConvTmaBT kConvTma's backward-data (bf16) on the forward's own filters instead of a rotated
//           copy: B is the K x R*S*C filter matrix, and k-block (tap rs, channel block cb) of the
//           view reads its 64 rows cb of tap R*S - 1 - rs (the 180-degree rotation) as kTileN / 64
//           MN-major boxes, as kGemmBT does. (A tile's last boxes may reach into the next tap's
//           columns: those are output columns past n, never stored.)
//   kConvTmaSwap, kConvTmaBTSwap: kConvTma and kConvTmaBT for a C of 64 channels (VGG's 64-channel
//           layers: the forward of 64 -> 64, backward-data into 64 channels), with the operands'
//           roles swapped: the 64 filter rows are wgmma's A (M = 64) and the tile's 128 pixels its
//           B (N = 128), so one m64n128k16 instead of two m64n64k16 reads the 128 x 64 tile's
//           k16 step from shared memory: 6 KB per 64 clocks of tensor work instead of 8 KB (an
//           m64n64k16 needs 4 KB per 32 clocks: all of shared memory's 128 bytes a clock, which is
//           what held these layers at ~0.7x the others' rate). The stages are kConvTma's as they
//           are (the filter box is A, K-major or, for backward-data, MN-major with A's transpose
//           bit; the patch box is B, K-major). The accumulators then hold C transposed (channels x
//           pixels), so the epilogue goes through shared memory (store_swapped_tile): stmatrix
//           with .trans writes the tile as the NHWC rows it is, and one TMA store writes it out
//           (the patch's pixels past the output's edge are clipped by the tensor map). A ReLU
//           mask is loaded into the same buffer by TMA while the mainloop runs, and read with
//           ldmatrix .trans in the accumulators' layout.
//   kConvHaloSwap, kConvHaloBTSwap: the swapped modes on halo tiles (PatchTiles::halo: 3 x 3
//           filters, one block of 64 reduction channels, filters resident). A tile is a patch of
//           8 x 16 output pixels of one image, and its stage holds the input over the patch with
//           its border, one 4-D TMA box of 10 x 18 pixels (kHaloPitch x kHaloRows rows of 128
//           bytes, 128-byte swizzled), loaded once instead of nine shifted boxes. Tap (r, s)'s B
//           operand is a view of it: pixel (x, y) of the patch at box row (y + r) * 10 + x + s, so
//           each 8-pixel row of the patch is 8 consecutive box rows (one core-matrix group) and
//           the groups are 10 rows apart: the descriptor starts at row r * 10 + s with a stride
//           byte offset of 1,280 (halo_descriptor). The consumers run the tile's 9 taps x 4 k16
//           steps from that one stage; the epilogue is the swapped modes'.
enum Mode : int {
  kGemm = 0,
  kConv_ = 1,
  kWgrad = 2,
  kWgradAlt = 3,
  kConvTma = 4,
  kWgradTma = 5,
  kWgradTmaT = 6,
  kWgradShift = 7,
  kWgradShiftT = 8,
  kGemmBT = 9,
  kGemmTT = 10,
  kConvTmaBT = 11,
  kConvTmaSwap = 12,
  kConvTmaBTSwap = 13,
  kConvHaloSwap = 14,
  kConvHaloBTSwap = 15
};

// The B descriptor of a halo tile's tap view (kConvHaloSwap): K-major, 128-byte swizzled, 8-row
// groups kHaloPitch rows apart. The view starts at any whole row of the box; the swizzle is a
// function of the address bits (bench/probes/wgmma_shift.cu measured it on the H200), so the base
// offset stays 0.
__device__ __forceinline__ uint64_t halo_descriptor(uint32_t addr) {
  return smem_descriptor(addr, 16, kHaloPitch * kRowBytes);
}

// A halo tile's input box and its stage (padded to the 1024-byte swizzle atom).
constexpr int kHaloBoxBytes = kHaloPitch * kHaloRows * kRowBytes;
constexpr int kHaloStageBytes = (kHaloBoxBytes + 1023) / 1024 * 1024;

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the accumulators in registers across the asynchronous wgmma (the compiler must not move
// reads or writes of them across the fence/wait points).
template <int kCount>
__device__ __forceinline__ void keep_in_registers(float* acc) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// Named barriers 1 and 2 (0 is __syncthreads) pass the mainloop turn between the two consumer
// warpgroups of the ping-pong schedule: one warpgroup arrives, the other waits, 256 threads in all.
__device__ __forceinline__ void turn_arrive(int id) {
  asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void turn_wait(int id) {
  asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}

template <typename Elem, int kTileN>
struct Mma;
template <int kTileN>
struct Mma<__nv_bfloat16, kTileN> : WgmmaBf16<kTileN> {};
template <int kTileN>
struct Mma<float, kTileN> : WgmmaTf32<kTileN> {};

// B's dense 2 x 2 view (MatmulProblem::b_dense_k): the box at W_eff's (row, column) is the box at
// the filters' (row - p K, column + (tap(p, q) - q) C), p = row / K, q = column / C: W_eff's row
// p K + k and column q C + c hold W[k][tap(p, q)][c] (kernels/conv2d_dense.h). A box lies in one
// (p, q) block: its rows (kTileN or a k-block) divide K (a multiple of 256), its 64 columns C.
__device__ __forceinline__ void dense_2x2_box(const MainloopParams& p, int& row, int& column) {
  const int pp = row / p.b_dense_k, q = column / p.b_dense_c;
  const int tap = dense_2x2_tap(pp, q);
  row -= pp * p.b_dense_k;
  column += (tap - q) * p.b_dense_c;
}

struct WorkItem {
  int tile_m, tile_n, split;
};

__device__ __forceinline__ WorkItem work_item(const MainloopParams& p, int index) {
  const int tiles = p.tiles_m * p.tiles_n;
  const int tile = p.split_major ? index % tiles : index / p.splits;
  const int split = p.split_major ? index / tiles : index - tile * p.splits;
  const int per_group = kGroupM * p.tiles_n;
  const int group = tile / per_group;
  const int first_m = group * kGroupM;
  const int group_rows = min(p.tiles_m - first_m, kGroupM);
  const int in_group = tile - group * per_group;
  return {first_m + in_group % group_rows, in_group / group_rows, split};
}

// The bias gradient of backward-weight on the way (kWgradTma / kWgradTmaT with p.bias_partials):
// warps 2 and 3 of the producer warpgroup, idle otherwise, go through the stages with the
// consumers (waiting on "full", arriving on "empty") and, for the work items of the first tile
// column (kWgradTma: dy is A, its 128 rows the output channels) or row (kWgradTmaT: dy is B, 64
// channels wide), add up the dy boxes each stage holds: box b is 64 pixels (rows of 128 bytes,
// 128-byte swizzled) of 64 channels. Each lane sums the 16-byte chunk lane % 8 (8 channels) of
// every 4th (two boxes: one per warp) or 8th row (one box: the two warps take alternate row
// groups) of a box, so a quarter warp reads one whole row (no bank conflicts) and a lane keeps 8
// sums (the producer warpgroup has 40 registers a thread). At the end of an item the row groups are
// added in a fixed order, within a warp by shuffles (and, for one box, warp 2's sums plus warp 3's
// through shared memory), and written to p.bias_partials[split][channel]; the caller sums the
// splits in order. An item's sums depend on its k-range alone: deterministic, and the product's
// bits are untouched.
template <int kMode, int kTileN, int kStages, int kOperandStageBytes>
__device__ __forceinline__ void wgrad_bias_sums(const MainloopParams& p, uint32_t operand,
                                                uint32_t full, uint32_t empty, uint32_t scratch) {
  constexpr int kBoxes = kMode == kWgradTma ? 2 : kTileN / 64;
  static_assert(kBoxes == 1 || kBoxes == 2, "bias sums of 64 or 128 channels a tile");
  constexpr int kGroups = 8 / kBoxes;      // row groups of a box: lanes of one chunk
  const int lane = int(threadIdx.x) - 64;  // 0..63 over warps 2 and 3
  const int chunk = lane & 7;
  const int box = kBoxes == 2 ? lane >> 5 : 0;
  const int group = (lane >> 3) & (kGroups - 1);
  // Row group + kGroups * i sits at swizzle phase (group + kGroups * i) % 8: two phases with four
  // groups (i even, odd), one with eight.
  const uint32_t offset0 = box * 64 * kRowBytes + group * kRowBytes + ((chunk ^ group) << 4);
  const uint32_t offset1 =
      box * 64 * kRowBytes + (group + 4) * kRowBytes + ((chunk ^ (group + 4)) << 4);
  const int work_items = p.tiles_m * p.tiles_n * p.splits;
  int stage = 0, phase = 0;
  for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
    const WorkItem w = work_item(p, index);
    const int kb_begin = w.split * p.k_blocks_per_split;
    const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
    const bool sums = (kMode == kWgradTma ? w.tile_n : w.tile_m) == 0;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      mbar_wait(full + 8 * stage, phase);
      if (sums) {
        const uint32_t base = operand + stage * kOperandStageBytes;
#pragma unroll 2
        for (int i = 0; i < 64 / kGroups; ++i) {
          // Rows 8 apart share a phase: row group + kGroups * i is 8 * (i / 2) rows past the
          // phase's first (four groups), or 8 * i (eight).
          const uint32_t at = kGroups == 4
                                  ? ((i & 1) ? offset1 : offset0) + (i >> 1) * 8 * kRowBytes
                                  : offset0 + i * 8 * kRowBytes;
          uint32_t v[4];
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                       : "r"(base + at)
                       : "memory");
#pragma unroll
          for (int h = 0; h < 4; ++h) {  // a bf16's bits are the high half of its fp32's
            acc[2 * h] += __uint_as_float(v[h] << 16);
            acc[2 * h + 1] += __uint_as_float(v[h] & 0xFFFF0000u);
          }
        }
      }
      __syncwarp();
      if (lane % 32 == 0) mbar_arrive(empty + 8 * stage);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    if (!sums) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      acc[e] += __shfl_xor_sync(0xFFFFFFFFu, acc[e], 8);
      acc[e] += __shfl_xor_sync(0xFFFFFFFFu, acc[e], 16);
    }
    // Lanes 0..7 of each warp now hold its row groups' sums of chunk `chunk`.
    const int channel0 =
        (kMode == kWgradTma ? w.tile_m * kTileM : w.tile_n * kTileN) + 64 * box + 8 * chunk;
    float* out = p.bias_partials + int64_t(w.split) * p.bias_channels + channel0;
    if constexpr (kBoxes == 2) {
      if (lane % 32 < 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (channel0 + e < p.bias_channels) out[e] = acc[e];
        }
      }
    } else {
      if (lane >= 32 && lane < 40) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          asm volatile("st.shared.f32 [%0], %1;" ::"r"(scratch + 4 * (chunk * 8 + e)), "f"(acc[e])
                       : "memory");
        }
      }
      asm volatile("bar.sync 3, 64;" ::: "memory");
      if (lane < 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float other;
          asm volatile("ld.shared.f32 %0, [%1];"
                       : "=f"(other)
                       : "r"(scratch + 4 * (chunk * 8 + e))
                       : "memory");
          if (channel0 + e < p.bias_channels) out[e] = acc[e] + other;
        }
      }
      asm volatile("bar.sync 3, 64;" ::: "memory");  // the scratch is read before it is rewritten
    }
  }
}

// The row of C (an output pixel, in n, p, q order) that row `local` of patch tile `tile` holds, or
// -1 when the patch hangs over the edge of the output.
__device__ __forceinline__ int patch_row(const PatchTiles& t, int tile, int local) {
  const int tq = tile % t.tiles_q;
  const int rest = tile / t.tiles_q;
  const int tp = rest % t.tiles_p, tn = rest / t.tiles_p;
  const int q = tq * t.wb + local % t.wb;
  const int pp = tp * t.hb + (local / t.wb) % t.hb;
  const int n = tn * t.nb + local / (t.wb * t.hb);
  if (q >= t.q || pp >= t.p || n >= t.n) return -1;
  return (n * t.p + pp) * t.q + q;
}

// Calls store(row, col, a0, a1) for each pair of adjacent accumulators a thread holds whose row is
// in C (rows[h] >= 0) and whose first column is below n. Thread t of a warpgroup holds rows
// warp*16 + lane/4 (+8) and column pairs 8j + 2*(lane%4) (+1): d[4j + 2h + e] is (row + 8h,
// col + e).
template <int kTileN, typename Store>
__device__ __forceinline__ void for_each_pair(const float* acc, const int (&rows)[2], int base_col,
                                              int n, Store store) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rows[h] < 0) continue;
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
      const int col = base_col + 8 * j;
      if (col < n) store(rows[h], col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

// The epilogue of a tile whose every column is below n, with beta 0 and an even ldc: the forward
// and backward-data tiles of a training step. The thread's bias values are read once, before any
// store, and its pairs are stored with no load, bounds check or branch between them: the general
// path below spent ~1,270 instructions per warp and tile on 16 pairs (ncu, L2's bf16 forward at
// 224^2), more than the tile's 9 k-blocks of wgmma, and both consumer warpgroups wait on it. The
// arithmetic is apply_epilogue's, step for step, so the two paths give the same bits.
//
// kBeta (fp32 C, beta != 0: Linear's weight gradients accumulated into .grad, and backward-weight
// without split-K) reads C's old values the same way as the mask below. Each element is read once,
// by the thread that then writes it, so the read-only path sees C as it was before the kernel.
// Halves the values a lane holds kMask lanes apart: each keeps one half (the upper where its lane
// has the kMask bit) plus the partner's same half, in v[0, kN / 2).
template <int kN, int kMask>
__device__ __forceinline__ void fold_halves(float* v) {
  const bool upper = (threadIdx.x & kMask) != 0;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    const float send = upper ? v[i] : v[i + kN / 2];
    const float keep = upper ? v[i + kN / 2] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
  }
}

// The column sums of a warp's 16 rows (store_whole_tile's kSums): the lane's kTileN / 4 column
// sums over its two rows, added across the 8 lanes that hold the same columns (lane % 4) by
// halving three times (each lane ends with the sums of kTileN / 32 columns, 7 shuffles a column
// pair instead of 24), and stored as one row of partial sums at `row` (the tile's column 0).
template <int kTileN>
__device__ __forceinline__ void store_column_sums(float (&sums)[kTileN / 4], float* row) {
  constexpr int kN = kTileN / 4;
  fold_halves<kN, 16>(sums);
  fold_halves<kN / 2, 8>(sums);
  fold_halves<kN / 4, 4>(sums);
  const int lane = threadIdx.x % 32;
  // Value index v = (lane / 4) * kN / 8 + i of the thread's original ones: column pair j = v / 2,
  // at 8 * j + 2 * (lane % 4).
#pragma unroll
  for (int i = 0; i < kN / 8; i += 2) {
    const int j = ((lane / 4) * (kN / 8) + i) / 2;
    *reinterpret_cast<float2*>(row + 8 * j + 2 * (lane % 4)) = make_float2(sums[i], sums[i + 1]);
  }
}

template <int kTileN, bool kBias, bool kRelu, bool kMask, bool kBeta, typename Out,
          bool kSums = false>
__device__ __forceinline__ void store_whole_tile(const MainloopParams& p, const float* acc,
                                                 const int (&rows)[2], int base_col,
                                                 float* sums_row = nullptr) {
  constexpr bool kBf16 = std::is_same_v<Out, __nv_bfloat16>;
  static_assert(!kSums || (kMask && !kBeta), "column sums: backward-data's masked tiles");
  [[maybe_unused]] float sums[kTileN / 4];
  if constexpr (kSums) {
#pragma unroll
    for (int i = 0; i < kTileN / 4; ++i) sums[i] = 0.f;
  }
  static_assert(!kBeta || !kBf16, "beta != 0 whole tiles are fp32");
  // The mask's pairs (and the old values) are loaded kChunk at a time ahead of their stores,
  // through the read-only path (which the stores cannot alias, so nothing orders the loads after
  // them): loaded pair by pair, each store waited on its load; L2's backward-data took 1.6x as
  // long, and VGG's classifier backward-weight at batch 64 (all epilogue) ran at a quarter of the
  // memory bandwidth.
  constexpr int kMaxChunk = kBeta ? 8 : 16;
  constexpr int kChunk = kTileN / 8 < kMaxChunk ? kTileN / 8 : kMaxChunk;
  [[maybe_unused]] const float beta = p.epilogue.beta;
  const float alpha = p.epilogue.alpha;
  float bias[kTileN / 4];
  if constexpr (kBias) {
#pragma unroll
    for (int j = 0; j < kTileN / 8; ++j) {
      bias[2 * j] = bias_of(p.epilogue, base_col + 8 * j);
      bias[2 * j + 1] = bias_of(p.epilogue, base_col + 8 * j + 1);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rows[h] < 0) continue;
    const int64_t row_at = int64_t(rows[h]) * p.ldc + base_col;
    Out* dst = static_cast<Out*>(p.c) + row_at;
#pragma unroll
    for (int j0 = 0; j0 < kTileN / 8; j0 += kChunk) {
      uint32_t mask[kChunk];  // bf16: the pair's bits; fp32: bit e set where element e is masked
      float2 old[kChunk];
      if constexpr (kBeta) {
#pragma unroll
        for (int t = 0; t < kChunk; ++t) {
          old[t] = __ldg(reinterpret_cast<const float2*>(dst + 8 * (j0 + t)));
        }
      }
      if constexpr (kMask) {
#pragma unroll
        for (int t = 0; t < kChunk; ++t) {
          const Out* m = static_cast<const Out*>(p.epilogue.mask) + row_at + 8 * (j0 + t);
          if constexpr (kBf16) {
            mask[t] = __ldg(reinterpret_cast<const unsigned int*>(m));
          } else {
            const float2 f = __ldg(reinterpret_cast<const float2*>(m));
            mask[t] = uint32_t(f.x <= 0.f) | uint32_t(f.y <= 0.f) << 1;
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kChunk; ++t) {
        const int j = j0 + t;
        float v0 = __fmul_rn(alpha, acc[4 * j + 2 * h]);
        float v1 = __fmul_rn(alpha, acc[4 * j + 2 * h + 1]);
        if constexpr (kBeta) {
          v0 = __fmaf_rn(beta, old[t].x, v0);
          v1 = __fmaf_rn(beta, old[t].y, v1);
        }
        if constexpr (kBias) {
          v0 = __fadd_rn(v0, bias[2 * j]);
          v1 = __fadd_rn(v1, bias[2 * j + 1]);
        }
        if constexpr (kRelu) {
          v0 = relu_keep_nan(v0);
          v1 = relu_keep_nan(v1);
        }
        if constexpr (kMask) {
          if constexpr (kBf16) {
            __nv_bfloat162 pair;
            memcpy(&pair, &mask[t], sizeof(pair));
            v0 = __low2float(pair) <= 0.f ? 0.f : v0;  // relu_grad's select
            v1 = __high2float(pair) <= 0.f ? 0.f : v1;
          } else {
            v0 = (mask[t] & 1u) ? 0.f : v0;
            v1 = (mask[t] & 2u) ? 0.f : v1;
          }
        }
        if constexpr (kBf16) {
          const __nv_bfloat162 out = __floats2bfloat162_rn(v0, v1);
          *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = out;
          if constexpr (kSums) {  // what is stored
            sums[2 * j] += __low2float(out);
            sums[2 * j + 1] += __high2float(out);
          }
        } else {
          *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(v0, v1);
          if constexpr (kSums) {
            sums[2 * j] += v0;
            sums[2 * j + 1] += v1;
          }
        }
      }
    }
  }
  if constexpr (kSums) store_column_sums<kTileN>(sums, sums_row);
}

template <int kTileN, typename Out>
__device__ __forceinline__ void store_whole_tile(const MainloopParams& p, const float* acc,
                                                 const int (&rows)[2], int base_col,
                                                 float* sums_row) {
  const bool bias = p.epilogue.bias != nullptr, relu = p.epilogue.relu != 0;
  if (p.epilogue.mask != nullptr && sums_row != nullptr) {  // backward-data, column sums on the way
    store_whole_tile<kTileN, false, false, true, false, Out, true>(p, acc, rows, base_col,
                                                                   sums_row);
  } else if (p.epilogue.mask != nullptr) {  // backward-data: never with a bias or a ReLU
    store_whole_tile<kTileN, false, false, true, false, Out>(p, acc, rows, base_col);
  } else if (bias && relu) {
    store_whole_tile<kTileN, true, true, false, false, Out>(p, acc, rows, base_col);
  } else if (bias) {
    store_whole_tile<kTileN, true, false, false, false, Out>(p, acc, rows, base_col);
  } else if (relu) {
    store_whole_tile<kTileN, false, true, false, false, Out>(p, acc, rows, base_col);
  } else {
    store_whole_tile<kTileN, false, false, false, false, Out>(p, acc, rows, base_col);
  }
}

// Split-K in the kernel: whether this warp's slice of the tile (16 rows, every column) is the last
// of its p.splits to reach the workspace. Each lane's slice stores are made visible to the GPU
// before lane 0 counts the slice in, and the last to count sees every other split's stores (the
// fence after the count). atomicInc wraps: the last count (old == splits - 1) leaves the counter
// zero for the next product.
__device__ __forceinline__ bool last_split_slice(const MainloopParams& p, int unit) {
  __threadfence();
  __syncwarp();
  int last = 0;
  if (threadIdx.x % 32 == 0) {
    const unsigned top = unsigned(p.splits - 1);
    last = atomicInc(reinterpret_cast<unsigned*>(p.split_counters) + unit, top) == top;
  }
  last = __shfl_sync(0xFFFFFFFFu, last, 0);
  if (last) {
    __threadfence();
    __syncwarp();  // every lane's loads of the other slices after lane 0's count and fence
  }
  return last != 0;
}

// The sums over the splits of the lane's elements into sum, in split order from 0.f (the reduction
// kernel's order, so the same bits), read past L1 (other blocks wrote them during this launch).
// for_each_pair's loop written out: with the accumulator index passed through a lambda, ptxas put
// the 256-wide kernels' accumulators in local memory (~1.4 KB of spills a thread).
template <int kTileN>
__device__ __forceinline__ void sum_splits(const MainloopParams& p, const int (&rows)[2],
                                           int base_col, float* sum) {
  const int n = p.n;
  const bool vec = n % 2 == 0;
#pragma unroll
  for (int i = 0; i < kTileN / 2; ++i) sum[i] = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float* ws = p.workspace + int64_t(s) * p.m * n;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rows[h] < 0) continue;
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
        const int col = base_col + 8 * j;
        if (col >= n) continue;
        const float* src = ws + int64_t(rows[h]) * n + col;
        if (vec && col + 1 < n) {
          const float2 v = __ldcg(reinterpret_cast<const float2*>(src));
          sum[4 * j + 2 * h] += v.x;
          sum[4 * j + 2 * h + 1] += v.y;
        } else {
          sum[4 * j + 2 * h] += __ldcg(src);
          if (col + 1 < n) sum[4 * j + 2 * h + 1] += __ldcg(src + 1);
        }
      }
    }
  }
}

// Writes one consumer warpgroup's 64 x kTileN accumulators: the final C (one split) or the
// split's slice of the workspace, and then, with the sum in the kernel, C from the sum of every
// split's slice where this warp's slice is the last of its rows to arrive (acc is overwritten with
// it). Rows are tile-local (local0 = the warpgroup's first) and mapped to C's rows here (patch
// tiles or plain blocks). The output path is chosen once, before the unrolled loop, so that each
// path's code is compact: the three paths interleaved in one unrolled loop made the epilogue ~140
// KB of straight-line code and cost a third of a 4096^3 product's time (the instruction cache;
// bench/NOTES-tensor-cores.md).
template <int kTileN, bool kPatch>
__device__ __forceinline__ void store_tile(const MainloopParams& p, float* acc, int tile_m,
                                           int local0, int col0, int split) {
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x % 128) / 32;
  const int local_row = local0 + warp * 16 + lane / 4;
  const int base_col = col0 + 2 * (lane % 4);
  int rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int row = tile_m * kTileM + local_row + 8 * h;
    if constexpr (kPatch) row = patch_row(p.patch, tile_m, local_row + 8 * h);
    rows[h] = row < p.m ? row : -1;
  }
  const int n = p.n;
  if (p.splits > 1) {
    float* ws = p.workspace + int64_t(split) * p.m * p.n;
    const bool vec = n % 2 == 0;
    for_each_pair<kTileN>(acc, rows, base_col, n, [&](int row, int col, float a0, float a1) {
      float* dst = ws + int64_t(row) * n + col;
      if (vec && col + 1 < n) {
        *reinterpret_cast<float2*>(dst) = make_float2(a0, a1);
      } else {
        dst[0] = a0;
        if (col + 1 < n) dst[1] = a1;
      }
    });
    if (p.split_counters == nullptr) return;
    // The slice's unit: its tile, then its 16 rows (local0 / 16 + warp: 0..7).
    const int unit = ((tile_m * p.tiles_n) + col0 / kTileN) * (kTileM / 16) + local0 / 16 + warp;
    if (!last_split_slice(p, unit)) return;
    sum_splits<kTileN>(p, rows, base_col, acc);  // and on to C, as one split's products go
  }
  const EpilogueArgs& e = p.epilogue;
  const bool vec = p.ldc % 2 == 0;
  if (e.beta == 0.f && vec && col0 + kTileN <= n) {
    // The warp's row of column partials (the host asks for them on whole tiles only).
    float* sums_row = nullptr;
    if (kPatch && p.column_partials != nullptr) {
      const int warp_row = (tile_m * 2 + local0 / 64) * 4 + (threadIdx.x % 128) / 32;
      sums_row = p.column_partials + int64_t(warp_row) * n + col0;
    }
    if (p.c_is_bf16) {
      store_whole_tile<kTileN, __nv_bfloat16>(p, acc, rows, base_col, sums_row);
    } else {
      store_whole_tile<kTileN, float>(p, acc, rows, base_col, sums_row);
    }
    return;
  }
  if (vec && col0 + kTileN <= n && !p.c_is_bf16 && e.bias == nullptr && !e.relu &&
      e.mask == nullptr) {  // C += A * B^T (beta != 0)
    store_whole_tile<kTileN, false, false, false, true, float>(p, acc, rows, base_col);
    return;
  }
  if (p.c_is_bf16) {
    __nv_bfloat16* c = static_cast<__nv_bfloat16*>(p.c);
    for_each_pair<kTileN>(acc, rows, base_col, n, [&](int row, int col, float a0, float a1) {
      const int64_t at = int64_t(row) * p.ldc + col;
      __nv_bfloat16* dst = c + at;
      const bool pair = col + 1 < n;
      float v0 = apply_epilogue(e, a0, e.beta != 0.f ? __bfloat162float(dst[0]) : 0.f, col);
      if (e.mask != nullptr) v0 = apply_mask(e, v0, at, true);
      if (!pair) {
        dst[0] = __float2bfloat16_rn(v0);
        return;
      }
      float v1 = apply_epilogue(e, a1, e.beta != 0.f ? __bfloat162float(dst[1]) : 0.f, col + 1);
      if (e.mask != nullptr) v1 = apply_mask(e, v1, at + 1, true);
      if (vec) {
        *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
      } else {
        dst[0] = __float2bfloat16_rn(v0);
        dst[1] = __float2bfloat16_rn(v1);
      }
    });
    return;
  }
  float* c = static_cast<float*>(p.c);
  for_each_pair<kTileN>(acc, rows, base_col, n, [&](int row, int col, float a0, float a1) {
    const int64_t at = int64_t(row) * p.ldc + col;
    float* dst = c + at;
    const bool pair = col + 1 < n;
    float v0 = apply_epilogue(e, a0, e.beta != 0.f ? dst[0] : 0.f, col);
    if (e.mask != nullptr) v0 = apply_mask(e, v0, at, false);
    if (!pair) {
      dst[0] = v0;
      return;
    }
    float v1 = apply_epilogue(e, a1, e.beta != 0.f ? dst[1] : 0.f, col + 1);
    if (e.mask != nullptr) v1 = apply_mask(e, v1, at + 1, false);
    if (vec) {
      *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    } else {
      dst[0] = v0;
      dst[1] = v1;
    }
  });
}

// ---- the swapped tiles' epilogue (kConvTmaSwap, kConvTmaBTSwap) ----------------------------

constexpr int kSwapTileBytes = kTileM * kRowBytes;  // a tile of C: 128 pixels x 64 bf16 channels

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1,
                                             int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until this thread's bulk stores have read their shared memory (kRead), or are complete.
template <bool kRead>
__device__ __forceinline__ void bulk_store_wait() {
  if constexpr (kRead) {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

// Named barrier `id` over one warpgroup's 128 threads.
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&v)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&v)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr)
               : "memory");
}

// Where patch tile `tile` starts in the output: (q, p, n).
struct PatchOrigin {
  int q, p, n;
};
__device__ __forceinline__ PatchOrigin patch_origin(const PatchTiles& t, int tile) {
  const int rest = tile / t.tiles_q;
  return {(tile - rest * t.tiles_q) * t.wb, (rest % t.tiles_p) * t.hb, (rest / t.tiles_p) * t.nb};
}

// One consumer warpgroup's swapped tile: acc holds C^T, 64 channels (rows) x 128 pixels (columns),
// in m64n128's layout (thread t of warp w: channels 16w + t/4 (+8), pixel pairs 8j + 2(t%4)).
// Each 8 x 8 block of it (8 channels x 8 pixels: one register of bf16 pairs a thread) is what
// stmatrix takes; with .trans it is stored as 8 rows of one pixel's 8 channels, i.e. as NHWC. So
// the tile goes to `staging` in the layout of a TMA box of C over the patch (pixel rows of 128
// bytes, 128-byte swizzled: chunk c of row r at c ^ (r % 8)), and one TMA store writes it. Lane l
// gives the address of row l % 8 of block l / 8 of each x4 (blocks: channel half h = (l / 8) & 1,
// pixel octet (l / 8) >> 1 of the 16 pixels), conflict-free: one block's rows sit at 8 different
// chunk positions. With a mask (backward-data), its box was loaded into `staging` by TMA (on
// mask_bar) while the mainloop ran, and ldmatrix .trans reads it back in the accumulators' layout;
// each warp reads and then overwrites its own blocks only. The arithmetic is store_whole_tile's,
// step for step, so every value is rounded as the unswapped kernels round it. kSums: the column
// sums of C (sums of each channel over the tile's stored values) as one row of 64 partial sums a
// tile (the patch's pixels past the output's edge have mask 0, hence add 0).
template <bool kBias, bool kRelu, bool kMask, bool kSums>
__device__ __forceinline__ void store_swapped_tile(const MainloopParams& p, const float* acc,
                                                   uint32_t staging, const CUtensorMap* map_c,
                                                   uint32_t mask_bar, int mask_phase, int tile,
                                                   int barrier) {
  static_assert(!kSums || kMask, "column sums: backward-data's masked tiles");
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x % 128) / 32;
  const bool leader = threadIdx.x % 128 == 0;
  const int channel = warp * 16 + lane / 4;  // and channel + 8
  if constexpr (kMask) {
    mbar_wait(mask_bar, mask_phase);  // its load waited for the last store's reads
  } else {
    if (leader) bulk_store_wait<true>();  // the last tile's store has read the buffer
    warpgroup_sync(barrier);
  }
  const float alpha = p.epilogue.alpha;
  [[maybe_unused]] float bias[2];
  if constexpr (kBias) {
    bias[0] = bias_of(p.epilogue, channel);
    bias[1] = bias_of(p.epilogue, channel + 8);
  }
  [[maybe_unused]] float sums[2] = {0.f, 0.f};
  const int block = lane / 8;
  const uint32_t row = (block >> 1) * 8 + (lane & 7);  // the pixel, within 16
  const uint32_t chunk = uint32_t(warp * 2 + (block & 1));
  const uint32_t addr0 = staging + row * kRowBytes + ((chunk ^ (lane & 7)) << 4);
#pragma unroll
  for (int g = 0; g < kTileM / 16; ++g) {  // 16 pixels: j = 2g, 2g + 1
    const uint32_t addr = addr0 + g * 16 * kRowBytes;
    [[maybe_unused]] uint32_t mask[4];
    if constexpr (kMask) ldmatrix_x4_trans(mask, addr);
    uint32_t out[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int h = b & 1, j = 2 * g + (b >> 1);
      float v0 = __fmul_rn(alpha, acc[4 * j + 2 * h]);
      float v1 = __fmul_rn(alpha, acc[4 * j + 2 * h + 1]);
      if constexpr (kBias) {
        v0 = __fadd_rn(v0, bias[h]);
        v1 = __fadd_rn(v1, bias[h]);
      }
      if constexpr (kRelu) {
        v0 = relu_keep_nan(v0);
        v1 = relu_keep_nan(v1);
      }
      if constexpr (kMask) {
        __nv_bfloat162 pair;
        memcpy(&pair, &mask[b], sizeof(pair));
        v0 = __low2float(pair) <= 0.f ? 0.f : v0;  // relu_grad's select
        v1 = __high2float(pair) <= 0.f ? 0.f : v1;
      }
      const __nv_bfloat162 stored = __floats2bfloat162_rn(v0, v1);
      if constexpr (kSums) sums[h] += __low2float(stored) + __high2float(stored);
      memcpy(&out[b], &stored, sizeof(stored));
    }
    stmatrix_x4_trans(addr, out);
  }
  // The TMA store reads shared memory through the async proxy: what stmatrix wrote must be visible
  // to it before the store is issued.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  warpgroup_sync(barrier);
  if (leader) {
    const PatchOrigin o = patch_origin(p.patch, tile);
    tma_store_4d(map_c, staging, 0, o.q, o.p, o.n);
  }
  if constexpr (kSums) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sums[h] += __shfl_xor_sync(0xffffffffu, sums[h], 1);
      sums[h] += __shfl_xor_sync(0xffffffffu, sums[h], 2);
    }
    if (lane % 4 == 0) {
      float* out = p.column_partials + int64_t(tile) * p.n;
      out[channel] = sums[0];
      out[channel + 8] = sums[1];
    }
  }
}

// store_swapped_tile with the epilogue's options chosen once per tile.
__device__ __forceinline__ void store_swapped(const MainloopParams& p, const float* acc,
                                              uint32_t staging, const CUtensorMap* map_c,
                                              uint32_t mask_bar, int mask_phase, int tile,
                                              int barrier) {
  const bool bias = p.epilogue.bias != nullptr, relu = p.epilogue.relu != 0;
  if (p.epilogue.mask != nullptr && p.column_partials != nullptr) {
    store_swapped_tile<false, false, true, true>(p, acc, staging, map_c, mask_bar, mask_phase, tile,
                                                 barrier);
  } else if (p.epilogue.mask != nullptr) {  // backward-data: never with a bias or a ReLU
    store_swapped_tile<false, false, true, false>(p, acc, staging, map_c, mask_bar, mask_phase,
                                                  tile, barrier);
  } else if (bias && relu) {
    store_swapped_tile<true, true, false, false>(p, acc, staging, map_c, mask_bar, mask_phase, tile,
                                                 barrier);
  } else if (bias) {
    store_swapped_tile<true, false, false, false>(p, acc, staging, map_c, mask_bar, mask_phase,
                                                  tile, barrier);
  } else if (relu) {
    store_swapped_tile<false, true, false, false>(p, acc, staging, map_c, mask_bar, mask_phase,
                                                  tile, barrier);
  } else {
    store_swapped_tile<false, false, false, false>(p, acc, staging, map_c, mask_bar, mask_phase,
                                                   tile, barrier);
  }
}

// The producer warpgroup's im2col gather of one A k-block: 128 rows (output pixels) of 128 bytes
// (8 chunks of 16 bytes: 8 bf16 or 4 fp32 channels of one input pixel, C being a multiple of that).
// Thread t copies chunk j = t % 8 of rows t / 8 + 16 i (i = 0..7), so the 8 threads of a row read
// its 128 contiguous bytes together and a warp's copy touches 4 cache lines, not 32. Each chunk
// goes with cp.async to its 128-byte-swizzled place (chunk j of row r at j ^ (r % 8): the layout
// TMA writes and wgmma reads), zero-filled where the filter hangs over the padding, past the last
// pixel or past R*S*C. The thread's chunk has one reduction position (r, s, c) for all its rows,
// advanced by a k-block per call without division.
template <typename Elem>
struct Im2colGather {
  static constexpr int kChunk = 16 / int(sizeof(Elem));  // elements per 16-byte chunk
  static constexpr int kBlockK = kRowBytes / int(sizeof(Elem));
  int nh[8], h0[8], w0[8];  // per row: image * H + h0, and the input position of tap (0, 0)
  int r, s, c;              // this thread's chunk's reduction position

  __device__ __forceinline__ void init(const ConvGather& g, int tile_row0, int m, int k_begin) {
    const int pq = g.p * g.q;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int row = tile_row0 + threadIdx.x / 8 + 16 * i;
      if (row < m) {
        const int img = row / pq;
        const int rem = row - img * pq;
        const int op = rem / g.q, oq = rem - op * g.q;
        h0[i] = op * g.stride_h - g.pad_h;
        w0[i] = oq * g.stride_w - g.pad_w;
        nh[i] = img * g.h + h0[i];
      } else {
        h0[i] = -(1 << 30);  // every tap falls outside: zeros
        w0[i] = 0;
        nh[i] = 0;
      }
    }
    const int k = k_begin + (threadIdx.x % 8) * kChunk;
    const int rs = k / g.c;
    c = k - rs * g.c;
    r = rs / g.s;
    s = rs - r * g.s;
  }

  __device__ __forceinline__ void load(const ConvGather& g, uint32_t stage) {
    const int j = threadIdx.x % 8;
    const int row0 = threadIdx.x / 8;
    const uint32_t dst0 = stage + row0 * kRowBytes + ((j ^ (row0 & 7)) << 4);  // rows differ by 16
    const Elem* x = static_cast<const Elem*>(g.x);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int h = h0[i] + r, w = w0[i] + s;
      const bool inside = r < g.r && unsigned(h) < unsigned(g.h) && unsigned(w) < unsigned(g.w);
      const Elem* src = inside ? x + (int64_t(nh[i] + r) * g.w + w) * g.c + c : x;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst0 + i * 16 * kRowBytes),
                   "l"(src), "r"(inside ? 16 : 0)
                   : "memory");
    }
    c += kBlockK;
    while (c >= g.c) {
      c -= g.c;
      if (++s == g.s) {
        s = 0;
        ++r;
      }
    }
  }
};

// The producer warpgroup's gather of one B k-block for backward-weight: 64 reduction rows (output
// pixels m) by kTileN columns (taps (r, s) x channels c, c fastest), stored MN-major as kTileN / 64
// slabs of 64 rows x 128 bytes, each row 64 consecutive columns, 128-byte swizzled. Thread t copies
// chunk j = t % 8 of rows t / 8 + 16 i (i = 0..3) of every slab; its chunk's columns, hence taps,
// are fixed for the tile, and only the pixels move with the k-block.
template <int kTileN>
struct WgradGather {
  static constexpr int kSlabs = kTileN / 64;
  int r[kSlabs], s[kSlabs], c[kSlabs];  // this thread's chunk's tap and channel per slab (r = big:
                                        // the column is past R*S*C)

  __device__ __forceinline__ void init(const ConvGather& g, int col0) {
    const int j = threadIdx.x % 8;
#pragma unroll
    for (int b = 0; b < kSlabs; ++b) {
      const int col = col0 + 64 * b + 8 * j;
      const int rs = col / g.c;
      c[b] = col - rs * g.c;
      r[b] = rs / g.s;
      s[b] = rs - r[b] * g.s;
      if (r[b] >= g.r) r[b] = 1 << 29;
    }
  }

  __device__ __forceinline__ void load(const ConvGather& g, uint32_t stage, int m0, int m) {
    const int j = threadIdx.x % 8;
    const int row0 = threadIdx.x / 8;
    const uint32_t dst0 = stage + row0 * kRowBytes + ((j ^ (row0 & 7)) << 4);
    const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(g.x);
    const int pq = g.p * g.q;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = m0 + row0 + 16 * i;
      int img = 0, h0 = -(1 << 30), w0 = 0;
      if (row < m) {
        img = row / pq;
        const int rem = row - img * pq;
        const int op = rem / g.q, oq = rem - op * g.q;
        h0 = op * g.stride_h - g.pad_h;
        w0 = oq * g.stride_w - g.pad_w;
      }
#pragma unroll
      for (int b = 0; b < kSlabs; ++b) {
        const int h = h0 + r[b], w = w0 + s[b];
        const bool inside = unsigned(h) < unsigned(g.h) && unsigned(w) < unsigned(g.w);
        const __nv_bfloat16* src =
            inside ? x + ((int64_t(img) * g.h + h) * g.w + w) * g.c + c[b] : x;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(
                         dst0 + b * 64 * kRowBytes + i * 16 * kRowBytes),
                     "l"(src), "r"(inside ? 16 : 0)
                     : "memory");
      }
    }
  }
};

// TF32 backward-weight by patch boxes (kWgradTma / kWgradTmaT with fp32 operands). A box of an NHWC
// tensor over a patch of 32 output pixels lands MN-major: 32 rows (pixels) of 128 bytes (32
// channels), 128-byte swizzled (16-byte chunk cc of row p at chunk cc ^ (p & 7)). TF32 wgmma reads
// shared-memory operands K-major only, so:
// - A (the tile's 128 rows: 4 boxes) is never transposed: the consumers load their wgmma fragments
//   from the boxes as they landed (load_a_fragments), and wgmma takes A from registers.
// - Each box of B is transposed in place by the producer's warps 1-3 (transpose_stages) to the
//   K-major layout: row n (a channel) holds the 32 pixels, chunk pg at pg ^ (n & 7).
// The order of k. Both operands see the 32 pixels of a k-block in one permuted order: within each
// group of 8 (one k8 step), logical k = 0..3 are pixels 0, 2, 4, 6 and k = 4..7 pixels 1, 3, 5, 7
// (kPixelOfK). A sum over k does not care, and with it each fragment load of A is free of bank
// conflicts: lane 4g + t reads rows 2t (or 2t + 1) of the step at chunk (channel / 4) ^ row, and
// the eight (g / 4, t) pairs of a warp then hit eight different chunks (in natural order rows t
// and t' = t ^ 1 would meet in one chunk: 2-way conflicts).
__host__ __device__ constexpr int kPixelOfK(int k) {
  return (k & ~7) + 2 * (k & 3) + ((k >> 2) & 1);
}

// The transposition of one box of B: 8 x 8 blocks of 4 pixels x 4 channels, block (pg, cc) of the
// box (4 pixel rows, chunk cc) becomes block (cc, pg) of the K-major square (rows 4cc + j, chunk
// pg), each a 4 x 4 transpose in registers. kPermuted (backward-weight, A from registers): block
// pg's pixels are rows kPixelOfK(4pg + i), i = 0..3; otherwise rows 4pg + i (k in its natural
// order: kGemmBT, whose A is K-major by TMA). One warp owns a box: it loads all 64 blocks (lane l
// the blocks pg = l % 8 and, for u = 0, 1, cc = (pg + l / 8 + 4u) % 8, xor pg % 2 when permuted:
// 8 ld.shared.v4 a lane), then, after __syncwarp, stores them transposed. Each quarter warp of one
// instruction reads and writes 8 different chunk positions: no bank conflicts on either side
// (checked exhaustively for both orders; permuted, the loads' chunk is ((pg + l / 8 + 4u) % 8) ^
// 2i and the stores' pg ^ (4 (l / 8 % 2) + j)).
template <bool kPermuted>
__device__ __forceinline__ void transpose_box_in_place(uint32_t box) {
  const int lane = threadIdx.x % 32;
  const int pg = lane & 7;
  const auto block_column = [&](int u) {
    const int cc = (pg + (lane >> 3) + 4 * u) & 7;
    return kPermuted ? cc ^ (pg & 1) : cc;
  };
  uint32_t v[2][4][4];  // [block][pixel i][channel j]
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int cc = block_column(u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = kPermuted ? kPixelOfK(4 * pg + i) : 4 * pg + i;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[u][i][0]), "=r"(v[u][i][1]), "=r"(v[u][i][2]), "=r"(v[u][i][3])
                   : "r"(box + row * kRowBytes + ((cc ^ (row & 7)) << 4))
                   : "memory");
    }
  }
  __syncwarp();
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int cc = block_column(u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = 4 * cc + j;
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(box + row * kRowBytes +
                                                                    ((pg ^ (row & 7)) << 4)),
                   "r"(v[u][0][j]), "r"(v[u][1][j]), "r"(v[u][2][j]), "r"(v[u][3][j])
                   : "memory");
    }
  }
}

// The transposing warps of TF32's MN-major B (warps 1..3 of the producer warpgroup): they follow
// the stages in the producer's order, wait for a stage's boxes to land (its "loaded" barrier: the
// TMA's transaction bytes), transpose the stage's kBoxesB boxes of B in place (box b by warp 1 + b
// % 3), and arrive on the stage's "full" barrier (one arrival per thread, after a proxy fence: the
// consumers' wgmma reads through the async proxy what these threads wrote through the generic one).
template <int kStages, int kBoxesB, int kStageBytesB, bool kPermuted>
__device__ __forceinline__ void transpose_stages(const MainloopParams& p, uint32_t stages_b,
                                                 uint32_t loaded, uint32_t full) {
  const int warp = int(threadIdx.x) / 32 - 1;  // 0..2
  const int work_items = p.tiles_m * p.tiles_n * p.splits;
  int stage = 0, phase = 0;
  for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
    const WorkItem w = work_item(p, index);
    const int kb_begin = w.split * p.k_blocks_per_split;
    const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
    for (int kb = kb_begin; kb < kb_end; ++kb) {
      mbar_wait(loaded + 8 * stage, phase);
#pragma unroll
      for (int i = 0; i < (kBoxesB + 2) / 3; ++i) {  // boxes warp, warp + 3, ...
        const int b = warp + 3 * i;
        if (b < kBoxesB) {
          transpose_box_in_place<kPermuted>(stages_b + stage * kStageBytesB + b * 32 * kRowBytes);
        }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      mbar_arrive(full + 8 * stage);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
}

// A consumer thread's TF32 A fragments of one k-block, from the MN-major boxes of its stage
// (fragment[4 kk + r] for k8 step kk: the WgmmaTf32RS order, with k in the order kPixelOfK).
// Consumer c's 64 rows are boxes 2c and 2c + 1; warp w's 16 rows are channels 16 (w % 2) + g and
// + 8 of box 2c + w / 2. (The offsets are recomputed per k-block: a few integer instructions,
// where holding them would cost the epilogue four registers.)
__device__ __forceinline__ void load_a_fragments(uint32_t stage_a, int consumer,
                                                 uint32_t (&fragment)[16]) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  const uint32_t box = stage_a + uint32_t(2 * consumer + warp / 2) * 32 * kRowBytes;
  const int chunk = 4 * (warp % 2) + g / 4;  // channel / 4 of row g
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // a0: (g, t), a1: (g + 8, t), a2: (g, t + 4), a3: (g + 8, t + 4)
    const int row = kPixelOfK(t + 4 * (r / 2));
    const uint32_t at = box + row * kRowBytes + (((chunk + 2 * (r % 2)) ^ row) << 4) + (g % 4) * 4;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      asm volatile("ld.shared.u32 %0, [%1];"
                   : "=r"(fragment[4 * kk + r])
                   : "r"(at + kk * 8 * kRowBytes)
                   : "memory");
    }
  }
}

// MN-major descriptors of backward-weight: 8-row groups along k are 1024 bytes apart and 64-wide
// slabs along m/n 8 KiB apart. Which of the descriptor's two offsets holds which stride for
// MN-major operands is the question kWgradAlt answers on the device (the tests run both).
template <int kMode>
__device__ __forceinline__ uint64_t wgrad_descriptor(uint32_t addr) {
  return kMode != kWgradAlt ? smem_descriptor(addr, 64 * kRowBytes, 1024)
                            : smem_descriptor(addr, 1024, 64 * kRowBytes);
}

// The swapped modes' per-consumer staging of C (store_swapped_tile), 0 for the others.
template <int kMode>
constexpr bool kSwappedMode = kMode == kConvTmaSwap || kMode == kConvTmaBTSwap ||
                              kMode == kConvHaloSwap || kMode == kConvHaloBTSwap;
template <int kMode>
constexpr int kStagingBytesOf = kSwappedMode<kMode> ? (kConsumers* kSwapTileBytes) : 0;
// A stage's A bytes: a halo tile's input box, or one k-block of 128 rows.
template <int kMode>
constexpr int kStageBytesAOf =
    kMode == kConvHaloSwap || kMode == kConvHaloBTSwap ? kHaloStageBytes : kTileM* kRowBytes;

// map_c and map_mask: C and the ReLU mask as NHWC tensors over the patch tiles (kConvTmaSwap,
// kConvTmaBTSwap: the epilogue's TMA store and mask load); unused by the other modes.
template <typename Elem, int kTileN, int kMode, int kResidentB = 0>
__global__ void __launch_bounds__(kThreads, 1)
    matmul_kernel(const __grid_constant__ CUtensorMap map_a,
                  const __grid_constant__ CUtensorMap map_b,
                  const __grid_constant__ CUtensorMap map_c,
                  const __grid_constant__ CUtensorMap map_mask, const MainloopParams p,
                  const ConvGather g) {
  kernel_entry();
  using Cfg = Config<Elem, kTileN, kResidentB, kStagingBytesOf<kMode>, kStageBytesAOf<kMode>>;
  constexpr bool kConv = kMode == kConv_;
  constexpr bool kWgradGather = kMode == kWgrad || kMode == kWgradAlt;
  constexpr bool kWgradPatch = kMode == kWgradTma || kMode == kWgradTmaT;
  // TF32 with an MN-major B (backward-weight by patch boxes; kGemmBT, a Linear layer's backward
  // reading W or x as stored): B's boxes land MN-major and the producer's warps 1..3 transpose them
  // in place to the K-major layout TF32 wgmma reads (transpose_stages).
  constexpr bool kTransposes = (kWgradPatch || kMode == kGemmBT) && std::is_same_v<Elem, float>;
  // TF32 backward-weight: A's fragments from registers (load_a_fragments), k permuted (kPixelOfK).
  constexpr bool kRegisterA = kTransposes && kWgradPatch;
  constexpr bool kWgradMode =  // both operands MN-major
      kWgradGather || (kWgradPatch && !kTransposes) || kMode == kGemmTT;
  constexpr bool kGathers = kConv || kWgradGather;
  // The ping-pong schedule (forward and backward-data tiles up to 128 wide, whose short reductions
  // leave the epilogue a large share of a tile's time): each consumer warpgroup takes whole tiles,
  // the block's work items alternately, and the two take turns at the tensor cores, so that one
  // runs its mainloop while the other stores its tile. Wider tiles would need 2 x kTileN / 2
  // accumulators per thread (more than the register file gives past 128); they keep the
  // cooperative schedule, both warpgroups on one tile's two 64-row halves.
  // The operands' roles swapped (the filters as wgmma's A): a 64-channel C, ping-pong only.
  constexpr bool kSwapped = kSwappedMode<kMode>;
  static_assert(!kSwapped || (kTileN == 64 && std::is_same_v<Elem, __nv_bfloat16>),
                "swapped tiles: 64 bf16 channels");
  // Halo tiles: one stage per tile and block of channels, the taps read as views of it.
  constexpr bool kHalo = kMode == kConvHaloSwap || kMode == kConvHaloBTSwap;
  static_assert(!kHalo || kResidentB == 9, "halo tiles: 9 k-blocks of resident filters");
  // A by patch boxes
  constexpr bool kConvPatch = kMode == kConvTma || kMode == kConvTmaBT || kSwapped;
  // The filters read rotated per tap, as MN-major boxes
  constexpr bool kRotatedB =
      kMode == kConvTmaBT || kMode == kConvTmaBTSwap || kMode == kConvHaloBTSwap;
  // B MN-major (read with wgmma's transpose bit), A K-major
  constexpr bool kBStoredKN = (kMode == kGemmBT || kMode == kConvTmaBT) && !kTransposes;
  constexpr bool kPingPong = (kMode == kConv_ || kConvPatch) && kTileN <= 128;
  static_assert(kResidentB == 0 || (kConvPatch && kPingPong),
                "resident B: the TMA-patch convolutions' ping-pong tiles only");
  extern __shared__ uint8_t shared_raw[];
  // 128-byte swizzle atoms must start on a 1024-byte boundary.
  const uint32_t raw = smem_addr(shared_raw);
  const uint32_t base = (raw + 1023) & ~1023u;
  const uint32_t stages_a = base;
  const uint32_t stages_b = base + Cfg::kStages * Cfg::kStageBytesA;
  const uint32_t resident_b = base + Cfg::kStages * Cfg::kStageBytes;  // kResidentB k-blocks
  // kSwapped: consumer c's tile of C on the way out at staging + c * kSwapTileBytes
  const uint32_t staging = resident_b + Cfg::kStagingOffset;
  // full[s], then empty[s], then the resident B's barrier
  const uint32_t bars = staging + Cfg::kStaging;
  auto full_bar = [&](int s) { return bars + 8 * s; };
  auto empty_bar = [&](int s) { return bars + 8 * (Cfg::kStages + s); };
  const uint32_t resident_bar = bars + 16 * Cfg::kStages;
  // kTransposes: loaded[s], where the TMA completes its bytes before the transposing warps take
  // the stage (they then arrive on full[s]).
  const uint32_t loaded_bars = resident_bar + 8;
  static_assert(!kTransposes || 24 * Cfg::kStages + 8 <= Cfg::kScratchOffset,
                "the barriers overrun the scratch");
  auto load_bar = [&](int s) { return kTransposes ? loaded_bars + 8 * s : full_bar(s); };
  // kSwapped: consumer c's mask load (one phase per tile it takes), where kTransposes has loaded[s]
  auto mask_bar = [&](int c) { return loaded_bars + 8 * c; };
  static_assert(16 * Cfg::kStages + 8 + 8 * kConsumers <= Cfg::kScratchOffset,
                "the barriers overrun the scratch");
  const bool bias_sums = kWgradPatch && !kTransposes && p.bias_partials != nullptr;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      // + a cp.async arrival per producer thread, or one per transposing thread
      mbar_init(full_bar(s), kGathers ? 1 + 128 : kTransposes ? 96 : 1);
      if constexpr (kTransposes) mbar_init(loaded_bars + 8 * s, 1);
      // One arrival per warp of the warpgroups that read the stage (both, or one in ping-pong),
      // and one per bias-sum warp.
      mbar_init(empty_bar(s), (kPingPong ? 4 : kConsumers * 4) + (bias_sums ? 2 : 0));
    }
    if constexpr (kResidentB > 0) mbar_init(resident_bar, 1);
    if constexpr (kSwapped) {
      for (int c = 0; c < kConsumers; ++c) mbar_init(mask_bar(c), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int work_items = p.tiles_m * p.tiles_n * p.splits;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0 && kWgradGather) {
    // Thread 0 loads A (dy: 64 pixels x 64 output channels per consumer) with TMA; all 128 gather B.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;");
    int stage = 0, phase = 0;
    for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
      const WorkItem w = work_item(p, index);
      const int kb_begin = w.split * p.k_blocks_per_split;
      const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
      WgradGather<kTileN> gather;
      gather.init(g, w.tile_n * kTileN);
      for (int kb = kb_begin; kb < kb_end; ++kb) {
        mbar_wait(empty_bar(stage), phase ^ 1);
        if (threadIdx.x == 0) {
          mbar_expect_tx(full_bar(stage), Cfg::kStageBytesA);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            tma_load_2d(stages_a + stage * Cfg::kStageBytesA + half * 64 * kRowBytes, &map_a,
                        full_bar(stage), w.tile_m * kTileM + 64 * half, kb * 64);
          }
        }
        gather.load(g, stages_b + stage * Cfg::kStageBytesB, kb * 64, p.k);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full_bar(stage))
                     : "memory");
        if (++stage == Cfg::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else if (warpgroup == 0 && kConv) {
    // All 128 producer threads gather A, one row each; thread 0 also loads B with TMA.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;");
    int stage = 0, phase = 0;
    for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
      const WorkItem w = work_item(p, index);
      const int kb_begin = w.split * p.k_blocks_per_split;
      const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
      Im2colGather<Elem> gather;
      gather.init(g, w.tile_m * kTileM, p.m, kb_begin * Cfg::kBlockK);
      for (int kb = kb_begin; kb < kb_end; ++kb) {
        mbar_wait(empty_bar(stage), phase ^ 1);
        if (threadIdx.x == 0) {
          mbar_expect_tx(full_bar(stage), Cfg::kStageBytesB);
          tma_load_2d(stages_b + stage * Cfg::kStageBytesB, &map_b, full_bar(stage),
                      kb * Cfg::kBlockK, w.tile_n * kTileN);
        }
        gather.load(g, stages_a + stage * Cfg::kStageBytesA);
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full_bar(stage))
                     : "memory");
        if (++stage == Cfg::kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else if (warpgroup == 0) {
    if constexpr (kTransposes) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 72;");
    } else {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    }
    if constexpr (kTransposes) {
      if (threadIdx.x >= 32) {
        transpose_stages<Cfg::kStages, kTileN / Cfg::kBlockK, Cfg::kStageBytesB, kRegisterA>(
            p, stages_b, load_bar(0), full_bar(0));
      }
    }
    if (threadIdx.x == 0) {
      // k-block kb of a kConvTma / kConvTmaBT B for tile column tile_n (kConvTmaBT: the filters'
      // rows cb of tap R*S-1-rs, as kTileN / 64 MN-major boxes).
      [[maybe_unused]] const auto load_conv_b = [&](uint32_t dst, int kb, int tile_n,
                                                    uint32_t bar) {
        if constexpr (kRotatedB) {
          const PatchTiles& t = p.patch;
          const int rs = kb / t.c_blocks;
          const int cb = kb - rs * t.c_blocks;
          const int column0 = (t.r * t.s - 1 - rs) * p.n + tile_n * kTileN;
#pragma unroll
          for (int slab = 0; slab < kTileN / 64; ++slab) {
            tma_load_2d(dst + slab * 64 * kRowBytes, &map_b, bar, column0 + 64 * slab,
                        cb * Cfg::kBlockK);
          }
        } else {
          tma_load_2d(dst, &map_b, bar, kb * Cfg::kBlockK, tile_n * kTileN);
        }
      };
      if constexpr (kResidentB > 0) {
        // All of B (one tile column, p.k_blocks <= kResidentB: the host's condition), once.
        if (int(blockIdx.x) < work_items) {
          mbar_expect_tx(resident_bar, p.k_blocks * Cfg::kBlockBytesB);
          for (int kb = 0; kb < p.k_blocks; ++kb) {
            load_conv_b(resident_b + kb * Cfg::kBlockBytesB, kb, 0, resident_bar);
          }
        }
      }
      int stage = 0, phase = 0;
      for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
        const WorkItem w = work_item(p, index);
        const int kb_begin = w.split * p.k_blocks_per_split;
        const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
        // kConvTma: where the tile's patch starts, and the tap / channel block of each k-block.
        int q0 = 0, p0 = 0, n0 = 0;
        if constexpr (kConvPatch) {
          const PatchTiles& t = p.patch;
          q0 = (w.tile_m % t.tiles_q) * t.wb;
          const int rest = w.tile_m / t.tiles_q;
          p0 = (rest % t.tiles_p) * t.hb;
          n0 = (rest / t.tiles_p) * t.nb;
        }
        // kWgradTma / kWgradTmaT: where each box of x sits relative to the k-block's patch (its
        // channel block and tap: fixed for the item), and the patch of the k-block, advanced
        // without a division: the producer is one thread issuing 4 to 6 boxes a k-block, and
        // its divisions per box and per k-block were on the critical path of every stage.
        // A box of x is kBox channels (one k-block row of 128 bytes) of one tap: 64 bf16 or 32
        // fp32 over the patch (the TF32 shifted copies' slabs: 64 rows of x^T).
        constexpr bool kWgradShifted = kMode == kWgradShift || kMode == kWgradShiftT;
        constexpr int kBox = kWgradPatch ? Cfg::kBlockK : 64;
        constexpr int kXBoxes =
            kMode == kWgradTma || kMode == kWgradShift ? kTileN / kBox : kTileM / kBox;
        [[maybe_unused]] int box_c[kXBoxes], box_q[kXBoxes], box_p[kXBoxes];
        [[maybe_unused]] int patch_q = 0, patch_p = 0, patch_n = 0;
        if constexpr (kWgradShifted) {
          // TF32's shifted copies: slab i's rows (copy s, channel block cb) and its shift along
          // the grid (r rows of it), once per item.
          const PatchTiles& t = p.patch;
#pragma unroll
          for (int i = 0; i < kXBoxes; ++i) {
            const int block = (kMode == kWgradShift ? w.tile_n : w.tile_m) * kXBoxes + i;
            const int rs = block / t.c_blocks;
            const int cb = block - rs * t.c_blocks;
            int r = rs / t.s, s = rs - r * t.s;
            if (r >= t.r) r = s = 0;  // slabs past R*S*C: any box will do, none is stored
            box_c[i] = (s * t.c_blocks + cb) * 64;
            box_q[i] = r * t.grid_w;
          }
        }
        if constexpr (kWgradPatch) {
          const PatchTiles& t = p.patch;
#pragma unroll
          for (int i = 0; i < kXBoxes; ++i) {
            const int block = (kMode == kWgradTma ? w.tile_n : w.tile_m) * kXBoxes + i;
            const int rs = block / t.c_blocks;
            int r = rs / t.s, s = rs - r * t.s;
            if (r >= t.r) r = s = 0;  // columns past R*S*C: any box will do, none is stored
            box_c[i] = (block - rs * t.c_blocks) * kBox;
            box_q[i] = s - t.pad_w;
            box_p[i] = r - t.pad_h;
          }
          const int rest = kb_begin / t.tiles_q;
          patch_q = kb_begin - rest * t.tiles_q;
          patch_p = rest % t.tiles_p;
          patch_n = rest / t.tiles_p;
        }
        // Halo tiles: one stage per tile (its whole input: the host allows one channel block).
        const int kb_stop = kHalo ? kb_begin + 1 : kb_end;
        for (int kb = kb_begin; kb < kb_stop; ++kb) {
          mbar_wait(empty_bar(stage), phase ^ 1);
          mbar_expect_tx(load_bar(stage), kHalo ? kHaloBoxBytes : Cfg::kStageBytes);
          if constexpr (kMode == kWgradShift || kMode == kWgradShiftT) {
            // Slab `block`: tap (r, s) of 64 channels, from x^T's rows of filter column s (each
            // copy already shifted by s) at this k-block's grid columns plus r rows of the grid.
            // (TMA faults on a box whose first element is not 16-byte aligned: the shifts along
            // the innermost dimension stay multiples of 4 floats.) Slabs past R*S*C load any box
            // (tap 0); none of it is stored.
            const int k0 = kb * Cfg::kBlockK;
            const auto load_x = [&](uint32_t dst, const CUtensorMap* map, int i) {
              tma_load_2d(dst, map, full_bar(stage), k0 + box_q[i], box_c[i]);
            };
            const uint32_t a = stages_a + stage * Cfg::kStageBytesA;
            const uint32_t b = stages_b + stage * Cfg::kStageBytesB;
            if constexpr (kMode == kWgradShift) {
              tma_load_2d(a, &map_a, full_bar(stage), k0, w.tile_m * kTileM);
#pragma unroll
              for (int slab = 0; slab < kTileN / 64; ++slab) {
                load_x(b + slab * 64 * kRowBytes, &map_b, slab);
              }
            } else {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                load_x(a + half * 64 * kRowBytes, &map_a, half);
              }
              tma_load_2d(b, &map_b, full_bar(stage), k0, w.tile_n * kTileN);
            }
          } else if constexpr (kMode == kWgradTma || kMode == kWgradTmaT) {
            // k-block kb is patch kb of the output pixels: dy there, and x shifted by the tap of
            // each 64-column block of im2col(x) (kWgradTma: dy is A, x is B; kWgradTmaT the
            // other way round).
            const PatchTiles& t = p.patch;
            const int pq0 = patch_q * t.wb, pp0 = patch_p * t.hb, pn0 = patch_n * t.nb;
            if (++patch_q == t.tiles_q) {
              patch_q = 0;
              if (++patch_p == t.tiles_p) {
                patch_p = 0;
                ++patch_n;
              }
            }
            const auto load_dy = [&](uint32_t dst, const CUtensorMap* map, int channel0) {
              tma_load_4d(dst, map, load_bar(stage), channel0, pq0, pp0, pn0);
            };
            const auto load_x = [&](uint32_t dst, const CUtensorMap* map, int i) {
              tma_load_4d(dst, map, load_bar(stage), box_c[i], pq0 + box_q[i], pp0 + box_p[i], pn0);
            };
            const uint32_t a = stages_a + stage * Cfg::kStageBytesA;
            const uint32_t b = stages_b + stage * Cfg::kStageBytesB;
#pragma unroll
            for (int i = 0; i < kTileM / kBox; ++i) {
              if constexpr (kMode == kWgradTma) {
                load_dy(a + i * kBox * kRowBytes, &map_a, w.tile_m * kTileM + kBox * i);
              } else {
                load_x(a + i * kBox * kRowBytes, &map_a, i);
              }
            }
#pragma unroll
            for (int i = 0; i < kTileN / kBox; ++i) {
              if constexpr (kMode == kWgradTma) {
                load_x(b + i * kBox * kRowBytes, &map_b, i);
              } else {
                load_dy(b + i * kBox * kRowBytes, &map_b, w.tile_n * kTileN + kBox * i);
              }
            }
          } else if constexpr (kHalo) {
            // The patch's input with its border: box rows (y, x) = input pixel (p0 - pad_h + y,
            // q0 - pad_w + x), zero-filled outside the image.
            const PatchTiles& t = p.patch;
            tma_load_4d(stages_a + stage * Cfg::kStageBytesA, &map_a, full_bar(stage), 0,
                        q0 - t.pad_w, p0 - t.pad_h, n0);
          } else if constexpr (kConvPatch) {
            const PatchTiles& t = p.patch;
            const int rs = kb / t.c_blocks;
            const int cb = kb - rs * t.c_blocks;
            const int r = rs / t.s, s = rs - r * t.s;
            tma_load_4d(stages_a + stage * Cfg::kStageBytesA, &map_a, full_bar(stage),
                        cb * Cfg::kBlockK, q0 + s - t.pad_w, p0 + r - t.pad_h, n0);
            if constexpr (kResidentB == 0) {
              load_conv_b(stages_b + stage * Cfg::kStageBytesB, kb, w.tile_n, full_bar(stage));
            }
          } else if constexpr (kMode == kGemmTT) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              tma_load_2d(stages_a + stage * Cfg::kStageBytesA + half * 64 * kRowBytes, &map_a,
                          full_bar(stage), w.tile_m * kTileM + 64 * half, kb * Cfg::kBlockK);
            }
          } else {
            tma_load_2d(stages_a + stage * Cfg::kStageBytesA, &map_a, load_bar(stage),
                        kb * Cfg::kBlockK, w.tile_m * kTileM);
          }
          if constexpr (kMode == kGemmBT || kMode == kGemmTT) {
            // B stored k x n: boxes of one k-block's rows by 128 bytes of columns (64 bf16, 32
            // fp32)
#pragma unroll
            for (int slab = 0; slab < kTileN / Cfg::kBlockK; ++slab) {
              int row = kb * Cfg::kBlockK, column = w.tile_n * kTileN + Cfg::kBlockK * slab;
              if (p.b_dense_k != 0) dense_2x2_box(p, row, column);
              tma_load_2d(stages_b + stage * Cfg::kStageBytesB + slab * Cfg::kBlockK * kRowBytes,
                          &map_b, load_bar(stage), column, row);
            }
          } else if constexpr (kMode != kWgradTma && kMode != kWgradTmaT && kMode != kWgradShift &&
                               kMode != kWgradShiftT && !kConvPatch) {
            int row = w.tile_n * kTileN, column = kb * Cfg::kBlockK;
            if (p.b_dense_k != 0) dense_2x2_box(p, row, column);
            tma_load_2d(stages_b + stage * Cfg::kStageBytesB, &map_b, full_bar(stage), column, row);
          }
          if (++stage == Cfg::kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
    // (dw^T tiles wider than 128 channels do not take the bias sums: launch_mainloop refuses.)
    if constexpr (!kTransposes && (kMode == kWgradTma || (kMode == kWgradTmaT && kTileN <= 128))) {
      if (bias_sums && threadIdx.x >= 64) {
        wgrad_bias_sums<kMode, kTileN, Cfg::kStages,
                        kMode == kWgradTma ? Cfg::kStageBytesA : Cfg::kStageBytesB>(
            p, kMode == kWgradTma ? stages_a : stages_b, full_bar(0), empty_bar(0),
            bars + Cfg::kScratchOffset);
      }
    }
  } else {
    if constexpr (kGathers || kTransposes) {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    }
    const int consumer = warpgroup - 1;
    const bool arrives = threadIdx.x % 32 == 0;
    int stage = 0, phase = 0;
    if constexpr (kPingPong) {
      // Consumer c takes the block's work items j = c, c + 2, ... whole (both 64-row halves of
      // the tile: acc[0] and acc[1]), and skips the stages the producer filled for the other's
      // items. Turns: item j's mainloop starts after item j - 1's has finished (named barrier
      // 1 + c, arrived at by the other consumer), so the mainloops run in the producer's order
      // and one warpgroup's epilogue overlaps the other's mainloop. Each wait matches exactly one
      // arrival: a consumer arrives after item j's mainloop only if item j + 1 exists.
      // Both 64-row halves of the tile: acc + half * kAccumulators (kSwapped: one m64n128, C^T).
      float acc[2 * Cfg::kAccumulators];
      [[maybe_unused]] int mask_phase = 0;  // kSwapped: the mask barrier's phase
      const bool masked = kSwapped && p.epilogue.mask != nullptr;
      int j = 0;
      for (int index = blockIdx.x; index < work_items; index += gridDim.x, ++j) {
        const WorkItem w = work_item(p, index);
        const int kb_begin = w.split * p.k_blocks_per_split;
        const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
        if ((j & 1) != consumer) {
          // The other consumer's stages: the ring moves on by their count, the phase flipping
          // once per wrap.
          stage += kHalo ? 1 : max(kb_end - kb_begin, 0);
          phase ^= (stage / Cfg::kStages) & 1;
          stage %= Cfg::kStages;
          continue;
        }
        if constexpr (kSwapped) {
          // The tile's mask into the staging buffer while the mainloop runs, once the last
          // tile's store has read it.
          if (masked && threadIdx.x % 128 == 0) {
            bulk_store_wait<true>();
            const PatchOrigin o = patch_origin(p.patch, w.tile_m);
            mbar_expect_tx(mask_bar(consumer), kSwapTileBytes);
            tma_load_4d(staging + consumer * kSwapTileBytes, &map_mask, mask_bar(consumer), 0, o.q,
                        o.p, o.n);
          }
        }
        if (j > 0) turn_wait(1 + consumer);
        // The resident B's one phase: complete after the block's first wait, so later waits pass.
        if constexpr (kResidentB > 0) mbar_wait(resident_bar, 0);
        int previous = -1;
        const int kb_stop = kHalo ? kb_begin + 1 : kb_end;  // halo tiles: one stage a tile
        for (int kb = kb_begin; kb < kb_stop; ++kb) {
          mbar_wait(full_bar(stage), phase);
          // A was written by cp.async (the generic proxy); wgmma reads through the async proxy.
          if constexpr (kGathers) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          const uint32_t a = stages_a + stage * Cfg::kStageBytesA;
          const uint32_t b = kResidentB > 0 ? resident_b + kb * Cfg::kBlockBytesB
                                            : stages_b + stage * Cfg::kStageBytesB;
          wgmma_fence();
          if constexpr (kHalo) {
            // The 9 taps from the one stage: tap (r, s)'s pixels are the box's rows from
            // r * kHaloPitch + s on (halo_descriptor), its filters resident k-block rs.
#pragma unroll
            for (int rs = 0; rs < 9; ++rs) {
              const uint32_t view = a + ((rs / 3) * kHaloPitch + rs % 3) * kRowBytes;
              const uint32_t filter = b + rs * Cfg::kBlockBytesB;
#pragma unroll
              for (int kk = 0; kk < 4; ++kk) {
                const int accumulate = rs > 0 || kk > 0;
                if constexpr (kMode == kConvHaloSwap) {
                  WgmmaBf16<kTileM>::mma(acc, smem_descriptor(filter + 32 * kk),
                                         halo_descriptor(view + 32 * kk), accumulate);
                } else {
                  WgmmaBf16AT<kTileM>::mma(acc,
                                           wgrad_descriptor<kWgrad>(filter + 16 * kRowBytes * kk),
                                           halo_descriptor(view + 32 * kk), accumulate);
                }
              }
            }
          } else {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {  // 4 steps of 32 bytes of k: k16 bf16 or k8 tf32
            const int accumulate = kb > kb_begin || kk > 0;
            if constexpr (kMode == kConvTmaSwap) {  // A = the filters, B = the tile's pixels
              WgmmaBf16<kTileM>::mma(acc, smem_descriptor(b + 32 * kk),
                                     smem_descriptor(a + 32 * kk), accumulate);
            } else if constexpr (kMode == kConvTmaBTSwap) {  // A = the filters, MN-major
              WgmmaBf16AT<kTileM>::mma(acc, wgrad_descriptor<kWgrad>(b + 16 * kRowBytes * kk),
                                       smem_descriptor(a + 32 * kk), accumulate);
            } else {
#pragma unroll
              for (int half = 0; half < 2; ++half) {
                float* d = acc + half * Cfg::kAccumulators;
                const uint64_t desc_a = smem_descriptor(a + half * 64 * kRowBytes + 32 * kk);
                if constexpr (kBStoredKN) {
                  WgmmaBf16BT<kTileN>::mma(
                      d, desc_a, wgrad_descriptor<kWgrad>(b + 16 * kRowBytes * kk), accumulate);
                } else {
                  Mma<Elem, kTileN>::mma(d, desc_a, smem_descriptor(b + 32 * kk), accumulate);
                }
              }
            }
          }
          }
          wgmma_commit();
          wgmma_wait<1>();
          keep_in_registers<2 * Cfg::kAccumulators>(acc);
          if (previous >= 0 && arrives) mbar_arrive(empty_bar(previous));
          previous = stage;
          if (++stage == Cfg::kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
        wgmma_wait<0>();
        keep_in_registers<2 * Cfg::kAccumulators>(acc);
        if (previous >= 0 && arrives) mbar_arrive(empty_bar(previous));
        if (index + int(gridDim.x) < work_items) turn_arrive(2 - consumer);
        if (kb_end <= kb_begin) {
#pragma unroll
          for (int i = 0; i < 2 * Cfg::kAccumulators; ++i) acc[i] = 0.f;
        }
        if constexpr (kSwapped) {
          store_swapped(p, acc, staging + consumer * kSwapTileBytes, &map_c, mask_bar(consumer),
                        mask_phase, w.tile_m, 4 + consumer);
          mask_phase ^= masked ? 1 : 0;
        } else {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            store_tile<kTileN, kConvPatch>(p, acc + half * Cfg::kAccumulators, w.tile_m, half * 64,
                                           w.tile_n * kTileN, w.split);
          }
        }
      }
      // The last store must be complete before the block's shared memory goes (and, under a
      // programmatic launch, before the grid counts as done).
      if constexpr (kSwapped) {
        if (threadIdx.x % 128 == 0) bulk_store_wait<false>();
      }
    } else {
      float acc[Cfg::kAccumulators];
      // kRegisterA: A's fragments from registers, two k-blocks' worth (a wgmma group in flight
      // reads one while the next k-block's are loaded into the other).
      [[maybe_unused]] uint32_t fragments[2][16];
      for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
        const WorkItem w = work_item(p, index);
        const int kb_begin = w.split * p.k_blocks_per_split;
        const int kb_end = min(p.k_blocks, kb_begin + p.k_blocks_per_split);
        int previous = -1;
        // One k-block: `fragment` takes A's fragments (kRegisterA; the wgmma group before, in
        // flight until the wait below, reads the other buffer).
        const auto k_block = [&](int kb, uint32_t(&fragment)[16]) {
          mbar_wait(full_bar(stage), phase);
          // A was written by cp.async or B by the transposing warps (the generic proxy); wgmma
          // reads through the async proxy.
          if constexpr (kGathers || kTransposes) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          }
          const uint32_t a = stages_a + stage * Cfg::kStageBytesA + consumer * 64 * kRowBytes;
          const uint32_t b = stages_b + stage * Cfg::kStageBytesB;
          if constexpr (kTransposes) {
            // A as the TMA wrote it: its own barrier ("full" counts the transposes of B, which
            // followed it).
            mbar_wait(load_bar(stage), phase);
          }
          if constexpr (kRegisterA) {
            load_a_fragments(stages_a + stage * Cfg::kStageBytesA, consumer, fragment);
          }
          wgmma_fence();
          if constexpr (kRegisterA) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // k8 steps: 32 bytes of B's rows further each
              WgmmaTf32RS<kTileN>::mma(acc, fragment + 4 * kk, smem_descriptor(b + 32 * kk),
                                       kb > kb_begin || kk > 0);
            }
          } else if constexpr (kWgradMode) {
            // MN-major: a k16 step is 16 rows of 128 bytes further.
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
              WgmmaBf16MN<kTileN>::mma(acc, wgrad_descriptor<kMode>(a + 16 * kRowBytes * kk),
                                       wgrad_descriptor<kMode>(b + 16 * kRowBytes * kk),
                                       kb > kb_begin || kk > 0);
            }
          } else if constexpr (kBStoredKN) {
            // A K-major (32 bytes further per k16 step), B MN-major (16 rows of 128 bytes further).
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
              WgmmaBf16BT<kTileN>::mma(acc, smem_descriptor(a + 32 * kk),
                                       wgrad_descriptor<kWgrad>(b + 16 * kRowBytes * kk),
                                       kb > kb_begin || kk > 0);
            }
          } else {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {  // 4 steps of 32 bytes of k: k16 bf16 or k8 tf32
              Mma<Elem, kTileN>::mma(acc, smem_descriptor(a + 32 * kk),
                                     smem_descriptor(b + 32 * kk), kb > kb_begin || kk > 0);
            }
          }
          wgmma_commit();
          wgmma_wait<1>();
          keep_in_registers<Cfg::kAccumulators>(acc);
          if (previous >= 0 && arrives) mbar_arrive(empty_bar(previous));
          previous = stage;
          if (++stage == Cfg::kStages) {
            stage = 0;
            phase ^= 1;
          }
        };
        if constexpr (kRegisterA) {
          // Two k-blocks a pass, so that each names its fragment registers statically, and an odd
          // one last (on every path, a k-block's loads go to the registers the group before it
          // does not read; otherwise ptxas serializes the wgmma).
          int kb = kb_begin;
          for (; kb + 1 < kb_end; kb += 2) {
            k_block(kb, fragments[0]);
            k_block(kb + 1, fragments[1]);
          }
          if (kb < kb_end) k_block(kb, fragments[0]);
        } else {
          for (int kb = kb_begin; kb < kb_end; ++kb) k_block(kb, fragments[0]);
        }
        wgmma_wait<0>();
        keep_in_registers<Cfg::kAccumulators>(acc);
        if (previous >= 0 && arrives) mbar_arrive(empty_bar(previous));
        if (kb_end <= kb_begin) {
#pragma unroll
          for (int i = 0; i < Cfg::kAccumulators; ++i) acc[i] = 0.f;
        }
      store_tile<kTileN, kConvPatch>(p, acc, w.tile_m, consumer * 64, w.tile_n * kTileN, w.split);
    }
    }
  }
}

// ---- halo tiles with two rings: the wide layers (conv_halo_kernel) ------------------------------
//
// The forward and backward-data of a 3 x 3 layer whose output is 128 or more channels wide, on halo
// tiles (PatchTiles::halo): a tile is a patch of 8 x 16 output pixels of one image (its two 64-row
// halves: 8 rows of 8 pixels each) by kTileN output channels, and the reduction runs channel block
// by channel block: the input over the patch with its border (one 10 x 18 pixel box of 64
// channels, kHaloWideStageBytes) comes into a ring of its own, kHaloStagesA deep, and stays there
// while the 9 filter k-blocks of that channel block (tap rs: k-block rs * c_blocks + cb of the
// filters, or its 180-degree rotation for backward-data, as kConvTma / kConvTmaBT load them) stream
// through the second ring; tap (r, s) of half h reads the box from row (8h + r) * 10 + s on
// (halo_descriptor). With the `pairs` tiling (HaloTiling: outputs whose height is a multiple of 8
// but not of 16) a tile is two images' 8 x 8 patches, one per half, and its box 10 x 10 x 2 pixels:
// half h's taps start at row (10h + r) * 10 + s. The input then comes from L2 once per channel
// block instead of nine times. The sums run channel block by channel block (kConvTma's run tap by
// tap), so the bits are not kConvTma's. One producer thread; the consumers cooperate on a tile (one
// half each) for 256-wide tiles and take turns with whole tiles (ping-pong, as in matmul_kernel)
// for 128-wide ones; the epilogue is store_tile's. No split-K, 3 x 3 filters, padding up to 2 (the
// host checks).
constexpr int kHaloStagesA = 2;
// A stage holds either tiling's box: 10 x 18 pixels (tall) or 10 x 10 x 2 (pairs).
constexpr int kHaloWideStageBytes = 10 * 10 * 2 * kRowBytes;
static_assert(kHaloWideStageBytes % 1024 == 0 && kHaloWideStageBytes >= kHaloBoxBytes,
              "a wide halo stage holds either box, on the swizzle atom");

template <int kTileN>
struct HaloRings {
  static constexpr int kBlockBytesB = kTileN * kRowBytes;
  static constexpr int kStagesB =
      (kSharedBudget - 4096 - kHaloStagesA * kHaloWideStageBytes) / kBlockBytesB;
  static constexpr bool kPingPong = kTileN <= 128;
  static constexpr int kAccumulators = kTileN / 2;   // fp32 per thread for one m64nN
  static constexpr int kHalves = kPingPong ? 2 : 1;  // 64-row halves a consumer holds
  static constexpr int kBarriers = 2 * (kHaloStagesA + kStagesB);
  static constexpr int kSharedBytes =
      kHaloStagesA * kHaloWideStageBytes + kStagesB * kBlockBytesB + 1024 + 8 * kBarriers;
  static_assert(kStagesB >= 4, "too few filter stages");
  static_assert(kSharedBytes <= kSharedBudget, "the rings overrun shared memory");
};

// Moves a ring position on by one stage, flipping the phase when it wraps.
template <int kStages>
__device__ __forceinline__ void ring_next(int& stage, int& phase) {
  if (++stage == kStages) {
    stage = 0;
    phase ^= 1;
  }
}

// ... or by n stages.
template <int kStages>
__device__ __forceinline__ void ring_skip(int& stage, int& phase, int n) {
  stage += n;
  phase ^= (stage / kStages) & 1;
  stage %= kStages;
}

template <int kTileN, bool kRotated>
__global__ void __launch_bounds__(kThreads, 1)
    conv_halo_kernel(const __grid_constant__ CUtensorMap map_a,
                     const __grid_constant__ CUtensorMap map_b, const MainloopParams p) {
  kernel_entry();
  using Cfg = HaloRings<kTileN>;
  extern __shared__ uint8_t shared_raw[];
  const uint32_t base = (smem_addr(shared_raw) + 1023) & ~1023u;
  const uint32_t stages_a = base;
  const uint32_t stages_b = base + kHaloStagesA * kHaloWideStageBytes;
  const uint32_t bars = stages_b + Cfg::kStagesB * Cfg::kBlockBytesB;
  const auto full_a = [&](int s) { return bars + 8 * s; };
  const auto empty_a = [&](int s) { return bars + 8 * (kHaloStagesA + s); };
  const auto full_b = [&](int s) { return bars + 8 * (2 * kHaloStagesA + s); };
  const auto empty_b = [&](int s) { return bars + 8 * (2 * kHaloStagesA + Cfg::kStagesB + s); };
  if (threadIdx.x == 0) {
    // A stage is read by the 4 warps of one consumer (ping-pong) or of both.
    constexpr int kReaders = Cfg::kPingPong ? 4 : 4 * kConsumers;
    for (int s = 0; s < kHaloStagesA; ++s) {
      mbar_init(full_a(s), 1);
      mbar_init(empty_a(s), kReaders);
    }
    for (int s = 0; s < Cfg::kStagesB; ++s) {
      mbar_init(full_b(s), 1);
      mbar_init(empty_b(s), kReaders);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const PatchTiles& t = p.patch;
  const int work_items = p.tiles_m * p.tiles_n;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    // The tiling's input box: (8 + 2) x (16 + 2) pixels, or (8 + 2) x (8 + 2) x 2 images.
    const uint32_t box_bytes = (t.wb + 2) * (t.hb + 2) * t.nb * kRowBytes;
    int sa = 0, pa = 0, sb = 0, pb = 0;
    for (int index = blockIdx.x; index < work_items; index += gridDim.x) {
      const WorkItem w = work_item(p, index);
      const PatchOrigin o = patch_origin(t, w.tile_m);
      for (int cb = 0; cb < t.c_blocks; ++cb) {
        mbar_wait(empty_a(sa), pa ^ 1);
        mbar_expect_tx(full_a(sa), box_bytes);
        tma_load_4d(stages_a + sa * kHaloWideStageBytes, &map_a, full_a(sa), cb * 64, o.q - t.pad_w,
                    o.p - t.pad_h, o.n);
        ring_next<kHaloStagesA>(sa, pa);
        for (int rs = 0; rs < 9; ++rs) {
          mbar_wait(empty_b(sb), pb ^ 1);
          mbar_expect_tx(full_b(sb), Cfg::kBlockBytesB);
          const uint32_t dst = stages_b + sb * Cfg::kBlockBytesB;
          if constexpr (kRotated) {  // the filters' rows cb of tap 8 - rs, MN-major
            const int column0 = (8 - rs) * p.n + w.tile_n * kTileN;
#pragma unroll
            for (int slab = 0; slab < kTileN / 64; ++slab) {
              tma_load_2d(dst + slab * 64 * kRowBytes, &map_b, full_b(sb), column0 + 64 * slab,
                          cb * 64);
            }
          } else {
            tma_load_2d(dst, &map_b, full_b(sb), (rs * t.c_blocks + cb) * 64, w.tile_n * kTileN);
          }
          ring_next<Cfg::kStagesB>(sb, pb);
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;
  const bool arrives = threadIdx.x % 32 == 0;
  float acc[Cfg::kHalves * Cfg::kAccumulators];
  // Box rows from one 64-row half of the tile to the next: 8 (tall: the two halves are rows 0-7 and
  // 8-15 of one patch) or 10 (pairs: each half is one image's box of 10 rows).
  const int half_rows = t.nb == 2 ? t.hb + 2 : 8;
  int sa = 0, pa = 0, sb = 0, pb = 0;
  int j = 0;
  for (int index = blockIdx.x; index < work_items; index += gridDim.x, ++j) {
    const WorkItem w = work_item(p, index);
    if constexpr (Cfg::kPingPong) {
      if ((j & 1) != consumer) {  // the other consumer's tile: its stages
        ring_skip<kHaloStagesA>(sa, pa, t.c_blocks);
        ring_skip<Cfg::kStagesB>(sb, pb, 9 * t.c_blocks);
        continue;
      }
      if (j > 0) turn_wait(1 + consumer);
    }
    int previous_b = -1, previous_a = -1;  // the stages the last group read (A: if its last)
    for (int cb = 0; cb < t.c_blocks; ++cb) {
      mbar_wait(full_a(sa), pa);
      const uint32_t a = stages_a + sa * kHaloWideStageBytes;
#pragma unroll 1
      for (int rs = 0; rs < 9; ++rs) {
        mbar_wait(full_b(sb), pb);
        const uint32_t b = stages_b + sb * Cfg::kBlockBytesB;
        const int r = rs / 3, s = rs - 3 * (rs / 3);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const int accumulate = cb > 0 || rs > 0 || kk > 0;
#pragma unroll
          for (int half = 0; half < Cfg::kHalves; ++half) {
            const int h = Cfg::kPingPong ? half : consumer;
            const uint64_t desc_a =
                halo_descriptor(a + ((h * half_rows + r) * kHaloPitch + s) * kRowBytes + 32 * kk);
            float* d = acc + half * Cfg::kAccumulators;
            if constexpr (kRotated) {
              WgmmaBf16BT<kTileN>::mma(d, desc_a, wgrad_descriptor<kWgrad>(b + 16 * kRowBytes * kk),
                                       accumulate);
            } else {
              WgmmaBf16<kTileN>::mma(d, desc_a, smem_descriptor(b + 32 * kk), accumulate);
            }
          }
        }
        wgmma_commit();
        wgmma_wait<1>();
        keep_in_registers<Cfg::kHalves * Cfg::kAccumulators>(acc);
        if (previous_b >= 0 && arrives) {
          mbar_arrive(empty_b(previous_b));
          if (previous_a >= 0) mbar_arrive(empty_a(previous_a));
        }
        previous_b = sb;
        previous_a = rs == 8 ? sa : -1;
        ring_next<Cfg::kStagesB>(sb, pb);
      }
      ring_next<kHaloStagesA>(sa, pa);
    }
    wgmma_wait<0>();
    keep_in_registers<Cfg::kHalves * Cfg::kAccumulators>(acc);
    if (arrives) {
      mbar_arrive(empty_b(previous_b));
      if (previous_a >= 0) mbar_arrive(empty_a(previous_a));
    }
    if constexpr (Cfg::kPingPong) {
      if (index + int(gridDim.x) < work_items) turn_arrive(2 - consumer);
    }
#pragma unroll
    for (int half = 0; half < Cfg::kHalves; ++half) {
      const int h = Cfg::kPingPong ? half : consumer;
      store_tile<kTileN, true>(p, acc + half * Cfg::kAccumulators, w.tile_m, h * 64,
                               w.tile_n * kTileN, 0);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------------

// cuTensorMapEncodeTiled, found through the runtime (no link against libcuda, so that the library
// loads on machines without a driver and reports "no device" there instead of failing to load).
CUtensorMap encode_k_major(const void* ptr, CUtensorMapDataType type, int elem_bytes, int rows,
                           int cols, int64_t ld, int box_rows);

inline void check_launch() { CUDP_CUDA_CHECK(cudaGetLastError()); }

// The product's part of the kernel parameters under `plan`: sizes, tiles of kTileM x tile_n rows
// of C, k-blocks of k_block, split-K, C and the epilogue.
inline MainloopParams product_params(const MatmulProblem& prob, const MatmulPlan& plan, int tile_n,
                                     int k_block) {
  MainloopParams p{};
  p.m = prob.m;
  p.n = prob.n;
  p.k = prob.k;
  p.tiles_m = (prob.m + kTileM - 1) / kTileM;
  p.tiles_n = (prob.n + tile_n - 1) / tile_n;
  p.splits = plan.splits;
  p.k_blocks = (prob.k + k_block - 1) / k_block;
  p.k_blocks_per_split = plan.k_blocks_per_split;
  p.c = prob.c;
  p.ldc = prob.ldc;
  p.c_is_bf16 = prob.c_type == DType::BF16;
  p.epilogue = {prob.alpha, prob.beta, prob.bias, prob.relu, prob.mask, prob.bias_period};
  p.b_dense_k = prob.b_dense_k;
  p.b_dense_c = prob.b_dense_c;
  return p;
}

// Enqueues the mainloop. With a ConvGather (`conv` non-null) A is the im2col view of conv->x and
// prob.a / prob.lda are unused; prob.m must be n*P*Q and prob.k R*S*C.
CUtensorMap encode_patch_map(const ConvGather& g, CUtensorMapDataType type, int elem_bytes,
                             const PatchTiles& t);

// The input box of a halo tile (kConvHaloSwap, kConvHaloBTSwap, conv_halo_kernel): the patch with
// its border of one pixel a side (3 x 3 filters).
inline PatchTiles halo_box(const PatchTiles& t) {
  PatchTiles b = t;
  b.wb = t.wb + 2;  // kHaloPitch
  b.hb = t.hb + 2;
  b.nb = t.nb;
  return b;
}

template <typename Elem, int kTileN, int kResidentB = 0>
void launch_mainloop(const MatmulProblem& prob, const MatmulPlan& plan, float* workspace,
                     cudaStream_t stream, const ConvGather* conv = nullptr, int mode = kGemm,
                     const PatchTiles* patch = nullptr, float* bias_partials = nullptr,
                     float* column_partials = nullptr) {
  using Cfg = Config<Elem, kTileN, kResidentB>;
  constexpr bool kBf16 = sizeof(Elem) == 2;
  constexpr CUtensorMapDataType kType =
      kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  // Backward-weight reads A = dy as it lies (pixels x output channels): 64 x 64 boxes; kWgradTma
  // reads dy (as an NHWC tensor of P x Q pixels and K channels) and x over patches.
  const bool dy_is_b = mode == kWgradTmaT;
  const ConvGather dy_view =
      conv ? ConvGather{dy_is_b ? prob.b : prob.a, conv->n, conv->p, conv->q,
                        int(dy_is_b ? prob.ldb : prob.lda), conv->p, conv->q, 1, 1, 1, 1, 0, 0}
           : ConvGather{};
  // kWgradShift: x^T's slabs are 64-row boxes of its S copies of c_blocks * 64 rows.
  const int shifted_rows = patch ? patch->s * patch->c_blocks * 64 : 0;
  const CUtensorMap map_a =
      mode == kWgradShift
          ? encode_k_major(prob.a, kType, sizeof(Elem), prob.m, prob.k, prob.lda, kTileM)
      : mode == kWgradShiftT
          ? encode_k_major(prob.a, kType, sizeof(Elem), shifted_rows, prob.k, prob.lda, 64)
      : mode == kWgrad || mode == kWgradAlt
          ? encode_k_major(prob.a, kType, sizeof(Elem), prob.k, prob.m, prob.lda, 64)
      : mode == kWgradTma  ? encode_patch_map(dy_view, kType, sizeof(Elem), *patch)
      : mode == kWgradTmaT ? encode_patch_map(*conv, kType, sizeof(Elem), *patch)
      : mode == kConvTma || mode == kConvTmaBT || mode == kConvTmaSwap || mode == kConvTmaBTSwap
          ? encode_patch_map(*conv, kType, sizeof(Elem), *patch)
      : mode == kConvHaloSwap || mode == kConvHaloBTSwap  // the patch with its border
          ? encode_patch_map(*conv, kType, sizeof(Elem), halo_box(*patch))
          : mode == kGemmTT  // A stored k x m: 64-row boxes of 64 columns
                ? encode_k_major(prob.a, kType, sizeof(Elem), prob.k, prob.m, prob.lda, 64)
                : conv ? CUtensorMap{}
                       : encode_k_major(prob.a, kType, sizeof(Elem), prob.m, prob.k, prob.lda,
                                        kTileM);
  // B's dense 2 x 2 view: the filters as they are, K x 9C, in boxes of W_eff's shape.
  const bool dense_b = prob.b_dense_k > 0;
  CUDP_CHECK(!dense_b || (kBf16 && (mode == kGemm || mode == kGemmBT) && conv == nullptr &&
                          prob.b_dense_k % kTileN == 0 && prob.b_dense_c % 64 == 0),
             "matmul: the dense 2x2 view of B is read by the bf16 product kernels with K a "
             "multiple of the tile width and C of 64");
  const CUtensorMap map_b =
      dense_b ? encode_k_major(prob.b, kType, sizeof(Elem), prob.b_dense_k, 9 * prob.b_dense_c,
                               prob.ldb, mode == kGemm ? kTileN : Cfg::kBlockK)
      : mode == kWgradShift
          ? encode_k_major(prob.b, kType, sizeof(Elem), shifted_rows, prob.k, prob.ldb, 64)
      : mode == kWgrad || mode == kWgradAlt ? CUtensorMap{}
      : mode == kGemmBT || mode == kGemmTT  // B stored k x n: boxes of a k-block's rows
          ? encode_k_major(prob.b, kType, sizeof(Elem), prob.k, prob.n, prob.ldb, Cfg::kBlockK)
          : mode == kConvTmaBT || mode == kConvTmaBTSwap ||
                    mode == kConvHaloBTSwap  // the filters, K x R*S*C (the view's reduction
                                             // channels x taps*n)
                ? encode_k_major(prob.b, kType, sizeof(Elem), patch->c_blocks * 64,
                                 patch->r * patch->s * prob.n,
                                 int64_t(patch->r) * patch->s * prob.n, 64)
                : mode == kWgradTma    ? encode_patch_map(*conv, kType, sizeof(Elem), *patch)
                  : mode == kWgradTmaT ? encode_patch_map(dy_view, kType, sizeof(Elem), *patch)
                                       : encode_k_major(prob.b, kType, sizeof(Elem), prob.n, prob.k,
                                                        prob.ldb, kTileN);
  // The swapped modes' C and mask as NHWC tensors (n * P * Q pixels of ldc = n = 64 channels).
  const bool halo = mode == kConvHaloSwap || mode == kConvHaloBTSwap;
  const bool swapped = mode == kConvTmaSwap || mode == kConvTmaBTSwap || halo;
  const auto nhwc_view = [&](const void* t) {
    return ConvGather{t, conv->n, conv->p, conv->q, int(prob.ldc), conv->p, conv->q, 1, 1,
                      1, 1,       0,       0};
  };
  const CUtensorMap map_c =
      swapped ? encode_patch_map(nhwc_view(prob.c), kType, sizeof(Elem), *patch) : CUtensorMap{};
  const CUtensorMap map_mask =
      swapped && prob.mask != nullptr
          ? encode_patch_map(nhwc_view(prob.mask), kType, sizeof(Elem), *patch)
          : CUtensorMap{};
  MainloopParams p = product_params(prob, plan, kTileN, Cfg::kBlockK);
  p.workspace = workspace;
  const bool wgrad_tma = mode == kWgradTma || mode == kWgradTmaT;
  CUDP_CHECK(bias_partials == nullptr || mode == kWgradTma || (mode == kWgradTmaT && kTileN <= 128),
             "matmul: the bias gradient is taken on the way by backward-weight's patch feed only, "
             "with at most 128 channels a tile");
  p.bias_partials = bias_partials;
  p.bias_channels = mode == kWgradTma ? prob.m : prob.n;  // K either way
  CUDP_CHECK(
      column_partials == nullptr || ((mode == kConvTma || mode == kConvTmaBT || swapped) &&
                                     plan.tile_n == kTileN && column_sums_in_epilogue(prob, plan)),
      "matmul: column sums on the way are backward-data's (the TMA patches, a ReLU mask), "
      "on whole tiles without split-K");
  p.column_partials = column_partials;
  const bool shifted = mode == kWgradShift || mode == kWgradShiftT;
  const bool conv_patch = mode == kConvTma || mode == kConvTmaBT || swapped;
  p.patch = conv_patch || wgrad_tma || shifted ? *patch : PatchTiles{};
  p.split_major = shifted || (wgrad_tma && patch->split_major);
  if (conv_patch) p.tiles_m = patch->tiles_q * patch->tiles_p * patch->tiles_n;
  if (wgrad_tma) p.k_blocks = patch->tiles_q * patch->tiles_p * patch->tiles_n;
  if (plan.splits > 1 && plan.sum_in_kernel) {
    p.split_counters = arrival_counters(stream, int64_t(p.tiles_m) * p.tiles_n * (kTileM / 16),
                                        "the split-K sum's arrival counters");
  }
  const auto run = [&](auto kernel, const ConvGather& g, int shared_bytes = Cfg::kSharedBytes) {
    allow_shared_memory(reinterpret_cast<const void*>(kernel), shared_bytes);
    // A programmatic launch where the GPU allows (engine/core/launch.h): the kernel's set-up
    // overlaps the previous kernel's tail.
    launch("matmul_kernel", kernel, dim3(plan.grid), dim3(kThreads), shared_bytes, stream, map_a,
           map_b, map_c, map_mask, p, g);
  };
  if (swapped) {
    if constexpr (kBf16 && kTileN == 64 && (kResidentB == 0 || kResidentB == 9)) {
      using Swapped = Config<Elem, kTileN, kResidentB, kStagingBytesOf<kConvTmaSwap>>;
      // (The kernel writes 64 channels: n must be exactly that; a mask takes no bias or ReLU.)
      CUDP_CHECK(p.tiles_n == 1 && plan.splits == 1 && prob.c_type == DType::BF16 && prob.n == 64 &&
                     prob.ldc == prob.n && prob.beta == 0.f && p.k_blocks > 0 &&
                     (prob.mask == nullptr || (prob.bias == nullptr && !prob.relu)) &&
                     (kResidentB == 0 || p.k_blocks <= kResidentB),
                 "conv: swapped tiles need one column of 64 bf16 channels, no split-K, beta 0 and "
                 "a dense C (got ",
                 p.tiles_n, " columns, ", plan.splits, " splits, ldc ", prob.ldc, ", ", p.k_blocks,
                 " k-blocks)");
      CUDP_CHECK(halo == patch->halo &&
                     (!halo ||
                      (kResidentB == 9 && patch->c_blocks == 1 && patch->r == 3 && patch->s == 3 &&
                       patch->wb == kHaloTileW && patch->hb == kHaloTileH && patch->nb == 1)),
                 "conv: halo tiles need their tiling (halo_tiles), 3 x 3 filters over one block "
                 "of 64 channels and the filters resident");
      if (mode == kConvTmaSwap) {
        run(&matmul_kernel<Elem, kTileN, kConvTmaSwap, kResidentB>, *conv, Swapped::kSharedBytes);
      } else if (mode == kConvTmaBTSwap) {
        run(&matmul_kernel<Elem, kTileN, kConvTmaBTSwap, kResidentB>, *conv, Swapped::kSharedBytes);
      } else if constexpr (kResidentB == 9) {
        using Halo = Config<Elem, kTileN, kResidentB, kStagingBytesOf<kConvHaloSwap>,
                            kStageBytesAOf<kConvHaloSwap>>;
        if (mode == kConvHaloSwap) {
          run(&matmul_kernel<Elem, kTileN, kConvHaloSwap, kResidentB>, *conv, Halo::kSharedBytes);
        } else {
          run(&matmul_kernel<Elem, kTileN, kConvHaloBTSwap, kResidentB>, *conv, Halo::kSharedBytes);
        }
      }
      return check_launch();
    } else {
      CUDP_CHECK(false,
                 "conv: swapped tiles are bf16, 64 channels wide, with 0 or 9 k-blocks of "
                 "resident filters");
    }
  }
  if constexpr (kResidentB > 0) {
    CUDP_CHECK(
        (mode == kConvTma || mode == kConvTmaBT) && p.tiles_n == 1 && p.k_blocks <= kResidentB,
        "conv: resident filters need the TMA patches, one tile column and at most ", kResidentB,
        " k-blocks (got mode ", mode, ", ", p.tiles_n, " columns, ", p.k_blocks, " k-blocks)");
    if (mode == kConvTma) {
      run(&matmul_kernel<Elem, kTileN, kConvTma, kResidentB>, *conv);
    } else if constexpr (kBf16) {
      run(&matmul_kernel<Elem, kTileN, kConvTmaBT, kResidentB>, *conv);
    }
    return check_launch();
  } else {  // (an else: the resident instantiations compile none of the kernels below)
    if constexpr (kBf16) {
      if (mode == kWgrad) return run(&matmul_kernel<Elem, kTileN, kWgrad>, *conv), check_launch();
      if (mode == kWgradAlt)
        return run(&matmul_kernel<Elem, kTileN, kWgradAlt>, *conv), check_launch();
      if (mode == kWgradTma)
        return run(&matmul_kernel<Elem, kTileN, kWgradTma>, *conv), check_launch();
      if (mode == kWgradTmaT)
        return run(&matmul_kernel<Elem, kTileN, kWgradTmaT>, *conv), check_launch();
      if (mode == kGemmBT)
        return run(&matmul_kernel<Elem, kTileN, kGemmBT>, ConvGather{}), check_launch();
      if (mode == kGemmTT)
        return run(&matmul_kernel<Elem, kTileN, kGemmTT>, ConvGather{}), check_launch();
      if (mode == kConvTmaBT)
        return run(&matmul_kernel<Elem, kTileN, kConvTmaBT>, *conv), check_launch();
    }
    if constexpr (!kBf16) {
      CUDP_CHECK(bias_partials == nullptr, "matmul: the TF32 backward-weight takes no bias sums");
      if (mode == kWgradTma)
        return run(&matmul_kernel<Elem, kTileN, kWgradTma>, *conv), check_launch();
      if (mode == kWgradTmaT)
        return run(&matmul_kernel<Elem, kTileN, kWgradTmaT>, *conv), check_launch();
      if (mode == kWgradShift)
        return run(&matmul_kernel<Elem, kTileN, kWgradShift>, ConvGather{}), check_launch();
      if (mode == kWgradShiftT)
        return run(&matmul_kernel<Elem, kTileN, kWgradShiftT>, ConvGather{}), check_launch();
      if (mode == kGemmBT)
        return run(&matmul_kernel<Elem, kTileN, kGemmBT>, ConvGather{}), check_launch();
    }
    CUDP_CHECK(mode == kGemm || mode == kConv_ || mode == kConvTma, "matmul: mode ", mode,
               " needs ", kBf16 ? "fp32 (TF32)" : "bf16", " operands");
    if (mode == kConvTma) {
      run(&matmul_kernel<Elem, kTileN, kConvTma>, *conv);
    } else if (conv) {
      run(&matmul_kernel<Elem, kTileN, kConv_>, *conv);
    } else {
      run(&matmul_kernel<Elem, kTileN, kGemm>, ConvGather{});
    }
    check_launch();
  }
}

// Enqueues conv_halo_kernel: the forward (or, `unrotated`, backward-data on the forward's own
// filters) of `conv` on the halo tiling `patch` (conv_halo_applies, halo_tiles).
template <int kTileN>
void launch_conv_halo(const MatmulProblem& prob, const MatmulPlan& plan, const ConvGather& conv,
                      const PatchTiles& patch, bool unrotated, float* column_partials,
                      cudaStream_t stream) {
  using Cfg = HaloRings<kTileN>;
  constexpr CUtensorMapDataType kType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const bool tall = patch.wb == kHaloTileW && patch.hb == kHaloTileH && patch.nb == 1;
  const bool pairs = patch.wb == kHaloTileW && patch.hb == 8 && patch.nb == 2;
  CUDP_CHECK(patch.halo && (tall || pairs) && patch.r == 3 && patch.s == 3 && patch.pad_h <= 2 &&
                 patch.pad_w <= 2 && plan.splits == 1 && plan.tile_n == kTileN &&
                 prob.k == 9 * patch.c_blocks * 64,
             "conv: halo tiles need their tiling (halo_tiles), 3 x 3 filters, padding up to 2 and "
             "no split-K");
  const CUtensorMap map_a = encode_patch_map(conv, kType, 2, halo_box(patch));
  const CUtensorMap map_b =
      unrotated ? encode_k_major(prob.b, kType, 2, patch.c_blocks * 64, 9 * prob.n, 9 * prob.n, 64)
                : encode_k_major(prob.b, kType, 2, prob.n, prob.k, prob.ldb, kTileN);
  MainloopParams p = product_params(prob, plan, kTileN, 64);
  p.tiles_m = patch.tiles_q * patch.tiles_p * patch.tiles_n;  // the halo patches
  p.patch = patch;
  CUDP_CHECK(column_partials == nullptr || column_sums_in_epilogue(prob, plan),
             "conv: column sums on the way are backward-data's, on whole tiles");
  p.column_partials = column_partials;
  const auto kernel =
      unrotated ? &conv_halo_kernel<kTileN, true> : &conv_halo_kernel<kTileN, false>;
  allow_shared_memory(reinterpret_cast<const void*>(kernel), Cfg::kSharedBytes);
  launch("conv_halo_kernel", kernel, dim3(plan.grid), dim3(kThreads), Cfg::kSharedBytes, stream,
         map_a, map_b, p);
  check_launch();
}

// The instantiations of launch_mainloop and launch_conv_halo, each with its kernels, live in
// translation units of their own (kernels/sm90/matmul_sm90_{bf16,tf32}_*.cu) so that a parallel
// build compiles them at once (ptxas on one unit of every kernel took ~4 minutes); the dispatchers
// (matmul_sm90_bf16.cu, matmul_sm90_tf32.cu) see them as extern. EXTERN is `extern` or empty.
#define CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, T, N, R)                                               \
  EXTERN template void launch_mainloop<T, N, R>(const MatmulProblem&, const MatmulPlan&, float*, \
                                                cudaStream_t, const ConvGather*, int,            \
                                                const PatchTiles*, float*, float*)
#define CUDP_SM90_LAUNCH_CONV_HALO(EXTERN, N)                                                  \
  EXTERN template void launch_conv_halo<N>(const MatmulProblem&, const MatmulPlan&,            \
                                           const ConvGather&, const PatchTiles&, bool, float*, \
                                           cudaStream_t)
// Every instantiation the dispatchers use, by unit.
#define CUDP_SM90_BF16_64(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, __nv_bfloat16, 64, 0)
#define CUDP_SM90_BF16_128(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, __nv_bfloat16, 128, 0)
#define CUDP_SM90_BF16_256(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, __nv_bfloat16, 256, 0)
#define CUDP_SM90_BF16_SWAPPED(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, __nv_bfloat16, 64, 9)
#define CUDP_SM90_BF16_RESIDENT(EXTERN)                     \
  CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, __nv_bfloat16, 64, 18); \
  CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, __nv_bfloat16, 128, 9)
#define CUDP_SM90_BF16_HALO128(EXTERN) CUDP_SM90_LAUNCH_CONV_HALO(EXTERN, 128)
#define CUDP_SM90_BF16_HALO256(EXTERN) CUDP_SM90_LAUNCH_CONV_HALO(EXTERN, 256)
#define CUDP_SM90_TF32_64(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, float, 64, 0)
#define CUDP_SM90_TF32_128(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, float, 128, 0)
#define CUDP_SM90_TF32_256(EXTERN) CUDP_SM90_LAUNCH_MAINLOOP(EXTERN, float, 256, 0)

}  // namespace cudp::kernels::sm90
