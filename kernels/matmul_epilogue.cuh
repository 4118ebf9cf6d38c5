// The matmul epilogue's arithmetic (kernels/matmul.h), shared by the tensor-core kernels and the
// split-K reduction so that both round alike: v = alpha*acc (+ beta*old) (+ bias) (max 0).
#pragma once


namespace cudp::kernels {

struct EpilogueArgs {
  float alpha, beta;
  const float* bias;  // one per column, or null
  int relu;
};

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
  if (e.bias != nullptr) v = __fadd_rn(v, e.bias[col]);
  if (e.relu) v = relu_keep_nan(v);
  return v;
}

}  // namespace cudp::kernels
