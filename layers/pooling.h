// Pooling over NHWC activations with PyTorch's conventions (kernels/pool.h).
//
// MaxPool2d(kernel, stride = kernel, padding = 0): floor mode, padding as -inf; the forward keeps
// the argmax of every output (int32, [N, P, Q, C]; for 2x2 windows of stride 2 on the GPU one byte,
// kernels/pool.h) and backward routes the gradient through it. That is all it needs: the input is
// not kept (but on the CPU where it does a fused ReLU's mask).
//
// AdaptiveAvgPool2d(out_h, out_w): PyTorch's overlapping windows. When the input already has the
// output's size (VGG at 224x224: features end at 7x7) the op is the identity: forward returns its
// input and backward its gradient, with no copy and no launch.
#pragma once

#include "layers/module.h"

namespace cudp {

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(int kernel) : MaxPool2d(kernel, kernel) {}
  MaxPool2d(int kernel, int stride, int padding = 0);
  std::string type_name() const override { return "MaxPool2d"; }
  // PyTorch's "kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False". cudp pools
  // without dilation and in floor mode only: dilation=1 and ceil_mode=False always.
  std::string extra_repr() const override;
  bool takes_bf16() const override { return true; }  // pools bf16 as it comes
  int kernel() const { return kernel_; }
  int stride() const { return stride_; }
  int padding() const { return padding_; }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  void release_saved() override {
    argmax_ = Tensor();
    input_ = Tensor();
  }
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  int kernel_, stride_, padding_;
  Shape input_shape_, output_shape_;  // saved for backward
  DType input_dtype_ = DType::f32;
  // Where the maxima were: int32 indices, or (2x2 stride 2 on the GPU) the windows' u8 codes,
  // kernels/pool.h.
  Tensor argmax_;
  Tensor input_;  // the input, for the ReLU mask on the CPU
};

class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(int out_h, int out_w);
  explicit AdaptiveAvgPool2d(int out_size) : AdaptiveAvgPool2d(out_size, out_size) {
    one_size_ = true;
  }
  std::string type_name() const override { return "AdaptiveAvgPool2d"; }
  // PyTorch's "output_size=(7, 7)", or "output_size=7" when built from one size (as PyTorch keeps
  // the int or the tuple it was given).
  std::string extra_repr() const override;
  int out_h() const { return out_h_; }
  int out_w() const { return out_w_; }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  int out_h_, out_w_;
  bool one_size_ = false;  // built from one size (extra_repr)
  Shape input_shape_;  // saved for backward
};

}  // namespace cudp
