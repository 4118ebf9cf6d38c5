// Host tests of the layers' out-of-memory errors: an allocation a layer or an optimizer makes, made
// to fail on the CPU path by the allocation fault hook (engine/core/memory.h), says what it was
// for, its bytes, the tensor and what to change; and the failure leaves the owner as it was, so
// that the same call succeeds once memory is back. The hook picks the allocation by its size, not
// by its purpose, so a purpose that is missing or wrong fails these tests. The GPU twin
// (out_of_memory_gpu_test) makes a device allocation fail by filling the GPU.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "engine/core/memory.h"
#include "layers/batchnorm.h"
#include "layers/linear.h"
#include "layers/optim.h"

namespace cudp {
namespace {

// Host allocations of exactly this many bytes fail while a FailAllocationsOf lives.
size_t g_failing_bytes = 0;
int g_refused = 0;

bool refuse_matching(size_t bytes, int device) {
  if (device != -1 || bytes != g_failing_bytes) return false;
  ++g_refused;
  return true;
}

class FailAllocationsOf {
 public:
  explicit FailAllocationsOf(size_t bytes) {
    g_failing_bytes = bytes;
    g_refused = 0;
    detail::set_allocation_fault_hook(refuse_matching);
  }
  ~FailAllocationsOf() { detail::set_allocation_fault_hook(nullptr); }
  FailAllocationsOf(const FailAllocationsOf&) = delete;
  FailAllocationsOf& operator=(const FailAllocationsOf&) = delete;
};

// The message of the OutOfMemoryError `f` throws; a failure of the test when it throws nothing.
template <typename F>
std::string oom_message(F&& f) {
  try {
    f();
  } catch (const OutOfMemoryError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no OutOfMemoryError";
  return {};
}

void expect_contains(const std::string& what, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
  }
}

// NHWC [2, 4, 4, 3], never zero.
Tensor bn_input() {
  std::vector<float> v(2 * 4 * 4 * 3);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.25f + 0.5f * static_cast<float>(i % 7);
  return Tensor::from_vector(v, {2, 4, 4, 3});
}

TEST(LayerOutOfMemory, BatchNormsSavedStatisticsNameTheLayerAndTheBatchSize) {
  BatchNorm2d bn(3);  // 3 channels: the saved mean and inverse deviation are 12 bytes each
  const Tensor x = bn_input();
  std::string what;
  {
    FailAllocationsOf fail(3 * sizeof(float));
    what = oom_message([&] { bn.forward(x); });
    EXPECT_EQ(g_refused, 1);
  }
  expect_contains(what, {"out of host memory", "(12 bytes)",
                         "for BatchNorm2d(3)'s saved batch mean and inverse deviation",
                         "(a tensor [3] f32)", "reduce the batch size (--batch-size)"});
  // Nothing was updated: the running statistics and the batch count are as constructed.
  EXPECT_EQ(bn.running_mean().to_vector<float>(), std::vector<float>(3, 0.0f));
  EXPECT_EQ(bn.running_var().to_vector<float>(), std::vector<float>(3, 1.0f));
  EXPECT_EQ(bn.num_batches_tracked(), 0);
  // With memory back, the same forward goes through and counts one batch.
  EXPECT_EQ(bn.forward(x).shape(), x.shape());
  EXPECT_EQ(bn.num_batches_tracked(), 1);
}

TEST(LayerOutOfMemory, BatchNormsParametersAndRunningStatisticsNameTheLayer) {
  std::string what;
  {
    FailAllocationsOf fail(5 * sizeof(float));
    what = oom_message([] { BatchNorm2d bn(5); });
  }
  expect_contains(what, {"out of host memory", "(20 bytes)",
                         "for BatchNorm2d(5)'s weight, bias and running statistics",
                         "(a tensor [5] f32)", "Use a smaller model or free memory"});
}

// The optimizer's state is created at the first step. When it cannot be, the step fails before it
// changes anything and the next step creates it: the parameters end as those of an optimizer whose
// first step never failed.
TEST(LayerOutOfMemory, OptimizerStateNamesTheOptimizerAndALaterStepRecovers) {
  // Linear(5, 7): a weight of 35 floats (140 bytes), which nothing else in the step allocates.
  Linear failing(5, 7, true, 11), reference(5, 7, true, 11);
  for (Linear* m : {&failing, &reference}) {
    for (Parameter* p : m->parameters()) {
      std::vector<float> g(static_cast<size_t>(p->grad.numel()));
      for (size_t i = 0; i < g.size(); ++i) g[i] = 0.125f * static_cast<float>(i % 5) - 0.25f;
      p->grad.copy_from(Tensor::from_vector(g, p->grad.shape()));
    }
  }
  const SGDOptions options{.lr = 0.1, .momentum = 0.9};
  SGD sgd(failing.parameters(), options), sgd_ref(reference.parameters(), options);
  const std::vector<float> before = failing.weight().data.to_vector<float>();
  std::string what;
  {
    FailAllocationsOf fail(35 * sizeof(float));
    what = oom_message([&] { sgd.step(); });
    EXPECT_EQ(g_refused, 1);
  }
  expect_contains(what, {"out of host memory", "(140 bytes)",
                         "for SGD's momentum_buffer (1 fp32 copy of the parameters)",
                         "(a tensor [7, 5] f32)", "SGD without momentum"});
  EXPECT_EQ(failing.weight().data.to_vector<float>(), before);
  EXPECT_EQ(sgd.steps(), 0);
  for (int step = 0; step < 2; ++step) {
    sgd.step();
    sgd_ref.step();
  }
  EXPECT_EQ(sgd.steps(), 2);
  EXPECT_EQ(failing.weight().data.to_vector<float>(), reference.weight().data.to_vector<float>());
  EXPECT_EQ(failing.bias().data.to_vector<float>(), reference.bias().data.to_vector<float>());
  EXPECT_NE(failing.weight().data.to_vector<float>(), before);
}

}  // namespace
}  // namespace cudp
