// Every tensor's bytes by name, for tests that demand bit-for-bit equality (NaN and -0 compare as
// what they are, unlike ==).
#pragma once

#include <cstdint>
#include <cstring>
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

// A bf16 tensor's elements as their bit patterns (copied to the host first).
inline std::vector<uint16_t> bf16_bits(const Tensor& bf16) {
  const Tensor host = bf16.cpu();
  std::vector<uint16_t> bits(static_cast<size_t>(host.numel()));
  std::memcpy(bits.data(), host.data_ptr(), bits.size() * sizeof(uint16_t));
  return bits;
}

}  // namespace cudp::testing
