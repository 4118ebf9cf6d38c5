// A 3 x 3 convolution of stride 1 and padding 1 on a 2 x 2 image, as a dense map (VGG's last
// three layers at 32 x 32). Every (output pixel, input pixel) pair of a 2 x 2 image meets through
// one tap of the 3 x 3 filter, so the layer is a dense map of 4C input features to 4K output
// features per image:
//
//   y[n][p][k] = sum over q, c of x[n][q][c] * W[k][qy - py + 1][qx - px + 1][c]
//
// (p = 2 py + px the output pixel, q = 2 qy + qx the input pixel, W stored K x 3 x 3 x C). With
//
//   W_eff [4K][4C],  W_eff[p K + k][q C + c] = W[k][qy - py + 1][qx - px + 1][c],
//
// and the NHWC activations read as matrices (x as [N][4C], y and dy as [N][4K]):
//   forward          y  = x W_eff^T + bias_eff         (bias_eff[p K + k] = bias[k])
//   backward-data    dx = dy W_eff
//   backward-weight  dW_eff = dy^T x, then dW[k][r][s][c] = the sum of dW_eff's blocks (p, q)
//                    whose tap is (r, s): 4 pairs for the centre tap, 2 for an edge, 1 for a
//                    corner.
// Plain products (kernels/matmul.h), without the im2col's padding: 5/9 of an implicit GEMM's row
// of a 2 x 2 layer is zeros, 16 of the 36 tap-pixel pairs are real (bench/NOTES-tensor-cores.md,
// session 42). The two kernels here build W_eff and fold dW_eff back; each has a CPU reference
// with the same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "kernels/conv2d.h"
#include "kernels/matmul.h"

namespace cudp::kernels {

// The tap (r, s), as 3 r + s, through which output pixel p meets input pixel q of a 2 x 2 image
// (p = 2 py + px, q = 2 qy + qx): W_eff's block (p, q) is that tap's filters. The one definition
// of the form's geometry, for its kernels, the products' view of W_eff and the CPU references.
__host__ __device__ constexpr int dense_2x2_tap(int p, int q) {
  return ((q >> 1) - (p >> 1) + 1) * 3 + ((q & 1) - (p & 1) + 1);
}

// Whether `shape` is such a layer: 2 x 2 input, 3 x 3 filters, stride 1, padding 1, and C and K
// multiples of 8 (16-byte rows of bf16 for the products' loads).
bool conv2d_dense_2x2_applies(const Conv2dShape& shape);

// Whether the forward and backward-data products of such a layer can read W_eff as a view of the
// bf16 filters as they are (MatmulProblem::b_dense_k: K a multiple of 256, C of 64; VGG's 512
// channels), with the bias by period K (MatmulProblem::bias_period), instead of a gathered copy.
bool conv2d_dense_2x2_view_applies(const Conv2dShape& shape);

// w_eff (4K x 4C bf16) from the filters w (K x 3 x 3 x C, bf16, or fp32 rounded to nearest even as
// f32_to_bf16 rounds: the same bits from either), and, when `bias` is given, bias_eff (4K floats,
// bias four times). `shape` must be one that conv2d_dense_2x2_applies to.
void conv2d_dense_2x2_filters(const __nv_bfloat16* w, const Conv2dShape& shape,
                              __nv_bfloat16* w_eff, const float* bias, float* bias_eff,
                              cudaStream_t stream);
void conv2d_dense_2x2_filters(const float* w, const Conv2dShape& shape, __nv_bfloat16* w_eff,
                              const float* bias, float* bias_eff, cudaStream_t stream);
void conv2d_dense_2x2_filters_cpu(const __nv_bfloat16* w, const Conv2dShape& shape,
                                  __nv_bfloat16* w_eff, const float* bias, float* bias_eff);
void conv2d_dense_2x2_filters_cpu(const float* w, const Conv2dShape& shape, __nv_bfloat16* w_eff,
                                  const float* bias, float* bias_eff);

// dw (K x 3 x 3 x C) = beta * dw + the fold of dw_eff (4K x 4C floats): for each tap, its (p, q)
// blocks added in the order of p, from 0, in fp32; then fma(beta, dw, sum) (dw is not read when
// beta is 0: a deferred zero_grad's gradient may hold anything).
void conv2d_dense_2x2_fold(const float* dw_eff, const Conv2dShape& shape, float* dw, float beta,
                           cudaStream_t stream);
void conv2d_dense_2x2_fold_cpu(const float* dw_eff, const Conv2dShape& shape, float* dw,
                               float beta);

namespace detail {
// Throws ValueError naming `what` and the shape when conv2d_dense_2x2_applies rejects it.
void check_conv2d_dense_2x2(const char* what, const Conv2dShape& shape);
// Whether Conv2d runs the layers conv2d_dense_2x2_applies to in the dense form under the bf16
// policy on the GPU (on, the default), or as the other layers (off: to compare). Process-wide;
// for the tests and bench_train --dense-2x2.
void set_conv_dense_2x2(bool on);
bool conv_dense_2x2();
// Whether Conv2d's dense form reads W_eff as a view of the filters where
// conv2d_dense_2x2_view_applies (on, the default) or gathers it (off: to compare). Process-wide;
// for the tests and bench_train --dense-2x2-view.
void set_conv_dense_2x2_view(bool on);
bool conv_dense_2x2_view();
// The split-K count and tile width of the form's forward and backward-data products (m = the
// batch: few rows of tiles, so the planner's tiles may fill part of the GPU). Splits: 0, the
// default, the planner's count when the tile width is the planner's too, else 1; n > 0, n splits.
// Tile width: 0, the default, the planner's; else 64, 128 or 256. Process-wide; for the tests and
// bench_train --dense-2x2-splits and --dense-2x2-tile.
void set_conv_dense_2x2_splits(int splits);
int conv_dense_2x2_splits();
void set_conv_dense_2x2_tile(int tile_n);
int conv_dense_2x2_tile();
// matmul() for one of those products, with the split count and tile width above where set.
void conv_dense_2x2_matmul(const MatmulProblem& problem, cudaStream_t stream);
}  // namespace detail

}  // namespace cudp::kernels
