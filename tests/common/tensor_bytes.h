// Every tensor's bytes by name, for tests that demand bit-for-bit equality (NaN and -0 compare as
// what they are, unlike ==).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "layers/safetensors.h"

namespace cudp::testing {

inline std::map<std::string, std::vector<unsigned char>> bytes_of(const TensorMap& tensors) {
  std::map<std::string, std::vector<unsigned char>> out;
  for (const auto& [name, t] : tensors) {
    const Tensor host = t.cpu();
    const auto* p = static_cast<const unsigned char*>(host.data_ptr());
    out[name].assign(p, p + host.nbytes());
  }
  return out;
}

}  // namespace cudp::testing
