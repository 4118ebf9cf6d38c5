// Host tests of the element-wise CPU references (kernels/elementwise.h) against hand-computed
// values and independent loops, and of the vector split every element-wise launcher relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "engine/core/error.h"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace {

// A typed null: the float and bf16 overloads would make a bare nullptr ambiguous.
constexpr float* kNoFloats = nullptr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(Relu, ForwardHandValues) {
  const std::vector<float> x = {-2.0f, -0.0f, 0.0f, 1.5f, 3e-39f, -3e-39f, kInf, -kInf, kNaN};
  std::vector<float> y(x.size(), testing::kPoison);
  relu_forward_cpu(x.data(), y.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_FALSE(std::signbit(y[1])) << "relu(-0) is +0";
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 1.5f);
  EXPECT_EQ(y[4], 3e-39f) << "a positive subnormal passes";
  EXPECT_EQ(y[5], 0.0f);
  EXPECT_EQ(y[6], kInf);
  EXPECT_EQ(y[7], 0.0f);
  EXPECT_TRUE(std::isnan(y[8])) << "NaN propagates, as in torch.relu";
}

TEST(Relu, ForwardMatchesIndependentLoopInPlace) {
  std::vector<float> x = testing::random_vector(1001, 1);
  std::vector<float> expected(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    expected[i] = x[i] > 0.0f ? x[i] : 0.0f;
  }
  relu_forward_cpu(x.data(), x.data(), static_cast<int64_t>(x.size()));  // y aliases x
  EXPECT_ALL_CLOSE(x, expected, 0.0, 0.0);
}

TEST(Relu, BackwardUsesTheOutput) {
  const std::vector<float> y = {0.0f, 2.0f, 0.0f, 1e-30f, kNaN};
  const std::vector<float> dy = {5.0f, -3.0f, 7.0f, 0.25f, 9.0f};
  std::vector<float> dx(y.size(), testing::kPoison);
  relu_backward_cpu(y.data(), dy.data(), dx.data(), 5);
  EXPECT_EQ(dx[0], 0.0f);
  EXPECT_EQ(dx[1], -3.0f);
  EXPECT_EQ(dx[2], 0.0f);
  EXPECT_EQ(dx[3], 0.25f);
  EXPECT_EQ(dx[4], 9.0f) << "a NaN output passes the gradient (PyTorch's threshold_backward)";
}

TEST(Relu, BackwardOfForwardIsTheStepFunctionInPlace) {
  const std::vector<float> x = testing::random_vector(999, 2);
  std::vector<float> y(x.size());
  relu_forward_cpu(x.data(), y.data(), static_cast<int64_t>(x.size()));
  std::vector<float> g = testing::random_vector(x.size(), 3, 0.5f, 2.0f);
  std::vector<float> expected(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    expected[i] = x[i] > 0.0f ? g[i] : 0.0f;
  }
  relu_backward_cpu(y.data(), g.data(), g.data(), static_cast<int64_t>(g.size()));  // dx aliases dy
  EXPECT_ALL_CLOSE(g, expected, 0.0, 0.0);
}

TEST(Scale, HandValues) {
  std::vector<float> x = {1.0f, -2.5f, 0.125f};
  scale_cpu(x.data(), -4.0f, 3);
  EXPECT_EQ(x, (std::vector<float>{-4.0f, 10.0f, -0.5f}));
}

TEST(Axpy, HandValues) {
  const std::vector<float> x = {1.5f, -1.0f, 3.0f};
  std::vector<float> y = {0.25f, 2.0f, -6.0f};
  axpy_cpu(2.0f, x.data(), y.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{3.25f, 0.0f, 0.0f}));
}

TEST(Axpy, IsOneFusedMultiplyAdd) {
  // a = 1 + 2^-12: a * a = 1 + 2^-11 + 2^-24 exactly, which rounds alone (a tie, to even) to
  // 1 + 2^-11; a fused a * a - 1 keeps the 2^-24.
  const float a = 1.0f + std::ldexp(1.0f, -12);
  float y = -1.0f;
  axpy_cpu(a, &a, &y, 1);
  EXPECT_EQ(y, std::ldexp(1.0f, -11) + std::ldexp(1.0f, -24));
}

TEST(Axpy, MatchesDoubleLoop) {
  const std::vector<float> x = testing::random_vector(777, 4);
  std::vector<float> y = testing::random_vector(777, 5);
  std::vector<double> expected(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    expected[i] = -0.75 * double(x[i]) + double(y[i]);
  }
  axpy_cpu(-0.75f, x.data(), y.data(), 777);
  EXPECT_ALL_CLOSE(y, expected, 1e-7, 1e-12);  // one rounding of the exact result
}

TEST(Add, HandValuesAndAliasing) {
  std::vector<float> a = {1.0f, -2.0f, 0.5f};
  const std::vector<float> b = {2.0f, 2.0f, 0.25f};
  std::vector<float> out(3, testing::kPoison);
  add_cpu(a.data(), b.data(), out.data(), 3);
  EXPECT_EQ(out, (std::vector<float>{3.0f, 0.0f, 0.75f}));
  add_cpu(a.data(), b.data(), a.data(), 3);  // out aliases a
  EXPECT_EQ(a, out);
}

TEST(FlagNonFinite, FlagsTheSpansHoldingNanOrInfinity) {
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  const std::vector<float> v = {1.f, nan, 2.f, -inf, 3.f, 4.f, inf, -0.f, 3e38f};
  const FloatSpan spans[] = {{v.data(), 1},     {v.data() + 1, 1}, {v.data() + 2, 2},
                             {v.data() + 4, 2}, {v.data() + 6, 1}, {nullptr, 0},
                             {v.data() + 7, 2}};
  std::vector<int> flags = {0, 0, 0, 0, 0, 1, 0};  // a flag set before stays set
  flag_non_finite_cpu(spans, 7, flags.data());
  EXPECT_EQ(flags, (std::vector<int>{0, 1, 1, 0, 1, 1, 0}));
  const FloatSpan negative[] = {{v.data(), -1}}, null_data[] = {{nullptr, 2}};
  EXPECT_THROW(flag_non_finite_cpu(negative, 1, flags.data()), ValueError);
  EXPECT_THROW(flag_non_finite_cpu(null_data, 1, flags.data()), ValueError);
  EXPECT_THROW(flag_non_finite_cpu(spans, 1, nullptr), ValueError);
  EXPECT_NO_THROW(flag_non_finite_cpu(nullptr, 0, nullptr));
}

TEST(ZeroRanges, ZeroesExactlyTheRanges) {
  std::vector<float> v(20, 5.0f);
  const FloatRange ranges[] = {{2, 5}, {5, 5}, {9, 12}, {10, 11}, {19, 20}};
  zero_ranges_cpu(v.data(), ranges, 5);
  std::vector<float> expected(20, 5.0f);
  for (int i : {2, 3, 4, 9, 10, 11, 19}) expected[static_cast<size_t>(i)] = 0.0f;
  EXPECT_EQ(v, expected);
  EXPECT_NO_THROW(zero_ranges_cpu(nullptr, nullptr, 0));
  const FloatRange empty[] = {{3, 3}};
  EXPECT_NO_THROW(zero_ranges_cpu(nullptr, empty, 1));  // nothing to write
}

TEST(ZeroRanges, BadRangesThrowValueErrorNamingTheRange) {
  float v[4] = {};
  const FloatRange backwards[] = {{0, 1}, {3, 2}};
  try {
    zero_ranges_cpu(v, backwards, 2);
    ADD_FAILURE() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("range 1 [3, 2) is not 0 <= begin <= end"),
              std::string::npos)
        << e.what();
  }
  const FloatRange negative[] = {{-1, 2}};
  EXPECT_THROW(zero_ranges_cpu(v, negative, 1), ValueError);
  const FloatRange some[] = {{0, 2}};
  EXPECT_THROW(zero_ranges_cpu(nullptr, some, 1), ValueError);
  EXPECT_THROW(zero_ranges_cpu(v, nullptr, 1), ValueError);
  EXPECT_THROW(zero_ranges_cpu(v, some, -1), ValueError);
}

TEST(Elementwise, ZeroSizeIsANoOpEvenWithNullPointers) {
  EXPECT_NO_THROW(relu_forward_cpu(kNoFloats, kNoFloats, 0));
  EXPECT_NO_THROW(relu_backward_cpu(kNoFloats, kNoFloats, kNoFloats, 0));
  EXPECT_NO_THROW(scale_cpu(nullptr, 2.0f, 0));
  EXPECT_NO_THROW(axpy_cpu(2.0f, nullptr, nullptr, 0));
  EXPECT_NO_THROW(add_cpu(nullptr, nullptr, nullptr, 0));
}

TEST(Elementwise, BadArgumentsThrowValueError) {
  float a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 4};
  EXPECT_THROW(relu_forward_cpu(a, b, -1), ValueError);
  EXPECT_THROW(relu_forward_cpu(kNoFloats, b, 4), ValueError);
  EXPECT_THROW(relu_backward_cpu(a, kNoFloats, b, 4), ValueError);
  EXPECT_THROW(scale_cpu(nullptr, 1.0f, 1), ValueError);
  EXPECT_THROW(axpy_cpu(1.0f, a, b, -5), ValueError);
  EXPECT_THROW(add_cpu(a, b, nullptr, 2), ValueError);
  try {
    relu_forward_cpu(a, b, -3);
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("n must be >= 0, got -3"), std::string::npos) << e.what();
  }
}

// vector_split: addresses are made up (never dereferenced).
const void* at(uintptr_t address) {
  return reinterpret_cast<const void*>(address);
}

TEST(VectorSplit, AlignedArraysAreAllVectorsPlusATail) {
  const auto s = detail::vector_split(1027, {{at(4096), 4}, {at(8192), 4}});
  EXPECT_EQ(s.head, 0);
  EXPECT_EQ(s.vectors, 256);  // 1024 elements, then a scalar tail of 3
}

TEST(VectorSplit, EqualMisalignmentPeelsAHead) {
  // Element 0 sits 4 bytes past a 16-byte boundary: 3 scalars reach the next one.
  const auto s = detail::vector_split(100, {{at(4100), 4}, {at(8196), 4}, {at(260), 4}});
  EXPECT_EQ(s.head, 3);
  EXPECT_EQ(s.vectors, 24);  // 97 elements left: 24 float4, 1 scalar
}

TEST(VectorSplit, DifferentMisalignmentIsAllScalar) {
  const auto s = detail::vector_split(100, {{at(4100), 4}, {at(8192), 4}});
  EXPECT_EQ(s.head, 100);
  EXPECT_EQ(s.vectors, 0);
}

TEST(VectorSplit, ShortArraysClampTheHead) {
  const auto s = detail::vector_split(2, {{at(4100), 4}});
  EXPECT_EQ(s.head, 2);
  EXPECT_EQ(s.vectors, 0);
  const auto z = detail::vector_split(0, {{at(4100), 4}});
  EXPECT_EQ(z.head, 0);
  EXPECT_EQ(z.vectors, 0);
}

TEST(VectorSplit, MixedElementSizes) {
  // fp32 source 8 bytes past a 16-byte boundary, bf16 destination 4 bytes past an 8-byte one: both
  // reach a 4-element boundary after 2 elements.
  const auto s = detail::vector_split(11, {{at(4104), 4}, {at(2052), 2}});
  EXPECT_EQ(s.head, 2);
  EXPECT_EQ(s.vectors, 2);
  const auto t = detail::vector_split(11, {{at(4104), 4}, {at(2050), 2}});  // bf16 needs 3
  EXPECT_EQ(t.head, 11);
  EXPECT_EQ(t.vectors, 0);
  const auto u = detail::vector_split(11, {{at(4102), 4}});  // not even 4-byte aligned
  EXPECT_EQ(u.head, 11);
}

}  // namespace
}  // namespace cudp::kernels
