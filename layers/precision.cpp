#include "layers/precision.h"

#include "engine/core/device.h"
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
  if (precision == Precision::fp32 || n == 0) return;
  rounded_.resize(static_cast<size_t>(n));
  if (precision == Precision::tf32) {
    kernels::f32_to_tf32_cpu(data, rounded_.data(), n);
    return;
  }
  std::vector<__nv_bfloat16> bf16(static_cast<size_t>(n));
  kernels::f32_to_bf16_cpu(data, bf16.data(), n);
  kernels::bf16_to_f32_cpu(bf16.data(), rounded_.data(), n);
}

Tensor convert(const Tensor& t, DType dtype) {
  if (!t.defined() || t.dtype() == dtype) return t;
  const bool to_bf16 = t.dtype() == DType::f32 && dtype == DType::bf16;
  const bool to_f32 = t.dtype() == DType::bf16 && dtype == DType::f32;
  CUDP_CHECK(to_bf16 || to_f32, "convert: ", t.str(), " to ", dtype_name(dtype),
             " is not offered; f32 <-> bf16 is");
  Tensor out = Tensor::empty(t.shape(), dtype, t.device());
  const int64_t n = t.numel();
  if (t.is_cpu()) {
    if (to_bf16) {
      kernels::f32_to_bf16_cpu(t.data<float>(), out.data<__nv_bfloat16>(), n);
    } else {
      kernels::bf16_to_f32_cpu(t.data<__nv_bfloat16>(), out.data<float>(), n);
    }
    return out;
  }
  cuda::DeviceGuard guard(t.device().index);
  const cudaStream_t stream = stream_for(t.device());
  if (to_bf16) {
    kernels::f32_to_bf16(t.data<float>(), out.data<__nv_bfloat16>(), n, stream);
  } else {
    kernels::bf16_to_f32(t.data<__nv_bfloat16>(), out.data<float>(), n, stream);
  }
  return out;
}

}  // namespace cudp
