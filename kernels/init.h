// Filling and seeded random initialisation of fp32 buffers.
//
// Random values come from Philox (kernels/philox.h): element i of a buffer filled with (seed, offset)
// is a pure function of (seed, offset + i), so the CPU reference and the CUDA kernel give identical
// numbers, and a slice of a buffer can be regenerated alone.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cudp::kernels {

void fill(float* x, int64_t n, float value, cudaStream_t stream);
void fill_cpu(float* x, int64_t n, float value);

// Uniform in [lo, hi).
void uniform(float* x, int64_t n, float lo, float hi, uint64_t seed, uint64_t offset,
             cudaStream_t stream);
void uniform_cpu(float* x, int64_t n, float lo, float hi, uint64_t seed, uint64_t offset);

// Normal(mean, std) by the Box-Muller transform.
void normal(float* x, int64_t n, float mean, float std, uint64_t seed, uint64_t offset,
            cudaStream_t stream);
void normal_cpu(float* x, int64_t n, float mean, float std, uint64_t seed, uint64_t offset);

}  // namespace cudp::kernels
