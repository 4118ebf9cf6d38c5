// Loader: turns a data set into float32 NHWC batches, prepared ahead on host threads.
//
// What a batch goes through, per sample: the sample's uint8 pixels (read in place from a Dataset in
// memory, or produced by the SampleSource on the worker: an image folder decodes and crops a file
// there, data/image_folder.h) -> (x/255 - mean[c]) / std[c] (a 256-entry table per channel), placed
// in a frame `pad` pixels larger on every side (Fashion-MNIST's 28x28 becomes the 32x32 VGG wants),
// optionally moved by a random crop (RandomCrop(padding=p) in torchvision's terms) and flipped
// left-right. Border pixels hold 0 after normalisation (the data set's mean) or a raw pixel value
// normalised like the image (PadFill::Pixel, 0 = black, what torchvision's Pad before Normalize
// gives).
//
// Reproducibility, and why Philox: the order of an epoch is a Fisher-Yates shuffle whose draws are
// Philox(seed, i, epoch) (data/sampler.h, where a DistributedSampler also shards it between ranks)
// and a sample's crop and flip are Philox(seed, sample index, epoch) (a SampleSource draws from
// (seed, epoch, sample index) too), so the whole stream of batches is a pure function of (seed,
// epoch) - not of the number of worker threads, of timing, or of where the run started. That makes
// resuming exact: a checkpoint stores position() (epoch, next batch index) and start_epoch(epoch,
// batch) replays the same remaining batches.
//
// Pipeline: `workers` persistent threads fill batch buffers ahead of the consumer (at most
// `prefetch` batches ahead). The workers share the samples of a batch: each claims the next chunk
// of about batch_size / workers rows of the earliest batch not fully claimed, and starts a new
// batch only when none is left, so every worker decodes even when only one or two batches are in
// flight, and a batch is ready as soon as possible. Preparing batch i+1 overlaps the GPU's work on
// batch i; next() hands batches out in order and counts the time it had to wait (wait_seconds():
// the input pipeline's share of a step; the time a buffer was still read by the device,
// device_wait_seconds(), apart). Buffers are allocated once and reused, in pinned memory where a
// CUDA device is visible (asynchronous copies need it) and ordinary memory otherwise, so CPU-only
// training and CI use the same code.
//
// Buffer lifetime (the contract that makes reuse safe): a Batch's tensors stay valid until the next
// call of next() or start_epoch(); clone() them to keep them longer. Work queued on a CUDA stream
// that reads them (an asynchronous copy) must be announced with Batch::record_reader(): the loader
// then waits for that work (an event) before it refills the buffer. DevicePrefetcher
// (data/prefetcher.h) does this for you.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "data/dataset.h"
#include "data/sampler.h"
#include "engine/core/tensor.h"

namespace cudp::data {

// Per-channel statistics on the x/255 scale. Empty vectors mean no normalisation (x/255); a single
// value applies to every channel.
struct Normalization {
  std::vector<float> mean, std;
};

// The mean and (population) standard deviation of each channel of `train` on the x/255 scale, the
// usual way normalisation constants are made (Fashion-MNIST train: 0.2860, 0.3530). Compute them on
// the training set and give the same values to the test loader.
Normalization compute_normalization(const Dataset& train);

enum class PadFill {
  Zero,   // 0 after normalisation: the data set's mean
  Pixel,  // the raw pixel value `pad_pixel`, normalised like the image
};

struct LoaderOptions {
  int64_t batch_size = 256;  // the global batch: data parallelism splits it later. Buffers hold
                             // at most the data set's size, whatever batch_size says
  bool shuffle = true;
  bool drop_last = false;    // drop a last batch smaller than batch_size
  uint64_t seed = 0;
  Normalization normalization;
  int pad = 0;               // pixels added on every side (28x28 -> 32x32: 2)
  PadFill pad_fill = PadFill::Zero;
  uint8_t pad_pixel = 0;
  int random_crop = 0;       // augmentation: move the image by up to this many pixels (CIFAR: 4)
  bool horizontal_flip = false;  // augmentation: flip half the samples left-right
  int workers = 2;           // host threads preparing (and, for an image folder, decoding)
                             // samples, at most 1024
  int prefetch = 4;          // batches prepared ahead of the consumer, at most 1024
  bool pin_memory = true;    // pinned buffers (only where a CUDA device is visible)
  // The indices of each epoch (data/sampler.h): one process per GPU gives each rank a
  // DistributedSampler for its shard. Null: every sample once, in the order `shuffle` and `seed`
  // give (the same order as DistributedSampler for rank 0 of 1). A sampler decides the order, so
  // `shuffle` is then unused; `seed` still draws the augmentation.
  std::shared_ptr<const Sampler> sampler;
};

namespace detail {
struct BatchBuffer;  // the loader's reusable memory behind a Batch
}

struct Batch {
  Tensor images;       // [B, H + 2*pad, W + 2*pad, C] f32 (B < batch_size only for a last batch)
  Tensor labels;       // [B] i32
  int epoch = -1;
  int64_t index = -1;  // the batch's index in its epoch

  // Declares that work queued on `stream` (of CUDA device `device`) reads this batch's host memory:
  // the loader will not refill it before that work has completed. Call it before the next next().
  void record_reader(cudaStream_t stream, int device) const;

  std::shared_ptr<detail::BatchBuffer> buffer;  // the loader's bookkeeping
  uint64_t lease = 0;
};

// Where the loader is: the next batch next() returns. A checkpoint stores it; start_epoch(epoch,
// batch) resumes from it.
struct LoaderPosition {
  int epoch = 0;
  int64_t batch = 0;
};

class Loader {
 public:
  // `source` (or `dataset`) must outlive the loader.
  Loader(const SampleSource& source, LoaderOptions options);
  Loader(const Dataset& dataset, LoaderOptions options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Begins `epoch` (>= 0) at batch `first_batch` (a resumed run's position), dropping batches
  // prepared for the previous one. next() needs it first. When position() already is (epoch,
  // first_batch) of a started epoch, what the workers prepared for it is kept: starting an epoch
  // early (a trainer starts the test set's while it trains, and the next training epoch's while it
  // evaluates) has its first batches ready when it begins, and the same batches either way.
  void start_epoch(int epoch, int64_t first_batch = 0);
  // The next batch of the epoch; false at its end. Rethrows a worker's exception.
  bool next(Batch& batch);

  int64_t batches_per_epoch() const;
  LoaderPosition position() const;
  // Seconds next() waited since start_epoch() for the workers to prepare a batch: the input
  // pipeline's share of the consumer's time.
  double wait_seconds() const;
  // Seconds next() waited since start_epoch() for a batch whose buffer the device was still reading
  // when the wait began (Batch::record_reader: a copy not yet run), the batch's preparation after
  // the device let the buffer go included: the host ahead of a device-bound run, not slow input.
  double device_wait_seconds() const;
  // The dataset indices of `epoch` in the order they are served (the sampler's; the identity
  // without a sampler and without shuffle).
  std::vector<int64_t> epoch_order(int epoch) const;
  // [H, W, C] of a batch's images after padding.
  Shape image_shape() const;
  const SampleSource& source() const;
  const LoaderOptions& options() const;

  // Test-only (tests/data/loader_test.cpp, loader_gpu_test.cpp): where the loader's threads begin
  // to wait, so that a test of the wait accounting acts after that point (releases what is waited
  // for, after a delay it knows) instead of guessing it from timing, which a loaded machine upsets.
  enum class WaitPoint {
    Batch,   // next() found batch `batch` not ready and waits for it (the consumer's thread)
    Device,  // a worker taking the buffer for batch `batch` found a reader (Batch::record_reader)
             // not yet run and waits for the device
  };
  using WaitHook = std::function<void(WaitPoint, int64_t batch)>;
  // The hook runs on the waiting thread just before it waits, with a lock held: the loader's own
  // (Batch) or the buffer's (Device). So it must not call the loader, touch its batches, or wait
  // for anything the loader's threads do (they need those locks to go on): it hands what it wants
  // done to another thread (tests/data/data_test_util.h's Later) and returns. Set it before the
  // first start_epoch(). Unset (every real run) it costs a test of an empty std::function where a
  // thread is about to block.
  void set_wait_hook_for_testing(WaitHook hook);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cudp::data
