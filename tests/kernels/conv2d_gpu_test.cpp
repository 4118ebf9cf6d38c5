// GPU tests of kernels/conv2d.h: the three passes against the CPU references (double) and against
// cuDNN, on odd sizes (every tile edge, stride, padding, filter size, C = 1 and 3, the vector and
// the single-float paths, split reductions) and on VGG-16's layer shapes at small batch; fused
// bias and ReLU; beta accumulation; misaligned pointers; run-to-run determinism.
//
// Tolerance. Each output is an fp32 dot product of n = R*S*C (forward), R*S*K (backward-data) or
// N*P*Q (backward-weight) terms, summed in an order of the kernel's own. Inputs are uniform in
// [-1, 1), so products are O(1/3) and a partial sum after i terms is a random walk of size
// ~sqrt(i)/3; each fp32 addition errs by at most u = 2^-24 of it, so the accumulated error has a
// spread of about u * n / (3 sqrt(2)): 7e-5 for n = 4608 (VGG's 3x3x512 reduction). We allow
// atol = 1e-5 * sqrt(n), at least 9 such spreads for every n here (n <= 6272, checked below), plus
// rtol = 1e-4 for the large outputs (~sqrt(n)/3). An indexing mistake (a tap missed, doubled or
// misplaced) moves an output by ~1/3, thousands of times more. Against cuDNN, which has its own
// rounding, the difference of two such errors: atol doubles.
//
// Long reductions (backward-weight at training batch sizes, N*P*Q up to 262144) need one more
// step: a single fp32 chain of n terms would spread by u * n / (3 sqrt(2)) = 3.7e-3 at n = 262144,
// close to atol = 5.1e-3. The kernel never sums such a chain: it cuts the reduction into `split`
// slices, each summed on its own, and adds the partials. Independent chains of n / split terms
// spread by u * n / (3 sqrt(2 split)) together, and choose_split fills the GPU at least once,
// so split >= resident blocks / output tiles: about 100 or more on an H200 for the shapes below
// (>= 16 on any GPU with 20 SMs), i.e. <= 9e-4, and atol stays >= 5 spreads; see
// BackwardWeightLongReduction.
#include <cuda_runtime.h>  // before device_buffer.h: cudaMalloc's typed overload
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/cudnn_conv2d.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "engine/core/stream.h"
#include "engine/core/vendor_check.h"
#include "kernels/conv2d.h"

namespace cudp::kernels {
namespace {

constexpr double kRtol = 1e-4;
constexpr int64_t kLongestReduction = 6272;  // the tolerance argument above holds up to here

double atol_for(int64_t reduction) {
  EXPECT_LE(reduction, kLongestReduction) << "extend the tolerance argument first";
  return 1e-5 * std::sqrt(double(reduction));
}

// The same model for the split reductions of BackwardWeightLongReduction (see the top).
constexpr int64_t kLongestSplitReduction = 262144;

double atol_for_split(int64_t reduction) {
  EXPECT_LE(reduction, kLongestSplitReduction) << "extend the tolerance argument first";
  return 1e-5 * std::sqrt(double(reduction));
}

// n floats starting `shift` floats into a device allocation: shift 1 breaks 16-byte alignment.
class Buffer {
 public:
  explicit Buffer(int64_t n, int shift = 0) : n_(n), shift_(shift), buffer_(size_t(n + shift)) {}
  float* get() const { return buffer_.get() + shift_; }
  void upload(const std::vector<float>& v) {
    ASSERT_EQ(int64_t(v.size()), n_);
    CUDP_CUDA_CHECK(cudaMemcpy(get(), v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
    // A pageable copy may still be in flight when cudaMemcpy returns, and the kernels run on a
    // non-blocking stream that does not wait for it.
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void poison() { upload(std::vector<float>(size_t(n_), testing::kPoison)); }
  // What a beta-0 output may hold before the kernel writes it (a gradient that a deferred zero_grad
  // left, layers/module.h): NaN, which any read would carry into the result (0 * NaN is NaN, where
  // 0 * kPoison is 0).
  void poison_nan() {
    upload(std::vector<float>(size_t(n_), std::numeric_limits<float>::quiet_NaN()));
  }
  // Only the n elements from get(): the shift elements before them are never written, and a copy
  // of them would be a read of uninitialised memory (compute-sanitizer's initcheck says so).
  std::vector<float> download() const {
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());  // the kernels ran on a non-blocking stream
    std::vector<float> v(static_cast<size_t>(n_));
    CUDP_CUDA_CHECK(cudaMemcpy(v.data(), get(), v.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  int64_t n_;
  int shift_;
  testing::DeviceBuffer<float> buffer_;
};

// cuDNN on the same layouts (common/cudnn_conv2d.h). It runs one of its GEMM-like algorithms,
// which compute the same dot products as ours, never Winograd or FFT, whose different arithmetic
// would need a different tolerance.
class CudnnConv {
 public:
  CudnnConv(cudnnHandle_t handle, const Conv2dShape& s) : handle_(handle), d_(s) {}

  void forward(const float* x, const float* w, float* y) {
    constexpr int kMax = CUDNN_CONVOLUTION_FWD_ALGO_COUNT;
    cudnnConvolutionFwdAlgoPerf_t perf[kMax];
    int count = 0;
    CUDP_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle_, d_.x, d_.w, d_.conv, d_.y,
                                                            kMax, &count, perf));
    const auto algo =
        pick(perf, count,
             {CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
              CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, CUDNN_CONVOLUTION_FWD_ALGO_GEMM},
             "forward");
    size_t bytes = 0;
    CUDP_CUDNN_CHECK(
        cudnnGetConvolutionForwardWorkspaceSize(handle_, d_.x, d_.w, d_.conv, d_.y, algo, &bytes));
    testing::DeviceBuffer<unsigned char> workspace(bytes);
    const float one = 1.0f, zero = 0.0f;
    CUDP_CUDNN_CHECK(cudnnConvolutionForward(handle_, &one, d_.x, x, d_.w, w, d_.conv, algo,
                                             workspace.get(), bytes, &zero, d_.y, y));
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());  // before the workspace is freed
  }

  void backward_data(const float* dy, const float* w, float* dx) {
    constexpr int kMax = CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT;
    cudnnConvolutionBwdDataAlgoPerf_t perf[kMax];
    int count = 0;
    CUDP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle_, d_.w, d_.y, d_.conv, d_.x,
                                                                 kMax, &count, perf));
    const auto algo =
        pick(perf, count, {CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, CUDNN_CONVOLUTION_BWD_DATA_ALGO_0},
             "backward-data");
    size_t bytes = 0;
    CUDP_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(handle_, d_.w, d_.y, d_.conv,
                                                                  d_.x, algo, &bytes));
    testing::DeviceBuffer<unsigned char> workspace(bytes);
    const float one = 1.0f, zero = 0.0f;
    CUDP_CUDNN_CHECK(cudnnConvolutionBackwardData(handle_, &one, d_.w, w, d_.y, dy, d_.conv, algo,
                                                  workspace.get(), bytes, &zero, d_.x, dx));
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void backward_weight(const float* x, const float* dy, float* dw) {
    constexpr int kMax = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
    cudnnConvolutionBwdFilterAlgoPerf_t perf[kMax];
    int count = 0;
    CUDP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle_, d_.x, d_.y, d_.conv,
                                                                   d_.w, kMax, &count, perf));
    const auto algo =
        pick(perf, count,
             {CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
              CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3},
             "backward-filter");
    size_t bytes = 0;
    CUDP_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(handle_, d_.x, d_.y, d_.conv,
                                                                    d_.w, algo, &bytes));
    testing::DeviceBuffer<unsigned char> workspace(bytes);
    const float one = 1.0f, zero = 0.0f;
    CUDP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(handle_, &one, d_.x, x, d_.y, dy, d_.conv, algo,
                                                    workspace.get(), bytes, &zero, d_.w, dw));
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
  }

 private:
  // The fastest algorithm (cuDNN lists them fastest first) that is supported and in `exact`.
  template <class Perf, class Algo>
  static Algo pick(const Perf* perf, int count, std::initializer_list<Algo> exact,
                   const char* pass) {
    std::string offered;
    for (int i = 0; i < count; ++i) {
      if (perf[i].status != CUDNN_STATUS_SUCCESS) continue;
      offered += cudp::detail::str(' ', int(perf[i].algo));
      if (perf[i].mathType == CUDNN_TENSOR_OP_MATH ||
          perf[i].mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) {
        continue;
      }
      for (const Algo a : exact) {
        if (perf[i].algo == a) return a;
      }
    }
    CUDP_THROW(LibraryError, "cuDNN offers no GEMM-like ", pass, " algorithm here; it offers",
               offered);
  }

  cudnnHandle_t handle_;
  testing::CudnnConv2dDescriptors d_;
};

std::string describe(const Conv2dShape& s) {
  return cudp::detail::str("n", s.n, " h", s.h, " w", s.w, " c", s.c, " k", s.k, " r", s.r, " s", s.s,
                     " stride ", s.stride_h, "x", s.stride_w, " pad ", s.pad_h, "x", s.pad_w);
}

// One cuDNN handle for the whole suite, created by the first test that runs on a GPU.
class Conv2dGpuTest : public ::testing::Test {
 protected:
  static cudnnHandle_t cudnn() {
    if (!handle_) CUDP_CUDNN_CHECK(cudnnCreate(&handle_));
    return handle_;
  }
  static void TearDownTestSuite() {
    if (handle_) cudnnDestroy(handle_);
    handle_ = nullptr;
  }
  // Fresh random inputs for every call: no two tests share data.
  static std::vector<float> random(int64_t n) { return testing::random_vector(size_t(n), ++seed_); }

 private:
  static inline cudnnHandle_t handle_ = nullptr;
  static inline uint64_t seed_ = 1000;
};

struct Case {
  const char* name;
  Conv2dShape shape;
};

class Conv2dGpu : public Conv2dGpuTest, public ::testing::WithParamInterface<Case> {};

TEST_P(Conv2dGpu, Forward) {
  CUDP_REQUIRE_GPU();
  const Conv2dShape& s = GetParam().shape;
  SCOPED_TRACE(describe(s));
  const cuda::Stream stream = cuda::Stream::create(0);
  const std::vector<float> x = random(s.x_size()), w = random(s.w_size()), bias = random(s.k);
  Buffer dx(s.x_size()), dw(s.w_size()), dbias(s.k), dy(s.y_size());
  dx.upload(x);
  dw.upload(w);
  dbias.upload(bias);
  const double atol = atol_for(int64_t(s.r) * s.s * s.c);
  std::vector<float> plain;
  for (const bool with_bias : {false, true}) {
    for (const bool relu : {false, true}) {
      SCOPED_TRACE(cudp::detail::str("bias ", with_bias, " relu ", relu));
      std::vector<float> expected(size_t(s.y_size()));
      conv2d_forward_cpu(s, x.data(), w.data(), with_bias ? bias.data() : nullptr, expected.data(),
                         relu);
      dy.poison();
      conv2d_forward(s, dx.get(), dw.get(), with_bias ? dbias.get() : nullptr, dy.get(), relu,
                     stream);
      const std::vector<float> got = dy.download();
      EXPECT_ALL_CLOSE(got, expected, kRtol, atol);
      if (!with_bias && !relu) plain = got;
    }
  }
  dy.poison();
  CudnnConv(cudnn(), s).forward(dx.get(), dw.get(), dy.get());
  EXPECT_ALL_CLOSE(plain, dy.download(), kRtol, 2 * atol) << "against cuDNN";
}

TEST_P(Conv2dGpu, BackwardData) {
  CUDP_REQUIRE_GPU();
  const Conv2dShape& s = GetParam().shape;
  SCOPED_TRACE(describe(s));
  const cuda::Stream stream = cuda::Stream::create(0);
  const std::vector<float> dy = random(s.y_size()), w = random(s.w_size());
  Buffer ddy(s.y_size()), dw(s.w_size()), ddx(s.x_size());
  ddy.upload(dy);
  dw.upload(w);
  std::vector<float> expected(size_t(s.x_size()));
  conv2d_backward_data_cpu(s, dy.data(), w.data(), expected.data());
  ddx.poison();
  conv2d_backward_data(s, ddy.get(), dw.get(), ddx.get(), stream);
  const std::vector<float> got = ddx.download();
  const double atol = atol_for(int64_t(s.r) * s.s * s.k);
  EXPECT_ALL_CLOSE(got, expected, kRtol, atol);
  ddx.poison();
  CudnnConv(cudnn(), s).backward_data(ddy.get(), dw.get(), ddx.get());
  EXPECT_ALL_CLOSE(got, ddx.download(), kRtol, 2 * atol) << "against cuDNN";
}

TEST_P(Conv2dGpu, BackwardWeight) {
  CUDP_REQUIRE_GPU();
  const Conv2dShape& s = GetParam().shape;
  SCOPED_TRACE(describe(s));
  const cuda::Stream stream = cuda::Stream::create(0);
  const std::vector<float> x = random(s.x_size()), dy = random(s.y_size());
  const std::vector<float> old = random(s.w_size());
  Buffer dx(s.x_size()), ddy(s.y_size()), ddw(s.w_size());
  dx.upload(x);
  ddy.upload(dy);
  const double atol = atol_for(int64_t(s.n) * s.p() * s.q());

  // beta = 0: dw holds NaN, which must be neither read nor left behind.
  std::vector<float> expected(size_t(s.w_size()));
  conv2d_backward_weight_cpu(s, x.data(), dy.data(), expected.data(), 0.0f);
  ddw.poison_nan();
  conv2d_backward_weight(s, dx.get(), ddy.get(), ddw.get(), 0.0f, stream);
  const std::vector<float> got = ddw.download();
  EXPECT_ALL_CLOSE(got, expected, kRtol, atol);

  // beta = 1 accumulates onto the previous gradient.
  expected = old;
  conv2d_backward_weight_cpu(s, x.data(), dy.data(), expected.data(), 1.0f);
  ddw.upload(old);
  conv2d_backward_weight(s, dx.get(), ddy.get(), ddw.get(), 1.0f, stream);
  EXPECT_ALL_CLOSE(ddw.download(), expected, kRtol, atol) << "beta = 1";

  ddw.poison();
  CudnnConv(cudnn(), s).backward_weight(dx.get(), ddy.get(), ddw.get());
  EXPECT_ALL_CLOSE(got, ddw.download(), kRtol, 2 * atol) << "against cuDNN";
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.name;
}

// N = 3, C = 5, H = W = 7, K = 9 unless a case says otherwise: no dimension is a multiple of a
// tile, of 4 or of 8. Fields: n, h, w, c, k, r, s, stride_h, stride_w, pad_h, pad_w.
const Case kOddCases[] = {
    {"r1_s1_p0", {3, 7, 7, 5, 9, 1, 1, 1, 1, 0, 0}},
    {"r3_s1_p1", {3, 7, 7, 5, 9, 3, 3, 1, 1, 1, 1}},
    {"r5_s1_p2", {3, 7, 7, 5, 9, 5, 5, 1, 1, 2, 2}},
    {"r3_s1_p0", {3, 7, 7, 5, 9, 3, 3, 1, 1, 0, 0}},
    {"r1_s2_p0", {3, 7, 7, 5, 9, 1, 1, 2, 2, 0, 0}},
    {"r3_s2_p1", {3, 7, 7, 5, 9, 3, 3, 2, 2, 1, 1}},
    {"r5_s2_p0", {3, 7, 7, 5, 9, 5, 5, 2, 2, 0, 0}},
    {"r5_s2_p2", {3, 7, 7, 5, 9, 5, 5, 2, 2, 2, 2}},
    {"nonsquare_a", {3, 7, 9, 5, 9, 3, 5, 1, 2, 2, 1}},
    {"nonsquare_b", {3, 9, 7, 5, 9, 5, 3, 2, 1, 0, 2}},
    {"c1", {3, 7, 7, 1, 9, 3, 3, 1, 1, 1, 1}},
    {"c3", {3, 7, 7, 3, 9, 3, 3, 1, 1, 1, 1}},
    // C <= 4 with K % 4 == 0, 3-wide filters and stride 1: the direct backward-data kernel.
    {"c1_k8", {2, 9, 10, 1, 8, 3, 3, 1, 1, 1, 1}},
    {"c3_k8_p0", {2, 9, 10, 3, 8, 3, 3, 1, 1, 0, 0}},
    {"c3_k8_r5_p2", {2, 9, 10, 3, 8, 5, 3, 1, 1, 2, 1}},
    {"c4_k8", {2, 9, 9, 4, 8, 3, 3, 1, 1, 1, 1}},
    {"c3_k136", {2, 6, 19, 3, 136, 3, 3, 1, 1, 1, 1}},  // two k-chunks
    {"c3_k8_s2", {2, 9, 10, 3, 8, 3, 3, 2, 2, 1, 1}},
    // C and K multiples of 4: the float4 paths.
    {"c8_k12", {3, 7, 7, 8, 12, 3, 3, 1, 1, 1, 1}},
    {"c12_k20_s2x1", {3, 7, 9, 12, 20, 3, 5, 2, 1, 1, 2}},
    {"c16_k36_r1", {2, 11, 13, 16, 36, 1, 1, 1, 1, 0, 0}},
    {"c96_k40_s2", {2, 9, 9, 96, 40, 3, 3, 2, 2, 1, 1}},
    {"c68_k72", {2, 5, 5, 68, 72, 3, 3, 1, 1, 1, 1}},
    {"c8_k130", {2, 6, 6, 8, 130, 3, 3, 1, 1, 1, 1}},
    // Few output tiles and a long reduction: every pass splits it.
    {"c256_k256_h4", {1, 4, 4, 256, 256, 3, 3, 1, 1, 1, 1}},
};
INSTANTIATE_TEST_SUITE_P(Odd, Conv2dGpu, ::testing::ValuesIn(kOddCases), case_name);

// VGG-16's channel progression (3x3, stride 1, pad 1) at small batches, so that the CPU reference
// stays fast.
const Case kVggCases[] = {
    {"c3_k64_h32", {2, 32, 32, 3, 64, 3, 3, 1, 1, 1, 1}},
    {"c64_k64_h56", {2, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1}},
    {"c64_k128_h28", {2, 28, 28, 64, 128, 3, 3, 1, 1, 1, 1}},
    {"c128_k256_h14", {2, 14, 14, 128, 256, 3, 3, 1, 1, 1, 1}},
    {"c256_k512_h7", {2, 7, 7, 256, 512, 3, 3, 1, 1, 1, 1}},
    {"c512_k512_h4", {4, 4, 4, 512, 512, 3, 3, 1, 1, 1, 1}},
    {"c512_k512_h2", {8, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}},
};
INSTANTIATE_TEST_SUITE_P(Vgg, Conv2dGpu, ::testing::ValuesIn(kVggCases), case_name);

// Pointers one float past a 16-byte boundary must take the single-float path and still be right.
TEST_F(Conv2dGpuTest, MisalignedPointers) {
  CUDP_REQUIRE_GPU();
  const Conv2dShape s{2, 9, 9, 8, 16, 3, 3, 1, 1, 1, 1};
  const cuda::Stream stream = cuda::Stream::create(0);
  const std::vector<float> x = random(s.x_size()), w = random(s.w_size()), dy = random(s.y_size());
  Buffer bx(s.x_size(), 1), bw(s.w_size(), 1), bdy(s.y_size(), 1);
  Buffer by(s.y_size(), 1), bdx(s.x_size(), 1), bdw(s.w_size(), 1);
  bx.upload(x);
  bw.upload(w);
  bdy.upload(dy);
  std::vector<float> expected(size_t(s.y_size()));
  conv2d_forward_cpu(s, x.data(), w.data(), nullptr, expected.data(), false);
  by.poison();
  conv2d_forward(s, bx.get(), bw.get(), nullptr, by.get(), false, stream);
  EXPECT_ALL_CLOSE(by.download(), expected, kRtol, atol_for(s.r * s.s * s.c)) << "forward";

  expected.assign(size_t(s.x_size()), 0.0f);
  conv2d_backward_data_cpu(s, dy.data(), w.data(), expected.data());
  bdx.poison();
  conv2d_backward_data(s, bdy.get(), bw.get(), bdx.get(), stream);
  EXPECT_ALL_CLOSE(bdx.download(), expected, kRtol, atol_for(s.r * s.s * s.k)) << "backward-data";

  expected.assign(size_t(s.w_size()), 0.0f);
  conv2d_backward_weight_cpu(s, x.data(), dy.data(), expected.data(), 0.0f);
  bdw.poison();
  conv2d_backward_weight(s, bx.get(), bdy.get(), bdw.get(), 0.0f, stream);
  EXPECT_ALL_CLOSE(bdw.download(), expected, kRtol, atol_for(s.n * s.p() * s.q()))
      << "backward-weight";
}

// dw[k][r][s][c] = sum over n, p, q of dy[n][p][q][k] x[n][p*stride_h - pad_h + r][...][c], in
// double, for one element: the full CPU reference at training batch sizes would take minutes.
double backward_weight_at(const Conv2dShape& sh, const std::vector<float>& x,
                          const std::vector<float>& dy, int64_t index) {
  const int c = int(index % sh.c), s = int(index / sh.c % sh.s);
  const int r = int(index / sh.c / sh.s % sh.r), k = int(index / sh.c / sh.s / sh.r);
  const int P = sh.p(), Q = sh.q();
  double sum = 0;
  for (int n = 0; n < sh.n; ++n) {
    for (int p = 0; p < P; ++p) {
      const int ih = p * sh.stride_h - sh.pad_h + r;
      if (ih < 0 || ih >= sh.h) continue;
      for (int q = 0; q < Q; ++q) {
        const int iw = q * sh.stride_w - sh.pad_w + s;
        if (iw < 0 || iw >= sh.w) continue;
        sum += double(dy[size_t(((int64_t(n) * P + p) * Q + q) * sh.k + k)]) *
               x[size_t(((int64_t(n) * sh.h + ih) * sh.w + iw) * sh.c + c)];
      }
    }
  }
  return sum;
}

// Backward-weight at full-size reductions (N*P*Q of 50k to 262k, VGG's at batch 64 to 256), where
// the reduction is split hundreds of ways on a large GPU: every tile of every slice must be
// written and summed once. Checked on a random sample of outputs (plus the first and the last)
// against a double reference computed for those alone; every output must be written (no poison
// left) for beta = 0, and beta = 1 must add onto a known dw.
TEST_F(Conv2dGpuTest, BackwardWeightLongReduction) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  constexpr int kSamples = 512;
  // One per backward-weight tile configuration: 64 x 128 (K <= 64), 128 x 128 (K > 64), and
  // 64 x 32 on the single-float path (the first layer's C = 3).
  for (const Conv2dShape& s : {Conv2dShape{64, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1},
                               Conv2dShape{256, 32, 32, 64, 64, 3, 3, 1, 1, 1, 1},
                               Conv2dShape{64, 28, 28, 128, 128, 3, 3, 1, 1, 1, 1},
                               Conv2dShape{256, 32, 32, 3, 64, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(describe(s));
    const std::vector<float> x = random(s.x_size()), dy = random(s.y_size());
    const std::vector<float> old = random(s.w_size());
    Buffer dx(s.x_size()), ddy(s.y_size()), ddw(s.w_size());
    dx.upload(x);
    ddy.upload(dy);
    const double atol = atol_for_split(int64_t(s.n) * s.p() * s.q());

    std::vector<int64_t> sample = {0, s.w_size() - 1};
    std::mt19937_64 gen(uint64_t(s.w_size()));
    std::uniform_int_distribution<int64_t> pick(0, s.w_size() - 1);
    while (int(sample.size()) < kSamples) sample.push_back(pick(gen));
    std::vector<double> grad(sample.size());
    for (size_t i = 0; i < sample.size(); ++i) grad[i] = backward_weight_at(s, x, dy, sample[i]);
    const auto at = [&](const std::vector<float>& all) {
      std::vector<float> v(sample.size());
      for (size_t i = 0; i < sample.size(); ++i) v[i] = all[size_t(sample[i])];
      return v;
    };
    const auto written = [](const std::vector<float>& all) {
      return std::all_of(all.begin(), all.end(),
                         [](float v) { return std::isfinite(v) && v != testing::kPoison; });
    };

    // beta = 0: dw holds NaN, which must be neither read nor left behind.
    ddw.poison_nan();
    conv2d_backward_weight(s, dx.get(), ddy.get(), ddw.get(), 0.0f, stream);
    const std::vector<float> got = ddw.download();
    EXPECT_TRUE(written(got)) << "beta = 0 left poison (or produced a non-finite value) in dw";
    EXPECT_ALL_CLOSE(at(got), grad, kRtol, atol) << "beta = 0";

    // beta = 1 accumulates onto a known previous gradient.
    ddw.upload(old);
    conv2d_backward_weight(s, dx.get(), ddy.get(), ddw.get(), 1.0f, stream);
    const std::vector<float> sum = ddw.download();
    EXPECT_TRUE(written(sum)) << "beta = 1 produced a non-finite value";
    std::vector<double> expected(sample.size());
    for (size_t i = 0; i < sample.size(); ++i) {
      expected[i] = double(old[size_t(sample[i])]) + grad[i];
    }
    EXPECT_ALL_CLOSE(at(sum), expected, kRtol, atol) << "beta = 1";
  }
}

// Split reductions are summed in a fixed order: two runs give the same bits.
TEST_F(Conv2dGpuTest, Deterministic) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  for (const Conv2dShape& s : {Conv2dShape{4, 14, 14, 64, 128, 3, 3, 1, 1, 1, 1},
                               Conv2dShape{2, 32, 32, 3, 64, 3, 3, 1, 1, 1, 1},
                               Conv2dShape{8, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(describe(s));
    Buffer x(s.x_size()), w(s.w_size()), dy(s.y_size()), bias(s.k);
    x.upload(random(s.x_size()));
    w.upload(random(s.w_size()));
    dy.upload(random(s.y_size()));
    bias.upload(random(s.k));
    const auto same_twice = [](int64_t n, const auto& run) {
      Buffer first(n), second(n);
      first.poison();
      second.poison();
      run(first.get());
      run(second.get());
      const std::vector<float> a = first.download(), b = second.download();
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    EXPECT_TRUE(same_twice(s.y_size(), [&](float* y) {
      conv2d_forward(s, x.get(), w.get(), bias.get(), y, true, stream);
    })) << "forward";
    EXPECT_TRUE(same_twice(s.x_size(), [&](float* dx) {
      conv2d_backward_data(s, dy.get(), w.get(), dx, stream);
    })) << "backward-data";
    EXPECT_TRUE(same_twice(s.w_size(), [&](float* dw) {
      conv2d_backward_weight(s, x.get(), dy.get(), dw, 0.0f, stream);
    })) << "backward-weight";
  }
}

}  // namespace
}  // namespace cudp::kernels
