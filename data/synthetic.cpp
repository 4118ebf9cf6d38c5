#include "data/synthetic.h"

#include <algorithm>
#include <cmath>

#include "engine/core/error.h"
#include "kernels/philox.h"

namespace cudp::data {
namespace {

using kernels::philox;

// Philox's high counter word says what a draw is for, so the streams never overlap.
enum Tag : uint64_t { kPattern = 1, kTrainSample = 2, kTestSample = 3 };
constexpr int64_t kGrid = 4;  // control cells per side of a class pattern

// The random words of one item (a class pattern, a sample): Philox's counter is (index, tag | block
// << 8), four words per block, so each item's draws are independent of every other item's.
class Draws {
 public:
  Draws(uint64_t seed, uint64_t index, uint64_t tag) : seed_(seed), index_(index), tag_(tag) {}
  uint32_t next() {
    if (used_ == 4) {
      words_ = philox(seed_, index_, tag_ | (block_++ << 8));
      used_ = 0;
    }
    return words_.v[used_++];
  }
  // An integer in [lo, hi] (the modulo bias is below 1e-7 for the small ranges used here).
  int next(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint32_t>(hi - lo + 1)); }

 private:
  uint64_t seed_, index_, tag_, block_ = 0;
  kernels::Philox4 words_{};
  int used_ = 4;
};

// Class k's pattern, h x w x c grey levels.
std::vector<float> make_pattern(const SyntheticOptions& o, int k) {
  const int64_t side = kGrid + 1;
  std::vector<float> control(static_cast<size_t>(side * side * o.c));
  Draws draws(o.seed, static_cast<uint64_t>(k), kPattern);
  for (float& value : control) value = 255.0f * kernels::uniform01(draws.next());
  std::vector<float> pattern(static_cast<size_t>(o.h * o.w * o.c));
  for (int64_t y = 0; y < o.h; ++y) {
    const float gy = o.h > 1 ? static_cast<float>(y * kGrid) / static_cast<float>(o.h - 1) : 0.0f;
    const int64_t y0 = std::min<int64_t>(static_cast<int64_t>(gy), kGrid - 1);
    const float fy = gy - static_cast<float>(y0);
    for (int64_t x = 0; x < o.w; ++x) {
      const float gx = o.w > 1 ? static_cast<float>(x * kGrid) / static_cast<float>(o.w - 1) : 0.0f;
      const int64_t x0 = std::min<int64_t>(static_cast<int64_t>(gx), kGrid - 1);
      const float fx = gx - static_cast<float>(x0);
      for (int64_t ch = 0; ch < o.c; ++ch) {
        auto at = [&](int64_t cy, int64_t cx) { return control[(cy * side + cx) * o.c + ch]; };
        const float top = at(y0, x0) * (1 - fx) + at(y0, x0 + 1) * fx;
        const float bottom = at(y0 + 1, x0) * (1 - fx) + at(y0 + 1, x0 + 1) * fx;
        pattern[(y * o.w + x) * o.c + ch] = top * (1 - fy) + bottom * fy;
      }
    }
  }
  return pattern;
}

}  // namespace

Dataset make_synthetic(const SyntheticOptions& o, bool train) {
  CUDP_CHECK(o.h > 0 && o.w > 0 && o.c > 0, "synthetic: invalid image size ", o.h, "x", o.w, "x", o.c);
  CUDP_CHECK(o.classes > 0 && o.classes <= 256, "synthetic: classes must be in [1, 256], got ",
             o.classes);
  CUDP_CHECK(o.n_train >= 0 && o.n_test >= 0 && o.max_shift >= 0 && o.noise >= 0,
             "synthetic: n_train, n_test, max_shift and noise must not be negative");
  std::vector<std::vector<float>> patterns;
  for (int k = 0; k < o.classes; ++k) patterns.push_back(make_pattern(o, k));

  Dataset d;
  d.name = train ? "synthetic/train" : "synthetic/test";
  d.height = o.h;
  d.width = o.w;
  d.channels = o.c;
  d.num_classes = o.classes;
  const int64_t n = train ? o.n_train : o.n_test;
  const uint64_t tag = train ? kTrainSample : kTestSample;
  d.images.resize(static_cast<size_t>(n * d.image_bytes()));
  d.labels.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int label = static_cast<int>(i % o.classes);
    d.labels[i] = label;
    Draws draws(o.seed, static_cast<uint64_t>(i), tag);
    const int dy = draws.next(-o.max_shift, o.max_shift);
    const int dx = draws.next(-o.max_shift, o.max_shift);
    const std::vector<float>& pattern = patterns[static_cast<size_t>(label)];
    uint8_t* image = d.images.data() + i * d.image_bytes();
    for (int64_t y = 0; y < o.h; ++y) {
      for (int64_t x = 0; x < o.w; ++x) {
        const int64_t sy = y - dy, sx = x - dx;
        const bool inside = sy >= 0 && sy < o.h && sx >= 0 && sx < o.w;
        for (int64_t ch = 0; ch < o.c; ++ch) {
          const float base = inside ? pattern[(sy * o.w + sx) * o.c + ch] : 0.0f;
          const long value = std::lround(base) + draws.next(-o.noise, o.noise);
          image[(y * o.w + x) * o.c + ch] = static_cast<uint8_t>(std::clamp(value, 0l, 255l));
        }
      }
    }
  }
  d.validate();
  return d;
}

}  // namespace cudp::data
