// The precision policy of a model: how its products are computed, chosen once for the whole model
// with Module::set_precision (replicas and clones inherit it).
//
//   fp32  fp32 storage, fp32 products (the SIMT kernels; every GPU).
//   tf32  fp32 storage, TF32 tensor-core products (10-bit mantissa operands, fp32 accumulation)
//         for every Conv2d and Linear product, forward and backward; activations, gradients,
//         weights and optimizer state stay fp32.
//   bf16  bf16 operands for every Conv2d and Linear product (rounded to nearest even), fp32
//         accumulation, fp32 weight gradients; the fp32 master weights stay the parameters.
//         Activations and their gradients are bf16 between the layers that take bf16
//         (Module::takes_bf16: Conv2d, BatchNorm2d, ReLU, MaxPool2d, Flatten, Linear's input,
//         the containers): Conv2d writes bf16 (bias and a following ReLU applied in fp32 before the
//         rounding), BatchNorm2d writes its input's dtype, Linear writes fp32. A
//         layer that does not take bf16 gets its input converted to f32 and returns its input
//         gradient converted back, so a gradient always has the dtype of its value. BatchNorm's
//         statistics and arithmetic, softmax / cross-entropy and the loss are fp32.
//
// tf32 and bf16 need an sm_90 GPU (kernels/matmul.h); on another GPU their first product throws
// ValueError saying so (no silent fallback to fp32). On the CPU, layers emulate the policy's
// operand rounding (OperandView below) so that the CPU path is the GPU path's reference: bf16
// operands are rounded to nearest even, as the GPU's conversion does; tf32 operands are truncated
// to TF32 (10 mantissa bits, kernels/layout.h: the tensor core reads only the top 19 bits of the
// fp32 operands it is given), then the fp32 CPU references run, accumulation and all else as fp32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/tensor.h"
#include "kernels/common.h"

namespace cudp {

enum class Precision : uint8_t { fp32, tf32, bf16 };

// "fp32", "tf32", "bf16".
const char* precision_name(Precision precision);
// The inverse of precision_name; throws ValueError naming the accepted values.
Precision parse_precision(const std::string& name);
// The GEMM math a Conv2d or Linear runs under the policy.
kernels::Math precision_math(Precision precision);

// An fp32 operand as the policy's products see it, for the CPU path: under bf16 a rounded copy
// (round to nearest even, what the GPU's conversion does), under tf32 a truncated copy (what the
// tensor core reads of an fp32 operand), under fp32 the data itself.
class OperandView {
 public:
  OperandView(const float* data, int64_t n, Precision precision);
  const float* get() const { return rounded_.empty() ? data_ : rounded_.data(); }

 private:
  const float* data_;
  std::vector<float> rounded_;
};

// `t` converted to `dtype`, f32 <-> bf16 (rounding to nearest even; bf16 -> f32 is exact), on t's
// device and, for a GPU tensor, enqueued on that device's current stream. A tensor already of
// `dtype` is returned as is (shared, like PyTorch's .to(dtype)).
Tensor convert(const Tensor& t, DType dtype);

}  // namespace cudp
