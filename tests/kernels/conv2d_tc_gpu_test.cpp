// GPU tests of the tensor-core convolutions (kernels/conv2d.h, Math::BF16 and Math::TF32): forward
// (with bias and ReLU) and backward-data against the double CPU references on odd shapes (filter
// sizes, strides, paddings, C = 1 and 3, channel counts that are not multiples of anything) and on
// VGG-16's layers at small batch; the typed bf16 entry points; poisoned outputs; bitwise
// determinism; the errors for what is not implemented.
//
// Error bound per output, with p_l the R*S*C products of one output (|x|, |w| < 1), the same
// argument as tests/kernels/matmul_gpu_test.cpp: BF16 products are exact (the CPU reference is fed
// the bf16-rounded operands), so only the fp32 accumulation errs: 64u·Σ|p| (u = 2^-24). TF32 adds
// the operand rounding: 2^-9·|Σp| (a possible bias of truncation) + 6·2^-10·sqrt(Σp²), and
// sqrt(Σp²) <= sqrt(Σ|p|) since |p| < 1. Σ|p| comes from the CPU reference run on |x| and |w|.
// The relative L2 error over the whole output must also stay within 2^-9 (TF32) or 2^-14 (BF16).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "common/scoped_switch.h"
#include "kernels/conv2d.h"
#include "kernels/conv2d_narrow.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"

namespace cudp::kernels {
namespace {

using testing::DeviceBuffer;
using testing::kPoison;

using testing::bf16_rounded;
using testing::bf16_widened;

// A shape, for SCOPED_TRACE.
std::string shape_text(const Conv2dShape& s) {
  std::ostringstream out;
  out << "N " << s.n << " H " << s.h << " W " << s.w << " C " << s.c << " K " << s.k << " R " << s.r
      << " S " << s.s << " stride " << s.stride_h << " pad " << s.pad_h << "," << s.pad_w;
  return out.str();
}

// The bound of a bf16 output against its double reference `ref`, with Σ|p| = `abs_sum`: the bf16
// rounding, 2^-8 relative, on top of the fp32 accumulation's 64u·Σ|p| (the file comment).
double bf16_output_bound(double ref, double abs_sum) {
  return std::ldexp(1.0, -8) * std::fabs(ref) + std::ldexp(64.0, -24) * abs_sum + 1e-6;
}

std::vector<float> operand(size_t n, uint64_t seed, Math math) {
  std::vector<float> v = testing::random_vector(n, seed);
  if (math == Math::BF16) {
    for (float& x : v) x = bf16_rounded(x);
  }
  return v;
}

// The bf16 bit patterns of v (round to nearest even), for typed entry points on bf16 tensors.
std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = detail::f32_to_bf16_bits(v[i]);
  return b;
}

std::vector<float> absolute(std::vector<float> v) {
  for (float& x : v) x = std::fabs(x);
  return v;
}

// Checks got against ref elementwise with the bound of the file comment, and the relative L2 error.
void expect_within_bound(const std::vector<float>& got, const std::vector<float>& ref,
                         const std::vector<float>& abs_sum, Math math, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  double err2 = 0, ref2 = 0;
  int64_t bad = 0, worst_at = 0;
  double worst = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    double tol = std::ldexp(64.0, -24) * abs_sum[i] + std::ldexp(1.0, -22) * (std::fabs(ref[i]) + 1);
    if (math == Math::TF32) {
      tol += std::ldexp(1.0, -9) * std::fabs(ref[i]) + 6 * std::ldexp(1.0, -10) * std::sqrt(abs_sum[i]);
    }
    const double e = std::fabs(double(got[i]) - ref[i]);
    err2 += e * e;
    ref2 += double(ref[i]) * ref[i];
    const double excess = std::isnan(e) ? INFINITY : e / tol;
    if (excess > 1) ++bad;
    if (excess > worst) {
      worst = excess;
      worst_at = int64_t(i);
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outputs off; worst at "
                    << worst_at << ": got " << got[worst_at] << " want " << ref[worst_at] << " ("
                    << worst << " x tolerance)";
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  EXPECT_LE(rel, math == Math::TF32 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -14))
      << what << ": relative L2 error";
}

// The swapped-tiles switch set for a test's duration and put back as the test found it (the tests'
// main may have turned it off for initcheck: tests/common/test_main.cpp).
struct SwappedTiles : testing::ScopedSwitch<bool> {
  explicit SwappedTiles(bool on)
      : ScopedSwitch(detail::conv_swapped, detail::set_conv_swapped, on) {}
};

struct Case {
  const char* name;
  Conv2dShape shape;
};

const Case kCases[] = {
    {"r1_p0", {3, 7, 7, 5, 9, 1, 1, 1, 1, 0, 0}},
    {"r3_p1", {3, 7, 7, 5, 9, 3, 3, 1, 1, 1, 1}},
    {"r5_p2", {3, 7, 7, 5, 9, 5, 5, 1, 1, 2, 2}},
    {"r3_p0", {3, 7, 7, 5, 9, 3, 3, 1, 1, 0, 0}},
    {"r3_s2_p1", {3, 7, 7, 5, 9, 3, 3, 2, 2, 1, 1}},
    {"nonsquare", {3, 7, 9, 5, 9, 3, 5, 1, 1, 2, 1}},
    {"c1", {3, 7, 7, 1, 9, 3, 3, 1, 1, 1, 1}},
    {"c3_k64", {2, 9, 10, 3, 64, 3, 3, 1, 1, 1, 1}},
    // The kernels of 8-channel inputs (kernels/conv2d_narrow.h) with the patch feed: tiles that
    // hang over both edges, 1x1 and 2x3 filters, no padding.
    {"c3_k64_h37w45", {2, 37, 45, 3, 64, 3, 3, 1, 1, 1, 1}},
    {"c8_k64_r1", {2, 11, 13, 8, 64, 1, 1, 1, 1, 0, 0}},
    {"c3_k64_p0_w70", {3, 20, 70, 3, 64, 3, 3, 1, 1, 0, 0}},
    {"c5_k64_r2s3", {2, 15, 33, 5, 64, 2, 3, 1, 1, 1, 0}},
    {"c1_k64", {2, 13, 40, 1, 64, 3, 3, 1, 1, 1, 1}},
    {"c4_k64_r3s1", {2, 9, 35, 4, 64, 3, 1, 1, 1, 1, 0}},
    {"c2_k64_r2s2", {2, 11, 37, 2, 64, 2, 2, 1, 1, 1, 0}},
    {"c3_k64_r1", {2, 9, 33, 3, 64, 1, 1, 1, 1, 0, 0}},
    // More tiles than blocks (448 forward and backward-weight tiles, 896 in TF32): the narrow
    // kernels' double buffer and their sums across a block's tiles.
    {"c3_k64_h128_n7", {7, 128, 128, 3, 64, 3, 3, 1, 1, 1, 1}},
    // Backward-data of 3 output channels runs as the narrow forward (dy padded to 8 or 4).
    {"c64_k3", {2, 9, 37, 64, 3, 3, 3, 1, 1, 1, 1}},
    {"c24_k136", {2, 6, 19, 24, 136, 3, 3, 1, 1, 1, 1}},
    {"c68_k72", {2, 5, 5, 68, 72, 3, 3, 1, 1, 1, 1}},
    {"c96_k300", {2, 9, 9, 96, 300, 3, 3, 1, 1, 1, 1}},
    {"c256_k256_h4", {1, 4, 4, 256, 256, 3, 3, 1, 1, 1, 1}},
    // VGG-16's channel progression at small batch.
    {"vgg_c3_k64_h32", {2, 32, 32, 3, 64, 3, 3, 1, 1, 1, 1}},
    {"vgg_c64_k64_h56", {2, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1}},
    {"vgg_c64_k128_h28", {2, 28, 28, 64, 128, 3, 3, 1, 1, 1, 1}},
    {"vgg_c128_k256_h14", {2, 14, 14, 128, 256, 3, 3, 1, 1, 1, 1}},
    {"vgg_c256_k512_h7", {2, 7, 7, 256, 512, 3, 3, 1, 1, 1, 1}},
    {"vgg_c512_k512_h4", {4, 4, 4, 512, 512, 3, 3, 1, 1, 1, 1}},
    {"vgg_c512_k512_h2", {8, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}},
    // Patches that hang over the output's edges (Q = 12: wb 4; P = 10: hb 2; n = 3: nb 16).
    {"c64_k64_h10w12_n3", {3, 10, 12, 64, 64, 3, 3, 1, 1, 1, 1}},
    {"c128_k192_r5_p2", {2, 9, 13, 128, 192, 5, 5, 1, 1, 2, 2}},
    // bf16 backward-data on the filters as they are (K a multiple of 64), C not a multiple of the
    // 64-channel boxes: a tile's last box reads into the next tap's columns (never stored); a
    // non-square filter with one-sided padding.
    {"c200_k128", {2, 7, 9, 200, 128, 3, 3, 1, 1, 1, 1}},
    {"c72_k64_r2s3", {2, 8, 11, 72, 64, 2, 3, 1, 1, 1, 0}},
    // TF32 backward-weight's boxes: dy boxes (32 channels) wider than K, dw^T with K not a
    // multiple of 32, C of one box, odd P and Q (patches of 32 images, most past n).
    {"c32_k20_h7w9", {2, 7, 9, 32, 20, 3, 3, 1, 1, 1, 1}},
    {"c64_k36_h5w7", {3, 5, 7, 64, 36, 3, 3, 1, 1, 1, 1}},
};

struct Param {
  Case c;
  Math math;
  bool patch_feed;  // stride-1 layers with C a multiple of the k-block: TMA boxes, or the gather
};

class Conv2dTcGpu : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    CUDP_REQUIRE_TENSOR_CORES();
    detail::set_conv_feed(GetParam().patch_feed ? detail::ConvFeed::patch
                                                : detail::ConvFeed::gather);
  }
  void TearDown() override { detail::set_conv_feed(detail::ConvFeed::patch); }
};

TEST_P(Conv2dTcGpu, ForwardWithBiasAndRelu) {
  const auto& [c, math, patch_feed] = GetParam();
  const Conv2dShape& s = c.shape;
  const std::vector<float> x = operand(size_t(s.x_size()), 1, math);
  const std::vector<float> w = operand(size_t(s.w_size()), 2, math);
  const std::vector<float> bias = testing::random_vector(size_t(s.k), 3);
  std::vector<float> ref(size_t(s.y_size())), abs_sum(size_t(s.y_size()));
  conv2d_forward_cpu(s, x.data(), w.data(), bias.data(), ref.data(), true);
  conv2d_forward_cpu(s, absolute(x).data(), absolute(w).data(), nullptr, abs_sum.data(), false);
  DeviceBuffer<float> dx(x), dw(w), db(bias), dy(size_t(s.y_size()));
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    dy.fill(kPoison);
    conv2d_forward(s, dx.get(), dw.get(), db.get(), dy.get(), true, nullptr, math);
    const std::vector<float> got = dy.download();
    if (run == 0) {
      expect_within_bound(got, ref, abs_sum, math, std::string("forward ") + c.name);
      first = got;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), got.data(), got.size() * 4), 0) << "not deterministic";
    }
  }
}

TEST_P(Conv2dTcGpu, BackwardData) {
  const auto& [c, math, patch_feed] = GetParam();
  const Conv2dShape& s = c.shape;
  const std::vector<float> dy = operand(size_t(s.y_size()), 4, math);
  const std::vector<float> w = operand(size_t(s.w_size()), 5, math);
  DeviceBuffer<float> ddy(dy), dw(w), ddx(size_t(s.x_size()));
  ddx.fill(kPoison);
  if (s.stride_h != 1 || s.stride_w != 1) {
    EXPECT_THROW(conv2d_backward_data(s, ddy.get(), dw.get(), ddx.get(), nullptr, math),
                 ValueError);
    return;
  }
  std::vector<float> ref(size_t(s.x_size())), abs_sum(size_t(s.x_size()));
  conv2d_backward_data_cpu(s, dy.data(), w.data(), ref.data());
  conv2d_backward_data_cpu(s, absolute(dy).data(), absolute(w).data(), abs_sum.data());
  conv2d_backward_data(s, ddy.get(), dw.get(), ddx.get(), nullptr, math);
  expect_within_bound(ddx.download(), ref, abs_sum, math, std::string("backward-data ") + c.name);
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (const Case& c : kCases) {
    for (Math m : {Math::BF16, Math::TF32}) {
      for (bool patch : {true, false}) out.push_back({c, m, patch});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dTcGpu, ::testing::ValuesIn(params()), [](const auto& info) {
  return std::string(info.param.c.name) + "_" + math_name(info.param.math) +
         (info.param.patch_feed ? "_patch" : "_gather");
});

// The filters' bf16 copies, bit for bit against the host's rounding: channels zero-padded to 8, and
// the rotated copy of backward-data. Both kernels (pairs: C and K even; single elements otherwise),
// partial tiles on both sides, 1x1 and 3x3 taps; without the rotated copy, the plain cast where C
// is a multiple of 8.
TEST(Conv2dTcTyped, FiltersToBf16AndTheirRotation) {
  CUDP_REQUIRE_GPU();
  struct Filters {
    int k, r, s, c;
  };
  for (const Filters f :
       {Filters{64, 3, 3, 3}, Filters{6, 3, 3, 10}, Filters{72, 3, 3, 68}, Filters{130, 1, 1, 66},
        Filters{5, 3, 3, 7}, Filters{2, 3, 5, 2}, Filters{64, 3, 3, 64}, Filters{24, 1, 1, 40}}) {
    SCOPED_TRACE(::testing::Message()
                 << "K " << f.k << " R " << f.r << " S " << f.s << " C " << f.c);
    const Conv2dShape shape{1, 8, 8, f.c, f.k, f.r, f.s, 1, 1, 0, 0};
    const int cp = bf16_channels(f.c);
    const size_t taps = size_t(f.r) * f.s;
    const std::vector<float> w = testing::random_vector(size_t(f.k) * taps * f.c, 300 + f.c);
    DeviceBuffer<float> dw(w);
    DeviceBuffer<uint16_t> dst(size_t(f.k) * taps * cp), rot(size_t(f.c) * taps * f.k);
    dst.fill(0xFFFF);
    rot.fill(0xFFFF);
    conv2d_filters_to_bf16(dw.get(), shape, dst.get(), rot.get(), nullptr);
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = dst.download(), got_rot = rot.download();
    int64_t bad = 0, bad_rot = 0;
    for (int k = 0; k < f.k; ++k) {
      for (int r = 0; r < f.r; ++r) {
        for (int sx = 0; sx < f.s; ++sx) {
          const size_t tap = size_t(r) * f.s + sx;
          for (int c = 0; c < cp; ++c) {
            const float v = c < f.c ? w[(k * taps + tap) * f.c + c] : 0.f;
            bad += got[(k * taps + tap) * cp + c] != detail::f32_to_bf16_bits(v);
          }
          const size_t rtap = size_t(f.r - 1 - r) * f.s + (f.s - 1 - sx);
          for (int c = 0; c < f.c; ++c) {
            bad_rot += got_rot[(c * taps + rtap) * f.k + k] !=
                       detail::f32_to_bf16_bits(w[(k * taps + tap) * f.c + c]);
          }
        }
      }
    }
    EXPECT_EQ(bad, 0) << "elements of the padded copy differ";
    EXPECT_EQ(bad_rot, 0) << "elements of the rotated copy differ";
    // Without the rotated copy (a bf16 layer's forward; C a multiple of 8: a plain cast).
    dst.fill(0xFFFF);
    conv2d_filters_to_bf16(dw.get(), shape, dst.get(), nullptr, nullptr);
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(dst.download(), got) << "the copy without the rotated one differs";
  }
}

// Backward-data with the ReLU mask of the layer before (ConvOperands::mask), on the patch tiles a
// VGG layer runs (64 input channels: whole tiles 64 and 128 wide): the unmasked product with the
// mask's select applied afterwards, bit for bit; masked elements are +0, every element written.
TEST(Conv2dTcTyped, BackwardDataAppliesTheReluMask) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const Conv2dShape s : {Conv2dShape{2, 12, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{3, 10, 12, 128, 64, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << "C " << s.c << " K " << s.k);
    std::vector<float> mask = operand(size_t(s.x_size()), 13, Math::BF16);
    for (size_t i = 0; i < mask.size(); i += 5) mask[i] = 0.f;
    DeviceBuffer<uint16_t> dy(bf16_bits(operand(size_t(s.y_size()), 11, Math::BF16))),
        w(bf16_bits(operand(size_t(s.w_size()), 12, Math::BF16))), dmask(bf16_bits(mask)),
        plain(size_t(s.x_size())), masked(size_t(s.x_size()));
    plain.fill(0xFFFF);
    masked.fill(0xFFFF);
    ConvOperands ops{Math::BF16, dy.get(), w.get(), plain.get(), DType::BF16, nullptr, false};
    conv2d_backward_data_tc(s, ops, nullptr);
    ops.y = masked.get();
    ops.mask = dmask.get();
    conv2d_backward_data_tc(s, ops, nullptr);
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> p = plain.download(), m = masked.download();
    int64_t bad = 0, zeros = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      const uint16_t want = mask[i] <= 0.f ? uint16_t(0) : p[i];
      bad += m[i] != want;
      zeros += mask[i] <= 0.f;
    }
    EXPECT_EQ(bad, 0) << "of " << p.size() << " elements (" << zeros << " masked)";
    EXPECT_GT(zeros, 0);
  }
}

// Backward-data's column sums (ConvOperands::column_sums, the layer before's bias gradient:
// Module's bias hand-off): sums += the column sums of the dx the same call stores, against double.
// In the epilogue with a mask (64-, 128- and 256-wide tiles, ping-pong and cooperative, tiles over
// the output's edge), in a pass of its own without a mask or with split-K (the small output). The
// fp32 chain of an element: its thread's 2 rows, 3 halvings across lanes, bias_grad's chain over
// the partial rows (< 300): 512 * 2^-24 * (sum |dx| + |start|) bounds the error. dx is the call's
// without sums bit for bit, and a second call gives the same sums.
TEST(Conv2dTcTyped, BackwardDataAddsTheColumnSums) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const Conv2dShape s : {Conv2dShape{2, 12, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{3, 10, 12, 128, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 28, 28, 64, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 14, 14, 256, 256, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 9, 11, 64, 512, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{1, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}}) {
    for (bool with_mask : {true, false}) {
      SCOPED_TRACE(shape_text(s) + (with_mask ? " mask" : ""));
      std::vector<float> mask = operand(size_t(s.x_size()), 33, Math::BF16);
      for (size_t i = 0; i < mask.size(); i += 5) mask[i] = 0.f;
      DeviceBuffer<uint16_t> dy(bf16_bits(operand(size_t(s.y_size()), 31, Math::BF16))),
          w(bf16_bits(operand(size_t(s.w_size()), 32, Math::BF16))), dmask(bf16_bits(mask)),
          alone(size_t(s.x_size())), summed(size_t(s.x_size()));
      alone.fill(0xFFFF);
      summed.fill(0xFFFF);
      const std::vector<float> start = testing::random_vector(size_t(s.c), 34);
      DeviceBuffer<float> sums(start), again(start);
      ConvOperands ops{Math::BF16, dy.get(), w.get(), alone.get(), DType::BF16, nullptr, false};
      ops.mask = with_mask ? dmask.get() : nullptr;
      conv2d_backward_data_tc(s, ops, nullptr);
      ops.y = summed.get();
      ops.column_sums = sums.get();
      conv2d_backward_data_tc(s, ops, nullptr);
      ops.column_sums = again.get();
      conv2d_backward_data_tc(s, ops, nullptr);
      CUDP_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> dx = summed.download();
      EXPECT_EQ(dx, alone.download());
      const std::vector<float> values = bf16_widened(dx);  // the stored bf16 (exact)
      const std::vector<float> got = sums.download();
      EXPECT_TRUE(testing::column_sums_close(got, start, values));
      EXPECT_TRUE(testing::bitwise_equal(again.download(), got));
    }
  }
}

// The same two under TF32 (fp32 dy, filters, mask and dx: the tf32 policy's Conv2d hands its ReLU
// mask and bias sums to backward-data like bf16's): the mask's select on the unmasked product, bit
// for bit (masked elements +0, every element written; the fp32 mask is zero every fifth element and
// negative about half the rest); the column sums, in the epilogue on whole tiles (64-, 128- and
// 256-wide) and in a pass of their own elsewhere (C = 32, split-K on the small output), against
// double with column_sums_close's bound; dx unchanged by taking them; a second call the same bits.
TEST(Conv2dTcTyped, Tf32BackwardDataMasksAndAddsTheColumnSums) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const Conv2dShape s : {Conv2dShape{2, 12, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{3, 10, 12, 128, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 16, 16, 32, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 28, 28, 64, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 14, 14, 256, 256, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 9, 11, 64, 512, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{1, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(shape_text(s));
    std::vector<float> mask = operand(size_t(s.x_size()), 43, Math::TF32);
    for (size_t i = 0; i < mask.size(); i += 5) mask[i] = 0.f;
    DeviceBuffer<float> dy(operand(size_t(s.y_size()), 41, Math::TF32)),
        w(operand(size_t(s.w_size()), 42, Math::TF32)), dmask(mask), plain(size_t(s.x_size())),
        masked(size_t(s.x_size())), summed(size_t(s.x_size())), unmasked(size_t(s.x_size()));
    for (DeviceBuffer<float>* b : {&plain, &masked, &summed, &unmasked}) b->fill(kPoison);
    const std::vector<float> start = testing::random_vector(size_t(s.c), 44);
    DeviceBuffer<float> sums(start), again(start), plain_sums(start);
    ConvOperands ops{Math::TF32, dy.get(), w.get(), plain.get(), DType::F32, nullptr, false};
    conv2d_backward_data_tc(s, ops, nullptr);
    ops.y = unmasked.get();
    ops.column_sums = plain_sums.get();  // no mask: a pass of its own
    conv2d_backward_data_tc(s, ops, nullptr);
    ops.y = masked.get();
    ops.mask = dmask.get();
    ops.column_sums = nullptr;
    conv2d_backward_data_tc(s, ops, nullptr);
    ops.y = summed.get();
    ops.column_sums = sums.get();
    conv2d_backward_data_tc(s, ops, nullptr);
    ops.column_sums = again.get();
    conv2d_backward_data_tc(s, ops, nullptr);
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> p = plain.download(), m = masked.download();
    int64_t bad = 0, zeros = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      const float want = mask[i] <= 0.f ? 0.f : p[i];
      bad += std::memcmp(&m[i], &want, sizeof(float)) != 0;
      zeros += mask[i] <= 0.f;
    }
    EXPECT_EQ(bad, 0) << "of " << p.size() << " elements (" << zeros << " masked)";
    EXPECT_GT(zeros, 0);
    EXPECT_TRUE(testing::bitwise_equal(unmasked.download(), p));
    EXPECT_TRUE(testing::column_sums_close(plain_sums.download(), start, p));
    EXPECT_TRUE(testing::bitwise_equal(summed.download(), m));
    const std::vector<float> got = sums.download();
    EXPECT_TRUE(testing::column_sums_close(got, start, m));
    EXPECT_TRUE(testing::bitwise_equal(again.download(), got));
  }
}

// bf16 layers of 64 (forward) or 64..128 (backward-data's view) output channels keep their filters
// resident in shared memory instead of streaming them with every k-block of x. The wgmma are the
// same on the same operands, so the outputs must match the streamed kernels' bit for bit: forward
// with bias and ReLU, backward-data with the ReLU mask; tiles over the output's edges, split-K on
// small outputs, 1 to 18 k-blocks of filters (1x1, 2x3 with one-sided padding, 3x3 over 64 and
// 128 channels). The unswapped kernels (the swapped ones keep at most 9 k-blocks resident: see
// SwappedTilesAgainstTheReference).
TEST(Conv2dTcTyped, ResidentFiltersMatchStreamedBitForBit) {
  CUDP_REQUIRE_TENSOR_CORES();
  struct Defaults {  // however the test ends
    ~Defaults() { detail::set_conv_halo(true); }
  } defaults;
  const SwappedTiles unswapped(false);
  detail::set_conv_halo(false);  // the nine-box kernels (halo tiles have tests of their own)
  int resident_runs[2][3] = {};  // [forward, backward-data][streamed, 9 k-blocks, 18 k-blocks]
  for (const Conv2dShape s : {Conv2dShape{3, 10, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 56, 56, 64, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 28, 28, 64, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 20, 24, 128, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 9, 13, 64, 64, 2, 3, 1, 1, 1, 0},
                              Conv2dShape{3, 8, 8, 64, 64, 1, 1, 1, 1, 0, 0}}) {
    SCOPED_TRACE(shape_text(s));
    // Which kernels run (the plan's tile width decides: the view's K must fit one tile column):
    // recorded per pass and capacity, and required below to cover each at least once.
    const int fwd_blocks = detail::conv2d_resident_filter_blocks(s, false);
    const int bwd_blocks = detail::conv2d_resident_filter_blocks(s, true);
    ++resident_runs[0][fwd_blocks == 9 ? 1 : fwd_blocks == 18 ? 2 : 0];
    ++resident_runs[1][bwd_blocks == 9 ? 1 : bwd_blocks == 18 ? 2 : 0];
    std::vector<float> mask = operand(size_t(s.x_size()), 23, Math::BF16);
    for (size_t i = 0; i < mask.size(); i += 3) mask[i] = 0.f;
    DeviceBuffer<uint16_t> x(bf16_bits(operand(size_t(s.x_size()), 21, Math::BF16))),
        w(bf16_bits(operand(size_t(s.w_size()), 22, Math::BF16))), dmask(bf16_bits(mask)),
        dy(bf16_bits(operand(size_t(s.y_size()), 24, Math::BF16)));
    DeviceBuffer<float> bias(testing::random_vector(size_t(s.k), 25));
    std::vector<uint16_t> y_of[2], dx_of[2];
    for (int streamed = 0; streamed < 2; ++streamed) {
      detail::set_conv_feed(streamed ? detail::ConvFeed::patch_streamed : detail::ConvFeed::patch);
      if (streamed) {
        EXPECT_EQ(detail::conv2d_resident_filter_blocks(s, false), 0);
        EXPECT_EQ(detail::conv2d_resident_filter_blocks(s, true), 0);
      }
      DeviceBuffer<uint16_t> y(size_t(s.y_size())), dx(size_t(s.x_size()));
      y.fill(0xFFFF);
      dx.fill(0xFFFF);
      ConvOperands fwd{Math::BF16, x.get(), w.get(), y.get(), DType::BF16, bias.get(), true};
      conv2d_forward_tc(s, fwd, nullptr);
      ConvOperands back{Math::BF16, dy.get(), w.get(), dx.get(), DType::BF16, nullptr, false};
      back.mask = dmask.get();
      conv2d_backward_data_tc(s, back, nullptr);
      CUDP_CUDA_CHECK(cudaDeviceSynchronize());
      y_of[streamed] = y.download();
      dx_of[streamed] = dx.download();
    }
    detail::set_conv_feed(detail::ConvFeed::patch);
    int64_t bad_y = 0, bad_dx = 0, nonzero = 0;
    for (size_t i = 0; i < y_of[0].size(); ++i) {
      bad_y += y_of[0][i] != y_of[1][i];
      nonzero += y_of[0][i] != 0 && y_of[0][i] != 0xFFFF;
    }
    for (size_t i = 0; i < dx_of[0].size(); ++i) bad_dx += dx_of[0][i] != dx_of[1][i];
    EXPECT_EQ(bad_y, 0) << "forward: of " << y_of[0].size() << " outputs";
    EXPECT_EQ(bad_dx, 0) << "backward-data: of " << dx_of[0].size() << " outputs";
    EXPECT_GT(nonzero, int64_t(y_of[0].size() / 4)) << "the forward wrote too few outputs";
    EXPECT_EQ(std::count(y_of[0].begin(), y_of[0].end(), uint16_t(0xFFFF)), 0)
        << "the forward left poisoned outputs";
    EXPECT_EQ(std::count(dx_of[0].begin(), dx_of[0].end(), uint16_t(0xFFFF)), 0)
        << "backward-data left poisoned outputs";
  }
  EXPECT_GT(resident_runs[0][1], 0) << "no forward kept 9 k-blocks of filters resident";
  EXPECT_GT(resident_runs[0][2], 0) << "no forward kept 18 k-blocks of filters resident";
  EXPECT_GT(resident_runs[1][1], 0) << "no backward-data kept 9 k-blocks of filters resident";
  EXPECT_GT(resident_runs[1][2], 0) << "no backward-data kept 18 k-blocks of filters resident";
}

// The typed bf16 forward (bias, fused ReLU) and backward-data (ReLU mask, column sums) of one shape
// against the double CPU references, for the tests of the swapped and halo tiles: the operands
// (seeds seed .. seed + 5), their references and the sums of |terms| that bound a bf16 output
// (bf16_output_bound), and the operands on the device.
struct TypedConvCase {
  Conv2dShape s;
  std::vector<float> y_ref, y_abs, dx_ref, dx_abs, start;
  DeviceBuffer<uint16_t> x, w, dy, mask;
  DeviceBuffer<float> bias;

  TypedConvCase(const Conv2dShape& shape, uint64_t seed) : s(shape) {
    const std::vector<float> hx = operand(size_t(s.x_size()), seed, Math::BF16);
    const std::vector<float> hw = operand(size_t(s.w_size()), seed + 1, Math::BF16);
    const std::vector<float> hdy = operand(size_t(s.y_size()), seed + 2, Math::BF16);
    const std::vector<float> hbias = testing::random_vector(size_t(s.k), seed + 3);
    std::vector<float> hmask = operand(size_t(s.x_size()), seed + 4, Math::BF16);
    for (size_t i = 0; i < hmask.size(); i += 3) hmask[i] = 0.f;
    // y = relu(x (*) w + bias), dx = mask(dy (*)^T w), and the sums of |terms|.
    y_ref.resize(size_t(s.y_size()));
    y_abs.resize(size_t(s.y_size()));
    conv2d_forward_cpu(s, hx.data(), hw.data(), hbias.data(), y_ref.data(), true);
    conv2d_forward_cpu(s, absolute(hx).data(), absolute(hw).data(), absolute(hbias).data(),
                       y_abs.data(), false);
    dx_ref.resize(size_t(s.x_size()));
    dx_abs.resize(size_t(s.x_size()));
    conv2d_backward_data_cpu(s, hdy.data(), hw.data(), dx_ref.data());
    conv2d_backward_data_cpu(s, absolute(hdy).data(), absolute(hw).data(), dx_abs.data());
    for (size_t i = 0; i < hmask.size(); ++i) {
      if (hmask[i] <= 0.f) dx_ref[i] = dx_abs[i] = 0.f;
    }
    start = testing::random_vector(size_t(s.c), seed + 5);
    x = DeviceBuffer<uint16_t>(bf16_bits(hx));
    w = DeviceBuffer<uint16_t>(bf16_bits(hw));
    dy = DeviceBuffer<uint16_t>(bf16_bits(hdy));
    mask = DeviceBuffer<uint16_t>(bf16_bits(hmask));
    bias = DeviceBuffer<float>(hbias);
  }

  struct Outputs {
    std::vector<uint16_t> y, dx;
    std::vector<float> sums;
  };

  // Both passes under the current settings, into poisoned outputs (sums starting from `start`).
  Outputs run() const {
    DeviceBuffer<uint16_t> y(size_t(s.y_size())), dx(size_t(s.x_size()));
    DeviceBuffer<float> sums(start);
    y.fill(0xFFFF);
    dx.fill(0xFFFF);
    ConvOperands fwd{Math::BF16, x.get(), w.get(), y.get(), DType::BF16, bias.get(), true};
    conv2d_forward_tc(s, fwd, nullptr);
    ConvOperands back{Math::BF16, dy.get(), w.get(), dx.get(), DType::BF16, nullptr, false};
    back.mask = mask.get();
    back.column_sums = sums.get();
    conv2d_backward_data_tc(s, back, nullptr);
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    return {y.download(), dx.download(), sums.download()};
  }

  // No poisoned output left, every output within the bf16 bound of its reference, the sums
  // against double (column_sums_close).
  void expect_within_references(const Outputs& o) const {
    EXPECT_EQ(std::count(o.y.begin(), o.y.end(), uint16_t(0xFFFF)), 0)
        << "the forward left poisoned outputs";
    EXPECT_EQ(std::count(o.dx.begin(), o.dx.end(), uint16_t(0xFFFF)), 0)
        << "backward-data left poisoned outputs";
    const std::vector<float> yv = bf16_widened(o.y), dxv = bf16_widened(o.dx);
    int64_t bad_y = 0, bad_dx = 0;
    for (size_t i = 0; i < yv.size(); ++i) {
      bad_y += !(std::fabs(yv[i] - y_ref[i]) <= bf16_output_bound(y_ref[i], y_abs[i]));
    }
    for (size_t i = 0; i < dxv.size(); ++i) {
      bad_dx += !(std::fabs(dxv[i] - dx_ref[i]) <= bf16_output_bound(dx_ref[i], dx_abs[i]));
    }
    EXPECT_EQ(bad_y, 0) << "forward: of " << yv.size() << " outputs";
    EXPECT_EQ(bad_dx, 0) << "backward-data: of " << dxv.size() << " outputs";
    EXPECT_TRUE(testing::column_sums_close(o.sums, start, dxv));
  }
};

// The swapped tiles of 64-channel outputs (the filters as wgmma's A, 128 pixels as its N; the
// tile transposed through shared memory, written and its mask read by TMA): the forward with bias
// and ReLU and backward-data with the ReLU mask and the column sums, each against the double CPU
// reference with a bf16 output's bound (bf16_output_bound), the sums against double
// (BackwardDataAddsTheColumnSums'), no poisoned output left; the same with the filters streamed
// bit for bit; and the unswapped kernels within the same bounds and with the same bits. Patches
// over the output's edges (10 x 12, 9 x 13), 1 to 18 k-blocks (1x1, 2x3 with one-sided padding, 3x3
// over 64 and 128 channels). Both consumers take several tiles (so staging reuse and the mask
// barrier's second phase run) where the patches hang over the edges: the grid is sized from the
// pixel count, the work from the patches (10 x 12 x 3: 3 blocks for 15 tiles).
TEST(Conv2dTcTyped, SwappedTilesAgainstTheReference) {
  CUDP_REQUIRE_TENSOR_CORES();
  // The switches back to their defaults however the test ends.
  struct Defaults {
    ~Defaults() {
      detail::set_conv_feed(detail::ConvFeed::patch);
      detail::set_conv_halo(true);
    }
  } defaults;
  const SwappedTiles swapped(true);
  // The nine-box swapped kernels (halo tiles, their own test below, tile the pixels differently,
  // so their column sums are added in another order).
  detail::set_conv_halo(false);
  int swapped_runs[2] = {};  // forward, backward-data
  for (const Conv2dShape s : {Conv2dShape{3, 10, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 28, 28, 64, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 20, 24, 128, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 20, 24, 128, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 9, 13, 64, 64, 2, 3, 1, 1, 1, 0},
                              Conv2dShape{3, 8, 8, 64, 64, 1, 1, 1, 1, 0, 0}}) {
    SCOPED_TRACE(shape_text(s));
    // Swapped only where the output has 64 channels; and only without split-K, which the planner
    // may choose for a short M (C = 128 -> K = 64 over 2 x 20 x 24 = 960 pixels: 8 tiles of 18
    // k-blocks, split 6
    // ways, so it runs unswapped: the 4-image case runs swapped).
    const bool fwd_swapped = detail::conv2d_swapped_tiles(s, false);
    const bool bwd_swapped = detail::conv2d_swapped_tiles(s, true);
    EXPECT_TRUE(!fwd_swapped || s.k == 64);
    EXPECT_TRUE(!bwd_swapped || s.c == 64);
    swapped_runs[0] += fwd_swapped;
    swapped_runs[1] += bwd_swapped;
    const TypedConvCase c(s, 41);
    TypedConvCase::Outputs out[3];  // swapped, swapped and streamed, unswapped
    for (int run = 0; run < 3; ++run) {
      detail::set_conv_swapped(run < 2);
      detail::set_conv_feed(run == 1 ? detail::ConvFeed::patch_streamed : detail::ConvFeed::patch);
      out[run] = c.run();
    }
    detail::set_conv_swapped(true);
    detail::set_conv_feed(detail::ConvFeed::patch);
    const char* names[3] = {"swapped", "swapped, filters streamed", "unswapped"};
    for (int run = 0; run < 3; ++run) {
      SCOPED_TRACE(names[run]);
      c.expect_within_references(out[run]);
    }
    EXPECT_EQ(out[0].y, out[1].y) << "resident and streamed filters: forward";
    EXPECT_EQ(out[0].dx, out[1].dx) << "resident and streamed filters: backward-data";
    EXPECT_TRUE(testing::bitwise_equal(out[0].sums, out[1].sums));
    // The same bits as the unswapped kernels: wgmma evidently adds the products in the same order
    // with the roles swapped (on the H200 no output of these shapes differed), and both
    // epilogues round alike.
    if (fwd_swapped) {
      EXPECT_EQ(out[0].y, out[2].y) << "swapped and unswapped: forward";
    }
    if (bwd_swapped) {
      EXPECT_EQ(out[0].dx, out[2].dx) << "swapped and unswapped: backward-data";
    }
  }
  // Each pass: 1, 6 and 9 k-blocks (filters resident) and 18 (streamed), 5 shapes.
  EXPECT_GE(swapped_runs[0], 5) << "too few forwards ran swapped";
  EXPECT_GE(swapped_runs[1], 5) << "too few backward-data runs were swapped";
}

// Halo tiles (the swapped 3 x 3 layers over 64 channels: each tile's input loaded once with its
// border, the nine taps read as views of it shifted by whole pixels): the forward with bias and
// ReLU and backward-data with the mask and the column sums against the double references with the
// bf16 output's bound, no poisoned output left, and the same output bits as the nine-box swapped
// kernels (the same products in the same order; only the tiling of the pixels differs). Outputs
// that the 8 x 16 patches tile exactly and ones they overhang on either side (12 x 20, 9 x 17), pad
// 0 (backward-data's view then pads by 2) and images where both consumers take several tiles.
TEST(Conv2dTcTyped, HaloTilesAgainstTheReference) {
  CUDP_REQUIRE_TENSOR_CORES();
  struct Defaults {
    ~Defaults() {
      detail::set_conv_halo(true);
      detail::set_conv_halo_wide(detail::HaloWide::exact);
    }
  } defaults;
  const SwappedTiles swapped(true);  // halo tiles go with the swapped ones
  // The swapped kernels' halo tiles alone (should the planner give a shape a wider tile, the wide
  // halo tiles have their own test).
  detail::set_conv_halo_wide(detail::HaloWide::off);
  int halo_runs[2] = {};  // forward, backward-data
  for (const Conv2dShape s : {Conv2dShape{2, 32, 32, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{3, 20, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{3, 17, 9, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 20, 22, 64, 64, 3, 3, 1, 1, 0, 0},
                              Conv2dShape{4, 48, 40, 64, 64, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(shape_text(s));
    detail::set_conv_halo(true);
    const bool fwd_halo = detail::conv2d_halo_tiles(s, false);
    const bool bwd_halo = detail::conv2d_halo_tiles(s, true);
    // Every shape here has the halo tiles' geometry: they run wherever the swapped tiles do (not
    // under split-K, which the planner may choose for few tiles).
    EXPECT_EQ(fwd_halo, detail::conv2d_swapped_tiles(s, false));
    EXPECT_EQ(bwd_halo, detail::conv2d_swapped_tiles(s, true));
    halo_runs[0] += fwd_halo;
    halo_runs[1] += bwd_halo;
    const TypedConvCase c(s, 51);
    TypedConvCase::Outputs out[2];  // halo tiles, nine boxes
    for (int run = 0; run < 2; ++run) {
      detail::set_conv_halo(run == 0);
      if (run == 1) {
        EXPECT_FALSE(detail::conv2d_halo_tiles(s, false));
        EXPECT_FALSE(detail::conv2d_halo_tiles(s, true));
      }
      out[run] = c.run();
    }
    detail::set_conv_halo(true);
    const char* names[2] = {"halo tiles", "nine boxes"};
    for (int run = 0; run < 2; ++run) {
      SCOPED_TRACE(names[run]);
      c.expect_within_references(out[run]);
    }
    EXPECT_EQ(out[0].y, out[1].y) << "halo tiles and nine boxes: forward";
    EXPECT_EQ(out[0].dx, out[1].dx) << "halo tiles and nine boxes: backward-data";
  }
  EXPECT_GE(halo_runs[0], 4) << "too few forwards took halo tiles";
  EXPECT_GE(halo_runs[1], 4) << "too few backward-data runs took halo tiles";
}

// Halo tiles of the wide layers (tiles 128 or 256 channels wide: the input box of a channel block
// held in a ring of its own while the block's 9 filter k-blocks stream through a second ring; the
// ping-pong schedule at 128, the cooperative one at 256): the forward with bias and ReLU and
// backward-data with the mask and the column sums against the double references with the bf16
// output's bound, with and without halo tiles, at both tile widths (forced: the planner gives such
// small shapes 64-wide tiles). The sums run channel block by channel block, so the bits are not the
// nine-box kernels'. 1 to 4 channel blocks, a partial tile column (n = 192 in tiles of 128, or 128
// in tiles of 256), patches over the output's right edge, pad 0, and the `pairs` tiling (8 x 8
// patches over two images, for heights that are multiples of 8 only: 24 x 24, 8 x 16).
TEST(Conv2dTcTyped, WideHaloTilesAgainstTheReference) {
  CUDP_REQUIRE_TENSOR_CORES();
  struct Defaults {
    ~Defaults() {
      detail::set_conv_halo(true);
      detail::set_conv_halo_wide(detail::HaloWide::exact);
      detail::set_conv_tile_n(0);
    }
  } defaults;
  const SwappedTiles swapped(true);  // the library's default, whatever the tests' main was told
  // What the library runs: halo tiles where the patches tile the output exactly, not at 56 x 56.
  detail::set_conv_tile_n(256);
  EXPECT_TRUE(detail::conv2d_halo_tiles(Conv2dShape{1, 32, 16, 256, 256, 3, 3, 1, 1, 1, 1}, false));
  EXPECT_FALSE(
      detail::conv2d_halo_tiles(Conv2dShape{1, 56, 56, 256, 256, 3, 3, 1, 1, 1, 1}, false));
  EXPECT_FALSE(
      detail::conv2d_halo_tiles(Conv2dShape{2, 24, 24, 128, 128, 3, 3, 1, 1, 1, 1}, false));
  detail::set_conv_halo_wide(detail::HaloWide::pairs);  // 8 x 8 patches over image pairs
  EXPECT_TRUE(detail::conv2d_halo_tiles(Conv2dShape{2, 56, 56, 256, 256, 3, 3, 1, 1, 1, 1}, false));
  EXPECT_TRUE(detail::conv2d_halo_tiles(Conv2dShape{2, 24, 24, 128, 128, 3, 3, 1, 1, 1, 1}, false));
  EXPECT_FALSE(detail::conv2d_halo_tiles(Conv2dShape{3, 24, 24, 128, 128, 3, 3, 1, 1, 1, 1}, false))
      << "an odd number of images";
  // The tests run the patches that hang over the edges too (and the pairs).
  detail::set_conv_halo_wide(detail::HaloWide::covering);
  EXPECT_TRUE(detail::conv2d_halo_tiles(Conv2dShape{1, 56, 56, 256, 256, 3, 3, 1, 1, 1, 1}, false));
  int halo_runs[2][2] = {};  // [tile 128, 256][forward, backward-data]
  for (const Conv2dShape s : {Conv2dShape{2, 16, 16, 128, 256, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 16, 16, 128, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 32, 30, 128, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{1, 16, 24, 192, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{1, 34, 26, 64, 128, 3, 3, 1, 1, 0, 0},
                              Conv2dShape{2, 24, 24, 128, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 8, 16, 128, 256, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(shape_text(s));
    const TypedConvCase c(s, 61);
    for (const int tile_n : {128, 256}) {
      for (const bool halo : {true, false}) {
        SCOPED_TRACE(::testing::Message()
                     << "tile width " << tile_n << (halo ? ", halo tiles" : ", nine boxes"));
        detail::set_conv_tile_n(tile_n);
        detail::set_conv_halo(halo);
        const bool fwd_halo = detail::conv2d_halo_tiles(s, false);
        const bool bwd_halo = detail::conv2d_halo_tiles(s, true);
        if (halo) {
          halo_runs[tile_n / 256][0] += fwd_halo;
          halo_runs[tile_n / 256][1] += bwd_halo;
        } else {
          EXPECT_FALSE(fwd_halo || bwd_halo);
        }
        c.expect_within_references(c.run());
      }
    }
  }
  // Forward: 7 shapes at 256 and 6 at 128 (the 64 -> 128 layer keeps its filters resident there);
  // backward-data: the 6 whose view the patches tile or cover to 7/8, at each width.
  EXPECT_GE(halo_runs[0][0], 6) << "too few 128-wide forwards took halo tiles";
  EXPECT_GE(halo_runs[1][0], 7) << "too few 256-wide forwards took halo tiles";
  EXPECT_GE(halo_runs[0][1], 6) << "too few 128-wide backward-data runs took halo tiles";
  EXPECT_GE(halo_runs[1][1], 6) << "too few 256-wide backward-data runs took halo tiles";
}

// The bf16 backward-weight's split-K work items split-major (the default) or tile-major: the same
// items, each summing its k-range in the same order, and the same fixed-order reduction, so the
// same bits. Layers of 64 output channels (dw^T, kWgradTmaT) and more (kWgradTma), beta 1.
TEST(Conv2dTcTyped, WgradOrderGivesTheSameBits) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const Conv2dShape s : {Conv2dShape{4, 28, 28, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 28, 28, 128, 256, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{4, 14, 14, 256, 512, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << "C " << s.c << " K " << s.k << " H " << s.h);
    const std::vector<float> w0 = testing::random_vector(size_t(s.w_size()), 33);
    DeviceBuffer<uint16_t> x(bf16_bits(operand(size_t(s.x_size()), 31, Math::BF16))),
        dy(bf16_bits(operand(size_t(s.y_size()), 32, Math::BF16)));
    std::vector<float> got[2];
    for (int tile_major = 0; tile_major < 2; ++tile_major) {
      detail::set_wgrad_split_major(tile_major == 0);
      DeviceBuffer<float> dw(w0);
      conv2d_backward_weight_tc(s, x.get(), dy.get(), dw.get(), 1.f, nullptr);
      CUDP_CUDA_CHECK(cudaDeviceSynchronize());
      got[tile_major] = dw.download();
    }
    detail::set_wgrad_split_major(true);
    int64_t bad = 0;
    for (size_t i = 0; i < got[0].size(); ++i) {
      bad += std::memcmp(&got[0][i], &got[1][i], sizeof(float)) != 0;
    }
    EXPECT_EQ(bad, 0) << "of " << got[0].size() << " weights";
  }
}

// The bias gradient of the bf16 backward-weight (dbias += dy's column sums). Where the kernel takes
// it from the dy tiles it loads (the patch feed: kWgradTma, and kWgradTmaT for 64 or fewer output
// channels), and in the separate reduction elsewhere (the narrow first layer, the gather feed,
// channels padded to 8). dy holds multiples of 1/8 in [-4, 4] and dbias starts at multiples of
// 1/8: every partial sum is then exact in fp32 (far below 2^21), in any order, so the result must
// equal the exact sum bit for bit: a row summed twice or missed, or a channel mixed up, shows.
// The product must not change: dw is compared bit for bit with a run without dbias. Both with the
// fusion switched on (detail::set_wgrad_bias_fusion) and off (the default: every shape separate).
class BiasFusion : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    CUDP_REQUIRE_TENSOR_CORES();
    detail::set_wgrad_bias_fusion(GetParam());
  }
  void TearDown() override { detail::set_wgrad_bias_fusion(false); }
};

TEST_P(BiasFusion, BackwardWeightTakesTheBiasGradient) {
  int fused = 0, separate = 0;
  for (const Conv2dShape s : {Conv2dShape{4, 28, 28, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{16, 56, 56, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{3, 10, 12, 64, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 56, 56, 64, 128, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 28, 28, 128, 256, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 9, 13, 128, 192, 5, 5, 1, 1, 2, 2},
                              Conv2dShape{8, 2, 2, 512, 512, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 9, 11, 64, 40, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 32, 32, 8, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 7, 9, 72, 64, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 7, 7, 64, 128, 3, 3, 2, 2, 1, 1}}) {
    SCOPED_TRACE(shape_text(s));
    ++(detail::conv2d_backward_weight_fuses_bias(s) ? fused : separate);
    std::vector<float> dy_values = testing::random_vector(size_t(s.y_size()), 41, -4.f, 4.f);
    for (float& v : dy_values) v = std::round(v * 8.f) / 8.f;
    std::vector<float> db0 = testing::random_vector(size_t(s.k), 42, -64.f, 64.f);
    for (float& v : db0) v = std::round(v * 8.f) / 8.f;
    std::vector<double> want(db0.begin(), db0.end());
    const int64_t pixels = s.y_size() / s.k;
    for (int64_t i = 0; i < pixels; ++i) {
      for (int k = 0; k < s.k; ++k) want[size_t(k)] += dy_values[size_t(i * s.k + k)];
    }
    const std::vector<float> w0 = testing::random_vector(size_t(s.w_size()), 43);
    DeviceBuffer<uint16_t> x(bf16_bits(operand(size_t(s.x_size()), 44, Math::BF16))),
        dy(bf16_bits(dy_values));
    DeviceBuffer<float> dw(w0), dw_alone(w0), db(db0);
    conv2d_backward_weight_tc(s, x.get(), dy.get(), dw.get(), 1.f, nullptr, db.get());
    conv2d_backward_weight_tc(s, x.get(), dy.get(), dw_alone.get(), 1.f, nullptr);
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = db.download(), dw_got = dw.download(),
                             dw_want = dw_alone.download();
    int64_t bad = 0;
    for (int k = 0; k < s.k; ++k) {
      if (double(got[size_t(k)]) != want[size_t(k)]) {
        if (bad++ < 3) {
          ADD_FAILURE() << "channel " << k << ": got " << got[size_t(k)] << " want "
                        << want[size_t(k)];
        }
      }
    }
    EXPECT_EQ(bad, 0) << "of " << s.k << " channels";
    EXPECT_EQ(std::memcmp(dw_got.data(), dw_want.data(), dw_got.size() * sizeof(float)), 0)
        << "the bias sums changed the weight gradient";
  }
  if (GetParam()) {
    EXPECT_GE(fused, 6) << "too few shapes took the fused bias gradient";
    EXPECT_GE(separate, 3) << "too few shapes took the separate bias gradient";
  } else {
    EXPECT_EQ(fused, 0) << "the fusion is off, yet shapes took it";
  }
}

INSTANTIATE_TEST_SUITE_P(OnOff, BiasFusion, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "fused" : "separate"; });

// The typed entry points on bf16 tensors with a bf16 output, as a bf16 training step calls them.
TEST(Conv2dTcTyped, Bf16InBf16Out) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Conv2dShape s{2, 12, 12, 64, 128, 3, 3, 1, 1, 1, 1};
  const std::vector<float> x = operand(size_t(s.x_size()), 7, Math::BF16);
  const std::vector<float> w = operand(size_t(s.w_size()), 8, Math::BF16);
  DeviceBuffer<uint16_t> dx(bf16_bits(x)), dw(bf16_bits(w)), dy(size_t(s.y_size())),
      ddx(size_t(s.x_size()));
  dy.fill(0xFFFF);
  ddx.fill(0xFFFF);
  ConvOperands ops{Math::BF16, dx.get(), dw.get(), dy.get(), DType::BF16, nullptr, false};
  conv2d_forward_tc(s, ops, nullptr);
  std::vector<float> ref(size_t(s.y_size())), abs_sum(size_t(s.y_size()));
  conv2d_forward_cpu(s, x.data(), w.data(), nullptr, ref.data(), false);
  conv2d_forward_cpu(s, absolute(x).data(), absolute(w).data(), nullptr, abs_sum.data(), false);
  const std::vector<float> got = bf16_widened(dy.download());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - ref[i]), bf16_output_bound(ref[i], abs_sum[i])) << "output " << i;
  }
  // Backward-data, typed: dy here is the bf16 y just computed.
  ConvOperands back{Math::BF16, dy.get(), dw.get(), ddx.get(), DType::BF16, nullptr, false};
  conv2d_backward_data_tc(s, back, nullptr);
  std::vector<float> dy_f = got, dref(size_t(s.x_size())), dabs(size_t(s.x_size()));
  conv2d_backward_data_cpu(s, dy_f.data(), w.data(), dref.data());
  conv2d_backward_data_cpu(s, absolute(dy_f).data(), absolute(w).data(), dabs.data());
  const std::vector<uint16_t> dxb = ddx.download();
  for (size_t i = 0; i < dxb.size(); ++i) {
    ASSERT_LE(std::fabs(bf16_widened(dxb[i]) - dref[i]), bf16_output_bound(dref[i], dabs[i]))
        << "dx " << i;
  }
}

// Backward-weight: dw = beta*dw + dy^T (*) x, compared like the other passes (the reduction runs
// over the n*P*Q pixels; Σ|p| from the reference on |x| and |dy|), with beta = 0 and 1. TF32 takes
// fp32 operands as they are (its operand rounding is part of the bound) and goes through K-major
// copies on a padded pixel grid (kernels/conv2d_tc.cu): shifted taps where C is a multiple of 64
// and the stride 1, an explicit im2col elsewhere, dw^T for K <= 64; the cases cover each. A second
// run must give the same bits (deterministic split-K).
void check_backward_weight(const Conv2dShape& s, Math math, float beta, const std::string& what) {
  const std::vector<float> x = operand(size_t(s.x_size()), 11, math);
  const std::vector<float> dy = operand(size_t(s.y_size()), 12, math);
  const std::vector<float> dw0 = testing::random_vector(size_t(s.w_size()), 13);
  std::vector<float> ref = dw0, abs_sum(size_t(s.w_size()));
  conv2d_backward_weight_cpu(s, x.data(), dy.data(), ref.data(), beta);
  conv2d_backward_weight_cpu(s, absolute(x).data(), absolute(dy).data(), abs_sum.data(), 0.f);
  for (size_t i = 0; i < abs_sum.size(); ++i) abs_sum[i] += std::fabs(beta * dw0[i]);
  // beta 0: dw starts as NaN, which a read would carry into the result (a deferred zero_grad
  // leaves stale gradients there, layers/module.h).
  const std::vector<float> start =
      beta != 0.f ? dw0 : std::vector<float>(dw0.size(), std::numeric_limits<float>::quiet_NaN());
  // The bias gradient on the way (dbias += dy's column sums, any order): the bound of any fp32
  // summation of n terms, (n - 1) u sum|terms| (u = 2^-24), here n = pixels + 1 with dbias's start.
  const std::vector<float> db0 = testing::random_vector(size_t(s.k), 14);
  const int64_t pixels = s.y_size() / s.k;
  std::vector<double> db_want(db0.begin(), db0.end()), db_abs(db_want);
  for (double& v : db_abs) v = std::fabs(v);
  for (int64_t i = 0; i < pixels; ++i) {
    for (int k = 0; k < s.k; ++k) {
      db_want[size_t(k)] += dy[size_t(i * s.k + k)];
      db_abs[size_t(k)] += std::fabs(dy[size_t(i * s.k + k)]);
    }
  }
  DeviceBuffer<float> dx(x), ddy(dy), ddw(start), ddb(db0);
  conv2d_backward_weight(s, dx.get(), ddy.get(), ddw.get(), beta, nullptr, math, {}, ddb.get());
  const std::vector<float> got = ddw.download();
  expect_within_bound(got, ref, abs_sum, math, what);
  const std::vector<float> db_got = ddb.download();
  for (int k = 0; k < s.k; ++k) {
    ASSERT_LE(std::fabs(db_got[size_t(k)] - db_want[size_t(k)]),
              double(pixels) * std::ldexp(1.0, -24) * db_abs[size_t(k)])
        << what << ": bias gradient of channel " << k;
  }
  DeviceBuffer<float> again(start);
  conv2d_backward_weight(s, dx.get(), ddy.get(), again.get(), beta, nullptr, math);
  EXPECT_EQ(std::memcmp(got.data(), again.download().data(), got.size() * sizeof(float)), 0)
      << what << ": a second run gave other bits";
}

TEST_P(Conv2dTcGpu, BackwardWeight) {
  const auto& [c, math, patch_feed] = GetParam();
  check_backward_weight(c.shape, math, 0.f, std::string("backward-weight ") + c.name);
  check_backward_weight(c.shape, math, 1.f, std::string("backward-weight beta 1 ") + c.name);
}

// The TF32 backward-weight of stride-1 layers both ways (detail::set_tf32_wgrad_feed): TMA boxes
// over patches of 32 output pixels transposed in shared memory (kWgradTma / kWgradTmaT on fp32),
// and the K-major copies of x and dy; every case with C a multiple of 32 and K of 4 (dw and dw^T,
// patches over the output's edges, 1x1 and 5x5 filters, VGG's channel progression), each against
// the double-precision reference within the TF32 bound, bitwise deterministic, beta 0 and 1.
class Tf32WgradFeeds : public ::testing::TestWithParam<detail::Tf32WgradFeed> {
 protected:
  void SetUp() override {
    CUDP_REQUIRE_TENSOR_CORES();
    detail::set_tf32_wgrad_feed(GetParam());
  }
  void TearDown() override { detail::set_tf32_wgrad_feed(detail::Tf32WgradFeed::automatic); }
};

TEST_P(Tf32WgradFeeds, BackwardWeight) {
  int ran = 0;
  for (const Case& c : kCases) {
    const Conv2dShape& s = c.shape;
    if (s.stride_h != 1 || s.stride_w != 1 || s.c % 32 != 0 || s.k % 4 != 0) continue;
    ++ran;
    EXPECT_EQ(detail::conv2d_backward_weight_tf32_boxes(s),
              GetParam() == detail::Tf32WgradFeed::boxes)
        << c.name << ": the setting did not choose the kernel";
    check_backward_weight(s, Math::TF32, 0.f, std::string("backward-weight ") + c.name);
    check_backward_weight(s, Math::TF32, 1.f, std::string("backward-weight beta 1 ") + c.name);
  }
  EXPECT_GE(ran, 12) << "too few shapes for the TF32 patch boxes";
}

INSTANTIATE_TEST_SUITE_P(BoxesAndCopies, Tf32WgradFeeds,
                         ::testing::Values(detail::Tf32WgradFeed::boxes,
                                           detail::Tf32WgradFeed::copies),
                         [](const auto& info) {
                           return info.param == detail::Tf32WgradFeed::boxes ? "boxes" : "copies";
                         });

// The TF32 boxes' kernels plan by plan (detail::set_tf32_wgrad_plan): every tile width of dw (K >
// 64: dy as wgmma's A, from registers) and of dw^T (K <= 64: x as A), with split counts that give a
// work item an even number of k-blocks (pairs alone), an odd one of 3 or more (pairs and the odd
// one last), or just one, against the double reference within the TF32 bound, bitwise
// repeatable, beta 0 and 1. The k-blocks are patches of 32 output pixels: 8 x 4 over 3 images of
// 8 x 8 (6 k-blocks: 6, 3, 2 and 1 a work item for splits 1, 2, 3 and 8), 4 x 8 over one image
// of 8 x 12 (3 k-blocks: 3, 2 + 1, 1 and 1).
TEST(Conv2dTcTyped, Tf32WgradBoxesEveryTileWidthAndSplit) {
  CUDP_REQUIRE_TENSOR_CORES();
  struct Defaults {  // however the test ends
    ~Defaults() { detail::set_tf32_wgrad_plan(0, 0); }
  } defaults;
  for (const Conv2dShape s : {Conv2dShape{3, 8, 8, 64, 96, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{1, 8, 12, 32, 36, 3, 3, 1, 1, 1, 1}}) {
    ASSERT_TRUE(detail::conv2d_backward_weight_tf32_boxes(s)) << shape_text(s);
    for (int tile_n : {64, 128, 256}) {
      for (int splits : {1, 2, 3, 8}) {
        detail::set_tf32_wgrad_plan(tile_n, splits);
        const std::string what = "backward-weight " + shape_text(s) + " tile_n " +
                                 std::to_string(tile_n) + " splits " + std::to_string(splits);
        check_backward_weight(s, Math::TF32, splits == 2 ? 1.f : 0.f, what);
      }
    }
  }
}

// Operands converted by the caller (Bf16Operands, what Conv2d passes under bf16) give bit for bit
// what the launchers give when they convert: forward, backward-data and backward-weight, with
// C = 3 (padded to 8) and with channels that need no padding; and the float pointers are then not
// read (null is accepted). Other maths refuse converted operands.
TEST(Conv2dTcTyped, ConvertedOperandsGiveTheSameResults) {
  CUDP_REQUIRE_TENSOR_CORES();
  for (const Conv2dShape s : {Conv2dShape{2, 9, 11, 3, 16, 3, 3, 1, 1, 1, 1},
                              Conv2dShape{2, 10, 7, 64, 24, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << "C " << s.c << " K " << s.k);
    const std::vector<float> x = testing::random_vector(size_t(s.x_size()), 31);
    const std::vector<float> w = testing::random_vector(size_t(s.w_size()), 32);
    const std::vector<float> dy = testing::random_vector(size_t(s.y_size()), 33);
    DeviceBuffer<float> dx_in(x), dw_in(w), ddy(dy);
    const int64_t pixels_in = int64_t(s.n) * s.h * s.w, pixels_out = int64_t(s.n) * s.p() * s.q();
    EXPECT_EQ(bf16_channels(s.c), (s.c + 7) / 8 * 8);
    DeviceBuffer<uint16_t> xb(size_t(pixels_in * bf16_channels(s.c))),
        dyb(size_t(pixels_out * bf16_channels(s.k)));
    conv2d_to_bf16(dx_in.get(), pixels_in, s.c, xb.get(), nullptr);
    conv2d_to_bf16(ddy.get(), pixels_out, s.k, dyb.get(), nullptr);
    // The conversion itself: each value rounded to nearest even, padding channels zero.
    const std::vector<uint16_t> xb_host = xb.download();
    for (int64_t i = 0; i < pixels_in * bf16_channels(s.c); ++i) {
      const int64_t pixel = i / bf16_channels(s.c), ch = i % bf16_channels(s.c);
      const uint16_t want = ch < s.c ? detail::f32_to_bf16_bits(x[size_t(pixel * s.c + ch)]) : 0;
      ASSERT_EQ(xb_host[size_t(i)], want) << "element " << i;
    }
    const Bf16Operands converted{xb.get(), dyb.get()};

    DeviceBuffer<float> y1(size_t(s.y_size())), y2(size_t(s.y_size()));
    conv2d_forward(s, dx_in.get(), dw_in.get(), nullptr, y1.get(), false, nullptr, Math::BF16);
    conv2d_forward(s, nullptr, dw_in.get(), nullptr, y2.get(), false, nullptr, Math::BF16,
                   {xb.get(), nullptr});
    EXPECT_EQ(y1.download(), y2.download()) << "forward";
    DeviceBuffer<float> g1(size_t(s.x_size())), g2(size_t(s.x_size()));
    conv2d_backward_data(s, ddy.get(), dw_in.get(), g1.get(), nullptr, Math::BF16);
    conv2d_backward_data(s, nullptr, dw_in.get(), g2.get(), nullptr, Math::BF16, converted);
    EXPECT_EQ(g1.download(), g2.download()) << "backward-data";
    DeviceBuffer<float> w1(size_t(s.w_size())), w2(size_t(s.w_size()));
    conv2d_backward_weight(s, dx_in.get(), ddy.get(), w1.get(), 0.f, nullptr, Math::BF16);
    conv2d_backward_weight(s, nullptr, nullptr, w2.get(), 0.f, nullptr, Math::BF16, converted);
    EXPECT_EQ(w1.download(), w2.download()) << "backward-weight";
    EXPECT_THROW(conv2d_forward(s, dx_in.get(), dw_in.get(), nullptr, y1.get(), false, nullptr,
                                Math::FP32, converted),
                 ValueError);
  }
}

// The first layer's kernels (kernels/conv2d_narrow.h; their TF32 variants run in the Shapes cases
// with 1 to 4 channels and K = 64) through the typed entry points a bf16 training step uses: bf16 x
// of 8 channels (3 real, the rest zero), bias and ReLU into bf16 and fp32 y, and backward-weight
// accumulating into dw (beta 1); against the CPU reference, bitwise deterministic, and within the
// same bound as the mainloop (the gather feed) on the same operands. VGG-16's first layer (padded)
// must take them: a change that turned them off would otherwise pass every accuracy test.
TEST(Conv2dTcTyped, NarrowFirstLayer) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Conv2dShape vgg{64, 224, 224, 8, 64, 3, 3, 1, 1, 1, 1};
  alignas(16) static uint16_t dummy[8] = {};  // only the pointers' alignment is looked at
  const ConvOperands vgg_ops{Math::BF16, dummy, dummy, dummy, DType::BF16, nullptr, true};
  EXPECT_TRUE(detail::narrow_forward_applies(vgg, vgg_ops));
  EXPECT_TRUE(detail::narrow_wgrad_applies(vgg, dummy, dummy));
  // TF32: the float launcher pads x to 4 channels for the forward; backward-weight reads x as it
  // is.
  Conv2dShape vgg_tf32 = vgg;
  vgg_tf32.c = 4;
  ConvOperands tf32_ops = vgg_ops;
  tf32_ops.math = Math::TF32;
  tf32_ops.y_type = DType::F32;
  EXPECT_TRUE(detail::narrow_forward_applies(vgg_tf32, tf32_ops));
  vgg_tf32.c = 3;
  EXPECT_TRUE(detail::narrow_wgrad_tf32_applies(vgg_tf32, reinterpret_cast<const float*>(dummy)));
  for (const Conv2dShape real : {Conv2dShape{3, 19, 70, 3, 64, 3, 3, 1, 1, 1, 1},
                                 Conv2dShape{2, 32, 32, 3, 64, 3, 3, 1, 1, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << real.n << "x" << real.h << "x" << real.w);
    Conv2dShape s = real;
    s.c = 8;
    // Operands with channels 3..7 zero, as conv2d_to_bf16 and conv2d_filters_to_bf16 pad them.
    std::vector<float> x = operand(size_t(s.x_size()), 41, Math::BF16);
    std::vector<float> w = operand(size_t(s.w_size()), 42, Math::BF16);
    for (size_t i = 0; i < x.size(); ++i) {
      if (i % 8 >= 3) x[i] = 0.f;
    }
    for (size_t i = 0; i < w.size(); ++i) {
      if (i % 8 >= 3) w[i] = 0.f;
    }
    const std::vector<float> bias = testing::random_vector(size_t(s.k), 43);
    std::vector<float> ref(size_t(s.y_size())), abs_sum(size_t(s.y_size()));
    conv2d_forward_cpu(s, x.data(), w.data(), bias.data(), ref.data(), true);
    conv2d_forward_cpu(s, absolute(x).data(), absolute(w).data(), nullptr, abs_sum.data(), false);
    DeviceBuffer<uint16_t> dx(bf16_bits(x)), dw(bf16_bits(w)), yb(size_t(s.y_size()));
    DeviceBuffer<float> db(bias), yf(size_t(s.y_size()));
    ConvOperands ops{Math::BF16, dx.get(), dw.get(), yb.get(), DType::BF16, db.get(), true};
    ASSERT_TRUE(detail::narrow_forward_applies(s, ops));
    std::vector<uint16_t> first;
    for (int run = 0; run < 2; ++run) {
      yb.fill(0xFFFF);
      conv2d_forward_tc(s, ops, nullptr);
      const std::vector<uint16_t> got = yb.download();
      if (run == 1) {
        EXPECT_EQ(got, first) << "forward not deterministic";
        break;
      }
      first = got;
      const std::vector<float> v = bf16_widened(got);
      for (size_t i = 0; i < v.size(); ++i) {
        ASSERT_LE(std::fabs(v[i] - ref[i]), bf16_output_bound(ref[i], abs_sum[i]))
            << "bf16 y " << i;
      }
    }
    // fp32 y: the fp32 bound, and the mainloop's result (gather feed) within it too.
    ops.y = yf.get();
    ops.y_type = DType::F32;
    yf.fill(kPoison);
    conv2d_forward_tc(s, ops, nullptr);
    expect_within_bound(yf.download(), ref, abs_sum, Math::BF16, "narrow forward, fp32 y");
    detail::set_conv_feed(detail::ConvFeed::gather);
    yf.fill(kPoison);
    conv2d_forward_tc(s, ops, nullptr);
    detail::set_conv_feed(detail::ConvFeed::patch);
    expect_within_bound(yf.download(), ref, abs_sum, Math::BF16, "mainloop forward, fp32 y");

    // Backward-weight, accumulating (beta 1) into a random dw.
    const std::vector<float> dy = operand(size_t(s.y_size()), 44, Math::BF16);
    const std::vector<float> dw0 = testing::random_vector(size_t(s.w_size()), 45);
    std::vector<float> wref = dw0, wabs(size_t(s.w_size()));
    conv2d_backward_weight_cpu(s, x.data(), dy.data(), wref.data(), 1.f);
    conv2d_backward_weight_cpu(s, absolute(x).data(), absolute(dy).data(), wabs.data(), 0.f);
    for (size_t i = 0; i < wabs.size(); ++i) wabs[i] += std::fabs(dw0[i]);
    DeviceBuffer<uint16_t> ddy(bf16_bits(dy));
    ASSERT_TRUE(detail::narrow_wgrad_applies(s, dx.get(), ddy.get()));
    DeviceBuffer<float> gw(dw0), gw2(dw0);
    conv2d_backward_weight_tc(s, dx.get(), ddy.get(), gw.get(), 1.f, nullptr);
    const std::vector<float> got = gw.download();
    expect_within_bound(got, wref, wabs, Math::BF16, "narrow backward-weight");
    conv2d_backward_weight_tc(s, dx.get(), ddy.get(), gw2.get(), 1.f, nullptr);
    EXPECT_EQ(std::memcmp(got.data(), gw2.download().data(), got.size() * 4), 0)
        << "backward-weight not deterministic";
  }
}

// Paired taps (kernels/conv2d_narrow.h): x of 8 bf16 channels of which only the first 3 or 4 are
// live (the rest zeros, as a layer pads them; the filters' padding channels random, which the
// paired kernels must not need to be zeros), forward and backward-weight against the double
// reference; the forward also without the claim (five k steps) within the same bound; dw's
// channels past 4 left exactly as they were (their gradient is zero); and the float launcher a
// layer uses (fp32 x and w of 3 channels, Math::BF16) on the paired kernels too.
TEST(Conv2dTcTyped, NarrowPairedTaps) {
  CUDP_REQUIRE_TENSOR_CORES();
  EXPECT_TRUE(detail::narrow_paired_taps(Conv2dShape{64, 224, 224, 8, 64, 3, 3, 1, 1, 1, 1}, 3));
  EXPECT_FALSE(detail::narrow_paired_taps(Conv2dShape{64, 224, 224, 8, 64, 3, 3, 1, 1, 1, 1}, 5));
  EXPECT_FALSE(detail::narrow_paired_taps(Conv2dShape{64, 224, 224, 8, 64, 3, 3, 1, 1, 1, 1}, 0));
  EXPECT_FALSE(detail::narrow_paired_taps(Conv2dShape{64, 224, 224, 8, 64, 1, 1, 1, 1, 0, 0}, 3));
  for (const int live : {3, 4}) {
    for (const Conv2dShape real : {Conv2dShape{3, 19, 70, live, 64, 3, 3, 1, 1, 1, 1},
                                   Conv2dShape{2, 32, 32, live, 64, 3, 3, 1, 1, 1, 1},
                                   Conv2dShape{1, 9, 33, live, 64, 3, 3, 1, 1, 0, 0}}) {
      SCOPED_TRACE(::testing::Message() << live << " live channels, " << real.n << "x" << real.h
                                        << "x" << real.w << " pad " << real.pad_h);
      Conv2dShape s = real;
      s.c = 8;
      std::vector<float> x = operand(size_t(s.x_size()), 51, Math::BF16);
      const std::vector<float> w = operand(size_t(s.w_size()), 52, Math::BF16);
      for (size_t i = 0; i < x.size(); ++i) {
        if (int(i % 8) >= live) x[i] = 0.f;
      }
      const std::vector<float> bias = testing::random_vector(size_t(s.k), 53);
      std::vector<float> ref(size_t(s.y_size())), abs_sum(size_t(s.y_size()));
      conv2d_forward_cpu(s, x.data(), w.data(), bias.data(), ref.data(), true);
      conv2d_forward_cpu(s, absolute(x).data(), absolute(w).data(), nullptr, abs_sum.data(), false);
      DeviceBuffer<uint16_t> dx(bf16_bits(x)), dw(bf16_bits(w)), yb(size_t(s.y_size()));
      DeviceBuffer<float> db(bias), yf(size_t(s.y_size()));
      ConvOperands ops{Math::BF16, dx.get(), dw.get(), yb.get(), DType::BF16, db.get(), true};
      ops.live_channels = live;
      ASSERT_TRUE(detail::narrow_forward_applies(s, ops));
      ASSERT_TRUE(detail::narrow_paired_taps(s, live));
      yb.fill(0xFFFF);
      conv2d_forward_tc(s, ops, nullptr);
      const std::vector<uint16_t> got = yb.download();
      const std::vector<float> v = bf16_widened(got);
      for (size_t i = 0; i < v.size(); ++i) {
        ASSERT_LE(std::fabs(v[i] - ref[i]), bf16_output_bound(ref[i], abs_sum[i])) << "y " << i;
      }
      yb.fill(0xFFFF);
      conv2d_forward_tc(s, ops, nullptr);
      EXPECT_EQ(yb.download(), got) << "paired forward not deterministic";
      ops.y = yf.get();
      ops.y_type = DType::F32;
      for (const int claim : {live, 0}) {
        ops.live_channels = claim;
        yf.fill(kPoison);
        conv2d_forward_tc(s, ops, nullptr);
        expect_within_bound(yf.download(), ref, abs_sum, Math::BF16,
                            claim ? "paired forward, fp32 y" : "unpaired forward, fp32 y");
      }

      const std::vector<float> dy = operand(size_t(s.y_size()), 54, Math::BF16);
      const std::vector<float> dw0 = testing::random_vector(size_t(s.w_size()), 55);
      std::vector<float> wref = dw0, wabs(size_t(s.w_size()));
      conv2d_backward_weight_cpu(s, x.data(), dy.data(), wref.data(), 1.f);
      conv2d_backward_weight_cpu(s, absolute(x).data(), absolute(dy).data(), wabs.data(), 0.f);
      for (size_t i = 0; i < wabs.size(); ++i) wabs[i] += std::fabs(dw0[i]);
      DeviceBuffer<uint16_t> ddy(bf16_bits(dy));
      DeviceBuffer<float> gw(dw0), gw2(dw0);
      conv2d_backward_weight_tc(s, dx.get(), ddy.get(), gw.get(), 1.f, nullptr, nullptr, live);
      const std::vector<float> gotw = gw.download();
      expect_within_bound(gotw, wref, wabs, Math::BF16, "paired backward-weight");
      for (size_t i = 0; i < gotw.size(); ++i) {
        if (i % 8 >= 4) {
          ASSERT_EQ(gotw[i], dw0[i]) << "dw channel " << i % 8 << " at " << i;
        }
      }
      conv2d_backward_weight_tc(s, dx.get(), ddy.get(), gw2.get(), 1.f, nullptr, nullptr, live);
      EXPECT_EQ(std::memcmp(gotw.data(), gw2.download().data(), gotw.size() * 4), 0)
          << "paired backward-weight not deterministic";

      // The float launcher on the live channels alone (it pads them, and claims them).
      std::vector<float> xr(size_t(real.x_size())), wr(size_t(real.w_size()));
      for (size_t i = 0; i < xr.size(); ++i) xr[i] = x[i / live * 8 + i % live];
      for (size_t i = 0; i < wr.size(); ++i) wr[i] = w[i / live * 8 + i % live];
      std::vector<float> rref(size_t(real.y_size())), rabs(size_t(real.y_size()));
      conv2d_forward_cpu(real, xr.data(), wr.data(), bias.data(), rref.data(), true);
      conv2d_forward_cpu(real, absolute(xr).data(), absolute(wr).data(), nullptr, rabs.data(),
                         false);
      DeviceBuffer<float> fx(xr), fw(wr), fy(size_t(real.y_size()));
      fy.fill(kPoison);
      conv2d_forward(real, fx.get(), fw.get(), db.get(), fy.get(), true, nullptr, Math::BF16);
      expect_within_bound(fy.download(), rref, rabs, Math::BF16, "float launcher forward");
      std::vector<float> rw(size_t(real.w_size())), rwabs(size_t(real.w_size()));
      conv2d_backward_weight_cpu(real, xr.data(), dy.data(), rw.data(), 0.f);
      conv2d_backward_weight_cpu(real, absolute(xr).data(), absolute(dy).data(), rwabs.data(), 0.f);
      DeviceBuffer<float> fdy(dy), fdw(size_t(real.w_size()));
      fdw.fill(kPoison);
      conv2d_backward_weight(real, fx.get(), fdy.get(), fdw.get(), 0.f, nullptr, Math::BF16);
      expect_within_bound(fdw.download(), rw, rwabs, Math::BF16, "float launcher backward-weight");
    }
  }
}

// Which byte offset of an MN-major wgmma descriptor holds the stride between 8-row groups along k
// and which the stride between 64-wide slabs along m/n: the kernels assume one assignment
// (kWgradAltByDefault in kernels/conv2d_tc.cu); this test shows that exactly that one computes
// the right product on this GPU, so a wrong assumption cannot pass silently.
TEST(Conv2dTcTyped, WgradDescriptorLayout) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Conv2dShape s{2, 12, 12, 128, 128, 3, 3, 1, 1, 1, 1};
  const std::vector<float> x = operand(size_t(s.x_size()), 21, Math::BF16);
  const std::vector<float> dy = operand(size_t(s.y_size()), 22, Math::BF16);
  std::vector<float> ref(size_t(s.w_size()));
  conv2d_backward_weight_cpu(s, x.data(), dy.data(), ref.data(), 0.f);
  DeviceBuffer<float> dx(x), ddy(dy), ddw(size_t(s.w_size()));
  double rel[2];
  for (int variant : {0, 1}) {
    detail::set_wgrad_descriptor_variant(variant);
    ddw.fill(kPoison);
    conv2d_backward_weight(s, dx.get(), ddy.get(), ddw.get(), 0.f, nullptr, Math::BF16);
    const std::vector<float> got = ddw.download();
    double e = 0, r = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      e += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
      r += double(ref[i]) * ref[i];
    }
    rel[variant] = std::sqrt(e / r);
  }
  detail::set_wgrad_descriptor_variant(-1);
  std::printf("relative L2 error of backward-weight: descriptor variant 0 %.3g, variant 1 %.3g\n",
              rel[0], rel[1]);
  EXPECT_TRUE((rel[0] < 1e-4) != (rel[1] < 1e-4)) << "exactly one layout should be right";
  DeviceBuffer<float> again(size_t(s.w_size()));
  conv2d_backward_weight(s, dx.get(), ddy.get(), again.get(), 0.f, nullptr, Math::BF16);
  const std::vector<float> got = again.download();
  double e = 0, r = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    e += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  EXPECT_LT(std::sqrt(e / r), 1e-4) << "the default descriptor layout is the wrong one";
}

}  // namespace
}  // namespace cudp::kernels
