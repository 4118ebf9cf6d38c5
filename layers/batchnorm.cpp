#include "layers/batchnorm.h"

#include "engine/core/memory.h"
#include "kernels/batchnorm.h"
#include "kernels/scalars.h"

namespace cudp {

BatchNorm2d::BatchNorm2d(int num_features, float eps, float momentum)
    : BatchNorm2d(init::skip_init, num_features, eps, momentum) {
  reset_parameters();
}

BatchNorm2d::BatchNorm2d(init::SkipInit, int num_features, float eps, float momentum)
    : c_(num_features), eps_(eps), momentum_(momentum) {
  CUDP_CHECK(c_ > 0, "BatchNorm2d: num_features must be positive, got ", c_);
  CUDP_CHECK(eps_ > 0.0f, "BatchNorm2d: eps must be positive, got ", eps_);
  CUDP_CHECK(momentum_ >= 0.0f && momentum_ <= 1.0f,
             "BatchNorm2d: momentum must be in [0, 1], got ", momentum_);
  const cuda::AllocationPurpose purpose(
      detail::str("BatchNorm2d(", c_, ")'s weight, bias and running statistics"),
      "Use a smaller model or free memory (BatchNorm2d keeps 4 floats per channel).");
  weight_ = &register_parameter("weight", Tensor::empty({c_}));
  bias_ = &register_parameter("bias", Tensor::empty({c_}));
  running_mean_ = &register_buffer("running_mean", Tensor::empty({c_}));
  running_var_ = &register_buffer("running_var", Tensor::empty({c_}));
  num_batches_tracked_ = &register_buffer("num_batches_tracked", Tensor::zeros({}, DType::i64));
}

void BatchNorm2d::reset_parameters() {
  weight_->data.fill_(1.0f);
  bias_->data.zero_();
  refresh_compute_copies();  // a flattened bf16 model's copies follow (layers/module.h)
  running_mean_->zero_();
  running_var_->fill_(1.0f);
  batches_tracked_ = 0;
  num_batches_tracked_->zero_();
}

int64_t BatchNorm2d::rows_of(const Tensor& input) const {
  CUDP_CHECK(input.dim() == 4 && input.size(3) == c_ &&
                 (input.dtype() == DType::f32 || input.dtype() == DType::bf16),
             "BatchNorm2d: expected an NHWC f32 or bf16 input [N, H, W, ", c_, "], got ",
             input.str());
  return input.numel() / c_;
}

void BatchNorm2d::count_batch(bool counted_on_device) {
  int64_t* count = num_batches_tracked_->data<int64_t>();
  // +1 where the buffer lives: no pageable copy, and a CUDA graph's replays count too.
  run([&] { kernels::add_i64_cpu(count, 1); },
      [&](cudaStream_t s) {
        if (!counted_on_device) kernels::add_i64(count, 1, s);
      });
  ++batches_tracked_;
}

template <typename T>
void BatchNorm2d::forward_typed(const Tensor& input, Tensor& y) {
  const int64_t rows = rows_of(input);
  const T* x = input.data<T>();
  T* out = y.data<T>();
  const float* gamma = weight_->data.data<float>();
  const float* beta = bias_->data.data<float>();
  float* mean = running_mean_->data<float>();
  float* var = running_var_->data<float>();
  const int c = c_;
  const float eps = eps_, momentum = momentum_;
  const kernels::BnActivation act =
      relu_fused_ ? kernels::BnActivation::relu : kernels::BnActivation::none;
  if (!training_) {
    run(
        [&] {
          kernels::batchnorm_forward_eval_cpu(x, out, gamma, beta, mean, var, rows, c, eps, act);
        },
        [&](cudaStream_t s) {
          kernels::batchnorm_forward_eval(x, out, gamma, beta, mean, var, rows, c, eps, act, s);
        });
    return;
  }
  Tensor save_mean, save_invstd;
  {
    const cuda::AllocationPurpose purpose(
        detail::str("BatchNorm2d(", c_, ")'s saved batch mean and inverse deviation"),
        "They are kept with the activations for the backward: reduce the batch size "
        "(--batch-size).");
    save_mean = Tensor::empty({c_}, DType::f32, device_);
    save_invstd = Tensor::empty({c_}, DType::f32, device_);
  }
  float* sm = save_mean.data<float>();
  float* si = save_invstd.data<float>();
  run(
      [&] {
        kernels::batchnorm_forward_train_cpu(x, out, gamma, beta, mean, var, sm, si, rows, c,
                                             momentum, eps, act);
      },
      [&](cudaStream_t s) {
        // num_batches_tracked counted by the statistics' launches.
        kernels::batchnorm_forward_train(x, out, gamma, beta, mean, var, sm, si, rows, c, momentum,
                                         eps, act, s, num_batches_tracked_->data<int64_t>());
      });
  count_batch(/*counted_on_device=*/true);
  save_mean_ = save_mean;
  save_invstd_ = save_invstd;
}

Tensor BatchNorm2d::forward_one(const Tensor& input) {
  rows_of(input);
  Tensor y = Tensor::empty(input.shape(), input.dtype(), device_);
  saved_training_ = training_;
  input_ = input;
  if (input.dtype() == DType::bf16) {
    forward_typed<__nv_bfloat16>(input, y);
  } else {
    forward_typed<float>(input, y);
  }
  // A fused ReLU's backward needs the output (its mask); kept only then. The tensor is the one
  // returned, so this costs no memory while the next layer holds it.
  keep_fused_relu_output(y);
  return y;
}

template <typename T>
void BatchNorm2d::backward_typed(const Tensor& grad_output, Tensor& dx) {
  const Operands<T> o = operands<T>(grad_output, dx);
  if (saved_training_) {
    const float* mean = save_mean_.data<float>();
    const float* invstd = save_invstd_.data<float>();
    // The bias hand-off (Module): on the GPU, the column sums of dx, the bias gradient of the
    // layer before (a convolution's), in the pass that writes dx. The CPU path declines: that
    // layer sums dx itself.
    float* sums = device_.is_cuda() ? grad_sums_into_ : nullptr;
    run(
        [&] {
          kernels::batchnorm_backward_cpu(o.x, o.dy, o.mask, o.gamma, mean, invstd, o.dx, o.dgamma,
                                          o.dbeta, o.rows, o.c, 1.0f);
        },
        [&](cudaStream_t s) {
          kernels::batchnorm_backward(o.x, o.dy, o.mask, o.gamma, mean, invstd, o.dx, o.dgamma,
                                      o.dbeta, o.rows, o.c, 1.0f, s, sums);
        });
    input_grad_summed_ = sums != nullptr;
    return;
  }
  const float* mean = running_mean_->data<float>();
  const float* var = running_var_->data<float>();
  const float eps = eps_;
  run(
      [&] {
        kernels::batchnorm_backward_eval_cpu(o.x, o.dy, o.mask, o.gamma, mean, var, o.dx, o.dgamma,
                                             o.dbeta, o.rows, o.c, eps, 1.0f);
      },
      [&](cudaStream_t s) {
        kernels::batchnorm_backward_eval(o.x, o.dy, o.mask, o.gamma, mean, var, o.dx, o.dgamma,
                                         o.dbeta, o.rows, o.c, eps, 1.0f, s);
      });
}

Tensor BatchNorm2d::new_grad_input(const Tensor& grad_output, const char* layer) const {
  check_shape_of(grad_output, input_.shape(), layer, ": grad_output");
  CUDP_CHECK(grad_output.dtype() == input_.dtype(), layer,
             ": grad_output must have the output's dtype ", dtype_name(input_.dtype()),
             " (the input's), got ", grad_output.str(),
             "; convert the gradient where the dtypes change");
  return Tensor::empty(input_.shape(), input_.dtype(), device_);
}

Tensor BatchNorm2d::backward_one(const Tensor& grad_output) {
  Tensor dx = new_grad_input(grad_output, "BatchNorm2d");
  if (input_.dtype() == DType::bf16) {
    backward_typed<__nv_bfloat16>(grad_output, dx);
  } else {
    backward_typed<float>(grad_output, dx);
  }
  return dx;
}

void BatchNorm2d::sync_replica(const Module& primary, size_t replica, ReplicaSync when) {
  if (when != ReplicaSync::BuffersBroadcast) return;
  const auto* first = dynamic_cast<const BatchNorm2d*>(&primary);
  CUDP_CHECK(first != nullptr, "BatchNorm2d: replica ", replica, "'s BatchNorm2d matches a ",
             primary.type_name(), " in replica 0; replicas must have replica 0's structure");
  batches_tracked_ = first->batches_tracked_;
}

std::string BatchNorm2d::extra_repr() const {
  return detail::str(c_, ", eps=", py_float(eps_), ", momentum=", py_float(momentum_),
                     ", affine=True, track_running_stats=True");
}

std::shared_ptr<Module> BatchNorm2d::make_empty_copy() const {
  auto copy = std::make_shared<BatchNorm2d>(init::skip_init, c_, eps_, momentum_);
  copy->batches_tracked_ = batches_tracked_;
  return copy;
}

Tensor BatchNorm2d::import_tensor(const std::string& local_name, const Tensor& pytorch) const {
  if (local_name == "num_batches_tracked") {
    batches_tracked_ = pytorch.to_vector<int64_t>().at(0);
  }
  return pytorch;
}

}  // namespace cudp
