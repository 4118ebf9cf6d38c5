// scatter and gather: split a batch across devices and concatenate the pieces back (PyTorch's
// torch.nn.parallel.scatter_gather and torch.cuda.comm.scatter/gather), along dim 0.
//
// scatter follows torch.chunk: chunks of ceil(n / k) rows, the last one smaller, and possibly fewer
// chunks than devices (6 rows on 4 devices: 2, 2, 2 on the first three; 1 row on 2 devices: one
// chunk). Only device_ids[:chunks] receive one. Tensors are contiguous and dim 0 is the slowest, so
// every chunk is one contiguous byte range:
//   - a chunk already on its device is a slice view of the input, not a copy;
//   - a chunk of a CUDA tensor on another device is a peer copy (cudaMemcpyPeerAsync) on the
//     destination's current stream, after an event recorded on the source's current stream;
//   - a chunk of a host tensor is a cudaMemcpyAsync on the destination's current stream. From
//   pinned
//     memory it is asynchronous, and the host tensor must stay alive and unchanged until the device
//     has read it (DataParallel holds it until then, ReplicaSet::keep_until_copied; a loader that
//     refills a pinned buffer must order the refill after the step, as with PyTorch's non_blocking
//     copies).
//     From pageable memory CUDA stages the copy through its own pinned buffer and returns once the
//     source has been read, so the host tensor may be freed or changed right after; the price is a
//     host stall for each chunk. Pin batches (Tensor::pin_memory, a pinned loader) to keep the
//     host ahead of the GPUs; cudp does not pin a staging copy itself, because page-locking memory
//     at each step costs more than the stall it saves.
//
// gather concatenates along dim 0 on the output device: a GPU (peer copies on its current stream,
// each after an event recorded on the source device's current stream) or the CPU (-1; copies that
// complete before gather returns). Tensors must agree in dtype and in every dimension but dim 0
// (PyTorch's "Input tensor at index 1 has invalid shape [3, 4], but expected [3, 5]"). Zero-
// dimensional tensors (a loss per replica) are gathered into a vector, with PyTorch's warning.
// gather's backward is scatter with the sizes that gather saw: scatter(grad, devices, sizes).
//
// NOTE [Cross-device copies and memory lifetime]
// Memory is allocated and freed on its device's current stream (engine/core/memory.h). A copy from
// device s to device d runs on d's stream, so after it d's stream records an event and s's stream
// waits for it: when the source (an input slice, a replica's output) is dropped, its cudaFreeAsync
// on s's stream comes after the copy has read it. The same holds the other way round for a copy's
// destination, which is allocated on d's stream, where the copy runs. No host synchronisation.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/module.h"

namespace cudp::parallel {

// torch.chunk's sizes for n rows in at most k chunks: ceil(n / k) each, the last smaller, as many
// chunks as that takes (possibly fewer than k). Throws ValueError for n <= 0 or k <= 0.
std::vector<int64_t> chunk_sizes(int64_t n, int k);

// Splits `input` along `dim` (only 0 is supported yet) onto device_ids[:chunks] with torch.chunk
// rules, or with the given `sizes` (which must sum to the size along dim and have at most as many
// entries as device_ids).
TensorList scatter(const Tensor& input, const std::vector<int>& device_ids, int dim = 0);
TensorList scatter(const Tensor& input, const std::vector<int>& device_ids,
                   const std::vector<int64_t>& sizes, int dim = 0);

// Concatenates `tensors` along `dim` (only 0 is supported yet) on `output_device`: a CUDA device
// id, or -1 for the CPU. A single tensor already on the output device is returned as it is.
Tensor gather(const TensorList& tensors, int output_device, int dim = 0);

}  // namespace cudp::parallel
