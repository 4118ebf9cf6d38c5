// The matmul epilogue's arithmetic (kernels/matmul.h), shared by the tensor-core kernels and the
// split-K reduction so that both round alike: v = alpha*acc (+ beta*old) (+ bias) (max 0).
#pragma once


namespace cudp::kernels {

struct EpilogueArgs {
  float alpha, beta;
  const float* bias;  // one per column, or null
  int relu;
};

__device__ __forceinline__ float apply_epilogue(const EpilogueArgs& e, float acc, float old,
                                                int col) {
  float v = e.alpha * acc;
  if (e.beta != 0.f) v = fmaf(e.beta, old, v);
  if (e.bias != nullptr) v += e.bias[col];
  // ReLU as kernels/elementwise.h's: NaN kept, -0 to +0, so a fused ReLU equals a separate one.
  if (e.relu) v = v <= 0.f ? 0.f : v;
  return v;
}

}  // namespace cudp::kernels
