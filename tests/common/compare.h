// Tolerance comparison for tests (docs/architecture.md §7): |a - b| <= atol + rtol * |b| element-wise, with b
// the reference. On failure the message names the worst element, its index, both values, the count
// of mismatches and the first few of them.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cudp::testing {

::testing::AssertionResult all_close(const std::vector<float>& actual,
                                     const std::vector<double>& expected, double rtol, double atol);
::testing::AssertionResult all_close(const std::vector<float>& actual,
                                     const std::vector<float>& expected, double rtol, double atol);

// Equal bit for bit (NaNs, signed zeros and all): for results that select or copy values rather
// than compute them. On failure, the first differing index and both values.
::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b);

// Column sums added to `start` (a kernel's `sums += the column sums of the matrix it stored`):
// got[c] within 512 * 2^-24 * (sum_r |values[r][c]| + |start[c]|) of start[c] + the sum in double.
// 512 bounds the fp32 chain of the kernels that take such sums on the way (their tests say how).
// values: the stored matrix as floats, row-major, start.size() columns.
::testing::AssertionResult column_sums_close(const std::vector<float>& got,
                                             const std::vector<float>& start,
                                             const std::vector<float>& values);

// Random floats in [lo, hi) from a fixed seed (never zeros in a meaningful amount).
std::vector<float> random_vector(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f);

// A value that no kernel produces; fill outputs with it before a launch to catch unwritten elements.
inline constexpr float kPoison = -7.77e30f;

}  // namespace cudp::testing

#define EXPECT_ALL_CLOSE(actual, expected, rtol, atol) \
  EXPECT_TRUE(::cudp::testing::all_close((actual), (expected), (rtol), (atol)))
