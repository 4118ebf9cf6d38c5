// One templated kernel serves every op of elementwise.h: out[i] = op(a[i], b[i]) (b unused by the
// one-input ops), float4 over the aligned body and scalars over the head and tail that
// detail::vector_split() computes. Loads are plain (not __ldg): outputs may alias inputs.
#include <cuda_bf16.h>

#include <type_traits>

#include "engine/core/launch.cuh"
#include "kernels/elementwise.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops: enough blocks to fill any GPU many times over, no more than the work needs.
constexpr unsigned kMaxBlocks = 65535;

struct Relu {
  __device__ float operator()(float x, float) const { return detail::relu(x); }
};
struct ReluGrad {
  __device__ float operator()(float y, float dy) const { return detail::relu_grad(y, dy); }
};
struct Scale {
  float alpha;
  __device__ float operator()(float x, float) const { return alpha * x; }
};
struct Axpy {
  float alpha;
  __device__ float operator()(float x, float y) const { return detail::axpy(alpha, x, y); }
};
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};

template <typename Op>
__device__ __forceinline__ float4 apply4(const Op& op, const float4& a, const float4& b) {
  return make_float4(op(a.x, b.x), op(a.y, b.y), op(a.z, b.z), op(a.w, b.w));
}

// Elements [0, head) and [head + 4 * vectors, n) one at a time; [head, head + 4 * vectors) as
// float4.
template <int kInputs, typename Op>
__global__ void map_kernel(Op op, const float* a, const float* b, float* out, int64_t n,
                           int64_t head, int64_t vectors) {
  kernel_entry();
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const auto* a4 = reinterpret_cast<const float4*>(a + head);
  const auto* b4 = reinterpret_cast<const float4*>(b + head);
  auto* out4 = reinterpret_cast<float4*>(out + head);
  for (int64_t v = start; v < vectors; v += stride) {
    const float4 x = a4[v];
    if constexpr (kInputs == 2) {
      out4[v] = apply4(op, x, b4[v]);
    } else {
      out4[v] = apply4(op, x, x);
    }
  }
  for (int64_t i = start; i < head; i += stride) {
    out[i] = op(a[i], kInputs == 2 ? b[i] : 0.0f);
  }
  for (int64_t i = head + 4 * vectors + start; i < n; i += stride) {
    out[i] = op(a[i], kInputs == 2 ? b[i] : 0.0f);
  }
}

// bf16 storage, float arithmetic: [head, head + 4 * vectors) as 4 bf16 (8 bytes) per access.
// The ops used on bf16 (ReLU and its gradient) return one of their inputs or 0, so rounding the
// result back to bf16 is exact.
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 q = *reinterpret_cast<const uint2*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&q);
  const float2 lo = __bfloat1622float2(h[0]), hi = __bfloat1622float2(h[1]);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float4& v) {
  uint2 q;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&q);
  h[0] = __floats2bfloat162_rn(v.x, v.y);
  h[1] = __floats2bfloat162_rn(v.z, v.w);
  *reinterpret_cast<uint2*>(p) = q;
}

template <int kInputs, typename Op>
__global__ void map_kernel_bf16(Op op, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                __nv_bfloat16* out, int64_t n, int64_t head, int64_t vectors) {
  kernel_entry();
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = start; v < vectors; v += stride) {
    const int64_t i = head + 4 * v;
    const float4 x = load4(a + i);
    store4(out + i, apply4(op, x, kInputs == 2 ? load4(b + i) : x));
  }
  auto scalar = [&](int64_t i) {
    const float y = kInputs == 2 ? __bfloat162float(b[i]) : 0.0f;
    out[i] = __float2bfloat16_rn(op(__bfloat162float(a[i]), y));
  };
  for (int64_t i = start; i < head; i += stride) scalar(i);
  for (int64_t i = head + 4 * vectors + start; i < n; i += stride) scalar(i);
}

// One launcher for both element types: the split into an aligned body of 4-element vectors (16
// bytes of floats, 8 of bf16) and scalar ends, then the type's kernel.
template <int kInputs, typename Op, typename T>
void run(const char* name, Op op, const T* a, const std::type_identity_t<T>* b, T* out, int64_t n,
         cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  constexpr int size = sizeof(T);
  const detail::VectorSplit split =
      kInputs == 2 ? detail::vector_split(n, {{a, size}, {b, size}, {out, size}})
                   : detail::vector_split(n, {{a, size}, {out, size}});
  const int64_t work = std::max(split.vectors, n - 4 * split.vectors);
  const unsigned blocks = std::min(grid_for(work, kThreads), kMaxBlocks);
  if constexpr (size == 4) {
    launch(name, map_kernel<kInputs, Op>, blocks, kThreads, 0, stream, op, a, kInputs == 2 ? b : a,
           out, n, split.head, split.vectors);
  } else {
    launch(name, map_kernel_bf16<kInputs, Op>, blocks, kThreads, 0, stream, op, a,
           kInputs == 2 ? b : a, out, n, split.head, split.vectors);
  }
}

// zero_ranges: up to kRangesPerLaunch ranges per launch, passed by value (1 KiB of parameters);
// blockIdx.y picks the range, a grid-stride loop over x covers it.
constexpr int kRangesPerLaunch = 64;
struct RangeBatch {
  int64_t begin[kRangesPerLaunch];
  int64_t end[kRangesPerLaunch];
};

__global__ void zero_ranges_kernel(float* base, RangeBatch batch) {
  kernel_entry();
  const int64_t begin = batch.begin[blockIdx.y], end = batch.end[blockIdx.y];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < end; i += stride) {
    base[i] = 0.0f;
  }
}

struct SpanBatch {
  const float* data[kRangesPerLaunch];
  int64_t size[kRangesPerLaunch];
  int64_t flag[kRangesPerLaunch];  // the span's index among all: its flag
};

// blockIdx.y picks the span; any thread that meets a NaN or an infinity sets its flag (every
// writer writes 1: the result does not depend on which).
__global__ void flag_non_finite_kernel(SpanBatch batch, int* flags) {
  kernel_entry();
  const float* v = batch.data[blockIdx.y];
  const int64_t n = batch.size[blockIdx.y];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    bad = bad || !isfinite(v[i]);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) flags[batch.flag[blockIdx.y]] = 1;
}

}  // namespace

namespace {

// Runs `count` items in launches of at most kRangesPerLaunch (zero_ranges, flag_non_finite): fill(
// batch, slot, item) puts item into a Batch's slot and returns its length; launch_batch(batch,
// grid) launches one batch on (blocks for the longest item, capped) x (items in the batch) blocks.
// A batch whose items are all empty launches nothing.
template <typename Batch, typename Fill, typename Launch>
void in_batches(int64_t count, Fill&& fill, Launch&& launch_batch) {
  for (int64_t first = 0; first < count; first += kRangesPerLaunch) {
    Batch batch{};
    const int64_t in_batch = std::min<int64_t>(kRangesPerLaunch, count - first);
    int64_t longest = 0;
    for (int64_t i = 0; i < in_batch; ++i) longest = std::max(longest, fill(batch, i, first + i));
    if (longest == 0) continue;
    launch_batch(batch,
                 dim3(std::min(grid_for(longest, kThreads), kMaxBlocks), unsigned(in_batch)));
  }
}

}  // namespace

void flag_non_finite(const FloatSpan* spans, int64_t count, int* flags, cudaStream_t stream) {
  detail::check_spans("flag_non_finite", spans, count, flags);
  in_batches<SpanBatch>(
      count,
      [&](SpanBatch& batch, int64_t slot, int64_t item) {
        batch.data[slot] = spans[item].data;
        batch.size[slot] = spans[item].size;
        batch.flag[slot] = item;
        return batch.size[slot];
      },
      [&](const SpanBatch& batch, dim3 grid) {
        launch("flag_non_finite", flag_non_finite_kernel, grid, kThreads, 0, stream, batch, flags);
      });
}

void zero_ranges(float* base, const FloatRange* ranges, int64_t count, cudaStream_t stream) {
  detail::check_zero_ranges("zero_ranges", base, ranges, count);
  in_batches<RangeBatch>(
      count,
      [&](RangeBatch& batch, int64_t slot, int64_t item) {
        batch.begin[slot] = ranges[item].begin;
        batch.end[slot] = ranges[item].end;
        return batch.end[slot] - batch.begin[slot];
      },
      [&](const RangeBatch& batch, dim3 grid) {
        launch("zero_ranges", zero_ranges_kernel, grid, kThreads, 0, stream, base, batch);
      });
}

void relu_forward(const float* x, float* y, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("relu_forward", n, {x, y});
  run<1>("relu_forward", Relu{}, x, nullptr, y, n, stream);
}

void relu_forward(const __nv_bfloat16* x, __nv_bfloat16* y, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("relu_forward", n, {x, y});
  run<1>("relu_forward", Relu{}, x, nullptr, y, n, stream);
}

void relu_backward(const __nv_bfloat16* y, const __nv_bfloat16* dy, __nv_bfloat16* dx, int64_t n,
                   cudaStream_t stream) {
  detail::check_elementwise("relu_backward", n, {y, dy, dx});
  run<2>("relu_backward", ReluGrad{}, y, dy, dx, n, stream);
}

void relu_backward(const float* y, const float* dy, float* dx, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("relu_backward", n, {y, dy, dx});
  run<2>("relu_backward", ReluGrad{}, y, dy, dx, n, stream);
}

void scale(float* x, float alpha, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("scale", n, {x});
  run<1>("scale", Scale{alpha}, x, nullptr, x, n, stream);
}

void axpy(float alpha, const float* x, float* y, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("axpy", n, {x, y});
  run<2>("axpy", Axpy{alpha}, x, y, y, n, stream);
}

void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  detail::check_elementwise("add", n, {a, b, out});
  run<2>("add", Add{}, a, b, out, n, stream);
}

}  // namespace cudp::kernels
