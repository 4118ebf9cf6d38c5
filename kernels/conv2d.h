// 2-D convolution (cross-correlation, as PyTorch's Conv2d), fp32, forward and both backward passes.
//
// Layouts (docs/architecture.md §2.2): activations x, y, dx, dy are NHWC; weights w, dw are KRSC (K output
// channels, an R x S filter, C input channels), so one output channel's filter is R*S*C contiguous
// floats. PyTorch's OIHW checkpoints are converted at load time, not here.
//
// Each pass is an implicit GEMM (kernels/conv2d.cu explains the tiling):
//   forward          y  = x (*) w      M = N*P*Q  GEMM-N = K  reduction = R*S*C
//   backward_data    dx = dy (*) w^T   M = N*H*W  GEMM-N = C  reduction = R*S*K
//   backward_weight  dw = dy^T (*) x   M = K      GEMM-N = R*S*C  reduction = N*P*Q
// Activation gradients are written (dx =), parameter gradients accumulate when asked (dw = beta*dw
// + grad), following docs/architecture.md §2.1. The bias gradient is a reduction of dy and lives with the bias
// kernels, not here.
//
// Every launcher validates the shape and throws ValueError before touching the GPU. Results are
// deterministic: no atomics, and a split reduction is summed in a fixed order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common.h"
#include "kernels/matmul.h"

namespace cudp::kernels {

struct Conv2dShape {
  int n = 0, h = 0, w = 0, c = 0;  // input: batch, height, width, channels
  int k = 0, r = 0, s = 0;         // filters: output channels, height, width
  int stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;

  // Output height and width: (h + 2*pad_h - r)/stride_h + 1 and likewise.
  int p() const;
  int q() const;

  // Throws ValueError naming the first bad field: sizes and strides must be positive, pads
  // non-negative, the output at least 1 x 1, and the GEMM extents must fit in int.
  void validate() const;

  int64_t x_size() const { return int64_t(n) * h * w * c; }
  int64_t w_size() const { return int64_t(k) * r * s * c; }
  int64_t y_size() const { return int64_t(n) * p() * q() * k; }
  // Multiply-adds times two, the same for each of the three passes.
  double flops() const { return 2.0 * double(n) * p() * q() * k * r * s * c; }
};

// Operands a caller already converted for Math::BF16 (conv2d_to_bf16: bf16, channels padded with
// zeros to bf16_channels), so that each is converted once: a layer keeps x from the forward for
// backward-weight and converts dy once for both backward passes. A null member is converted by
// the call that needs it; the other maths take none.
struct Bf16Operands {
  const void* x = nullptr;   // n x h x w x bf16_channels(c)
  const void* dy = nullptr;  // n x p x q x bf16_channels(k)
};
// Channels of a converted operand: c rounded up to a multiple of 8 (16-byte rows).
int bf16_channels(int c);
// dst (pixels x bf16_channels(c) bf16) = src (pixels x c floats), rounded to nearest even.
void conv2d_to_bf16(const float* src, int64_t pixels, int c, void* dst, cudaStream_t stream);
// The same from bf16 activations (src: pixels x c bf16): a copy with the channels padded.
void conv2d_pad_bf16(const void* src, int64_t pixels, int c, void* dst, cudaStream_t stream);

// y = relu?(conv(x, w) + bias). bias (K floats) may be null; relu applies max(., 0) after the bias.
void conv2d_forward(const Conv2dShape& shape, const float* x, const float* w, const float* bias,
                    float* y, bool relu, cudaStream_t stream, Math math = Math::FP32,
                    const Bf16Operands& converted = {});
void conv2d_forward_cpu(const Conv2dShape& shape, const float* x, const float* w, const float* bias,
                        float* y, bool relu);

// dx = d(sum y*dy)/dx, written (not accumulated).
void conv2d_backward_data(const Conv2dShape& shape, const float* dy, const float* w, float* dx,
                          cudaStream_t stream, Math math = Math::FP32,
                          const Bf16Operands& converted = {});
void conv2d_backward_data_cpu(const Conv2dShape& shape, const float* dy, const float* w, float* dx);

// dw = beta*dw + d(sum y*dy)/dw. beta = 1 accumulates parameter gradients; beta = 0 overwrites dw
// without reading it (so dw may hold garbage, even NaN).
// dbias (K floats) or null: the bias gradient, accumulated: dbias[k] += the sum of dy's channel k
// over the n*P*Q pixels, dy as the product reads it (bf16 under Math::BF16), in fp32 and in a fixed
// order: kernels::bias_grad's reduction (under bf16 with stride 1 and C a multiple of 64 it can be
// taken from the dy tiles the product loads instead: detail::set_wgrad_bias_fusion). Inside a
// Module's backward it is complete when the backward ends (kernels/bias.h, NOTE [Deferred bias
// gradients]).
void conv2d_backward_weight(const Conv2dShape& shape, const float* x, const float* dy, float* dw,
                            float beta, cudaStream_t stream, Math math = Math::FP32,
                            const Bf16Operands& converted = {}, float* dbias = nullptr);
void conv2d_backward_weight_cpu(const Conv2dShape& shape, const float* x, const float* dy,
                                float* dw, float beta);

// ---- tensor cores (Math::TF32, Math::BF16; sm_90) ---------------------------------------------
//
// The float launchers above take Math::TF32 and Math::BF16 too: they run these kernels on fp32
// tensors, converting x and w to bf16 (BF16) or padding their channels (TF32) in a workspace where
// the kernels need it. The typed entry points below take operands already in the math's type (bf16
// for BF16, fp32 for TF32): what a bf16 training step and the benchmarks use.
//
// Requirements: an sm_90 GPU (tensor_cores_available()); any channel counts (they are padded to
// 16 bytes' worth when they are not); backward-data with stride 1 only (it runs as the forward
// convolution of dy with the filters rotated by 180 degrees and K and C swapped). Backward-weight
// in TF32 takes fp32 x and dy through the float launcher only: TF32 wgmma reads only K-major
// operands, and backward-weight's reduction runs along the rows of x and dy (MN-major), so the
// launcher first writes K-major fp32 copies of both (a pass over each; kernels/conv2d_tc.cu),
// except for inputs of at most 4 channels and 64 output channels (kernels/conv2d_narrow.h).
struct ConvOperands {
  Math math = Math::BF16;
  const void* x = nullptr;  // NHWC input (dy for backward-data)
  const void* w = nullptr;  // KRSC filters
  void* y = nullptr;        // NHWC output (dx for backward-data)
  DType y_type = DType::F32;
  const float* bias = nullptr;  // forward only: K floats, or null
  bool relu = false;            // forward only
  // Backward-data only, or null: the layer's input x (dx's layout and type). Where x is <= 0,
  // dx is stored as 0: the backward of the ReLU that produced x, fused into the epilogue.
  const void* mask = nullptr;
  // Backward-data only, or null: dx's C floats; column_sums[c] += the sum of the stored dx's
  // channel c over n, h and w (fp32, deterministic; in the epilogue where it can be, with a mask:
  // MatmulProblem::column_sums): the bias gradient of the layer before, Module's bias hand-off;
  // complete when a Module's backward ends (NOTE [Deferred bias gradients]).
  float* column_sums = nullptr;
  // Forward only: where x and w carry channels past this many as zeros (a layer's padding of its
  // C to 16-byte rows), their count, which lets VGG's first layer (3 of 8) skip more of the zeros'
  // products; 0 (the default) claims nothing.
  int live_channels = 0;
};

// y = relu?(conv(x, w) + bias), typed operands. x and w must be 16-byte aligned with C a multiple
// of 8 (bf16) or 4 (fp32).
void conv2d_forward_tc(const Conv2dShape& shape, const ConvOperands& ops, cudaStream_t stream);

// dx = conv^T(dy, w), typed operands: ops.x is dy (N x P x Q x K), ops.y is dx. K a multiple of
// 8 (bf16) or 4 (fp32); stride 1. In bf16 with K a multiple of 64 the kernel reads w as it is,
// rotated per tap (conv2d_backward_data_reads_filters_as_they_are); otherwise the filters are
// rotated into a workspace first.
void conv2d_backward_data_tc(const Conv2dShape& shape, const ConvOperands& ops,
                             cudaStream_t stream);

// Whether conv2d_backward_data_tc in bf16 reads `shape`'s filters as they are (no rotated copy
// made per call, none needed beforehand): stride 1, K a multiple of 64.
bool conv2d_backward_data_reads_filters_as_they_are(const Conv2dShape& shape);

// The same with the filters already rotated: ops.w is C x R x S x K (conv2d_filters_to_bf16's
// `rotated`), so nothing is rotated per call (TF32, and bf16 layers whose K is not a multiple of
// 64).
void conv2d_backward_data_tc_rotated(const Conv2dShape& shape, const ConvOperands& ops,
                                     cudaStream_t stream);

// A layer's fp32 filters (K x R x S x C) as the bf16 operands of its products, in one pass: dst
// (K x R x S x bf16_channels(C), channels zero-padded) for forward and backward-weight and, when
// `rotated` is not null, the rotated filters of backward-data (C x R x S x K: w'[c][r][s][k] =
// w[k][R-1-r][S-1-s][c]).
void conv2d_filters_to_bf16(const float* w, const Conv2dShape& shape, void* dst, void* rotated,
                            cudaStream_t stream);

// dw = beta*dw + dy^T (*) x on tensor cores, bf16 x (C a multiple of 8) and dy (K a multiple of 8),
// fp32 dw (weight gradients accumulate in fp32); deterministic split over the n*P*Q pixels.
// dbias: as conv2d_backward_weight's (K floats, accumulated, or null).
// live_channels: as ConvOperands' (x's channels past it zeros; 0 claims nothing).
void conv2d_backward_weight_tc(const Conv2dShape& shape, const void* x, const void* dy, float* dw,
                               float beta, cudaStream_t stream, float* dbias = nullptr,
                               int live_channels = 0);

namespace detail {
// The float launchers' tensor-core paths (kernels/conv2d_tc.cu).
void conv2d_forward_tc_f32(const Conv2dShape& shape, const float* x, const float* w,
                           const float* bias, float* y, bool relu, cudaStream_t stream, Math math,
                           const Bf16Operands& converted);
void conv2d_backward_data_tc_f32(const Conv2dShape& shape, const float* dy, const float* w,
                                 float* dx, cudaStream_t stream, Math math,
                                 const Bf16Operands& converted);
// dbias under BF16 only (the bias gradient of the bf16 dy the product reads); under TF32 the float
// launcher reduces the fp32 dy itself.
void conv2d_backward_weight_tc_f32(const Conv2dShape& shape, const float* x, const float* dy,
                                   float* dw, float beta, cudaStream_t stream, Math math,
                                   const Bf16Operands& converted, float* dbias);
// The MN-major descriptor layout the backward-weight kernels use: 0 or 1 forces one for the tests
// that establish which is right; -1 (the default) is the established one.
void set_wgrad_descriptor_variant(int variant);
// How the tensor-core convolutions of stride-1 layers whose C is a multiple of the k-block feed
// their gathered operand: `patch` (the default: 4-D TMA boxes over patch tiles, the faster on every
// VGG-16 shape measured) or `gather` (the im2col gather that every other layer uses). `gather` also
// turns off the forward and backward-weight kernels of inputs with one 16-byte chunk of channels
// (kernels/conv2d_narrow.h), so that those layers run on the mainloop. `patch_streamed` is `patch`
// with the filters streamed through the pipeline stages even where they would stay resident in
// shared memory (bf16 layers of 64 output channels): the same products, for the tests that compare
// the two bit for bit. The tests run every feed, and bench_conv2d --feed times them.
enum class ConvFeed { patch, gather, patch_streamed };
void set_conv_feed(ConvFeed feed);
// How many k-blocks of bf16 filters the forward of `shape` (or, with backward_data, the forward
// view that runs its backward-data) keeps resident in shared memory under the current feed: 0
// where they are streamed through the stages. For the tests that must know which kernel ran.
int conv2d_resident_filter_blocks(const Conv2dShape& shape, bool backward_data);
// Whether the bf16 convolutions of a 64-channel output (the forward of K = 64, backward-data into
// C = 64) run with the operands' roles swapped: the filters as wgmma's A, 128 output pixels as its
// N (one m64n128k16 per k16 step of a 128 x 64 tile instead of two m64n64k16, a quarter less
// shared-memory traffic), the tile transposed on its way out through shared memory. On by default
// (bench/NOTES-tensor-cores.md); off for the tests that compare the two and bench_conv2d --swap.
void set_conv_swapped(bool on);
bool conv_swapped();  // the switch's setting
// Whether the typed bf16 call of `shape` (or its backward-data, whose output has shape.c
// channels) with a dense bf16 output takes the swapped tiles under the current settings.
bool conv2d_swapped_tiles(const Conv2dShape& shape, bool backward_data);
// Whether the swapped tiles of a 3 x 3 layer over 64 reduction channels (the forward of 64 -> 64,
// backward-data into 64 channels from 64) read their nine taps from one input box per tile, the
// patch with its border (halo tiles: patches of 8 x 16 pixels, a ninth of the input traffic),
// rather than nine shifted boxes. On by default; off for the tests that compare the two and
// bench_conv2d --halo.
void set_conv_halo(bool on);
// The same for the layers 128 or 256 channels wide (the input box of a channel block held in a ring
// of its own while that block's filters stream through a second ring), where set_conv_halo is on:
// `exact` on outputs 8 x 16 patches tile exactly; `pairs` (the default) also on those whose height
// is a multiple of 8 only (56 x 56), with 8 x 8 patches over two images (faster there by
// measurement); `covering` instead 8 x 16 patches that hang over the edges by up to 1/8 of their
// pixels (slower at 56 x 56 by measurement; for the tests); `off` (bench_conv2d --halo swapped).
enum class HaloWide { off, exact, pairs, covering };
void set_conv_halo_wide(HaloWide mode);
// For the tests: the tile width of the tensor-core forward and backward-data products (64, 128 or
// 256, without split-K), so that small shapes run the kernels of VGG's wide layers; 0 (the
// default) leaves the choice to the planner.
void set_conv_tile_n(int tile_n);
// Whether the typed bf16 call of `shape` (or its backward-data) takes halo tiles under the current
// settings.
bool conv2d_halo_tiles(const Conv2dShape& shape, bool backward_data);
// Whether the bf16 backward-weight of the patch feed takes the bias gradient from the dy tiles it
// loads (two spare producer warps add them up) instead of the separate reduction: off by default,
// since it measured slower (bench/NOTES-tensor-cores.md); for the tests and bench_conv2d.
void set_wgrad_bias_fusion(bool on);
// Whether the bf16 backward-weight of `shape` (channels already multiples of 8) takes the bias
// gradient from its own dy tiles under the current settings, rather than in a separate reduction.
bool conv2d_backward_weight_fuses_bias(const Conv2dShape& shape);
// The order of the bf16 backward-weight's split-K work items (TMA patches): split-major (the
// default: the blocks running at one time read the same pixels) or tile-major. The same sums in
// the same order either way; for the test that shows it and bench_conv2d --wgrad-order.
void set_wgrad_split_major(bool split_major);
// How the TF32 backward-weight of stride-1 layers (C a multiple of 32) reads its operands: `boxes`
// (TMA boxes over patches of output pixels, transposed in shared memory to the K-major layout TF32
// wgmma needs), `copies` (K-major copies of x and dy written first, then read by TMA), or
// `automatic` (the default: the boxes wherever they apply, the faster on every VGG-16 layer
// measured; bench/NOTES-tensor-cores.md). For the tests, which run both, and bench_conv2d
// --tf32-wgrad.
enum class Tf32WgradFeed { automatic, boxes, copies };
void set_tf32_wgrad_feed(Tf32WgradFeed feed);
// For the tests: the tile width (64, 128 or 256) and split-K count (at most one per k-block; fewer
// where the k-blocks run out) of the TF32 backward-weight's boxes, so that every kernel and every
// count of k-blocks a work item takes runs on small shapes; (0, 0), the default, leaves both to the
// planner.
void set_tf32_wgrad_plan(int tile_n, int splits);
// Whether the TF32 backward-weight of `shape` takes the boxes under the current settings (for
// 16-byte aligned tensors): for the tests that must know which kernel ran.
bool conv2d_backward_weight_tf32_boxes(const Conv2dShape& shape);
}  // namespace detail

}  // namespace cudp::kernels
