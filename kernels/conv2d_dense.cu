// The dense 2 x 2 form's kernels (kernels/conv2d_dense.h): W_eff gathered from the filters, 16
// bytes a thread, and dW_eff folded back into the filters' gradient, four channels a thread. Both
// are passes over memory (8 MB of W_eff, 16 MB of dW_eff for a layer of 512 channels); the products
// between them are kernels::matmul's.
#include <atomic>
#include <cstdint>

#include "engine/core/launch.cuh"
#include "kernels/conv2d_dense.h"

namespace cudp::kernels {
namespace {

constexpr int kThreads = 256;

// 8 channels of one filter row as bf16: 16 bytes as they are, or 32 bytes of fp32 rounded to
// nearest even (cvt.rn.bf16x2.f32, f32_to_bf16's rounding).
__device__ __forceinline__ uint4 load8(const __nv_bfloat16* src) {
  return *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ uint4 load8(const float* src) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  uint4 out;
  const __nv_bfloat162 h[4] = {
      __float22bfloat162_rn(make_float2(a.x, a.y)), __float22bfloat162_rn(make_float2(a.z, a.w)),
      __float22bfloat162_rn(make_float2(b.x, b.y)), __float22bfloat162_rn(make_float2(b.z, b.w))};
  static_assert(sizeof h == sizeof out);
  memcpy(&out, h, sizeof out);
  return out;
}

// One thread a 16-byte chunk of W_eff: row p K + k, columns q C + c .. + 7. The first 4K threads
// also write bias_eff.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dense_2x2_filters_kernel(const T* w, int K, int C, __nv_bfloat16* w_eff, const float* bias,
                             float* bias_eff) {
  kernel_entry();
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t chunks_per_row = C / 2;  // 4C / 8
  if (t >= int64_t(4) * K * chunks_per_row) return;
  const int64_t row = t / chunks_per_row;
  const int col = static_cast<int>(t - row * chunks_per_row) * 8;
  const int p = static_cast<int>(row / K), k = static_cast<int>(row - int64_t(p) * K);
  const int q = col / C, c = col - q * C;
  const T* src = w + (int64_t(k) * 9 + dense_2x2_tap(p, q)) * C + c;
  *reinterpret_cast<uint4*>(w_eff + row * 4 * C + col) = load8(src);
  if (bias != nullptr && t < int64_t(4) * K) bias_eff[t] = bias[t % K];
}

// One thread four channels of one tap of one filter: the tap's blocks of dW_eff in the order of p.
__global__ void __launch_bounds__(kThreads)
    dense_2x2_fold_kernel(const float* dw_eff, int K, int C, float* dw, float beta) {
  kernel_entry();
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int quads = C / 4;
  if (t >= int64_t(K) * 9 * quads) return;
  const int64_t filter_tap = t / quads;  // k * 9 + tap
  const int c = static_cast<int>(t - filter_tap * quads) * 4;
  const int k = static_cast<int>(filter_tap / 9), tap = static_cast<int>(filter_tap - k * 9);
  const int dr = tap / 3 - 1, ds = tap % 3 - 1;  // q = p + (dr, ds)
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const int qy = (p >> 1) + dr, qx = (p & 1) + ds;
    if (qy < 0 || qy > 1 || qx < 0 || qx > 1) continue;
    const int q = qy * 2 + qx;
    const float4 v = *reinterpret_cast<const float4*>(dw_eff + (int64_t(p) * K + k) * 4 * C +
                                                      int64_t(q) * C + c);
    sum.x = __fadd_rn(sum.x, v.x);
    sum.y = __fadd_rn(sum.y, v.y);
    sum.z = __fadd_rn(sum.z, v.z);
    sum.w = __fadd_rn(sum.w, v.w);
  }
  float4* out = reinterpret_cast<float4*>(dw + filter_tap * C + c);
  if (beta != 0.f) {
    const float4 old = *out;
    sum = make_float4(fmaf(beta, old.x, sum.x), fmaf(beta, old.y, sum.y), fmaf(beta, old.z, sum.z),
                      fmaf(beta, old.w, sum.w));
  }
  *out = sum;
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

template <typename T>
void run_filters(const T* w, const Conv2dShape& shape, __nv_bfloat16* w_eff, const float* bias,
                 float* bias_eff, cudaStream_t stream) {
  detail::check_conv2d_dense_2x2("conv2d_dense_2x2_filters", shape);
  CUDP_CHECK(w != nullptr && w_eff != nullptr && (bias == nullptr || bias_eff != nullptr),
             "conv2d_dense_2x2_filters: w, w_eff (and bias_eff, with a bias) must not be null");
  CUDP_CHECK(aligned16(w) && aligned16(w_eff),
             "conv2d_dense_2x2_filters: w and w_eff must be 16-byte aligned (they are read and "
             "written 16 bytes a thread)");
  const int64_t threads = int64_t(4) * shape.k * (shape.c / 2);
  launch("dense_2x2_filters_kernel", dense_2x2_filters_kernel<T>, dim3(grid_for(threads, kThreads)),
         dim3(kThreads), 0, stream, w, shape.k, shape.c, w_eff, bias, bias_eff);
}

std::atomic<bool> g_dense_2x2{true};
std::atomic<int> g_dense_2x2_splits{0};  // the planner's
std::atomic<int> g_dense_2x2_tile{0};    // the planner's
std::atomic<bool> g_dense_2x2_view{true};

}  // namespace

void conv2d_dense_2x2_filters(const __nv_bfloat16* w, const Conv2dShape& shape,
                              __nv_bfloat16* w_eff, const float* bias, float* bias_eff,
                              cudaStream_t stream) {
  run_filters(w, shape, w_eff, bias, bias_eff, stream);
}

void conv2d_dense_2x2_filters(const float* w, const Conv2dShape& shape, __nv_bfloat16* w_eff,
                              const float* bias, float* bias_eff, cudaStream_t stream) {
  run_filters(w, shape, w_eff, bias, bias_eff, stream);
}

void conv2d_dense_2x2_fold(const float* dw_eff, const Conv2dShape& shape, float* dw, float beta,
                           cudaStream_t stream) {
  detail::check_conv2d_dense_2x2("conv2d_dense_2x2_fold", shape);
  CUDP_CHECK(dw_eff != nullptr && dw != nullptr,
             "conv2d_dense_2x2_fold: dw_eff and dw must not be null");
  CUDP_CHECK(aligned16(dw_eff) && aligned16(dw),
             "conv2d_dense_2x2_fold: dw_eff and dw must be 16-byte aligned (they are read and "
             "written four floats a thread)");
  const int64_t threads = int64_t(shape.k) * 9 * (shape.c / 4);
  launch("dense_2x2_fold_kernel", dense_2x2_fold_kernel, dim3(grid_for(threads, kThreads)),
         dim3(kThreads), 0, stream, dw_eff, shape.k, shape.c, dw, beta);
}

namespace detail {
void set_conv_dense_2x2(bool on) {
  g_dense_2x2.store(on);
}
bool conv_dense_2x2() {
  return g_dense_2x2.load();
}
void set_conv_dense_2x2_view(bool on) {
  g_dense_2x2_view.store(on);
}
bool conv_dense_2x2_view() {
  return g_dense_2x2_view.load();
}
void set_conv_dense_2x2_splits(int splits) {
  CUDP_CHECK(splits >= 0, "set_conv_dense_2x2_splits: splits must be >= 0 (0: the planner's), got ",
             splits);
  g_dense_2x2_splits.store(splits);
}
int conv_dense_2x2_splits() {
  return g_dense_2x2_splits.load();
}
void set_conv_dense_2x2_tile(int tile_n) {
  CUDP_CHECK(tile_n == 0 || tile_n == 64 || tile_n == 128 || tile_n == 256,
             "set_conv_dense_2x2_tile: the tile width must be 64, 128 or 256 (0: the planner's), "
             "got ",
             tile_n);
  g_dense_2x2_tile.store(tile_n);
}
int conv_dense_2x2_tile() {
  return g_dense_2x2_tile.load();
}
void conv_dense_2x2_matmul(const MatmulProblem& problem, cudaStream_t stream) {
  const int splits = g_dense_2x2_splits.load(), tile_n = g_dense_2x2_tile.load();
  if (splits == 0 && tile_n == 0) {
    matmul(problem, stream);
    return;
  }
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const MatmulPlan planned = plan_matmul(problem, device);
  const int tile = tile_n != 0 ? tile_n : planned.tile_n;
  const int count = splits != 0 ? splits : tile == planned.tile_n ? planned.splits : 1;
  matmul_with_plan(problem, make_matmul_plan(problem, tile, count, multiprocessor_count(device)),
                   stream);
}
}  // namespace detail

}  // namespace cudp::kernels
