// Host tests of scatter/gather: torch.chunk arithmetic, gather on the CPU, and the checks' texts
// (every check that comes before any device is touched).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "engine/parallel/scatter_gather.h"

namespace cudp::parallel {
namespace {

using Sizes = std::vector<int64_t>;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no exception)";
}

Tensor iota_tensor(const Shape& shape, float start = 0.f) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  std::iota(v.begin(), v.end(), start);
  return Tensor::from_vector(v, shape);
}

TEST(ChunkSizes, FollowTorchChunk) {
  EXPECT_EQ(chunk_sizes(7, 2), (Sizes{4, 3}));
  EXPECT_EQ(chunk_sizes(8, 2), (Sizes{4, 4}));
  EXPECT_EQ(chunk_sizes(6, 4), (Sizes{2, 2, 2}));  // three chunks on four devices
  EXPECT_EQ(chunk_sizes(1, 2), (Sizes{1}));        // one chunk on two devices
  EXPECT_EQ(chunk_sizes(5, 4), (Sizes{2, 2, 1}));
  EXPECT_EQ(chunk_sizes(9, 4), (Sizes{3, 3, 3}));
  EXPECT_EQ(chunk_sizes(10, 4), (Sizes{3, 3, 3, 1}));
  EXPECT_EQ(chunk_sizes(3, 8), (Sizes{1, 1, 1}));
  EXPECT_EQ(chunk_sizes(256, 1), (Sizes{256}));
  EXPECT_EQ(chunk_sizes(256, 3), (Sizes{86, 86, 84}));
}

TEST(ChunkSizes, SumToTheBatchAndNeverExceedTheDevices) {
  for (int64_t n = 1; n <= 64; ++n) {
    for (int k = 1; k <= 9; ++k) {
      const Sizes s = chunk_sizes(n, k);
      EXPECT_EQ(std::accumulate(s.begin(), s.end(), int64_t{0}), n) << n << " on " << k;
      EXPECT_LE(static_cast<int>(s.size()), k) << n << " on " << k;
      for (size_t i = 0; i + 1 < s.size(); ++i) EXPECT_EQ(s[i], s[0]) << n << " on " << k;
      EXPECT_GE(s.back(), 1);
      EXPECT_LE(s.back(), s[0]);
    }
  }
}

TEST(ChunkSizes, EmptyBatchAndNoDeviceAreErrors) {
  EXPECT_THROW(chunk_sizes(0, 2), ValueError);
  EXPECT_NE(error_of([] { chunk_sizes(0, 2); }).find("an empty batch has nothing to scatter"),
            std::string::npos);
  EXPECT_THROW(chunk_sizes(-3, 2), ValueError);
  EXPECT_NE(error_of([] { chunk_sizes(4, 0); }).find("give at least one device"),
            std::string::npos);
}

TEST(Scatter, ChecksComeBeforeAnyDevice) {
  const Tensor x = iota_tensor({7, 3});
  EXPECT_EQ(error_of([&] {
              scatter(x, {0, 1}, 1);
            }),
            "scatter along dim 1 is not supported yet: cudp splits and concatenates along dim 0 "
            "(the batch) only");
  EXPECT_EQ(error_of([&] {
              scatter(x, {0, 1}, 2);
            }),
            "scatter: dim 2 is out of range for Tensor[7, 3] f32 cpu");
  EXPECT_EQ(error_of([&] {
              scatter(Tensor::full({}, 1.f), {0, 1});
            }),
            "scatter: cannot split Tensor[] f32 cpu: a scalar has no dimension to split along");
  EXPECT_EQ(error_of([&] { scatter(Tensor(), {0}); }), "scatter: the input is undefined");
  EXPECT_EQ(
      error_of([&] {
        scatter(x, {0, 1}, Sizes{4, 4});
      }),
      "scatter: chunk sizes [4, 4] do not split the 7 rows along dim 0 of Tensor[7, 3] f32 cpu");
  EXPECT_EQ(error_of([&] {
              scatter(x, {0}, Sizes{4, 3});
            }),
            "scatter: 2 chunks for 1 devices; give between 1 and 1 chunk sizes");
  EXPECT_NE(error_of([&] {
              scatter(Tensor::zeros({0, 3}), {0, 1});
            }).find("empty batch"),
            std::string::npos);
}

TEST(Gather, ConcatenatesOnTheCpu) {
  const Tensor a = iota_tensor({4, 3}, 0.f);
  const Tensor b = iota_tensor({3, 3}, 12.f);
  const Tensor out = gather({a, b}, -1);
  EXPECT_EQ(out.shape(), (Shape{7, 3}));
  EXPECT_TRUE(out.is_cpu());
  std::vector<float> expected(21);
  std::iota(expected.begin(), expected.end(), 0.f);
  EXPECT_EQ(out.to_vector<float>(), expected);
  // One tensor already on the output device comes back as it is.
  EXPECT_TRUE(gather({a}, -1).shares_storage(a));
}

TEST(Gather, ScalarsBecomeAVector) {
  const Tensor out = gather({Tensor::full({}, 1.5f), Tensor::full({}, -2.f)}, -1);
  EXPECT_EQ(out.shape(), (Shape{2}));
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{1.5f, -2.f}));
}

TEST(Gather, ShapeAndDtypeMismatchesUsePyTorchsWords) {
  const Tensor a = Tensor::zeros({3, 5});
  EXPECT_EQ(error_of([&] {
              gather({a, Tensor::zeros({3, 4})}, -1);
            }),
            "Input tensor at index 1 has invalid shape [3, 4], but expected [3, 5]");
  EXPECT_EQ(error_of([&] {
              gather({a, Tensor::zeros({2, 5, 1})}, -1);
            }),
            "Input tensor at index 1 has invalid shape [2, 5, 1], but expected [2, 5]");
  EXPECT_EQ(error_of([&] {
              gather({a, Tensor::zeros({3, 5}, DType::i32)}, -1);
            }),
            "Input tensor at index 1 has dtype i32, but expected f32");
  EXPECT_EQ(error_of([&] {
              gather({a, Tensor()}, -1);
            }),
            "gather: input tensor at index 1 is undefined");
  EXPECT_EQ(error_of([&] { gather({}, -1); }), "gather: no tensors to gather");
  EXPECT_EQ(error_of([&] { gather({a}, -1, 1); }),
            "gather along dim 1 is not supported yet: cudp splits and concatenates along dim 0 "
            "(the batch) only");
  EXPECT_EQ(error_of([&] { gather({a}, -2); }),
            "gather: output_device -2 is neither a CUDA device id nor -1 (the CPU)");
}

}  // namespace
}  // namespace cudp::parallel
