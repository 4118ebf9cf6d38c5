// GPU tests of kernels/scalars.h against their CPU twins: write_bytes (how a CUDA graph's replay
// scalars reach the device, engine/core/graph.h) across its chunk boundary, and add_i64
// (BatchNorm's batch count).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/gpu.h"
#include "engine/core/tensor.h"
#include "kernels/scalars.h"

namespace cudp {
namespace {

const Device kGpu = Device::cuda(0);

// The bytes written match the CPU twin's, those past the end stay as they were; the counter adds.
TEST(ScalarsGpu, WriteBytesAndAddMatchTheCpu) {
  CUDP_REQUIRE_GPU();
  for (const size_t n : {size_t{1}, size_t{37}, kernels::kWriteChunk, kernels::kWriteChunk + 5,
                         3 * kernels::kWriteChunk + 1}) {
    std::vector<unsigned char> src(n);
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 31 + 7);
    const std::vector<uint8_t> poison(n + 8, 0xA5);  // also what must stay past the end
    Tensor dst = Tensor::from_vector(poison, {static_cast<int64_t>(n + 8)}, kGpu);
    kernels::write_bytes(dst.data_ptr(), src.data(), n, stream_for(kGpu));
    std::vector<unsigned char> expected(poison.begin(), poison.end());
    kernels::write_bytes_cpu(expected.data(), src.data(), n);
    const Tensor host = dst.cpu();
    const auto* p = static_cast<const unsigned char*>(host.data_ptr());
    EXPECT_EQ(std::vector<unsigned char>(p, p + n + 8), expected) << n << " bytes";
  }
  Tensor counter = Tensor::from_vector<int64_t>({41}, {1}).to(kGpu);
  kernels::add_i64(counter.data<int64_t>(), 1, stream_for(kGpu));
  int64_t expected = 41;
  kernels::add_i64_cpu(&expected, 1);
  EXPECT_EQ(counter.to_vector<int64_t>()[0], expected);
}

}  // namespace
}  // namespace cudp
