// bias_add: a grid-stride pass over y (float4 when cols % 4 == 0 and y, bias are 16-byte aligned).
// Each thread's column advances by the same amount (stride mod cols) at every step, so no division
// is needed inside the loop.
//
// bias_grad: the two-stage deterministic column reduction described in bias.h.
#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>

#include "engine/core/device.h"
#include "engine/core/launch.cuh"
#include "kernels/bias.h"
#include "kernels/elementwise.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;
// Stage 1 of bias_grad: at most this many blocks (about one wave on an H100/H200: 132 SMs x 8
// blocks of 256 threads), and at least this many rows per thread before the rows are cut further.
// (16 rows left VGG's small layers at 32^2 with 16 blocks and ~18 us a pass, latency-bound: the
// mask and bias pass of a 2x2x512 layer at batch 256.)
constexpr int64_t kMaxChunkBlocks = 1024;
constexpr int64_t kMinRowsPerThread = 4;
// Stage 2: tiles of 32 columns x 32 lanes over the chunks' partial sums.
constexpr int kTile = 32;

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
bool aligned16(const void* p) {
  return detail::aligned(p, 16);
}

template <int V>
__device__ __forceinline__ void load(const float* p, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
    v[0] = __ldg(p);
  }
}

template <int V>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float (&v)[V]) {
  if constexpr (V == 8) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  } else if constexpr (V == 4) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&q);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    v[0] = a.x;
    v[1] = a.y;
    v[2] = b.x;
    v[3] = b.y;
  } else {
    v[0] = __bfloat162float(__ldg(p));
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

// Exact: every v is a bf16 value (a masked bf16 input), so the conversion does not round.
template <int V>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float (&v)[V]) {
  if constexpr (V == 8) {
    uint4 q;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = q;
  } else if constexpr (V == 4) {
    uint2 q;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&q);
    h[0] = __floats2bfloat162_rn(v[0], v[1]);
    h[1] = __floats2bfloat162_rn(v[2], v[3]);
    *reinterpret_cast<uint2*>(p) = q;
  } else {
    *p = __float2bfloat16_rn(v[0]);
  }
}

// y viewed as `vectors` groups of V floats, cols_v groups per row.
template <int V>
__global__ void bias_add_kernel(float* y, const float* bias, int64_t vectors, int64_t cols_v,
                                int64_t stride_mod) {
  kernel_entry();
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t c = start % cols_v;
  for (int64_t v = start; v < vectors; v += stride) {
    float b[V];
    load<V>(bias + c * V, b);
    if constexpr (V == 4) {
      auto* p = reinterpret_cast<float4*>(y) + v;
      float4 q = *p;
      q.x += b[0];
      q.y += b[1];
      q.z += b[2];
      q.w += b[3];
      *p = q;
    } else {
      y[v] += b[0];
    }
    c += stride_mod;
    if (c >= cols_v) {
      c -= cols_v;
    }
  }
}

// Stage 1. Block (blockIdx.x, blockIdx.y) sums rows [x * chunk_rows, (x + 1) * chunk_rows) of the
// column groups [y * width, (y + 1) * width) (groups of V columns). Thread t works on group
// t % width down the rows lane, lane + lanes, ... with lane = t / width; the lanes are then added
// in order through shared memory. `final` (only with one chunk): write beta * dbias + sum into out;
// otherwise write the chunk's sums to row x of the [chunks, cols] workspace `out`.
// With `y` (a fused ReLU's output), each dy element is first masked (relu_grad: y > 0 ? dy : 0) and
// written to `masked`; the sums are the masked values'. `out` may be null then (the mask alone).
// M, the masked output's type: T, or bf16 from float (rounded to nearest even as it is stored; the
// sums are the fp32 masked values').
template <int V, typename T, typename M>
__global__ void bias_grad_chunk_kernel(const T* dy, const T* y, M* masked, float* out, int64_t rows,
                                       int64_t cols, int64_t chunk_rows, int width, int lanes,
                                       float beta, bool final) {
  kernel_entry();
  __shared__ float sums[V][kThreads];
  const int lane = static_cast<int>(threadIdx.x) / width;
  const int group = static_cast<int>(threadIdx.x) % width;
  const int64_t cv = int64_t(blockIdx.y) * width + group;  // column group, V columns each
  const int64_t chunk = blockIdx.x;
  float acc[V] = {};
  if (lane < lanes && cv < cols / V) {
    const int64_t end = std::min(rows, (chunk + 1) * chunk_rows);
    const int64_t step = int64_t(lanes) * cols;
    const int64_t first = (chunk * chunk_rows + lane) * cols + cv * V;
    const T* p = dy + first;
#pragma unroll 4
    for (int64_t r = chunk * chunk_rows + lane; r < end; r += lanes, p += step) {
      float v[V];
      load<V>(p, v);
      if (y != nullptr) {
        const int64_t at = p - dy;
        float yv[V];
        load<V>(y + at, yv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          v[k] = detail::relu_grad(yv[k], v[k]);
        }
        store<V>(masked + at, v);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        acc[k] += v[k];
      }
    }
  }
  if (out == nullptr) {
    return;  // uniform across the block: no thread reaches the barrier below
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    sums[k][threadIdx.x] = acc[k];
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < width && cv < cols / V) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float s = sums[k][threadIdx.x];
      for (int l = 1; l < lanes; ++l) {
        s += sums[k][l * width + threadIdx.x];
      }
      const int64_t c = cv * V + k;
      if (final) {
        out[c] = beta == 0.0f ? s : fmaf(beta, out[c], s);
      } else {
        out[chunk * cols + c] = s;
      }
    }
  }
}

// Stage 2 for tile `tile` of 32 columns: column c = tile * 32 + threadIdx.x; lane threadIdx.y
// sums chunks y, y + 32, ...; the 32 lanes are added in order.
__device__ __forceinline__ void final_columns(float (&sums)[kTile][kTile + 1], const float* partial,
                                              float* dbias, int64_t chunks, int64_t cols,
                                              float beta, int64_t tile) {
  const int64_t c = tile * kTile + threadIdx.x;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t g = threadIdx.y; g < chunks; g += kTile) {
      s += partial[g * cols + c];
    }
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = sums[0][threadIdx.x];
    for (int l = 1; l < kTile; ++l) {
      total += sums[l][threadIdx.x];
    }
    dbias[c] = beta == 0.0f ? total : fmaf(beta, dbias[c], total);
  }
}

__global__ void bias_grad_final_kernel(const float* partial, float* dbias, int64_t chunks,
                                       int64_t cols, float beta) {
  kernel_entry();
  __shared__ float sums[kTile][kTile + 1];
  final_columns(sums, partial, dbias, chunks, cols, beta, blockIdx.x);
}

// Queued stage-2 launches (NOTE [Deferred bias gradients]): job j takes blocks first_block up to
// the next job's, each a tile of its columns, with bias_grad_final_kernel's arithmetic.
struct FinalJob {
  const float* partial;
  float* dbias;
  int64_t chunks;
  int64_t cols;
  float beta;
  unsigned first_block;
};
constexpr int kMaxFinalJobs = 48;  // 1.9 KB of kernel parameters
struct FinalJobs {
  int count;
  FinalJob job[kMaxFinalJobs];
};

__global__ void bias_grad_final_batch_kernel(const __grid_constant__ FinalJobs jobs) {
  kernel_entry();
  __shared__ float sums[kTile][kTile + 1];
  int j = 0;
  while (j + 1 < jobs.count && jobs.job[j + 1].first_block <= blockIdx.x) ++j;
  const FinalJob& job = jobs.job[j];
  final_columns(sums, job.partial, job.dbias, job.chunks, job.cols, job.beta,
                blockIdx.x - job.first_block);
}

template <int V>
void bias_add_impl(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t cols_v = cols / V;
  const int64_t vectors = rows * cols_v;
  const unsigned blocks = std::min(grid_for(vectors, kThreads), kMaxBlocks);
  const int64_t stride_mod = (int64_t(blocks) * kThreads) % cols_v;
  launch("bias_add_kernel", bias_add_kernel<V>, blocks, kThreads, 0, stream, y, bias, vectors,
         cols_v, stride_mod);
}

template <int V, typename T, typename M>
void bias_grad_impl(const T* dy, const T* y, M* masked, float* dbias, int64_t rows, int64_t cols,
                    float beta, cudaStream_t stream, bool deferrable) {
  const int64_t cols_v = cols / V;
  const int width = static_cast<int>(std::min<int64_t>(cols_v, kThreads));
  const int lanes = kThreads / width;
  const int64_t tiles = ceil_div(cols_v, width);
  CUDP_CHECK(tiles <= 65535, "bias_grad: cols = ", cols, " is more than this kernel supports (",
             int64_t(65535) * kThreads * V, ")");
  // The chunking depends on the shape only, so the summation order (and the result) is fixed.
  int64_t chunks = std::clamp<int64_t>(ceil_div(rows, lanes * kMinRowsPerThread), 1,
                                       std::max<int64_t>(1, kMaxChunkBlocks / tiles));
  const int64_t chunk_rows = std::max<int64_t>(1, ceil_div(rows, chunks));
  chunks = std::max<int64_t>(1, ceil_div(rows, chunk_rows));  // no empty chunk
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(tiles));
  if (chunks == 1 || dbias == nullptr) {
    // This launch writes dbias itself: after any queued sum into it. (With chunks, the second
    // stage's bias_grad_from_partials orders itself.)
    if (dbias != nullptr) detail::flush_deferred_bias_grads_into(dbias, stream);
    launch("bias_grad_chunk_kernel", bias_grad_chunk_kernel<V, T, M>, grid, kThreads, 0, stream, dy,
           y, masked, dbias, rows, cols, chunk_rows, width, lanes, beta, true);
    return;
  }
  Workspace ws(static_cast<size_t>(chunks * cols) * sizeof(float), stream,
               "the bias gradient's partial column sums");
  launch("bias_grad_chunk_kernel", bias_grad_chunk_kernel<V, T, M>, grid, kThreads, 0, stream, dy,
         y, masked, ws.get(), rows, cols, chunk_rows, width, lanes, beta, false);
  if (deferrable) {
    bias_grad_from_partials(std::move(ws), dbias, chunks, cols, beta, stream);  // or queued
    return;
  }
  bias_grad_from_partials(ws.get(), dbias, chunks, cols, beta, stream);
  ws.release();
}

template <typename T, typename M = T>
void bias_grad_dispatch(const T* dy, const T* y, std::type_identity_t<M>* masked, float* dbias,
                        int64_t rows, int64_t cols, float beta, cudaStream_t stream,
                        bool deferrable = false) {
  if (cols == 0) {
    return;
  }
  // bf16: 8 elements (16 bytes) per access where the rows allow it.
  auto vec_ok = [&]<int V>() {
    return cols % V == 0 && detail::aligned<V * sizeof(T)>(dy) &&
           (y == nullptr || detail::aligned<V * sizeof(T)>(y)) &&
           (masked == nullptr || detail::aligned<V * sizeof(M)>(masked));
  };
  const bool vec = vec_ok.template operator()<4>();
  if constexpr (sizeof(T) == 2) {
    if (vec_ok.template operator()<8>()) {
      bias_grad_impl<8, T, M>(dy, y, masked, dbias, rows, cols, beta, stream, deferrable);
      return;
    }
  }
  if (vec) {
    bias_grad_impl<4, T, M>(dy, y, masked, dbias, rows, cols, beta, stream, deferrable);
  } else {
    bias_grad_impl<1, T, M>(dy, y, masked, dbias, rows, cols, beta, stream, deferrable);
  }
}

}  // namespace

namespace {

// A grid's x dimension: the most blocks one launch (and one batch of queued sums) may have.
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1;

void check_partials(const float* partial, const float* dbias, int64_t chunks, int64_t cols) {
  CUDP_CHECK(chunks >= 1 && cols >= 0, "bias_grad_from_partials: invalid size ", chunks, " x ",
             cols);
  CUDP_CHECK(cols == 0 || (partial && dbias),
             "bias_grad_from_partials: partial and dbias must not be null");
  CUDP_CHECK(ceil_div(cols, kTile) <= kMaxGridX, "bias_grad_from_partials: cols = ", cols,
             " is too many");
}

std::atomic<bool> g_deferred{true};

// A thread's queue: the outermost active scope's device and stream, its sums, their partials and
// the blocks their launch will take. One per thread for the thread's life, its capacity reserved
// once (no allocation per backward); t_queue points to it while a scope is active. Empty whenever
// no scope is, so its destruction at the thread's exit makes no CUDA call.
struct DeferredQueue {
  DeferredQueue() {
    jobs.reserve(kMaxFinalJobs);
    partials.reserve(kMaxFinalJobs);
  }
  int device = 0;
  cudaStream_t stream = nullptr;
  std::vector<FinalJob> jobs;
  std::vector<Workspace> partials;
  int64_t blocks = 0;

  // Empties the queue, freeing the partials on their stream after what was enqueued on it.
  void drop() {
    jobs.clear();
    partials.clear();
    blocks = 0;
  }
};
thread_local DeferredQueue* t_queue = nullptr;

void flush_queue(DeferredQueue& q) {
  if (q.jobs.empty()) return;
  // The launch and the partials' release on the queue's device, whichever is current.
  const cuda::DeviceGuard guard(q.device);
  FinalJobs batch{};
  unsigned blocks = 0;
  for (const FinalJob& job : q.jobs) {
    batch.job[batch.count] = job;
    batch.job[batch.count++].first_block = blocks;
    blocks += static_cast<unsigned>(ceil_div(job.cols, kTile));
  }
  try {
    launch("bias_grad_final_batch_kernel", bias_grad_final_batch_kernel, blocks, dim3(kTile, kTile),
           0, q.stream, batch);
  } catch (...) {
    q.drop();  // the workspaces freed whether or not the launch was accepted
    throw;
  }
  q.jobs.clear();
  q.blocks = 0;
  for (Workspace& ws : q.partials) ws.release();  // reporting an error, as the single launch does
  q.partials.clear();
}

bool queued_into(const DeferredQueue& q, const float* dbias) {
  return std::any_of(q.jobs.begin(), q.jobs.end(),
                     [&](const FinalJob& job) { return job.dbias == dbias; });
}

// Whether the calling thread's queue takes a launch on `stream`: the same stream of the same
// device (a null or per-thread stream handle names a different stream on each device).
bool queue_takes(const DeferredQueue* q, cudaStream_t stream) {
  if (q == nullptr || q->stream != stream) return false;
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  return device == q->device;
}

}  // namespace

void bias_grad_from_partials(const float* partial, float* dbias, int64_t chunks, int64_t cols,
                             float beta, cudaStream_t stream) {
  check_partials(partial, dbias, chunks, cols);
  if (cols == 0) return;
  detail::flush_deferred_bias_grads_into(dbias, stream);  // after any queued sum into dbias
  launch("bias_grad_final_kernel", bias_grad_final_kernel,
         static_cast<unsigned>(ceil_div(cols, kTile)), dim3(kTile, kTile), 0, stream, partial,
         dbias, chunks, cols, beta);
}

void bias_grad_from_partials(Workspace partials, float* dbias, int64_t chunks, int64_t cols,
                             float beta, cudaStream_t stream) {
  const float* partial = partials.get();
  check_partials(partial, dbias, chunks, cols);
  if (cols == 0) return;
  DeferredQueue* q = t_queue;
  if (!queue_takes(q, stream)) {
    bias_grad_from_partials(partial, dbias, chunks, cols, beta, stream);
    partials.release();
    return;
  }
  const int64_t blocks = ceil_div(cols, kTile);
  if (queued_into(*q, dbias) || q->jobs.size() == size_t(kMaxFinalJobs) ||
      q->blocks + blocks > kMaxGridX) {
    flush_queue(*q);
  }
  // Both vectors hold kMaxFinalJobs already: neither push_back reallocates, so neither throws.
  q->jobs.push_back(FinalJob{partial, dbias, chunks, cols, beta, 0});
  q->partials.push_back(std::move(partials));
  q->blocks += blocks;
}

DeferredBiasGrads::DeferredBiasGrads(int device, cudaStream_t stream) {
  if (t_queue != nullptr || !detail::deferred_bias_grads()) return;
  thread_local DeferredQueue queue;
  queue.device = device;
  queue.stream = stream;
  t_queue = &queue;
  active_ = true;
}

DeferredBiasGrads::~DeferredBiasGrads() {
  if (!active_) return;
  // Unflushed sums are dropped (only an exception leaves a backward without its flush), their
  // workspaces freed on the stream after the kernels that wrote them.
  std::exchange(t_queue, nullptr)->drop();
}

void flush_deferred_bias_grads() {
  if (t_queue != nullptr) flush_queue(*t_queue);
}

namespace detail {
void set_deferred_bias_grads(bool on) {
  g_deferred.store(on);
}
bool deferred_bias_grads() {
  return g_deferred.load();
}
void flush_deferred_bias_grads_into(const float* dbias, cudaStream_t stream) {
  DeferredQueue* q = t_queue;
  if (q == nullptr || !queued_into(*q, dbias)) return;
  flush_queue(*q);
  if (queue_takes(q, stream)) return;
  // A writer on another stream waits for the flush.
  const cuda::DeviceGuard guard(q->device);
  cudaEvent_t flushed = nullptr;
  CUDP_CUDA_CHECK(cudaEventCreateWithFlags(&flushed, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(flushed, q->stream);
  const cudaError_t waited =
      recorded == cudaSuccess ? cudaStreamWaitEvent(stream, flushed, 0) : recorded;
  cudaEventDestroy(flushed);  // released once the wait is resolved
  CUDP_CUDA_CHECK(waited);
}
int deferred_bias_grads_queued() {
  return t_queue ? static_cast<int>(t_queue->jobs.size()) : 0;
}
}  // namespace detail

void bias_add(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  detail::check_bias_args("bias_add", y, bias, rows, cols);
  if (rows == 0 || cols == 0) {
    return;
  }
  if (cols % 4 == 0 && aligned16(y) && aligned16(bias)) {
    bias_add_impl<4>(y, bias, rows, cols, stream);
  } else {
    bias_add_impl<1>(y, bias, rows, cols, stream);
  }
}

void bias_grad(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta,
               cudaStream_t stream) {
  detail::check_bias_args("bias_grad", dy, dbias, rows, cols);
  bias_grad_dispatch<float>(dy, nullptr, nullptr, dbias, rows, cols, beta, stream);
}

void bias_grad(const __nv_bfloat16* dy, float* dbias, int64_t rows, int64_t cols, float beta,
               cudaStream_t stream) {
  detail::check_bias_args("bias_grad", dy, dbias, rows, cols);
  bias_grad_dispatch<__nv_bfloat16>(dy, nullptr, nullptr, dbias, rows, cols, beta, stream);
}

namespace detail {
void bias_grad_deferrable(const float* dy, float* dbias, int64_t rows, int64_t cols, float beta,
                          cudaStream_t stream) {
  check_bias_args("bias_grad", dy, dbias, rows, cols);
  bias_grad_dispatch<float>(dy, nullptr, nullptr, dbias, rows, cols, beta, stream, true);
}
void bias_grad_deferrable(const __nv_bfloat16* dy, float* dbias, int64_t rows, int64_t cols,
                          float beta, cudaStream_t stream) {
  check_bias_args("bias_grad", dy, dbias, rows, cols);
  bias_grad_dispatch<__nv_bfloat16>(dy, nullptr, nullptr, dbias, rows, cols, beta, stream, true);
}
}  // namespace detail

template <typename T>
void relu_mask_bias_grad(const T* y, const T* dy, T* dy_masked, float* dbias, int64_t rows,
                         int64_t cols, float beta, cudaStream_t stream) {
  detail::check_relu_mask_args("relu_mask_bias_grad", y, dy, dy_masked, dbias, rows, cols);
  bias_grad_dispatch<T>(dy, y, dy_masked, dbias, rows, cols, beta, stream);
}

namespace detail {
template <typename T, typename M>
void relu_mask_bias_grad_deferrable(const T* y, const T* dy, M* dy_masked, float* dbias,
                                    int64_t rows, int64_t cols, float beta, cudaStream_t stream) {
  check_relu_mask_args("relu_mask_bias_grad", y, dy, dy_masked, dbias, rows, cols);
  bias_grad_dispatch<T, M>(dy, y, dy_masked, dbias, rows, cols, beta, stream, true);
}
template void relu_mask_bias_grad_deferrable<float, float>(const float*, const float*, float*,
                                                           float*, int64_t, int64_t, float,
                                                           cudaStream_t);
template void relu_mask_bias_grad_deferrable<float, __nv_bfloat16>(const float*, const float*,
                                                                   __nv_bfloat16*, float*, int64_t,
                                                                   int64_t, float, cudaStream_t);
}  // namespace detail

template void relu_mask_bias_grad<float>(const float*, const float*, float*, float*, int64_t,
                                         int64_t, float, cudaStream_t);
template void relu_mask_bias_grad<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*,
                                                 __nv_bfloat16*, float*, int64_t, int64_t, float,
                                                 cudaStream_t);

}  // namespace cudp::kernels
