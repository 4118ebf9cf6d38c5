// Host tests of the layout, bf16 and TF32 CPU references (kernels/layout.h): hand-checked indices,
// round trips, bf16 rounding of known values and against CUDA's own host-side conversion, TF32
// truncation of known values and against a frexp-based bound, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/compare.h"
#include "engine/core/error.h"
#include "kernels/layout.h"

namespace cudp::kernels {
namespace {

std::vector<float> iota(size_t n) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), 0.0f);
  return v;
}

TEST(Layout, NchwToNhwcHandCheckedIndex) {
  // n = 2, c = 3, h = 2, w = 2, src[i] = i. Element (n=1, c=2, h=1, w=0) sits at NCHW index
  // ((1*3 + 2)*2 + 1)*2 + 0 = 22 and goes to NHWC index ((1*2 + 1)*2 + 0)*3 + 2 = 20.
  const std::vector<float> src = iota(24);
  std::vector<float> dst(24, testing::kPoison);
  nchw_to_nhwc_cpu(src.data(), dst.data(), 2, 3, 2, 2);
  EXPECT_EQ(dst[20], 22.0f);
  // The first pixel's channels come from the three planes of image 0: 0, 4, 8.
  EXPECT_EQ(dst[0], 0.0f);
  EXPECT_EQ(dst[1], 4.0f);
  EXPECT_EQ(dst[2], 8.0f);
  EXPECT_EQ(dst[3], 1.0f);    // pixel (0, 1), channel 0
  EXPECT_EQ(dst[12], 12.0f);  // image 1 starts with its channel 0 plane
}

TEST(Layout, OihwToKrscHandCheckedIndex) {
  // k = 2, c = 3, r = 1, s = 2: OIHW index ((k*3 + c)*1 + r)*2 + s -> KRSC ((k*1 + r)*2 + s)*3 + c.
  const std::vector<float> src = iota(12);
  std::vector<float> dst(12, testing::kPoison);
  oihw_to_krsc_cpu(src.data(), dst.data(), 2, 3, 1, 2);
  EXPECT_EQ(dst, (std::vector<float>{0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11}));
}

TEST(Layout, NchwNhwcRoundTripsOddSizes) {
  for (auto [n, c, h, w] :
       {std::array<int64_t, 4>{1, 1, 1, 1}, {2, 3, 5, 7}, {3, 17, 4, 9}, {1, 64, 3, 3}}) {
    const std::vector<float> src = testing::random_vector(n * c * h * w, 1);
    std::vector<float> mid(src.size(), testing::kPoison), back(src.size(), testing::kPoison);
    nchw_to_nhwc_cpu(src.data(), mid.data(), n, c, h, w);
    nhwc_to_nchw_cpu(mid.data(), back.data(), n, c, h, w);
    EXPECT_ALL_CLOSE(back, src, 0.0, 0.0);
    // Every element of the NHWC tensor is the NCHW element its indices name:
    for (int64_t in = 0; in < n; ++in) {
      for (int64_t ic = 0; ic < c; ++ic) {
        for (int64_t p = 0; p < h * w; ++p) {
          ASSERT_EQ(mid[(in * h * w + p) * c + ic], src[(in * c + ic) * h * w + p]);
        }
      }
    }
  }
}

TEST(Layout, OihwKrscRoundTripsOddSizes) {
  for (auto [k, c, r, s] :
       {std::array<int64_t, 4>{1, 1, 1, 1}, {5, 3, 3, 3}, {7, 11, 1, 5}, {4, 2, 3, 2}}) {
    const std::vector<float> src = testing::random_vector(k * c * r * s, 2);
    std::vector<float> mid(src.size(), testing::kPoison), back(src.size(), testing::kPoison);
    oihw_to_krsc_cpu(src.data(), mid.data(), k, c, r, s);
    krsc_to_oihw_cpu(mid.data(), back.data(), k, c, r, s);
    EXPECT_ALL_CLOSE(back, src, 0.0, 0.0);
  }
}

TEST(Layout, EmptyAndBadArguments) {
  EXPECT_NO_THROW(nchw_to_nhwc_cpu(static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
                                   0, 3, 4, 4));
  EXPECT_NO_THROW(krsc_to_oihw_cpu(nullptr, nullptr, 8, 0, 3, 3));
  std::vector<float> a(24), b(24);
  EXPECT_THROW(nchw_to_nhwc_cpu(a.data(), b.data(), -1, 3, 2, 2), ValueError);
  EXPECT_THROW(nhwc_to_nchw_cpu(a.data(), static_cast<float*>(nullptr), 2, 3, 2, 2), ValueError);
  EXPECT_THROW(oihw_to_krsc_cpu(a.data(), a.data(), 2, 3, 2, 2), ValueError) << "in place";
  EXPECT_THROW(krsc_to_oihw_cpu(a.data(), a.data() + 5, 1, 2, 2, 2), ValueError) << "overlap";
  EXPECT_NO_THROW(krsc_to_oihw_cpu(a.data(), a.data() + 8, 1, 2, 2, 2)) << "adjacent is fine";
  EXPECT_THROW(f32_to_bf16_cpu(a.data(), nullptr, 3), ValueError);
  EXPECT_THROW(bf16_to_f32_cpu(nullptr, b.data(), 3), ValueError);
  EXPECT_THROW(bf16_to_f32_cpu(nullptr, b.data(), -3), ValueError);
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t bits_of(__nv_bfloat16 b) {
  return static_cast<__nv_bfloat16_raw>(b).x;
}

TEST(Bf16, RoundsKnownValues) {
  struct Case {
    uint32_t f32;
    uint16_t bf16;
    const char* what;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F80, "1.0"},
      {0xBF800000u, 0xBF80, "-1.0"},
      {0x00000000u, 0x0000, "+0"},
      {0x80000000u, 0x8000, "-0"},
      {0x3F808000u, 0x3F80, "1 + 2^-8: a tie, to the even 1.0"},
      {0x3F818000u, 0x3F82, "1 + 3*2^-8: a tie, to the even 1 + 2^-6"},
      {0x3F808001u, 0x3F81, "just above the tie: up"},
      {0x3F807FFFu, 0x3F80, "just below the tie: down"},
      {0x3F810000u, 0x3F81, "1 + 2^-7: exact"},
      {0xBF808000u, 0xBF80, "-(1 + 2^-8): ties to even on the magnitude"},
      {0x7F800000u, 0x7F80, "inf"},
      {0xFF800000u, 0xFF80, "-inf"},
      {0x7F7FFFFFu, 0x7F80, "the largest float rounds past the largest bf16: inf"},
      {0x7F7F7FFFu, 0x7F7F, "below the tie at the top: the largest bf16"},
      {0x7F7F8000u, 0x7F80, "tie at the top with an odd kept part: up to inf"},
      {0x00008000u, 0x0000, "subnormal tie, even 0"},
      {0x00018000u, 0x0002, "subnormal tie, odd 1 goes to 2"},
      {0x7FC00000u, 0x7FFF, "quiet NaN: canonical NaN"},
      {0xFFC00000u, 0x7FFF, "negative NaN: canonical NaN"},
      {0x7F800001u, 0x7FFF, "signalling NaN that rounding would turn into inf"},
      {0x7FFFFFFFu, 0x7FFF, "NaN that rounding would carry into the sign"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(detail::f32_to_bf16_bits(from_bits(c.f32)), c.bf16) << c.what;
    __nv_bfloat16 out;
    const float in = from_bits(c.f32);
    f32_to_bf16_cpu(&in, &out, 1);
    EXPECT_EQ(bits_of(out), c.bf16) << c.what;
  }
}

// CUDA's host-side __float2bfloat16_rn is an independent implementation: compare on every 251st bit
// pattern of the 2^32 floats (17 million values, every exponent, both signs, NaNs included).
TEST(Bf16, AgreesWithCudaHostConversion) {
  int64_t checked = 0, mismatches = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 251) {
    const float f = from_bits(static_cast<uint32_t>(u));
    const uint16_t ours = detail::f32_to_bf16_bits(f);
    const uint16_t cuda = bits_of(__float2bfloat16_rn(f));
    if (ours != cuda && mismatches++ < 5) {
      ADD_FAILURE() << std::hex << "f32 0x" << u << ": ours 0x" << ours << ", CUDA 0x" << cuda;
    }
    ++checked;
  }
  EXPECT_EQ(mismatches, 0) << "of " << checked;
}

TEST(Bf16, WidensExactlyAllPatterns) {
  std::vector<__nv_bfloat16> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) {
    __nv_bfloat16_raw raw;
    raw.x = static_cast<uint16_t>(b);
    all[b] = raw;
  }
  std::vector<float> f(65536, testing::kPoison);
  bf16_to_f32_cpu(all.data(), f.data(), 65536);
  for (uint32_t b = 0; b < 65536; ++b) {
    uint32_t u;
    std::memcpy(&u, &f[b], sizeof u);
    ASSERT_EQ(u, b << 16) << "bf16 0x" << std::hex << b;  // NaN payloads kept too
  }
  // And back: every non-NaN bf16 survives the round trip.
  std::vector<__nv_bfloat16> back(65536);
  f32_to_bf16_cpu(f.data(), back.data(), 65536);
  for (uint32_t b = 0; b < 65536; ++b) {
    if (std::isnan(f[b])) {
      EXPECT_EQ(bits_of(back[b]), 0x7FFF);
    } else {
      ASSERT_EQ(bits_of(back[b]), b) << "bf16 0x" << std::hex << b;
    }
  }
}

// TF32 truncation toward zero: the low 13 mantissa bits cleared. The halfway and just-below cases
// are where rounding to nearest would differ (it would go up); the largest float stays finite.
TEST(Tf32, TruncatesKnownValues) {
  struct Case {
    uint32_t f32, tf32;
    const char* what;
  };
  const Case cases[] = {
      {0x3F800000u, 0x3F800000u, "1.0: exact"},
      {0xBF800000u, 0xBF800000u, "-1.0: exact"},
      {0x00000000u, 0x00000000u, "+0"},
      {0x80000000u, 0x80000000u, "-0"},
      {0x3F802000u, 0x3F802000u, "1 + 2^-10: exact"},
      {0x3F801000u, 0x3F800000u, "1 + 2^-11: halfway, even kept part: down"},
      {0x3F803000u, 0x3F802000u, "1 + 3*2^-11: halfway, odd kept part: down (nearest-even: up)"},
      {0x3F803FFFu, 0x3F802000u, "just below 1 + 2^-9: down (nearest: up)"},
      {0x3F801FFFu, 0x3F800000u, "just below 1 + 2^-10: down"},
      {0xBF803FFFu, 0xBF802000u, "negative: toward zero, the magnitude truncated"},
      {0xBF801000u, 0xBF800000u, "negative halfway: toward zero"},
      {0x3EAAAAABu, 0x3EAAA000u, "1/3"},
      {0x7F7FFFFFu, 0x7F7FE000u, "the largest float stays finite"},
      {0x00800000u, 0x00800000u, "the smallest normal: exact"},
      {0x007FFFFFu, 0x007FE000u, "the largest subnormal: truncated, not flushed"},
      {0x00003FFFu, 0x00002000u, "a small subnormal: truncated"},
      {0x00001FFFu, 0x00000000u, "below TF32's smallest subnormal: +0"},
      {0x80001FFFu, 0x80000000u, "negative, below the smallest subnormal: -0"},
      {0x7F800000u, 0x7F800000u, "inf"},
      {0xFF800000u, 0xFF800000u, "-inf"},
      {0x7FC00000u, 0x7FC00000u, "quiet NaN"},
      {0xFFC00001u, 0xFFC00000u, "negative quiet NaN: sign kept"},
      {0x7F800001u, 0x7FC00000u, "NaN whose payload is only in the cleared bits: not inf"},
      {0xFF801000u, 0xFFC00000u, "negative such NaN: not -inf"},
      {0x7FBFFFFFu, 0x7FFFE000u, "signalling NaN: quietened, high payload kept"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(detail::f32_to_tf32_bits(from_bits(c.f32)), c.tf32)
        << std::hex << c.what << ": 0x" << c.f32;
    const float in = from_bits(c.f32);
    float out = testing::kPoison;
    f32_to_tf32_cpu(&in, &out, 1);
    uint32_t got;
    std::memcpy(&got, &out, sizeof got);
    EXPECT_EQ(got, c.tf32) << std::hex << c.what << ": 0x" << c.f32;
  }
}

// Against the definition, computed with frexp instead of masks, on every 251st bit pattern: the
// result has TF32's form (low 13 bits zero), the sign of x, is no further from zero than x, and is
// less than one TF32 unit (2^(e-10) for x in [2^e, 2^(e+1)); 2^-136 below the normals) below it.
TEST(Tf32, TruncatesTowardZeroWithinOneUnit) {
  int64_t checked = 0, bad = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFu; u += 251) {
    const float x = from_bits(static_cast<uint32_t>(u));
    const uint32_t bits = detail::f32_to_tf32_bits(x);
    const float t = from_bits(bits);
    bool ok;
    if (std::isnan(x)) {
      ok = std::isnan(t) && std::signbit(t) == std::signbit(x);
    } else if (std::isinf(x)) {
      ok = t == x;
    } else {
      int e;
      std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
      const double unit = std::ldexp(1.0, std::max(e - 11, -136));
      const double gap = std::fabs(double(x)) - std::fabs(double(t));
      ok = (bits & 0x1FFFu) == 0 && std::signbit(t) == std::signbit(x) && gap >= 0 && gap < unit;
    }
    if (!ok && bad++ < 5) {
      ADD_FAILURE() << std::hex << "f32 0x" << u << " -> 0x" << bits;
    }
    ++checked;
  }
  EXPECT_EQ(bad, 0) << "of " << checked;
}

TEST(Tf32, InPlaceAndBadArguments) {
  std::vector<float> v = {1.0f + std::ldexp(1.0f, -12), -3.0f, 0.1f};
  f32_to_tf32_cpu(v.data(), v.data(), 3);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -3.0f);
  EXPECT_EQ(v[2], from_bits(0x3DCCC000u));  // 0.1 = 0x3DCCCCCD
  f32_to_tf32_cpu(nullptr, nullptr, 0);
  EXPECT_THROW(f32_to_tf32_cpu(nullptr, v.data(), 3), ValueError);
  EXPECT_THROW(f32_to_tf32_cpu(v.data(), v.data(), -1), ValueError);
}

}  // namespace
}  // namespace cudp::kernels
