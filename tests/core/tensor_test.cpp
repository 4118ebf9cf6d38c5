// Host tests of Tensor: shapes, dtypes, views, slices, errors and the seeded initialisers on CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "engine/core/tensor.h"

namespace cudp {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(element_size(DType::f32), 4u);
  EXPECT_EQ(element_size(DType::bf16), 2u);
  EXPECT_EQ(element_size(DType::f16), 2u);
  EXPECT_EQ(element_size(DType::i32), 4u);
  EXPECT_EQ(element_size(DType::i64), 8u);
  EXPECT_EQ(element_size(DType::u8), 1u);
  EXPECT_STREQ(dtype_name(DType::bf16), "bf16");
  static_assert(dtype_of<int64_t>() == DType::i64);
}

TEST(Tensor, ShapeNumelAndString) {
  const Tensor t = Tensor::zeros({2, 3, 5});
  EXPECT_EQ(t.numel(), 30);
  EXPECT_EQ(t.nbytes(), 120u);
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.size(-1), 5);
  EXPECT_EQ(t.str(), "Tensor[2, 3, 5] f32 cpu");
  EXPECT_THROW(t.size(3), ValueError);
  EXPECT_THROW(Tensor::empty({2, -3}), ValueError);
  EXPECT_EQ(Tensor::empty({}).numel(), 1);  // a scalar
  EXPECT_FALSE(Tensor().defined());
}

TEST(Tensor, FromVectorRoundTripsEveryDtype) {
  const std::vector<int64_t> i64 = {-5, 1LL << 40, 7};
  EXPECT_EQ(Tensor::from_vector(i64, {3}).to_vector<int64_t>(), i64);
  const std::vector<uint8_t> u8 = {0, 255, 9, 1};
  EXPECT_EQ(Tensor::from_vector(u8, {2, 2}).to_vector<uint8_t>(), u8);
  const std::vector<float> f = {1.5f, -2.25f};
  const Tensor t = Tensor::from_vector(f, {2});
  EXPECT_EQ(t.to_vector<float>(), f);
  EXPECT_THROW(t.to_vector<int32_t>(), ValueError);
  EXPECT_THROW(Tensor::from_vector(f, {3}), ValueError);
}

TEST(Tensor, ViewSharesStorageAndInfersMinusOne) {
  std::vector<float> values(24);
  std::iota(values.begin(), values.end(), 0.f);
  const Tensor t = Tensor::from_vector(values, {2, 3, 4});
  const Tensor v = t.view({-1, 4});
  EXPECT_EQ(v.shape(), (Shape{6, 4}));
  EXPECT_TRUE(v.shares_storage(t));
  v.data<float>()[5] = 100.f;
  EXPECT_EQ(t.data<float>()[5], 100.f);
  EXPECT_THROW(t.view({5, -1}), ValueError);
  EXPECT_THROW(t.view({-1, -1}), ValueError);
  EXPECT_THROW(t.view({7, 4}), ValueError);
}

TEST(Tensor, SliceAlongDimZeroIsAView) {
  std::vector<int32_t> values(12);
  std::iota(values.begin(), values.end(), 0);
  const Tensor t = Tensor::from_vector(values, {4, 3});
  const Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.to_vector<int32_t>(), (std::vector<int32_t>{3, 4, 5, 6, 7, 8}));
  EXPECT_TRUE(s.shares_storage(t));
  EXPECT_EQ(t.slice(4, 4).numel(), 0);
  EXPECT_THROW(t.slice(2, 5), ValueError);
  EXPECT_THROW(t.slice(3, 2), ValueError);
}

TEST(Tensor, CloneIsADeepCopy) {
  const Tensor t = Tensor::full({3}, 2.f);
  const Tensor c = t.clone();
  c.data<float>()[0] = 9.f;
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{2.f, 2.f, 2.f}));
  EXPECT_FALSE(c.shares_storage(t));
  EXPECT_EQ(t.to(Device::cpu()).data_ptr(), t.data_ptr());  // already there: same tensor
}

TEST(Tensor, CopyFromChecksShapeAndDtype) {
  Tensor dst = Tensor::zeros({2, 2});
  EXPECT_THROW(dst.copy_from(Tensor::zeros({4})), ValueError);
  EXPECT_THROW(dst.copy_from(Tensor::zeros({2, 2}, DType::i32)), ValueError);
  dst.copy_from(Tensor::full({2, 2}, 3.f));
  EXPECT_EQ(dst.to_vector<float>(), std::vector<float>(4, 3.f));
}

TEST(Tensor, SeededUniformIsReproducibleAndInRange) {
  Tensor a = Tensor::empty({1000});
  Tensor b = Tensor::empty({1000});
  a.uniform_(-2.f, 3.f, 42);
  b.uniform_(-2.f, 3.f, 42);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  double mean = 0;
  for (float x : a.to_vector<float>()) {
    EXPECT_GE(x, -2.f);
    EXPECT_LT(x, 3.f);
    mean += x / 1000.0;
  }
  EXPECT_NEAR(mean, 0.5, 0.25);  // 5 sigma of a uniform's mean over 1000 draws is ~0.23
  b.uniform_(-2.f, 3.f, 43);
  EXPECT_NE(a.to_vector<float>(), b.to_vector<float>());
}

TEST(Tensor, SeededNormalHasTheAskedMoments) {
  Tensor a = Tensor::empty({20000});
  a.normal_(1.f, 0.5f, 7);
  double mean = 0, sq = 0;
  for (float x : a.to_vector<float>()) {
    mean += x;
    sq += double(x) * x;
  }
  mean /= 20000;
  const double var = sq / 20000 - mean * mean;
  EXPECT_NEAR(mean, 1.0, 0.02);           // 5 sigma: 5 * 0.5 / sqrt(20000) = 0.018
  EXPECT_NEAR(std::sqrt(var), 0.5, 0.02);
}

TEST(Tensor, OffsetContinuesTheSameStream) {
  Tensor whole = Tensor::empty({10});
  whole.uniform_(0.f, 1.f, 5);
  Tensor tail = Tensor::empty({4});
  tail.uniform_(0.f, 1.f, 5, /*offset=*/6);
  const auto w = whole.to_vector<float>();
  EXPECT_EQ(tail.to_vector<float>(), std::vector<float>(w.begin() + 6, w.end()));
}

TEST(Tensor, DeviceAndShapeChecksNameTheProblem) {
  const Tensor t = Tensor::zeros({2, 3});
  try {
    check_device(t, Device::cuda(0), "input");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("input is on cpu but is expected on cuda:0"), std::string::npos)
        << e.message();
  }
  try {
    check_shape(t, {3, 2}, "weight");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_EQ(e.message(), "weight has invalid shape [2, 3], but expected [3, 2]");
  }
}

}  // namespace
}  // namespace cudp
