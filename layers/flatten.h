// Flatten: [N, H, W, C] (NHWC) -> [N, C*H*W] with the features in PyTorch's order (c, h, w).
//
// PyTorch flattens NCHW activations, so the first Linear after torch.flatten(x, 1) expects feature
// index c*H*W + h*W + w. Our activations are NHWC; Flatten transposes each sample to CHW first
// (kernels/layout.h nhwc_to_nchw) so torchvision's classifier weights load unchanged. Backward is
// the inverse transpose. When H = W = 1 (VGG's compact head on 32x32 inputs) both orders agree and
// Flatten is a view, no copy. A 2-D input [N, F] is already flat and passes through. f32 or bf16
// (the bf16 policy's activations), the output and the input gradient in the input's dtype.
#pragma once

#include "layers/module.h"

namespace cudp {

class Flatten : public Module {
 public:
  Flatten() = default;
  std::string type_name() const override { return "Flatten"; }
  // Under the bf16 policy the activations stay bf16 through it (a view, or a transpose of the
  // elements as they are): no widening to f32 before it, and the Linear after it takes them as
  // they are.
  bool takes_bf16() const override { return true; }
  // PyTorch's nn.Flatten() text, "start_dim=1, end_dim=-1": cudp's always flattens every dimension
  // after the batch's (into PyTorch's (c, h, w) order, above).
  std::string extra_repr() const override;

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  Shape input_shape_;  // saved for backward
  DType input_dtype_ = DType::f32;
};

}  // namespace cudp
