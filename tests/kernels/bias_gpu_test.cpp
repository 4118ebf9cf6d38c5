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
//
// The order itself is fixed (kernels/bias.h), so a host emulation of it, addition for addition,
// must match the GPU bit for bit: that test covers the chunking and both stages (each case run
// twice back to back on one stream).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/compare.h"
#include "common/gpu.h"
#include "common/guarded_buffer.h"
#include "common/scoped_switch.h"
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

// ---- bias_grad's exact order, emulated on the host ----

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The vector width bias_grad_dispatch picks (kernels/bias.cu) for dy (and y, dy_masked) `shift`
// elements into cudaMalloc'd (256-byte aligned) allocations.
template <typename T>
int vector_width(int64_t cols, int shift) {
  if (sizeof(T) == 2 && cols % 8 == 0 && shift % 8 == 0) {
    return 8;
  }
  return cols % 4 == 0 && shift % 4 == 0 ? 4 : 1;
}

// bias_grad_impl's cut of the work: 256 threads a block, `width` column groups of v columns by
// `lanes` lanes; `chunks` blocks of chunk_rows rows down each of `tiles` column tiles.
struct Chunking {
  int width, lanes;
  int64_t tiles, chunks, chunk_rows;
};
Chunking chunking(int64_t rows, int64_t cols, int v) {
  Chunking k{};
  const int64_t cols_v = cols / v;
  k.width = static_cast<int>(std::min<int64_t>(cols_v, 256));
  k.lanes = 256 / k.width;
  k.tiles = ceil_div(cols_v, k.width);
  k.chunks =
      std::clamp<int64_t>(ceil_div(rows, k.lanes * 4), 1, std::max<int64_t>(1, 1024 / k.tiles));
  k.chunk_rows = std::max<int64_t>(1, ceil_div(rows, k.chunks));
  k.chunks = std::max<int64_t>(1, ceil_div(rows, k.chunk_rows));
  return k;
}

// What bias_grad computes, addition for addition, from x (dy as floats, masked when fused):
// stage 1, per chunk g and column c: lane l (< lanes) sums rows g * chunk_rows + l, + lanes, ...
// from 0.0f, then the lanes are added in order (from lane 0's sum). With one chunk, that is the
// sum; otherwise stage 2: lane l of 32 sums chunks l, l + 32, ... from 0.0f, the 32 lanes are
// added in order (from lane 0's), and dbias = beta == 0 ? total : fmaf(beta, dbias, total).
// (Only additions in a fixed order, which vectorising across columns does not change.)
std::vector<float> emulate_bias_grad(const std::vector<float>& x, std::vector<float> dbias,
                                     int64_t rows, int64_t cols, int v, float beta) {
  const Chunking k = chunking(rows, cols, v);
  std::vector<float> partial(static_cast<size_t>(k.chunks * cols));
  std::vector<float> lane(static_cast<size_t>(k.lanes * cols));
  for (int64_t g = 0; g < k.chunks; ++g) {
    const int64_t end = std::min(rows, (g + 1) * k.chunk_rows);
    std::fill(lane.begin(), lane.end(), 0.0f);
    for (int l = 0; l < k.lanes; ++l) {
      float* acc = lane.data() + l * cols;
      for (int64_t r = g * k.chunk_rows + l; r < end; r += k.lanes) {
        const float* row = x.data() + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          acc[c] += row[c];
        }
      }
    }
    float* out = partial.data() + g * cols;
    std::copy(lane.begin(), lane.begin() + cols, out);
    for (int l = 1; l < k.lanes; ++l) {
      for (int64_t c = 0; c < cols; ++c) {
        out[c] += lane[l * cols + c];
      }
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    float total = partial[c];
    if (k.chunks > 1) {
      float sums[32];
      for (int l = 0; l < 32; ++l) {
        sums[l] = 0.0f;
        for (int64_t g = l; g < k.chunks; g += 32) {
          sums[l] += partial[g * cols + c];
        }
      }
      total = sums[0];
      for (int l = 1; l < 32; ++l) {
        total += sums[l];
      }
    }
    dbias[c] = beta == 0.0f ? total : std::fmaf(beta, dbias[c], total);
  }
  return dbias;
}

// Many chunks (more than 32: every lane of stage 2 sums several), few (2 to 32), exactly 32 and
// 33, several column tiles (the last one partial), each with every vector width.
const Shape kOrderShapes[] = {{100000, 64}, {1024, 512}, {3000, 2500}, {3000, 2504}, {40, 2500},
                              {4096, 64},   {4097, 64},  {1000, 64},   {200, 64},    {100003, 3}};

// The emulation itself, on the host: within the summation bound of the double reference, and exact
// on small integers (every partial sum exact), for the shapes the GPU test uses.
TEST(BiasGradOrder, EmulationMatchesTheCpuReference) {
  uint64_t seed = 60;
  bool many_tiled = false, few_tiled = false, at_32 = false, at_33 = false;
  for (const Shape& shape : kOrderShapes) {
    for (int v : {1, 4, 8}) {
      if (shape.cols % v != 0) {
        continue;
      }
      const Chunking k = chunking(shape.rows, shape.cols, v);
      many_tiled |= k.chunks > 32 && k.tiles > 1;
      few_tiled |= k.chunks > 1 && k.chunks <= 32 && k.tiles > 1;
      at_32 |= k.chunks == 32;
      at_33 |= k.chunks == 33;
      SCOPED_TRACE(where(shape, 0, 0) + ", V = " + std::to_string(v));
      const int64_t n = shape.rows * shape.cols;
      const std::vector<float> dy = testing::random_vector(n, ++seed);
      const std::vector<float> dbias = testing::random_vector(shape.cols, ++seed);
      std::vector<float> expected = dbias;
      bias_grad_cpu(dy.data(), expected.data(), shape.rows, shape.cols, 0.5f);
      EXPECT_ALL_CLOSE(emulate_bias_grad(dy, dbias, shape.rows, shape.cols, v, 0.5f), expected, 0.0,
                       summation_atol(dy, dbias, shape.rows, shape.cols, 0.5f));
      std::vector<float> ints = dy;
      for (float& x : ints) {
        x = std::round(8.0f * x);
      }
      expected = dbias;
      bias_grad_cpu(ints.data(), expected.data(), shape.rows, shape.cols, 0.0f);
      EXPECT_ALL_CLOSE(emulate_bias_grad(ints, dbias, shape.rows, shape.cols, v, 0.0f), expected,
                       0.0, 0.0);
    }
  }
  EXPECT_TRUE(many_tiled && few_tiled && at_32 && at_33) << "kOrderShapes misses a case";
}

template <typename T>
T to(float x) {
  if constexpr (sizeof(T) == 2) {
    return __float2bfloat16_rn(x);
  } else {
    return x;
  }
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// One case of the test below: bias_grad (or relu_mask_bias_grad with `relu`) run twice back to back
// on the stream into two outputs, each equal to the emulation bit for bit.
template <typename T>
void check_exact_order(const Shape& shape, int shift, bool relu, float beta, uint64_t seed,
                       cudaStream_t stream) {
  const int v = vector_width<T>(shape.cols, shift);
  const Chunking k = chunking(shape.rows, shape.cols, v);
  SCOPED_TRACE(where(shape, shift, 0, beta) + (sizeof(T) == 2 ? ", bf16" : ", fp32") +
               (relu ? ", ReLU mask" : "") + ", V = " + std::to_string(v) +
               ", chunks = " + std::to_string(k.chunks) + ", tiles = " + std::to_string(k.tiles));
  const int64_t n = shape.rows * shape.cols;
  std::vector<float> dyf = testing::random_vector(n, seed);
  std::vector<float> yf = testing::random_vector(n, seed + 1);  // half of it <= 0: masked
  if constexpr (sizeof(T) == 2) {
    for (float& x : dyf) x = testing::bf16_rounded(x);
    for (float& x : yf) x = testing::bf16_rounded(x);
  }
  std::vector<T> dy(n), y(n), masked(n);
  std::vector<float> x = dyf;  // what is summed
  for (int64_t i = 0; i < n; ++i) {
    dy[i] = to<T>(dyf[i]);
    y[i] = to<T>(yf[i]);
    if (relu) {
      x[i] = yf[i] <= 0.0f ? 0.0f : dyf[i];  // detail::relu_grad
    }
    masked[i] = to<T>(x[i]);
  }
  const std::vector<float> dbias = testing::random_vector(shape.cols, seed + 2);
  const std::vector<float> expected = emulate_bias_grad(x, dbias, shape.rows, shape.cols, v, beta);

  const T poison = to<T>(testing::kPoison);
  testing::GuardedBuffer<T> ddy(n, shift, poison), dyv(n, shift, poison), dmasked(n, shift, poison);
  Slice first(shape.cols, 0), second(shape.cols, 0);
  ddy.upload(dy);
  dyv.upload(y);
  if (beta != 0.0f) {
    first.upload(dbias);  // beta = 0: the outputs stay poisoned, and must not be read
    second.upload(dbias);
  }
  for (Slice* out : {&first, &second}) {
    if (relu) {
      relu_mask_bias_grad(dyv.get(), ddy.get(), dmasked.get(), out->get(), shape.rows, shape.cols,
                          beta, stream);
    } else {
      bias_grad(ddy.get(), out->get(), shape.rows, shape.cols, beta, stream);
    }
  }
  const std::vector<float> a = first.download(), b = second.download();
  EXPECT_TRUE(testing::bitwise_equal(a, expected)) << "first run against the emulation";
  EXPECT_TRUE(testing::bitwise_equal(b, a)) << "second run against the first";
  EXPECT_TRUE(first.guards_intact());
  EXPECT_TRUE(second.guards_intact());
  if (relu) {
    EXPECT_TRUE(same_bits(dmasked.download(), masked)) << "dy_masked";
    EXPECT_TRUE(dmasked.guards_intact());
  }
}

TEST(BiasGpu, BiasGradFollowsItsExactOrderBitForBit) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 70;
  for (const Shape& shape : kOrderShapes) {
    for (bool relu : {false, true}) {
      for (float beta : {0.0f, 0.5f}) {
        // fp32: V = 4, 1; bf16: V = 8, 4, 1 (where cols allows).
        for (int shift : {0, 1}) {
          check_exact_order<float>(shape, shift, relu, beta, seed += 3, stream);
        }
        for (int shift : {0, 4, 1}) {
          check_exact_order<__nv_bfloat16>(shape, shift, relu, beta, seed += 3, stream);
        }
      }
    }
  }
}

// The queued sums' tests (NOTE [Deferred bias gradients]): on a GPU, the switch on for the test
// and put back after it, the queue's stream and another.
class DeferredBiasGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    CUDP_REQUIRE_GPU();
    stream = cuda::Stream::create(0);
    other = cuda::Stream::create(0);
  }
  const testing::ScopedSwitch<bool> queued_{detail::deferred_bias_grads,
                                            detail::set_deferred_bias_grads, true};
  cuda::Stream stream, other;  // made once a GPU is known to be there
};

// NOTE [Deferred bias gradients] (kernels/bias.h): inside a scope, the sums handed over with their
// workspace are queued, nothing of them lands before the flush, and the flush's one launch gives
// each gradient the bits of its own launch (partials whose order shows: values of mixed
// magnitudes and signs, so another order would round differently somewhere). A second sum into a
// queued gradient flushes the queue first (the two in order); a scope that is not the outermost
// is inactive (its sums go to the outer queue); a sum on another stream and any sum under a scope
// with the switch off run at once.
TEST_F(DeferredBiasGpu, SumsRunAsOneLaunchWithTheBitsOfOneLaunchEach) {
  struct Sum {
    int64_t chunks, cols;
    float beta;
    int target;  // which gradient it adds to
  };
  // Gradients 0-4 once each (one tile, several, a partial tile, beta 0 over NaN, beta 0.5); then
  // gradient 1 again (flushes the queue before it is queued).
  const std::vector<Sum> sums = {{1, 10, 0.f, 0},     {37, 64, 1.f, 1}, {660, 512, 1.f, 2},
                                 {1024, 100, 0.f, 3}, {5, 33, 0.5f, 4}, {300, 64, 1.f, 1}};
  const int64_t sizes[] = {10, 64, 512, 100, 33};
  std::vector<Slice> want, got;
  std::vector<std::vector<float>> initial;
  uint64_t seed = 900;
  for (int64_t n : sizes) {
    std::vector<float> v = testing::random_vector(n, seed++, -4.f, 4.f);
    if (n == 100) std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
    initial.push_back(v);
    want.emplace_back(n, 0);
    got.emplace_back(n, 0);
    want.back().upload(v);
    got.back().upload(v);
  }
  std::vector<std::vector<float>> partials;
  for (const Sum& sum : sums) {
    std::vector<float> p = testing::random_vector(sum.chunks * sum.cols, seed++, -1.f, 1.f);
    for (size_t i = 0; i < p.size(); i += 7) p[i] *= 4096.f;  // magnitudes whose order shows
    partials.push_back(std::move(p));
  }
  // One launch each, in order, outside any scope.
  for (size_t i = 0; i < sums.size(); ++i) {
    Slice in(int64_t(partials[i].size()), 0);
    in.upload(partials[i]);
    bias_grad_from_partials(in.get(), want[sums[i].target].get(), sums[i].chunks, sums[i].cols,
                            sums[i].beta, stream);
    stream.synchronize();
  }
  auto queue = [&](size_t i, cudaStream_t on) {
    Workspace ws(partials[i].size() * sizeof(float), on);
    CUDP_CUDA_CHECK(cudaMemcpyAsync(ws.get(), partials[i].data(),
                                    partials[i].size() * sizeof(float), cudaMemcpyHostToDevice,
                                    on));
    bias_grad_from_partials(std::move(ws), got[sums[i].target].get(), sums[i].chunks, sums[i].cols,
                            sums[i].beta, on);
  };
  {
    DeferredBiasGrads scope(0, stream);
    ASSERT_TRUE(scope.active());
    {
      DeferredBiasGrads inner(0, stream);  // not the outermost: its sums go to the outer queue
      EXPECT_FALSE(inner.active());
      queue(0, stream);
      EXPECT_EQ(detail::deferred_bias_grads_queued(), 1);
    }
    EXPECT_EQ(detail::deferred_bias_grads_queued(), 1);
    for (size_t i = 1; i < 5; ++i) queue(i, stream);
    EXPECT_EQ(detail::deferred_bias_grads_queued(), 5);
    stream.synchronize();
    for (int t = 0; t < 5; ++t) {
      const std::vector<float> now = got[t].download();
      EXPECT_EQ(std::memcmp(now.data(), initial[t].data(), now.size() * sizeof(float)), 0)
          << "gradient " << t << " changed before the flush";
    }
    queue(5, stream);  // gradient 1 again: the five before it run first
    EXPECT_EQ(detail::deferred_bias_grads_queued(), 1);
    flush_deferred_bias_grads();
    EXPECT_EQ(detail::deferred_bias_grads_queued(), 0);
    stream.synchronize();
  }
  for (int t = 0; t < 5; ++t) {
    const std::vector<float> a = want[t].download(), b = got[t].download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
        << "gradient " << t << ": the queued sums differ from one launch each";
    EXPECT_TRUE(got[t].guards_intact()) << "gradient " << t;
  }
  // Gradient 3's sum (beta 0 over NaN) against the reference in double, within the summation
  // bound above: the queue is no stand-in for it.
  std::vector<float> ref(initial[3]);
  bias_grad_cpu(partials[3].data(), ref.data(), sums[3].chunks, sums[3].cols, 0.f);
  EXPECT_ALL_CLOSE(got[3].download(), ref, 0.0,
                   summation_atol(partials[3], initial[3], sums[3].chunks, sums[3].cols, 0.f));
  // Another stream, or the switch off: at once, and the sum lands (sum 1 once more on gradient
  // 1, against the same launch outside any scope).
  std::vector<float> gradient1 = want[1].download();
  Slice in1(int64_t(partials[1].size()), 0);
  in1.upload(partials[1]);
  for (const bool switch_off : {false, true}) {
    SCOPED_TRACE(switch_off ? "the switch off" : "another stream");
    want[1].upload(gradient1);
    got[1].upload(gradient1);
    bias_grad_from_partials(in1.get(), want[1].get(), sums[1].chunks, sums[1].cols, sums[1].beta,
                            stream);
    stream.synchronize();
    detail::set_deferred_bias_grads(!switch_off);
    {
      DeferredBiasGrads scope(0, stream);
      EXPECT_EQ(scope.active(), !switch_off);
      queue(1, switch_off ? stream.get() : other.get());
      EXPECT_EQ(detail::deferred_bias_grads_queued(), 0);
    }
    other.synchronize();
    stream.synchronize();
    const std::vector<float> a = want[1].download(), b = got[1].download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  }
}

// NOTE [Deferred bias gradients]: a launch that writes a queued gradient itself (bias_grad, which
// never queues) comes after the queued sum, on the queue's stream and on another (which waits for
// the flush); a queue of kMaxFinalJobs (48) sums flushes before the 49th. Each against the same
// launches one at a time on one stream, bit for bit. The direct write overwrites (beta 0), so in
// order it leaves exactly its own sum, and out of order the queued sum on top of it; and the
// queue's stream is kept busy (a 1 GiB memset) before the flush, so that a writer on another
// stream that did not wait for the flush would run first.
TEST_F(DeferredBiasGpu, SumsStayInOrderWithDirectWritesAndPastTheQueuesCapacity) {
  const int64_t cols = 96, chunks = 40, rows = 3000;
  Slice dy(rows * cols, 0);
  dy.upload(testing::random_vector(size_t(rows * cols), 950, -1.f, 1.f));
  std::vector<std::vector<float>> partials;
  for (uint64_t i = 0; i < 50; ++i) {
    partials.push_back(testing::random_vector(size_t(chunks * cols), 960 + i, -8.f, 8.f));
  }
  const auto workspace = [&](const std::vector<float>& values, cudaStream_t on) {
    Workspace ws(values.size() * sizeof(float), on);
    CUDP_CUDA_CHECK(cudaMemcpyAsync(ws.get(), values.data(), values.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, on));
    return ws;
  };
  const std::vector<float> initial = testing::random_vector(size_t(cols), 955, -2.f, 2.f);
  for (const bool same_stream : {true, false}) {
    SCOPED_TRACE(same_stream ? "the direct write on the queue's stream" : "on another stream");
    const cudaStream_t writer = same_stream ? stream.get() : other.get();
    Slice in(chunks * cols, 0), want(cols, 0), got(cols, 0);
    in.upload(partials[0]);
    want.upload(initial);
    got.upload(initial);
    bias_grad_from_partials(in.get(), want.get(), chunks, cols, 1.f, stream);
    bias_grad(dy.get(), want.get(), rows, cols, 0.f, stream);
    stream.synchronize();
    {
      DeferredBiasGrads scope(0, stream);
      bias_grad_from_partials(workspace(partials[0], stream), got.get(), chunks, cols, 1.f, stream);
      EXPECT_EQ(detail::deferred_bias_grads_queued(), 1);
      Workspace busy(size_t(1) << 30, stream);
      CUDP_CUDA_CHECK(cudaMemsetAsync(busy.get(), 0, size_t(1) << 30, stream));
      bias_grad(dy.get(), got.get(), rows, cols, 0.f, writer);
      EXPECT_EQ(detail::deferred_bias_grads_queued(), 0) << "the direct write did not flush";
      other.synchronize();
      stream.synchronize();
    }
    const std::vector<float> a = want.download(), b = got.download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
        << "the direct write and the queued sum out of order";
    EXPECT_TRUE(got.guards_intact());
  }
  // 50 gradients, one sum each: the 49th finds the queue full and flushes the first 48.
  std::vector<Slice> want, got;
  for (size_t i = 0; i < partials.size(); ++i) {
    want.emplace_back(cols, 0);
    got.emplace_back(cols, 0);
    want.back().upload(initial);
    got.back().upload(initial);
    Slice in(chunks * cols, 0);
    in.upload(partials[i]);
    bias_grad_from_partials(in.get(), want.back().get(), chunks, cols, 0.5f, stream);
    stream.synchronize();
  }
  {
    DeferredBiasGrads scope(0, stream);
    for (size_t i = 0; i < partials.size(); ++i) {
      bias_grad_from_partials(workspace(partials[i], stream), got[i].get(), chunks, cols, 0.5f,
                              stream);
      EXPECT_EQ(detail::deferred_bias_grads_queued(), i < 48 ? int(i) + 1 : int(i) - 47) << i;
    }
    flush_deferred_bias_grads();
    stream.synchronize();
  }
  for (size_t i = 0; i < partials.size(); ++i) {
    const std::vector<float> a = want[i].download(), b = got[i].download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "gradient " << i;
    EXPECT_TRUE(got[i].guards_intact()) << "gradient " << i;
  }
}

// The fp32 mask's pass writing bf16 (a Linear's fused ReLU under the bf16 policy): dbias has the
// float form's bits (the sums are the fp32 masked values'), dy_masked is the float form's output
// rounded as f32_to_bf16 rounds (the CPU reference's bits), whether it runs at once (no scope) or
// is queued in a scope and flushed.
TEST_F(DeferredBiasGpu, TheMaskWrittenInBf16KeepsTheFloatFormsSums) {
  uint64_t seed = 400;
  for (const Shape& shape : {Shape{256, 512}, Shape{7, 10}, Shape{1025, 64}, Shape{3, 5}}) {
    for (const float beta : {0.0f, 0.5f}) {
      SCOPED_TRACE(where(shape, 0, 0, beta));
      const int64_t n = shape.rows * shape.cols;
      const std::vector<float> dy = testing::random_vector(n, ++seed);
      const std::vector<float> y = testing::random_vector(n, ++seed);  // half <= 0: masked
      const std::vector<float> dbias = testing::random_vector(shape.cols, ++seed);
      const __nv_bfloat16 poison = to<__nv_bfloat16>(testing::kPoison);
      Slice ddy(n, 0), dyv(n, 0), masked32(n, 0), sums32(shape.cols, 0), sums16(shape.cols, 0),
          queued16(shape.cols, 0);
      testing::GuardedBuffer<__nv_bfloat16> masked16(n, 0, poison), queued_masked(n, 0, poison);
      ddy.upload(dy);
      dyv.upload(y);
      for (Slice* out : {&sums32, &sums16, &queued16}) out->upload(dbias);
      relu_mask_bias_grad(dyv.get(), ddy.get(), masked32.get(), sums32.get(), shape.rows,
                          shape.cols, beta, stream);
      // Outside a scope: at once.
      detail::relu_mask_bias_grad_deferrable(dyv.get(), ddy.get(), masked16.get(), sums16.get(),
                                             shape.rows, shape.cols, beta, stream);
      {
        DeferredBiasGrads scope(0, stream);
        ASSERT_TRUE(scope.active());
        detail::relu_mask_bias_grad_deferrable(dyv.get(), ddy.get(), queued_masked.get(),
                                               queued16.get(), shape.rows, shape.cols, beta,
                                               stream);
        flush_deferred_bias_grads();
      }
      const std::vector<float> want = sums32.download();
      EXPECT_TRUE(testing::bitwise_equal(sums16.download(), want)) << "dbias, bf16 output";
      EXPECT_TRUE(testing::bitwise_equal(queued16.download(), want)) << "dbias, queued";
      // The CPU reference: the fp32 masked values rounded (and its own sums, in double).
      std::vector<__nv_bfloat16> cpu_masked(n);
      std::vector<float> cpu_sums = dbias;
      relu_mask_bias_grad_cpu(y.data(), dy.data(), cpu_masked.data(), cpu_sums.data(), shape.rows,
                              shape.cols, beta);
      EXPECT_TRUE(same_bits(masked16.download(), cpu_masked)) << "dy_masked";
      EXPECT_TRUE(same_bits(queued_masked.download(), cpu_masked)) << "dy_masked, queued";
      EXPECT_TRUE(masked16.guards_intact());
      EXPECT_TRUE(queued_masked.guards_intact());
      EXPECT_ALL_CLOSE(want, cpu_sums, 0.0,
                       summation_atol(dy, dbias, shape.rows, shape.cols, beta));
    }
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
    // One fp32 addition y + b each, rounded once on both sides: the same bits.
    EXPECT_ALL_CLOSE(ours.download(), theirs.download(), 0.0, 0.0);

    Slice grad_ours(shape.cols, 0), grad_theirs(shape.cols, 0);
    bias_grad(ours.get(), grad_ours.get(), shape.rows, shape.cols, 0.0f, stream);
    CUDP_CUDNN_CHECK(cudnnConvolutionBackwardBias(handle, &one, matrix, ours.get(), &zero, vector,
                                                  grad_theirs.get()));
    const std::vector<float> dy = ours.download();
    // Both sides err by at most the bound (ours: see above; cuDNN's summation depth is not
    // published, so this also checks that it is no deeper than 512 levels, as ours).
    const double atol =
        2.0 * summation_atol(dy, std::vector<float>(shape.cols), shape.rows, shape.cols, 0.0f);
    EXPECT_ALL_CLOSE(grad_ours.download(), grad_theirs.download(), 0.0, atol);
  }
  cudnnDestroyTensorDescriptor(vector);
  cudnnDestroyTensorDescriptor(matrix);
  cudnnDestroy(handle);
}

}  // namespace
}  // namespace cudp::kernels
