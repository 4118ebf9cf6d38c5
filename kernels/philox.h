// Philox-4x32-10, a counter-based random generator (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC 2011). The output is a pure function of (seed, counter), so the CPU and the GPU
// produce the same numbers, any element can be generated independently, and a run is reproducible
// from (seed, offset) alone: dropout masks, weight initialisation and data shuffling use it.
#pragma once

#include <cstdint>

#include "kernels/common.h"

namespace cudp::kernels {

struct Philox4 {
  uint32_t v[4];
};

CUDP_HD inline uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

// Four 32-bit random words for the 128-bit counter (counter_lo, counter_hi) under a 64-bit seed.
CUDP_HD inline Philox4 philox(uint64_t seed, uint64_t counter_lo, uint64_t counter_hi = 0) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c2, &hi1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// A uniform float in [0, 1) from 24 random bits (exact in fp32).
CUDP_HD inline float uniform01(uint32_t bits) { return (bits >> 8) * (1.0f / 16777216.0f); }

}  // namespace cudp::kernels
