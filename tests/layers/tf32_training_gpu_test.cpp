// The tf32 precision policy trains (layers/precision.h): K SGD steps of a small conv net on the GPU
// under tf32 (every Conv2d and Linear product, forward, backward-data and backward-weight, on TF32
// tensor cores) against the same steps under fp32 (the SIMT kernels), within TF32's precision;
// and two identical tf32 runs bit for bit (the kernels are deterministic).
//
// The bound. TF32 keeps 10 of fp32's 23 mantissa bits of each operand: rounded to nearest that is
// a relative error of at most 2^-11, truncated (the MMA reading fp32 operands may drop the low 13
// bits) at most 2^-10; we take u = 2^-10. A product a*b then errs by at most 2u relative, and so
// does a sum of such products, to first order, relative to the sum of their magnitudes; the
// kernel tests hold every TF32 product to a relative L2 error of 2u = 2^-9 on random operands
// (tests/kernels/conv2d_tc_gpu_test.cpp, matmul_gpu_test.cpp). Errors of successive products add
// to first order (every layer here is linear in its input, BatchNorm renormalises, so a relative
// error passes on without growing, and softmax and the loss are smooth). The loss depends on the 3
// forward products (2u each: 6u); the first convolution's weight gradient, the longest path, on
// those 3 and on 3 backward products (the Linear's and the second convolution's backward-data, its
// own backward-weight): 12u. SGD's update is linear in the gradients (momentum, weight decay), so
// the change the K steps make to each tensor carries at most that relative error too; fp32's own
// error (~1e-6) is negligible beside it. What the first-order argument leaves out is the feedback
// of one step's weight difference into the next step's gradients, which the loss's curvature scales
// by lr * ||H|| per step, and the cancellation of terms of mixed signs in a reduction, which makes
// 2u * sum |p| larger than 2u * |sum p|. We allow a factor 2 for both over K = 4 steps:
// kBound = 2 * 12u = 24 * 2^-10 ~ 0.023 normwise, for the losses and every tensor's change. A
// wrong or missing term in any of the 8 products moves results by O(1), far beyond it. Measured
// while writing the test, with the CPU path's operands truncated to TF32 in a throwaway build (the
// worst case of the rounding): at most 0.0031 (the BatchNorm weight's change) and 5e-4 on the
// losses.
//
// The net has no ReLU and no max-pool: their decisions are discontinuous, and a TF32 rounding that
// moves a value across zero or across its neighbour in a pooling window changes a whole unit's
// gradient, an O(1) difference that no precision argument bounds (tests/pytorch/golden_gpu_test.cpp
// measures that effect under bf16). The layers' own GPU tests cover ReLU and max-pool.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/sequential.h"
#include "layers/train.h"

namespace cudp {
namespace {

using testing::bitwise_equal;
using testing::random_vector;

constexpr double kUnit = 1.0 / 1024;       // u = 2^-10: TF32's relative error per operand
constexpr double kBound = 2 * 12 * kUnit;  // see the header
constexpr int kSteps = 4;

std::shared_ptr<Module> make_net() {
  // 3 input channels: the first convolution's channels are padded on the tensor cores. It has no
  // bias: BatchNorm removes the mean that a bias adds, so that bias's true gradient is zero and
  // what is computed for it is rounding noise, which no relative bound holds.
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(3, 16, 3, 1, 1, false, 31), std::make_shared<BatchNorm2d>(16),
      std::make_shared<Conv2d>(16, 32, 3, 1, 1, true, 32), std::make_shared<Flatten>(),
      std::make_shared<Linear>(32 * 8 * 8, 10, true, 33)});
}

struct TrainRun {
  TensorMap initial, final;
  std::vector<float> losses;
};

// kSteps SGD steps on the GPU under `precision`, each on its own batch of 16 NHWC 8x8x3 images.
TrainRun train(Precision precision) {
  const Device gpu = Device::cuda(0);
  std::shared_ptr<Module> model = make_net();
  TrainRun run;
  for (const auto& [name, t] : model->state_dict()) run.initial.emplace(name, t.clone());
  model->to(gpu);
  model->set_precision(precision);
  SGD sgd(model->parameters(), SGDOptions{.lr = 0.02, .momentum = 0.9, .weight_decay = 5e-4});
  CrossEntropyLoss criterion;
  for (int step = 0; step < kSteps; ++step) {
    std::mt19937 gen(static_cast<uint32_t>(100 + step));
    std::vector<int32_t> labels(16);
    for (auto& l : labels) l = static_cast<int32_t>(gen() % 10);
    const Tensor images =
        Tensor::from_vector(random_vector(16 * 8 * 8 * 3, 200 + step), {16, 8, 8, 3});
    run.losses.push_back(
        train_step(*model, criterion, sgd, images, Tensor::from_vector(labels, {16})).loss);
  }
  for (const auto& [name, t] : model->state_dict()) run.final.emplace(name, t.cpu());
  return run;
}

// ||a - b|| / ||b||.
double normwise(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) diff += (a[i] - b[i]) * (a[i] - b[i]), ref += b[i] * b[i];
  return std::sqrt(diff / ref);
}

// The change the steps made to tensor `name`, final minus initial, in double.
std::vector<double> change(const TrainRun& run, const std::string& name) {
  const std::vector<float> end = run.final.at(name).to_vector<float>();
  const std::vector<float> start = run.initial.at(name).to_vector<float>();
  std::vector<double> out(end.size());
  for (size_t i = 0; i < end.size(); ++i) out[i] = double(end[i]) - start[i];
  return out;
}

std::vector<float> raw(const Tensor& t) {
  std::vector<float> out((t.nbytes() + 3) / 4, 0.0f);
  std::memcpy(out.data(), t.data_ptr(), t.nbytes());  // i64 counters compared as raw bits
  return out;
}

TEST(Tf32TrainingGpu, StepsMatchFp32WithinTf32PrecisionAndRepeatBitForBit) {
  CUDP_REQUIRE_TENSOR_CORES();
  const TrainRun fp32 = train(Precision::fp32);
  const TrainRun tf32 = train(Precision::tf32);

  for (int step = 0; step < kSteps; ++step) {
    const double error = std::abs(double(tf32.losses[step]) - fp32.losses[step]) /
                         std::abs(double(fp32.losses[step]));
    std::printf("step %d: loss fp32 %.6f, tf32 %.6f, relative difference %.3g (bound %.3g)\n", step,
                fp32.losses[step], tf32.losses[step], error, kBound);
    EXPECT_LE(error, kBound) << "loss of step " << step;
  }
  bool any_differs = false;
  for (const auto& [name, t] : fp32.final) {
    if (t.dtype() != DType::f32) {  // num_batches_tracked
      EXPECT_TRUE(bitwise_equal(raw(tf32.final.at(name)), raw(t))) << name;
      continue;
    }
    const double error = normwise(change(tf32, name), change(fp32, name));
    std::printf("%-16s change's normwise difference %.3g (bound %.3g)\n", name.c_str(), error,
                kBound);
    EXPECT_LE(error, kBound) << "change of " << name << " over " << kSteps << " steps";
    any_differs = any_differs || !bitwise_equal(raw(tf32.final.at(name)), raw(t));
  }
  // Bit-identical to fp32 would mean the products never reached the tensor cores.
  EXPECT_TRUE(any_differs) << "tf32 trained exactly as fp32 did";

  const TrainRun again = train(Precision::tf32);
  EXPECT_TRUE(bitwise_equal(again.losses, tf32.losses)) << "the losses of two identical tf32 runs";
  for (const auto& [name, t] : tf32.final) {
    EXPECT_TRUE(bitwise_equal(raw(again.final.at(name)), raw(t))) << name << " in two tf32 runs";
  }
}

}  // namespace
}  // namespace cudp
