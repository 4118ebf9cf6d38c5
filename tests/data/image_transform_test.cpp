// data/image_folder's transforms, without files: torchvision's RandomResizedCrop parameter rules
// (checked on scripted draws against values worked out by hand from torchvision's get_params, and
// on the real draws for bounds, symmetry and determinism), and the bilinear resampling of both
// transforms against a reference written here: PIL's antialiased bilinear filter evaluated directly
// in two dimensions, in double precision, with the output size and the centre crop's offsets
// computed by Python's rules (int() truncation, round() half to even).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <set>
#include <tuple>
#include <vector>

#include "data/image_folder.h"
#include "engine/core/error.h"

namespace cudp::data {

void PrintTo(const CropBox& b, std::ostream* os) {  // GoogleTest's printer for failures
  *os << "{top " << b.top << ", left " << b.left << ", " << b.height << "x" << b.width << "}";
}

namespace {

// Numbers in [0, 1) from a script; a test fails if the code under test asks for more.
class Script {
 public:
  explicit Script(std::vector<double> values) : values_(std::move(values)) {}
  double operator()() {
    if (used_ >= values_.size()) {
      ADD_FAILURE() << "asked for draw " << used_ + 1 << " of a script of " << values_.size();
      return 0.5;
    }
    return values_[used_++];
  }
  size_t used() const { return used_; }

 private:
  std::vector<double> values_;
  size_t used_ = 0;
};

CropBox box_of(int64_t w, int64_t h, Script& s) {
  return random_resized_crop_box(w, h, [&s] { return s(); });
}

// torchvision's get_params, step by step for a 100x80 image (area 8000):
//   scale u = 0.5: target area 8000 * (0.08 + 0.92 * 0.5) = 4320; ratio u = 0.5: exp(0) = 1;
//   w = h = round(sqrt(4320) = 65.73) = 66; top = floor(0.25 * (80 - 66 + 1)) = 3,
//   left = floor(0.9 * (100 - 66 + 1)) = floor(31.5) = 31.
TEST(RandomResizedCrop, FirstAttemptThatFits) {
  Script s({0.5, 0.5, 0.25, 0.9});
  EXPECT_EQ(box_of(100, 80, s), (CropBox{3, 31, 66, 66}));
  EXPECT_EQ(s.used(), 4u);
  // The smallest area at the lowest ratio: 640 at 3/4 -> w = round(sqrt(480) = 21.9) = 22,
  // h = round(sqrt(853.3) = 29.2) = 29; and at 4/3 the transpose.
  Script low({0.0, 0.0, 0.0, 0.0});
  EXPECT_EQ(box_of(100, 80, low), (CropBox{0, 0, 29, 22}));
  Script high({0.0, 1.0 - 1e-12, 0.999999, 0.999999});
  EXPECT_EQ(box_of(100, 80, high), (CropBox{80 - 22, 100 - 29, 22, 29}));
}

// Scale and ratio u = 0.999: area 7992.6, ratio 1.3326 -> w = round(103.2) = 103 > 100: rejected,
// and the next attempt is taken.
TEST(RandomResizedCrop, RetriesWhenTheCropDoesNotFit) {
  Script s({0.999, 0.999, 0.5, 0.5, 0.25, 0.9});
  EXPECT_EQ(box_of(100, 80, s), (CropBox{3, 31, 66, 66}));
  EXPECT_EQ(s.used(), 6u);
}

// Ten rejected attempts (20 draws, no placement draws), then the centre crop: of the whole image
// when its ratio is within [3/4, 4/3]; narrowed to 4/3 for a wide image (h = 50, w = round(66.7) =
// 67, left = (200 - 67) // 2 = 66) and to 3/4 for a tall one.
TEST(RandomResizedCrop, FallsBackToTheCentreCropAfterTenAttempts) {
  const std::vector<double> rejected(20, 0.999);
  Script whole(rejected);
  EXPECT_EQ(box_of(100, 80, whole), (CropBox{0, 0, 80, 100}));
  EXPECT_EQ(whole.used(), 20u);
  Script wide(rejected);
  EXPECT_EQ(box_of(200, 50, wide), (CropBox{0, 66, 50, 67}));
  Script tall(rejected);
  EXPECT_EQ(box_of(50, 200, tall), (CropBox{66, 0, 67, 50}));
  // An image too thin for any crop of the ratio bounds never fits: every draw is an attempt.
  Script thin(std::vector<double>(20, 0.3));
  EXPECT_EQ(box_of(1000, 10, thin), (CropBox{0, (1000 - 13) / 2, 10, 13}));
  EXPECT_EQ(thin.used(), 20u);
}

TEST(RandomResizedCrop, RejectsBadArguments) {
  Script s({0.5});
  EXPECT_THROW(box_of(0, 10, s), ValueError);
  RandomResizedCropOptions o;
  o.ratio_min = 2;
  o.ratio_max = 1;
  EXPECT_THROW(random_resized_crop_box(10, 10, [] { return 0.5; }, o), ValueError);
}

// The real draws, on an image large enough that rounding does not matter: every box is inside the
// image, with an area fraction in [0.08, 1] and a ratio in [3/4, 4/3]; the ratio is log-uniform, so
// wide and tall crops are equally likely and log(w / h) averages 0 (a ratio drawn uniformly in
// [3/4, 4/3] would give wide crops ~55% of the time); positions are uniform.
TEST(RandomResizedCrop, RealDrawsFollowTheRules) {
  const int64_t side = 10000;
  const int n = 4000;
  int wide = 0;
  double log_ratio_sum = 0, position_sum = 0, min_fraction = 1, max_fraction = 0;
  for (int i = 0; i < n; ++i) {
    SampleRandom r(7, 3, i);
    const CropBox b = random_resized_crop_box(side, side, [&r] { return r.uniform(); });
    ASSERT_GT(b.width, 0);
    ASSERT_GT(b.height, 0);
    ASSERT_GE(b.top, 0);
    ASSERT_GE(b.left, 0);
    ASSERT_LE(b.top + b.height, side);
    ASSERT_LE(b.left + b.width, side);
    const double ratio = static_cast<double>(b.width) / static_cast<double>(b.height);
    const double fraction = static_cast<double>(b.width * b.height) / (double(side) * side);
    EXPECT_GE(ratio, 0.75 - 1e-3);
    EXPECT_LE(ratio, 4.0 / 3.0 + 1e-3);
    EXPECT_GE(fraction, 0.08 - 1e-3);
    EXPECT_LE(fraction, 1.0);
    min_fraction = std::min(min_fraction, fraction);
    max_fraction = std::max(max_fraction, fraction);
    wide += b.width > b.height;
    log_ratio_sum += std::log(ratio);
    if (b.height < side) position_sum += static_cast<double>(b.top) / double(side - b.height);
  }
  EXPECT_NEAR(static_cast<double>(wide) / n, 0.5, 0.03);
  EXPECT_NEAR(log_ratio_sum / n, 0.0, 0.015);
  EXPECT_NEAR(position_sum / n, 0.5, 0.03);
  EXPECT_LT(min_fraction, 0.1);
  EXPECT_GT(max_fraction, 0.9);
}

// A sample's draws are a function of (seed, epoch, index): the same triple repeats them, changing
// any one of the three changes them.
TEST(SampleRandom, DeterminedBySeedEpochAndIndex) {
  const auto draws = [](uint64_t seed, int epoch, int64_t index) {
    SampleRandom r(seed, epoch, index);
    std::vector<double> v;
    for (int i = 0; i < 9; ++i) v.push_back(r.uniform());  // crosses several Philox blocks
    return v;
  };
  const std::vector<double> base = draws(1, 2, 3);
  EXPECT_EQ(draws(1, 2, 3), base);
  EXPECT_NE(draws(2, 2, 3), base);
  EXPECT_NE(draws(1, 3, 3), base);
  EXPECT_NE(draws(1, 2, 4), base);
  std::set<double> distinct(base.begin(), base.end());
  EXPECT_EQ(distinct.size(), base.size());
  for (double u : base) {
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
  }
  EXPECT_THROW(SampleRandom(1, -1, 0), ValueError);
}

// ---- resampling against the reference ----------------------------------------------------------

// Python's round(): halves to even.
int64_t py_round(double x) {
  const double f = std::floor(x);
  if (x - f != 0.5) return static_cast<int64_t>(std::floor(x + 0.5));
  return static_cast<int64_t>(f) % 2 == 0 ? static_cast<int64_t>(f) : static_cast<int64_t>(f) + 1;
}

Image noise_image(int64_t w, int64_t h, uint32_t seed) {
  Image img{w, h, {}};
  for (int64_t i = 0; i < w * h * 3; ++i) {
    seed = seed * 1664525u + 1013904223u;
    img.rgb.push_back(static_cast<uint8_t>(seed >> 24));
  }
  return img;
}

// Pixel (X, Y), channel c, of the rectangle `box` of `img` resized to out_w x out_h: PIL's bilinear
// filter (a triangle of half-width max(1, reduction) source pixels, centred on the target pixel's
// centre mapped into the box, normalised over the box), as one double sum over the box.
double reference(const Image& img, const CropBox& box, int64_t out_w, int64_t out_h, int64_t X,
                 int64_t Y, int c) {
  const double sx = double(box.width) / double(out_w), sy = double(box.height) / double(out_h);
  const double fx = std::max(1.0, sx), fy = std::max(1.0, sy);
  const double cx = double(box.left) + (double(X) + 0.5) * sx;
  const double cy = double(box.top) + (double(Y) + 0.5) * sy;
  double num = 0, den = 0;
  for (int64_t j = box.top; j < box.top + box.height; ++j) {
    const double wy = std::max(0.0, 1.0 - std::fabs(double(j) + 0.5 - cy) / fy);
    for (int64_t i = box.left; i < box.left + box.width; ++i) {
      const double wx = std::max(0.0, 1.0 - std::fabs(double(i) + 0.5 - cx) / fx);
      num += wy * wx * img.rgb[static_cast<size_t>((j * img.width + i) * 3 + c)];
      den += wy * wx;
    }
  }
  return num / den;
}

// Tolerance: the code rounds its float result once, so each pixel is within 0.5 of the exact value,
// plus 0.01 for float accumulation. A window off by one pixel, or a filter without antialiasing,
// misses by tens of grey levels on noise.
constexpr double kTolerance = 0.5 + 0.01;

void expect_matches(const Image& got, const Image& img, const CropBox& box, int64_t out_w,
                    int64_t out_h, int64_t left, int64_t top, const std::string& what) {
  double worst = 0;
  for (int64_t y = 0; y < got.height; ++y) {
    for (int64_t x = 0; x < got.width; ++x) {
      for (int c = 0; c < 3; ++c) {
        const double want = reference(img, box, out_w, out_h, left + x, top + y, c);
        const double d = std::fabs(got.rgb[static_cast<size_t>((y * got.width + x) * 3 + c)] - want);
        worst = std::max(worst, d);
        ASSERT_LE(d, kTolerance) << what << ": pixel (" << x << ", " << y << ") channel " << c
                                 << " is " << int(got.rgb[static_cast<size_t>((y * got.width + x) * 3 + c)])
                                 << ", the reference " << want;
      }
    }
  }
  EXPECT_LE(worst, kTolerance) << what;
}

// Eval: Resize(round(size * 256 / 224)) of the shorter side, the longer to int(resize * long /
// short), then CenterCrop(size) at int(round((side - size) / 2.0)). The cases shrink, enlarge and
// keep a side, and include offsets of x.5, where round half to even and half up disagree.
TEST(ImageTransform, EvalResizeAndCentreCropMatchTheReference) {
  struct Case {
    int64_t w, h, size;
  };
  for (const Case& k : {Case{80, 72, 64}, Case{37, 50, 32}, Case{300, 200, 24}, Case{20, 30, 32},
                        Case{64, 64, 56}}) {
    const Image img = noise_image(k.w, k.h, static_cast<uint32_t>(k.w * 1000 + k.h));
    const int64_t resize = py_round(double(k.size) * 256.0 / 224.0);
    EXPECT_EQ(eval_resize(k.size), resize);
    const int64_t out_w = k.w <= k.h ? resize : static_cast<int64_t>(double(resize * k.w) / double(k.h));
    const int64_t out_h = k.w <= k.h ? static_cast<int64_t>(double(resize * k.h) / double(k.w)) : resize;
    const int64_t top = py_round(double(out_h - k.size) / 2.0);
    const int64_t left = py_round(double(out_w - k.size) / 2.0);
    const Image got = eval_transform(img, k.size);
    ASSERT_EQ(got.width, k.size);
    ASSERT_EQ(got.height, k.size);
    expect_matches(got, img, {0, 0, k.h, k.w}, out_w, out_h, left, top,
                   std::to_string(k.w) + "x" + std::to_string(k.h) + " to " + std::to_string(k.size));
  }
}

// Train's resampling: the crop box resized to size x size, shrinking, enlarging, or both.
TEST(ImageTransform, ResizedCropMatchesTheReference) {
  const Image img = noise_image(90, 70, 5);
  for (const CropBox& box : {CropBox{5, 10, 40, 60}, CropBox{0, 0, 10, 12}, CropBox{3, 50, 67, 9},
                             CropBox{0, 0, 70, 90}}) {
    const Image got = resized_crop(img, box, 32, 32);
    ASSERT_EQ(got.width, 32);
    expect_matches(got, img, box, 32, 32, 0, 0,
                   "box " + std::to_string(box.top) + "," + std::to_string(box.left));
  }
  EXPECT_THROW(resized_crop(img, {0, 0, 71, 10}, 8, 8), ValueError);  // outside the image
}

// The train transform is the crop of random_resized_crop_box on the sample's draws, resized, then
// mirrored when the next draw is below 0.5 - about half the samples.
TEST(ImageTransform, TrainIsRandomResizedCropThenFlip) {
  const Image img = noise_image(61, 47, 11);
  int flipped = 0;
  const int n = 200;
  for (int index = 0; index < n; ++index) {
    SampleRandom r(3, 1, index);
    const CropBox box = random_resized_crop_box(61, 47, [&r] { return r.uniform(); });
    const bool flip = r.uniform() < 0.5;
    Image want = resized_crop(img, box, 24, 24);
    if (flip) {
      Image mirror = want;
      for (int64_t y = 0; y < 24; ++y)
        for (int64_t x = 0; x < 24; ++x)
          for (int c = 0; c < 3; ++c)
            mirror.rgb[static_cast<size_t>((y * 24 + x) * 3 + c)] =
                want.rgb[static_cast<size_t>((y * 24 + 23 - x) * 3 + c)];
      want = mirror;
    }
    flipped += flip;
    ASSERT_EQ(train_transform(img, 24, 3, 1, index).rgb, want.rgb) << "sample " << index;
  }
  EXPECT_GT(flipped, n * 35 / 100);
  EXPECT_LT(flipped, n * 65 / 100);
  // Another epoch gives other crops.
  EXPECT_NE(train_transform(img, 24, 3, 1, 0).rgb, train_transform(img, 24, 3, 2, 0).rgb);
}

}  // namespace
}  // namespace cudp::data
