// GPU tests of softmax cross-entropy, argmax and accuracy counting: against the CPU reference on
// odd and real class counts, against cuDNN's softmax (LOG and ACCURATE modes), bad labels, in-place
// backward, determinism.
#include <cuda_runtime.h>  // before device_buffer.h: cudaMalloc(T**) for DeviceBuffer<T>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "engine/core/vendor_check.h"
#include "kernels/loss.h"

namespace cudp::kernels {
namespace {

using testing::DeviceBuffer;

std::vector<int32_t> random_labels(int n, int classes, uint64_t seed) {
  const std::vector<float> u = testing::random_vector(n, seed, 0.f, 1.f);
  std::vector<int32_t> labels(n);
  for (int i = 0; i < n; ++i) labels[i] = std::min(classes - 1, int(u[i] * classes));
  return labels;
}

struct CeCase {
  int n, classes;
};

const CeCase kCases[] = {{3, 5}, {256, 10}, {64, 1000}, {37, 33}, {1, 1}, {5, 2049}, {2, 32}};

TEST(CrossEntropyGpu, ForwardAndBackwardMatchCpu) {
  CUDP_REQUIRE_GPU();
  for (const CeCase& k : kCases) {
    SCOPED_TRACE(::testing::Message() << k.n << " x " << k.classes);
    const size_t size = size_t(k.n) * k.classes;
    const std::vector<float> logits = testing::random_vector(size, 201 + k.classes, -8.f, 8.f);
    const std::vector<int32_t> labels = random_labels(k.n, k.classes, 202 + k.n);
    float loss_ref = 0;
    std::vector<float> probs_ref(size);
    int bad_ref = 0;
    softmax_cross_entropy_forward_cpu(logits.data(), labels.data(), &loss_ref, probs_ref.data(),
                                      k.n, k.classes, &bad_ref);
    ASSERT_EQ(bad_ref, 0);

    const DeviceBuffer<float> x(logits);
    const DeviceBuffer<int32_t> y(labels);
    DeviceBuffer<float> loss(1), probs(size), dlogits(size);
    DeviceBuffer<int> bad(std::vector<int>{0});
    loss.fill(testing::kPoison);
    probs.fill(testing::kPoison);
    softmax_cross_entropy_forward(x.get(), y.get(), loss.get(), probs.get(), k.n, k.classes,
                                  bad.get(), nullptr);
    // expf is within 2 ulps, (x - max) rounds once at |x - max| <= 16 (~1e-6 relative in its exp),
    // the row sum over <= 2049 terms a few ulps: probabilities agree to ~2e-6 relative.
    EXPECT_ALL_CLOSE(probs.download(), probs_ref, 1e-5, 1e-12);
    EXPECT_ALL_CLOSE(loss.download(), std::vector<float>{loss_ref}, 1e-5, 1e-7);
    EXPECT_EQ(bad.download()[0], 0);

    for (const float scale : {1.f, 0.3f}) {
      SCOPED_TRACE(::testing::Message() << "grad_scale " << scale);
      std::vector<float> dlogits_ref(size);
      softmax_cross_entropy_backward_cpu(probs_ref.data(), labels.data(), dlogits_ref.data(), k.n,
                                         k.classes, scale);
      dlogits.fill(testing::kPoison);
      softmax_cross_entropy_backward(probs.get(), y.get(), dlogits.get(), k.n, k.classes, scale,
                                     nullptr);
      // (p - onehot) * scale / n: where p is within a few ulps of 1, p - 1 keeps p's absolute
      // error of a few ulp(1) = 6e-8 (hence an atol of ~8 ulps), else relative 1e-5 as for p.
      const double atol = 5e-7 * scale / k.n;
      EXPECT_ALL_CLOSE(dlogits.download(), dlogits_ref, 1e-5, atol);
      // In place: dlogits written over probs gives the same values.
      DeviceBuffer<float> in_place(probs.download());
      softmax_cross_entropy_backward(in_place.get(), y.get(), in_place.get(), k.n, k.classes, scale,
                                     nullptr);
      EXPECT_EQ(in_place.download(), dlogits.download());
    }
  }
}

TEST(CrossEntropyGpu, BadLabelsAreFlaggedAndPoisonTheirRows) {
  CUDP_REQUIRE_GPU();
  const int n = 40, classes = 10;
  const std::vector<float> logits = testing::random_vector(n * classes, 211);
  std::vector<int32_t> labels = random_labels(n, classes, 212);
  labels[7] = classes;  // one past the end
  labels[31] = -1;
  const DeviceBuffer<float> x(logits);
  const DeviceBuffer<int32_t> y(labels);
  DeviceBuffer<float> loss(1), probs(n * classes), dlogits(n * classes);
  DeviceBuffer<int> bad(std::vector<int>{0});
  softmax_cross_entropy_forward(x.get(), y.get(), loss.get(), probs.get(), n, classes, bad.get(),
                                nullptr);
  softmax_cross_entropy_backward(probs.get(), y.get(), dlogits.get(), n, classes, 1.f, nullptr);
  EXPECT_EQ(bad.download()[0], 1);
  EXPECT_TRUE(std::isnan(loss.download()[0]));
  const std::vector<float> d = dlogits.download();
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < classes; ++j) {
      EXPECT_EQ(std::isnan(d[i * classes + j]), i == 7 || i == 31) << i << "," << j;
    }
  }
  // Without a flag pointer the kernel still poisons the loss and does not fault.
  softmax_cross_entropy_forward(x.get(), y.get(), loss.get(), probs.get(), n, classes, nullptr,
                                nullptr);
  EXPECT_TRUE(std::isnan(loss.download()[0]));
}

TEST(CrossEntropyGpu, LossIsBitwiseDeterministic) {
  CUDP_REQUIRE_GPU();
  const int n = 256, classes = 1000;
  const DeviceBuffer<float> x(testing::random_vector(n * classes, 221, -5.f, 5.f));
  const DeviceBuffer<int32_t> y(random_labels(n, classes, 222));
  DeviceBuffer<float> loss(2), probs(n * classes);
  softmax_cross_entropy_forward(x.get(), y.get(), loss.get(), probs.get(), n, classes, nullptr,
                                nullptr);
  softmax_cross_entropy_forward(x.get(), y.get(), loss.get() + 1, probs.get(), n, classes, nullptr,
                                nullptr);
  const std::vector<float> l = loss.download();
  EXPECT_EQ(std::memcmp(&l[0], &l[1], sizeof(float)), 0) << l[0] << " vs " << l[1];
}

struct Cudnn {
  cudnnHandle_t handle = nullptr;
  Cudnn() { CUDP_CUDNN_CHECK(cudnnCreate(&handle)); }
  ~Cudnn() { cudnnDestroy(handle); }
};

TEST(CrossEntropyGpu, MatchesCudnnSoftmax) {
  CUDP_REQUIRE_GPU();
  Cudnn cudnn;
  for (const CeCase& k : {CeCase{3, 5}, CeCase{256, 10}, CeCase{64, 1000}}) {
    SCOPED_TRACE(::testing::Message() << k.n << " x " << k.classes);
    const size_t size = size_t(k.n) * k.classes;
    const std::vector<float> logits = testing::random_vector(size, 231 + k.classes, -8.f, 8.f);
    const std::vector<int32_t> labels = random_labels(k.n, k.classes, 232);
    const DeviceBuffer<float> x(logits);
    const DeviceBuffer<int32_t> y(labels);
    DeviceBuffer<float> loss(1), probs(size), log_probs_ref(size), probs_ref(size);
    softmax_cross_entropy_forward(x.get(), y.get(), loss.get(), probs.get(), k.n, k.classes,
                                  nullptr, nullptr);
    cudnnTensorDescriptor_t desc;
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&desc));
    CUDP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, k.n,
                                                k.classes, 1, 1));
    const float one = 1.f, zero = 0.f;
    CUDP_CUDNN_CHECK(cudnnSoftmaxForward(cudnn.handle, CUDNN_SOFTMAX_LOG,
                                         CUDNN_SOFTMAX_MODE_INSTANCE, &one, desc, x.get(), &zero,
                                         desc, log_probs_ref.get()));
    CUDP_CUDNN_CHECK(cudnnSoftmaxForward(cudnn.handle, CUDNN_SOFTMAX_ACCURATE,
                                         CUDNN_SOFTMAX_MODE_INSTANCE, &one, desc, x.get(), &zero,
                                         desc, probs_ref.get()));
    cudnnDestroyTensorDescriptor(desc);
    // The loss is the mean of -log p[label] from cuDNN's log-softmax.
    const std::vector<float> log_probs = log_probs_ref.download();
    double mean = 0;
    for (int i = 0; i < k.n; ++i) mean -= log_probs[size_t(i) * k.classes + labels[i]];
    mean /= k.n;
    // Each side a few ulps from the exact value (see ForwardAndBackwardMatchCpu): twice the bounds.
    EXPECT_ALL_CLOSE(loss.download(), std::vector<double>{mean}, 2e-5, 2e-7);
    EXPECT_ALL_CLOSE(probs.download(), probs_ref.download(), 2e-5, 1e-12);
  }
}

TEST(ArgmaxGpu, MatchesCpuWithTiesAndNaN) {
  CUDP_REQUIRE_GPU();
  for (const CeCase& k : {CeCase{0, 10}, CeCase{3, 5}, CeCase{1000, 10}, CeCase{64, 1000},
                          CeCase{7, 33}, CeCase{5, 1}}) {
    SCOPED_TRACE(::testing::Message() << k.n << " x " << k.classes);
    const size_t size = size_t(k.n) * k.classes;
    // Values in {0, ..., 3}: ties in most rows; a few NaNs.
    std::vector<float> x = testing::random_vector(size, 241 + k.classes, 0.f, 4.f);
    for (float& v : x) v = std::floor(v);
    for (size_t i = 3; i < size; i += 101) x[i] = std::numeric_limits<float>::quiet_NaN();
    std::vector<int32_t> ref(k.n);
    argmax_rows_cpu(x.data(), ref.data(), k.n, k.classes);
    const DeviceBuffer<float> xg(x);
    DeviceBuffer<int32_t> out(std::vector<int32_t>(k.n, -77));
    argmax_rows(xg.get(), out.get(), k.n, k.classes, nullptr);
    EXPECT_EQ(out.download(), ref);
    // Distinct random values too.
    const std::vector<float> z = testing::random_vector(size, 242 + k.classes);
    argmax_rows_cpu(z.data(), ref.data(), k.n, k.classes);
    const DeviceBuffer<float> zg(z);
    argmax_rows(zg.get(), out.get(), k.n, k.classes, nullptr);
    EXPECT_EQ(out.download(), ref);
  }
}

TEST(CountCorrectGpu, MatchesCpu) {
  CUDP_REQUIRE_GPU();
  for (const int n : {0, 1, 1000, 100003}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const std::vector<int32_t> pred = random_labels(n, 10, 251), labels = random_labels(n, 10, 252);
    int ref = -1;
    count_correct_cpu(pred.data(), labels.data(), n, &ref);
    const DeviceBuffer<int32_t> p(pred), l(labels);
    DeviceBuffer<int> count(std::vector<int>{-5});
    count_correct(p.get(), l.get(), n, count.get(), nullptr);
    EXPECT_EQ(count.download()[0], ref);
  }
}

}  // namespace
}  // namespace cudp::kernels
