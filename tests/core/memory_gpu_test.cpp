// GPU tests of out-of-memory messages: a device allocation and a pinned host allocation that cannot
// succeed name the device, the bytes, the purpose given by the caller and what to change, and the
// device stays usable afterwards.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>

#include "common/gpu.h"
#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"
#include "kernels/workspace.h"

namespace cudp {
namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const OutOfMemoryError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected OutOfMemoryError";
  return {};
}

void expect_contains(const std::string& what, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
  }
}

TEST(OutOfMemoryGpu, ADeviceAllocationFailureNamesDeviceBytesPurposeAndAdvice) {
  CUDP_REQUIRE_GPU();
  // 2^50 bytes (1 PiB): more than any GPU holds.
  const std::string what = message_of([] {
    cuda::AllocationPurpose purpose("the test's activations", "Reduce the test's batch size.");
    Tensor::empty({int64_t{1} << 48}, DType::f32, Device::cuda(0));
  });
  expect_contains(what, {"CUDA out of memory on cuda:0", "1125899906842624 bytes",
                         "for the test's activations", "(a tensor [281474976710656] f32)",
                         "free of", "Reduce the test's batch size."});
  // The failure left no error behind: the device still allocates and computes.
  Tensor t = Tensor::full({1000}, 2.0f, Device::cuda(0));
  EXPECT_EQ(t.cpu().to_vector<float>()[999], 2.0f);
}

TEST(OutOfMemoryGpu, APinnedAllocationFailureNamesBytesPurposeAndAdvice) {
  CUDP_REQUIRE_GPU();
  const std::string what = message_of(
      [] { Tensor::empty({int64_t{1} << 50}, DType::u8, Device::cpu(), /*pinned=*/true); });
  expect_contains(what, {"out of pinned (page-locked) host memory", "1125899906842624 bytes",
                         "(a tensor [1125899906842624] u8)", "pin_memory"});
  Tensor t = Tensor::full({10}, 1.0f).pin_memory();
  EXPECT_TRUE(t.is_pinned());
}

// A kernel's workspace (kernels/workspace.h) that cannot be had names itself, its bytes and the
// device inside the purpose of whoever launched the kernel; the device stays usable.
TEST(OutOfMemoryGpu, AKernelWorkspaceFailureNamesItselfTheBytesAndThePurpose) {
  CUDP_REQUIRE_GPU();
  const cudaStream_t stream = cuda::current_stream(0);
  const std::string what = message_of([&] {
    cuda::AllocationPurpose purpose("the test's step", "Use a smaller test batch.");
    kernels::Workspace ws(size_t{1} << 50, stream, "the test's partial sums");
  });
  expect_contains(what, {"CUDA out of memory on cuda:0", "1125899906842624 bytes",
                         "for the test's step (the test's partial sums)", "free of",
                         "Use a smaller test batch."});
  const std::string plain =
      message_of([&] { kernels::Workspace ws(size_t{1} << 50, stream); });
  expect_contains(plain, {"(a kernel's workspace)", "Reduce the batch size (--batch-size)"});
  kernels::Workspace fine(1 << 20, stream);
  EXPECT_NE(fine.get(), nullptr);
}

}  // namespace
}  // namespace cudp
