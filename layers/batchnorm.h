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
// num_batches_tracked lives on the module's device like every buffer, but no kernel of ours does
// int64 arithmetic on the GPU. The module therefore keeps the count on the host as the truth and
// writes it into the buffer after each training forward: on the CPU directly, on a GPU with a
// cudaMemcpyAsync from pageable memory (CUDA stages such a copy before returning, so the host value
// may change right after, and the stream is not synchronised). load_state_dict updates the host
// count through import_tensor. Whoever writes the buffer by other means (the engine broadcasting
// replica 0's buffers) leaves the host count of that replica behind; replica 0's is the one kept.
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

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  std::shared_ptr<Module> make_empty_copy() const override;
  Tensor import_tensor(const std::string& local_name, const Tensor& pytorch) const override;

 private:
  int64_t rows_of(const Tensor& input) const;
  void write_batch_count();
  // y = (x - mean) / sqrt(running_var + eps) * gamma + beta (gamma, beta may be null: 1 and 0).
  void normalise_with_running_var(const float* x, float* y, const float* gamma, const float* beta,
                                  const float* mean, int64_t rows) const;
  // The backward kernel on the saved input: dgamma, dbeta accumulate, dx written.
  void parameter_gradients(const float* dy, const float* mean, const float* invstd, float* dx);

  int c_;
  float eps_, momentum_;
  Parameter* weight_ = nullptr;
  Parameter* bias_ = nullptr;
  Tensor* running_mean_ = nullptr;
  Tensor* running_var_ = nullptr;
  Tensor* num_batches_tracked_ = nullptr;
  // The count's truth (see above); mutable because import_tensor, a const hook, sets it on load.
  mutable int64_t batches_tracked_ = 0;
  // Saved by forward for backward (the statistics by a training forward only).
  bool saved_training_ = false;
  Tensor input_, save_mean_, save_invstd_;
};

}  // namespace cudp
