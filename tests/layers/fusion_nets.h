// Small models of VGG's shapes for the fusion tests, shared by the host (bf16_storage_test) and
// GPU (bf16_storage_gpu_test) suites, which build them at their own widths.
#pragma once

#include <cstdint>
#include <memory>

#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/layers/layer_testing.h"

namespace cudp::testing {

// VGG-BN's blocks in small, for NHWC inputs [n, 2 side, 2 side, 3]: Conv(3, c1) -> BatchNorm ->
// ReLU -> MaxPool(2) -> Conv(c1, c2) -> BatchNorm -> ReLU -> Conv(c2, c2) -> ReLU -> Flatten ->
// Linear(c2 side^2, 10). The pool takes the first BatchNorm's ReLU mask over, the third
// convolution the second's. Parameters: the convolutions' weights and biases are 0/1, 4/5 and 8/9,
// BatchNorm's 2/3 and 6/7, Linear's 10/11. Weights uniform in [-scale, scale].
inline std::shared_ptr<Sequential> batchnorm_block_net(int c1, int c2, int side, uint64_t seed,
                                                       float scale) {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Conv2d>(3, c1, 3, 1, 1));
  net->add(std::make_shared<BatchNorm2d>(c1));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<MaxPool2d>(2));
  net->add(std::make_shared<Conv2d>(c1, c2, 3, 1, 1));
  net->add(std::make_shared<BatchNorm2d>(c2));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<Conv2d>(c2, c2, 3, 1, 1));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<Flatten>());
  net->add(std::make_shared<Linear>(c2 * side * side, 10));
  randomize_parameters(*net, seed, -scale, scale);
  return net;
}

// A classifier as VGG's: Linear(in, h1), ReLU, Dropout(0.5), Linear(h1, h2), ReLU, Linear(h2, 10).
// The same Dropout seed in every copy: the same mask.
inline std::shared_ptr<Sequential> classifier_net(int in, int h1, int h2, uint64_t seed,
                                                  float scale) {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Linear>(in, h1));
  net->add(std::make_shared<ReLU>(true));
  net->add(std::make_shared<Dropout>(0.5f, 3));
  net->add(std::make_shared<Linear>(h1, h2));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<Linear>(h2, 10));
  randomize_parameters(*net, seed, -scale, scale);
  return net;
}

}  // namespace cudp::testing
