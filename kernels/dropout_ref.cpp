// CPU references of dropout.h: one element at a time through detail::dropout_keep, the documented
// element -> (counter, word) mapping, with no vector paths to get wrong.
#include <algorithm>

#include "engine/core/error.h"
#include "kernels/dropout.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace {

void run_cpu(const char* op, const float* x, float* y, int64_t n, float p, uint64_t seed,
             uint64_t offset) {
  detail::check_elementwise(op, n, {x, y});
  const float scale = dropout_scale(p);
  if (p == 0.0f) {
    if (y != x) {
      std::copy(x, x + n, y);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    y[i] = detail::dropout_keep(seed, offset + static_cast<uint64_t>(i), p) ? x[i] * scale : 0.0f;
  }
}

}  // namespace

float dropout_scale(float p) {
  CUDP_CHECK(p >= 0.0f && p < 1.0f, "dropout: p must be in [0, 1), got ", p);
  return 1.0f / (1.0f - p);
}

void dropout_forward_cpu(const float* x, float* y, int64_t n, float p, uint64_t seed,
                         uint64_t offset) {
  run_cpu("dropout_forward_cpu", x, y, n, p, seed, offset);
}

void dropout_backward_cpu(const float* dy, float* dx, int64_t n, float p, uint64_t seed,
                          uint64_t offset) {
  run_cpu("dropout_backward_cpu", dy, dx, n, p, seed, offset);
}

}  // namespace cudp::kernels
