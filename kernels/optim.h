// Optimizer updates and gradient norms on flat fp32 buffers.
//
// The layers pack every parameter of a model into one buffer (and the gradients, and each optimizer
// state, alike), so one launch updates a whole model and a global norm is one reduction over one
// buffer. Element-wise updates do not care where a tensor starts; weight decay applies to every
// element given (a caller that exempts biases passes those ranges separately).
//
// The arithmetic is PyTorch's for-each path (the default on CUDA), in fp32, step by step:
//   SGD (torch.optim.SGD):   g = grad + wd * p                              (when wd != 0)
//                            buf = first_step ? g : momentum * buf + (1 - dampening) * g
//                            g = nesterov ? g + momentum * buf : buf        (when momentum != 0)
//                            p = p - lr * g
//   AdamW (torch.optim.AdamW, `step` counted from 1):
//                            p = p * (1 - lr * wd)
//                            m = lerp(m, g, 1 - beta1)        (PyTorch's lerp, both branches)
//                            v = v * beta2 + (1 - beta2) * g * g
//                            p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//                            with bc1 = 1 - beta1^step, bc2 = 1 - beta2^step.
// Hyperparameters are doubles (Python floats). Scalars derived from them (1 - dampening, 1 - lr*wd,
// the bias corrections, -lr/bc1) are computed in double on the host and rounded once to fp32, as
// PyTorch does. Each fused multiply-add that PyTorch's kernels contain is an explicit fmaf here, in
// a formula shared by the CUDA kernel and the CPU reference (detail:: below), so the two agree
// bitwise; nothing is left for the compiler to contract differently on either side.
//
// The bf16 compute copy (the parameter store, layers/module.h): the gated and captured updates take
// `compute`, n bf16 elements mirroring `param`; when it is not null each element written to param
// is also written there, rounded to nearest even (what kernels/layout.h's f32_to_bf16 gives), in
// the same pass, so the copy a bf16 model's products read never needs a pass of its own. A skipped
// step writes neither.
//
// Gated steps (--on-nan skip-step with no host synchronisation): the step's own check (a loss or a
// gradient norm that is not finite, nonfinite_flag) writes a flag on the device, and the update
// reads it there; when it is set, nothing is written. A skipped step must not count either (SGD's
// first step, AdamW's bias corrections), yet the host that issues the steps cannot know which were
// skipped without waiting. So the count is corrected on the device (StepGate below): the caller
// passes the count it issued, and the device subtracts the skipped steps the caller has not yet
// heard of. While there are none, AdamW uses the scalars computed on the host as above; after a
// skip, until the caller folds it into its count (reading *skipped when it reads results anyway),
// the kernel computes the bias corrections itself in double with the same formula, where the
// device's pow (CUDA's: within 2 ulp) may in rare cases round to another fp32 scalar than the
// host's.
//
// Norms: sum_of_squares and global_norm reduce in fp32 (docs/architecture.md §2.3) in two stages in
// a fixed order; the partition depends only on n, so every replica, on any GPU model, gets the same
// bits from the same gradients and clips identically. Clipping reads the norm from device memory:
// no host synchronisation in the step. Like torch.nn.utils.clip_grad_norm_, it multiplies by min(1,
// max_norm / (norm + 1e-6)) unconditionally (by exactly 1 when the norm is small).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "kernels/common.h"

namespace cudp::kernels {

// The device side of a gated step. skip: one int, nonzero: write nothing. skipped: the count of
// skipped steps that would have advanced the state (count_skipped_step's counts[1]); folded: the
// part of *skipped the caller has already taken out of the counts it passes. A step's count as
// taken is then issued - (*skipped - folded). All null / 0: an ordinary step.
struct StepGate {
  const int32_t* skip = nullptr;
  const int64_t* skipped = nullptr;
  int64_t folded = 0;
};

// param, grad, momentum_buf: n floats. momentum_buf may be nullptr when momentum == 0. first_step:
// this buffer has no history yet (PyTorch's `momentum_buffer is None`): it is set to g, not
// decayed.
void sgd_step(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov,
              bool first_step, cudaStream_t stream);
void sgd_step_cpu(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov,
                  bool first_step);

// Gated: momentum_steps is the number of updates of this momentum buffer issued before this one
// (a buffer restored from a checkpoint counts as one); the step is the buffer's first when that
// count, less the skipped ones, is 0.
// grad_norm (a device float, or null): *grad_norm = the 2-norm of grad, the bits global_norm(grad,
// n) gives, from the update's own reads of the gradient (the update runs on the norm's partition
// and sums the squares as it goes), so a step that wants both reads the gradients once. Written
// whether or not the step is skipped. The CPU reference computes global_norm_cpu.
void sgd_step(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov,
              int64_t momentum_steps, const StepGate& gate, cudaStream_t stream,
              __nv_bfloat16* compute = nullptr, float* grad_norm = nullptr);
void sgd_step_cpu(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
                  double momentum, double dampening, double weight_decay, bool nesterov,
                  int64_t momentum_steps, const StepGate& gate, __nv_bfloat16* compute = nullptr,
                  float* grad_norm = nullptr);

// m, v: first and second moments (zero before the first step). step: 1 on the first call.
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step,
                cudaStream_t stream);
void adamw_step_cpu(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step);

// Gated: `step` is the step number issued (1 on the first call); the step taken is that less the
// skipped ones. grad_norm: as sgd_step's.
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step,
                const StepGate& gate, cudaStream_t stream, __nv_bfloat16* compute = nullptr,
                float* grad_norm = nullptr);
void adamw_step_cpu(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    const StepGate& gate, __nv_bfloat16* compute = nullptr,
                    float* grad_norm = nullptr);

// After the updates of one gated step: when *skip is nonzero, counts[0] += 1 (steps skipped) and,
// when the step would have advanced the optimizer's state, counts[1] += 1 (what StepGate::skipped
// points at). A separate launch, so that every block of the updates read the counts before.
void count_skipped_step(const int32_t* skip, int64_t* counts, bool advances_state,
                        cudaStream_t stream);
void count_skipped_step_cpu(const int32_t* skip, int64_t* counts, bool advances_state);

// *flag = 1 when *a or *b (b may be null) is NaN or infinite, else 0 (=): a step's loss and
// gradient norm checked where they are, one device int.
void nonfinite_flag(const float* a, const float* b, int32_t* flag, cudaStream_t stream);
void nonfinite_flag_cpu(const float* a, const float* b, int32_t* flag);

// *out = sum of x[i]^2 (=), one device float.
void sum_of_squares(const float* x, int64_t n, float* out, cudaStream_t stream);
void sum_of_squares_cpu(const float* x, int64_t n, float* out);

// *norm = sqrt(sum of x[i]^2) (=), one device float.
void global_norm(const float* x, int64_t n, float* norm, cudaStream_t stream);
void global_norm_cpu(const float* x, int64_t n, float* norm);

// grad *= min(1, max_norm / (*norm + 1e-6)), *norm read on the device.
void scale_by_clip_coefficient(float* grad, int64_t n, const float* norm, float max_norm,
                               cudaStream_t stream);
void scale_by_clip_coefficient_cpu(float* grad, int64_t n, const float* norm, float max_norm);

// torch.nn.utils.clip_grad_norm_ on one flat gradient buffer: global_norm into *norm (a device
// float the caller can read later, as PyTorch returns the total norm), then the scaling.
void clip_grad_norm(float* grad, int64_t n, float max_norm, float* norm, cudaStream_t stream);
void clip_grad_norm_cpu(float* grad, int64_t n, float max_norm, float* norm);

namespace detail {

struct SgdCoefficients {
  float weight_decay;  // applied when != 0
  float momentum;      // the momentum path runs when != 0
  float keep;          // 1 - dampening
  float neg_lr;        // -lr
  bool nesterov;
  bool first_step;
};
// Validates like torch.optim.SGD (ValueError naming the value; `who` begins the message) and rounds
// the scalars.
SgdCoefficients sgd_coefficients(int64_t n, double lr, double momentum, double dampening,
                                 double weight_decay, bool nesterov, bool first_step,
                                 const char* who = "sgd_step");

CUDP_HD inline float sgd_update(float p, float g, float* buf, const SgdCoefficients& k) {
  if (k.weight_decay != 0.f) g = fmaf(k.weight_decay, p, g);  // _foreach_add(g, p, alpha=wd)
  if (k.momentum != 0.f) {
    // _foreach_mul_(buf, momentum); _foreach_add_(buf, g, alpha=1 - dampening)
    const float b = k.first_step ? g : fmaf(k.keep, g, *buf * k.momentum);
    *buf = b;
    g = k.nesterov ? fmaf(k.momentum, b, g) : b;  // _foreach_add_(g, buf, alpha=momentum)
  }
  return fmaf(k.neg_lr, g, p);  // _foreach_add_(p, g, alpha=-lr)
}

// Whether a gated step is skipped, and a count issued as `issued` as taken (see StepGate).
CUDP_HD inline bool skipped(const StepGate& gate) {
  return gate.skip != nullptr && *gate.skip != 0;
}
CUDP_HD inline int64_t steps_taken(int64_t issued, const StepGate& gate) {
  return gate.skipped != nullptr ? issued - (*gate.skipped - gate.folded) : issued;
}

struct AdamWCoefficients {
  float decay;  // 1 - lr * wd, applied when wd != 0
  bool decays;
  float w1;            // 1 - beta1, the lerp weight
  float one_minus_w1;  // 1 - w1 in fp32, lerp's second branch
  float beta2;
  float w2;        // 1 - beta2
  float bc2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float step_size;  // -lr / (1 - beta1^step)
  // The hyperparameters as given, for set_bias_corrections on the device (a gated step after a
  // skip).
  double lr_given, beta1_given, beta2_given;
};

// bc2_sqrt and step_size for `step`, as torch/optim/adam.py (_multi_tensor_adam) computes them in
// Python floats: the host's coefficients and a gated kernel's after a skip share this formula.
CUDP_HD inline void set_bias_corrections(AdamWCoefficients& k, int64_t step) {
  const double bc1 = 1 - pow(k.beta1_given, double(step));
  const double bc2 = 1 - pow(k.beta2_given, double(step));
  k.bc2_sqrt = float(pow(bc2, 0.5));
  k.step_size = float((k.lr_given / bc1) * -1);
}
// Validates like torch.optim.AdamW (ValueError naming the value; `who` begins the message) and
// rounds the scalars.
AdamWCoefficients adamw_coefficients(int64_t n, double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step,
                                     const char* who = "adamw_step");

CUDP_HD inline void adamw_update(float& p, float g, float& m, float& v,
                                 const AdamWCoefficients& k) {
  if (k.decays) p = p * k.decay;  // _foreach_mul_(p, 1 - lr * wd)
  // _foreach_lerp_(m, g, 1 - beta1): PyTorch's lerp picks the branch by |weight| < 0.5.
  m = fabsf(k.w1) < 0.5f ? fmaf(k.w1, g - m, m) : fmaf(-(g - m), k.one_minus_w1, g);
  v = fmaf(k.w2, g * g,
           v * k.beta2);  // _foreach_mul_(v, beta2); _foreach_addcmul_(v, g, g, 1 - beta2)
  const float denom = sqrtf(v) / k.bc2_sqrt + k.eps;  // sqrt, div by sqrt(bc2), add eps
  p = fmaf(k.step_size, m / denom, p);                // _foreach_addcdiv_(p, m, denom, -lr/bc1)
}

// min(1, max_norm / (norm + 1e-6)) in fp32, as clip_grad_norm_ computes it on the device; a NaN
// norm gives NaN (torch.clamp propagates it), not 1.
CUDP_HD inline float clip_coefficient(float norm, float max_norm) {
  const float coef = max_norm / (norm + 1e-6f);
  return coef > 1.f ? 1.f : coef;
}

}  // namespace detail

// Captured steps (engine/core/graph.h NOTE [Replay scalars]): the same updates, with every scalar
// that may change from step to step (the rate, the momentum, the step counts, the folded skips)
// read on the device from `scalars`, which the host rewrites before each replay of the graph. The
// arithmetic is the kernels' above, element for element, so a replay and an eager step agree bit
// for bit. `host` holds this step's values (for the launch configuration and the checks); the
// kernel reads `scalars`, which must hold the same values by the time it runs. gate.folded is
// ignored (scalars->folded is read).
struct SgdScalars {
  detail::SgdCoefficients k;  // first_step unused: from momentum_steps as above
  int64_t momentum_steps;
  int64_t folded;
};
struct AdamWScalars {
  detail::AdamWCoefficients k;
  int64_t step;
  int64_t folded;
};
SgdScalars sgd_scalars(int64_t n, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, int64_t momentum_steps,
                       int64_t folded);
void sgd_step_captured(float* param, const float* grad, float* momentum_buf, int64_t n,
                       const SgdScalars& host, const SgdScalars* scalars, const StepGate& gate,
                       cudaStream_t stream, __nv_bfloat16* compute = nullptr,
                       float* grad_norm = nullptr);
AdamWScalars adamw_scalars(int64_t n, double lr, double beta1, double beta2, double eps,
                           double weight_decay, int64_t step, int64_t folded);
void adamw_step_captured(float* param, const float* grad, float* m, float* v, int64_t n,
                         const AdamWScalars* scalars, const StepGate& gate, cudaStream_t stream,
                         __nv_bfloat16* compute = nullptr, float* grad_norm = nullptr);

}  // namespace cudp::kernels
