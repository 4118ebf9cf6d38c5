// Batch normalisation kernels (semantics and the reasons for this structure: kernels/batchnorm.h).
//
// A [rows, c] matrix is spread over a 2-D grid: blockDim.x lanes over channel vectors (V channels
// per lane: 16 bytes, 4 floats or 8 bf16, when c % V == 0 and the pointers are 16-byte aligned,
// else 1), blockDim.y threads over rows; gridDim.x channel groups of at most 32 lanes, gridDim.y
// row blocks, as many as fit on the GPU at once (one wave), every thread striding over rows. A lane
// keeps its channels' parameters in registers for the whole walk. When one group covers all
// channels (c <= 128 floats or 256 bf16), a warp's accesses are one contiguous run of memory even
// if the lanes do not fill it. bf16 is converted to fp32 on load and rounded to nearest even on
// store; every sum and coefficient is fp32.
//
// Reductions are deterministic: per thread in row order, then across blockDim.y in a fixed tree in
// shared memory, then (finalize kernel) across row blocks in a fixed order. The grid depends on the
// GPU's SM count and occupancy, so results are bitwise reproducible on one GPU model, not across.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <optional>

#include "engine/core/launch.cuh"
#include "kernels/batchnorm.h"
#include "kernels/bias.h"
#include "kernels/elementwise.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;  // threads per block of the row-walking kernels
// Rows in flight per thread: 4 on the 16-byte float path; 2 for 8 bf16 per lane, whose 32
// per-channel coefficients would otherwise cost the dx kernel ~150 registers and most of its
// occupancy.
template <int V>
constexpr int kUnroll = V >= 8 ? 2 : 4;
// The finalize kernels: 8 channels a block (x), 128 partials walked in parallel per channel (y).
// The finalize is a chain of latencies on the step's critical path (nothing else can run while it
// merges), so its depth matters more than its width: a thread walks ~parts / 128 partials (~8 at
// one wave of 1056 blocks) and the rows are then merged in a 7-level tree. With 32 x 32 blocks a
// thread walked ~33, and the two finalize kernels took 9 and 7.6 us a layer at 32x32 images (ncu,
// VGG-16-BN), as long as the data passes.
constexpr int kFinalLanes = 8;
constexpr int kFinalRows = 128;
// Partials a finalize thread loads before merging them, in order: one dependent global load per
// merge would make the finalize a chain of memory latencies (~20 us at 33 partials a thread). The
// merge order is the same as one at a time.
constexpr int kFinalPrefetch = 8;

// Channels per lane on the vector path: 16 bytes.
template <typename T>
constexpr int kVector = 16 / int(sizeof(T));

// V consecutive channels of one row as stored; one load or store instruction.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

__device__ __forceinline__ float to_f32(float v) {
  return v;
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return v;
  }
}

// The gradient reaching the normalisation: dy, masked by the fused ReLU's output when there is
// one (ReLU's own rule, so that fused and unfused gradients agree bit for bit).
template <typename T>
__device__ __forceinline__ float masked_grad(T dy, const T* mask_row, int k) {
  return mask_row ? detail::relu_grad(to_f32(mask_row[k]), to_f32(dy)) : to_f32(dy);
}

// Rows r0, r0 + step, ... below `rows`.
__device__ __forceinline__ int64_t rows_walked(int64_t r0, int64_t step, int64_t rows) {
  return r0 < rows ? (rows - 1 - r0) / step + 1 : 0;
}

// Chan, Golub and LeVeque's merge of two (count, mean, M2) summaries into the first.
__device__ __forceinline__ void chan_merge(float& n, float& mean, float& m2, float n_b,
                                           float mean_b, float m2_b) {
  if (n_b == 0.f) return;
  const float total = n + n_b;
  const float delta = mean_b - mean;
  const float frac = n_b / total;
  mean = fmaf(delta, frac, mean);
  m2 = m2 + m2_b + delta * delta * n * frac;
  n = total;
}

// Smallest power of two >= v (v >= 1).
__device__ __forceinline__ int pow2_ceil(int v) {
  return v <= 1 ? 1 : 1 << (32 - __clz(v - 1));
}

// Where a thread keeps value k of its V channels in a block's array of blockDim.y rows of
// blockDim.x * V values (the per-thread sums and summaries the trees below merge over rows):
// planes of one k, [k][row][lane], so that for each k a warp's threads (consecutive in
// row * blockDim.x + lane) touch 32 consecutive floats, one per bank. Laid out [row][lane][k], a
// lane's V values were V floats apart and every access of the trees a V-way bank conflict: ~7 us
// of a 4 MB layer's 16 us statistics pass (ncu, VGG-16-BN at 32x32). Row 0 of channel k of lane
// `lane` is at k * blockDim.y * blockDim.x + lane.
__device__ __forceinline__ int at(int row, int k, int lane) {
  return (k * int(blockDim.y) + row) * int(blockDim.x) + lane;
}

// ---- the walks the kernels share ----------------------------------------------------------------
//
// A thread walks rows r0, r0 + step, ... below `rows` of the V channels from `channel`, kUnroll<V>
// rows in flight. The multi-pass kernels and the one-launch cluster kernels (below) walk with the
// same functions, so a thread computes the same values on either path; the paths differ only in
// how the threads' results are combined.
//
// Forward statistics: everything is relative to a per-channel shift K = x[row 0, channel] (a
// sample of the data, so |mean - K| is a few standard deviations at most): each thread sums d = x -
// K and d^2, turns them into (count, mean of d, M2) where sum d^2 - (sum d)^2 / n loses nothing to
// cancellation, and those are merged with Chan's formula. The merged mean of d stays small, so its
// rounding errors are relative to the spread of the data and not to |mean|: a channel with mean
// 1000 and spread 1 is normalised as accurately as one with mean 0. K is added back only for the
// saved mean.

// One thread's summary of its rows into its slots of the block's arrays: s_n [blockDim.y][lanes],
// s_mean and s_m2 of blockDim.y * lanes * V floats laid out by at() (count, mean of x - K, M2 per
// channel).
template <typename T, int V>
__device__ __forceinline__ void thread_stats(const T* __restrict__ x, int64_t r0, int64_t step,
                                             int64_t rows, int c, int channel, bool active,
                                             float* s_n, float* s_mean, float* s_m2) {
  const int lanes = blockDim.x, tx = threadIdx.x, ty = threadIdx.y;
  const int64_t count = rows_walked(r0, step, rows);
  float shift[V], s1[V], s2[V];
#pragma unroll
  for (int k = 0; k < V; ++k) shift[k] = s1[k] = s2[k] = 0.f;
  if (active && count > 0) {
    const T* col = x + channel;
    const Pack<T, V> first = load<T, V>(col);  // row 0
#pragma unroll
    for (int k = 0; k < V; ++k) shift[k] = to_f32(first.v[k]);
    int64_t r = r0;
    for (; r + (kUnroll<V> - 1) * step < rows; r += kUnroll<V> * step) {
      Pack<T, V> v[kUnroll<V>];
#pragma unroll
      for (int u = 0; u < kUnroll<V>; ++u) v[u] = load<T, V>(col + (r + u * step) * c);
#pragma unroll
      for (int u = 0; u < kUnroll<V>; ++u) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = to_f32(v[u].v[k]) - shift[k];
          s1[k] += d;
          s2[k] = fmaf(d, d, s2[k]);
        }
      }
    }
    for (; r < rows; r += step) {
      const Pack<T, V> v = load<T, V>(col + r * c);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = to_f32(v.v[k]) - shift[k];
        s1[k] += d;
        s2[k] = fmaf(d, d, s2[k]);
      }
    }
  }
  const float n = float(count);
  s_n[ty * lanes + tx] = n;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s_mean[at(ty, k, tx)] = n > 0 ? s1[k] / n : 0.f;
    s_m2[at(ty, k, tx)] = n > 0 ? fmaxf(s2[k] - s1[k] * (s1[k] / n), 0.f) : 0.f;
  }
}

// Merges the block's summaries over blockDim.y in a fixed tree; row 0 ends with the block's.
template <int V>
__device__ __forceinline__ void stats_tree(float* s_n, float* s_mean, float* s_m2) {
  const int lanes = blockDim.x, tx = threadIdx.x, ty = threadIdx.y;
  __syncthreads();
  for (int half = pow2_ceil(blockDim.y) / 2; half > 0; half /= 2) {
    if (ty < half && ty + half < int(blockDim.y)) {
      const int a = ty * lanes + tx, b = (ty + half) * lanes + tx;
      const float n_a = s_n[a], n_b = s_n[b];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float na = n_a;
        const int ia = at(ty, k, tx), ib = at(ty + half, k, tx);
        chan_merge(na, s_mean[ia], s_m2[ia], n_b, s_mean[ib], s_m2[ib]);
      }
      s_n[a] = n_a + n_b;
    }
    __syncthreads();
  }
}

// Adds Arrays arrays of blockDim.y * lanes * V floats laid out by at() (the i-th at s + i * stride)
// over blockDim.y in a fixed tree; row 0 ends with the block's sums.
template <int V, int Arrays>
__device__ __forceinline__ void sum_tree(float* s, int stride) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  __syncthreads();
  for (int half = pow2_ceil(blockDim.y) / 2; half > 0; half /= 2) {
    if (ty < half && ty + half < int(blockDim.y)) {
#pragma unroll
      for (int i = 0; i < Arrays; ++i) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          s[i * stride + at(ty, k, tx)] += s[i * stride + at(ty + half, k, tx)];
        }
      }
    }
    __syncthreads();
  }
}

// y = act(((x - center) - offset) * scale + shift) over the thread's rows.
template <typename T, int V>
__device__ __forceinline__ void apply_walk(const T* __restrict__ x, T* __restrict__ y, int64_t r0,
                                           int64_t step, int64_t rows, int c, int channel,
                                           const float (&center)[V], const float (&offset)[V],
                                           const float (&scale)[V], const float (&shift)[V],
                                           bool relu) {
  auto apply = [&](const Pack<T, V>& in) {
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float v = fmaf((to_f32(in.v[k]) - center[k]) - offset[k], scale[k], shift[k]);
      if (relu) v = detail::relu(v);
      out.v[k] = from_f32<T>(v);
    }
    return out;
  };
  int64_t r = r0;
  for (; r + (kUnroll<V> - 1) * step < rows; r += kUnroll<V> * step) {
    Pack<T, V> v[kUnroll<V>];
#pragma unroll
    for (int u = 0; u < kUnroll<V>; ++u) v[u] = load<T, V>(x + (r + u * step) * c + channel);
#pragma unroll
    for (int u = 0; u < kUnroll<V>; ++u) {
      *reinterpret_cast<Pack<T, V>*>(y + (r + u * step) * c + channel) = apply(v[u]);
    }
  }
  for (; r < rows; r += step) {
    *reinterpret_cast<Pack<T, V>*>(y + r * c + channel) = apply(load<T, V>(x + r * c + channel));
  }
}

// The thread's sums of g and g * (x - mean) over its rows, g = dy masked by the fused ReLU's
// output (mask, nullable), added to a and b.
template <typename T, int V>
__device__ __forceinline__ void grad_sums_walk(const T* __restrict__ x, const T* __restrict__ dy,
                                               const T* __restrict__ mask, const float (&mean)[V],
                                               int64_t r0, int64_t step, int64_t rows, int c,
                                               int channel, float (&a)[V], float (&b)[V]) {
  auto accumulate = [&](const Pack<T, V>& xv, const Pack<T, V>& gv, const T* mask_row) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = masked_grad(gv.v[k], mask_row, k);
      a[k] += g;
      b[k] = fmaf(g, to_f32(xv.v[k]) - mean[k], b[k]);
    }
  };
  int64_t r = r0;
  for (; r + (kUnroll<V> - 1) * step < rows; r += kUnroll<V> * step) {
    Pack<T, V> xv[kUnroll<V>], gv[kUnroll<V>], mv[kUnroll<V>];
#pragma unroll
    for (int u = 0; u < kUnroll<V>; ++u) {
      const int64_t at = (r + u * step) * c + channel;
      xv[u] = load<T, V>(x + at);
      gv[u] = load<T, V>(dy + at);
      if (mask) mv[u] = load<T, V>(mask + at);
    }
#pragma unroll
    for (int u = 0; u < kUnroll<V>; ++u) accumulate(xv[u], gv[u], mask ? mv[u].v : nullptr);
  }
  for (; r < rows; r += step) {
    const int64_t at = r * c + channel;
    Pack<T, V> mv;
    if (mask) mv = load<T, V>(mask + at);
    accumulate(load<T, V>(x + at), load<T, V>(dy + at), mask ? mv.v : nullptr);
  }
}

// dx = k * (g - a - (x - mean) * b) over the thread's rows; with frozen statistics (b == 0) x is
// not read. With Sums, adds the stored dx (bf16: the rounded values) to sum, in row order.
template <typename T, int V, bool Frozen, bool Sums>
__device__ __forceinline__ void dx_walk(const T* __restrict__ x, const T* __restrict__ dy,
                                        const T* __restrict__ mask, const float (&mean)[V],
                                        const float (&k_)[V], const float (&a)[V],
                                        const float (&b)[V], T* __restrict__ dx, int64_t r0,
                                        int64_t step, int64_t rows, int c, int channel,
                                        float (&sum)[V]) {
  auto grad = [&](const Pack<T, V>& xv, const Pack<T, V>& gv, const T* mask_row) {
    Pack<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float g = masked_grad(gv.v[k], mask_row, k);
      if constexpr (Frozen) {
        out.v[k] = from_f32<T>(k_[k] * g);
      } else {
        out.v[k] = from_f32<T>(k_[k] * fmaf(mean[k] - to_f32(xv.v[k]), b[k], g - a[k]));
      }
      if constexpr (Sums) sum[k] += to_f32(out.v[k]);
    }
    return out;
  };
  int64_t r = r0;
  for (; r + (kUnroll<V> - 1) * step < rows; r += kUnroll<V> * step) {
    Pack<T, V> xv[kUnroll<V>], gv[kUnroll<V>], mv[kUnroll<V>];
#pragma unroll
    for (int u = 0; u < kUnroll<V>; ++u) {
      const int64_t at = (r + u * step) * c + channel;
      if constexpr (!Frozen) xv[u] = load<T, V>(x + at);
      gv[u] = load<T, V>(dy + at);
      if (mask) mv[u] = load<T, V>(mask + at);
    }
#pragma unroll
    for (int u = 0; u < kUnroll<V>; ++u) {
      *reinterpret_cast<Pack<T, V>*>(dx + (r + u * step) * c + channel) =
          grad(xv[u], gv[u], mask ? mv[u].v : nullptr);
    }
  }
  for (; r < rows; r += step) {
    const int64_t at = r * c + channel;
    Pack<T, V> xv, mv;
    if constexpr (!Frozen) xv = load<T, V>(x + at);
    if (mask) mv = load<T, V>(mask + at);
    *reinterpret_cast<Pack<T, V>*>(dx + at) = grad(xv, load<T, V>(dy + at), mask ? mv.v : nullptr);
  }
}

// ---- a channel's outputs from its merged sums (the finalize, merge and cluster kernels)
// -----------

// The forward's, from the channel's statistics (K, the mean of x - K and M2 over n rows; n_minus_1
// = n - 1 as the caller counts): the saved and running statistics, each where given, and the
// coefficients of y = ((x - K) - mean_d) * scale + shift at coef[0], coef[stride], coef[2 stride],
// coef[3 stride].
__device__ __forceinline__ void finish_statistics(int ch, float shift_k, float mean_d, float m2,
                                                  float n, float n_minus_1, const float* gamma,
                                                  const float* beta, float* running_mean,
                                                  float* running_var, float* save_mean,
                                                  float* save_invstd, float momentum, float eps,
                                                  float* coef, int stride) {
  const float mean = shift_k + mean_d;
  const float var = m2 / n;
  const float invstd = 1.f / sqrtf(var + eps);
  if (save_mean) save_mean[ch] = mean;
  if (save_invstd) save_invstd[ch] = invstd;
  if (running_mean) running_mean[ch] = (1.f - momentum) * running_mean[ch] + momentum * mean;
  if (running_var) {
    const float unbiased = m2 / n_minus_1;
    running_var[ch] = (1.f - momentum) * running_var[ch] + momentum * unbiased;
  }
  coef[0] = shift_k;
  coef[stride] = mean_d;
  coef[2 * stride] = gamma ? gamma[ch] * invstd : invstd;
  coef[3 * stride] = beta ? beta[ch] : 0.f;
}

// The backward's, from the channel's sums of g and g * (x - mean) over m rows: dgamma and dbeta,
// each where given (= or, with beta_accumulate != 0, beta_accumulate * old +), and, where coef is
// given, the coefficients of dx = k * (g - a - (x - mean) * b) at coef[0], coef[stride],
// coef[2 stride]; frozen statistics have a = b = 0.
__device__ __forceinline__ void finish_gradients(int ch, float sum_dy, float sum_dy_xmu,
                                                 float invstd, float m, bool frozen,
                                                 const float* gamma, float* dgamma, float* dbeta,
                                                 float beta_accumulate, float* coef, int stride) {
  const float grad_gamma = sum_dy_xmu * invstd, grad_beta = sum_dy;
  if (dgamma) {
    dgamma[ch] = beta_accumulate == 0.f ? grad_gamma : beta_accumulate * dgamma[ch] + grad_gamma;
  }
  if (dbeta) {
    dbeta[ch] = beta_accumulate == 0.f ? grad_beta : beta_accumulate * dbeta[ch] + grad_beta;
  }
  if (coef == nullptr) return;
  coef[0] = gamma ? gamma[ch] * invstd : invstd;
  coef[stride] = frozen ? 0.f : sum_dy / m;
  coef[2 * stride] = frozen ? 0.f : grad_gamma * invstd / m;
}

// ---- the multi-pass kernels ---------------------------------------------------------------------

// Partials per (row block, channel): count, mean of x - K, M2 of the rows that block walked.
template <typename T, int V>
__global__ void bn_stats_kernel(const T* __restrict__ x, int64_t rows, int c,
                                float* __restrict__ part_n, float* __restrict__ part_mean,
                                float* __restrict__ part_m2) {
  kernel_entry();
  extern __shared__ float smem[];
  const int lanes = blockDim.x, width = lanes * V, tx = threadIdx.x, ty = threadIdx.y;
  float* s_n = smem;                          // [blockDim.y][lanes]
  float* s_mean = s_n + blockDim.y * lanes;   // blockDim.y x width, laid out by at()
  float* s_m2 = s_mean + blockDim.y * width;  // blockDim.y x width, laid out by at()
  const int channel = (blockIdx.x * lanes + tx) * V;
  const bool active = channel < c;
  const int64_t step = int64_t(blockDim.y) * gridDim.y;
  thread_stats<T, V>(x, int64_t(blockIdx.y) * blockDim.y + ty, step, rows, c, channel, active, s_n,
                     s_mean, s_m2);
  stats_tree<V>(s_n, s_mean, s_m2);
  if (ty == 0 && active) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      part_mean[int64_t(blockIdx.y) * c + channel + k] = s_mean[at(0, k, tx)];
      part_m2[int64_t(blockIdx.y) * c + channel + k] = s_m2[at(0, k, tx)];
    }
    if (blockIdx.x == 0 && tx == 0) part_n[blockIdx.y] = s_n[0];
  }
}

// Per channel: merges the partials in a fixed order, writes the saved and running statistics, and
// the coefficients of y = ((x - K) - mean_d) * scale + shift into coef = [K | mean_d | scale |
// shift]; batches_tracked (or null) += 1, once.
template <typename T>
__global__ void __launch_bounds__(kFinalLanes* kFinalRows)
    bn_stats_finalize_kernel(const T* __restrict__ x, const float* __restrict__ part_n,
                             const float* __restrict__ part_mean, const float* __restrict__ part_m2,
                             int parts, int64_t rows, int c, const float* __restrict__ gamma,
                             const float* __restrict__ beta, float* __restrict__ running_mean,
                             float* __restrict__ running_var, float* __restrict__ save_mean,
                             float* __restrict__ save_invstd, float momentum, float eps,
                             float* __restrict__ coef, float* __restrict__ summary_out,
                             int64_t* __restrict__ batches_tracked) {
  kernel_entry();
  __shared__ float s_n[kFinalRows][kFinalLanes], s_mean[kFinalRows][kFinalLanes],
      s_m2[kFinalRows][kFinalLanes];
  const int tx = threadIdx.x, ty = threadIdx.y;
  // The layer's num_batches_tracked, counted here rather than by a launch of its own.
  if (batches_tracked != nullptr && blockIdx.x == 0 && tx == 0 && ty == 0) *batches_tracked += 1;
  const int ch = blockIdx.x * kFinalLanes + tx;
  float n = 0.f, mean_d = 0.f, m2 = 0.f;
  if (ch < c) {
    for (int p0 = ty; p0 < parts; p0 += kFinalPrefetch * kFinalRows) {
      float pn[kFinalPrefetch], pm[kFinalPrefetch], pq[kFinalPrefetch];
#pragma unroll
      for (int u = 0; u < kFinalPrefetch; ++u) {
        const int p = p0 + u * kFinalRows;
        pn[u] = pm[u] = pq[u] = 0.f;  // a count of 0 merges nothing
        if (p < parts) {
          pn[u] = part_n[p];
          pm[u] = part_mean[int64_t(p) * c + ch];
          pq[u] = part_m2[int64_t(p) * c + ch];
        }
      }
#pragma unroll
      for (int u = 0; u < kFinalPrefetch; ++u) chan_merge(n, mean_d, m2, pn[u], pm[u], pq[u]);
    }
  }
  s_n[ty][tx] = n, s_mean[ty][tx] = mean_d, s_m2[ty][tx] = m2;
  __syncthreads();
  for (int half = kFinalRows / 2; half > 0; half /= 2) {
    if (ty < half) {
      chan_merge(s_n[ty][tx], s_mean[ty][tx], s_m2[ty][tx], s_n[ty + half][tx],
                 s_mean[ty + half][tx], s_m2[ty + half][tx]);
    }
    __syncthreads();
  }
  if (ty != 0 || ch >= c) return;
  const float shift_k = to_f32(x[ch]);  // K: row 0
  mean_d = s_mean[0][tx];
  m2 = s_m2[0][tx];
  if (summary_out) {  // the split forward: this participant's summary, nothing else
    if (ch == 0) summary_out[0] = s_n[0][tx];
    summary_out[1 + ch] = shift_k;
    summary_out[1 + c + ch] = mean_d;
    summary_out[1 + 2 * c + ch] = m2;
    return;
  }
  finish_statistics(ch, shift_k, mean_d, m2, float(rows), float(rows - 1), gamma, beta,
                    running_mean, running_var, save_mean, save_invstd, momentum, eps, coef + ch, c);
}

// ---- the forward's element-wise pass ------------------------------------------------------------
//
// y = act(((x - center) - offset) * scale + shift): training passes the finalize kernel's
// coefficients (center K, offset mean_d); evaluation passes the running statistics, and the
// kernel computes the scale per channel once (FromRunning).
struct ApplyParams {
  const float* center;  // training: K; evaluation: running_mean
  const float* offset;  // training: mean_d; evaluation: nullptr (0)
  const float* scale;   // training: gamma * invstd; evaluation: running_var (scale computed here)
  const float* gamma;   // evaluation only, nullable
  const float* shift;   // training: beta or 0; evaluation: beta, nullable
  float eps;            // evaluation only
  bool relu;            // the fused ReLU
};

template <typename T, int V, bool FromRunning>
__global__ void bn_apply_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int c,
                                ApplyParams p) {
  kernel_entry();
  const int channel = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (channel >= c) return;
  float center[V], offset[V], scale[V], shift[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    center[k] = p.center[channel + k];
    offset[k] = p.offset ? p.offset[channel + k] : 0.f;
    if constexpr (FromRunning) {
      const float invstd = 1.f / sqrtf(p.scale[channel + k] + p.eps);
      scale[k] = p.gamma ? p.gamma[channel + k] * invstd : invstd;
      shift[k] = p.shift ? p.shift[channel + k] : 0.f;
    } else {
      scale[k] = p.scale[channel + k];
      shift[k] = p.shift[channel + k];
    }
  }
  apply_walk<T, V>(x, y, int64_t(blockIdx.y) * blockDim.y + threadIdx.y,
                   int64_t(blockDim.y) * gridDim.y, rows, c, channel, center, offset, scale, shift,
                   p.relu);
}

// ---- backward -----------------------------------------------------------------------------------

// Partials per (row block, channel) of sum g and sum g * (x - mean), g = dy masked by the fused
// ReLU's output (mask, nullable).
template <typename T, int V>
__global__ void bn_backward_reduce_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                          const T* __restrict__ mask,
                                          const float* __restrict__ mean_in, int64_t rows, int c,
                                          float* __restrict__ part_dy,
                                          float* __restrict__ part_dy_xmu) {
  kernel_entry();
  extern __shared__ float smem[];
  const int lanes = blockDim.x, width = lanes * V, tx = threadIdx.x, ty = threadIdx.y;
  const int stride = blockDim.y * width;
  float* s_dy = smem;               // blockDim.y x width, laid out by at()
  float* s_dy_xmu = s_dy + stride;  // blockDim.y x width, laid out by at()
  const int channel = (blockIdx.x * lanes + tx) * V;
  const bool active = channel < c;
  float mean[V], a[V], b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) a[k] = b[k] = 0.f, mean[k] = active ? mean_in[channel + k] : 0.f;
  if (active) {
    grad_sums_walk<T, V>(x, dy, mask, mean, int64_t(blockIdx.y) * blockDim.y + ty,
                         int64_t(blockDim.y) * gridDim.y, rows, c, channel, a, b);
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s_dy[at(ty, k, tx)] = a[k];
    s_dy_xmu[at(ty, k, tx)] = b[k];
  }
  sum_tree<V, 2>(smem, stride);
  if (ty == 0 && active) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      part_dy[int64_t(blockIdx.y) * c + channel + k] = s_dy[at(0, k, tx)];
      part_dy_xmu[int64_t(blockIdx.y) * c + channel + k] = s_dy_xmu[at(0, k, tx)];
    }
  }
}

// Per channel: sums the partials in a fixed order, writes dgamma/dbeta and the coefficients of
// dx = k * (g - a - (x - mean) * b) into coef = [k | a | b]. invstd is the saved one, or, with
// frozen statistics (running_var != nullptr), 1 / sqrt(running_var + eps) as the evaluation
// forward computes it, and a = b = 0 (dx = k * g).
__global__ void __launch_bounds__(kFinalLanes* kFinalRows) bn_backward_finalize_kernel(
    const float* __restrict__ part_dy, const float* __restrict__ part_dy_xmu, int parts,
    int64_t rows, int c, const float* __restrict__ gamma, const float* __restrict__ save_invstd,
    const float* __restrict__ running_var, float eps, float* __restrict__ dgamma,
    float* __restrict__ dbeta, float beta_accumulate, float* __restrict__ coef,
    float* __restrict__ sums_out) {
  kernel_entry();
  __shared__ float s_dy[kFinalRows][kFinalLanes], s_dy_xmu[kFinalRows][kFinalLanes];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int ch = blockIdx.x * kFinalLanes + tx;
  float sum_dy = 0.f, sum_dy_xmu = 0.f;
  if (ch < c) {
    for (int p0 = ty; p0 < parts; p0 += kFinalPrefetch * kFinalRows) {
      float a[kFinalPrefetch], b[kFinalPrefetch];
#pragma unroll
      for (int u = 0; u < kFinalPrefetch; ++u) {
        const int p = p0 + u * kFinalRows;
        a[u] = p < parts ? part_dy[int64_t(p) * c + ch] : 0.f;
        b[u] = p < parts ? part_dy_xmu[int64_t(p) * c + ch] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kFinalPrefetch; ++u) {
        if (p0 + u * kFinalRows < parts) sum_dy += a[u], sum_dy_xmu += b[u];  // no -0 + 0
      }
    }
  }
  s_dy[ty][tx] = sum_dy, s_dy_xmu[ty][tx] = sum_dy_xmu;
  __syncthreads();
  for (int half = kFinalRows / 2; half > 0; half /= 2) {
    if (ty < half) {
      s_dy[ty][tx] += s_dy[ty + half][tx];
      s_dy_xmu[ty][tx] += s_dy_xmu[ty + half][tx];
    }
    __syncthreads();
  }
  if (ty != 0 || ch >= c) return;
  sum_dy = s_dy[0][tx];
  sum_dy_xmu = s_dy_xmu[0][tx];
  const bool frozen = running_var != nullptr;
  const float invstd = frozen ? 1.f / sqrtf(running_var[ch] + eps) : save_invstd[ch];
  // The split backward (sums_out) writes this participant's sums instead of coefficients; its dx
  // pass comes later.
  finish_gradients(ch, sum_dy, sum_dy_xmu, invstd, float(rows), frozen, gamma, dgamma, dbeta,
                   beta_accumulate, sums_out ? nullptr : coef + ch, c);
  if (sums_out) {
    sums_out[ch] = sum_dy;
    sums_out[c + ch] = sum_dy_xmu;
    if (ch == 0) sums_out[2 * c] = float(rows);
  }
}

// dx = k * (g - a - (x - mean) * b); with frozen statistics (b == 0) x is not read. With Sums, also
// the column sums of dx as stored (bf16: the rounded values), the bias gradient of the layer before
// (kernels/batchnorm.h, input_grad_sums): each thread adds its rows in order, the block's threads
// are added in a fixed tree over blockDim.y in shared memory, and the block writes one partial row
// (part_dx[blockIdx.y][c]) for bias_grad_from_partials to add up in row-block order.
template <typename T, int V, bool Frozen, bool Sums>
__global__ void bn_backward_dx_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                      const T* __restrict__ mask, const float* __restrict__ mean_in,
                                      const float* __restrict__ coef, T* __restrict__ dx,
                                      int64_t rows, int c, float* __restrict__ part_dx) {
  kernel_entry();
  const int channel = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  const bool active = channel < c;
  if (!Sums && !active) return;
  float mean[V], k_[V], a[V], b[V], sum[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    mean[k] = active ? mean_in[channel + k] : 0.f;
    k_[k] = active ? coef[channel + k] : 0.f;
    a[k] = active ? coef[c + channel + k] : 0.f;
    b[k] = active ? coef[2 * c + channel + k] : 0.f;
    sum[k] = 0.f;
  }
  if (active) {
    dx_walk<T, V, Frozen, Sums>(x, dy, mask, mean, k_, a, b, dx,
                                int64_t(blockIdx.y) * blockDim.y + threadIdx.y,
                                int64_t(blockDim.y) * gridDim.y, rows, c, channel, sum);
  }
  if constexpr (Sums) {
    extern __shared__ float s_sum[];  // blockDim.y x blockDim.x * V, laid out by at()
    const int tx = threadIdx.x, ty = threadIdx.y;
#pragma unroll
    for (int k = 0; k < V; ++k) s_sum[at(ty, k, tx)] = sum[k];
    sum_tree<V, 1>(s_sum, 0);
    if (ty == 0 && active) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        part_dx[int64_t(blockIdx.y) * c + channel + k] = s_sum[at(0, k, tx)];
      }
    }
  }
}

// ---- one launch per call: a thread-block cluster per channel group ------------------------------
//
// Where a layer is small (kernels/batchnorm.h: at most kBatchnormClusterElements values), its cost
// is the multi-pass kernels' launches and the finalize's serial latency, not its bytes. There one
// launch does a whole forward or backward: a cluster of kClusterBlocks blocks covers every row of
// `lanes` channel vectors (block rank q walks rows q * blockDim.y + ty, stepping by the cluster's
// threads), each block reduces its threads in the fixed tree of the multi-pass kernels, and the
// blocks read each other's results from distributed shared memory, merging them in rank order
// (every block the same merge, so every block holds the same coefficients). The element-wise pass
// follows in the same launch. No workspace, no finalize launch, no float atomics; the grid
// depends on the shape alone (cluster_plan), so the bits are the same on every GPU with clusters.
constexpr int kClusterBlocks = 8;     // blocks per cluster, along the rows: the portable maximum
constexpr int kClusterThreads = 512;  // threads per block

// The cluster kernels are sm_90's. The older targets of a multi-architecture build (e.g.
// CMAKE_CUDA_ARCHITECTURES "80;90") compile them empty, and the host never launches them there:
// such a GPU has no cluster launch (detail::batchnorm_one_launch).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define CUDP_BN_CLUSTERS 0
#define CUDP_BN_CLUSTER_DIMS
#else
#define CUDP_BN_CLUSTERS 1
#define CUDP_BN_CLUSTER_DIMS __cluster_dims__(1, kClusterBlocks, 1)
#endif

// barrier.cluster in two halves: arrive (release: this block's earlier shared-memory reads and
// writes are ordered before it) and wait (acquire). Every thread of every block of the cluster
// executes both, in this order, as often as the others. .aligned asks every thread of a warp to
// execute the instruction together; the walks before some of them leave a warp's threads after
// different trip counts (rows differ by ty), so each first reconverges the warp.
#if CUDP_BN_CLUSTERS
__device__ __forceinline__ void cluster_arrive() {
  __syncwarp();
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  __syncwarp();
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// What a thread of a cluster kernel walks: the V channels from `channel` (active: below c), rows
// r0, r0 + step, ... (block rank q takes rows q * blockDim.y + ty of every stride of the cluster's
// threads).
struct ClusterWalk {
  int channel;
  bool active;
  unsigned rank;
  int64_t r0, step;
};

template <int V>
__device__ __forceinline__ ClusterWalk cluster_walk(const cg::cluster_group& cluster, int c) {
  ClusterWalk w;
  w.channel = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  w.active = w.channel < c;
  w.rank = cluster.block_rank();
  w.step = int64_t(blockDim.y) * kClusterBlocks;
  w.r0 = int64_t(w.rank) * blockDim.y + threadIdx.y;
  return w;
}
#endif

// The training forward in one launch: statistics, the saved and running statistics (rank 0 of
// each cluster writes its channels'), batches_tracked += 1 (once), and y.
template <typename T, int V>
__global__ void CUDP_BN_CLUSTER_DIMS __launch_bounds__(kClusterThreads)
    bn_forward_cluster_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int c,
                              const float* __restrict__ gamma, const float* __restrict__ beta,
                              float* __restrict__ running_mean, float* __restrict__ running_var,
                              float* __restrict__ save_mean, float* __restrict__ save_invstd,
                              float momentum, float eps, bool relu,
                              int64_t* __restrict__ batches_tracked) {
  kernel_entry();
#if CUDP_BN_CLUSTERS
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ float smem[];
  const int lanes = blockDim.x, width = lanes * V, tx = threadIdx.x, ty = threadIdx.y;
  float* s_n = smem;                          // [blockDim.y][lanes]
  float* s_mean = s_n + blockDim.y * lanes;   // blockDim.y x width, laid out by at()
  float* s_m2 = s_mean + blockDim.y * width;  // blockDim.y x width, laid out by at()
  float* s_coef = s_m2 + blockDim.y * width;  // [4][V][lanes]: K, mean_d, scale, shift
  const ClusterWalk w = cluster_walk<V>(cluster, c);
  // K, row 0, read before any block of the cluster may have written y (which may be x), and kept
  // in the K slots of s_coef, which the same threads fill after the merge.
  if (ty == 0 && w.active) {
    const Pack<T, V> first = load<T, V>(x + w.channel);
#pragma unroll
    for (int k = 0; k < V; ++k) s_coef[k * lanes + tx] = to_f32(first.v[k]);
  }
  thread_stats<T, V>(x, w.r0, w.step, rows, c, w.channel, w.active, s_n, s_mean, s_m2);
  stats_tree<V>(s_n, s_mean, s_m2);
  cluster_sync();  // every block's summary is in row 0 of its arrays
  if (ty == 0 && w.active) {
    float n[V], mean_d[V], m2[V];
#pragma unroll
    for (int k = 0; k < V; ++k) n[k] = mean_d[k] = m2[k] = 0.f;
    for (unsigned q = 0; q < kClusterBlocks; ++q) {
      const float n_q = cluster.map_shared_rank(s_n, q)[tx];
      const float* mean_q = cluster.map_shared_rank(s_mean, q);
      const float* m2_q = cluster.map_shared_rank(s_m2, q);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        chan_merge(n[k], mean_d[k], m2[k], n_q, mean_q[at(0, k, tx)], m2_q[at(0, k, tx)]);
      }
    }
    const bool writer = w.rank == 0;  // writes the statistics; every block its coefficients
    const float count = float(rows), count_minus_1 = float(rows - 1);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      finish_statistics(w.channel + k, s_coef[k * lanes + tx], mean_d[k], m2[k], count,
                        count_minus_1, gamma, beta, writer ? running_mean : nullptr,
                        writer ? running_var : nullptr, writer ? save_mean : nullptr,
                        writer ? save_invstd : nullptr, momentum, eps, s_coef + k * lanes + tx,
                        width);
    }
  }
  if (batches_tracked != nullptr && w.rank == 0 && blockIdx.x == 0 && tx == 0 && ty == 0) {
    *batches_tracked += 1;
  }
  __syncthreads();
  cluster_arrive();  // this block is done reading its peers' summaries
  if (w.active) {
    float center[V], offset[V], scale[V], shift[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      center[k] = s_coef[k * lanes + tx];
      offset[k] = s_coef[width + k * lanes + tx];
      scale[k] = s_coef[2 * width + k * lanes + tx];
      shift[k] = s_coef[3 * width + k * lanes + tx];
    }
    apply_walk<T, V>(x, y, w.r0, w.step, rows, c, w.channel, center, offset, scale, shift, relu);
  }
  cluster_wait();  // and its peers with its own: its shared memory may go
#endif
}

// The training backward in one launch: dgamma and dbeta (rank 0 of each cluster writes its
// channels'), dx, and with Sums the column sums of dx as stored added to input_grad_sums.
template <typename T, int V, bool Sums>
__global__ void CUDP_BN_CLUSTER_DIMS __launch_bounds__(kClusterThreads)
    bn_backward_cluster_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                               const T* __restrict__ mask, const float* __restrict__ gamma,
                               const float* __restrict__ mean_in,
                               const float* __restrict__ save_invstd, T* __restrict__ dx,
                               float* __restrict__ dgamma, float* __restrict__ dbeta,
                               float beta_accumulate, int64_t rows, int c,
                               float* __restrict__ input_grad_sums) {
  kernel_entry();
#if CUDP_BN_CLUSTERS
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ float smem[];
  const int lanes = blockDim.x, width = lanes * V, tx = threadIdx.x, ty = threadIdx.y;
  const int stride = blockDim.y * width;
  float* s_a = smem;             // blockDim.y x width (at()): sum g, later (Sums) sum of dx
  float* s_b = s_a + stride;     // blockDim.y x width (at()): sum g * (x - mean)
  float* s_coef = s_b + stride;  // [3][V][lanes]: k, a, b
  const ClusterWalk w = cluster_walk<V>(cluster, c);
  float mean[V], a[V], b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) a[k] = b[k] = 0.f, mean[k] = w.active ? mean_in[w.channel + k] : 0.f;
  if (w.active) grad_sums_walk<T, V>(x, dy, mask, mean, w.r0, w.step, rows, c, w.channel, a, b);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s_a[at(ty, k, tx)] = a[k];
    s_b[at(ty, k, tx)] = b[k];
  }
  sum_tree<V, 2>(smem, stride);
  cluster_sync();  // every block's sums are in row 0 of its arrays
  if (ty == 0 && w.active) {
    float sum_dy[V], sum_dy_xmu[V];
#pragma unroll
    for (int k = 0; k < V; ++k) sum_dy[k] = sum_dy_xmu[k] = 0.f;
    for (unsigned q = 0; q < kClusterBlocks; ++q) {
      const float* a_q = cluster.map_shared_rank(s_a, q);
      const float* b_q = cluster.map_shared_rank(s_b, q);
#pragma unroll
      for (int k = 0; k < V; ++k)
        sum_dy[k] += a_q[at(0, k, tx)], sum_dy_xmu[k] += b_q[at(0, k, tx)];
    }
    const bool writer = w.rank == 0;  // writes dgamma and dbeta; every block its coefficients
    const float m = float(rows);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int ch = w.channel + k;
      finish_gradients(ch, sum_dy[k], sum_dy_xmu[k], save_invstd[ch], m, false, gamma,
                       writer ? dgamma : nullptr, writer ? dbeta : nullptr, beta_accumulate,
                       s_coef + k * lanes + tx, width);
    }
  }
  __syncthreads();
  cluster_arrive();  // this block is done reading its peers' sums
  float k_[V], sum[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    k_[k] = w.active ? s_coef[k * lanes + tx] : 0.f;
    a[k] = w.active ? s_coef[width + k * lanes + tx] : 0.f;
    b[k] = w.active ? s_coef[2 * width + k * lanes + tx] : 0.f;
    sum[k] = 0.f;
  }
  if (w.active) {
    dx_walk<T, V, false, Sums>(x, dy, mask, mean, k_, a, b, dx, w.r0, w.step, rows, c, w.channel,
                               sum);
  }
  cluster_wait();  // and its peers with its own: s_a and s_b may be written again
  if constexpr (Sums) {
#pragma unroll
    for (int k = 0; k < V; ++k) s_a[at(ty, k, tx)] = sum[k];
    sum_tree<V, 1>(s_a, 0);
    cluster_sync();  // every block's column sums are in row 0 of s_a
    if (w.rank == 0 && ty == 0 && w.active) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float total = 0.f;
        for (unsigned q = 0; q < kClusterBlocks; ++q) {
          total += cluster.map_shared_rank(s_a, q)[at(0, k, tx)];
        }
        input_grad_sums[w.channel + k] += total;  // bias_grad_from_partials' beta = 1
      }
    }
    cluster_sync();  // rank 0 is done reading: the blocks' shared memory may go
  }
#endif
}

#undef CUDP_BN_CLUSTERS
#undef CUDP_BN_CLUSTER_DIMS

// ---- split passes (kernels/batchnorm.h, "Split passes") -----------------------------------------

// Per channel: merges the participants' summaries in slot order relative to slot 0's shift, then
// writes what bn_stats_finalize_kernel writes. With one slot the merge is the identity (from an
// empty summary Chan's merge takes the slot's mean and M2 as they are), so one participant gets the
// bits of the single-device multi-pass kernels (not of the one-launch cluster kernels, which merge
// in another order).
__global__ void bn_merge_stats_kernel(
    const float* __restrict__ summaries, int parts, int c, const float* __restrict__ gamma,
    const float* __restrict__ beta, float* __restrict__ running_mean,
    float* __restrict__ running_var, float* __restrict__ save_mean, float* __restrict__ save_invstd,
    float momentum, float eps, float* __restrict__ coef) {
  kernel_entry();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  const int64_t size = 1 + 3 * int64_t(c);
  const float shift_k = summaries[1 + ch];
  float n = 0.f, mean_d = 0.f, m2 = 0.f;
  for (int p = 0; p < parts; ++p) {
    const float* s = summaries + p * size;
    chan_merge(n, mean_d, m2, s[0], (s[1 + ch] - shift_k) + s[1 + c + ch], s[1 + 2 * c + ch]);
  }
  finish_statistics(ch, shift_k, mean_d, m2, n, n - 1.f, gamma, beta, running_mean, running_var,
                    save_mean, save_invstd, momentum, eps, coef + ch, c);
}

// Per channel: the dx coefficients [k | a | b] from the summed sums, as bn_backward_finalize_kernel
// computes them from its own.
__global__ void bn_backward_coef_kernel(const float* __restrict__ sums, int c,
                                        const float* __restrict__ gamma,
                                        const float* __restrict__ save_invstd,
                                        float* __restrict__ coef) {
  kernel_entry();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  finish_gradients(ch, sums[ch], sums[c + ch], save_invstd[ch], sums[2 * c], false, gamma, nullptr,
                   nullptr, 0.f, coef + ch, c);
}

// ---- host side ----------------------------------------------------------------------------------

// The vector path needs c % V == 0 and every given pointer on a 16-byte boundary (then so is
// every row, as c * sizeof(T) is a multiple of 16).
template <typename T>
bool vectorizable(int c, std::initializer_list<const void*> pointers) {
  if (c % kVector<T> != 0) return false;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// Runs f.template operator()<V>() with V = kVector<T> or 1.
template <typename T, typename F>
void with_vector(bool vector, F&& f) {
  if (vector) {
    f.template operator()<kVector<T>>();
  } else {
    f.template operator()<1>();
  }
}

// The grid of a row-walking kernel: lanes over channel vectors in groups of at most 32, row threads
// filling the block, row blocks for one wave of resident blocks (never more than the rows need).
struct Plan {
  dim3 block, grid;
  size_t shared_bytes = 0;
};

template <typename Kernel>
Plan make_plan(Kernel kernel, int64_t rows, int c, int v, size_t shared_per_thread) {
  const int vectors = c / v;
  const int groups = (vectors + 31) / 32;
  const int lanes = (vectors + groups - 1) / groups;
  const int row_threads = std::max(1, kThreads / lanes);
  Plan plan;
  plan.block = dim3(lanes, row_threads);
  plan.shared_bytes = shared_per_thread * lanes * row_threads;
  int device = 0, sms = 0, per_sm = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, kernel, lanes * row_threads, plan.shared_bytes));
  const int64_t wave = std::max<int64_t>(1, int64_t(sms) * std::max(per_sm, 1) / groups);
  const int64_t needed = (rows + row_threads - 1) / row_threads;
  plan.grid = dim3(groups, unsigned(std::min<int64_t>({wave, needed, 65535})));
  return plan;
}

dim3 finalize_grid(int c) {
  return dim3((c + kFinalLanes - 1) / kFinalLanes);
}
const dim3 kFinalBlock(kFinalLanes, kFinalRows);

std::atomic<bool> g_cluster{false};  // off: measured slower (kernels/batchnorm.h)

// The blocks the cluster plan aims for: about one per SM of an H100 or H200 (132). A constant, not
// the GPU's SM count, so that the grid, and with it the bits, depend on the shape alone.
constexpr int kClusterTargetBlocks = 128;

// The cluster kernels' dynamic shared memory for a block of `lanes` lanes (V values each) and
// kClusterThreads / lanes rows. The forward: the block's counts, means and M2s, then the 4
// coefficients of its channels; the backward: its two sums, then 3 coefficients (never more than
// the forward's).
size_t cluster_forward_bytes(int lanes, int v) {
  const size_t threads = size_t(lanes) * (kClusterThreads / lanes), width = size_t(lanes) * v;
  return (threads + 2 * threads * v + 4 * width) * sizeof(float);
}
size_t cluster_backward_bytes(int lanes, int v) {
  const size_t threads = size_t(lanes) * (kClusterThreads / lanes), width = size_t(lanes) * v;
  return (2 * threads * v + 3 * width) * sizeof(float);
}

// What a block may take without opting in to more (cudaFuncAttributeMaxDynamicSharedMemorySize).
constexpr size_t kClusterSharedLimit = 48 * 1024;

// The cluster kernels' grid and block for rows x c (V channels a lane; `bytes` per value), or none
// where the multi-pass kernels run (detail::batchnorm_one_launch). A lane takes 32 bytes of a row
// (one sector); more lanes where the rows would not reach every block of a cluster (VGG's conv11
// to conv13 at 32 x 32: 1,024 rows), as long as that leaves kClusterTargetBlocks and the block's
// shared memory within kClusterSharedLimit (a few rows of many channels: 8 x 16,384 in bf16 would
// ask 50 KB at 128 lanes) and at least one row of threads; fewer where the clusters would have
// fewer blocks than that. The first lanes (at most 16) take at most 35 KB.
std::optional<Plan> cluster_plan(int64_t rows, int c, int v, int bytes) {
  if (!detail::batchnorm_one_launch(rows, c)) return std::nullopt;
  const int vectors = c / v;
  int lanes = std::min(vectors, std::max(1, 32 / (v * bytes)));
  auto blocks = [&](int l) { return int64_t((vectors + l - 1) / l) * kClusterBlocks; };
  while (2 * lanes <= vectors && 2 * lanes <= kClusterThreads &&
         rows < int64_t(kClusterThreads / lanes) * kClusterBlocks &&
         blocks(2 * lanes) >= kClusterTargetBlocks &&
         cluster_forward_bytes(2 * lanes, v) <= kClusterSharedLimit) {
    lanes *= 2;
  }
  while (lanes > 1 && blocks(lanes) < kClusterTargetBlocks) lanes = (lanes + 1) / 2;
  Plan plan;
  plan.block = dim3(lanes, kClusterThreads / lanes);
  plan.grid = dim3((vectors + lanes - 1) / lanes, kClusterBlocks);
  return plan;
}

template <typename T, int V>
void forward_train(const T* x, T* y, const float* gamma, const float* beta, float* running_mean,
                   float* running_var, float* save_mean, float* save_invstd, int64_t rows, int c,
                   float momentum, float eps, bool relu, cudaStream_t stream,
                   int64_t* batches_tracked) {
  if (const std::optional<Plan> one = cluster_plan(rows, c, V, int(sizeof(T)))) {
    launch("bn_forward_cluster_kernel", bn_forward_cluster_kernel<T, V>, one->grid, one->block,
           cluster_forward_bytes(int(one->block.x), V), stream, x, y, rows, c, gamma, beta,
           running_mean, running_var, save_mean, save_invstd, momentum, eps, relu, batches_tracked);
    return;
  }
  // Shared memory per thread: its count and V means and M2s.
  const Plan stats = make_plan(bn_stats_kernel<T, V>, rows, c, V, (1 + 2 * V) * sizeof(float));
  const int parts = int(stats.grid.y);
  Workspace ws((size_t(parts) * (2 * c + 1) + 4 * size_t(c)) * sizeof(float), stream,
               "batch norm's partial statistics");
  float* part_mean = ws.get();
  float* part_m2 = part_mean + size_t(parts) * c;
  float* part_n = part_m2 + size_t(parts) * c;
  float* coef = part_n + parts;
  launch("bn_stats_kernel", bn_stats_kernel<T, V>, stats.grid, stats.block, stats.shared_bytes,
         stream, x, rows, c, part_n, part_mean, part_m2);
  launch("bn_stats_finalize_kernel", bn_stats_finalize_kernel<T>, finalize_grid(c), kFinalBlock, 0,
         stream, x, part_n, part_mean, part_m2, parts, rows, c, gamma, beta, running_mean,
         running_var, save_mean, save_invstd, momentum, eps, coef, nullptr, batches_tracked);
  const Plan apply = make_plan(bn_apply_kernel<T, V, false>, rows, c, V, 0);
  const ApplyParams params{coef, coef + c, coef + 2 * c, nullptr, coef + 3 * c, 0.f, relu};
  launch("bn_apply_kernel", bn_apply_kernel<T, V, false>, apply.grid, apply.block, 0, stream, x, y,
         rows, c, params);
}

// Both backwards; running_var != nullptr means frozen statistics (mean is then running_mean).
template <typename T, int V>
void backward(const T* x, const T* dy, const T* mask, const float* gamma, const float* mean,
              const float* save_invstd, const float* running_var, float eps, T* dx, float* dgamma,
              float* dbeta, int64_t rows, int c, float beta_accumulate, cudaStream_t stream,
              float* input_grad_sums) {
  const std::optional<Plan> one =
      running_var ? std::nullopt : cluster_plan(rows, c, V, int(sizeof(T)));
  if (one) {
    auto run = [&]<bool Sums>() {
      launch("bn_backward_cluster_kernel", bn_backward_cluster_kernel<T, V, Sums>, one->grid,
             one->block, cluster_backward_bytes(int(one->block.x), V), stream, x, dy, mask, gamma,
             mean, save_invstd, dx, dgamma, dbeta, beta_accumulate, rows, c, input_grad_sums);
    };
    if (input_grad_sums) {
      // The kernel adds to them itself: after any queued sum into them.
      detail::flush_deferred_bias_grads_into(input_grad_sums, stream);
      run.template operator()<true>();
    } else {
      run.template operator()<false>();
    }
    return;
  }
  const Plan reduce = make_plan(bn_backward_reduce_kernel<T, V>, rows, c, V, 2 * V * sizeof(float));
  const int parts = int(reduce.grid.y);
  Workspace ws((size_t(parts) * 2 * c + 3 * size_t(c)) * sizeof(float), stream,
               "batch norm's partial gradient sums");
  float* part_dy = ws.get();
  float* part_dy_xmu = part_dy + size_t(parts) * c;
  float* coef = part_dy_xmu + size_t(parts) * c;
  launch("bn_backward_reduce_kernel", bn_backward_reduce_kernel<T, V>, reduce.grid, reduce.block,
         reduce.shared_bytes, stream, x, dy, mask, mean, rows, c, part_dy, part_dy_xmu);
  launch("bn_backward_finalize_kernel", bn_backward_finalize_kernel, finalize_grid(c), kFinalBlock,
         0, stream, part_dy, part_dy_xmu, parts, rows, c, gamma, save_invstd, running_var, eps,
         dgamma, dbeta, beta_accumulate, coef, nullptr);
  auto dx_pass = [&]<bool Frozen, bool Sums>() {
    const auto kernel = bn_backward_dx_kernel<T, V, Frozen, Sums>;
    // With the sums, shared memory for the block's tree: V floats a thread.
    const Plan apply = make_plan(kernel, rows, c, V, Sums ? V * sizeof(float) : 0);
    if constexpr (Sums) {
      const int64_t parts = apply.grid.y;
      Workspace partials(size_t(parts) * c * sizeof(float), stream,
                         "batch norm's partial column sums of dx");
      launch("bn_backward_dx_kernel", kernel, apply.grid, apply.block, apply.shared_bytes, stream,
             x, dy, mask, mean, coef, dx, rows, c, partials.get());
      bias_grad_from_partials(std::move(partials), input_grad_sums, parts, c, 1.f, stream);
    } else {
      launch("bn_backward_dx_kernel", kernel, apply.grid, apply.block, 0, stream, x, dy, mask, mean,
             coef, dx, rows, c, nullptr);
    }
  };
  // Only the training backward takes the sums (batchnorm_backward_eval passes none).
  if (running_var) {
    dx_pass.template operator()<true, false>();
  } else if (input_grad_sums) {
    dx_pass.template operator()<false, true>();
  } else {
    dx_pass.template operator()<false, false>();
  }
}

}  // namespace

template <typename T>
void batchnorm_forward_train(const T* x, std::type_identity_t<T>* y, const float* gamma,
                             const float* beta, float* running_mean, float* running_var,
                             float* save_mean, float* save_invstd, int64_t rows, int c,
                             float momentum, float eps, BnActivation act, cudaStream_t stream,
                             int64_t* batches_tracked) {
  detail::check_batchnorm("batchnorm_forward_train", rows, c, true);
  with_vector<T>(vectorizable<T>(c, {x, y}), [&]<int V>() {
    forward_train<T, V>(x, y, gamma, beta, running_mean, running_var, save_mean, save_invstd, rows,
                        c, momentum, eps, act == BnActivation::relu, stream, batches_tracked);
  });
}

template <typename T>
void batchnorm_forward_eval(const T* x, std::type_identity_t<T>* y, const float* gamma,
                            const float* beta, const float* running_mean, const float* running_var,
                            int64_t rows, int c, float eps, BnActivation act, cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_forward_eval", rows, c, false);
  CUDP_CHECK(running_mean && running_var,
             "batchnorm_forward_eval: needs running_mean and running_var");
  if (rows == 0) return;
  with_vector<T>(vectorizable<T>(c, {x, y}), [&]<int V>() {
    const Plan apply = make_plan(bn_apply_kernel<T, V, true>, rows, c, V, 0);
    const ApplyParams params{
        running_mean, nullptr, running_var, gamma, beta, eps, act == BnActivation::relu};
    launch("bn_apply_kernel", bn_apply_kernel<T, V, true>, apply.grid, apply.block, 0, stream, x, y,
           rows, c, params);
  });
}

template <typename T>
void batchnorm_backward(const T* x, const std::type_identity_t<T>* dy,
                        const std::type_identity_t<T>* relu_output, const float* gamma,
                        const float* save_mean, const float* save_invstd,
                        std::type_identity_t<T>* dx, float* dgamma, float* dbeta, int64_t rows,
                        int c, float beta_accumulate, cudaStream_t stream, float* input_grad_sums) {
  detail::check_batchnorm("batchnorm_backward", rows, c, true);
  CUDP_CHECK(save_mean && save_invstd,
             "batchnorm_backward: needs save_mean and save_invstd from the training forward");
  with_vector<T>(vectorizable<T>(c, {x, dy, relu_output, dx}), [&]<int V>() {
    backward<T, V>(x, dy, relu_output, gamma, save_mean, save_invstd, nullptr, 0.f, dx, dgamma,
                   dbeta, rows, c, beta_accumulate, stream, input_grad_sums);
  });
}

template <typename T>
void batchnorm_backward_eval(const T* x, const std::type_identity_t<T>* dy,
                             const std::type_identity_t<T>* relu_output, const float* gamma,
                             const float* running_mean, const float* running_var,
                             std::type_identity_t<T>* dx, float* dgamma, float* dbeta, int64_t rows,
                             int c, float eps, float beta_accumulate, cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_backward_eval", rows, c, false);
  CUDP_CHECK(running_mean && running_var,
             "batchnorm_backward_eval: needs running_mean and running_var");
  with_vector<T>(vectorizable<T>(c, {x, dy, relu_output, dx}), [&]<int V>() {
    backward<T, V>(x, dy, relu_output, gamma, running_mean, nullptr, running_var, eps, dx, dgamma,
                   dbeta, rows, c, beta_accumulate, stream, nullptr);
  });
}

template <typename T>
void batchnorm_local_stats(const T* x, int64_t rows, int c, float* summary, cudaStream_t stream) {
  CUDP_CHECK(c >= 1 && rows >= 1, "batchnorm_local_stats: needs rows >= 1 and c >= 1, got rows ",
             rows, " and c ", c);
  with_vector<T>(vectorizable<T>(c, {x}), [&]<int V>() {
    const Plan stats = make_plan(bn_stats_kernel<T, V>, rows, c, V, (1 + 2 * V) * sizeof(float));
    const int parts = int(stats.grid.y);
    Workspace ws(size_t(parts) * (2 * c + 1) * sizeof(float), stream,
                 "batch norm's partial statistics");
    float* part_mean = ws.get();
    float* part_m2 = part_mean + size_t(parts) * c;
    float* part_n = part_m2 + size_t(parts) * c;
    launch("bn_stats_kernel", bn_stats_kernel<T, V>, stats.grid, stats.block, stats.shared_bytes,
           stream, x, rows, c, part_n, part_mean, part_m2);
    launch("bn_stats_finalize_kernel", bn_stats_finalize_kernel<T>, finalize_grid(c), kFinalBlock,
           0, stream, x, part_n, part_mean, part_m2, parts, rows, c, nullptr, nullptr, nullptr,
           nullptr, nullptr, nullptr, 0.f, 0.f, nullptr, summary, nullptr);
  });
}

void batchnorm_merge_stats(const float* summaries, int parts, int c, const float* gamma,
                           const float* beta, float* running_mean, float* running_var,
                           float* save_mean, float* save_invstd, float momentum, float eps,
                           float* coef, cudaStream_t stream) {
  CUDP_CHECK(c >= 1 && parts >= 1, "batchnorm_merge_stats: needs parts >= 1 and c >= 1, got ",
             parts, " and ", c);
  launch("bn_merge_stats_kernel", bn_merge_stats_kernel, dim3((c + 127) / 128), dim3(128), 0,
         stream, summaries, parts, c, gamma, beta, running_mean, running_var, save_mean,
         save_invstd, momentum, eps, coef);
}

template <typename T>
void batchnorm_apply(const T* x, std::type_identity_t<T>* y, const float* coef, int64_t rows, int c,
                     BnActivation act, cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_apply", rows, c, false);
  if (rows == 0) return;
  with_vector<T>(vectorizable<T>(c, {x, y}), [&]<int V>() {
    const Plan apply = make_plan(bn_apply_kernel<T, V, false>, rows, c, V, 0);
    const ApplyParams params{
        coef, coef + c, coef + 2 * c, nullptr, coef + 3 * c, 0.f, act == BnActivation::relu};
    launch("bn_apply_kernel", bn_apply_kernel<T, V, false>, apply.grid, apply.block, 0, stream, x,
           y, rows, c, params);
  });
}

template <typename T>
void batchnorm_backward_local(const T* x, const std::type_identity_t<T>* dy,
                              const std::type_identity_t<T>* relu_output, const float* save_mean,
                              const float* save_invstd, int64_t rows, int c, float* sums,
                              float* dgamma, float* dbeta, float beta_accumulate,
                              cudaStream_t stream) {
  CUDP_CHECK(c >= 1 && rows >= 1, "batchnorm_backward_local: needs rows >= 1 and c >= 1, got rows ",
             rows, " and c ", c);
  with_vector<T>(vectorizable<T>(c, {x, dy, relu_output}), [&]<int V>() {
    const Plan reduce =
        make_plan(bn_backward_reduce_kernel<T, V>, rows, c, V, 2 * V * sizeof(float));
    const int parts = int(reduce.grid.y);
    Workspace ws(size_t(parts) * 2 * c * sizeof(float), stream,
                 "batch norm's partial gradient sums");
    float* part_dy = ws.get();
    float* part_dy_xmu = part_dy + size_t(parts) * c;
    launch("bn_backward_reduce_kernel", bn_backward_reduce_kernel<T, V>, reduce.grid, reduce.block,
           reduce.shared_bytes, stream, x, dy, relu_output, save_mean, rows, c, part_dy,
           part_dy_xmu);
    launch("bn_backward_finalize_kernel", bn_backward_finalize_kernel, finalize_grid(c),
           kFinalBlock, 0, stream, part_dy, part_dy_xmu, parts, rows, c, nullptr, save_invstd,
           nullptr, 0.f, dgamma, dbeta, beta_accumulate, nullptr, sums);
  });
}

template <typename T>
void batchnorm_backward_global(const T* x, const std::type_identity_t<T>* dy,
                               const std::type_identity_t<T>* relu_output, const float* gamma,
                               const float* save_mean, const float* save_invstd, const float* sums,
                               std::type_identity_t<T>* dx, int64_t rows, int c,
                               cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_backward_global", rows, c, false);
  Workspace ws(3 * size_t(c) * sizeof(float), stream, "batch norm's gradient coefficients");
  float* coef = ws.get();
  launch("bn_backward_coef_kernel", bn_backward_coef_kernel, dim3((c + 127) / 128), dim3(128), 0,
         stream, sums, c, gamma, save_invstd, coef);
  if (rows == 0) return;
  with_vector<T>(vectorizable<T>(c, {x, dy, relu_output, dx}), [&]<int V>() {
    const Plan apply = make_plan(bn_backward_dx_kernel<T, V, false, false>, rows, c, V, 0);
    launch("bn_backward_dx_kernel", bn_backward_dx_kernel<T, V, false, false>, apply.grid,
           apply.block, 0, stream, x, dy, relu_output, save_mean, coef, dx, rows, c, nullptr);
  });
}

namespace detail {

void set_batchnorm_cluster(bool on) {
  g_cluster.store(on);
}

bool batchnorm_cluster() {
  return g_cluster.load();
}

bool batchnorm_one_launch(int64_t rows, int c) {
  if (!g_cluster.load() || rows * int64_t(c) > kBatchnormClusterElements) return false;
  // Few channels over many rows would leave all but a few SMs idle (one cluster of 8 blocks per
  // channel group): there the multi-pass kernels' full grid is faster.
  if (c < 64 && rows * int64_t(c) > kBatchnormClusterFewChannels) return false;
  int device = 0, clusters = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
  return clusters != 0;
}

int batchnorm_cluster_rows_per_block(int64_t rows, int c, int v, int bytes) {
  const std::optional<Plan> plan = cluster_plan(rows, c, v, bytes);
  return plan ? int(plan->block.y) : 0;
}

}  // namespace detail

#define CUDP_BATCHNORM_SPLIT_INSTANTIATE(T)                                                     \
  template void batchnorm_local_stats<T>(const T*, int64_t, int, float*, cudaStream_t);         \
  template void batchnorm_apply<T>(const T*, T*, const float*, int64_t, int, BnActivation,      \
                                   cudaStream_t);                                               \
  template void batchnorm_backward_local<T>(const T*, const T*, const T*, const float*,         \
                                            const float*, int64_t, int, float*, float*, float*, \
                                            float, cudaStream_t);                               \
  template void batchnorm_backward_global<T>(const T*, const T*, const T*, const float*,        \
                                             const float*, const float*, const float*, T*,      \
                                             int64_t, int, cudaStream_t);
CUDP_BATCHNORM_SPLIT_INSTANTIATE(float)
CUDP_BATCHNORM_SPLIT_INSTANTIATE(__nv_bfloat16)
#undef CUDP_BATCHNORM_SPLIT_INSTANTIATE

#define CUDP_BATCHNORM_INSTANTIATE(T)                                                             \
  template void batchnorm_forward_train<T>(const T*, T*, const float*, const float*, float*,      \
                                           float*, float*, float*, int64_t, int, float, float,    \
                                           BnActivation, cudaStream_t, int64_t*);                 \
  template void batchnorm_forward_eval<T>(const T*, T*, const float*, const float*, const float*, \
                                          const float*, int64_t, int, float, BnActivation,        \
                                          cudaStream_t);                                          \
  template void batchnorm_backward<T>(const T*, const T*, const T*, const float*, const float*,   \
                                      const float*, T*, float*, float*, int64_t, int, float,      \
                                      cudaStream_t, float*);                                      \
  template void batchnorm_backward_eval<T>(const T*, const T*, const T*, const float*,            \
                                           const float*, const float*, T*, float*, float*,        \
                                           int64_t, int, float, float, cudaStream_t);
CUDP_BATCHNORM_INSTANTIATE(float)
CUDP_BATCHNORM_INSTANTIATE(__nv_bfloat16)
#undef CUDP_BATCHNORM_INSTANTIATE

}  // namespace cudp::kernels
