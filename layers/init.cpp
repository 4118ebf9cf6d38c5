// Initialisers (see init.h for the scheme and the seed derivation).
#include "layers/init.h"

#include <cmath>
#include <string>

#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/linear.h"

namespace cudp::init {

uint64_t derive_seed(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a offset basis
  for (const char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;  // FNV prime
  }
  // splitmix64's finaliser over the combination, so one flipped bit changes every output bit.
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (h | 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void kaiming_normal_fan_out(Tensor& weight, int64_t fan_out, uint64_t seed) {
  CUDP_CHECK(fan_out > 0, "kaiming_normal_fan_out: fan_out must be positive, got ", fan_out);
  const double gain = std::sqrt(2.0);  // ReLU's
  weight.normal_(0.0f, static_cast<float>(gain / std::sqrt(static_cast<double>(fan_out))), seed);
}

void reset_parameters(Module& root, uint64_t seed) {
  for (auto& [path, module] : root.named_modules()) {
    const uint64_t layer_seed = path.empty() ? seed : derive_seed(seed, path);
    if (auto* conv = dynamic_cast<Conv2d*>(module)) {
      conv->reset_parameters(layer_seed);
    } else if (auto* linear = dynamic_cast<Linear*>(module)) {
      linear->reset_parameters(layer_seed);
    } else if (auto* bn = dynamic_cast<BatchNorm2d*>(module)) {
      bn->reset_parameters();
    }
  }
}

}  // namespace cudp::init
