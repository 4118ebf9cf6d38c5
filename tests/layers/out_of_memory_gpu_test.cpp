// GPU test of a layer's out-of-memory error: with the GPU filled (tests/common/memory_hog.h), the
// bf16 weight copies a Linear makes at each forward cannot be allocated, and the error names the
// layer, the bytes, the tensor, the device's figures and what to change; the layer is left usable,
// and its next forward gives the output an untouched twin gives. The host twin (out_of_memory_test)
// forces the failures of the CPU path with the allocation fault hook. Runs alone (RUN_SERIAL).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "common/gpu.h"
#include "common/memory_hog.h"
#include "layers/linear.h"

namespace cudp {
namespace {

TEST(LayerOutOfMemoryGpu, LinearsBf16WeightCopyNamesTheLayerAndTheBatchSize) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Device gpu = Device::cuda(0);
  // 8192 x 8192: its bf16 copy of the weight is 128 MiB, far more than the test's input and output.
  Linear failing(8192, 8192, true, 5), twin(8192, 8192, true, 5);
  for (Linear* m : {&failing, &twin}) {
    m->to(gpu);
    m->set_precision(Precision::bf16);
  }
  const Tensor x = Tensor::full({8, 8192}, 0.5f, gpu);
  // The twin's forward, before memory is filled; the copy it keeps stays allocated through it.
  const std::vector<float> expected = twin.forward(x).cpu().to_vector<float>();
  std::string what;
  {
    testing::MemoryHog hog(0, size_t{16} << 20);
    ASSERT_LT(hog.free_bytes(), size_t{128} << 20);
    try {
      failing.forward(x);
      ADD_FAILURE() << "the bf16 copy fitted in " << hog.free_bytes() << " free bytes";
    } catch (const OutOfMemoryError& e) {
      what = e.what();
    }
  }
  for (const std::string part :
       {"CUDA out of memory on cuda:0", "(134217728 bytes)",
        "for Linear(8192, 8192)'s bf16 copy of its weight", "(a tensor [8192, 8192] bf16)",
        "free of", "reduce the batch size (--batch-size)"}) {
    EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
  }
  // With the memory back the same forward goes through, bit for bit the twin's.
  EXPECT_EQ(failing.forward(x).cpu().to_vector<float>(), expected);
}

}  // namespace
}  // namespace cudp
