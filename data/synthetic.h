// A synthetic, learnable image set that needs no files: CI trains on it, and so can anyone without
// a data set at hand.
//
// Each class has a fixed smooth pattern: random control values on a coarse grid (per channel),
// interpolated bilinearly to the image size. A sample is its class's pattern moved by a random shift
// of up to `max_shift` pixels (the border filled with black), plus uniform noise; labels go round the
// classes (sample i has class i % classes), so the classes are balanced. Everything comes from
// Philox (kernels/philox.h) keyed by `seed`: the same options give the same bytes on every machine,
// train and test samples are different draws of the same classes, and a different seed gives a
// different set.
#pragma once

#include <cstdint>

#include "data/dataset.h"

namespace cudp::data {

struct SyntheticOptions {
  int64_t n_train = 10000, n_test = 2000;
  int64_t h = 28, w = 28, c = 1;  // 28x28x1 like Fashion-MNIST, or 32x32x3 like CIFAR-10
  int classes = 10;
  uint64_t seed = 0;
  int max_shift = 2;  // pixels in each direction
  int noise = 48;     // uniform in [-noise, noise] grey levels
};

Dataset make_synthetic(const SyntheticOptions& options, bool train);

}  // namespace cudp::data
