// DistributedSampler on the host: PyTorch's DistributedSampler rules (one permutation shared by
// every rank, padding by repeating its start or truncating, rank r taking every world_size-th
// position), and the loader's order unchanged for one rank of one.
//
// The shards are checked against what the rules say, rebuilt here from the shards themselves:
// interleaving rank 0's, rank 1's, ... indices gives back the padded (or truncated) list, whose
// first n entries must be a permutation of [0, n) only if every rank used the same permutation.
#include "data/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "data/data_test_util.h"
#include "data/loader.h"

namespace cudp::data {
namespace {

using testing::run_epoch;
using testing::throws_with;

std::vector<std::vector<int64_t>> shards(int64_t n, int world, bool drop_last, int epoch,
                                         uint64_t seed = 11, bool shuffle = true) {
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(
        n,
        {.rank = r, .world_size = world, .shuffle = shuffle, .seed = seed, .drop_last = drop_last});
    out.push_back(s.indices(epoch));
    EXPECT_EQ(static_cast<int64_t>(out.back().size()), s.size()) << "rank " << r;
  }
  return out;
}

// The list the ranks' shards were cut from: position p is rank p % world's (p / world)-th index.
std::vector<int64_t> interleave(const std::vector<std::vector<int64_t>>& parts) {
  std::vector<int64_t> all;
  const size_t per = parts[0].size();
  for (size_t k = 0; k < per; ++k) {
    for (const auto& part : parts) {
      EXPECT_EQ(part.size(), per) << "every rank gets as many indices";
      all.push_back(part[k]);
    }
  }
  return all;
}

bool is_permutation_of_range(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] != static_cast<int64_t>(i)) return false;
  }
  return true;
}

// Sizes that divide (12 on 2, 3, 4, 6) and that do not, worlds larger than the set (2 on 5).
const std::vector<int64_t> kSizes = {1, 2, 5, 12, 13, 101};
const std::vector<int> kWorlds = {1, 2, 3, 4, 5, 6, 7};

TEST(DistributedSampler, PaddedShardsCoverTheEpochAndRepeatItsStart) {
  for (const int64_t n : kSizes) {
    for (const int world : kWorlds) {
      SCOPED_TRACE(::testing::Message() << n << " samples on " << world << " ranks");
      const auto parts = shards(n, world, /*drop_last=*/false, 3);
      const int64_t per = (n + world - 1) / world;
      ASSERT_EQ(static_cast<int64_t>(parts[0].size()), per);
      const std::vector<int64_t> all = interleave(parts);
      ASSERT_EQ(static_cast<int64_t>(all.size()), per * world);
      const std::vector<int64_t> head(all.begin(), all.begin() + n);
      EXPECT_TRUE(is_permutation_of_range(head)) << "the first n positions hold every sample once";
      for (size_t p = static_cast<size_t>(n); p < all.size(); ++p) {
        EXPECT_EQ(all[p], all[p % static_cast<size_t>(n)]) << "padding position " << p;
      }
    }
  }
}

TEST(DistributedSampler, TruncatedShardsAreDisjoint) {
  for (const int64_t n : kSizes) {
    for (const int world : kWorlds) {
      if (n < world) continue;  // nothing per rank: an error (below)
      SCOPED_TRACE(::testing::Message() << n << " samples on " << world << " ranks");
      const auto parts = shards(n, world, /*drop_last=*/true, 3);
      ASSERT_EQ(static_cast<int64_t>(parts[0].size()), n / world);
      const std::vector<int64_t> all = interleave(parts);
      std::set<int64_t> distinct(all.begin(), all.end());
      EXPECT_EQ(distinct.size(), all.size()) << "no sample on two ranks";
      EXPECT_TRUE(*distinct.rbegin() < n);
      // The kept ones are the start of the same permutation padded shards are cut from.
      const std::vector<int64_t> padded = interleave(shards(n, world, false, 3));
      EXPECT_EQ(all, std::vector<int64_t>(padded.begin(), padded.begin() + (n / world) * world));
    }
  }
}

TEST(DistributedSampler, EveryRankHasTheSamePermutation) {
  // Ranks built independently agree: the permutation is a function of (seed, epoch) only.
  const auto parts = shards(1000, 4, false, 5, 123);
  EXPECT_EQ(interleave(parts), epoch_permutation(1000, 123, 5));
  const auto again = shards(1000, 4, false, 5, 123);
  EXPECT_EQ(parts, again) << "deterministic";
  EXPECT_NE(interleave(shards(1000, 4, false, 6, 123)), interleave(parts)) << "another epoch";
  EXPECT_NE(interleave(shards(1000, 4, false, 5, 124)), interleave(parts)) << "another seed";
  EXPECT_NE(interleave(parts), interleave(shards(1000, 4, false, 5, 123, /*shuffle=*/false)));
}

TEST(DistributedSampler, WithoutShuffleRankRTakesREveryWorldSize) {
  const auto parts = shards(10, 3, false, 0, 1, /*shuffle=*/false);
  EXPECT_EQ(parts[0], (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(parts[1], (std::vector<int64_t>{1, 4, 7, 0}));  // padded with the start: 0
  EXPECT_EQ(parts[2], (std::vector<int64_t>{2, 5, 8, 1}));
  EXPECT_EQ(shards(10, 3, true, 0, 1, false)[2], (std::vector<int64_t>{2, 5, 8}));
  // Fewer samples than ranks: the list wraps around as often as needed.
  const auto tiny = shards(2, 5, false, 0, 1, false);
  EXPECT_EQ(interleave(tiny), (std::vector<int64_t>{0, 1, 0, 1, 0}));
}

TEST(DistributedSampler, SetEpochChoosesThePermutation) {
  DistributedSampler s(50, {.rank = 1, .world_size = 3, .seed = 4});
  EXPECT_EQ(s.epoch(), 0);
  const std::vector<int64_t> first = s.indices();
  s.set_epoch(7);
  EXPECT_EQ(s.indices(), s.indices(7));
  EXPECT_NE(s.indices(), first);
  EXPECT_TRUE(throws_with<ValueError>([&] { s.set_epoch(-1); }, {"epoch", "-1"}));
}

TEST(DistributedSampler, OneRankOfOneIsTheLoadersOrder) {
  // Recorded from the loader's own shuffle before the sampler existed (seed 7, 23 samples).
  const std::vector<int64_t> epoch0 = {7,  1,  14, 6,  10, 16, 18, 2,  0,  3, 8, 4,
                                       12, 17, 21, 20, 13, 11, 15, 22, 19, 5, 9};
  const std::vector<int64_t> epoch3 = {17, 1,  16, 7, 19, 3,  4,  22, 11, 21, 14, 13,
                                       6,  15, 20, 8, 2,  18, 12, 5,  0,  10, 9};
  DistributedSampler one(23, {.seed = 7});
  EXPECT_EQ(one.indices(0), epoch0);
  EXPECT_EQ(one.indices(3), epoch3);

  Dataset d;
  d.name = "indexed";
  d.height = d.width = d.channels = 1;
  d.num_classes = 23;
  for (int i = 0; i < 23; ++i) {
    d.labels.push_back(i);
    d.images.push_back(static_cast<uint8_t>(i));
  }
  LoaderOptions o;
  o.batch_size = 5;
  o.seed = 7;
  o.workers = 1;
  Loader plain(d, o);
  EXPECT_EQ(plain.epoch_order(0), epoch0);
  EXPECT_EQ(plain.epoch_order(3), epoch3);
  o.sampler = std::make_shared<DistributedSampler>(23, DistributedSamplerOptions{.seed = 7});
  Loader sampled(d, o);
  EXPECT_EQ(run_epoch(sampled, 3), run_epoch(plain, 3)) << "the same batches, images and all";
}

TEST(DistributedSampler, LoadersOfTwoRanksSplitTheEpoch) {
  Dataset d;
  d.name = "indexed";
  d.height = d.width = d.channels = 1;
  d.num_classes = 13;
  for (int i = 0; i < 13; ++i) {
    d.labels.push_back(i);
    d.images.push_back(static_cast<uint8_t>(i));
  }
  std::multiset<int32_t> seen;
  for (int rank = 0; rank < 2; ++rank) {
    LoaderOptions o;
    o.batch_size = 4;
    o.sampler = std::make_shared<DistributedSampler>(
        13, DistributedSamplerOptions{.rank = rank, .world_size = 2, .seed = 3});
    Loader loader(d, o);
    EXPECT_EQ(loader.batches_per_epoch(), 2);  // 7 samples a rank: 4 + 3
    for (const auto& b : run_epoch(loader, 1)) seen.insert(b.labels.begin(), b.labels.end());
  }
  EXPECT_EQ(seen.size(), 14u) << "13 samples and one repeated to pad";
  for (int i = 0; i < 13; ++i) EXPECT_GE(seen.count(i), 1u) << "sample " << i;
}

TEST(DistributedSampler, BadArgumentsAreErrors) {
  EXPECT_TRUE(throws_with<ValueError>([] { DistributedSampler(10, {.rank = 2, .world_size = 2}); },
                                      {"rank 2", "[0, 1]"}));
  EXPECT_TRUE(throws_with<ValueError>([] { DistributedSampler(10, {.world_size = 0}); },
                                      {"world_size", "0"}));
  EXPECT_TRUE(throws_with<ValueError>(
      [] { DistributedSampler(3, {.rank = 0, .world_size = 4, .drop_last = true}); },
      {"drop_last", "3 samples on 4 ranks"}));
  Dataset d;
  d.name = "tiny";
  d.height = d.width = d.channels = 1;
  d.num_classes = 1;
  d.labels = {0, 0};
  d.images = {1, 2};
  LoaderOptions o;
  o.sampler = std::make_shared<DistributedSampler>(5, DistributedSamplerOptions{});
  EXPECT_TRUE(
      throws_with<ValueError>([&] { Loader loader(d, o); }, {"5 samples", "tiny", "has 2"}));
}

}  // namespace
}  // namespace cudp::data
