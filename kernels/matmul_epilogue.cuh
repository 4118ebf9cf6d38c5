// The matmul epilogue's arithmetic (kernels/matmul.h), shared by the tensor-core kernels and the
// split-K reduction so that both round alike: v = alpha*acc (+ beta*old) (+ bias) (max 0).
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

namespace cudp::kernels {

struct EpilogueArgs {
  float alpha, beta;
  const float* bias;  // one per column, or null
  int relu;
  // Or null. C's layout and type (backward-data of a layer whose input is a fused ReLU's output):
  // where it is <= 0 the value stored is 0 (NaN passes), the ReLU's backward applied to the
  // product. Only with beta 0, no bias and no ReLU (kernels/matmul.cu checks).
  const void* mask = nullptr;
  // Or 0: the bias repeats every bias_period columns (column col takes bias[col % bias_period]).
  int bias_period = 0;
};

// The bias of column `col`.
__device__ __forceinline__ float bias_of(const EpilogueArgs& e, int col) {
  return __ldg(e.bias + (e.bias_period != 0 ? col % e.bias_period : col));
}

// Each step is rounded on its own (no contraction of alpha*acc + bias into one FMA, which the
// compiler would do in one code path and not in another), so that every path that applies the
// epilogue (the general one, the tensor-core kernels' whole-tile one, the split-K reduction) gives
// the same bits.
__device__ __forceinline__ float relu_keep_nan(float v) {
  // As kernels/elementwise.h's ReLU: NaN kept, -0 to +0, so a fused ReLU equals a separate one.
  return v <= 0.f ? 0.f : v;
}

__device__ __forceinline__ float apply_epilogue(const EpilogueArgs& e, float acc, float old,
                                                int col) {
  float v = __fmul_rn(e.alpha, acc);
  if (e.beta != 0.f) v = __fmaf_rn(e.beta, old, v);
  if (e.bias != nullptr) v = __fadd_rn(v, bias_of(e, col));
  if (e.relu) v = relu_keep_nan(v);
  return v;
}

// The mask's ReLU backward at element `at` of C (row * ldc + col): relu_grad's select, so that the
// fused mask stores what a separate pass over the product's output would.
__device__ __forceinline__ float apply_mask(const EpilogueArgs& e, float v, int64_t at,
                                            bool c_is_bf16) {
  const float m = c_is_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(e.mask)[at])
                            : static_cast<const float*>(e.mask)[at];
  return m <= 0.f ? 0.f : v;
}

}  // namespace cudp::kernels
