#include "common/compare.h"

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

namespace cudp::testing {

::testing::AssertionResult all_close(const std::vector<float>& actual,
                                     const std::vector<double>& expected, double rtol, double atol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size mismatch: actual has " << actual.size() << " elements, expected "
           << expected.size();
  }
  size_t bad = 0, worst = 0;
  double worst_excess = -1.0;
  std::ostringstream first;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], b = expected[i];
    const double err = std::fabs(a - b);
    const double allowed = atol + rtol * std::fabs(b);
    const bool ok = std::isfinite(a) && err <= allowed;
    if (!ok) {
      if (bad < 5) first << "\n  [" << i << "] got " << a << " expected " << b;
      ++bad;
    }
    const double excess = std::isfinite(a) ? err - allowed : INFINITY;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << actual.size() << " elements differ (rtol " << rtol << ", atol " << atol
         << "); worst at index " << worst << ": got " << actual[worst] << ", expected "
         << expected[worst] << first.str();
}

::testing::AssertionResult all_close(const std::vector<float>& actual,
                                     const std::vector<float>& expected, double rtol, double atol) {
  return all_close(actual, std::vector<double>(expected.begin(), expected.end()), rtol, atol);
}

std::vector<float> random_vector(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at " << i << ": " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult column_sums_close(const std::vector<float>& got,
                                             const std::vector<float>& start,
                                             const std::vector<float>& values) {
  const size_t cols = start.size();
  if (got.size() != cols || cols == 0 || values.size() % cols != 0) {
    return ::testing::AssertionFailure() << "sizes differ: " << got.size() << " sums, " << cols
                                         << " starts, " << values.size() << " values";
  }
  std::vector<double> sum(cols), magnitude(cols);
  for (size_t i = 0; i < values.size(); ++i) {
    sum[i % cols] += values[i];
    magnitude[i % cols] += std::fabs(double(values[i]));
  }
  for (size_t c = 0; c < cols; ++c) {
    const double want = double(start[c]) + sum[c];
    const double bound = 512.0 * std::ldexp(1.0, -24) * (magnitude[c] + std::fabs(start[c]));
    if (!(std::fabs(double(got[c]) - want) <= bound)) {
      return ::testing::AssertionFailure()
             << "column " << c << ": " << got[c] << " vs " << want << " (bound " << bound << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace cudp::testing
