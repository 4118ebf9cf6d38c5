#include "data/sampler.h"

#include <utility>

#include "engine/core/error.h"
#include "kernels/philox.h"

namespace cudp::data {
namespace {

// Philox's high counter word: the epoch above 8 bits of purpose, so the streams never overlap
// (data/loader.cpp draws augmentation with purpose 0x11, data/synthetic.cpp uses 1-3,
// data/image_folder.cpp 0x12).
constexpr uint64_t kShuffle = 0x10;

}  // namespace

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int epoch) {
  CUDP_CHECK(n >= 0, "epoch_permutation: the data set size must not be negative, got ", n);
  CUDP_CHECK(epoch >= 0, "epoch must not be negative, got ", epoch);
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  const uint64_t counter_hi = (static_cast<uint64_t>(epoch) << 8) | kShuffle;
  for (size_t i = order.size(); i-- > 1;) {  // swap i with a uniform j in [0, i]
    const kernels::Philox4 r = kernels::philox(seed, i, counter_hi);
    const uint64_t bits = (uint64_t{r.v[0]} << 32) | r.v[1];
    std::swap(order[i], order[bits % (i + 1)]);
  }
  return order;
}

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  CUDP_CHECK(dataset_size >= 0, "DistributedSampler: the data set size must not be negative, got ",
             dataset_size);
  CUDP_CHECK(options.world_size >= 1, "DistributedSampler: world_size must be at least 1, got ",
             options.world_size);
  CUDP_CHECK(options.rank >= 0 && options.rank < options.world_size, "DistributedSampler: rank ",
             options.rank, " is outside [0, ", options.world_size - 1,
             "]; give each process its rank in the world (ProcessGroup::rank())");
  const int64_t w = options.world_size;
  per_rank_ = options.drop_last ? dataset_size / w : dataset_size / w + (dataset_size % w != 0);
  CUDP_CHECK(per_rank_ > 0 || dataset_size == 0 || !options.drop_last, "DistributedSampler: with ",
             "drop_last, ", dataset_size, " samples on ", w,
             " ranks leave every rank none; use fewer ranks or drop_last = false");
}

void DistributedSampler::set_epoch(int epoch) {
  CUDP_CHECK(epoch >= 0, "DistributedSampler::set_epoch: epoch must not be negative, got ", epoch);
  epoch_ = epoch;
}

std::vector<int64_t> DistributedSampler::indices(int epoch) const {
  std::vector<int64_t> order;
  if (options_.shuffle) {
    order = epoch_permutation(dataset_size_, options_.seed, epoch);
  } else {
    CUDP_CHECK(epoch >= 0, "epoch must not be negative, got ", epoch);
    order.resize(static_cast<size_t>(dataset_size_));
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  }
  const int64_t w = options_.world_size;
  const int64_t total = per_rank_ * w;  // padded up or truncated down to a multiple of w
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_rank_));
  for (int64_t p = options_.rank; p < total; p += w) {
    mine.push_back(order[static_cast<size_t>(p % dataset_size_)]);  // p >= n: the start again
  }
  return mine;
}

}  // namespace cudp::data
