// Linear: y = x W^T + b, PyTorch's nn.Linear, over the last dimension of x ([*, in] -> [*, out]).
//
// The weight is [out, in] as PyTorch stores it (no conversion at load), the bias [out]. Forward and
// both backward products are one GEMM each (kernels/gemm.h):
//   y  = x W^T        (trans_b)       then y += b (kernels/bias.h)
//   dx = dy W         written
//   dW += dy^T x      (trans_a, beta = 1: parameter gradients accumulate, docs/architecture.md
//                     §2.1; beta = 0 right after a deferred zero_grad, layers/module.h)
//   db += column sums of dy (bias_grad, beta as dW's)
// The forward keeps its input for dW. Parameters are initialised as torchvision's VGG does
// (layers/init.h): W ~ N(0, 0.01), b = 0. Under the bf16 policy the layer takes f32 or bf16 input
// and writes an fp32 output; the input gradient has the input's dtype.
#pragma once

#include "kernels/common.h"
#include "layers/init.h"
#include "layers/module.h"

namespace cudp {

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true, uint64_t seed = 0);
  Linear(init::SkipInit, int64_t in_features, int64_t out_features, bool bias = true);

  std::string type_name() const override { return "Linear"; }
  // PyTorch's "in_features=4096, out_features=1000, bias=True".
  std::string extra_repr() const override;
  // Under bf16: f32 or bf16 input, f32 output (the logits stay fp32 for the loss).
  bool takes_bf16() const override { return precision_ == Precision::bf16; }
  // A ReLU right after it in a Sequential runs inside it (Module::can_fuse_relu): max(y, 0) in the
  // product's epilogue (or after the float launcher's bias), and in backward dy masked by y > 0 in
  // the pass that takes the bias gradient (kernels::relu_mask_bias_grad), so that the classifier's
  // ReLUs cost no launches of their own.
  bool can_fuse_relu() const override { return true; }

  // weight ~ N(0, 0.01) from derive_seed(seed, "weight"); bias = 0.
  void reset_parameters(uint64_t seed);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  bool has_bias() const { return bias_ != nullptr; }
  Parameter& weight() { return *weight_; }  // [out, in]
  Parameter& bias();                        // [out]; throws when built without a bias

  // The GEMM math of the products, from the precision policy (Module::set_precision): fp32, TF32
  // or bf16 operands with fp32 accumulation (layers/precision.h); the CPU path rounds bf16 and
  // TF32 operands as the GPU does.
  kernels::Math math() const { return precision_math(precision_); }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  void release_saved() override {
    input_ = Tensor();
    input_bf16_ = Tensor();
    weight_bf16_ = Tensor();
  }
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  int64_t in_, out_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  bool direct_bf16(int64_t k) const;

  // Saved for backward: the input (fp32, or widened), or under bf16 on the GPU its bf16 copy and
  // the weight's bf16 copy (backward-data reads it as B stored k x n: no W^T copy).
  Tensor input_, input_bf16_, weight_bf16_;
  DType input_dtype_ = DType::f32;
};

}  // namespace cudp
