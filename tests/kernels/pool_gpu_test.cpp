// GPU tests of the pooling kernels: against the CPU reference (odd sizes, both vector widths, ties,
// NaN, the 2x2/2 fast paths and the general kernels, VGG sizes) and against cuDNN's NHWC pooling.
#include <cuda_bf16.h>
#include <cuda_runtime.h>  // before device_buffer.h: cudaMalloc(T**) for DeviceBuffer<T>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "engine/core/vendor_check.h"
#include "kernels/bias.h"
#include "kernels/pool.h"

namespace cudp::kernels {
namespace {

using testing::DeviceBuffer;
constexpr int32_t kIndexPoison = std::numeric_limits<int32_t>::min() + 7;

struct PoolCase {
  int n, h, w, c, kh, kw, sh, sw, ph, pw;
  int out_h() const { return max_pool2d_output_size(h, kh, sh, ph); }
  int out_w() const { return max_pool2d_output_size(w, kw, sw, pw); }
  size_t in_size() const { return size_t(n) * h * w * c; }
  size_t out_size() const { return size_t(n) * out_h() * out_w() * c; }
};

::testing::Message describe(const PoolCase& k, size_t offset) {
  return ::testing::Message() << k.n << "x" << k.h << "x" << k.w << "x" << k.c << " window " << k.kh
                              << "x" << k.kw << " stride " << k.sh << "," << k.sw << " pad " << k.ph
                              << "," << k.pw << " offset " << offset;
}

// A device copy of `host` starting `offset` elements into the buffer: offset 1 breaks 16-byte
// alignment and sends the kernels down their scalar path even when C % 4 == 0.
template <typename T>
DeviceBuffer<T> upload_at(const std::vector<T>& host, size_t offset, T fill) {
  std::vector<T> padded(host.size() + offset, fill);
  std::copy(host.begin(), host.end(), padded.begin() + offset);
  return DeviceBuffer<T>(padded);
}

template <typename T>
std::vector<T> download_at(const DeviceBuffer<T>& buffer, size_t offset) {
  const std::vector<T> all = buffer.download();
  return std::vector<T>(all.begin() + offset, all.end());
}

// Max pooling selects, it does not compute: y must equal the reference bit for bit (NaNs included).
using testing::bitwise_equal;

// Forward and backward of one case on the GPU and the CPU; x is given (random, quantised or NaN).
void check_max_pool_against_cpu(const PoolCase& k, const std::vector<float>& x, size_t offset) {
  SCOPED_TRACE(describe(k, offset));
  std::vector<float> y_ref(k.out_size());
  std::vector<int32_t> idx_ref(k.out_size());
  max_pool2d_forward_cpu(x.data(), y_ref.data(), idx_ref.data(), k.n, k.h, k.w, k.c, k.kh, k.kw,
                         k.sh, k.sw, k.ph, k.pw);
  const auto x_gpu = upload_at(x, offset, 0.f);
  auto y = upload_at(std::vector<float>(k.out_size(), testing::kPoison), offset, testing::kPoison);
  auto idx = upload_at(std::vector<int32_t>(k.out_size(), kIndexPoison), offset, kIndexPoison);
  max_pool2d_forward(x_gpu.get() + offset, y.get() + offset, idx.get() + offset, k.n, k.h, k.w, k.c,
                     k.kh, k.kw, k.sh, k.sw, k.ph, k.pw, nullptr);
  EXPECT_TRUE(bitwise_equal(download_at(y, offset), y_ref));
  EXPECT_EQ(download_at(idx, offset), idx_ref);

  const std::vector<float> dy = testing::random_vector(k.out_size(), 1000 + k.h * 7 + k.c);
  std::vector<float> dx_ref(k.in_size());
  max_pool2d_backward_cpu(dy.data(), idx_ref.data(), dx_ref.data(), k.n, k.h, k.w, k.c, k.kh, k.kw,
                          k.sh, k.sw, k.ph, k.pw);
  const auto dy_gpu = upload_at(dy, offset, 0.f);
  auto dx = upload_at(std::vector<float>(k.in_size(), testing::kPoison), offset, testing::kPoison);
  max_pool2d_backward(dy_gpu.get() + offset, idx.get() + offset, dx.get() + offset, k.n, k.h, k.w,
                      k.c, k.kh, k.kw, k.sh, k.sw, k.ph, k.pw, nullptr);
  // dx sums at most ceil(kh/sh) * ceil(kw/sw) <= 4 gradients here, in fp32 on the GPU and in double
  // on the CPU: a few ulps of values below 4 in magnitude.
  EXPECT_ALL_CLOSE(download_at(dx, offset), dx_ref, 1e-6, 1e-6);
}

const PoolCase kCases[] = {
    {3, 7, 7, 5, 2, 2, 2, 2, 0, 0},  {3, 7, 7, 5, 3, 3, 2, 2, 1, 1},
    {3, 9, 9, 8, 2, 2, 2, 2, 0, 0},  {3, 9, 9, 8, 3, 3, 2, 2, 1, 1},
    {2, 7, 9, 12, 3, 3, 1, 1, 1, 1}, {2, 8, 6, 4, 2, 3, 1, 2, 1, 0},
    {1, 1, 1, 4, 1, 1, 1, 1, 0, 0},  {2, 6, 6, 3, 2, 2, 2, 2, 0, 0},
    {2, 5, 5, 16, 3, 3, 3, 3, 1, 1},
};

TEST(MaxPoolGpu, MatchesCpuOnOddSizes) {
  CUDP_REQUIRE_GPU();
  for (const PoolCase& k : kCases) {
    const std::vector<float> x = testing::random_vector(k.in_size(), 7 + k.c * 3 + k.kh);
    check_max_pool_against_cpu(k, x, 0);
    check_max_pool_against_cpu(k, x, 1);
  }
}

TEST(MaxPoolGpu, MatchesCpuOnVggSizes) {
  CUDP_REQUIRE_GPU();
  for (const PoolCase& k :
       {PoolCase{8, 112, 112, 128, 2, 2, 2, 2, 0, 0}, PoolCase{4, 56, 56, 256, 3, 3, 2, 2, 1, 1},
        PoolCase{2, 14, 14, 512, 2, 2, 2, 2, 0, 0}}) {
    const std::vector<float> x = testing::random_vector(k.in_size(), 17 + k.c);
    check_max_pool_against_cpu(k, x, 0);
  }
}

TEST(MaxPoolGpu, TiesAndNaNsMatchCpu) {
  CUDP_REQUIRE_GPU();
  for (const PoolCase& k : kCases) {
    // Values in {0, 1, 2}: most windows hold ties, so the first-maximum rule decides the indices
    // (and then dx). A few NaNs propagate, the last NaN of a window giving its index.
    std::vector<float> x = testing::random_vector(k.in_size(), 23 + k.c, 0.f, 3.f);
    for (float& v : x) v = std::floor(v);
    for (size_t i = 5; i < x.size(); i += 37) x[i] = std::numeric_limits<float>::quiet_NaN();
    check_max_pool_against_cpu(k, x, 0);
    check_max_pool_against_cpu(k, x, 1);
  }
}

// 2x2 stride 2 with codes (one byte per output, kernels/pool.h) instead of indices: the forward
// writes the indexed forward's y and the CPU reference's codes, and the backward from the codes
// gives the indexed backward's dx bit for bit, on ties (values in {0, 1, 2}), NaNs, values <= 0
// (bit 2), odd sizes (a partial window at the edge has no output and gets zeros) and misaligned
// pointers (the scalar path).
TEST(MaxPoolGpu, TwoByTwoCodesGiveTheIndexedResults) {
  CUDP_REQUIRE_GPU();
  for (const PoolCase& k :
       {PoolCase{2, 7, 9, 4, 2, 2, 2, 2, 0, 0}, PoolCase{1, 8, 8, 3, 2, 2, 2, 2, 0, 0},
        PoolCase{3, 16, 12, 64, 2, 2, 2, 2, 0, 0}}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE(describe(k, offset));
      std::vector<float> x = testing::random_vector(k.in_size(), 61 + k.c, -1.f, 3.f);
      for (float& v : x) v = std::floor(v);
      for (size_t i = 3; i < x.size(); i += 41) x[i] = std::numeric_limits<float>::quiet_NaN();
      const std::vector<float> dy_host = testing::random_vector(k.out_size(), 62);
      std::vector<float> y_ref(k.out_size());
      std::vector<uint8_t> codes_ref(k.out_size());
      max_pool2d_2x2_forward_cpu(x.data(), y_ref.data(), codes_ref.data(), k.n, k.h, k.w, k.c);
      const DeviceBuffer<float> xd = upload_at(x, offset, 0.f);
      const DeviceBuffer<float> dy = upload_at(dy_host, offset, 0.f);
      DeviceBuffer<float> y1 = upload_at(std::vector<float>(k.out_size()), offset, 0.f);
      DeviceBuffer<float> y2 = upload_at(std::vector<float>(k.out_size()), offset, 0.f);
      DeviceBuffer<float> dx1 = upload_at(std::vector<float>(k.in_size()), offset, 7.f);
      DeviceBuffer<float> dx2 = upload_at(std::vector<float>(k.in_size()), offset, 7.f);
      DeviceBuffer<int32_t> idx(k.out_size());
      DeviceBuffer<uint8_t> codes =
          upload_at(std::vector<uint8_t>(k.out_size(), 0xee), offset, uint8_t{0xee});
      max_pool2d_forward(xd.get() + offset, y1.get() + offset, idx.get(), k.n, k.h, k.w, k.c, 2, 2,
                         2, 2, 0, 0, nullptr);
      max_pool2d_2x2_forward(xd.get() + offset, y2.get() + offset, codes.get() + offset, k.n, k.h,
                             k.w, k.c, nullptr);
      EXPECT_TRUE(bitwise_equal(download_at(y2, offset), download_at(y1, offset)));
      EXPECT_TRUE(bitwise_equal(download_at(y2, offset), y_ref));
      EXPECT_EQ(download_at(codes, offset), codes_ref);
      max_pool2d_backward(dy.get() + offset, idx.get(), dx1.get() + offset, k.n, k.h, k.w, k.c, 2,
                          2, 2, 2, 0, 0, nullptr);
      max_pool2d_2x2_backward(dy.get() + offset, codes.get() + offset, dx2.get() + offset, k.n, k.h,
                              k.w, k.c, nullptr);
      EXPECT_TRUE(bitwise_equal(download_at(dx2, offset), download_at(dx1, offset)));
      std::vector<float> dx_ref(k.in_size());
      max_pool2d_2x2_backward_cpu(dy_host.data(), codes_ref.data(), dx_ref.data(), k.n, k.h, k.w,
                                  k.c);
      EXPECT_TRUE(bitwise_equal(download_at(dx2, offset), dx_ref));
      // With the ReLU mask of x (a fused ReLU's output) in the same pass: the indexed backward
      // followed by the ReLU's own backward (zeros masked, NaNs kept), bit for bit.
      DeviceBuffer<float> dx3 = upload_at(std::vector<float>(k.in_size()), offset, 7.f);
      max_pool2d_2x2_backward(dy.get() + offset, codes.get() + offset, dx3.get() + offset, k.n, k.h,
                              k.w, k.c, nullptr, /*relu_mask=*/true);
      relu_mask_bias_grad(xd.get() + offset, dx1.get() + offset, dx1.get() + offset, nullptr,
                          int64_t(k.in_size()), 1, 0.f, nullptr);
      EXPECT_TRUE(bitwise_equal(download_at(dx3, offset), download_at(dx1, offset)));
      max_pool2d_2x2_backward_cpu(dy_host.data(), codes_ref.data(), dx_ref.data(), k.n, k.h, k.w,
                                  k.c, /*relu_mask=*/true);
      EXPECT_TRUE(bitwise_equal(download_at(dx3, offset), dx_ref));
    }
  }
  // The codes alone misaligned (x, y, dy and dx aligned): the scalar path, the same results.
  {
    const PoolCase k{3, 16, 12, 64, 2, 2, 2, 2, 0, 0};
    const std::vector<float> x = testing::random_vector(k.in_size(), 63, -1.f, 1.f);
    const std::vector<float> dy_host = testing::random_vector(k.out_size(), 64);
    std::vector<float> y_ref(k.out_size()), dx_ref(k.in_size());
    std::vector<uint8_t> codes_ref(k.out_size());
    max_pool2d_2x2_forward_cpu(x.data(), y_ref.data(), codes_ref.data(), k.n, k.h, k.w, k.c);
    max_pool2d_2x2_backward_cpu(dy_host.data(), codes_ref.data(), dx_ref.data(), k.n, k.h, k.w, k.c,
                                /*relu_mask=*/true);
    const DeviceBuffer<float> xd(x), dy(dy_host);
    DeviceBuffer<float> y(k.out_size()), dx(k.in_size());
    DeviceBuffer<uint8_t> codes = upload_at(std::vector<uint8_t>(k.out_size()), 1, uint8_t{0});
    max_pool2d_2x2_forward(xd.get(), y.get(), codes.get() + 1, k.n, k.h, k.w, k.c, nullptr);
    max_pool2d_2x2_backward(dy.get(), codes.get() + 1, dx.get(), k.n, k.h, k.w, k.c, nullptr,
                            /*relu_mask=*/true);
    EXPECT_TRUE(bitwise_equal(y.download(), y_ref));
    EXPECT_EQ(download_at(codes, 1), codes_ref);
    EXPECT_TRUE(bitwise_equal(dx.download(), dx_ref));
  }
  // Other windows need their indices.
  EXPECT_THROW(max_pool2d_forward(static_cast<const float*>(nullptr), nullptr, nullptr, 1, 4, 4, 1,
                                  3, 3, 2, 2, 1, 1, nullptr),
               ValueError);
}

// The column sums on the way (dbias, Module's bias hand-off): dbias += the sum of each channel of
// dx, against the sums of the dx the same call stored, in double. The fp32 chain an element goes
// through is at most the thread's windows + 256 / vectors in its block + 1024 / 32 + 32 partial
// rows (kernels/pool.cu): 512 covers it, so |error| <= 512 * 2^-24 * (sum |dx| + |dbias|). dx
// itself is the call's without sums, bit for bit, and a second call gives the same dbias bits. C
// = 3 (no vector width dividing the block) takes bias_grad's pass instead; 20 x 64 x 64 x 64 has
// more windows than the capped grid has threads (each thread takes two); the ReLU mask and a
// misaligned offset (scalar path) are covered; bf16 too.
template <typename T>
void check_pool_backward_sums(const PoolCase& k, size_t offset, bool relu_mask) {
  SCOPED_TRACE(describe(k, offset) << (relu_mask ? " relu_mask" : ""));
  std::vector<float> xf = testing::random_vector(k.in_size(), 71 + k.c, -1.f, 2.f);
  std::vector<float> dyf = testing::random_vector(k.out_size(), 72 + k.c);
  std::vector<T> x(xf.size()), dy(dyf.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = T(xf[i]);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = T(dyf[i]);
  const DeviceBuffer<T> xd = upload_at(x, offset, T(0.f));
  const DeviceBuffer<T> dyd = upload_at(dy, offset, T(0.f));
  DeviceBuffer<T> dx1 = upload_at(std::vector<T>(k.in_size()), offset, T(7.f));
  DeviceBuffer<T> dx2 = upload_at(std::vector<T>(k.in_size()), offset, T(7.f));
  const std::vector<float> start = testing::random_vector(size_t(k.c), 73);
  DeviceBuffer<float> db1(start), db2(start);
  DeviceBuffer<T> y(k.out_size());
  DeviceBuffer<uint8_t> codes = upload_at(std::vector<uint8_t>(k.out_size()), offset, uint8_t{0});
  max_pool2d_2x2_forward(xd.get() + offset, y.get(), codes.get() + offset, k.n, k.h, k.w, k.c,
                         nullptr);
  const uint8_t* code = codes.get() + offset;
  // The codes against the CPU reference on the values as floats (bf16 widens exactly).
  std::vector<float> x_wide(x.size()), y_ref(k.out_size());
  for (size_t i = 0; i < x.size(); ++i) x_wide[i] = float(x[i]);
  std::vector<uint8_t> codes_ref(k.out_size());
  max_pool2d_2x2_forward_cpu(x_wide.data(), y_ref.data(), codes_ref.data(), k.n, k.h, k.w, k.c);
  EXPECT_EQ(download_at(codes, offset), codes_ref);
  max_pool2d_2x2_backward(dyd.get() + offset, code, dx1.get() + offset, k.n, k.h, k.w, k.c, nullptr,
                          relu_mask);
  max_pool2d_2x2_backward(dyd.get() + offset, code, dx2.get() + offset, k.n, k.h, k.w, k.c, nullptr,
                          relu_mask, db1.get());
  const std::vector<T> dx = download_at(dx2, offset);
  const std::vector<T> dx_alone = download_at(dx1, offset);
  EXPECT_EQ(std::memcmp(dx.data(), dx_alone.data(), dx.size() * sizeof(T)), 0);
  const std::vector<float> got = db1.download();
  EXPECT_TRUE(testing::column_sums_close(got, start, std::vector<float>(dx.begin(), dx.end())));
  max_pool2d_2x2_backward(dyd.get() + offset, code, dx2.get() + offset, k.n, k.h, k.w, k.c, nullptr,
                          relu_mask, db2.get());
  EXPECT_TRUE(bitwise_equal(db2.download(), got));
}

TEST(MaxPoolGpu, TwoByTwoBackwardFromCodesAddsTheColumnSums) {
  CUDP_REQUIRE_GPU();
  for (const PoolCase& k :
       {PoolCase{2, 7, 9, 4, 2, 2, 2, 2, 0, 0}, PoolCase{1, 8, 8, 3, 2, 2, 2, 2, 0, 0},
        PoolCase{3, 16, 12, 64, 2, 2, 2, 2, 0, 0}, PoolCase{2, 14, 14, 512, 2, 2, 2, 2, 0, 0},
        PoolCase{20, 64, 64, 64, 2, 2, 2, 2, 0, 0}}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {
      for (bool relu_mask : {false, true}) {
        check_pool_backward_sums<float>(k, offset, relu_mask);
      }
    }
    check_pool_backward_sums<__nv_bfloat16>(k, 0, true);
  }
}

TEST(MaxPoolGpu, BackwardIsDeterministicAndEmptyBatchIsANoOp) {
  CUDP_REQUIRE_GPU();
  const PoolCase k{4, 28, 28, 64, 3, 3, 2, 2, 1, 1};
  const DeviceBuffer<float> x(testing::random_vector(k.in_size(), 29));
  DeviceBuffer<float> y(k.out_size());
  DeviceBuffer<int32_t> idx(k.out_size());
  max_pool2d_forward(x.get(), y.get(), idx.get(), k.n, k.h, k.w, k.c, k.kh, k.kw, k.sh, k.sw, k.ph,
                     k.pw, nullptr);
  const DeviceBuffer<float> dy(testing::random_vector(k.out_size(), 30));
  DeviceBuffer<float> dx1(k.in_size()), dx2(k.in_size());
  dx1.fill(testing::kPoison);
  dx2.fill(1.f);
  max_pool2d_backward(dy.get(), idx.get(), dx1.get(), k.n, k.h, k.w, k.c, k.kh, k.kw, k.sh, k.sw,
                      k.ph, k.pw, nullptr);
  max_pool2d_backward(dy.get(), idx.get(), dx2.get(), k.n, k.h, k.w, k.c, k.kh, k.kw, k.sh, k.sw,
                      k.ph, k.pw, nullptr);
  EXPECT_TRUE(bitwise_equal(dx1.download(), dx2.download()));
  EXPECT_NO_THROW(max_pool2d_forward(x.get(), y.get(), idx.get(), 0, k.h, k.w, k.c, k.kh, k.kw,
                                     k.sh, k.sw, k.ph, k.pw, nullptr));
  EXPECT_NO_THROW(max_pool2d_backward(dy.get(), idx.get(), dx1.get(), 0, k.h, k.w, k.c, k.kh, k.kw,
                                      k.sh, k.sw, k.ph, k.pw, nullptr));
  // An empty batch's tensors have null data: the codes path takes them too.
  float* none = nullptr;
  EXPECT_NO_THROW(max_pool2d_2x2_forward(none, none, nullptr, 0, 8, 8, 4, nullptr));
  EXPECT_NO_THROW(max_pool2d_2x2_backward(none, nullptr, none, 0, 8, 8, 4, nullptr, true, nullptr));
  EXPECT_THROW(max_pool2d_2x2_backward(dy.get(), nullptr, dx1.get(), 1, 8, 8, 4, nullptr),
               ValueError);
  CUDP_CUDA_CHECK(cudaDeviceSynchronize());
}

struct AdaptiveCase {
  int n, h, w, c, oh, ow;
};

TEST(AdaptiveAvgPoolGpu, MatchesCpu) {
  CUDP_REQUIRE_GPU();
  for (const AdaptiveCase& k :
       {AdaptiveCase{3, 7, 7, 5, 7, 7}, AdaptiveCase{3, 9, 9, 8, 4, 3},
        AdaptiveCase{2, 1, 1, 512, 7, 7}, AdaptiveCase{2, 5, 6, 4, 7, 7},
        AdaptiveCase{8, 14, 14, 512, 7, 7}, AdaptiveCase{4, 7, 7, 512, 7, 7},
        AdaptiveCase{3, 13, 11, 5, 3, 5}}) {
    for (const size_t offset : {size_t(0), size_t(1)}) {
      SCOPED_TRACE(::testing::Message() << k.n << "x" << k.h << "x" << k.w << "x" << k.c << " -> "
                                        << k.oh << "x" << k.ow << " offset " << offset);
      const size_t in = size_t(k.n) * k.h * k.w * k.c, out = size_t(k.n) * k.oh * k.ow * k.c;
      const std::vector<float> x = testing::random_vector(in, 41 + k.c);
      const std::vector<float> dy = testing::random_vector(out, 42 + k.c);
      std::vector<float> y_ref(out), dx_ref(in);
      adaptive_avg_pool2d_forward_cpu(x.data(), y_ref.data(), k.n, k.h, k.w, k.c, k.oh, k.ow);
      adaptive_avg_pool2d_backward_cpu(dy.data(), dx_ref.data(), k.n, k.h, k.w, k.c, k.oh, k.ow);
      const auto x_gpu = upload_at(x, offset, 0.f), dy_gpu = upload_at(dy, offset, 0.f);
      auto y = upload_at(std::vector<float>(out, testing::kPoison), offset, testing::kPoison);
      auto dx = upload_at(std::vector<float>(in, testing::kPoison), offset, testing::kPoison);
      adaptive_avg_pool2d_forward(x_gpu.get() + offset, y.get() + offset, k.n, k.h, k.w, k.c, k.oh,
                                  k.ow, nullptr);
      adaptive_avg_pool2d_backward(dy_gpu.get() + offset, dx.get() + offset, k.n, k.h, k.w, k.c,
                                   k.oh, k.ow, nullptr);
      // Windows and overlaps here hold at most 16 terms of magnitude < 1: fp32 sums of a few ulps.
      EXPECT_ALL_CLOSE(download_at(y, offset), y_ref, 1e-6, 1e-6);
      EXPECT_ALL_CLOSE(download_at(dx, offset), dx_ref, 1e-6, 1e-6);
    }
  }
}

// ---- against cuDNN ------------------------------------------------------------------------------

struct Cudnn {
  cudnnHandle_t handle = nullptr;
  Cudnn() { CUDP_CUDNN_CHECK(cudnnCreate(&handle)); }
  ~Cudnn() { cudnnDestroy(handle); }
};

struct TensorDesc {
  cudnnTensorDescriptor_t desc = nullptr;
  TensorDesc(int n, int c, int h, int w) {
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc));
    CUDP_CUDNN_CHECK(
        cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, n, c, h, w));
  }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(desc); }
};

struct PoolDesc {
  cudnnPoolingDescriptor_t desc = nullptr;
  explicit PoolDesc(const PoolCase& k) {
    CUDP_CUDNN_CHECK(cudnnCreatePoolingDescriptor(&desc));
    CUDP_CUDNN_CHECK(cudnnSetPooling2dDescriptor(desc, CUDNN_POOLING_MAX_DETERMINISTIC,
                                                 CUDNN_NOT_PROPAGATE_NAN, k.kh, k.kw, k.ph, k.pw,
                                                 k.sh, k.sw));
  }
  ~PoolDesc() { cudnnDestroyPoolingDescriptor(desc); }
};

TEST(MaxPoolGpu, MatchesCudnn) {
  CUDP_REQUIRE_GPU();
  Cudnn cudnn;
  for (const PoolCase& k :
       {PoolCase{3, 7, 7, 5, 2, 2, 2, 2, 0, 0}, PoolCase{3, 7, 7, 5, 3, 3, 2, 2, 1, 1},
        PoolCase{3, 9, 9, 8, 3, 3, 2, 2, 1, 1}, PoolCase{2, 8, 6, 4, 2, 3, 1, 2, 1, 0},
        PoolCase{8, 112, 112, 128, 2, 2, 2, 2, 0, 0}, PoolCase{4, 56, 56, 256, 3, 3, 2, 2, 1, 1}}) {
    SCOPED_TRACE(describe(k, 0));
    const TensorDesc x_desc(k.n, k.c, k.h, k.w), y_desc(k.n, k.c, k.out_h(), k.out_w());
    const PoolDesc pool(k);
    int dims[4];
    CUDP_CUDNN_CHECK(cudnnGetPooling2dForwardOutputDim(pool.desc, x_desc.desc, &dims[0], &dims[1],
                                                       &dims[2], &dims[3]));
    ASSERT_EQ(dims[2], k.out_h());
    ASSERT_EQ(dims[3], k.out_w());
    // Random inputs: no ties (with probability ~1), so cuDNN's choice of maximum is ours.
    const DeviceBuffer<float> x(testing::random_vector(k.in_size(), 51 + k.c));
    const DeviceBuffer<float> dy(testing::random_vector(k.out_size(), 52 + k.c));
    DeviceBuffer<float> y(k.out_size()), y_ref(k.out_size()), dx(k.in_size()), dx_ref(k.in_size());
    DeviceBuffer<int32_t> idx(k.out_size());
    y.fill(testing::kPoison);
    dx.fill(testing::kPoison);
    const float one = 1.f, zero = 0.f;
    CUDP_CUDNN_CHECK(cudnnPoolingForward(cudnn.handle, pool.desc, &one, x_desc.desc, x.get(), &zero,
                                         y_desc.desc, y_ref.get()));
    CUDP_CUDNN_CHECK(cudnnPoolingBackward(cudnn.handle, pool.desc, &one, y_desc.desc, y_ref.get(),
                                          y_desc.desc, dy.get(), x_desc.desc, x.get(), &zero,
                                          x_desc.desc, dx_ref.get()));
    max_pool2d_forward(x.get(), y.get(), idx.get(), k.n, k.h, k.w, k.c, k.kh, k.kw, k.sh, k.sw,
                       k.ph, k.pw, nullptr);
    max_pool2d_backward(dy.get(), idx.get(), dx.get(), k.n, k.h, k.w, k.c, k.kh, k.kw, k.sh, k.sw,
                        k.ph, k.pw, nullptr);
    EXPECT_TRUE(bitwise_equal(y.download(), y_ref.download()));
    // Both sum at most 4 fp32 gradients per element, perhaps in different orders: a few ulps.
    EXPECT_ALL_CLOSE(dx.download(), dx_ref.download(), 1e-6, 1e-6);
  }
}

}  // namespace
}  // namespace cudp::kernels
