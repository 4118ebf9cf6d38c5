// Host tests of size arithmetic and out-of-memory messages: shapes whose element or byte counts
// overflow are errors, never wrapped sizes; a failed host allocation names what it was for, the
// bytes and what to change (the GPU twin, memory_gpu_test, does the same for device and pinned
// memory).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/core/checked.h"
#include "engine/core/memory.h"
#include "engine/core/tensor.h"

namespace cudp {
namespace {

// Succeeds when `f()` throws E whose message holds every one of `parts`.
template <typename E, typename F>
::testing::AssertionResult throws_with(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const E& e) {
    for (const std::string& part : parts) {
      if (std::string(e.what()).find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << part << "\": " << e.what();
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

TEST(CheckedSizes, ProductsAndSumsThatOverflowThrow) {
  EXPECT_EQ(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "x"), int64_t{1} << 62);
  EXPECT_EQ(checked_add(INT64_MAX - 1, 1, "x"), INT64_MAX);
  EXPECT_TRUE(throws_with<ValueError>([] { checked_mul(int64_t{1} << 32, int64_t{1} << 31, "rows"); },
                                      {"rows", "4294967296 x 2147483648", "overflows"}));
  EXPECT_TRUE(throws_with<ValueError>([] { checked_add(INT64_MAX, 1, "bytes"); }, {"bytes", "overflows"}));
  EXPECT_TRUE(throws_with<ValueError>([] { checked_mul(-1, 2, "n"); }, {"n", "negative"}));
}

TEST(CheckedSizes, ShapesThatOverflowAreErrors) {
  const Shape wraps = {int64_t{1} << 32, int64_t{1} << 32};  // 2^64 elements: 0 if wrapped
  EXPECT_TRUE(throws_with<ValueError>([&] { shape_numel(wraps); },
                                      {"[4294967296, 4294967296]", "64-bit"}));
  EXPECT_TRUE(throws_with<ValueError>([&] { Tensor::empty(wraps); }, {"64-bit"}));
  // 2^62 elements fit, but not 2^62 x 4 bytes.
  EXPECT_TRUE(throws_with<ValueError>([] { Tensor::empty({int64_t{1} << 62}); },
                                      {"f32", "needs more bytes than 64-bit"}));
  EXPECT_TRUE(throws_with<ValueError>([] { shape_numel({3, -1}); }, {"negative", "[3, -1]"}));
  const Tensor t = Tensor::zeros({4});
  EXPECT_THROW(t.view({int64_t{1} << 32, int64_t{1} << 32, -1}), ValueError);
  EXPECT_EQ(shape_nbytes({3, 5}, DType::i64), 120u);
}

// ASan's allocator aborts on an absurd request unless told to return null.
bool allocator_aborts_on_huge_requests() {
#if defined(__SANITIZE_ADDRESS__)
  constexpr bool asan = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  constexpr bool asan = true;
#else
  constexpr bool asan = false;
#endif
#else
  constexpr bool asan = false;
#endif
  const char* options = std::getenv("ASAN_OPTIONS");
  return asan && !(options && std::strstr(options, "allocator_may_return_null=1"));
}

TEST(OutOfMemory, AHostAllocationFailureSaysWhatItWasForAndWhatToChange) {
  if (allocator_aborts_on_huge_requests()) {
    GTEST_SKIP() << "under AddressSanitizer without ASAN_OPTIONS=allocator_may_return_null=1";
  }
  // 2^61 bytes: more than any machine's address space, so the allocation fails for certain.
  const Shape shape = {int64_t{1} << 30, int64_t{1} << 29};
  cuda::AllocationPurpose outer("the test's buffers");
  cuda::AllocationPurpose inner("batch buffer 3", "Reduce the test's batch size.");
  EXPECT_TRUE(throws_with<OutOfMemoryError>(
      [&] { Tensor::empty(shape, DType::f32); },
      {"out of host memory", "2305843009213693952 bytes", "for the test's buffers: batch buffer 3",
       "(a tensor [1073741824, 536870912] f32)", "Reduce the test's batch size."}));
}

TEST(OutOfMemory, WithoutAPurposeTheTensorAndGeneralAdviceAreNamed) {
  if (allocator_aborts_on_huge_requests()) {
    GTEST_SKIP() << "under AddressSanitizer without ASAN_OPTIONS=allocator_may_return_null=1";
  }
  EXPECT_TRUE(throws_with<OutOfMemoryError>(
      [] { Tensor::empty({int64_t{1} << 59}, DType::u8); },
      {"(a tensor [576460752303423488] u8)", "Reduce the batch size (--batch-size)"}));
  EXPECT_TRUE(cuda::AllocationPurpose::current_what().empty());
}

TEST(OutOfMemory, AFailedCudaAllocationCallNamesThePurposeAndTheAdvice) {
  // What a kernel's workspace allocation (CUDP_CUDA_CHECK(cudaMallocAsync(...))) throws.
  cuda::AllocationPurpose purpose("conv2d's split-K workspace", "Use a smaller batch.");
  EXPECT_TRUE(throws_with<OutOfMemoryError>(
      [] { detail::throw_cuda(cudaErrorMemoryAllocation, "cudaMallocAsync(&p, n, s)", "x.cu", 1); },
      {"cudaMallocAsync(&p, n, s) failed: cudaErrorMemoryAllocation",
       "for conv2d's split-K workspace", "Use a smaller batch."}));
}

// What a kernel's Workspace calls with cudaMallocAsync's status (kernels/workspace.h): out of
// memory names the bytes, the workspace and the purpose its caller set; another failure stays a
// CudaError naming the call; success passes.
TEST(OutOfMemory, AFailedWorkspaceAllocationNamesItsBytesWhatAndPurpose) {
  EXPECT_NO_THROW(cuda::check_allocation(cudaSuccess, 1 << 20, "x", "cudaMallocAsync"));
  cuda::AllocationPurpose purpose("replica 1's backward on cuda:1", "Use a smaller batch.");
  EXPECT_TRUE(throws_with<OutOfMemoryError>(
      [] {
        cuda::check_allocation(cudaErrorMemoryAllocation, 3 << 20, "the GEMM's split-K partials",
                               "cudaMallocAsync");
      },
      {"CUDA out of memory", "3.00 MiB (3145728 bytes)",
       "for replica 1's backward on cuda:1 (the GEMM's split-K partials)",
       "Use a smaller batch."}));
  try {
    cuda::check_allocation(cudaErrorInvalidValue, 8, "x", "cudaMallocAsync(&p, 8, s)");
    ADD_FAILURE() << "no exception";
  } catch (const OutOfMemoryError& e) {
    ADD_FAILURE() << "an invalid value is not out of memory: " << e.what();
  } catch (const CudaError& e) {
    EXPECT_EQ(e.code(), cudaErrorInvalidValue);
    EXPECT_NE(std::string(e.what()).find("cudaMallocAsync(&p, 8, s) failed"), std::string::npos)
        << e.what();
  }
}

// What a CUDA graph's instantiation or launch that finds no memory throws (engine/core/graph.cpp):
// the call does not say how many bytes it wanted, so the message names the call instead of a size.
TEST(OutOfMemory, AFailureOfUnknownSizeNamesTheCallInsteadOfBytes) {
  cuda::AllocationPurpose purpose("the CUDA graph of the training step", "Use --graphs off.");
  EXPECT_TRUE(throws_with<OutOfMemoryError>(
      [] {
        cuda::check_allocation(cudaErrorMemoryAllocation, 0, "its allocation nodes",
                               "cudaGraphLaunch");
      },
      // With a GPU the message names the device ("CUDA out of memory on cuda:0: ..."), without
      // one it cannot: only what follows is the same.
      {"CUDA out of memory",
       "cudaGraphLaunch could not allocate device memory for the CUDA graph "
       "of the training step (its allocation nodes)",
       "Use --graphs off."}));
}

bool refuse_everything(size_t, int) {
  return true;
}

// The test hook (memory.h) fails host allocations as the system would, with the same error, and is
// inert once cleared.
TEST(OutOfMemory, TheAllocationFaultHookFailsAllocationsUntilCleared) {
  detail::set_allocation_fault_hook(refuse_everything);
  const bool threw = throws_with<OutOfMemoryError>(
      [] { Tensor::empty({4}, DType::f32); },
      {"out of host memory", "(16 bytes)", "(a tensor [4] f32)", "fault hook"});
  detail::set_allocation_fault_hook(nullptr);
  EXPECT_TRUE(threw);
  EXPECT_EQ(Tensor::full({4}, 3.0f).to_vector<float>(), std::vector<float>(4, 3.0f));
}

TEST(OutOfMemory, APurposeWithAdviceAloneAddsNoEmptyName) {
  cuda::AllocationPurpose outer("", "Use fewer workers.");
  cuda::AllocationPurpose inner("batch buffer 2");
  EXPECT_EQ(cuda::AllocationPurpose::current_what(), "batch buffer 2");
  EXPECT_EQ(cuda::AllocationPurpose::current_advice(), "Use fewer workers.");
}

TEST(OutOfMemory, PurposesNestAndUnwind) {
  EXPECT_EQ(cuda::AllocationPurpose::current_what(), "");
  {
    cuda::AllocationPurpose a("model parameters", "Use a smaller model.");
    {
      cuda::AllocationPurpose b("conv1.weight");
      EXPECT_EQ(cuda::AllocationPurpose::current_what(), "model parameters: conv1.weight");
      EXPECT_EQ(cuda::AllocationPurpose::current_advice(), "Use a smaller model.");
    }
    EXPECT_EQ(cuda::AllocationPurpose::current_what(), "model parameters");
  }
  EXPECT_EQ(cuda::AllocationPurpose::current_what(), "");
  EXPECT_EQ(cuda::AllocationPurpose::current_advice(), "");
}

}  // namespace
}  // namespace cudp
