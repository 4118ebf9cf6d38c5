// GPU tests of kernels/layout.h: the four transposes and the two bf16 conversions against the CPU
// references, bit for bit, on odd shapes (partial tiles on every side, dimensions of 1), aligned
// and misaligned pointers; round trips; outputs poisoned and their surroundings checked untouched.
// f32_to_bf16 is fed random bit patterns (every exponent, subnormals, inf, NaN) plus the rounding
// ties; a NaN must stay a NaN (its bf16 payload is the hardware's, so only NaN-ness is compared).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/gpu.h"
#include "common/guarded_buffer.h"
#include "engine/core/stream.h"
#include "kernels/layout.h"

namespace cudp::kernels {
namespace {

// n elements of T `shift` elements into a poisoned allocation, guard band checked.
template <typename T>
using Slice = testing::GuardedBuffer<T>;

using Dims = std::array<int64_t, 4>;

std::string where(const Dims& d, int shift_src, int shift_dst) {
  return "dims " + std::to_string(d[0]) + "x" + std::to_string(d[1]) + "x" + std::to_string(d[2]) +
         "x" + std::to_string(d[3]) + ", shifts " + std::to_string(shift_src) + "/" +
         std::to_string(shift_dst);
}

// (source, destination) element shifts from their allocations.
const std::pair<int, int> kTransposeShifts[] = {{0, 0}, {1, 1}, {1, 0}, {0, 3}};

using GpuOp = void (*)(const float*, float*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);
using CpuOp = void (*)(const float*, float*, int64_t, int64_t, int64_t, int64_t);

// Runs op on the GPU and its reference on the CPU for every shape and alignment; then the inverse
// on the GPU must give the input back.
void check_transpose(GpuOp op, CpuOp reference, GpuOp inverse, const std::vector<Dims>& shapes) {
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 0;
  for (const Dims& d : shapes) {
    for (auto [ss, sd] : kTransposeShifts) {
      SCOPED_TRACE(where(d, ss, sd));
      const int64_t n = d[0] * d[1] * d[2] * d[3];
      const std::vector<float> x = testing::random_vector(n, ++seed);
      std::vector<float> expected(n, testing::kPoison);
      reference(x.data(), expected.data(), d[0], d[1], d[2], d[3]);
      Slice<float> src(n, ss, testing::kPoison), dst(n, sd, testing::kPoison),
          back(n, ss, testing::kPoison);
      src.upload(x);
      op(src.get(), dst.get(), d[0], d[1], d[2], d[3], stream);
      EXPECT_ALL_CLOSE(dst.download(), expected, 0.0, 0.0);
      EXPECT_TRUE(dst.guards_intact());
      inverse(dst.get(), back.get(), d[0], d[1], d[2], d[3], stream);
      EXPECT_ALL_CLOSE(back.download(), x, 0.0, 0.0);
      EXPECT_TRUE(back.guards_intact());
    }
  }
}

const std::vector<Dims> kImageShapes = {{1, 1, 1, 1},     {2, 3, 5, 7},    {3, 64, 7, 9},
                                        {1, 33, 31, 17},  {2, 1, 1, 1025}, {1, 1025, 1, 3},
                                        {2, 100, 33, 65}, {4, 64, 56, 56}, {5, 3, 224, 224}};
const std::vector<Dims> kWeightShapes = {{1, 1, 1, 1},   {64, 3, 3, 3},    {5, 7, 3, 3},
                                         {33, 65, 1, 1}, {128, 256, 3, 3}, {3, 2, 7, 7},
                                         {1, 40, 5, 7}};

TEST(LayoutGpu, NchwToNhwcMatchesCpu) {
  CUDP_REQUIRE_GPU();
  check_transpose(nchw_to_nhwc, nchw_to_nhwc_cpu, nhwc_to_nchw, kImageShapes);
}

TEST(LayoutGpu, NhwcToNchwMatchesCpu) {
  CUDP_REQUIRE_GPU();
  check_transpose(nhwc_to_nchw, nhwc_to_nchw_cpu, nchw_to_nhwc, kImageShapes);
}

// The bf16 activation transposes (Flatten under the bf16 policy) move the elements as they are:
// the bits of the CPU reference on every shape and alignment, the inverse gives the input back,
// and nothing outside the output is written. Buffers of uint16_t hold the bf16 bit patterns.
TEST(LayoutGpu, Bf16ActivationTransposesMoveTheBits) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  const auto bf16 = [](uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); };
  constexpr uint16_t kPoisonBits = 0xDEAD;
  uint64_t seed = 100;
  for (const bool to_nchw : {true, false}) {
    for (const Dims& d : kImageShapes) {
      for (auto [ss, sd] : kTransposeShifts) {
        SCOPED_TRACE(where(d, ss, sd) + (to_nchw ? ", to NCHW" : ", to NHWC"));
        const int64_t n = d[0] * d[1] * d[2] * d[3];
        const std::vector<float> values = testing::random_vector(n, ++seed);
        std::vector<uint16_t> x(n), expected(n, kPoisonBits);
        f32_to_bf16_cpu(values.data(), bf16(x.data()), n);
        if (to_nchw) {
          nhwc_to_nchw_cpu(bf16(x.data()), bf16(expected.data()), d[0], d[1], d[2], d[3]);
        } else {
          nchw_to_nhwc_cpu(bf16(x.data()), bf16(expected.data()), d[0], d[1], d[2], d[3]);
        }
        Slice<uint16_t> src(n, ss, kPoisonBits), dst(n, sd, kPoisonBits), back(n, ss, kPoisonBits);
        src.upload(x);
        if (to_nchw) {
          nhwc_to_nchw(bf16(src.get()), bf16(dst.get()), d[0], d[1], d[2], d[3], stream);
          nchw_to_nhwc(bf16(dst.get()), bf16(back.get()), d[0], d[1], d[2], d[3], stream);
        } else {
          nchw_to_nhwc(bf16(src.get()), bf16(dst.get()), d[0], d[1], d[2], d[3], stream);
          nhwc_to_nchw(bf16(dst.get()), bf16(back.get()), d[0], d[1], d[2], d[3], stream);
        }
        EXPECT_EQ(dst.download(), expected);
        EXPECT_EQ(back.download(), x);
        EXPECT_TRUE(dst.guards_intact());
        EXPECT_TRUE(back.guards_intact());
      }
    }
  }
}

TEST(LayoutGpu, OihwToKrscMatchesCpu) {
  CUDP_REQUIRE_GPU();
  check_transpose(oihw_to_krsc, oihw_to_krsc_cpu, krsc_to_oihw, kWeightShapes);
}

TEST(LayoutGpu, KrscToOihwMatchesCpu) {
  CUDP_REQUIRE_GPU();
  check_transpose(krsc_to_oihw, krsc_to_oihw_cpu, oihw_to_krsc, kWeightShapes);
}

TEST(LayoutGpu, EmptyAndOverlapping) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  EXPECT_NO_THROW(nchw_to_nhwc(static_cast<const float*>(nullptr), static_cast<float*>(nullptr), 0,
                               3, 4, 4, stream));
  Slice<float> a(16, 0, testing::kPoison);
  EXPECT_THROW(nchw_to_nhwc(a.get(), a.get(), 1, 4, 2, 2, stream), ValueError);
  EXPECT_THROW(f32_to_bf16(a.get(), nullptr, 3, stream), ValueError);
}

const int64_t kSizes[] = {1, 3, 5, 7, 1023, 1025, (int64_t(1) << 20) + 3};
// (fp32 array, bf16 array) element shifts: both on a 4-element boundary, both off it alike (head,
// body, tail), and off it differently (all scalar).
const std::pair<int, int> kBf16Shifts[] = {{0, 0}, {1, 1}, {2, 2}, {3, 3}, {1, 0}, {0, 1}, {2, 0}};
constexpr uint16_t kBf16Poison = 0x7FC1;  // a NaN no conversion here produces from these inputs

std::vector<uint16_t> bits_of(const std::vector<__nv_bfloat16>& v) {
  std::vector<uint16_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(uint16_t));
  return out;
}

bool is_bf16_nan(uint16_t b) {
  return (b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0;
}

TEST(Bf16Gpu, NarrowingMatchesCpuBitForBit) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 0;
  const uint32_t ties[] = {0x3F808000u, 0x3F818000u, 0xBF808000u, 0x7F7F8000u,
                           0x00018000u, 0x00008000u, 0x7F800000u, 0xFF800000u,
                           0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 0x80000000u};
  for (int64_t n : kSizes) {
    for (auto [sf, sb] : kBf16Shifts) {
      SCOPED_TRACE("n = " + std::to_string(n) + ", shifts " + std::to_string(sf) + "/" +
                   std::to_string(sb));
      std::mt19937 gen(static_cast<uint32_t>(++seed));
      std::vector<uint32_t> patterns(n);
      for (auto& u : patterns) {
        u = gen();
      }
      for (size_t i = 0; i < std::size(ties) && i < patterns.size(); ++i) {
        patterns[i] = ties[i];
      }
      std::vector<float> x(n);
      std::memcpy(x.data(), patterns.data(), n * sizeof(float));
      std::vector<__nv_bfloat16> expected(n);
      f32_to_bf16_cpu(x.data(), expected.data(), n);
      const std::vector<uint16_t> want = bits_of(expected);

      Slice<float> src(n, sf, testing::kPoison);
      Slice<uint16_t> dst(n, sb, kBf16Poison);
      src.upload(x);
      f32_to_bf16(src.get(), reinterpret_cast<__nv_bfloat16*>(dst.get()), n, stream);
      const std::vector<uint16_t> got = dst.download();
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const bool ok = is_bf16_nan(want[i]) ? is_bf16_nan(got[i]) : got[i] == want[i];
        if (!ok && bad++ < 5) {
          ADD_FAILURE() << std::hex << "element " << std::dec << i << std::hex << ": f32 0x"
                        << patterns[i] << " gave bf16 0x" << got[i] << ", expected 0x" << want[i];
        }
      }
      EXPECT_EQ(bad, 0);
      EXPECT_TRUE(dst.guards_intact());
    }
  }
}

TEST(Bf16Gpu, WideningIsExact) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  uint64_t seed = 100;
  for (int64_t n : kSizes) {
    for (auto [sf, sb] : kBf16Shifts) {
      SCOPED_TRACE("n = " + std::to_string(n) + ", shifts " + std::to_string(sf) + "/" +
                   std::to_string(sb));
      std::mt19937 gen(static_cast<uint32_t>(++seed));
      std::vector<uint16_t> patterns(n);
      for (auto& b : patterns) {
        b = static_cast<uint16_t>(gen());
      }
      std::vector<float> expected(n);
      bf16_to_f32_cpu(reinterpret_cast<const __nv_bfloat16*>(patterns.data()), expected.data(), n);

      Slice<uint16_t> src(n, sb, kBf16Poison);
      Slice<float> dst(n, sf, testing::kPoison);
      src.upload(patterns);
      bf16_to_f32(reinterpret_cast<const __nv_bfloat16*>(src.get()), dst.get(), n, stream);
      const std::vector<float> got = dst.download();
      EXPECT_EQ(std::memcmp(got.data(), expected.data(), n * sizeof(float)), 0)
          << "the widened bits differ (NaN payloads included)";
      EXPECT_TRUE(dst.guards_intact());
    }
  }
}

TEST(Bf16Gpu, RoundTripOfBf16ValuesIsTheIdentity) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream stream = cuda::Stream::create(0);
  // Every non-NaN bf16 pattern, widened and narrowed again on the GPU.
  std::vector<uint16_t> all;
  for (uint32_t b = 0; b < 65536; ++b) {
    if (!is_bf16_nan(static_cast<uint16_t>(b))) {
      all.push_back(static_cast<uint16_t>(b));
    }
  }
  const auto n = static_cast<int64_t>(all.size());
  Slice<uint16_t> src(n, 0, kBf16Poison), back(n, 0, kBf16Poison);
  Slice<float> mid(n, 0, testing::kPoison);
  src.upload(all);
  bf16_to_f32(reinterpret_cast<const __nv_bfloat16*>(src.get()), mid.get(), n, stream);
  f32_to_bf16(mid.get(), reinterpret_cast<__nv_bfloat16*>(back.get()), n, stream);
  EXPECT_EQ(back.download(), all);
}

}  // namespace
}  // namespace cudp::kernels
