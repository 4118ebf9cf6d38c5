// GPU tests of CrossEntropyLoss, argmax and count_correct: CUDA against the CPU path on random
// inputs of odd sizes, chunk weighting, and bad labels caught through the device flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "common/compare.h"
#include "common/gpu.h"
#include "layers/loss.h"

namespace cudp {
namespace {

using testing::all_close;
using testing::random_vector;

const Device kGpu = Device::cuda(0);

std::vector<int32_t> random_labels(int n, int classes, uint64_t seed) {
  std::vector<int32_t> labels(n);
  const std::vector<float> u = random_vector(n, seed, 0.f, 1.f);
  for (int i = 0; i < n; ++i) labels[i] = std::min(classes - 1, static_cast<int>(u[i] * classes));
  return labels;
}

struct Shape2 {
  int n, classes;
};

class LossGpuSizes : public ::testing::TestWithParam<Shape2> {};

TEST_P(LossGpuSizes, ForwardAndBackwardMatchTheCpu) {
  CUDP_REQUIRE_GPU();
  const auto [n, classes] = GetParam();
  const Tensor logits = Tensor::from_vector(random_vector(n * classes, 7, -4.f, 4.f), {n, classes});
  const Tensor labels = Tensor::from_vector(random_labels(n, classes, 8), {n});
  CrossEntropyLoss cpu, gpu;
  cpu.forward(logits, labels);
  const Tensor loss = gpu.forward(logits.to(kGpu), labels.to(kGpu));
  EXPECT_EQ(loss.device(), kGpu);
  EXPECT_EQ(loss.shape(), Shape{});
  EXPECT_TRUE(all_close({gpu.item()}, std::vector<float>{cpu.item()}, 1e-5, 0));
  EXPECT_TRUE(all_close(gpu.backward(0.5).to_vector<float>(), cpu.backward(0.5).to_vector<float>(),
                        1e-5, 1e-9));
  // Predictions and their count agree too.
  EXPECT_EQ(argmax(logits.to(kGpu)).to_vector<int32_t>(), argmax(logits).to_vector<int32_t>());
  EXPECT_EQ(num_correct(logits.to(kGpu), labels.to(kGpu)), num_correct(logits, labels));
}

INSTANTIATE_TEST_SUITE_P(OddSizes, LossGpuSizes,
                         ::testing::Values(Shape2{1, 1}, Shape2{37, 10}, Shape2{5, 1000},
                                           Shape2{1031, 3}),
                         [](const auto& info) {
                           return detail::str("n", info.param.n, "_c", info.param.classes);
                         });

TEST(LossGpu, ChunkWeightsReproduceTheWholeBatch) {
  CUDP_REQUIRE_GPU();
  const int n = 9, classes = 4;
  const Tensor logits = Tensor::from_vector(random_vector(n * classes, 3), {n, classes}).to(kGpu);
  const Tensor labels = Tensor::from_vector(random_labels(n, classes, 4), {n}).to(kGpu);
  CrossEntropyLoss whole, a, b;
  whole.forward(logits, labels);
  a.forward(logits.slice(0, 5), labels.slice(0, 5), CrossEntropyLoss::chunk_weight(5, n));
  b.forward(logits.slice(5, 9), labels.slice(5, 9), CrossEntropyLoss::chunk_weight(4, n));
  EXPECT_NEAR(a.item() + b.item(), whole.item(), 1e-6);
  std::vector<float> chunked = a.backward().to_vector<float>();
  const std::vector<float> tail = b.backward().to_vector<float>();
  chunked.insert(chunked.end(), tail.begin(), tail.end());
  EXPECT_TRUE(all_close(chunked, whole.backward().to_vector<float>(), 1e-6, 1e-9));
}

TEST(LossGpu, BadLabelIsReportedWhenTheLossIsRead) {
  CUDP_REQUIRE_GPU();
  const Tensor logits = Tensor::from_vector(random_vector(12, 5), {4, 3}).to(kGpu);
  const Tensor labels = Tensor::from_vector<int32_t>({0, 2, 1, 7}, {4}).to(kGpu);
  CrossEntropyLoss criterion;
  const Tensor loss = criterion.forward(logits, labels);  // no synchronisation, no error yet
  EXPECT_TRUE(std::isnan(loss.to_vector<float>()[0]));
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      attempt == 0 ? void(criterion.item()) : criterion.check_labels();
      ADD_FAILURE() << "expected ValueError";
    } catch (const ValueError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("Target 7 is out of bounds"), std::string::npos) << what;
      EXPECT_NE(what.find("index 3"), std::string::npos) << what;
      EXPECT_NE(what.find("3 classes"), std::string::npos) << what;
    }
  }
  // A good batch afterwards starts from a clean flag.
  criterion.forward(logits, Tensor::from_vector<int32_t>({0, 2, 1, 1}, {4}).to(kGpu));
  EXPECT_NO_THROW(criterion.check_labels());
}

TEST(LossGpu, RejectsLabelsOnAnotherDevice) {
  CUDP_REQUIRE_GPU();
  CrossEntropyLoss criterion;
  EXPECT_THROW(
      criterion.forward(Tensor::zeros({2, 3}).to(kGpu), Tensor::from_vector<int32_t>({0, 1}, {2})),
      ValueError);
}

}  // namespace
}  // namespace cudp
