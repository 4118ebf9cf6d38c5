// Batch normalisation kernels (semantics and the reasons for this structure: kernels/batchnorm.h).
//
// A [rows, c] matrix is spread over a 2-D grid: blockDim.x lanes over channel vectors (V = 4
// channels per lane when c % 4 == 0 and the pointers allow float4, else 1), blockDim.y threads over
// rows; gridDim.x channel groups of at most 32 lanes, gridDim.y row blocks, as many as fit on the
// GPU at once (one wave), every thread striding over rows. A lane keeps its channels' parameters in
// registers for the whole walk. When one group covers all channels (c <= 128 with float4), a warp's
// accesses are one contiguous run of memory even if the lanes do not fill it.
//
// Reductions are deterministic: per thread in row order, then across blockDim.y in a fixed tree in
// shared memory, then (finalize kernel) across row blocks in a fixed order. The grid depends on the
// GPU's SM count and occupancy, so results are bitwise reproducible on one GPU model, not across.
#include <algorithm>

#include "engine/core/launch.cuh"
#include "kernels/batchnorm.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;    // threads per block of the row-walking kernels
constexpr int kUnroll = 4;       // rows in flight per thread
constexpr int kFinalLanes = 32;  // finalize: channels per block (x) ...
constexpr int kFinalRows = 32;   // ... and partials walked in parallel (y)

template <int V>
__device__ __forceinline__ void load(const float* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
    v[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void store(float* p, const float (&v)[V]) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    *p = v[0];
  }
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

// ---- forward statistics -------------------------------------------------------------------------
//
// Everything is relative to a per-channel shift K = x[row 0, channel] (a sample of the data, so
// |mean - K| is a few standard deviations at most): each thread sums d = x - K and d^2, turns them
// into (count, mean of d, M2) where sum d^2 - (sum d)^2 / n loses nothing to cancellation, and
// those are merged with Chan's formula. The merged mean of d stays small, so its rounding errors
// are relative to the spread of the data and not to |mean|: a channel with mean 1000 and spread 1
// is normalised as accurately as one with mean 0. K is added back only for the saved mean.

// Partials per (row block, channel): count, mean of x - K, M2 of the rows that block walked.
template <int V>
__global__ void bn_stats_kernel(const float* __restrict__ x, int64_t rows, int c,
                                float* __restrict__ part_n, float* __restrict__ part_mean,
                                float* __restrict__ part_m2) {
  extern __shared__ float smem[];
  const int lanes = blockDim.x, width = lanes * V, tx = threadIdx.x, ty = threadIdx.y;
  float* s_n = smem;                          // [blockDim.y][lanes]
  float* s_mean = s_n + blockDim.y * lanes;   // [blockDim.y][width]
  float* s_m2 = s_mean + blockDim.y * width;  // [blockDim.y][width]

  const int channel = (blockIdx.x * lanes + tx) * V;
  const bool active = channel < c;
  const int64_t step = int64_t(blockDim.y) * gridDim.y;
  const int64_t r0 = int64_t(blockIdx.y) * blockDim.y + ty;
  const int64_t count = rows_walked(r0, step, rows);

  float shift[V], s1[V], s2[V];
#pragma unroll
  for (int k = 0; k < V; ++k) shift[k] = s1[k] = s2[k] = 0.f;
  if (active && count > 0) {
    const float* col = x + channel;
    load<V>(col, shift);  // row 0
    int64_t r = r0;
    for (; r + (kUnroll - 1) * step < rows; r += kUnroll * step) {
      float v[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load<V>(col + (r + u * step) * c, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float d = v[u][k] - shift[k];
          s1[k] += d;
          s2[k] = fmaf(d, d, s2[k]);
        }
      }
    }
    for (; r < rows; r += step) {
      float v[V];
      load<V>(col + r * c, v);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = v[k] - shift[k];
        s1[k] += d;
        s2[k] = fmaf(d, d, s2[k]);
      }
    }
  }
  const float n = float(count);
  s_n[ty * lanes + tx] = n;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s_mean[ty * width + tx * V + k] = n > 0 ? s1[k] / n : 0.f;
    s_m2[ty * width + tx * V + k] = n > 0 ? fmaxf(s2[k] - s1[k] * (s1[k] / n), 0.f) : 0.f;
  }
  __syncthreads();
  for (int half = pow2_ceil(blockDim.y) / 2; half > 0; half /= 2) {
    if (ty < half && ty + half < int(blockDim.y)) {
      const int a = ty * lanes + tx, b = (ty + half) * lanes + tx;
      const float n_a = s_n[a], n_b = s_n[b];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float na = n_a;
        const int ia = ty * width + tx * V + k, ib = (ty + half) * width + tx * V + k;
        chan_merge(na, s_mean[ia], s_m2[ia], n_b, s_mean[ib], s_m2[ib]);
      }
      s_n[a] = n_a + n_b;
    }
    __syncthreads();
  }
  if (ty == 0 && active) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      part_mean[int64_t(blockIdx.y) * c + channel + k] = s_mean[tx * V + k];
      part_m2[int64_t(blockIdx.y) * c + channel + k] = s_m2[tx * V + k];
    }
    if (blockIdx.x == 0 && tx == 0) part_n[blockIdx.y] = s_n[0];
  }
}

// Per channel: merges the partials in a fixed order, writes the saved and running statistics, and
// the coefficients of y = ((x - K) - mean_d) * scale + shift into coef = [K | mean_d | scale |
// shift].
__global__ void __launch_bounds__(kFinalLanes* kFinalRows)
    bn_stats_finalize_kernel(const float* __restrict__ x, const float* __restrict__ part_n,
                             const float* __restrict__ part_mean, const float* __restrict__ part_m2,
                             int parts, int64_t rows, int c, const float* __restrict__ gamma,
                             const float* __restrict__ beta, float* __restrict__ running_mean,
                             float* __restrict__ running_var, float* __restrict__ save_mean,
                             float* __restrict__ save_invstd, float momentum, float eps,
                             float* __restrict__ coef) {
  __shared__ float s_n[kFinalRows][kFinalLanes], s_mean[kFinalRows][kFinalLanes],
      s_m2[kFinalRows][kFinalLanes];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int ch = blockIdx.x * kFinalLanes + tx;
  float n = 0.f, mean_d = 0.f, m2 = 0.f;
  if (ch < c) {
    for (int p = ty; p < parts; p += kFinalRows) {
      chan_merge(n, mean_d, m2, part_n[p], part_mean[int64_t(p) * c + ch],
                 part_m2[int64_t(p) * c + ch]);
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
  const float shift_k = x[ch];  // K: row 0
  mean_d = s_mean[0][tx];
  m2 = s_m2[0][tx];
  const float mean = shift_k + mean_d;
  const float var = m2 / float(rows);
  const float invstd = 1.f / sqrtf(var + eps);
  if (save_mean) save_mean[ch] = mean;
  if (save_invstd) save_invstd[ch] = invstd;
  if (running_mean) running_mean[ch] = (1.f - momentum) * running_mean[ch] + momentum * mean;
  if (running_var) {
    const float unbiased = m2 / float(rows - 1);
    running_var[ch] = (1.f - momentum) * running_var[ch] + momentum * unbiased;
  }
  coef[ch] = shift_k;
  coef[c + ch] = mean_d;
  coef[2 * c + ch] = gamma ? gamma[ch] * invstd : invstd;
  coef[3 * c + ch] = beta ? beta[ch] : 0.f;
}

// ---- element-wise passes ------------------------------------------------------------------------

// Per-channel inputs of the normalisation y = ((x - center) - offset) * scale + shift.
struct ApplyParams {
  const float* center;  // training: K; evaluation: running_mean
  const float* offset;  // training: mean of x - K; evaluation: nullptr (0)
  const float* scale;   // training: gamma * invstd; evaluation: running_var (scale computed here)
  const float* gamma;   // evaluation only, nullable
  const float* shift;   // training: beta or 0; evaluation: beta, nullable
  float eps;            // evaluation only
};

template <int V, bool FromRunning>
__global__ void bn_apply_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t rows,
                                int c, ApplyParams p) {
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
  const int64_t step = int64_t(blockDim.y) * gridDim.y;
  int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  for (; r + (kUnroll - 1) * step < rows; r += kUnroll * step) {
    float v[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load<V>(x + (r + u * step) * c + channel, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        v[u][k] = fmaf((v[u][k] - center[k]) - offset[k], scale[k], shift[k]);
      store<V>(y + (r + u * step) * c + channel, v[u]);
    }
  }
  for (; r < rows; r += step) {
    float v[V];
    load<V>(x + r * c + channel, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = fmaf((v[k] - center[k]) - offset[k], scale[k], shift[k]);
    store<V>(y + r * c + channel, v);
  }
}

// ---- backward -----------------------------------------------------------------------------------

// Partials per (row block, channel) of sum dy and sum dy * (x - mean).
template <int V>
__global__ void bn_backward_reduce_kernel(const float* __restrict__ x, const float* __restrict__ dy,
                                          const float* __restrict__ save_mean, int64_t rows, int c,
                                          float* __restrict__ part_dy,
                                          float* __restrict__ part_dy_xmu) {
  extern __shared__ float smem[];
  const int lanes = blockDim.x, width = lanes * V, tx = threadIdx.x, ty = threadIdx.y;
  float* s_dy = smem;                           // [blockDim.y][width]
  float* s_dy_xmu = s_dy + blockDim.y * width;  // [blockDim.y][width]

  const int channel = (blockIdx.x * lanes + tx) * V;
  const bool active = channel < c;
  const int64_t step = int64_t(blockDim.y) * gridDim.y;
  float mean[V], a[V], b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) a[k] = b[k] = 0.f, mean[k] = active ? save_mean[channel + k] : 0.f;
  if (active) {
    int64_t r = int64_t(blockIdx.y) * blockDim.y + ty;
    for (; r + (kUnroll - 1) * step < rows; r += kUnroll * step) {
      float xv[kUnroll][V], gv[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        load<V>(x + (r + u * step) * c + channel, xv[u]);
        load<V>(dy + (r + u * step) * c + channel, gv[u]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          a[k] += gv[u][k];
          b[k] = fmaf(gv[u][k], xv[u][k] - mean[k], b[k]);
        }
      }
    }
    for (; r < rows; r += step) {
      float xv[V], gv[V];
      load<V>(x + r * c + channel, xv);
      load<V>(dy + r * c + channel, gv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        a[k] += gv[k];
        b[k] = fmaf(gv[k], xv[k] - mean[k], b[k]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s_dy[ty * width + tx * V + k] = a[k];
    s_dy_xmu[ty * width + tx * V + k] = b[k];
  }
  __syncthreads();
  for (int half = pow2_ceil(blockDim.y) / 2; half > 0; half /= 2) {
    if (ty < half && ty + half < int(blockDim.y)) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int ia = ty * width + tx * V + k, ib = (ty + half) * width + tx * V + k;
        s_dy[ia] += s_dy[ib];
        s_dy_xmu[ia] += s_dy_xmu[ib];
      }
    }
    __syncthreads();
  }
  if (ty == 0 && active) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      part_dy[int64_t(blockIdx.y) * c + channel + k] = s_dy[tx * V + k];
      part_dy_xmu[int64_t(blockIdx.y) * c + channel + k] = s_dy_xmu[tx * V + k];
    }
  }
}

// Per channel: sums the partials in a fixed order, writes dgamma/dbeta and the coefficients of
// dx = k * (dy - a - (x - mean) * b) into coef = [k | a | b].
__global__ void __launch_bounds__(kFinalLanes* kFinalRows)
    bn_backward_finalize_kernel(const float* __restrict__ part_dy,
                                const float* __restrict__ part_dy_xmu, int parts, int64_t rows,
                                int c, const float* __restrict__ gamma,
                                const float* __restrict__ save_invstd, float* __restrict__ dgamma,
                                float* __restrict__ dbeta, float beta_accumulate,
                                float* __restrict__ coef) {
  __shared__ float s_dy[kFinalRows][kFinalLanes], s_dy_xmu[kFinalRows][kFinalLanes];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int ch = blockIdx.x * kFinalLanes + tx;
  float sum_dy = 0.f, sum_dy_xmu = 0.f;
  if (ch < c) {
    for (int p = ty; p < parts; p += kFinalRows) {
      sum_dy += part_dy[int64_t(p) * c + ch];
      sum_dy_xmu += part_dy_xmu[int64_t(p) * c + ch];
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
  const float invstd = save_invstd[ch];
  const float grad_gamma = sum_dy_xmu * invstd, grad_beta = sum_dy;
  if (dgamma) {
    dgamma[ch] = beta_accumulate == 0.f ? grad_gamma : beta_accumulate * dgamma[ch] + grad_gamma;
  }
  if (dbeta) {
    dbeta[ch] = beta_accumulate == 0.f ? grad_beta : beta_accumulate * dbeta[ch] + grad_beta;
  }
  const float m = float(rows);
  coef[ch] = gamma ? gamma[ch] * invstd : invstd;
  coef[c + ch] = sum_dy / m;
  coef[2 * c + ch] = grad_gamma * invstd / m;
}

template <int V>
__global__ void bn_backward_dx_kernel(const float* __restrict__ x, const float* __restrict__ dy,
                                      const float* __restrict__ save_mean,
                                      const float* __restrict__ coef, float* __restrict__ dx,
                                      int64_t rows, int c) {
  const int channel = (blockIdx.x * blockDim.x + threadIdx.x) * V;
  if (channel >= c) return;
  float mean[V], k_[V], a[V], b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    mean[k] = save_mean[channel + k];
    k_[k] = coef[channel + k];
    a[k] = coef[c + channel + k];
    b[k] = coef[2 * c + channel + k];
  }
  const int64_t step = int64_t(blockDim.y) * gridDim.y;
  int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  for (; r + (kUnroll - 1) * step < rows; r += kUnroll * step) {
    float xv[kUnroll][V], gv[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load<V>(x + (r + u * step) * c + channel, xv[u]);
      load<V>(dy + (r + u * step) * c + channel, gv[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        gv[u][k] = k_[k] * fmaf(mean[k] - xv[u][k], b[k], gv[u][k] - a[k]);
      store<V>(dx + (r + u * step) * c + channel, gv[u]);
    }
  }
  for (; r < rows; r += step) {
    float xv[V], gv[V];
    load<V>(x + r * c + channel, xv);
    load<V>(dy + r * c + channel, gv);
#pragma unroll
    for (int k = 0; k < V; ++k) gv[k] = k_[k] * fmaf(mean[k] - xv[k], b[k], gv[k] - a[k]);
    store<V>(dx + r * c + channel, gv);
  }
}

// ---- host side ----------------------------------------------------------------------------------

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
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

template <int V>
void forward_train(const float* x, float* y, const float* gamma, const float* beta,
                   float* running_mean, float* running_var, float* save_mean, float* save_invstd,
                   int64_t rows, int c, float momentum, float eps, cudaStream_t stream) {
  // Shared memory per thread: its count and V means and M2s.
  const Plan stats = make_plan(bn_stats_kernel<V>, rows, c, V, (1 + 2 * V) * sizeof(float));
  const int parts = int(stats.grid.y);
  Workspace ws((size_t(parts) * (2 * c + 1) + 4 * size_t(c)) * sizeof(float), stream,
               "batch norm's partial statistics");
  float* part_mean = ws.get();
  float* part_m2 = part_mean + size_t(parts) * c;
  float* part_n = part_m2 + size_t(parts) * c;
  float* coef = part_n + parts;
  launch("bn_stats_kernel", bn_stats_kernel<V>, stats.grid, stats.block, stats.shared_bytes, stream,
         x, rows, c, part_n, part_mean, part_m2);
  launch("bn_stats_finalize_kernel", bn_stats_finalize_kernel, finalize_grid(c), kFinalBlock, 0,
         stream, x, part_n, part_mean, part_m2, parts, rows, c, gamma, beta, running_mean,
         running_var, save_mean, save_invstd, momentum, eps, coef);
  const Plan apply = make_plan(bn_apply_kernel<V, false>, rows, c, V, 0);
  const ApplyParams params{coef, coef + c, coef + 2 * c, nullptr, coef + 3 * c, 0.f};
  launch("bn_apply_kernel", bn_apply_kernel<V, false>, apply.grid, apply.block, 0, stream, x, y,
         rows, c, params);
}

template <int V>
void backward(const float* x, const float* dy, const float* gamma, const float* save_mean,
              const float* save_invstd, float* dx, float* dgamma, float* dbeta, int64_t rows, int c,
              float beta_accumulate, cudaStream_t stream) {
  const Plan reduce = make_plan(bn_backward_reduce_kernel<V>, rows, c, V, 2 * V * sizeof(float));
  const int parts = int(reduce.grid.y);
  Workspace ws((size_t(parts) * 2 * c + 3 * size_t(c)) * sizeof(float), stream,
               "batch norm's partial gradient sums");
  float* part_dy = ws.get();
  float* part_dy_xmu = part_dy + size_t(parts) * c;
  float* coef = part_dy_xmu + size_t(parts) * c;
  launch("bn_backward_reduce_kernel", bn_backward_reduce_kernel<V>, reduce.grid, reduce.block,
         reduce.shared_bytes, stream, x, dy, save_mean, rows, c, part_dy, part_dy_xmu);
  launch("bn_backward_finalize_kernel", bn_backward_finalize_kernel, finalize_grid(c), kFinalBlock,
         0, stream, part_dy, part_dy_xmu, parts, rows, c, gamma, save_invstd, dgamma, dbeta,
         beta_accumulate, coef);
  const Plan apply = make_plan(bn_backward_dx_kernel<V>, rows, c, V, 0);
  launch("bn_backward_dx_kernel", bn_backward_dx_kernel<V>, apply.grid, apply.block, 0, stream, x,
         dy, save_mean, coef, dx, rows, c);
}

}  // namespace

void batchnorm_forward_train(const float* x, float* y, const float* gamma, const float* beta,
                             float* running_mean, float* running_var, float* save_mean,
                             float* save_invstd, int64_t rows, int c, float momentum, float eps,
                             cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_forward_train", rows, c, true);
  if (c % 4 == 0 && aligned16(x) && aligned16(y)) {
    forward_train<4>(x, y, gamma, beta, running_mean, running_var, save_mean, save_invstd, rows, c,
                     momentum, eps, stream);
  } else {
    forward_train<1>(x, y, gamma, beta, running_mean, running_var, save_mean, save_invstd, rows, c,
                     momentum, eps, stream);
  }
}

void batchnorm_forward_eval(const float* x, float* y, const float* gamma, const float* beta,
                            const float* running_mean, const float* running_var, int64_t rows,
                            int c, float eps, cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_forward_eval", rows, c, false);
  CUDP_CHECK(running_mean && running_var,
             "batchnorm_forward_eval: needs running_mean and running_var");
  if (rows == 0) return;
  auto run = [&]<int V>() {
    const Plan apply = make_plan(bn_apply_kernel<V, true>, rows, c, V, 0);
    const ApplyParams params{running_mean, nullptr, running_var, gamma, beta, eps};
    launch("bn_apply_kernel", bn_apply_kernel<V, true>, apply.grid, apply.block, 0, stream, x, y,
           rows, c, params);
  };
  if (c % 4 == 0 && aligned16(x) && aligned16(y)) {
    run.template operator()<4>();
  } else {
    run.template operator()<1>();
  }
}

void batchnorm_backward(const float* x, const float* dy, const float* gamma, const float* save_mean,
                        const float* save_invstd, float* dx, float* dgamma, float* dbeta,
                        int64_t rows, int c, float beta_accumulate, cudaStream_t stream) {
  detail::check_batchnorm("batchnorm_backward", rows, c, true);
  CUDP_CHECK(save_mean && save_invstd,
             "batchnorm_backward: needs save_mean and save_invstd from the training forward");
  if (c % 4 == 0 && aligned16(x) && aligned16(dy) && aligned16(dx)) {
    backward<4>(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta, rows, c, beta_accumulate,
                stream);
  } else {
    backward<1>(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta, rows, c, beta_accumulate,
                stream);
  }
}

}  // namespace cudp::kernels
