#include "layers/precision.h"

#include "engine/core/error.h"
#include "kernels/layout.h"

namespace cudp {

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::fp32:
      return "fp32";
    case Precision::tf32:
      return "tf32";
    case Precision::bf16:
      return "bf16";
  }
  return "?";
}

Precision parse_precision(const std::string& name) {
  for (Precision p : {Precision::fp32, Precision::tf32, Precision::bf16}) {
    if (name == precision_name(p)) return p;
  }
  throw ValueError(detail::str("unknown precision \"", name, "\": use fp32, tf32 or bf16"),
                   __FILE__, __LINE__);
}

kernels::Math precision_math(Precision precision) {
  switch (precision) {
    case Precision::tf32:
      return kernels::Math::TF32;
    case Precision::bf16:
      return kernels::Math::BF16;
    case Precision::fp32:
      break;
  }
  return kernels::Math::FP32;
}

OperandView::OperandView(const float* data, int64_t n, Precision precision) : data_(data) {
  if (precision != Precision::bf16 || n == 0) return;
  std::vector<__nv_bfloat16> bf16(static_cast<size_t>(n));
  kernels::f32_to_bf16_cpu(data, bf16.data(), n);
  rounded_.resize(static_cast<size_t>(n));
  kernels::bf16_to_f32_cpu(bf16.data(), rounded_.data(), n);
}

}  // namespace cudp
