#include "kernels/init.h"
#include "kernels/init_math.h"

namespace cudp::kernels {

void fill_cpu(float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

void uniform_cpu(float* x, int64_t n, float lo, float hi, uint64_t seed, uint64_t offset) {
  for (int64_t i = 0; i < n; ++i) x[i] = detail::uniform_at(seed, offset + i, lo, hi);
}

void normal_cpu(float* x, int64_t n, float mean, float std, uint64_t seed, uint64_t offset) {
  for (int64_t i = 0; i < n; ++i) x[i] = detail::normal_at(seed, offset + i, mean, std);
}

}  // namespace cudp::kernels
