// Typed matrix products on tensor cores: problem -> plan -> launch.
//
//   C (m x n, row-major) = epilogue(A (m x k) * B^T),  B stored n x k,
//
// i.e. both operands are K-major (row-major with k contiguous), the layout Hopper's wgmma reads for
// every precision (TF32 accepts no other) and the one a Linear layer's forward already has
// (Y = X W^T). gemm() (kernels/gemm.h) takes BLAS-style fp32 operands in any transpose and packs
// them into this form when needed.
//
// The epilogue, applied once per element in fp32 before the single rounding to C's type:
//   v = alpha * acc  (+ beta * C_old when beta != 0; C is then read, else never)
//   v += bias[col]   (when bias is given: one float per column of C, or bias[col % bias_period])
//   v = max(v, 0)    (when relu)
//
// A plan (tile shape, split-K) is chosen once per (device model, shape) and cached; the launch does
// no driver queries. With split-K, each split writes its fp32 partial tile to a workspace taken
// from the stream-ordered allocator and one reduction kernel sums the splits in a fixed order and
// applies the epilogue, so results are deterministic: the same call gives bitwise the same C.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/common.h"

namespace cudp::kernels {

enum class DType { F32, BF16 };

const char* dtype_name(DType dtype);
int dtype_size(DType dtype);

struct MatmulProblem {
  int m = 0, n = 0, k = 0;
  Math math = Math::BF16;  // BF16: A and B are bf16. TF32: A and B are fp32, rounded by the MMA.
  const void* a = nullptr;  // m x k, row stride lda (elements); k x m when a_transposed
  int64_t lda = 0;
  const void* b = nullptr;  // n x k, row stride ldb (elements); k x n when b_transposed
  int64_t ldb = 0;
  // B stored k x n (row stride ldb >= n) instead of n x k: C = A * B. BF16 through wgmma's
  // transpose bit; TF32 (whose wgmma reads K-major operands alone) transposes B's boxes in shared
  // memory. A Linear layer's backward-data (dx = dy W) reads W so, with no copy.
  bool b_transposed = false;
  // A stored k x m (row stride lda >= m) too: C = A^T * B, with b_transposed only (both operands
  // MN-major), BF16 only. A Linear layer's backward-weight (dW = dy^T x) reads dy and x so.
  bool a_transposed = false;
  // Or 0: B as stored. K and C > 0: B is the dense 2 x 2 view of a 3 x 3 convolution's filters
  // (kernels/conv2d_dense.h), read without building it: b is the filters as they are, K x 3 x 3 x
  // C (ldb = 9C), and B's element (j, l) as n x k (n = 4K, k = 4C; with b_transposed B is k x n,
  // k = 4K, n = 4C) is W_eff's, W[k'][tap(p, q)][c] for W_eff row p K + k' and column q C + c.
  // bf16, A not a_transposed, K a multiple of 256 and C of 64 (each of B's TMA boxes then lies in
  // one tap).
  int b_dense_k = 0, b_dense_c = 0;
  void* c = nullptr;  // m x n, row stride ldc (elements)
  int64_t ldc = 0;
  DType c_type = DType::F32;
  float alpha = 1.f, beta = 0.f;
  const float* bias = nullptr;  // n floats, or null
  // Or 0: bias holds bias_period floats and column j takes bias[j % bias_period] (a per-channel
  // bias over a row of several pixels' channels: the dense 2 x 2 form's outputs, 4 pixels of K).
  int bias_period = 0;
  bool relu = false;
  // Or null: C's layout and type; where it is <= 0 the stored value is 0 (the backward of a ReLU
  // whose output is `mask`, fused into backward-data). Only with beta 0, no bias and no ReLU.
  const void* mask = nullptr;
  // bf16 backward-weight on the patch feed only (detail::Feed::WgradTma / WgradTmaT; not matmul()):
  // K floats, or null. bias_grad[c] += the sum of dy's channel c over the pixels (the convolution's
  // bias gradient), taken from the dy tiles the product loads anyway (kernels/sm90/matmul_sm90.cuh,
  // wgrad_bias_sums) and the splits summed in a fixed order: deterministic. A parameter's gradient:
  // its last launch may be queued (kernels/bias.h, NOTE [Deferred bias gradients]).
  float* bias_grad = nullptr;
  // A convolution's backward-data on the TMA patch feed (detail::run_mainloop; not matmul()): n
  // floats, or null. column_sums[c] += the sum of the stored C's column c (C's values as stored,
  // after the mask), fp32, in a fixed order: the bias gradient of the layer before (Module's bias
  // hand-off). Taken in the epilogue where it can be (a ReLU mask, whole tiles, no split-K: one
  // row of partial sums per 16 rows of C, then bias_grad over them), else in a pass over C. Its
  // last launch may be queued, as bias_grad's above.
  float* column_sums = nullptr;
};

// How a product runs: C is cut into tile_m x tile_n tiles and k into `splits` chunks of
// `k_blocks_per_split` blocks of k_block elements (128 bytes of the operand type).
struct MatmulPlan {
  int tile_m = 128;
  int tile_n = 256;
  int splits = 1;
  int k_blocks_per_split = 0;
  int grid = 0;  // persistent blocks
  // With splits > 1: the splits added up in the product's own kernel (detail::splitk_in_kernel),
  // or by a reduction kernel after it. Set by the launch, once, from the process-wide switch; the
  // value a caller's plan holds is not read.
  bool sum_in_kernel = false;
};

// Bytes of split-K workspace `plan` needs for `problem` (0 without split-K).
int64_t matmul_workspace_bytes(const MatmulProblem& problem, const MatmulPlan& plan);

// Why `problem` cannot run on tensor cores on `device`, or "" when it can: the device must be
// sm_90 and the library built with its sm_90a kernels; math TF32 or BF16; pointers 16-byte
// aligned and lda, ldb multiples of 16 bytes (TMA's rule); ldc >= n; no overlap checks.
std::string matmul_unsupported_reason(const MatmulProblem& problem, int device);

// True when the library holds the sm_90a kernels and `device` is compute capability 9.0.
bool tensor_cores_available(int device);

// The cached plan for `problem` on `device` (the current device when -1).
MatmulPlan plan_matmul(const MatmulProblem& problem, int device = -1);

// Validates (throws ValueError naming the bad argument and what to do), plans and enqueues.
void matmul(const MatmulProblem& problem, cudaStream_t stream);

// matmul() with an explicit plan (tests run every tile shape and split count through it).
void matmul_with_plan(const MatmulProblem& problem, const MatmulPlan& plan, cudaStream_t stream);

// Normalises a requested (tile_n, splits) for `problem`: drops splits that would be empty.
MatmulPlan make_matmul_plan(const MatmulProblem& problem, int tile_n, int splits, int sm_count);

// The CPU reference: the same contract, products of the operands as stored (bf16 values exactly;
// fp32 values unrounded, so the TF32 rounding is part of the measured error) accumulated in
// double, C rounded to its type once.
void matmul_cpu(const MatmulProblem& problem);

namespace sm90 {
struct ConvGather;
struct PatchTiles;
}

namespace detail {

// How the mainloop's operands are fed (kernels/sm90/matmul_sm90.cuh):
//   Tma      A and B by TMA, K-major (matmul);
//   Im2col   A gathered as im2col of conv->x, B (filters) by TMA (forward, backward-data);
//   Wgrad    backward-weight, bf16: A = dy (problem.a, pixels x K) by TMA, B = im2col(conv->x)
//            gathered, both MN-major; WgradAlt swaps the MN-major descriptor offsets (a test of
//            which layout the hardware wants; see the tests).
//   ConvTma  forward / backward-data with A as 4-D TMA boxes of conv->x over `patch` tiles.
//   ConvTmaUnrotated backward-data (bf16) as ConvTma, with B = the forward's filters (K x R*S*C,
//            problem.b) read per tap rotated by 180 degrees instead of a rotated copy.
//   WgradTma backward-weight with both operands as 4-D TMA boxes over `patch` tiles of 64 output
//            pixels in bf16, 32 in TF32 (dy for A, conv->x shifted by each tap for B; TF32's
//            boxes are transposed in shared memory); problem.k = patches * pixels a patch.
//            WgradTmaT computes dw^T instead (A = im2col(conv->x)^T, B = dy = problem.b).
//   WgradShift backward-weight in TF32 where the boxes do not apply (strided layers, other
//            channel counts): A = dy^T and B = x^T, K-major fp32 copies on a padded
//            pixel grid, each 64-row slab of B shifted along it by its tap (`patch` holds the
//            taps and the grid width); WgradShiftT computes dw^T (A = x^T, B = dy^T).
enum class Feed {
  Tma,
  Im2col,
  Wgrad,
  WgradAlt,
  ConvTma,
  ConvTmaUnrotated,
  WgradTma,
  WgradTmaT,
  WgradShift,
  WgradShiftT
};

// sums[c] += the sum of column c of the rows x cols matrix c (no gaps between rows) of `type`:
// MatmulProblem::column_sums' pass where the epilogue does not take them. sums is a parameter's
// gradient (the bias hand-off): its last launch may be queued (kernels/bias.h, NOTE [Deferred bias
// gradients]).
void add_column_sums(const void* c, DType type, float* sums, int64_t rows, int64_t cols,
                     cudaStream_t stream);

// Split-K's sum: in the mainloop kernel (on: the last of a tile's splits to write its slice of the
// workspace adds every split's slice up, in split order, and applies the epilogue) or by a
// reduction kernel after it (off, the default). The same sums in the same order, so the same bits.
// In the kernel saves a launch but measured 1.5x slower on VGG-16's 32^2 step: a wave's splits
// finish together, and one warp per slice then reads every split's slice in turn, where the
// reduction kernel spreads those reads over the GPU (bench/NOTES-tensor-cores.md, session 28).
// For the tests and bench_train --splitk; process-wide.
void set_splitk_in_kernel(bool on);
bool splitk_in_kernel_enabled();
// The reduction kernel four columns a thread (16-byte loads of the workspace, its splits' loads
// issued eight at a time, one store of the four results) where n, ldc and the pointers allow, or
// one element a thread (off; on by default: +0.6 to +1.4% at 32² on an H100, bench_train --splitk
// kernel against kernel4, session 34). Every element's arithmetic is the same, so the same bits.
// For the tests and bench_train; process-wide.
void set_splitk_reduce_vectorized(bool on);
bool splitk_reduce_vectorized();
// Whether the four-column kernel can take `problem`'s reduction (the switch aside): n and ldc
// multiples of 4, C aligned to four of its elements (the workspace always is).
bool splitk_reduce4_applies(const MatmulProblem& problem);
// Whether `plan`'s split-K sum is taken in the kernel: the switch on, 2 to kMaxSplitsInKernel
// splits (more would make the last split's block add up a long column alone).
inline constexpr int kMaxSplitsInKernel = 16;
bool splitk_in_kernel(const MatmulPlan& plan);

// Runs a validated problem with `plan`: split-K workspace, the sm_90a mainloop, the split-K
// reduction (in the kernel or after it: splitk_in_kernel).
void run_mainloop(const MatmulProblem& problem, const MatmulPlan& plan,
                  const sm90::ConvGather* conv, cudaStream_t stream, Feed feed = Feed::Tma,
                  const sm90::PatchTiles* patch = nullptr);

// Throws ValueError unless the current device can run tensor-core math (an sm_90 GPU and a build
// with the sm_90a kernels): "<what>: <math> runs on tensor cores and needs an sm_90 GPU ...; use
// Math::FP32". Returns the current device.
int require_tensor_cores(const char* what, Math math);

// The multiprocessor count of `device`, read once and cached (launch paths make no driver queries).
int multiprocessor_count(int device);

// gemm()'s tensor-core path (kernels/gemm.h, math TF32 or BF16): packs op(A) and op(B) into K-major
// operands of the math's type where they are not already usable as they are (a transpose, a cast
// to bf16, an unaligned row), in one workspace from the stream-ordered allocator, then runs
// matmul() with alpha and beta. Arguments are checked by the caller.
void gemm_tensor_cores(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                       const float* A, int lda, const float* B, int ldb, float beta, float* C,
                       int ldc, cudaStream_t stream, Math math);

}  // namespace detail
}  // namespace cudp::kernels
