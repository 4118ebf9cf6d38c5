// Conv2d: 2-D convolution over NHWC activations, PyTorch's nn.Conv2d with square kernels,
// groups = 1, dilation = 1.
//
// Input [N, H, W, in_channels] -> output [N, P, Q, out_channels], P = (H + 2*padding - kernel) /
// stride + 1 (likewise Q). The weight is stored K x R x S x C ([out, kh, kw, in]: one filter is
// contiguous along C, what the implicit-GEMM kernels want, kernels/conv2d.h); state_dict() exports
// it as PyTorch's OIHW [out, in, kh, kw] and load_state_dict() converts back, so torchvision
// checkpoints load unchanged. The bias is [out].
//
// Products follow the model's precision policy (layers/precision.h): fp32; tf32 (fp32 tensors
// throughout, forward, backward-data and backward-weight on TF32 tensor cores); or bf16, where the
// layer takes f32 or bf16 input, writes a bf16 output (bias and a ReLU that follows in a Sequential
// applied to the fp32 accumulator before the one rounding), takes a bf16 output gradient, returns
// the input gradient in the input's dtype and accumulates fp32 weight gradients. Under bf16 the
// CPU path rounds the operands and the output as the GPU does, so it stays the GPU's reference;
// under tf32 it truncates each product's operands to TF32 as the tensor cores read them, then
// computes in fp32. On the tensor cores (tf32, bf16) backward-data takes stride 1 only
// (kernels/conv2d.h): a strided layer's input gradient throws.
//
// Backward writes dx and accumulates dW and db (docs/architecture.md §2.1); after a deferred
// zero_grad it writes dW with beta 0 instead (NOTE [Deferred zeroing], layers/module.h; db, summed
// by several kernels, is zeroed by zero_grad as before). The forward keeps its
// input for the weight gradient. Parameters are initialised as torchvision's VGG does
// (layers/init.h).
#pragma once

#include "kernels/common.h"
#include "kernels/conv2d.h"
#include "layers/init.h"
#include "layers/module.h"

namespace cudp {

class Conv2d : public Module {
 public:
  Conv2d(int in_channels, int out_channels, int kernel, int stride = 1, int padding = 0,
         bool bias = true, uint64_t seed = 0);
  // Parameters allocated but not initialised (to be filled by clone, load or reset_parameters).
  Conv2d(init::SkipInit, int in_channels, int out_channels, int kernel, int stride = 1,
         int padding = 0, bool bias = true);

  std::string type_name() const override { return "Conv2d"; }
  // PyTorch's "3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)" (", bias=False" without
  // one). cudp has no dilation, groups or padding_mode: they are always PyTorch's defaults, which
  // PyTorch leaves out of the text.
  std::string extra_repr() const override;
  // Under the bf16 policy: bf16 in and out. Under every policy a following ReLU is applied in the
  // epilogue and its backward's mask in the bias gradient's pass (Module::can_fuse_relu).
  bool takes_bf16() const override { return precision_ == Precision::bf16; }
  bool can_fuse_relu() const override { return true; }
  // The fused ReLU's mask can be left to the next layer (Module's hand-off): the backward then
  // takes only the bias gradient from dy. And this layer does the mask of a ReLU before it in
  // backward-data's epilogue on the GPU's tensor cores (bf16: bf16 input, channels multiples of 8;
  // tf32: stride 1, C and K multiples of 4), and on the CPU.
  bool can_take_masked_grad() const override { return true; }
  // The bias hand-off (Module): on the GPU, when the next layer did the fused ReLU's mask, the
  // bias gradient is the column sum of the gradient that layer returns, and it may add it up on
  // the way (max pooling's backward does); this layer's bias gradient is where it goes.
  float* output_grad_sums_target() override;

  // weight ~ N(0, sqrt(2 / (out * kernel^2))) from derive_seed(seed, "weight"); bias = 0.
  void reset_parameters(uint64_t seed);

  int in_channels() const { return in_; }
  int out_channels() const { return out_; }
  int kernel() const { return kernel_; }
  int stride() const { return stride_; }
  int padding() const { return padding_; }
  bool has_bias() const { return bias_ != nullptr; }
  Parameter& weight() { return *weight_; }  // [out, kernel, kernel, in] (KRSC)
  Parameter& bias();                        // [out]; throws when built without a bias

  // Whether the last forward ran as a dense map of 4C to 4K features (a 3x3 layer of stride 1 and
  // padding 1 on a 2x2 image, under bf16 on the GPU: kernels/conv2d_dense.h), for tests and
  // profiles.
  bool ran_dense_2x2() const { return ran_dense_2x2_; }

  // The GEMM math of the products, from the precision policy (Module::set_precision).
  kernels::Math math() const { return precision_math(precision_); }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  void release_saved() override {
    input_ = Tensor();
    input_bf16_ = Tensor();
    weight_bf16_ = Tensor();
    weight_rot_bf16_ = Tensor();
    weight_eff_bf16_ = Tensor();
  }
  std::shared_ptr<Module> make_empty_copy() const override;
  Tensor export_tensor(const std::string& local_name, const Tensor& internal) const override;
  Tensor import_tensor(const std::string& local_name, const Tensor& pytorch) const override;
  Shape export_shape(const std::string& local_name, const Shape& internal) const override;

 private:
  kernels::Conv2dShape shape_for(const Tensor& input) const;
  Tensor forward_bf16(const Tensor& input, const kernels::Conv2dShape& s);
  void bf16_filters(const kernels::Conv2dShape& s, bool rotate, cudaStream_t stream);
  Tensor backward_bf16(const Tensor& grad_output);
  // The dense form of a 3x3 layer on a 2x2 image (kernels/conv2d_dense.h), under bf16 on the GPU.
  void forward_dense_2x2(const kernels::Conv2dShape& s, Tensor& y, cudaStream_t stream);
  void backward_dense_2x2(const Tensor& dy, const Tensor& dx, float* db, cudaStream_t stream);
  int in_, out_, kernel_, stride_, padding_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  // Saved for backward: the input (fp32, tf32 and the CPU), or under bf16 on the GPU the bf16
  // operands (channels padded to 8, kernels/conv2d.h) of x and w, and w's rotated copy for
  // backward-data; or, in the dense 2x2 form, W_eff (or the bf16 filters, where it reads them as
  // W_eff's view).
  // (The output a fused ReLU's mask needs is Module's, keep_fused_relu_output.)
  Tensor input_;
  Tensor input_bf16_, weight_bf16_, weight_rot_bf16_, weight_eff_bf16_;
  DType input_dtype_ = DType::f32;
  kernels::Conv2dShape saved_shape_;
  bool ran_dense_2x2_ = false;
};

}  // namespace cudp
