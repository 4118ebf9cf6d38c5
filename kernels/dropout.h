// Inverted dropout with a counter-based mask: nothing is stored between forward and backward.
//
//   y[i] = keep(i) ? x[i] * scale : 0,    scale = 1 / (1 - p) computed once in fp32 (dropout_scale)
//
// The mask is a pure function of (seed, offset + i), so backward regenerates it, the CPU reference
// gives the same mask bit for bit, and a run is reproducible from (seed, offset) alone:
//
//   g       = offset + i                      the element's global index (64-bit, wrapping)
//   word    = philox(seed, g / 4).v[g % 4]    Philox-4x32-10, counter_lo = g / 4, counter_hi = 0
//   keep(i) = uniform01(word) >= p            uniform01: the top 24 bits times 2^-24, exact
//
// So the four words of one Philox call serve four consecutive global indices 4k .. 4k + 3: the
// GPU makes one call per float4 when offset + (first aligned element) is a multiple of 4, and two
// otherwise. Callers advance `offset` by n (rounded up to a multiple of 4 keeps the fast path)
// between calls that need independent masks. As the mask depends on offset + i alone, element i of
// a call with offset o + d is element i + d of a call with offset o: a slice of a tensor dropped on
// its own, with the offset shifted by the slice's start, gets the whole tensor's mask.
//
// p must lie in [0, 1), anything else (NaN included) throws ValueError; p == 0 is the identity (a
// copy when y != x, nothing when y == x). A dropped element is exactly 0 even where x is inf or
// NaN. y may alias x, dx may alias dy. n == 0 is a no-op.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/philox.h"

namespace cudp::kernels {

void dropout_forward(const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset,
                     cudaStream_t stream);
void dropout_forward_cpu(const float* x, float* y, int64_t n, float p, uint64_t seed,
                         uint64_t offset);

// dx = keep ? dy * scale : 0 with the forward's mask, regenerated from (seed, offset).
void dropout_backward(const float* dy, float* dx, int64_t n, float p, uint64_t seed,
                      uint64_t offset, cudaStream_t stream);
void dropout_backward_cpu(const float* dy, float* dx, int64_t n, float p, uint64_t seed,
                          uint64_t offset);

// Captured launches (engine/core/graph.h NOTE [Replay scalars]): the same, with the seed and
// offset read on the device from seed_offset[0] and seed_offset[1], which the host rewrites before
// each replay of the graph.
void dropout_forward(const float* x, float* y, int64_t n, float p, const uint64_t* seed_offset,
                     cudaStream_t stream);
void dropout_backward(const float* dy, float* dx, int64_t n, float p, const uint64_t* seed_offset,
                      cudaStream_t stream);

// 1 / (1 - p) in fp32, the factor kept elements are multiplied by. Throws ValueError unless p is in
// [0, 1).
float dropout_scale(float p);

namespace detail {

// Word k (0..3) of a Philox output, selected without indexing a local array (which on the GPU
// would go through local memory).
CUDP_HD inline uint32_t philox_word(const Philox4& r, uint32_t k) {
  return k == 0 ? r.v[0] : k == 1 ? r.v[1] : k == 2 ? r.v[2] : r.v[3];
}

// Whether the element with global index g = offset + i is kept.
CUDP_HD inline bool dropout_keep(uint64_t seed, uint64_t g, float p) {
  return uniform01(philox_word(philox(seed, g >> 2), static_cast<uint32_t>(g & 3))) >= p;
}

}  // namespace detail
}  // namespace cudp::kernels
