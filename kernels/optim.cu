// Optimizer and norm kernels (semantics and the reasons for them: kernels/optim.h).
//
// Element-wise kernels walk the flat buffers with float4 accesses when every pointer is 16-byte
// aligned (then a scalar tail), else with scalar ones; the per-element arithmetic is the shared
// detail:: formula, so the path taken does not change a bit. Norms reduce in two fixed stages whose
// partition depends on n alone.
#include <algorithm>
#include <type_traits>

#include "engine/core/launch.cuh"
#include "kernels/optim.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;
constexpr int kNormBlocks = 1024;  // partials of a norm: at most this many, a function of n only

__device__ __forceinline__ int64_t thread_index() {
  return blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() {
  return int64_t(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ float4 load4(const float* p, int64_t i) {
  return reinterpret_cast<const float4*>(p)[i];
}
__device__ __forceinline__ void store4(float* p, int64_t i, float4 v) {
  reinterpret_cast<float4*>(p)[i] = v;
}

// Four consecutive elements of the bf16 compute copy (8 bytes: aligned when the fp32 ones are 16
// and the copy mirrors them), rounded to nearest even.
__device__ __forceinline__ void store4_bf16(__nv_bfloat16* c, int64_t i, float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  uint2 bits;
  bits.x = *reinterpret_cast<const uint32_t*>(&lo);
  bits.y = *reinterpret_cast<const uint32_t*>(&hi);
  reinterpret_cast<uint2*>(c)[i] = bits;
}

// Every element of n (param, grad, state...) once, in chunks of 4 consecutive elements: thread t
// takes chunks t, t + T, ... (T threads in all). A whole chunk of aligned buffers (Vec) goes to
// `four(j, g)` as one float4 of its gradient, any other to `one(e, g_e)` element by element.
// Returns the thread's sum of the squared gradients in element order (fmaf, a missing element as
// 0): the first stage of the norm, so that an update launched on the norm's partition (norm_blocks)
// gives the bits of sum_of_squares_partial_kernel. `Squares` false: 0, and nothing is summed.
template <bool Vec, bool Squares, class Four, class One>
__device__ __forceinline__ float walk_chunks(const float* __restrict__ grad, int64_t n, Four four,
                                             One one) {
  const int64_t chunks = (n + 3) / 4;
  float sum = 0.f;
  for (int64_t j = thread_index(); j < chunks; j += thread_count()) {
    const int64_t e = 4 * j;
    float4 g;
    if (Vec && e + 3 < n) {
      g = load4(grad, j);
      four(j, g);
    } else {
      g.x = grad[e];  // e < n since j < chunks
      g.y = e + 1 < n ? grad[e + 1] : 0.f;
      g.z = e + 2 < n ? grad[e + 2] : 0.f;
      g.w = e + 3 < n ? grad[e + 3] : 0.f;
      one(e, g.x);
      if (e + 1 < n) one(e + 1, g.y);
      if (e + 2 < n) one(e + 2, g.z);
      if (e + 3 < n) one(e + 3, g.w);
    }
    if constexpr (Squares) {
      sum = fmaf(g.x, g.x, sum);
      sum = fmaf(g.y, g.y, sum);
      sum = fmaf(g.z, g.z, sum);
      sum = fmaf(g.w, g.w, sum);
    }
  }
  return sum;
}

// The block's threads' sums in a fixed tree; partials[blockIdx.x] = the total. Every thread of the
// block calls it.
__device__ __forceinline__ void store_block_sum(float sum, float* __restrict__ partials) {
  __shared__ float tree[kThreads];
  tree[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) tree[threadIdx.x] += tree[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = tree[0];
}

constexpr auto kNoFour = [](int64_t, float4) {};
constexpr auto kNoOne = [](int64_t, float) {};

// With `partials` (Norm): the gradients' sum of squares as well, stage 1 of the norm (see
// walk_chunks), also when the step is skipped.
template <bool Vec, bool Norm>
__global__ void sgd_kernel(float* __restrict__ param, const float* __restrict__ grad,
                           float* __restrict__ buf, int64_t n, detail::SgdCoefficients k,
                           int64_t momentum_steps, StepGate gate,
                           const SgdScalars* __restrict__ scalars,
                           __nv_bfloat16* __restrict__ compute, float* __restrict__ partials) {
  kernel_entry();
  if (scalars != nullptr) {  // a captured step: this replay's values (optim.h)
    k = scalars->k;
    momentum_steps = scalars->momentum_steps;
    gate.folded = scalars->folded;
  }
  if (detail::skipped(gate)) {  // a skipped step writes nothing
    if constexpr (Norm) store_block_sum(walk_chunks<Vec, true>(grad, n, kNoFour, kNoOne), partials);
    return;
  }
  k.first_step = detail::steps_taken(momentum_steps, gate) == 0;
  // The buffer is read only when it has history, so a fresh (uninitialised) one is never read.
  const bool reads_buf = k.momentum != 0.f && !k.first_step;
  const bool writes_buf = k.momentum != 0.f;
  const float sum = walk_chunks<Vec, Norm>(
      grad, n,
      [&](int64_t i, float4 g) {
        float4 p = load4(param, i);
        float4 b = reads_buf ? load4(buf, i) : make_float4(0.f, 0.f, 0.f, 0.f);
        p.x = detail::sgd_update(p.x, g.x, &b.x, k);
        p.y = detail::sgd_update(p.y, g.y, &b.y, k);
        p.z = detail::sgd_update(p.z, g.z, &b.z, k);
        p.w = detail::sgd_update(p.w, g.w, &b.w, k);
        store4(param, i, p);
        if (writes_buf) store4(buf, i, b);
        if (compute != nullptr) store4_bf16(compute, i, p);
      },
      [&](int64_t i, float g) {
        float b = reads_buf ? buf[i] : 0.f;
        const float p = detail::sgd_update(param[i], g, &b, k);
        param[i] = p;
        if (writes_buf) buf[i] = b;
        if (compute != nullptr) compute[i] = __float2bfloat16_rn(p);
      });
  if constexpr (Norm) store_block_sum(sum, partials);
}

template <bool Vec, bool Norm>
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad,
                             float* __restrict__ m, float* __restrict__ v, int64_t n,
                             detail::AdamWCoefficients k, int64_t step, StepGate gate,
                             const AdamWScalars* __restrict__ scalars,
                             __nv_bfloat16* __restrict__ compute, float* __restrict__ partials) {
  kernel_entry();
  if (scalars != nullptr) {  // a captured step: this replay's values (optim.h)
    k = scalars->k;
    step = scalars->step;
    gate.folded = scalars->folded;
  }
  if (detail::skipped(gate)) {  // a skipped step writes nothing
    if constexpr (Norm) store_block_sum(walk_chunks<Vec, true>(grad, n, kNoFour, kNoOne), partials);
    return;
  }
  // After a skip the host's scalars are for a step that was not taken: recompute them (optim.h).
  if (const int64_t taken = detail::steps_taken(step, gate); taken != step) {
    detail::set_bias_corrections(k, taken);
  }
  const float sum = walk_chunks<Vec, Norm>(
      grad, n,
      [&](int64_t i, float4 g) {
        float4 p = load4(param, i), mm = load4(m, i), vv = load4(v, i);
        detail::adamw_update(p.x, g.x, mm.x, vv.x, k);
        detail::adamw_update(p.y, g.y, mm.y, vv.y, k);
        detail::adamw_update(p.z, g.z, mm.z, vv.z, k);
        detail::adamw_update(p.w, g.w, mm.w, vv.w, k);
        store4(param, i, p);
        store4(m, i, mm);
        store4(v, i, vv);
        if (compute != nullptr) store4_bf16(compute, i, p);
      },
      [&](int64_t i, float g) {
        float p = param[i], mm = m[i], vv = v[i];
        detail::adamw_update(p, g, mm, vv, k);
        param[i] = p, m[i] = mm, v[i] = vv;
        if (compute != nullptr) compute[i] = __float2bfloat16_rn(p);
      });
  if constexpr (Norm) store_block_sum(sum, partials);
}

// Stage 1 of a norm: each thread's sum of squares over its chunks (walk_chunks), then the block's
// fixed tree.
template <bool Vec>
__global__ void sum_of_squares_partial_kernel(const float* __restrict__ x, int64_t n,
                                              float* __restrict__ partials) {
  kernel_entry();
  store_block_sum(walk_chunks<Vec, true>(x, n, kNoFour, kNoOne), partials);
}

// Stage 2, one block: the partials in a fixed tree; *out = sum, or its square root.
template <bool Sqrt>
__global__ void __launch_bounds__(kNormBlocks)
    sum_partials_kernel(const float* __restrict__ partials, int parts, float* __restrict__ out) {
  kernel_entry();
  __shared__ float tree[kNormBlocks];
  tree[threadIdx.x] = int(threadIdx.x) < parts ? partials[threadIdx.x] : 0.f;
  __syncthreads();
  for (int half = kNormBlocks / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) tree[threadIdx.x] += tree[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = Sqrt ? sqrtf(tree[0]) : tree[0];
}

template <bool Vec>
__global__ void clip_scale_kernel(float* __restrict__ grad, int64_t n,
                                  const float* __restrict__ norm, float max_norm) {
  kernel_entry();
  const float coef = detail::clip_coefficient(*norm, max_norm);
  int64_t done = 0;
  if constexpr (Vec) {
    const int64_t vectors = n / 4;
    for (int64_t i = thread_index(); i < vectors; i += thread_count()) {
      float4 g = load4(grad, i);
      g.x *= coef, g.y *= coef, g.z *= coef, g.w *= coef;
      store4(grad, i, g);
    }
    done = vectors * 4;
  }
  for (int64_t i = done + thread_index(); i < n; i += thread_count()) grad[i] *= coef;
}

__global__ void count_skipped_step_kernel(const int32_t* __restrict__ skip,
                                          int64_t* __restrict__ counts, bool advances_state) {
  kernel_entry();
  if (*skip == 0) return;
  counts[0] += 1;
  if (advances_state) counts[1] += 1;
}

__global__ void nonfinite_flag_kernel(const float* __restrict__ a, const float* __restrict__ b,
                                      int32_t* __restrict__ flag) {
  kernel_entry();
  *flag = !isfinite(*a) || (b != nullptr && !isfinite(*b)) ? 1 : 0;
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Enough blocks for one chunk of 4 elements per thread, capped: the loops stride over the rest
// (clip_scale_kernel's scalar loop strides by element over as many threads).
unsigned elementwise_blocks(int64_t n) {
  const int64_t chunks = (n + 3) / 4;
  return unsigned(std::clamp<int64_t>((chunks + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// A norm's partition, a function of n alone: one chunk a thread up to kNormBlocks blocks.
int norm_blocks(int64_t n) {
  const int64_t chunks = (n + 3) / 4;
  return int(std::clamp<int64_t>((chunks + kThreads - 1) / kThreads, 1, kNormBlocks));
}

template <bool Sqrt>
void reduce_squares(const char* op, const float* x, int64_t n, float* out, cudaStream_t stream) {
  CUDP_CHECK(n >= 0, op, ": n must be >= 0, got ", n);
  CUDP_CHECK(out != nullptr, op, ": the output pointer is null");
  const int parts = norm_blocks(n);
  Workspace ws(size_t(parts) * sizeof(float), stream, "the norm's per-block partial sums");
  float* partials = ws.get();
  if (aligned16(x)) {
    launch("sum_of_squares_partial_kernel", sum_of_squares_partial_kernel<true>, parts, kThreads, 0,
           stream, x, n, partials);
  } else {
    launch("sum_of_squares_partial_kernel", sum_of_squares_partial_kernel<false>, parts, kThreads,
           0, stream, x, n, partials);
  }
  launch("sum_partials_kernel", sum_partials_kernel<Sqrt>, 1, kNormBlocks, 0, stream, partials,
         parts, out);
}

// The vectorised path needs the compute copy 8-byte aligned as well (it is, when it mirrors a
// 16-byte-aligned param: flat buffers, layers/module.h).
bool aligned8(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % 8 == 0;
}

// An update kernel over n elements: `pick(bool_constant<Vec>, bool_constant<Norm>)` is its
// instance, `args` its arguments before `partials`. Without `grad_norm`, one chunk of 4 elements a
// thread. With it, on the norm's partition, with the partial sums of squares of the gradient the
// update reads, then *grad_norm = their root: the bits of global_norm(grad, n), from the update's
// own reads.
template <class Pick, class... Args>
void launch_update(const char* name, bool vec, int64_t n, float* grad_norm, cudaStream_t stream,
                   Pick pick, Args... args) {
  if (n == 0) {
    if (grad_norm != nullptr) global_norm(nullptr, 0, grad_norm, stream);  // 0
    return;
  }
  const auto run = [&](auto norm, unsigned blocks, float* partials) {
    if (vec) {
      launch(name, pick(std::true_type{}, norm), blocks, kThreads, 0, stream, args..., partials);
    } else {
      launch(name, pick(std::false_type{}, norm), blocks, kThreads, 0, stream, args..., partials);
    }
  };
  if (grad_norm == nullptr) {
    run(std::false_type{}, elementwise_blocks(n), nullptr);
    return;
  }
  const int parts = norm_blocks(n);
  Workspace ws(size_t(parts) * sizeof(float), stream, "the norm's per-block partial sums");
  run(std::true_type{}, unsigned(parts), ws.get());
  launch("sum_partials_kernel", sum_partials_kernel<true>, 1, kNormBlocks, 0, stream, ws.get(),
         parts, grad_norm);
}

void launch_sgd(float* param, const float* grad, float* momentum_buf, int64_t n,
                const SgdScalars& host, const SgdScalars* scalars, const StepGate& gate,
                cudaStream_t stream, __nv_bfloat16* compute, float* grad_norm) {
  const bool momentum = host.k.momentum != 0.f;
  CUDP_CHECK(!momentum || momentum_buf || n == 0, "sgd_step: momentum ", host.k.momentum,
             " needs a momentum buffer");
  const bool vec = aligned16(param) && aligned16(grad) && (!momentum || aligned16(momentum_buf)) &&
                   aligned8(compute);
  launch_update(
      "sgd_kernel", vec, n, grad_norm, stream,
      [](auto vec, auto norm) { return sgd_kernel<vec(), norm()>; }, param, grad, momentum_buf, n,
      host.k, host.momentum_steps, gate, scalars, compute);
}

void launch_adamw(float* param, const float* grad, float* m, float* v, int64_t n,
                  const detail::AdamWCoefficients& k, int64_t step, const AdamWScalars* scalars,
                  const StepGate& gate, cudaStream_t stream, __nv_bfloat16* compute,
                  float* grad_norm) {
  const bool vec =
      aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) && aligned8(compute);
  launch_update(
      "adamw_kernel", vec, n, grad_norm, stream,
      [](auto vec, auto norm) { return adamw_kernel<vec(), norm()>; }, param, grad, m, v, n, k,
      step, gate, scalars, compute);
}

}  // namespace

void sgd_step(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov,
              bool first_step, cudaStream_t stream) {
  sgd_step(param, grad, momentum_buf, n, lr, momentum, dampening, weight_decay, nesterov,
           first_step ? 0 : 1, StepGate{}, stream);
}

void sgd_step(float* param, const float* grad, float* momentum_buf, int64_t n, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov,
              int64_t momentum_steps, const StepGate& gate, cudaStream_t stream,
              __nv_bfloat16* compute, float* grad_norm) {
  CUDP_CHECK(momentum_steps >= 0, "sgd_step: momentum_steps must be >= 0, got ", momentum_steps);
  const SgdScalars host = sgd_scalars(n, lr, momentum, dampening, weight_decay, nesterov,
                                      momentum_steps, gate.folded);
  launch_sgd(param, grad, momentum_buf, n, host, nullptr, gate, stream, compute, grad_norm);
}

void sgd_step_captured(float* param, const float* grad, float* momentum_buf, int64_t n,
                       const SgdScalars& host, const SgdScalars* scalars, const StepGate& gate,
                       cudaStream_t stream, __nv_bfloat16* compute, float* grad_norm) {
  CUDP_CHECK(scalars != nullptr, "sgd_step_captured: the device scalars pointer is null");
  launch_sgd(param, grad, momentum_buf, n, host, scalars, gate, stream, compute, grad_norm);
}

SgdScalars sgd_scalars(int64_t n, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, int64_t momentum_steps,
                       int64_t folded) {
  return {detail::sgd_coefficients(n, lr, momentum, dampening, weight_decay, nesterov, false),
          momentum_steps, folded};
}

void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step,
                cudaStream_t stream) {
  adamw_step(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, StepGate{}, stream);
}

void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step,
                const StepGate& gate, cudaStream_t stream, __nv_bfloat16* compute,
                float* grad_norm) {
  const detail::AdamWCoefficients k =
      detail::adamw_coefficients(n, lr, beta1, beta2, eps, weight_decay, step);
  launch_adamw(param, grad, m, v, n, k, step, nullptr, gate, stream, compute, grad_norm);
}

void adamw_step_captured(float* param, const float* grad, float* m, float* v, int64_t n,
                         const AdamWScalars* scalars, const StepGate& gate, cudaStream_t stream,
                         __nv_bfloat16* compute, float* grad_norm) {
  CUDP_CHECK(scalars != nullptr, "adamw_step_captured: the device scalars pointer is null");
  launch_adamw(param, grad, m, v, n, {}, 0, scalars, gate, stream, compute, grad_norm);
}

AdamWScalars adamw_scalars(int64_t n, double lr, double beta1, double beta2, double eps,
                           double weight_decay, int64_t step, int64_t folded) {
  return {detail::adamw_coefficients(n, lr, beta1, beta2, eps, weight_decay, step), step, folded};
}

void count_skipped_step(const int32_t* skip, int64_t* counts, bool advances_state,
                        cudaStream_t stream) {
  CUDP_CHECK(skip != nullptr && counts != nullptr, "count_skipped_step: a pointer is null");
  launch("count_skipped_step_kernel", count_skipped_step_kernel, 1, 1, 0, stream, skip, counts,
         advances_state);
}

void nonfinite_flag(const float* a, const float* b, int32_t* flag, cudaStream_t stream) {
  CUDP_CHECK(a != nullptr && flag != nullptr, "nonfinite_flag: a pointer is null");
  launch("nonfinite_flag_kernel", nonfinite_flag_kernel, 1, 1, 0, stream, a, b, flag);
}

void sum_of_squares(const float* x, int64_t n, float* out, cudaStream_t stream) {
  reduce_squares<false>("sum_of_squares", x, n, out, stream);
}

void global_norm(const float* x, int64_t n, float* norm, cudaStream_t stream) {
  reduce_squares<true>("global_norm", x, n, norm, stream);
}

void scale_by_clip_coefficient(float* grad, int64_t n, const float* norm, float max_norm,
                               cudaStream_t stream) {
  CUDP_CHECK(n >= 0, "clip_grad_norm: n must be >= 0, got ", n);
  if (n == 0) return;
  if (aligned16(grad)) {
    launch("clip_scale_kernel", clip_scale_kernel<true>, elementwise_blocks(n), kThreads, 0, stream,
           grad, n, norm, max_norm);
  } else {
    launch("clip_scale_kernel", clip_scale_kernel<false>, elementwise_blocks(n), kThreads, 0,
           stream, grad, n, norm, max_norm);
  }
}

void clip_grad_norm(float* grad, int64_t n, float max_norm, float* norm, cudaStream_t stream) {
  global_norm(grad, n, norm, stream);
  scale_by_clip_coefficient(grad, n, norm, max_norm, stream);
}

}  // namespace cudp::kernels
