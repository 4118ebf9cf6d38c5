// Samplers: which data-set indices an epoch visits, and in what order.
//
// The Loader (data/loader.h) asks its sampler for the indices of an epoch and serves them in
// batches. Without one it uses DistributedSampler for rank 0 of 1, which is its own order: every
// index once, shuffled by `epoch_permutation(n, seed, epoch)` or in sequence.
//
// DistributedSampler follows PyTorch's torch.utils.data.DistributedSampler, so that one process per
// GPU (docs/distributed.md) trains on disjoint shards of the same epoch:
//   - every rank computes the same permutation of [0, n) from (seed, epoch) alone: no
//   communication;
//   - drop_last = false: the permutation is padded to a multiple of world_size by repeating its
//     start (wrapping around as often as needed when n < world_size), so every rank gets
//     ceil(n / world_size) indices and a few samples are seen twice in the epoch;
//     drop_last = true: it is truncated to floor(n / world_size) * world_size, so a few samples are
//     not seen in that epoch (another epoch's permutation leaves out others);
//   - rank r takes positions r, r + world_size, r + 2 world_size, ... of that list.
// The permutation itself is ours, not PyTorch's (a Philox Fisher-Yates shuffle, not
// torch.randperm), so the indices differ from PyTorch's for the same seed; the rules above are the
// same.
#pragma once

#include <cstdint>
#include <vector>

namespace cudp::data {

// The order of [0, n) for `epoch` under `seed`: a Fisher-Yates shuffle whose draws are
// Philox(seed, i, epoch), a pure function of its arguments.
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int epoch);

class Sampler {
 public:
  virtual ~Sampler() = default;
  // The size of the data set the indices point into.
  virtual int64_t dataset_size() const = 0;
  // How many indices every epoch has.
  virtual int64_t size() const = 0;
  // The indices of `epoch` (>= 0), size() of them, each in [0, dataset_size()).
  virtual std::vector<int64_t> indices(int epoch) const = 0;
};

struct DistributedSamplerOptions {
  int rank = 0;
  int world_size = 1;
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options);

  int64_t dataset_size() const override { return dataset_size_; }
  int64_t size() const override { return per_rank_; }
  std::vector<int64_t> indices(int epoch) const override;

  // PyTorch's set_epoch, for code that keeps one sampler and asks for indices() without an epoch.
  // The Loader passes its own epoch (Loader::start_epoch) and does not need it.
  void set_epoch(int epoch);
  int epoch() const { return epoch_; }
  std::vector<int64_t> indices() const { return indices(epoch_); }

  const DistributedSamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  DistributedSamplerOptions options_;
  int64_t per_rank_;
  int epoch_ = 0;
};

}  // namespace cudp::data
