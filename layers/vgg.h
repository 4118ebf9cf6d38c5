// VGG (Simonyan & Zisserman, 2014) as torchvision builds it, plus a compact head for 32x32 images.
//
// Children, with torchvision's names so that its state_dicts load strictly:
//   features    Sequential of [Conv2d(3x3, padding 1), (BatchNorm2d,) ReLU(inplace)] blocks and
//               MaxPool2d(2, 2), per configuration A (vgg11), B (vgg13), D (vgg16), E (vgg19)
//   avgpool     AdaptiveAvgPool2d(7, 7)                       (Torchvision head only)
//   flatten     Flatten: NHWC -> PyTorch's (c, h, w) feature order; stateless, so not in state_dict
//   classifier  Sequential: Linear(F, H), ReLU, Dropout, Linear(H, H), ReLU, Dropout, Linear(H, N)
//               at indices 0..6 (names classifier.0/.3/.6), with F = 512*7*7, H = 4096 for the
//               Torchvision head and F = H = 512 for the Compact one
//
// Inputs are NHWC [N, H, W, in_channels] with H and W multiples of 32 (five 2x2 poolings); the
// Compact head needs exactly 32x32 (its classifier sees the 1x1x512 features). The model is
// initialised as torchvision's (layers/init.h) from options.seed, the Dropouts seeded from it too,
// so one seed reproduces the model and its masks.
//
// features() and classifier() are exposed so that a program can run them separately (the seed
// program wraps each in DataParallel) with avgpool() and flatten() in between; forward() is exactly
// that composition.
//
// repr() (print(model)) is torchvision's text but for one line: "(flatten): Flatten(start_dim=1,
// end_dim=-1)" between avgpool and classifier, a module here and torch.flatten in torchvision's
// forward. A ValueError in a child names it with torchvision's path ("in layer features.3
// (Conv2d) of a VGG: ...", NOTE [Locating errors in children], layers/module.h).
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/common.h"
#include "layers/flatten.h"
#include "layers/init.h"
#include "layers/module.h"
#include "layers/pooling.h"
#include "layers/sequential.h"

namespace cudp {

enum class VggHead {
  Torchvision,  // avgpool to 7x7, classifier 25088 -> 4096 -> 4096 -> N (any input multiple of 32)
  Compact,      // no avgpool, classifier 512 -> 512 -> 512 -> N (32x32 inputs: CIFAR, padded MNIST)
};

struct VggOptions {
  int in_channels = 3;
  int num_classes = 1000;
  bool batch_norm = false;
  VggHead head = VggHead::Torchvision;
  float dropout = 0.5f;
  uint64_t seed = 0;
};

class Vgg : public Module {
 public:
  // config: 'A' (11 layers), 'B' (13), 'D' (16) or 'E' (19).
  Vgg(char config, const VggOptions& options);
  // The same structure with parameters allocated but not initialised (for a checkpoint about to be
  // loaded, or a model to be initialised on the GPU with init::reset_parameters after cuda()).
  Vgg(init::SkipInit, char config, const VggOptions& options);

  std::string type_name() const override { return "VGG"; }
  bool takes_bf16() const override { return true; }  // its children decide
  char config() const { return config_; }
  const VggOptions& options() const { return options_; }

  const std::shared_ptr<Sequential>& features() const { return features_; }
  const std::shared_ptr<AdaptiveAvgPool2d>& avgpool() const { return avgpool_; }  // null: Compact
  const std::shared_ptr<Flatten>& flatten() const { return flatten_; }
  const std::shared_ptr<Sequential>& classifier() const { return classifier_; }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  struct Parts;  // the children, built (build) or copied (make_empty_copy)
  static Parts build(char config, const VggOptions& options);
  Vgg(char config, const VggOptions& options, Parts parts);
  void check_input(const Tensor& input) const;

  char config_;
  VggOptions options_;
  std::shared_ptr<Sequential> features_;
  std::shared_ptr<AdaptiveAvgPool2d> avgpool_;
  std::shared_ptr<Flatten> flatten_;
  std::shared_ptr<Sequential> classifier_;
};

std::shared_ptr<Vgg> vgg(char config, const VggOptions& options = {});
std::shared_ptr<Vgg> vgg11(const VggOptions& options = {});
std::shared_ptr<Vgg> vgg13(const VggOptions& options = {});
std::shared_ptr<Vgg> vgg16(const VggOptions& options = {});
std::shared_ptr<Vgg> vgg19(const VggOptions& options = {});

}  // namespace cudp
