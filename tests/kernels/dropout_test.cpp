// Host tests of the dropout CPU references (kernels/dropout.h): the documented element -> Philox
// (counter, word) mapping recomputed by hand, mask statistics, forward/backward consistency,
// offsets and slices, p == 0 and the error cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "engine/core/error.h"
#include "kernels/dropout.h"
#include "kernels/philox.h"

namespace cudp::kernels {
namespace {

// The mapping of dropout.h written out again: element i of a call with `offset` uses word
// (offset + i) % 4 of philox(seed, (offset + i) / 4), its top 24 bits as a float in [0, 1).
bool kept_by_hand(uint64_t seed, uint64_t offset, int64_t i, float p) {
  const uint64_t g = offset + static_cast<uint64_t>(i);
  const Philox4 r = philox(seed, g / 4);
  const uint32_t word = r.v[g % 4];
  return static_cast<float>(word >> 8) / 16777216.0f >= p;
}

std::vector<float> forward(const std::vector<float>& x, float p, uint64_t seed, uint64_t offset) {
  std::vector<float> y(x.size(), testing::kPoison);
  dropout_forward_cpu(x.data(), y.data(), static_cast<int64_t>(x.size()), p, seed, offset);
  return y;
}

TEST(Dropout, MaskFollowsTheDocumentedMapping) {
  const std::vector<float> x = testing::random_vector(1031, 1, 0.5f, 2.0f);  // never 0
  for (uint64_t offset : {uint64_t(0), uint64_t(1), uint64_t(2), uint64_t(3), uint64_t(1) << 40}) {
    const float p = 0.3f;
    const std::vector<float> y = forward(x, p, 1234, offset);
    const float scale = 1.0f / (1.0f - p);
    for (size_t i = 0; i < x.size(); ++i) {
      const bool keep = kept_by_hand(1234, offset, static_cast<int64_t>(i), p);
      ASSERT_EQ(y[i], keep ? x[i] * scale : 0.0f) << "element " << i << ", offset " << offset;
    }
  }
}

TEST(Dropout, ScaleIsOneOverOneMinusP) {
  EXPECT_EQ(dropout_scale(0.0f), 1.0f);
  EXPECT_EQ(dropout_scale(0.5f), 2.0f);
  EXPECT_EQ(dropout_scale(0.75f), 4.0f);
  EXPECT_EQ(dropout_scale(0.1f), 1.0f / (1.0f - 0.1f));
}

// Kept fraction within 6 binomial standard deviations of 1 - p, overall and for each of the four
// Philox words separately (a broken word would show there), and the mean of y close to that of x.
TEST(Dropout, KeptFractionMatchesP) {
  const int64_t n = int64_t(1) << 20;
  const std::vector<float> ones(n, 1.0f);
  for (float p : {0.1f, 0.3f, 0.5f, 0.9f}) {
    const std::vector<float> y = forward(ones, p, 42, 8);
    int64_t kept = 0, kept_word[4] = {0, 0, 0, 0};
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = y[i] != 0.0f;
      kept += keep;
      kept_word[(8 + i) % 4] += keep;
      sum += y[i];
    }
    const double q = 1.0 - p;
    const double sigma = std::sqrt(n * p * q);
    EXPECT_LE(std::fabs(kept - n * q), 6 * sigma)
        << "p = " << p << ": kept " << kept << " of " << n;
    for (int k = 0; k < 4; ++k) {
      const double m = n / 4.0;
      EXPECT_LE(std::fabs(kept_word[k] - m * q), 6 * std::sqrt(m * p * q))
          << "p = " << p << ", word " << k;
    }
    // y is 0 or 1 / q: mean 1, variance p / q.
    EXPECT_LE(std::fabs(sum / n - 1.0), 6 * std::sqrt(p / q / n)) << "p = " << p;
  }
}

TEST(Dropout, BackwardRegeneratesTheForwardMask) {
  const int64_t n = 4099;
  const std::vector<float> x = testing::random_vector(n, 2, 0.5f, 2.0f);
  std::vector<float> dy = testing::random_vector(n, 3, -2.0f, -0.5f);
  const float p = 0.4f, scale = dropout_scale(p);
  const std::vector<float> y = forward(x, p, 7, 100);
  std::vector<float> dx(n, testing::kPoison);
  dropout_backward_cpu(dy.data(), dx.data(), n, p, 7, 100);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = y[i] != 0.0f;
    kept += keep;
    ASSERT_EQ(dx[i], keep ? dy[i] * scale : 0.0f) << "element " << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, n);
  dropout_backward_cpu(dy.data(), dy.data(), n, p, 7, 100);  // in place
  EXPECT_ALL_CLOSE(dy, dx, 0.0, 0.0);
}

TEST(Dropout, ForwardInPlace) {
  std::vector<float> x = testing::random_vector(333, 4);
  const std::vector<float> y = forward(x, 0.5f, 9, 3);
  dropout_forward_cpu(x.data(), x.data(), 333, 0.5f, 9, 3);
  EXPECT_ALL_CLOSE(x, y, 0.0, 0.0);
}

TEST(Dropout, OffsetShiftsTheMaskAlongTheElements) {
  // Element i of a call with offset o + d is element i + d of a call with offset o, so a slice can
  // be dropped alone, consistently with the whole; this holds across the wrap of the 64-bit index.
  const std::vector<float> x = testing::random_vector(517, 5, 0.5f, 2.0f);
  for (uint64_t base : {uint64_t(0), uint64_t(5), std::numeric_limits<uint64_t>::max() - 6}) {
    const std::vector<float> whole = forward(x, 0.5f, 11, base);
    for (size_t d : {size_t(1), size_t(2), size_t(3), size_t(4), size_t(13)}) {
      const std::vector<float> tail(x.begin() + d, x.end());
      const std::vector<float> part = forward(tail, 0.5f, 11, base + d);
      EXPECT_ALL_CLOSE(part, std::vector<float>(whole.begin() + d, whole.end()), 0.0, 0.0)
          << "base " << base << ", shift " << d;
    }
  }
}

TEST(Dropout, DifferentSeedsOrOffsetsGiveDifferentMasks) {
  const std::vector<float> x(4096, 1.0f);
  const std::vector<float> a = forward(x, 0.5f, 1, 0);
  const std::vector<float> b = forward(x, 0.5f, 2, 0);
  const std::vector<float> c = forward(x, 0.5f, 1, 4096);
  int same_seed = 0, same_offset = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    same_seed += (a[i] == 0) == (b[i] == 0);
    same_offset += (a[i] == 0) == (c[i] == 0);
  }
  // Independent masks agree on about half the elements (2048 +- 32 for one sigma).
  EXPECT_NEAR(same_seed, 2048, 6 * 32);
  EXPECT_NEAR(same_offset, 2048, 6 * 32);
  EXPECT_EQ(a, forward(x, 0.5f, 1, 0)) << "same (seed, offset), same mask";
}

TEST(Dropout, DroppedElementsAreZeroEvenForInfAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = i % 2 ? inf : std::numeric_limits<float>::quiet_NaN();
  }
  const std::vector<float> y = forward(x, 0.5f, 3, 0);
  int dropped = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (kept_by_hand(3, 0, static_cast<int64_t>(i), 0.5f)) {
      EXPECT_TRUE(i % 2 ? y[i] == inf : std::isnan(y[i])) << i;
    } else {
      EXPECT_EQ(y[i], 0.0f) << i;
      ++dropped;
    }
  }
  EXPECT_GT(dropped, 0);
}

TEST(Dropout, PZeroIsTheIdentityBitForBit) {
  std::vector<float> x = testing::random_vector(257, 6);
  x[0] = -0.0f;
  x[1] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> y = forward(x, 0.0f, 1, 2);
  EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0);
  std::vector<float> z = x;
  dropout_backward_cpu(z.data(), z.data(), 257, 0.0f, 1, 2);
  EXPECT_EQ(std::memcmp(x.data(), z.data(), x.size() * sizeof(float)), 0);
}

TEST(Dropout, PMustBeInZeroOne) {
  float x[4] = {1, 2, 3, 4}, y[4];
  for (float p : {-0.1f, 1.0f, 1.5f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()}) {
    EXPECT_THROW(dropout_forward_cpu(x, y, 4, p, 1, 0), ValueError) << p;
    EXPECT_THROW(dropout_backward_cpu(x, y, 4, p, 1, 0), ValueError) << p;
    EXPECT_THROW(dropout_scale(p), ValueError) << p;
  }
  try {
    dropout_forward_cpu(x, y, 4, 1.0f, 1, 0);
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("p must be in [0, 1)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dropout_forward_cpu(x, y, -1, 0.5f, 1, 0), ValueError);
  EXPECT_THROW(dropout_forward_cpu(nullptr, y, 4, 0.5f, 1, 0), ValueError);
  EXPECT_NO_THROW(dropout_forward_cpu(nullptr, nullptr, 0, 0.5f, 1, 0));
}

}  // namespace
}  // namespace cudp::kernels
