// SyncBatchNorm2d on GPUs. The kernels' split passes with one participant are the single-device
// pass bit for bit; three participants on one GPU (each its rows, the summaries' slots in one
// buffer, the backward sums added on the host in participant order) equal BatchNorm2d over the
// whole batch on the CPU (double) within the bounds of sync_batchnorm_testing.h with f32
// arithmetic. Through DataParallel: on one GPU a converted model is the BatchNorm2d model bit for
// bit; on two GPUs (uneven chunks) it equals the whole batch's BatchNorm2d within those bounds,
// with replicas identical, and a batch smaller than the devices is refused. Skips without a GPU.
#include <gtest/gtest.h>

#include "common/gpu.h"
#include "common/tensor_bytes.h"
#include "engine/core/stream.h"
#include "engine/parallel/data_parallel.h"
#include "kernels/batchnorm.h"
#include "layers/batchnorm.h"
#include "layers/sync_batchnorm.h"
#include "tests/layers/layer_testing.h"
#include "tests/layers/sync_batchnorm_testing.h"

namespace cudp {
namespace {

using testing::BnStep;
using testing::random_tensor;
using testing::values;

constexpr int kC = 8;  // a multiple of 4 and 8: the kernels' vector path
constexpr float kEps = 1e-5f, kMomentum = 0.1f;

Tensor batch(int64_t n, uint64_t seed) {
  std::vector<float> v = values(random_tensor({n, 3, 2, kC}, seed, -1.7f, 1.7f));
  for (size_t i = 0; i < v.size(); ++i) v[i] += 3.0f + 10.0f * float(i % kC);
  return Tensor::from_vector(v, {n, 3, 2, kC});
}

std::vector<unsigned char> bytes(const Tensor& t) {
  return testing::bytes_of({{"t", t}}).at("t");
}

BnStep cpu_truth(BatchNorm2d& bn, const Tensor& x, const Tensor& dy) {
  bn.zero_grad();
  BnStep s;
  s.y = values(bn.forward(x));
  s.dx = values(bn.backward(dy));
  s.dgamma = values(bn.weight().grad);
  s.dbeta = values(bn.bias().grad);
  s.running_mean = values(bn.running_mean());
  s.running_var = values(bn.running_var());
  return s;
}

// The split passes are the multi-pass kernels cut where the participants exchange their sums, so
// one participant gets the multi-pass kernels' bits (the one-launch cluster kernels, which the
// single-device pass takes for a layer this small when they are switched on, merge in another
// order).
struct MultiPassOnly {
  MultiPassOnly() { kernels::detail::set_batchnorm_cluster(false); }
  ~MultiPassOnly() { kernels::detail::set_batchnorm_cluster(was_on); }
  const bool was_on = kernels::detail::batchnorm_cluster();
};

TEST(SyncBatchNormKernelsGpu, OneParticipantIsTheSingleDevicePassBitForBit) {
  CUDP_REQUIRE_GPU();
  const MultiPassOnly multi_pass;
  const Device d = Device::cuda(0);
  cuda::DeviceGuard guard(0);
  const cudaStream_t s = stream_for(d);
  const Tensor x = batch(5, 1).to(d), dy = random_tensor(x.shape(), 2).to(d);
  const int64_t rows = x.numel() / kC;
  const Tensor gamma = random_tensor({kC}, 3, 0.5f, 1.5f).to(d),
               beta = random_tensor({kC}, 4).to(d);
  auto vec = [&](float v) { return Tensor::full({kC}, v, d); };
  Tensor rm1 = vec(0.5f), rv1 = vec(2.f), sm1 = vec(0), si1 = vec(0), dg1 = vec(0), db1 = vec(0);
  Tensor rm2 = vec(0.5f), rv2 = vec(2.f), sm2 = vec(0), si2 = vec(0), dg2 = vec(0), db2 = vec(0);
  Tensor y1 = Tensor::empty(x.shape(), DType::f32, d), y2 = Tensor::empty(x.shape(), DType::f32, d);
  Tensor dx1 = Tensor::empty(x.shape(), DType::f32, d),
         dx2 = Tensor::empty(x.shape(), DType::f32, d);
  kernels::batchnorm_forward_train(x.data<float>(), y1.data<float>(), gamma.data<float>(),
                                   beta.data<float>(), rm1.data<float>(), rv1.data<float>(),
                                   sm1.data<float>(), si1.data<float>(), rows, kC, kMomentum, kEps,
                                   kernels::BnActivation::none, s);
  kernels::batchnorm_backward(x.data<float>(), dy.data<float>(), nullptr, gamma.data<float>(),
                              sm1.data<float>(), si1.data<float>(), dx1.data<float>(),
                              dg1.data<float>(), db1.data<float>(), rows, kC, 1.0f, s);
  Tensor summary = Tensor::zeros({kernels::batchnorm_summary_size(kC)}, DType::f32, d);
  Tensor coef = Tensor::empty({4 * kC}, DType::f32, d),
         sums = Tensor::empty({2 * kC + 1}, DType::f32, d);
  kernels::batchnorm_local_stats(x.data<float>(), rows, kC, summary.data<float>(), s);
  kernels::batchnorm_merge_stats(summary.data<float>(), 1, kC, gamma.data<float>(),
                                 beta.data<float>(), rm2.data<float>(), rv2.data<float>(),
                                 sm2.data<float>(), si2.data<float>(), kMomentum, kEps,
                                 coef.data<float>(), s);
  kernels::batchnorm_apply(x.data<float>(), y2.data<float>(), coef.data<float>(), rows, kC,
                           kernels::BnActivation::none, s);
  kernels::batchnorm_backward_local(x.data<float>(), dy.data<float>(), nullptr, sm2.data<float>(),
                                    si2.data<float>(), rows, kC, sums.data<float>(),
                                    dg2.data<float>(), db2.data<float>(), 1.0f, s);
  kernels::batchnorm_backward_global(x.data<float>(), dy.data<float>(), nullptr,
                                     gamma.data<float>(), sm2.data<float>(), si2.data<float>(),
                                     sums.data<float>(), dx2.data<float>(), rows, kC, s);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(bytes(y2), bytes(y1));
  EXPECT_EQ(bytes(rm2), bytes(rm1));
  EXPECT_EQ(bytes(rv2), bytes(rv1));
  EXPECT_EQ(bytes(sm2), bytes(sm1));
  EXPECT_EQ(bytes(si2), bytes(si1));
  EXPECT_EQ(bytes(dx2), bytes(dx1));
  EXPECT_EQ(bytes(dg2), bytes(dg1));
  EXPECT_EQ(bytes(db2), bytes(db1));
}

TEST(SyncBatchNormKernelsGpu, ThreeParticipantsOnOneGpuEqualTheWholeBatch) {
  CUDP_REQUIRE_GPU();
  const Device d = Device::cuda(0);
  cuda::DeviceGuard guard(0);
  const cudaStream_t s = stream_for(d);
  BatchNorm2d bn(kC, kEps, kMomentum);
  testing::randomize_parameters(bn, 5, 0.5f, 1.5f);
  const Tensor gamma = bn.weight().data.to(d), beta = bn.bias().data.to(d);
  const Tensor x_host = batch(6, 6), dy_host = random_tensor(x_host.shape(), 7);
  const BnStep truth = cpu_truth(bn, x_host, dy_host);
  const Tensor x = x_host.to(d), dy = dy_host.to(d);
  const std::vector<int64_t> bounds = {0, 6, 18, 36};  // rows of each participant (1, 2, 3 images)
  const int parts = 3;
  const int64_t size = kernels::batchnorm_summary_size(kC);
  Tensor summaries = Tensor::zeros({parts * size}, DType::f32, d);
  for (int p = 0; p < parts; ++p) {
    kernels::batchnorm_local_stats(x.data<float>() + bounds[p] * kC, bounds[p + 1] - bounds[p], kC,
                                   summaries.data<float>() + p * size, s);
  }
  // Each participant merges the same slots into its own statistics.
  std::vector<Tensor> rm, rv, sm, si;
  Tensor y = Tensor::empty(x.shape(), DType::f32, d), dx = Tensor::empty(x.shape(), DType::f32, d);
  std::vector<Tensor> sums, dg, db;
  for (int p = 0; p < parts; ++p) {
    rm.push_back(Tensor::zeros({kC}, DType::f32, d));
    rv.push_back(Tensor::full({kC}, 1.f, d));
    sm.push_back(Tensor::empty({kC}, DType::f32, d));
    si.push_back(Tensor::empty({kC}, DType::f32, d));
    Tensor coef = Tensor::empty({4 * kC}, DType::f32, d);
    kernels::batchnorm_merge_stats(summaries.data<float>(), parts, kC, gamma.data<float>(),
                                   beta.data<float>(), rm[p].data<float>(), rv[p].data<float>(),
                                   sm[p].data<float>(), si[p].data<float>(), kMomentum, kEps,
                                   coef.data<float>(), s);
    const int64_t r0 = bounds[p], n = bounds[p + 1] - bounds[p];
    kernels::batchnorm_apply(x.data<float>() + r0 * kC, y.data<float>() + r0 * kC,
                             coef.data<float>(), n, kC, kernels::BnActivation::none, s);
    sums.push_back(Tensor::empty({2 * kC + 1}, DType::f32, d));
    dg.push_back(Tensor::zeros({kC}, DType::f32, d));
    db.push_back(Tensor::zeros({kC}, DType::f32, d));
    kernels::batchnorm_backward_local(x.data<float>() + r0 * kC, dy.data<float>() + r0 * kC,
                                      nullptr, sm[p].data<float>(), si[p].data<float>(), n, kC,
                                      sums[p].data<float>(), dg[p].data<float>(),
                                      db[p].data<float>(), 1.0f, s);
    CUDP_CUDA_CHECK(cudaStreamSynchronize(s));  // coef is freed at the end of this iteration
  }
  // The group's sum, in participant order.
  std::vector<float> total = values(sums[0]);
  for (int p = 1; p < parts; ++p) {
    const std::vector<float> v = values(sums[p]);
    for (size_t i = 0; i < total.size(); ++i) total[i] += v[i];
  }
  const Tensor summed = Tensor::from_vector(total, {2 * kC + 1}).to(d);
  for (int p = 0; p < parts; ++p) {
    const int64_t r0 = bounds[p], n = bounds[p + 1] - bounds[p];
    kernels::batchnorm_backward_global(x.data<float>() + r0 * kC, dy.data<float>() + r0 * kC,
                                       nullptr, gamma.data<float>(), sm[p].data<float>(),
                                       si[p].data<float>(), summed.data<float>(),
                                       dx.data<float>() + r0 * kC, n, kC, s);
  }
  CUDP_CUDA_CHECK(cudaStreamSynchronize(s));
  for (int p = 1; p < parts; ++p) {  // every participant's statistics are the same bits
    EXPECT_EQ(bytes(rm[p]), bytes(rm[0]));
    EXPECT_EQ(bytes(rv[p]), bytes(rv[0]));
    EXPECT_EQ(bytes(sm[p]), bytes(sm[0]));
    EXPECT_EQ(bytes(si[p]), bytes(si[0]));
  }
  BnStep got;
  got.y = values(y);
  got.dx = values(dx);
  got.dgamma.assign(kC, 0.f);
  got.dbeta.assign(kC, 0.f);
  std::vector<double> dgs(kC, 0.0), dbs(kC, 0.0);
  for (int p = 0; p < parts; ++p) {
    const auto g = values(dg[p]), b = values(db[p]);
    for (int c = 0; c < kC; ++c) dgs[c] += g[c], dbs[c] += b[c];
  }
  got.dgamma.assign(dgs.begin(), dgs.end());
  got.dbeta.assign(dbs.begin(), dbs.end());
  got.running_mean = values(rm[0]);
  got.running_var = values(rv[0]);
  const auto tol =
      testing::sync_bn_tolerance(values(x_host), values(dy_host), values(bn.weight().data), kC,
                                 kEps, kMomentum, parts, truth, /*f32_arithmetic=*/true);
  testing::expect_within(got.y, truth.y, tol.y, "y");
  testing::expect_within(got.dx, truth.dx, tol.dx, "dx");
  testing::expect_within(got.dgamma, truth.dgamma, tol.dgamma, "dgamma");
  testing::expect_within(got.dbeta, truth.dbeta, tol.dbeta, "dbeta");
  testing::expect_within(got.running_mean, truth.running_mean, tol.running_mean, "running_mean");
  testing::expect_within(got.running_var, truth.running_var, tol.running_var, "running_var");
}

// A model's step through DataParallel on `ids`, the input and gradient on ids[0] (so the input
// gradient comes back gathered), the summed gradients read from the module (replica 0).
BnStep data_parallel_step(parallel::DataParallel& dp, BatchNorm2d& module, const Tensor& x,
                          const Tensor& dy, int device) {
  module.zero_grad();
  for (size_t r = 1; r < dp.num_replicas(); ++r) dp.replica(r)->zero_grad();
  BnStep s;
  s.y = values(dp.forward(x.to(Device::cuda(device))));
  s.dx = values(dp.backward(dy.to(Device::cuda(device))));
  s.dgamma = values(module.weight().grad);
  s.dbeta = values(module.bias().grad);
  s.running_mean = values(module.running_mean());
  s.running_var = values(module.running_var());
  return s;
}

TEST(SyncBatchNorm2dGpu, OneGpuInDataParallelIsBatchNormBitForBit) {
  CUDP_REQUIRE_GPU();
  auto bn = std::make_shared<BatchNorm2d>(kC, kEps, kMomentum);
  testing::randomize_parameters(*bn, 8, 0.5f, 1.5f);
  bn->cuda(0);
  auto sync = convert_sync_batchnorm(std::static_pointer_cast<Module>(bn->clone(Device::cuda(0))));
  ASSERT_EQ(sync->type_name(), "SyncBatchNorm");
  parallel::DataParallel dp(sync, {0});
  for (uint64_t step = 0; step < 2; ++step) {
    const Tensor x = batch(5, 10 + step), dy = random_tensor(x.shape(), 20 + step);
    bn->zero_grad();
    const Tensor y = bn->forward(x.to(Device::cuda(0)));
    const Tensor dx = bn->backward(dy.to(Device::cuda(0)));
    auto& s = static_cast<BatchNorm2d&>(*sync);
    s.zero_grad();
    EXPECT_EQ(bytes(dp.forward(x.to(Device::cuda(0)))), bytes(y));
    EXPECT_EQ(bytes(dp.backward(dy.to(Device::cuda(0)))), bytes(dx));
    EXPECT_EQ(bytes(s.weight().grad), bytes(bn->weight().grad));
    EXPECT_EQ(bytes(s.bias().grad), bytes(bn->bias().grad));
    EXPECT_EQ(bytes(s.running_mean()), bytes(bn->running_mean()));
    EXPECT_EQ(bytes(s.running_var()), bytes(bn->running_var()));
  }
}

TEST(SyncBatchNorm2dGpu, TwoGpusEqualBatchNormOverTheWholeBatch) {
  CUDP_REQUIRE_GPUS(2);
  BatchNorm2d truth_bn(kC, kEps, kMomentum);
  testing::randomize_parameters(truth_bn, 9, 0.5f, 1.5f);
  auto sync = convert_sync_batchnorm(truth_bn.clone(Device::cuda(0)));
  auto& module = static_cast<BatchNorm2d&>(*sync);
  parallel::DataParallel dp(sync, {0, 1});
  for (uint64_t step = 0; step < 2; ++step) {
    const Tensor x = batch(7, 30 + step), dy = random_tensor(x.shape(), 40 + step);  // 4 + 3
    const std::vector<float> gamma = values(truth_bn.weight().data);
    const BnStep truth = cpu_truth(truth_bn, x, dy);
    const BnStep got = data_parallel_step(dp, module, x, dy, 0);
    EXPECT_EQ(dp.chunk_sizes(), (std::vector<int64_t>{4, 3}));
    const auto tol = testing::sync_bn_tolerance(values(x), values(dy), gamma, kC, kEps, kMomentum,
                                                2, truth, /*f32_arithmetic=*/true);
    testing::expect_within(got.y, truth.y, tol.y, "y");
    testing::expect_within(got.dx, truth.dx, tol.dx, "dx");
    testing::expect_within(got.dgamma, truth.dgamma, tol.dgamma, "dgamma");
    testing::expect_within(got.dbeta, truth.dbeta, tol.dbeta, "dbeta");
    const double again = step > 0 ? 2 : 1;  // the second update carries the first one's error
    testing::expect_within(got.running_mean, truth.running_mean, again * tol.running_mean,
                           "running_mean");
    testing::expect_within(got.running_var, truth.running_var, again * tol.running_var,
                           "running_var");
    EXPECT_NO_THROW(dp.check_replicas_identical());
  }
  EXPECT_THROW_WITH(dp.forward(batch(1, 50).to(Device::cuda(0))), "reaches only 1 of the 2");
}

}  // namespace
}  // namespace cudp
