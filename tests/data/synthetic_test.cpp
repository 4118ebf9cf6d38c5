// The synthetic data set: deterministic bytes from the seed, balanced classes, and learnable (a
// nearest-class-mean classifier fitted on train already separates test well).
#include "data/synthetic.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/core/error.h"

namespace cudp::data {
namespace {

SyntheticOptions small(uint64_t seed, int64_t h = 28, int64_t w = 28, int64_t c = 1) {
  SyntheticOptions o;
  o.n_train = 600;
  o.n_test = 200;
  o.h = h;
  o.w = w;
  o.c = c;
  o.seed = seed;
  return o;
}

TEST(Synthetic, SameSeedSameBytes) {
  for (const bool train : {true, false}) {
    const Dataset a = make_synthetic(small(7), train), b = make_synthetic(small(7), train);
    EXPECT_EQ(a.images, b.images);
    EXPECT_EQ(a.labels, b.labels);
  }
}

TEST(Synthetic, DifferentSeedOrSplitDiffers) {
  const Dataset a = make_synthetic(small(7), true);
  EXPECT_NE(a.images, make_synthetic(small(8), true).images);
  const Dataset test = make_synthetic(small(7), false);
  EXPECT_FALSE(std::equal(test.images.begin(), test.images.end(), a.images.begin()));
}

TEST(Synthetic, ShapesNamesAndBalancedClasses) {
  const Dataset gray = make_synthetic(small(1), true);
  EXPECT_EQ(gray.str(), "synthetic/train: 600 images of 28x28x1, 10 classes");
  EXPECT_EQ(class_histogram(gray), std::vector<int64_t>(10, 60));
  const Dataset rgb = make_synthetic(small(1, 32, 32, 3), false);
  EXPECT_EQ(rgb.str(), "synthetic/test: 200 images of 32x32x3, 10 classes");
  EXPECT_EQ(rgb.images.size(), 200u * 32 * 32 * 3);
  // Not degenerate: pixel values spread over most of the range.
  const auto [lo, hi] = std::minmax_element(rgb.images.begin(), rgb.images.end());
  EXPECT_LT(*lo, 20);
  EXPECT_GT(*hi, 235);
}

TEST(Synthetic, NearestClassMeanSeparatesTheClasses) {
  for (const auto& options : {small(3), small(3, 32, 32, 3)}) {
    const Dataset train = make_synthetic(options, true), test = make_synthetic(options, false);
    const size_t pixels = static_cast<size_t>(train.image_bytes());
    std::vector<std::vector<double>> mean(10, std::vector<double>(pixels, 0.0));
    for (int64_t i = 0; i < train.size(); ++i) {
      for (size_t p = 0; p < pixels; ++p) mean[train.labels[i]][p] += train.image(i)[p] / 60.0;
    }
    int64_t correct = 0;
    for (int64_t i = 0; i < test.size(); ++i) {
      int best = -1;
      double best_distance = std::numeric_limits<double>::max();
      for (int k = 0; k < 10; ++k) {
        double distance = 0;
        for (size_t p = 0; p < pixels; ++p) distance += std::pow(test.image(i)[p] - mean[k][p], 2);
        if (distance < best_distance) best_distance = distance, best = k;
      }
      correct += best == test.labels[i];
    }
    EXPECT_GT(correct, test.size() * 9 / 10) << options.h << "x" << options.w << "x" << options.c;
  }
}

TEST(Synthetic, RejectsBadOptions) {
  SyntheticOptions o = small(1);
  o.classes = 0;
  EXPECT_THROW(make_synthetic(o, true), ValueError);
  o = small(1);
  o.h = 0;
  EXPECT_THROW(make_synthetic(o, true), ValueError);
}

}  // namespace
}  // namespace cudp::data
