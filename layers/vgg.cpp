#include "layers/vgg.h"

#include <string>
#include <vector>

#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/linear.h"

namespace cudp {

namespace {

constexpr int kPool = 0;  // "M" in torchvision's configuration lists

// torchvision's `cfgs`: output channels of each 3x3 convolution, kPool for a 2x2 max-pooling.
const std::vector<int>& layers_of(char config) {
  // clang-format off
  static const std::vector<int> a = {64, kPool, 128, kPool, 256, 256, kPool, 512, 512, kPool,
                                     512, 512, kPool};
  static const std::vector<int> b = {64, 64, kPool, 128, 128, kPool, 256, 256, kPool,
                                     512, 512, kPool, 512, 512, kPool};
  static const std::vector<int> d = {64, 64, kPool, 128, 128, kPool, 256, 256, 256, kPool,
                                     512, 512, 512, kPool, 512, 512, 512, kPool};
  static const std::vector<int> e = {64, 64, kPool, 128, 128, kPool, 256, 256, 256, 256, kPool,
                                     512, 512, 512, 512, kPool, 512, 512, 512, 512, kPool};
  switch (config) {
    case 'A': return a;
    case 'B': return b;
    case 'D': return d;
    case 'E': return e;
    default: break;
  }
  // clang-format on
  CUDP_THROW(ValueError, "vgg: unknown configuration '", config,
             "'; expected 'A' (vgg11), 'B' (vgg13), 'D' (vgg16) or 'E' (vgg19)");
}

void check_options(const VggOptions& o) {
  CUDP_CHECK(o.in_channels > 0, "vgg: in_channels must be positive, got ", o.in_channels);
  CUDP_CHECK(o.num_classes > 0, "vgg: num_classes must be positive, got ", o.num_classes);
  CUDP_CHECK(o.dropout >= 0.0f && o.dropout < 1.0f, "vgg: dropout must be in [0, 1), got ",
             o.dropout);
}

std::shared_ptr<Sequential> make_features(char config, const VggOptions& o) {
  auto features = std::make_shared<Sequential>();
  int channels = o.in_channels;
  for (const int v : layers_of(config)) {
    if (v == kPool) {
      features->add(std::make_shared<MaxPool2d>(2, 2));
      continue;
    }
    features->add(std::make_shared<Conv2d>(init::skip_init, channels, v, 3, 1, 1));
    if (o.batch_norm) {
      features->add(std::make_shared<BatchNorm2d>(init::skip_init, v));
    }
    features->add(std::make_shared<ReLU>(/*inplace=*/true));
    channels = v;
  }
  return features;
}

std::shared_ptr<Sequential> make_classifier(const VggOptions& o) {
  const bool torchvision = o.head == VggHead::Torchvision;
  const int64_t in = torchvision ? 512 * 7 * 7 : 512;
  const int64_t hidden = torchvision ? 4096 : 512;
  // Dropout at classifier.2 and classifier.5, seeded like parameters are (layers/init.h).
  auto dropout = [&o](const char* path) {
    return std::make_shared<Dropout>(o.dropout, init::derive_seed(o.seed, path));
  };
  auto classifier = std::make_shared<Sequential>();
  classifier->add(std::make_shared<Linear>(init::skip_init, in, hidden));
  classifier->add(std::make_shared<ReLU>(/*inplace=*/true));
  classifier->add(dropout("classifier.2"));
  classifier->add(std::make_shared<Linear>(init::skip_init, hidden, hidden));
  classifier->add(std::make_shared<ReLU>(/*inplace=*/true));
  classifier->add(dropout("classifier.5"));
  classifier->add(std::make_shared<Linear>(init::skip_init, hidden, o.num_classes));
  return classifier;
}

}  // namespace

struct Vgg::Parts {
  std::shared_ptr<Sequential> features;
  std::shared_ptr<AdaptiveAvgPool2d> avgpool;  // null for the Compact head
  std::shared_ptr<Flatten> flatten;
  std::shared_ptr<Sequential> classifier;
};

Vgg::Parts Vgg::build(char config, const VggOptions& options) {
  check_options(options);
  Parts parts;
  parts.features = make_features(config, options);
  if (options.head == VggHead::Torchvision) {
    parts.avgpool = std::make_shared<AdaptiveAvgPool2d>(7, 7);
  }
  parts.flatten = std::make_shared<Flatten>();
  parts.classifier = make_classifier(options);
  return parts;
}

Vgg::Vgg(char config, const VggOptions& options, Parts parts) : config_(config), options_(options) {
  features_ = register_module("features", std::move(parts.features));
  if (parts.avgpool) {
    avgpool_ = register_module("avgpool", std::move(parts.avgpool));
  }
  flatten_ = register_module("flatten", std::move(parts.flatten));
  classifier_ = register_module("classifier", std::move(parts.classifier));
}

Vgg::Vgg(init::SkipInit, char config, const VggOptions& options)
    : Vgg(config, options, build(config, options)) {}

Vgg::Vgg(char config, const VggOptions& options) : Vgg(init::skip_init, config, options) {
  init::reset_parameters(*this, options.seed);
}

void Vgg::check_input(const Tensor& input) const {
  CUDP_CHECK(input.dim() == 4, "VGG: expected an NHWC input [N, H, W, ", options_.in_channels,
             "], got ", input.str());
  const int64_t h = input.size(1), w = input.size(2);
  CUDP_CHECK(h > 0 && w > 0 && h % 32 == 0 && w % 32 == 0, "VGG: input size ", h, "x", w,
             " is not a multiple of 32 (five 2x2 max-poolings halve it); resize or pad the images");
  CUDP_CHECK(options_.head != VggHead::Compact || (h == 32 && w == 32),
             "VGG with the Compact head takes 32x32 inputs, got ", h, "x", w,
             "; use VggHead::Torchvision for larger images");
}

// Through forward_child / backward_child: a ValueError names the layer with torchvision's path
// ("in layer features.3 (Conv2d) of a VGG: ...", NOTE [Locating errors in children], module.h).
Tensor Vgg::forward_one(const Tensor& input) {
  check_input(input);
  features_->set_input_grad(input_grad_);
  Tensor x = forward_child(*features_, input);
  if (avgpool_) {
    x = forward_child(*avgpool_, x);
  }
  x = forward_child(*flatten_, x);
  return forward_child(*classifier_, x);
}

Tensor Vgg::backward_one(const Tensor& grad_output) {
  Tensor g = backward_child(*classifier_, grad_output);
  g = backward_child(*flatten_, g);
  if (avgpool_) {
    g = backward_child(*avgpool_, g);
  }
  return backward_child(*features_, g);
}

std::shared_ptr<Module> Vgg::make_empty_copy() const {
  // The children's own empty copies keep their state that is not in tensors (Dropout offsets,
  // BatchNorm counts, math modes), which a freshly built skeleton would lose.
  Parts parts;
  parts.features = std::static_pointer_cast<Sequential>(empty_copy_of(*features_));
  if (avgpool_) {
    parts.avgpool = std::static_pointer_cast<AdaptiveAvgPool2d>(empty_copy_of(*avgpool_));
  }
  parts.flatten = std::static_pointer_cast<Flatten>(empty_copy_of(*flatten_));
  parts.classifier = std::static_pointer_cast<Sequential>(empty_copy_of(*classifier_));
  return std::shared_ptr<Vgg>(new Vgg(config_, options_, std::move(parts)));
}

std::shared_ptr<Vgg> vgg(char config, const VggOptions& options) {
  return std::make_shared<Vgg>(config, options);
}
std::shared_ptr<Vgg> vgg11(const VggOptions& options) {
  return vgg('A', options);
}
std::shared_ptr<Vgg> vgg13(const VggOptions& options) {
  return vgg('B', options);
}
std::shared_ptr<Vgg> vgg16(const VggOptions& options) {
  return vgg('D', options);
}
std::shared_ptr<Vgg> vgg19(const VggOptions& options) {
  return vgg('E', options);
}

}  // namespace cudp
