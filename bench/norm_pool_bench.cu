// bench_norm_pool: our pooling and batch-normalisation kernels against cuDNN (NHWC), at VGG sizes.
//
// For every case: validate ours against cuDNN on the first input set (tolerances as in the GPU
// tests), then time both with time_on_stream, rotating over copies of the inputs so that L2 does
// not serve them. Bandwidth counts the bytes our op must move at the least (README-norm-pool.md),
// the same count for cuDNN, so ours/vendor is the inverse ratio of times; "of copy" divides ours by
// the measured device-to-device copy bandwidth. --json PATH writes the results as JSON.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/cli.h"
#include "common/device_buffer.h"
#include "common/timing.h"
#include "engine/core/error.h"
#include "engine/core/vendor_check.h"
#include "kernels/batchnorm.h"
#include "kernels/elementwise.h"
#include "kernels/init.h"
#include "kernels/layout.h"
#include "kernels/pool.h"

namespace {

using namespace cudp;
using namespace cudp::kernels;
using bench::DeviceBuffer;

// `copies` random buffers of n floats each.
std::vector<std::unique_ptr<DeviceBuffer<float>>> random_copies(int copies, size_t n, float lo,
                                                                float hi, uint64_t seed,
                                                                cudaStream_t stream) {
  std::vector<std::unique_ptr<DeviceBuffer<float>>> out;
  for (int i = 0; i < copies; ++i) {
    out.push_back(std::make_unique<DeviceBuffer<float>>(n));
    uniform(out.back()->p, int64_t(n), lo, hi, seed + i, 0, stream);
  }
  return out;
}

std::vector<std::unique_ptr<DeviceBuffer<float>>> empty_copies(int copies, size_t n) {
  std::vector<std::unique_ptr<DeviceBuffer<float>>> out;
  for (int i = 0; i < copies; ++i) out.push_back(std::make_unique<DeviceBuffer<float>>(n));
  return out;
}

// |a - b| <= atol + rtol |b| everywhere? Prints the worst element either way (the first NaN, if
// any). Exactly equal elements pass even with zero tolerance (atol = rtol = 0 asks for bitwise-equal
// values: 0 / 0 must not become a NaN "excess"); a NaN on either side, or unequal infinities, fail;
// so does a size mismatch.
bool validate(const std::string& what, const std::vector<float>& a, const std::vector<float>& b,
              double rtol, double atol) {
  if (a.size() != b.size()) {
    std::printf("  validate %-40s FAIL (size %zu vs %zu)\n", what.c_str(), a.size(), b.size());
    return false;
  }
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // excess 0; false for NaN
    const double diff = std::fabs(double(a[i]) - double(b[i]));  // > 0, inf or NaN here
    const double tol = atol + rtol * std::fabs(double(b[i]));
    // tol == 0: diff / 0 is inf (never NaN, as diff > 0 or NaN); NaN stays NaN.
    const double excess = tol > 0 ? diff / tol : (diff > 0 ? HUGE_VAL : diff);
    if (std::isnan(excess)) {  // NaN on either side (or inf - inf): the worst possible; stop
      worst = excess, at = i;
      break;
    }
    if (excess > worst) worst = excess, at = i;
  }
  const bool ok = worst <= 1.0;  // false for NaN
  std::printf("  validate %-40s %s (worst %.3g of tolerance at %zu: %.8g vs %.8g)\n", what.c_str(),
              ok ? "ok  " : "FAIL", worst, at, a.empty() ? 0.0 : a[at], b.empty() ? 0.0 : b[at]);
  return ok;
}

// Largest finite |v| (a tolerance scale: NaN / inf elements must not make it NaN / inf and so
// loosen every other comparison; validate fails on those elements themselves).
double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float f : v)
    if (std::isfinite(f)) m = std::max(m, double(std::fabs(f)));
  return m;
}

struct Result {
  std::string op, shape;
  double bytes = 0, ours_ms = 0, vendor_ms = 0;
  bool valid = true;
};

struct Cudnn {
  cudnnHandle_t handle = nullptr;
  explicit Cudnn(cudaStream_t s) {
    CUDP_CUDNN_CHECK(cudnnCreate(&handle));
    CUDP_CUDNN_CHECK(cudnnSetStream(handle, s));
  }
  ~Cudnn() { cudnnDestroy(handle); }
};

struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  TensorDesc(int n, int c, int h, int w) {
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
    CUDP_CUDNN_CHECK(
        cudnnSetTensor4dDescriptor(d, CUDNN_TENSOR_NHWC, CUDNN_DATA_FLOAT, n, c, h, w));
  }
  TensorDesc() { CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d)); }
  ~TensorDesc() { cudnnDestroyTensorDescriptor(d); }
};

struct PoolDesc {
  cudnnPoolingDescriptor_t d = nullptr;
  PoolDesc(cudnnPoolingMode_t mode, int kh, int kw, int ph, int pw, int sh, int sw) {
    CUDP_CUDNN_CHECK(cudnnCreatePoolingDescriptor(&d));
    CUDP_CUDNN_CHECK(
        cudnnSetPooling2dDescriptor(d, mode, CUDNN_NOT_PROPAGATE_NAN, kh, kw, ph, pw, sh, sw));
  }
  ~PoolDesc() { cudnnDestroyPoolingDescriptor(d); }
};

std::string shape_text(int n, int h, int w, int c) {
  return std::to_string(n) + "x" + std::to_string(h) + "x" + std::to_string(w) + "x" +
         std::to_string(c);
}

constexpr float kOne = 1.f, kZero = 0.f;

// Max pooling forward and backward at one shape and window.
void bench_max_pool(std::vector<Result>& results, cudaStream_t stream, Cudnn& cudnn, int n, int h,
                    int w, int c, int k, int s, int pad) {
  const int oh = max_pool2d_output_size(h, k, s, pad), ow = max_pool2d_output_size(w, k, s, pad);
  const size_t in = size_t(n) * h * w * c, out = size_t(n) * oh * ow * c;
  const double fwd_bytes = 4.0 * (in + 2 * out), bwd_bytes = 4.0 * (2 * out + in);
  const int copies = cudp::bench::rotation_copies(size_t(fwd_bytes));
  auto x = random_copies(copies, in, -1.f, 1.f, 1, stream);
  auto dy = random_copies(copies, out, -1.f, 1.f, 100, stream);
  auto y = empty_copies(copies, out), y_ref = empty_copies(copies, out);
  auto dx = empty_copies(copies, in), dx_ref = empty_copies(copies, in);
  std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> idx;
  for (int i = 0; i < copies; ++i) idx.push_back(std::make_unique<DeviceBuffer<int32_t>>(out));
  const TensorDesc xd(n, c, h, w), yd(n, c, oh, ow);
  const PoolDesc pd(CUDNN_POOLING_MAX_DETERMINISTIC, k, k, pad, pad, s, s);

  auto ours_fwd = [&](int i) {
    max_pool2d_forward(x[i]->p, y[i]->p, idx[i]->p, n, h, w, c, k, k, s, s, pad, pad, stream);
  };
  auto ours_bwd = [&](int i) {
    max_pool2d_backward(dy[i]->p, idx[i]->p, dx[i]->p, n, h, w, c, k, k, s, s, pad, pad, stream);
  };
  auto ref_fwd = [&](int i) {
    CUDP_CUDNN_CHECK(
        cudnnPoolingForward(cudnn.handle, pd.d, &kOne, xd.d, x[i]->p, &kZero, yd.d, y_ref[i]->p));
  };
  auto ref_bwd = [&](int i) {
    CUDP_CUDNN_CHECK(cudnnPoolingBackward(cudnn.handle, pd.d, &kOne, yd.d, y_ref[i]->p, yd.d,
                                          dy[i]->p, xd.d, x[i]->p, &kZero, xd.d, dx_ref[i]->p));
  };
  for (int i = 0; i < copies; ++i) ours_fwd(i), ref_fwd(i);  // indices and y for the backwards
  ours_bwd(0);
  ref_bwd(0);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::string shape = shape_text(n, h, w, c) + " k" + std::to_string(k) + "s" +
                            std::to_string(s) + "p" + std::to_string(pad);
  std::printf("max_pool2d %s (%d input copies)\n", shape.c_str(), copies);
  // Random inputs have no ties: both pick the same maxima; backward sums <= 4 terms.
  const bool fwd_ok = validate("forward y vs cuDNN", y[0]->download(), y_ref[0]->download(), 0, 0);
  const bool bwd_ok =
      validate("backward dx vs cuDNN", dx[0]->download(), dx_ref[0]->download(), 1e-6, 1e-6);
  auto rotate = [copies](const std::function<void(int)>& f) {
    return [f, copies](int rep) { f(rep % copies); };
  };
  results.push_back({"max_pool2d fwd", shape, fwd_bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_fwd)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_fwd)).median_ms, fwd_ok});
  results.push_back({"max_pool2d bwd", shape, bwd_bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_bwd)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_bwd)).median_ms, bwd_ok});
  if (k != 2 || s != 2 || pad != 0) return;
  // VGG's window as the layer runs it: one byte of code per output (kernels/pool.h) instead of the
  // int32 index, and backward from the codes alone (cuDNN's reads x, y and dy).
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> codes;
  for (int i = 0; i < copies; ++i) codes.push_back(std::make_unique<DeviceBuffer<uint8_t>>(out));
  auto codes_fwd = [&](int i) {
    max_pool2d_2x2_forward(x[i]->p, y[i]->p, codes[i]->p, n, h, w, c, stream);
  };
  auto codes_bwd = [&](int i) {
    max_pool2d_2x2_backward(dy[i]->p, codes[i]->p, dx[i]->p, n, h, w, c, stream);
  };
  for (int i = 0; i < copies; ++i) codes_fwd(i);
  codes_bwd(0);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  const bool codes_fwd_ok =
      validate("codes forward y vs cuDNN", y[0]->download(), y_ref[0]->download(), 0, 0);
  const bool codes_bwd_ok =
      validate("codes backward dx vs cuDNN", dx[0]->download(), dx_ref[0]->download(), 0, 0);
  results.push_back({"max_pool2d fwd, codes", shape, 4.0 * (in + out) + double(out),
                     cudp::bench::time_on_stream(stream, rotate(codes_fwd)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_fwd)).median_ms, codes_fwd_ok});
  results.push_back({"max_pool2d bwd, codes", shape, 4.0 * (out + in) + double(out),
                     cudp::bench::time_on_stream(stream, rotate(codes_bwd)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_bwd)).median_ms, codes_bwd_ok});
}

// Adaptive average pooling; cuDNN's average pooling stands in where the windows are uniform
// (in = 2 * out), otherwise there is no vendor figure.
void bench_adaptive(std::vector<Result>& results, cudaStream_t stream, Cudnn& cudnn, int n, int h,
                    int w, int c, int oh, int ow) {
  const size_t in = size_t(n) * h * w * c, out = size_t(n) * oh * ow * c;
  const double bytes = 4.0 * (in + out);
  const int copies = cudp::bench::rotation_copies(size_t(bytes));
  auto x = random_copies(copies, in, -1.f, 1.f, 200, stream);
  auto dy = random_copies(copies, out, -1.f, 1.f, 300, stream);
  auto y = empty_copies(copies, out), y_ref = empty_copies(copies, out);
  auto dx = empty_copies(copies, in), dx_ref = empty_copies(copies, in);
  const bool vendor = h == 2 * oh && w == 2 * ow;
  const TensorDesc xd(n, c, h, w), yd(n, c, oh, ow);
  const PoolDesc pd(CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING, 2, 2, 0, 0, 2, 2);
  auto ours_fwd = [&](int i) {
    adaptive_avg_pool2d_forward(x[i]->p, y[i]->p, n, h, w, c, oh, ow, stream);
  };
  auto ours_bwd = [&](int i) {
    adaptive_avg_pool2d_backward(dy[i]->p, dx[i]->p, n, h, w, c, oh, ow, stream);
  };
  auto ref_fwd = [&](int i) {
    CUDP_CUDNN_CHECK(
        cudnnPoolingForward(cudnn.handle, pd.d, &kOne, xd.d, x[i]->p, &kZero, yd.d, y_ref[i]->p));
  };
  auto ref_bwd = [&](int i) {
    CUDP_CUDNN_CHECK(cudnnPoolingBackward(cudnn.handle, pd.d, &kOne, yd.d, y_ref[i]->p, yd.d,
                                          dy[i]->p, xd.d, x[i]->p, &kZero, xd.d, dx_ref[i]->p));
  };
  const std::string shape =
      shape_text(n, h, w, c) + " -> " + std::to_string(oh) + "x" + std::to_string(ow);
  std::printf("adaptive_avg_pool2d %s (%d input copies)\n", shape.c_str(), copies);
  ours_fwd(0);
  ours_bwd(0);
  bool ok = true;
  if (vendor) {
    ref_fwd(0);
    ref_bwd(0);
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    ok = validate("forward y vs cuDNN average", y[0]->download(), y_ref[0]->download(), 1e-6,
                  1e-6) &&
         validate("backward dx vs cuDNN average", dx[0]->download(), dx_ref[0]->download(), 1e-6,
                  1e-6);
  }
  auto rotate = [copies](const std::function<void(int)>& f) {
    return [f, copies](int rep) { f(rep % copies); };
  };
  const auto time_vendor = [&](const std::function<void(int)>& f) {
    return vendor ? cudp::bench::time_on_stream(stream, rotate(f)).median_ms : 0.0;
  };
  results.push_back({"adaptive_avg_pool2d fwd", shape, bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_fwd)).median_ms,
                     time_vendor(ref_fwd), ok});
  results.push_back({"adaptive_avg_pool2d bwd", shape, bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_bwd)).median_ms,
                     time_vendor(ref_bwd), ok});
}

// Batch normalisation: training forward (with running statistics), evaluation, backward.
void bench_batchnorm(std::vector<Result>& results, cudaStream_t stream, Cudnn& cudnn, int n, int h,
                     int w, int c) {
  const int64_t rows = int64_t(n) * h * w;
  const size_t size = size_t(rows) * c;
  const int copies = cudp::bench::rotation_copies(2 * size * sizeof(float));
  auto x = random_copies(copies, size, -1.f, 3.f, 400, stream);
  auto dy = random_copies(copies, size, -1.f, 1.f, 500, stream);
  auto y = empty_copies(copies, size), y_ref = empty_copies(copies, size);
  auto dx = empty_copies(copies, size), dx_ref = empty_copies(copies, size);
  DeviceBuffer<float> gamma(c), beta(c), rm(c), rv(c), rm_ref(c), rv_ref(c), dgamma(c), dbeta(c),
      dgamma_ref(c), dbeta_ref(c);
  uniform(gamma.p, c, 0.5f, 1.5f, 600, 0, stream);
  uniform(beta.p, c, -1.f, 1.f, 601, 0, stream);
  for (DeviceBuffer<float>* b : {&rm, &rm_ref}) fill(b->p, c, 0.f, stream);
  for (DeviceBuffer<float>* b : {&rv, &rv_ref}) fill(b->p, c, 1.f, stream);
  auto save_mean = empty_copies(copies, c), save_invstd = empty_copies(copies, c);
  auto save_mean_ref = empty_copies(copies, c), save_invstd_ref = empty_copies(copies, c);
  TensorDesc xd(n, c, h, w), bnd;
  CUDP_CUDNN_CHECK(cudnnDeriveBNTensorDescriptor(bnd.d, xd.d, CUDNN_BATCHNORM_SPATIAL));
  const float momentum = 0.1f, eps = 1e-5f;

  auto ours_train = [&](int i) {
    batchnorm_forward_train(x[i]->p, y[i]->p, gamma.p, beta.p, rm.p, rv.p, save_mean[i]->p,
                            save_invstd[i]->p, rows, c, momentum, eps, BnActivation::none, stream);
  };
  auto ref_train = [&](int i) {
    CUDP_CUDNN_CHECK(cudnnBatchNormalizationForwardTraining(
        cudnn.handle, CUDNN_BATCHNORM_SPATIAL, &kOne, &kZero, xd.d, x[i]->p, xd.d, y_ref[i]->p,
        bnd.d, gamma.p, beta.p, momentum, rm_ref.p, rv_ref.p, eps, save_mean_ref[i]->p,
        save_invstd_ref[i]->p));
  };
  auto ours_eval = [&](int i) {
    batchnorm_forward_eval(x[i]->p, y[i]->p, gamma.p, beta.p, rm.p, rv.p, rows, c, eps,
                           BnActivation::none, stream);
  };
  auto ref_eval = [&](int i) {
    CUDP_CUDNN_CHECK(cudnnBatchNormalizationForwardInference(
        cudnn.handle, CUDNN_BATCHNORM_SPATIAL, &kOne, &kZero, xd.d, x[i]->p, xd.d, y_ref[i]->p,
        bnd.d, gamma.p, beta.p, rm.p, rv.p, eps));
  };
  auto ours_bwd = [&](int i) {
    batchnorm_backward(x[i]->p, dy[i]->p, nullptr, gamma.p, save_mean[i]->p, save_invstd[i]->p,
                       dx[i]->p, dgamma.p, dbeta.p, rows, c, 0.f, stream);
  };
  auto ref_bwd = [&](int i) {
    CUDP_CUDNN_CHECK(cudnnBatchNormalizationBackward(
        cudnn.handle, CUDNN_BATCHNORM_SPATIAL, &kOne, &kZero, &kOne, &kZero, xd.d, x[i]->p, xd.d,
        dy[i]->p, xd.d, dx_ref[i]->p, bnd.d, gamma.p, dgamma_ref.p, dbeta_ref.p, eps,
        save_mean_ref[i]->p, save_invstd_ref[i]->p));
  };

  const std::string shape = shape_text(n, h, w, c);
  std::printf("batchnorm %s (%d input copies)\n", shape.c_str(), copies);
  for (int i = 0; i < copies; ++i) ours_train(i), ref_train(i);  // saved statistics for backward
  ours_bwd(0);
  ref_bwd(0);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Tolerances of batchnorm_gpu_test's comparison with cuDNN; copy 0 of x (last forward of y[0]).
  bool train_ok = validate("train y vs cuDNN", y[0]->download(), y_ref[0]->download(), 2e-5, 4e-5);
  train_ok &= validate("saved invstd vs cuDNN", save_invstd[0]->download(),
                       save_invstd_ref[0]->download(), 2e-5, 0);
  const std::vector<float> dx_r = dx_ref[0]->download();
  bool bwd_ok =
      validate("backward dx vs cuDNN", dx[0]->download(), dx_r, 2e-5, 8e-6 * max_abs(dx_r));
  // dbeta, dgamma: sums over `rows` terms of magnitude <~ 1 (see the test for the bound).
  // sum |dy| ~ rows / 2 and sum |dy * xhat| ~ 0.43 rows per channel here.
  bwd_ok &= validate("backward dbeta vs cuDNN", dbeta.download(), dbeta_ref.download(), 2e-5,
                     2e-7 * double(rows));
  bwd_ok &= validate("backward dgamma vs cuDNN", dgamma.download(), dgamma_ref.download(), 2e-5,
                     2e-7 * double(rows));
  ours_eval(0);
  ref_eval(0);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  const bool eval_ok =
      validate("eval y vs cuDNN", y[0]->download(), y_ref[0]->download(), 2e-5, 2e-5);

  auto rotate = [copies](const std::function<void(int)>& f) {
    return [f, copies](int rep) { f(rep % copies); };
  };
  const double bytes = 4.0 * double(size);
  results.push_back({"batchnorm train fwd", shape, 3 * bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_train)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_train)).median_ms, train_ok});
  results.push_back({"batchnorm eval fwd", shape, 2 * bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_eval)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_eval)).median_ms, eval_ok});
  results.push_back({"batchnorm bwd", shape, 5 * bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_bwd)).median_ms,
                     cudp::bench::time_on_stream(stream, rotate(ref_bwd)).median_ms, bwd_ok});
}

// Batch normalisation with the fused ReLU (VGG-BN's Conv2d -> BatchNorm2d -> ReLU), in f32 or bf16
// storage (T): ours only, as cuDNN's batch-norm calls have no fused ReLU; the "of copy" column is
// the roofline. Validated first on copy 0: the fused forward is ReLU's rule applied to the plain
// forward, and the masked backward is the plain backward of the gradient ReLU's rule masked, both
// exactly (validate with zero tolerances); in bf16 the plain forward is also compared with the f32 kernel on the same values
// (one bf16 ulp, 2^-7 relative, plus the f32 kernel's distance to cuDNN, as in the tests).
template <typename T>
void bench_batchnorm_relu(std::vector<Result>& results, cudaStream_t stream, int n, int h, int w,
                          int c) {
  constexpr bool is_bf16 = std::is_same_v<T, __nv_bfloat16>;
  const char* type = is_bf16 ? "bf16" : "f32";
  const int64_t rows = int64_t(n) * h * w;
  const size_t size = size_t(rows) * c;
  const int copies = cudp::bench::rotation_copies(2 * size * sizeof(T));
  // Inputs as f32 (values bf16 holds exactly when T is bf16), and in T.
  auto x32 = random_copies(copies, size, -1.f, 3.f, 700, stream);
  auto dy32 = random_copies(copies, size, -1.f, 1.f, 800, stream);
  std::vector<std::unique_ptr<DeviceBuffer<T>>> x, dy, y, dx;
  for (int i = 0; i < copies; ++i) {
    for (auto* v : {&x, &dy, &y, &dx}) v->push_back(std::make_unique<DeviceBuffer<T>>(size));
    if constexpr (is_bf16) {
      f32_to_bf16(x32[i]->p, x[i]->p, int64_t(size), stream);
      f32_to_bf16(dy32[i]->p, dy[i]->p, int64_t(size), stream);
      bf16_to_f32(x[i]->p, x32[i]->p, int64_t(size), stream);
    } else {
      CUDP_CUDA_CHECK(cudaMemcpyAsync(x[i]->p, x32[i]->p, size * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream));
      CUDP_CUDA_CHECK(cudaMemcpyAsync(dy[i]->p, dy32[i]->p, size * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream));
    }
  }
  DeviceBuffer<float> gamma(c), beta(c), rm(c), rv(c), dgamma(c), dbeta(c);
  uniform(gamma.p, c, 0.5f, 1.5f, 900, 0, stream);
  uniform(beta.p, c, -1.f, 1.f, 901, 0, stream);
  fill(rm.p, c, 0.f, stream);
  fill(rv.p, c, 1.f, stream);
  auto save_mean = empty_copies(copies, c), save_invstd = empty_copies(copies, c);
  const float momentum = 0.1f, eps = 1e-5f;

  auto train = [&](int i, BnActivation act, T* out) {
    batchnorm_forward_train(x[i]->p, out, gamma.p, beta.p, rm.p, rv.p, save_mean[i]->p,
                            save_invstd[i]->p, rows, c, momentum, eps, act, stream);
  };
  auto ours_train = [&](int i) { train(i, BnActivation::relu, y[i]->p); };
  auto ours_eval = [&](int i) {
    batchnorm_forward_eval(x[i]->p, y[i]->p, gamma.p, beta.p, rm.p, rv.p, rows, c, eps,
                           BnActivation::relu, stream);
  };
  auto ours_bwd = [&](int i) {
    batchnorm_backward(x[i]->p, dy[i]->p, y[i]->p, gamma.p, save_mean[i]->p, save_invstd[i]->p,
                       dx[i]->p, dgamma.p, dbeta.p, rows, c, 0.f, stream);
  };

  const std::string shape = shape_text(n, h, w, c) + " " + type;
  std::printf("batchnorm + relu %s (%d input copies)\n", shape.c_str(), copies);
  auto as_floats = [](const DeviceBuffer<T>& b) {
    if constexpr (is_bf16) {
      const std::vector<T> v = b.download();
      std::vector<float> out(v.size());
      bf16_to_f32_cpu(v.data(), out.data(), int64_t(v.size()));
      return out;
    } else {
      return b.download();
    }
  };
  // Plain forward (copy 0) into dx[0] as scratch, fused into y[0]; then the backwards.
  DeviceBuffer<T> y_plain(size), dy_masked(size), dx_plain(size);
  DeviceBuffer<float> dgamma_plain(c), dbeta_plain(c);
  train(0, BnActivation::none, y_plain.p);
  for (int i = 0; i < copies; ++i) ours_train(i);
  const std::vector<float> plain = as_floats(y_plain), fused = as_floats(*y[0]);
  std::vector<float> relu_plain(size), masked(size);
  relu_forward_cpu(plain.data(), relu_plain.data(), int64_t(size));
  bool fwd_ok = validate("fused forward vs relu(plain), exact", fused, relu_plain, 0, 0);
  relu_backward_cpu(fused.data(), as_floats(*dy[0]).data(), masked.data(), int64_t(size));
  if constexpr (is_bf16) {
    std::vector<T> masked_bf16(size);
    f32_to_bf16_cpu(masked.data(), masked_bf16.data(), int64_t(size));
    CUDP_CUDA_CHECK(
        cudaMemcpy(dy_masked.p, masked_bf16.data(), size * sizeof(T), cudaMemcpyHostToDevice));
    // The f32 kernel on the same values (x32[0] holds x[0]'s bf16 values), as the reference.
    DeviceBuffer<float> y32(size), m32(c), i32(c);
    batchnorm_forward_train(x32[0]->p, y32.p, gamma.p, beta.p, nullptr, nullptr, m32.p, i32.p, rows,
                            c, momentum, eps, BnActivation::none, stream);
    fwd_ok &= validate("plain forward vs f32 kernel", plain, y32.download(), 8e-3, 4e-5);
  } else {
    CUDP_CUDA_CHECK(
        cudaMemcpy(dy_masked.p, masked.data(), size * sizeof(T), cudaMemcpyHostToDevice));
  }
  ours_bwd(0);
  batchnorm_backward(x[0]->p, dy_masked.p, static_cast<const T*>(nullptr), gamma.p, save_mean[0]->p,
                     save_invstd[0]->p, dx_plain.p, dgamma_plain.p, dbeta_plain.p, rows, c, 0.f,
                     stream);
  bool bwd_ok =
      validate("masked backward dx vs plain, exact", as_floats(*dx[0]), as_floats(dx_plain), 0, 0);
  bwd_ok &=
      validate("masked dgamma vs plain, exact", dgamma.download(), dgamma_plain.download(), 0, 0);
  bwd_ok &=
      validate("masked dbeta vs plain, exact", dbeta.download(), dbeta_plain.download(), 0, 0);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));

  auto rotate = [copies](const std::function<void(int)>& f) {
    return [f, copies](int rep) { f(rep % copies); };
  };
  const double bytes = double(sizeof(T)) * double(size);
  const std::string suffix = std::string(" +relu ") + type;
  results.push_back({"batchnorm train fwd" + suffix, shape, 3 * bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_train)).median_ms, 0.0,
                     fwd_ok});
  results.push_back({"batchnorm eval fwd" + suffix, shape, 2 * bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_eval)).median_ms, 0.0,
                     fwd_ok});
  // Backward with the fused ReLU reads y (its mask) in both passes: 7 |x|.
  results.push_back({"batchnorm bwd" + suffix, shape, 7 * bytes,
                     cudp::bench::time_on_stream(stream, rotate(ours_bwd)).median_ms, 0.0, bwd_ok});
}

void write_json(const std::string& path, double copy_gbs, const std::vector<Result>& results) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) CUDP_THROW(IoError, "cannot write ", path);
  std::fprintf(
      f, "{\n  \"benchmark\": \"norm_pool\",\n  \"copy_bandwidth_gbs\": %.3f,\n  \"results\": [\n",
      copy_gbs);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const double ours = r.bytes / (r.ours_ms * 1e-3) / 1e9;
    const double vendor = r.vendor_ms > 0 ? r.bytes / (r.vendor_ms * 1e-3) / 1e9 : 0.0;
    std::fprintf(f,
                 "    {\"op\": \"%s\", \"shape\": \"%s\", \"bytes\": %.0f, \"ours_ms\": %.6f, "
                 "\"cudnn_ms\": %.6f, \"ours_gbs\": %.3f, \"cudnn_gbs\": %.3f, "
                 "\"ours_over_copy\": %.4f, \"ours_over_cudnn\": %.4f, \"valid\": %s}%s\n",
                 r.op.c_str(), r.shape.c_str(), r.bytes, r.ours_ms, r.vendor_ms, ours, vendor,
                 ours / copy_gbs, vendor > 0 ? ours / vendor : 0.0, r.valid ? "true" : "false",
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "bench_norm_pool: pooling and batch normalisation, ours vs cuDNN (NHWC, fp32), and batch "
      "normalisation with a fused ReLU in fp32 and bf16 against the copy bandwidth"};
  std::string json;
  bool quick = false;
  app.add_option("--json", json, "write the results to this JSON file");
  app.add_flag("--quick", quick, "small shapes only (a smoke test)");
  if (const auto status = cudp::bench::parse_command_line(app, "bench_norm_pool", argc, argv)) {
    return *status;
  }
  if (!cudp::bench::usable_cuda_device("bench_norm_pool")) return cudp::bench::kExitUsage;
  cudaStream_t stream = nullptr;
  try {
    CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Cudnn cudnn(stream);
    const double copy_gbs = cudp::bench::measure_copy_bandwidth_gbs(stream);
    std::printf("device-to-device copy: %.1f GB/s (read + write)\n", copy_gbs);

    std::vector<Result> results;
    bench_max_pool(results, stream, cudnn, 8, 112, 112, 128, 2, 2, 0);
    bench_max_pool(results, stream, cudnn, 4, 56, 56, 256, 3, 2, 1);
    bench_adaptive(results, stream, cudnn, 64, 14, 14, 512, 7, 7);
    bench_adaptive(results, stream, cudnn, 256, 1, 1, 512, 7, 7);
    bench_batchnorm(results, stream, cudnn, 4, 56, 56, 256);
    bench_batchnorm_relu<float>(results, stream, 4, 56, 56, 256);
    bench_batchnorm_relu<__nv_bfloat16>(results, stream, 4, 56, 56, 256);
    if (!quick) {
      bench_max_pool(results, stream, cudnn, 64, 224, 224, 64, 2, 2, 0);
      bench_max_pool(results, stream, cudnn, 64, 56, 56, 256, 2, 2, 0);
      bench_max_pool(results, stream, cudnn, 64, 112, 112, 64, 3, 2, 1);
      bench_batchnorm(results, stream, cudnn, 64, 224, 224, 64);
      bench_batchnorm(results, stream, cudnn, 64, 112, 112, 128);
      bench_batchnorm(results, stream, cudnn, 64, 56, 56, 256);
      bench_batchnorm(results, stream, cudnn, 256, 32, 32, 64);
      for (const auto& [n, hw, c] :
           {std::tuple{64, 224, 64}, std::tuple{64, 56, 256}, std::tuple{256, 32, 64}}) {
        bench_batchnorm_relu<float>(results, stream, n, hw, hw, c);
        bench_batchnorm_relu<__nv_bfloat16>(results, stream, n, hw, hw, c);
      }
    }

    std::vector<cudp::bench::Row> rows;
    bool all_valid = true;
    for (const Result& r : results) {
      const double vendor = r.vendor_ms > 0 ? r.bytes / (r.vendor_ms * 1e-3) / 1e9 : 0.0;
      rows.push_back({r.op + (r.valid ? "" : " (INVALID)"), r.shape,
                      r.bytes / (r.ours_ms * 1e-3) / 1e9, vendor, "GB/s", "cuDNN"});
      all_valid &= r.valid;
    }
    std::printf("\n");
    cudp::bench::print_table(rows);
    std::printf("\n| op | shape | ours GB/s | of copy (%.0f GB/s) |\n|---|---|---:|---:|\n",
                copy_gbs);
    for (const auto& r : rows) {
      std::printf("| %s | %s | %.1f | %.0f%% |\n", r.op.c_str(), r.shape.c_str(), r.ours,
                  100 * r.ours / copy_gbs);
    }
    if (!json.empty()) write_json(json, copy_gbs, results);
    return all_valid ? 0 : 1;  // the stream goes with the process
  } catch (const std::exception& e) {
    cudp::bench::print_error("bench_norm_pool", e);
    return cudp::bench::kExitUsage;
  }
}
