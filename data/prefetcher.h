// DevicePrefetcher: copies the loader's batches to CUDA devices one batch ahead, on copy streams.
//
// While the devices compute on batch i, batch i+1 is already travelling from pinned host memory to
// each device on that device's own copy stream (a cuda::Stream of the prefetcher's), so the PCIe or
// NVLink transfer overlaps compute instead of preceding it. Ordering is done with events only:
//   - a batch's device tensors are allocated on the device's current (compute) stream, and the copy
//     stream waits for that stream's work before writing them (Tensor::copy_from does this), so
//     memory the pool recycles from batch i-1 is not overwritten while compute still reads it;
//   - next() makes each device's current stream wait for the copy's event before returning the
//     batch, so compute that uses it starts only when its bytes have arrived;
//   - the host batch announces the copy stream as a reader (Batch::record_reader), so the loader
//     does not refill that pinned buffer before the copy has read it.
// The host thread never waits for a copy. Device tensors are fresh allocations from the stream-
// ordered pool (cheap), so a returned batch stays valid for as long as the caller keeps it.
//
// Each device receives the whole batch, or, with `split`, its chunk by torch.chunk's rules (chunk
// size ceil(B / n), possibly fewer non-empty chunks than devices; the rest get 0 rows), as scatter
// would make it.
#pragma once

#include <vector>

#include "data/loader.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"

namespace cudp::data {

struct DeviceBatch {
  std::vector<Tensor> images, labels;  // one of each per device, in the order given
  int epoch = -1;
  int64_t index = -1;
};

class DevicePrefetcher {
 public:
  DevicePrefetcher(Loader& loader, std::vector<int> devices, bool split = false);
  ~DevicePrefetcher();
  DevicePrefetcher(const DevicePrefetcher&) = delete;
  DevicePrefetcher& operator=(const DevicePrefetcher&) = delete;

  // Starts the loader's epoch and the copy of its first batch.
  void start_epoch(int epoch, int64_t first_batch = 0);
  // The next batch, on the devices; each device's current stream (of the calling thread) waits for
  // its copy. Starts copying the batch after it. False at the end of the epoch.
  bool next(DeviceBatch& batch);

  const std::vector<int>& devices() const { return devices_; }
  Loader& loader() { return loader_; }

 private:
  bool stage();           // takes the loader's next batch and starts its copies
  void order_compute();   // the devices' current streams wait for the staged copies

  Loader& loader_;
  std::vector<int> devices_;
  bool split_;
  std::vector<cuda::Stream> copy_streams_;
  std::vector<cuda::Event> copied_;
  Batch host_;            // the batch being copied (its buffer must stay the loader's until then)
  DeviceBatch staged_;
  bool pending_ = false;  // staged_ holds a batch whose copies were started
};

}  // namespace cudp::data
