// Host tests of DataParallel: the constructor's checks and texts (which need no GPU), the
// pass-through without a GPU (PyTorch's behaviour), and the replica registry with no replicas.
#include <gtest/gtest.h>

#include "engine/core/device.h"
#include "engine/parallel/data_parallel.h"
#include "layers/linear.h"

namespace cudp {
namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no exception)";
}

std::shared_ptr<Linear> small_linear() {
  return std::make_shared<Linear>(4, 3, true, 7);
}

TEST(DataParallelChecks, EmptyDeviceList) {
  EXPECT_THROW(DataParallel(small_linear(), std::vector<int>{}), ValueError);
  EXPECT_EQ(error_of([] { DataParallel dp(small_linear(), std::vector<int>{}); }),
            "DataParallel: device_ids is empty; give at least one CUDA device id");
}

TEST(DataParallelChecks, RepeatedDevice) {
  EXPECT_EQ(error_of([] {
              DataParallel dp(small_linear(), {0, 0});
            }),
            "DataParallel: device_ids has device 0 twice (at index 0 and 1); each device holds one "
            "replica");
}

TEST(DataParallelChecks, DeviceOutsideTheVisibleOnes) {
  const int count = cuda::device_count();
  const std::string text = error_of([&] { DataParallel dp(small_linear(), {count + 3}); });
  EXPECT_EQ(text.rfind(
                detail::str("DataParallel: device_ids[0]: invalid device id ", count + 3, ": "), 0),
            0u)
      << text;
}

TEST(DataParallelChecks, NullModuleAndUnsupportedDim) {
  EXPECT_EQ(error_of([] { DataParallel dp(nullptr); }), "DataParallel: the module is null");
  EXPECT_EQ(
      error_of([] { DataParallel dp(small_linear(), {0}, std::nullopt, 1); }),
      "DataParallel: dim 1 is not supported yet: inputs are split along dim 0 (the batch) only");
}

TEST(DataParallelChecks, ModuleOnTheCpuIsRefusedWhenGpusAreUsed) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "needs a GPU to reach the module's device check";
  EXPECT_EQ(
      error_of([] { DataParallel dp(small_linear(), {0}); }),
      "module must have its parameters and buffers on device cuda:0 (device_ids[0]) but found "
      "one of them on device: cpu");
}

TEST(DataParallelPassThrough, WithoutAGpuTheModuleRunsAsItIs) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "the pass-through is for machines without a GPU";
  auto reference = small_linear();
  auto net = small_linear();
  DataParallel dp(net);
  EXPECT_TRUE(dp.device_ids().empty());
  EXPECT_EQ(dp.num_replicas(), 1u);
  EXPECT_EQ(dp.type_name(), "DataParallel");
  const Tensor x =
      Tensor::from_vector(std::vector<float>{1, 2, 3, 4, -1, -2, -3, -4, 0.5f, 0, 0, 1}, {3, 4});
  const Tensor y = dp.forward(x);
  EXPECT_EQ(y.to_vector<float>(), reference->forward(x).to_vector<float>());
  EXPECT_EQ(dp.chunk_sizes(), (std::vector<int64_t>{3}));
  EXPECT_EQ(dp.chunk_weights(), (std::vector<double>{1.0}));
  const Tensor g = Tensor::full({3, 3}, 0.25f);
  const Tensor dx = dp.backward(g);
  EXPECT_EQ(dx.to_vector<float>(), reference->backward(g).to_vector<float>());
  EXPECT_EQ(net->weight().grad.to_vector<float>(), reference->weight().grad.to_vector<float>());
  // PyTorch's names: the wrapped module is the child "module".
  std::vector<std::string> names;
  for (auto& [name, p] : dp.named_parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"module.weight", "module.bias"}));
  EXPECT_EQ(dp.parameters(), net->parameters());
}

TEST(DataParallelPassThrough, CannotBeCloned) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "the pass-through is for machines without a GPU";
  DataParallel dp(small_linear());
  EXPECT_THROW(dp.clone(Device::cpu()), ValueError);
}

TEST(ReplicaParameterLists, ParametersOutsideAnyDataParallelHaveNoReplicas) {
  auto net = small_linear();
  const auto lists = parallel::replica_parameter_lists(*net);
  ASSERT_EQ(lists.size(), 1u);
  EXPECT_EQ(lists[0], net->parameters());
}

TEST(ReplicaParameterLists, APassThroughDataParallelHasOneList) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "the pass-through is for machines without a GPU";
  auto net = small_linear();
  DataParallel dp(net);
  parallel::Replicated<SGD> opt(dp, {.lr = 0.1});
  EXPECT_EQ(opt.size(), 1u);
  EXPECT_EQ(opt.primary().params(), net->parameters());
}

}  // namespace
}  // namespace cudp
