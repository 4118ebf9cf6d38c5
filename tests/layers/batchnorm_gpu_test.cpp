// BatchNorm2d on CUDA against its CPU path (the reference), forward and backward, on random inputs
// of odd sizes: outputs, input gradients, parameter gradients and buffers (layer_testing.h's
// expect_gpu_matches_cpu). Statistics are fp32 reductions on the GPU (double on the CPU), and
// dividing by the standard deviation amplifies their error a little: 1e-4 relative. bf16
// activations against the CPU path in bf16; the fused ReLU against the unfused one bit for bit.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/sequential.h"
#include "tests/layers/batchnorm_testing.h"
#include "tests/layers/layer_testing.h"

namespace cudp {
namespace {

using testing::expect_gpu_matches_cpu;
using testing::random_tensor;
using testing::values;

TEST(BatchNorm2dGpuTest, MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  BatchNorm2d bn(13);
  testing::randomize_parameters(bn, 1);
  auto gpu = expect_gpu_matches_cpu(bn, random_tensor({3, 7, 5, 13}, 2, -2.f, 3.f), 3, 1e-4, 1e-5);
  EXPECT_EQ(std::static_pointer_cast<BatchNorm2d>(gpu)->num_batches_tracked(), 1);
  // Evaluation with the running statistics the training step left.
  bn.eval();
  gpu->eval();
  const Tensor x = random_tensor({2, 3, 3, 13}, 4);
  EXPECT_ALL_CLOSE(values(gpu->forward(x.cuda(0))), values(bn.forward(x)), 1e-5, 1e-5);
  // Backward through frozen statistics.
  expect_gpu_matches_cpu(bn, random_tensor({2, 5, 3, 13}, 5), 6, 1e-5, 1e-5);
  // The count reaches the device buffer without a host synchronisation in forward.
  gpu->train();
  gpu->forward(x.cuda(0));
  EXPECT_EQ(gpu->state_dict().at("num_batches_tracked").to_vector<int64_t>(),
            std::vector<int64_t>{2});
}

// bf16 on the GPU against the bf16 CPU path (the double result rounded once): fp32 buffers and
// parameter gradients with the f32 bounds above; bf16 activations within one bf16 ulp (2^-7
// relative: the GPU rounds an fp32 value within the f32 bounds of the exact one) plus those bounds.
TEST(BatchNorm2dGpuTest, Bf16MatchesTheCpuPath) {
  CUDP_REQUIRE_GPU();
  constexpr double kRtol = 1.0 / 128 + 1e-4;
  BatchNorm2d bn(24);
  testing::randomize_parameters(bn, 31);
  auto gpu = std::static_pointer_cast<BatchNorm2d>(bn.clone(Device::cuda(0)));
  const Tensor x = convert(random_tensor({3, 7, 5, 24}, 32, -2.f, 3.f), DType::bf16);
  const Tensor g = convert(random_tensor(x.shape(), 33), DType::bf16);
  for (const bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "evaluation");
    bn.train(training);
    gpu->train(training);
    bn.zero_grad();
    gpu->zero_grad();
    const Tensor y = gpu->forward(x.cuda(0));
    EXPECT_EQ(y.dtype(), DType::bf16);
    EXPECT_ALL_CLOSE(values(y), values(bn.forward(x)), kRtol, 1e-5);
    EXPECT_ALL_CLOSE(values(gpu->running_mean()), values(bn.running_mean()), 1e-4, 1e-5);
    EXPECT_ALL_CLOSE(values(gpu->running_var()), values(bn.running_var()), 1e-4, 1e-5);
    const Tensor dx = gpu->backward(g.cuda(0));
    EXPECT_EQ(dx.dtype(), DType::bf16);
    EXPECT_ALL_CLOSE(values(dx), values(bn.backward(g)), kRtol, 1e-5);
    EXPECT_ALL_CLOSE(values(gpu->weight().grad), values(bn.weight().grad), 1e-4, 1e-5);
    EXPECT_ALL_CLOSE(values(gpu->bias().grad), values(bn.bias().grad), 1e-4, 1e-5);
  }
  EXPECT_EQ(gpu->state_dict().at("num_batches_tracked").to_vector<int64_t>(),
            std::vector<int64_t>{1});
}

// Sequential(BatchNorm2d, ReLU) on the GPU, fused against unfused, in f32 and bf16: the same bits.
TEST(BatchNorm2dGpuTest, FusedReluIsUnfusedBitForBit) {
  CUDP_REQUIRE_GPU();
  using testing_bn::bitwise_equal;
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto bn = std::make_shared<BatchNorm2d>(64);
    testing::randomize_parameters(*bn, 34, 0.5f, 1.5f);
    Sequential cpu_model({bn, std::make_shared<ReLU>()});
    auto fused = std::static_pointer_cast<Sequential>(cpu_model.clone(Device::cuda(0)));
    auto unfused = std::static_pointer_cast<Sequential>(cpu_model.clone(Device::cuda(0)));
    unfused->set_fusion(false);
    const Tensor x = convert(random_tensor({4, 9, 7, 64}, 35, -2.f, 3.f), dtype).cuda(0);
    const Tensor g = convert(random_tensor(x.shape(), 36), dtype).cuda(0);
    for (const bool training : {true, false}) {
      SCOPED_TRACE(training ? "training" : "evaluation");
      fused->train(training);
      unfused->train(training);
      fused->zero_grad();
      unfused->zero_grad();
      const Tensor y = fused->forward(x);
      EXPECT_EQ(y.dtype(), dtype);
      EXPECT_TRUE((*fused)[0]->relu_fused());
      EXPECT_TRUE(bitwise_equal(y, unfused->forward(x)));
      EXPECT_TRUE(bitwise_equal(fused->backward(g), unfused->backward(g)));
      const auto a = fused->named_parameters(), b = unfused->named_parameters();
      for (size_t i = 0; i < a.size(); ++i)
        EXPECT_TRUE(bitwise_equal(a[i].second->grad, b[i].second->grad)) << a[i].first;
      const auto ba = fused->named_buffers(), bb = unfused->named_buffers();
      for (size_t i = 0; i < ba.size(); ++i) {
        if (ba[i].second->dtype() == DType::f32) {
          EXPECT_TRUE(bitwise_equal(*ba[i].second, *bb[i].second)) << ba[i].first;
        }
      }
    }
  }
}

}  // namespace
}  // namespace cudp
