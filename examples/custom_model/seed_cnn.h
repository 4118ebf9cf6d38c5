// SeedCnn: the seed program's small CNN written as a custom cudp Module. Read it as a tutorial: it
// shows every piece a model of your own needs (docs/custom-models.md explains each).
//
// The PyTorch model it reproduces:
//
//   class CNN(nn.Module):
//       def __init__(self):
//           self.conv1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.ReLU(), nn.MaxPool2d(2))
//           self.conv2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.ReLU(), nn.MaxPool2d(2))
//           self.out = nn.Linear(32 * 7 * 7, 10)
//       def forward(self, x):
//           x = self.conv2(self.conv1(x))
//           x = x.view(x.size(0), -1)
//           output = self.out(x)
//           return output, x          # two outputs: the logits and the flattened features
//
// In cudp:
//   - Children are registered under the PyTorch attribute names, so state_dict() keys are the
//     PyTorch ones: conv1.0.weight, conv1.0.bias, conv2.0.weight, conv2.0.bias, out.weight,
//     out.bias. A checkpoint of this model loads into the PyTorch CNN above and back.
//   - Activations are NHWC: the input is [N, 28, 28, 1]. Flatten turns [N, 7, 7, 32] into
//     [N, 1568] in PyTorch's (c, h, w) order, so `out.weight` and the features are laid out exactly
//     as PyTorch's x.view(x.size(0), -1) of an NCHW tensor.
//   - Two outputs means overriding forward_impl / backward_impl (lists) instead of forward_one /
//     backward_one (one tensor). forward_all({x}) returns {logits, features}; backward_all takes
//     {d logits, d features}, where an undefined Tensor means "that output was not used" (a zero
//     gradient): a classifier's training loop passes {criterion.backward(), Tensor()}.
//   - make_empty_copy() builds the same structure without values; clone() (and so DataParallel's
//     replicas) fills it.
#pragma once

#include <cudp/cudp.h>
#include <cudp/kernels/elementwise.h>  // axpy: the one tensor sum the backward needs (see below)

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace seed {

struct SeedCnnOptions {
  int in_channels = 1;
  int n_classes = 10;
  int image_size = 28;  // square inputs; two 2x2 poolings leave image_size / 4 (28: 7x7)
  uint64_t seed = 0;    // each layer gets its own random stream from it (cudp/layers/init.h)
};

class SeedCnn : public cudp::Module {
 public:
  // A model initialised from options.seed.
  explicit SeedCnn(const SeedCnnOptions& options = {}) : SeedCnn(cudp::init::skip_init, options) {
    cudp::init::reset_parameters(*this, options.seed);
  }

  // The same structure with parameters allocated but not initialised (they are about to be loaded).
  SeedCnn(cudp::init::SkipInit, const SeedCnnOptions& options)
      : SeedCnn(block(options.in_channels, 16), block(16, 32), std::make_shared<cudp::Flatten>(),
                std::make_shared<cudp::Linear>(cudp::init::skip_init, features(options.image_size),
                                               options.n_classes)) {}

  std::string type_name() const override { return "SeedCnn"; }

  // The length of the flattened features: 32 * 7 * 7 = 1568 for 28x28 images.
  static int64_t features(int image_size) {
    return int64_t{32} * (image_size / 4) * (image_size / 4);
  }

  const std::shared_ptr<cudp::Sequential>& conv1() const { return conv1_; }
  const std::shared_ptr<cudp::Sequential>& conv2() const { return conv2_; }
  const std::shared_ptr<cudp::Linear>& out() const { return out_; }

 protected:
  // {x [N, 28, 28, C]} -> {logits [N, n_classes], features [N, 1568]} (28x28 images).
  cudp::TensorList forward_impl(const cudp::TensorList& inputs) override {
    CUDP_CHECK(inputs.size() == 1, "SeedCnn takes one input (images), got ", inputs.size());
    // Through forward_child: a child's ValueError names it ("in layer conv1.0 (Conv2d) of a
    // SeedCnn: ...").
    cudp::Tensor x = forward_child(*conv1_, inputs[0]);    // [N, 14, 14, 16]
    x = forward_child(*conv2_, x);                         // [N, 7, 7, 32]
    cudp::Tensor features = forward_child(*flatten_, x);   // [N, 1568], PyTorch's feature order
    cudp::Tensor logits = forward_child(*out_, features);  // [N, n_classes]
    return {logits, features};
  }

  // {d logits, d features} -> {d x}: the children's backward in reverse order. `features` fed two
  // consumers (the Linear and the caller), so its gradient is the sum of both; either may be
  // undefined (unused).
  cudp::TensorList backward_impl(const cudp::TensorList& grads) override {
    CUDP_CHECK(grads.size() == 2, "SeedCnn has two outputs (logits, features), got ", grads.size(),
               " gradients");
    const cudp::Tensor& dlogits = grads[0];
    const cudp::Tensor& dfeatures_outside = grads[1];
    cudp::Tensor dfeatures;
    if (dlogits.defined()) {
      dfeatures = backward_child(*out_, dlogits);  // a fresh tensor: safe to add into
      if (dfeatures_outside.defined()) add_into(dfeatures, dfeatures_outside);
    } else if (dfeatures_outside.defined()) {
      dfeatures = dfeatures_outside;
    } else {
      return {cudp::Tensor()};  // neither output used: every gradient is zero, nothing to do
    }
    cudp::Tensor dx = backward_child(*flatten_, dfeatures);
    dx = backward_child(*conv2_, dx);
    return {backward_child(*conv1_, dx)};
  }

  std::shared_ptr<cudp::Module> make_empty_copy() const override {
    // The children's own empty copies, so that whatever they hold outside tensors (a Conv2d's
    // math mode) is copied too.
    auto copy = [](const auto& child) {
      using T = typename std::remove_reference_t<decltype(child)>::element_type;
      return std::static_pointer_cast<T>(empty_copy_of(*child));
    };
    return std::shared_ptr<SeedCnn>(
        new SeedCnn(copy(conv1_), copy(conv2_), copy(flatten_), copy(out_)));
  }

 private:
  SeedCnn(std::shared_ptr<cudp::Sequential> conv1, std::shared_ptr<cudp::Sequential> conv2,
          std::shared_ptr<cudp::Flatten> flatten, std::shared_ptr<cudp::Linear> out)
      : conv1_(register_module("conv1", std::move(conv1))),
        conv2_(register_module("conv2", std::move(conv2))),
        flatten_(register_module("flatten", std::move(flatten))),  // no parameters: no state keys
        out_(register_module("out", std::move(out))) {}

  // Conv2d(in, out, 5, stride 1, padding 2) -> ReLU -> MaxPool2d(2): names "0", "1", "2".
  static std::shared_ptr<cudp::Sequential> block(int in, int out) {
    auto s = std::make_shared<cudp::Sequential>();
    s->add(std::make_shared<cudp::Conv2d>(cudp::init::skip_init, in, out, /*kernel=*/5,
                                          /*stride=*/1, /*padding=*/2));
    s->add(std::make_shared<cudp::ReLU>());
    s->add(std::make_shared<cudp::MaxPool2d>(2));
    return s;
  }

  // a += b on the module's device (cudp has no Tensor arithmetic: layers call kernels, and so does
  // a model that sums gradients). run() picks the CPU reference or the CUDA kernel on the device's
  // current stream.
  // Under the bf16 policy the features are bf16, and so is their gradient (a gradient has its
  // value's dtype): the two are added in fp32 and the sum rounded once (cudp::convert).
  void add_into(cudp::Tensor& a, const cudp::Tensor& b) const {
    cudp::check_shape(b, a.shape(), "SeedCnn: gradient of the features");
    CUDP_CHECK(b.dtype() == a.dtype(), "SeedCnn: the gradient of the features is ", b.str(),
               " but the features are ", cudp::dtype_name(a.dtype()), "; give it in their dtype");
    if (a.dtype() == cudp::DType::bf16) {
      cudp::Tensor sum = cudp::convert(a, cudp::DType::f32);
      add_into(sum, cudp::convert(b, cudp::DType::f32));
      a = cudp::convert(sum, cudp::DType::bf16);
      return;
    }
    run([&] { cudp::kernels::axpy_cpu(1.f, b.data<float>(), a.data<float>(), a.numel()); },
        [&](cudaStream_t stream) {
          cudp::kernels::axpy(1.f, b.data<float>(), a.data<float>(), a.numel(), stream);
        });
  }

  std::shared_ptr<cudp::Sequential> conv1_, conv2_;
  std::shared_ptr<cudp::Flatten> flatten_;
  std::shared_ptr<cudp::Linear> out_;
};

}  // namespace seed
