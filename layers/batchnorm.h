// BatchNorm2d: PyTorch's nn.BatchNorm2d(C, eps, momentum) over NHWC activations (per channel, over
// N*H*W rows), through kernels/batchnorm.h.
//
// Training normalises with the batch mean and biased variance, updates the running statistics with
// momentum and the unbiased variance, and counts num_batches_tracked += 1 (PyTorch's semantics; a
// momentum of None, the cumulative average, is not offered). Evaluation normalises with the running
// statistics. State, with PyTorch's names: parameters weight (1) and bias (0), buffers running_mean
// (0), running_var (1) and num_batches_tracked (an i64 scalar, shape []), so torchvision's
// state_dicts load strictly.
//
// Activations may be f32 or bf16: the output, and the gradient w.r.t. the input, have the input's
// dtype (grad_output must have it too); statistics, parameters, buffers and their gradients are
// fp32, and so is the GPU's arithmetic (kernels/batchnorm.h). On the CPU the layer runs the
// double-precision references, rounding to the activation dtype once on store, so the CPU path is
// the GPU's truth.
//
// A ReLU directly after it in a Sequential is fused (can_fuse_relu): forward writes max(bn(x), 0)
// and keeps that output; backward masks the incoming gradient by it, exactly as the ReLU would,
// so fused and unfused give the same bits. Where the layer after the ReLU takes the mask over
// (Module's mask hand-off: a max pooling's backward, or a convolution's backward-data epilogue,
// which read that output anyway), the output is not kept and backward reads it no more. In
// training, on the GPU, it also takes Module's bias hand-off: its dx pass adds up the column sums
// of the dx it writes into the bias gradient of the convolution before it, which then takes no
// pass of its own over its output gradient for it.
//
// num_batches_tracked lives on the module's device like every buffer, and the module keeps the
// count on the host too (num_batches_tracked(), clones). After each training forward the buffer
// is incremented where it lives (on a GPU by the statistics' finalize kernel, or by
// kernels/scalars.h add_i64, a one-thread kernel, where SyncBatchNorm2d merges the statistics: on
// the stream, no host memory involved, so a CUDA graph's replays count too), starting from the
// value the buffer holds. load_state_dict updates the host count through import_tensor. Whoever
// writes the buffer by other means leaves the host count behind; the engine broadcasting replica
// 0's buffers to the other replicas says so (sync_replica), and they take replica 0's count.
//
// Backward after a training-mode forward is the batch-statistics gradient; after an eval-mode
// forward, the gradient of the affine map the frozen statistics make (PyTorch's, too).
#pragma once

#include "layers/init.h"
#include "layers/module.h"

namespace cudp {

class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int num_features, float eps = 1e-5f, float momentum = 0.1f);
  BatchNorm2d(init::SkipInit, int num_features, float eps = 1e-5f, float momentum = 0.1f);

  std::string type_name() const override { return "BatchNorm2d"; }
  // PyTorch's "64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True" (SyncBatchNorm2d
  // too). cudp's BatchNorm is always affine and always tracks running statistics: those two are
  // always True.
  std::string extra_repr() const override;
  bool takes_bf16() const override { return true; }  // its output keeps the input's dtype
  bool can_fuse_relu() const override { return true; }
  bool can_take_masked_grad() const override { return detail::batchnorm_mask_handoff(); }

  // weight = 1, bias = 0, running_mean = 0, running_var = 1, num_batches_tracked = 0.
  void reset_parameters();

  int num_features() const { return c_; }
  float eps() const { return eps_; }
  float momentum() const { return momentum_; }
  int64_t num_batches_tracked() const { return batches_tracked_; }
  Parameter& weight() { return *weight_; }
  Parameter& bias() { return *bias_; }
  Tensor& running_mean() { return *running_mean_; }
  Tensor& running_var() { return *running_var_; }
  // After the engine broadcast replica 0's buffers to this replica: the host count follows the
  // buffer, so every replica reports replica 0's num_batches_tracked().
  void sync_replica(const Module& primary, size_t replica, ReplicaSync when) override;

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  void release_saved() override {
    input_ = Tensor();
    save_mean_ = Tensor();
    save_invstd_ = Tensor();
  }
  std::shared_ptr<Module> make_empty_copy() const override;
  Tensor import_tensor(const std::string& local_name, const Tensor& pytorch) const override;

 protected:  // shared with SyncBatchNorm2d (layers/sync_batchnorm.h)
  int64_t rows_of(const Tensor& input) const;
  // num_batches_tracked += 1: on the CPU, or by a launch of its own on the GPU unless the caller's
  // launches counted it already (counted_on_device: kernels::batchnorm_forward_train's counter).
  void count_batch(bool counted_on_device = false);
  template <typename T>
  void forward_typed(const Tensor& input, Tensor& y);
  template <typename T>
  void backward_typed(const Tensor& grad_output, Tensor& dx);
  // The fused ReLU's mask for backward (Module::fused_relu_mask), as T, or null.
  template <typename T>
  const T* relu_mask() const {
    const Tensor* y = fused_relu_mask();
    return y != nullptr ? y->data<T>() : nullptr;
  }
  // A backward's operands: x (the saved input), dy and the fused ReLU's mask (null without one)
  // read, dx written; gamma read and the affine parameters' gradients written, in fp32.
  template <typename T>
  struct Operands {
    const T* x;
    const T* dy;
    const T* mask;
    T* dx;
    const float* gamma;
    float* dgamma;
    float* dbeta;
    int64_t rows;
    int c;
  };
  template <typename T>
  Operands<T> operands(const Tensor& grad_output, Tensor& dx) const {
    return {input_.data<T>(),
            grad_output.data<T>(),
            relu_mask<T>(),
            dx.data<T>(),
            weight_->data.data<float>(),
            weight_->grad.data<float>(),
            bias_->grad.data<float>(),
            rows_of(input_),
            c_};
  }
  // A new dx for `grad_output`, once that is checked against the saved input (its shape and
  // dtype; an error names `layer`).
  Tensor new_grad_input(const Tensor& grad_output, const char* layer) const;

  int c_;
  float eps_, momentum_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  Tensor* running_mean_ = nullptr;
  Tensor* running_var_ = nullptr;
  Tensor* num_batches_tracked_ = nullptr;
  // The host copy of the count (see above); mutable because import_tensor, a const hook, sets it
  // on load.
  mutable int64_t batches_tracked_ = 0;
  // Saved by forward for backward (the statistics by a training forward only).
  bool saved_training_ = false;
  Tensor input_, save_mean_, save_invstd_;
};

}  // namespace cudp
