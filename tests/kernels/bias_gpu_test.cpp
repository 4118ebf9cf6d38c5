// GPU tests of kernels/bias.h against the CPU references and cuDNN, on odd shapes (one row, one
// column, several column tiles, millions of rows), aligned and misaligned pointers.
//
// bias_add is one addition per element: compared exactly. bias_grad sums in fp32 in an order of its
// own, against the reference's double sums, so it gets a tolerance from the error bound of
// summation (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2): a sum computed
// through any tree whose longest chain has D additions differs from the exact sum by at most
// D * u * sum |terms|, u = 2^-24. bias.h bounds D below 300 for the shapes tested here (the longest
// is 3.2M rows: ~200 per thread + lanes + chunks); we allow 512. That bound cannot see a single
// element missing from a long sum, so a second test sums small integers, where every partial sum
// is exact in fp32 whatever the order: there the GPU must equal the reference exactly.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/guarded_buffer.h"
#include "engine/core/stream.h"
#include "engine/core/vendor_check.h"
#include "kernels/bias.h"

namespace cudp::kernels {
namespace {

// A typed null: the float and bf16 overloads would make a bare nullptr ambiguous.
constexpr float* kNoFloats = nullptr;

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{1, 1},
                         {3, 5},
                         {7, 3},
                         {1, 1025},
                         {5, 1025},
                         {1023, 4},
                         {1025, 64},
                         {2, 5000},
                         {4097, 100},
                         {(1 << 14) + 3, 64},
                         {(1 << 18) + 1, 128},
                         {(1 << 20) + 3, 3},
                         {(1 << 12) + 5, 1028}};

// n floats `shift` elements into a poisoned allocation, guard band checked.
using Slice = testing::GuardedBuffer<float>;

std::string where(const Shape& s, int shift_a, int shift_b, float beta = 0.0f) {
  return "rows = " + std::to_string(s.rows) + ", cols = " + std::to_string(s.cols) + ", shifts " +
         std::to_string(shift_a) + "/" + std::to_string(shift_b) +
         ", beta = " + std::to_string(beta);
}

// The summation bound above: 512 * u * max over columns of (sum_r |dy| + |beta * dbias|).
double summation_atol(const std::vector<float>& dy, const std::vector<float>& dbias, int64_t rows,
                      int64_t cols, float beta) {
  std::vector<double> mass(cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      mass[c] += std::fabs(dy[r * cols + c]);
    }
  }
  double worst = 0.0;
  for (int64_t c = 0; c < cols; ++c) {
    worst = std::max(worst, mass[c] + (beta == 0.0f ? 0.0 : std::fabs(double(beta) * dbias[c])));
  }
  return 512.0 * std::ldexp(1.0, -24) * worst;
}

TEST(BiasGpu, BiasAddMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 10;
  for (const Shape& shape : kShapes) {
    for (auto [sy, sb] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{0, 1}, std::pair{3, 3}}) {
      SCOPED_TRACE(where(shape, sy, sb));
      const int64_t n = shape.rows * shape.cols;
      const std::vector<float> y = testing::random_vector(n, ++seed);
      const std::vector<float> bias = testing::random_vector(shape.cols, ++seed);
      std::vector<float> expected = y;
      bias_add_cpu(expected.data(), bias.data(), shape.rows, shape.cols);
      Slice dy(n, sy), db(shape.cols, sb);
      dy.upload(y);
      db.upload(bias);
      bias_add(dy.get(), db.get(), shape.rows, shape.cols, stream);
      EXPECT_ALL_CLOSE(dy.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dy.guards_intact());
      EXPECT_ALL_CLOSE(db.download(), bias, 0.0, 0.0) << "bias is read only";
    }
  }
}

TEST(BiasGpu, BiasGradMatchesCpuWithinTheSummationBound) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 20;
  for (const Shape& shape : kShapes) {
    for (auto [sdy, sdb] : {std::pair{0, 0}, std::pair{1, 1}}) {
      for (float beta : {0.0f, 1.0f, 0.5f}) {
        SCOPED_TRACE(where(shape, sdy, sdb, beta));
        const int64_t n = shape.rows * shape.cols;
        const std::vector<float> dy = testing::random_vector(n, ++seed);
        std::vector<float> dbias = testing::random_vector(shape.cols, ++seed);
        std::vector<float> expected = dbias;
        bias_grad_cpu(dy.data(), expected.data(), shape.rows, shape.cols, beta);
        Slice ddy(n, sdy), ddb(shape.cols, sdb);
        ddy.upload(dy);
        if (beta != 0.0f) {
          ddb.upload(dbias);  // beta = 0: dbias stays poisoned, and must not be read
        }
        bias_grad(ddy.get(), ddb.get(), shape.rows, shape.cols, beta, stream);
        const double atol = summation_atol(dy, dbias, shape.rows, shape.cols, beta);
        EXPECT_ALL_CLOSE(ddb.download(), expected, 0.0, atol);
        EXPECT_TRUE(ddb.guards_intact());
      }
    }
  }
}

TEST(BiasGpu, BiasGradOfIntegersIsExact) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 30;
  // |partial sums| <= 8 * rows + 64 < 2^24: every fp32 addition below is exact.
  for (const Shape& shape : {Shape{(1 << 20) + 3, 3}, Shape{(1 << 16) + 5, 64}, Shape{3, 5000},
                             Shape{1025, 4}, Shape{20001, 7}}) {
    for (int shift : {0, 1}) {
      for (float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(where(shape, shift, 0, beta));
        const int64_t n = shape.rows * shape.cols;
        std::vector<float> dy = testing::random_vector(n, ++seed, -8.0f, 8.0f);
        for (float& v : dy) {
          v = std::trunc(v) == 0.0f ? 1.0f : std::trunc(v);  // nonzero integers
        }
        std::vector<float> dbias = testing::random_vector(shape.cols, ++seed, -64.0f, 64.0f);
        for (float& v : dbias) {
          v = std::round(v);
        }
        std::vector<float> expected = dbias;
        bias_grad_cpu(dy.data(), expected.data(), shape.rows, shape.cols, beta);
        Slice ddy(n, shift), ddb(shape.cols, 0);
        ddy.upload(dy);
        if (beta != 0.0f) {
          ddb.upload(dbias);
        }
        bias_grad(ddy.get(), ddb.get(), shape.rows, shape.cols, beta, stream);
        EXPECT_ALL_CLOSE(ddb.download(), expected, 0.0, 0.0);
      }
    }
  }
}

TEST(BiasGpu, BiasGradIsDeterministic) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  const int64_t rows = (1 << 18) + 7, cols = 64;
  Slice ddy(rows * cols, 0), first(cols, 0), second(cols, 0);
  ddy.upload(testing::random_vector(rows * cols, 40));
  bias_grad(ddy.get(), first.get(), rows, cols, 0.0f, stream);
  for (int i = 0; i < 3; ++i) {
    bias_grad(ddy.get(), second.get(), rows, cols, 0.0f, stream);
    const std::vector<float> a = first.download(), b = second.download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), cols * sizeof(float)), 0) << "run " << i;
  }
}

TEST(BiasGpu, EmptyShapes) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  EXPECT_NO_THROW(bias_add(nullptr, nullptr, 0, 0, stream));
  EXPECT_NO_THROW(bias_grad(kNoFloats, kNoFloats, 7, 0, 1.0f, stream));
  // No rows: dbias = beta * dbias.
  Slice db(3, 0);
  db.upload({2.0f, -4.0f, 8.0f});
  bias_grad(kNoFloats, db.get(), 0, 3, 0.5f, stream);
  EXPECT_ALL_CLOSE(db.download(), std::vector<float>({1.0f, -2.0f, 4.0f}), 0.0, 0.0);
  bias_grad(kNoFloats, db.get(), 0, 3, 0.0f, stream);
  EXPECT_ALL_CLOSE(db.download(), std::vector<float>({0.0f, 0.0f, 0.0f}), 0.0, 0.0);
  EXPECT_THROW(bias_add(db.get(), nullptr, 1, 3, stream), ValueError);
  EXPECT_THROW(bias_grad(db.get(), db.get(), -1, 3, 1.0f, stream), ValueError);
}

// cuDNN sees the [rows, cols] matrix as an NCHW tensor (rows, cols, 1, 1) and the bias as
// (1, cols, 1, 1).
TEST(BiasGpu, MatchesCudnn) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  cudnnHandle_t handle = nullptr;
  cudnnTensorDescriptor_t matrix = nullptr, vector = nullptr;
  CUDP_CUDNN_CHECK(cudnnCreate(&handle));
  CUDP_CUDNN_CHECK(cudnnSetStream(handle, stream));
  CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&matrix));
  CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&vector));
  uint64_t seed = 50;
  for (const Shape& shape :
       {Shape{64 * 28 * 28, 64}, Shape{(1 << 14) + 3, 100}, Shape{256, 4096}}) {
    SCOPED_TRACE(where(shape, 0, 0));
    const int64_t n = shape.rows * shape.cols;
    CUDP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(matrix, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT,
                                                static_cast<int>(shape.rows),
                                                static_cast<int>(shape.cols), 1, 1));
    CUDP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(vector, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1,
                                                static_cast<int>(shape.cols), 1, 1));
    const std::vector<float> y = testing::random_vector(n, ++seed);
    const std::vector<float> bias = testing::random_vector(shape.cols, ++seed);
    Slice ours(n, 0), theirs(n, 0), db(shape.cols, 0);
    ours.upload(y);
    theirs.upload(y);
    db.upload(bias);
    const float one = 1.0f, zero = 0.0f;
    bias_add(ours.get(), db.get(), shape.rows, shape.cols, stream);
    CUDP_CUDNN_CHECK(cudnnAddTensor(handle, &one, vector, db.get(), &one, matrix, theirs.get()));
    EXPECT_ALL_CLOSE(ours.download(), theirs.download(), 1e-6, 1e-6);

    Slice grad_ours(shape.cols, 0), grad_theirs(shape.cols, 0);
    bias_grad(ours.get(), grad_ours.get(), shape.rows, shape.cols, 0.0f, stream);
    CUDP_CUDNN_CHECK(cudnnConvolutionBackwardBias(handle, &one, matrix, ours.get(), &zero, vector,
                                                  grad_theirs.get()));
    const std::vector<float> dy = ours.download();
    // Both sides err by at most the bound (ours: see above; cuDNN's depth unknown, assumed alike).
    const double atol =
        2.0 * summation_atol(dy, std::vector<float>(shape.cols), shape.rows, shape.cols, 0.0f);
    EXPECT_ALL_CLOSE(grad_ours.download(), grad_theirs.download(), 1e-5, atol);
  }
  cudnnDestroyTensorDescriptor(vector);
  cudnnDestroyTensorDescriptor(matrix);
  cudnnDestroy(handle);
}

}  // namespace
}  // namespace cudp::kernels
