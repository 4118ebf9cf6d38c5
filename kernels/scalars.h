// Small device scalars written from the host or advanced on the device, without a host copy.
//
// A captured CUDA graph replays its kernels with the arguments they had at capture; what changes
// from one step to the next (a learning rate, a random-number offset) must therefore live in device
// memory, and what the host used to copy there with a pageable cudaMemcpyAsync (BatchNorm's batch
// count) would replay the stale host value. These two ops cover both:
//
//   write_bytes  copies up to a few KiB from the host into device memory by passing them as kernel
//                arguments: the bytes are taken when the call returns, so the host may change its
//                copy at once (no pinned staging buffer, no event to wait on before reuse). Issued
//                outside a graph, before its launch (engine/core/graph.h, ReplayScalars).
//   add_i64      *counter += value on the device: a counter that a replay advances by itself.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace cudp::kernels {

// dst[0, bytes) = src[0, bytes) on `stream` (device dst, host src), in launches of at most
// kWriteChunk bytes each.
inline constexpr size_t kWriteChunk = 1024;
void write_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream);
void write_bytes_cpu(void* dst, const void* src, size_t bytes);

// *counter += value (one int64 on the device).
void add_i64(int64_t* counter, int64_t value, cudaStream_t stream);
void add_i64_cpu(int64_t* counter, int64_t value);

}  // namespace cudp::kernels
