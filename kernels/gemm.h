// fp32 matrix product, row-major, BLAS semantics: C = alpha * op(A) * op(B) + beta * C.
//
//   op(A) is m x k: A (stored m x k, lda >= k), or with trans_a A^T (A stored k x m, lda >= m).
//   op(B) is k x n: B (stored k x n, ldb >= n), or with trans_b B^T (B stored n x k, ldb >= k).
//   C is m x n with ldc >= n. A leading dimension counts the elements from one row to the next.
//
// As in BLAS, beta == 0 does not read C (it may hold NaN or garbage) and alpha == 0 (or k == 0)
// does not read A and B. m, n or k may be 0. A and B must not overlap C.
//
// The CUDA path is our own SIMT kernel (kernels/gemm.cu); cuBLAS is only the tests' oracle and the
// benchmark's bar (docs/architecture.md §2.6). Results are deterministic: the same call on the same GPU model
// gives bitwise the same C, run after run. When the plan splits k (see GemmPlan), gemm() takes a
// temporary workspace from the stream-ordered allocator (cudaMallocAsync/cudaFreeAsync on
// `stream`); keep the device's memory pool release threshold raised (docs/architecture.md §2.4) so that this
// is a reuse, not an allocation from the driver.
//
// Linear layers use it as: forward Y = X W^T (trans_b), backward-data dX = dY W, backward-weight
// dW += dY^T X (trans_a, beta = 1).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/common.h"

namespace cudp::kernels {

// Enqueues the product on `stream`. Throws ValueError for invalid arguments (negative sizes, a
// leading dimension smaller than its row, a null pointer that would be used, a math mode that is
// not implemented) before anything is enqueued.
void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream,
          Math math = Math::FP32);

// The CPU reference: the same contract, products accumulated in double, C rounded to fp32 once.
void gemm_cpu(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* A, int lda,
              const float* B, int ldb, float beta, float* C, int ldc);

namespace detail {

// How gemm() runs a product: C is cut into tile_m x 128 tiles (tile_m is 128 or 64), and k into
// `splits` chunks of k_chunk (a multiple of 8 when splits > 1; only the last chunk may be shorter;
// none is empty). With splits > 1 each chunk's partial product goes to a workspace and a second
// kernel sums the chunks in a fixed order, so split-K stays deterministic.
struct GemmPlan {
  int tile_m = 128;
  int splits = 1;
  int k_chunk = 0;
};

// Normalises a requested (tile_m, splits) for k: rounds the chunk up to a multiple of 8 and drops
// the splits that would be empty. tile_m must be 64 or 128 and splits >= 1.
GemmPlan make_gemm_plan(int tile_m, int splits, int k);

// The plan gemm() uses on a GPU with `sm_count` multiprocessors: a small cost model (the tiles the
// busiest SM computes times the k each walks, slowed when the SM holds few warps, plus the split-K
// reduction's traffic) evaluated over both tile heights and 1..32 splits. A pure function of its
// arguments, so the same shape always gets the same plan on the same GPU model.
GemmPlan plan_gemm(int m, int n, int k, int sm_count);

// gemm() with an explicit plan instead of plan_gemm()'s choice (tests run every kernel variant
// through it). Validates the arguments like gemm().
void gemm_with_plan(const GemmPlan& plan, bool trans_a, bool trans_b, int m, int n, int k,
                    float alpha, const float* A, int lda, const float* B, int ldb, float beta,
                    float* C, int ldc, cudaStream_t stream);

// The argument checks shared by gemm() and gemm_cpu(); throws ValueError naming the bad value.
void check_gemm_args(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* A,
                     int lda, const float* B, int ldb, float* C, int ldc);

}  // namespace detail
}  // namespace cudp::kernels
