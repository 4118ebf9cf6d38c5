#include "kernels/common.h"

namespace cudp::kernels {

const char* math_name(Math math) {
  switch (math) {
    case Math::FP32: return "fp32";
    case Math::TF32: return "tf32";
    case Math::BF16: return "bf16";
  }
  return "unknown";
}

}  // namespace cudp::kernels
