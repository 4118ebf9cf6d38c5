// Validation, planning, dispatch and the split-K reduction of the tensor-core matmul
// (kernels/matmul.h). The mainloops live in kernels/sm90/ and are compiled for sm_90a only; this
// file is built for every architecture the library targets and calls them only on an sm_90 device.
//
// The plan: tile_m is 128 (two consumer warpgroups); tile_n 256 or 128; splits 1..16. A small
// model estimates each candidate's time on a GPU with `sms` multiprocessors, each running one
// persistent block: the busiest block's work items times the MMA time of one item (plus a fixed
// cost per item for pipeline fill and epilogue), plus the split-K reduction's memory traffic.
// Narrow tiles lose some efficiency (B is re-read for every 128 rows of A instead of 256). The
// model only has to rank candidates; its constants were set from the H200 (see bench/README-gemm.md).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <cuda_bf16.h>

#include "engine/core/launch.cuh"
#include "kernels/bias.h"
#include "kernels/matmul.h"
#include "kernels/matmul_epilogue.cuh"
#include "kernels/sm90/matmul_sm90.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

constexpr int kTileM = 128;
constexpr int kMaxSplits = 16;
constexpr int kMaxSplitsLongK = 128;  // when k is far longer than m and n (backward-weight)
constexpr int64_t kMaxWorkspaceBytes = int64_t(256) << 20;

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0;
};

// Read once per device: the launch path makes no property queries.
const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(device);
  if (it == cache.end()) {
    DeviceInfo info;
    CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device));
    CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device));
    CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
    it = cache.emplace(device, info).first;
  }
  return it->second;
}

int current_device() {
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

int k_block(Math math) { return math == Math::BF16 ? 64 : 32; }

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Estimated seconds for (tile_n, splits); see the file comment.
double estimate(const MatmulProblem& p, int tile_n, int splits, int sms) {
  const int kb = ceil_div(p.k, k_block(p.math));
  const int per_split = ceil_div(kb, splits);
  const int64_t items = int64_t(ceil_div(p.m, kTileM)) * ceil_div(p.n, tile_n) * splits;
  const int64_t per_block = (items + sms - 1) / sms;
  const double peak = (p.math == Math::BF16 ? 790e12 : 400e12) / sms;  // FLOP/s per SM
  const double efficiency = tile_n == 256 ? 1.0 : tile_n == 128 ? 0.88 : 0.7;
  const double item_flops = 2.0 * kTileM * tile_n * double(per_split) * k_block(p.math);
  const double item_overhead = 1.5e-6;  // fill, drain, epilogue
  double seconds = per_block * (item_flops / (peak * efficiency) + item_overhead);
  if (splits > 1) {
    const double bytes = double(p.m) * p.n * (4.0 * splits + dtype_size(p.c_type));
    seconds += bytes / 3.0e12 + 3e-6;
  }
  return seconds;
}

__global__ void splitk_reduce_kernel(const float* __restrict__ ws, int splits, int m, int n,
                                     void* c, int64_t ldc, int c_is_bf16, EpilogueArgs e) {
  kernel_entry();
  const int64_t total = int64_t(m) * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / n);
    const int col = static_cast<int>(i - int64_t(row) * n);
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) sum += ws[int64_t(s) * total + i];  // fixed order
    if (c_is_bf16) {
      auto* dst = static_cast<__nv_bfloat16*>(c) + int64_t(row) * ldc + col;
      const float old = e.beta != 0.f ? __bfloat162float(*dst) : 0.f;
      float v = apply_epilogue(e, sum, old, col);
      if (e.mask != nullptr) v = apply_mask(e, v, int64_t(row) * ldc + col, true);
      *dst = __float2bfloat16_rn(v);
    } else {
      float* dst = static_cast<float*>(c) + int64_t(row) * ldc + col;
      float v = apply_epilogue(e, sum, e.beta != 0.f ? *dst : 0.f, col);
      if (e.mask != nullptr) v = apply_mask(e, v, int64_t(row) * ldc + col, false);
      *dst = v;
    }
  }
}

// The same reduction four columns at a time (n and ldc multiples of 4, C and the workspace aligned
// for it: detail::splitk_reduce4_applies and splitk_reduce check): 16-byte loads of the workspace
// and one store of the four results, and every element's arithmetic exactly splitk_reduce_kernel's
// (the splits in order from 0.f, then apply_epilogue and apply_mask), so the same bits. The splits'
// loads are issued kBatch at a time ahead of their adds.
template <bool kBf16>
__global__ void splitk_reduce4_kernel(const float4* __restrict__ ws, int splits, int m, int n,
                                      void* c, int64_t ldc, EpilogueArgs e) {
  kernel_entry();
  constexpr int kBatch = 8;
  const int quads = n / 4;
  const int64_t total4 = int64_t(m) * quads;  // the workspace's float4s per split
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int row = static_cast<int>(i / quads);
    const int col = 4 * static_cast<int>(i - int64_t(row) * quads);
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < splits; s0 += kBatch) {
      float4 part[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        if (s0 + b < splits) part[b] = ws[int64_t(s0 + b) * total4 + i];
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {  // fixed order: split s0 + b after s0 + b - 1
        if (s0 + b < splits) {
          sum[0] += part[b].x;
          sum[1] += part[b].y;
          sum[2] += part[b].z;
          sum[3] += part[b].w;
        }
      }
    }
    const int64_t at = int64_t(row) * ldc + col;
    float v[4];
    if constexpr (kBf16) {
      auto* dst = reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(c) + at);  // 8 bytes
      uint2 old_bits = make_uint2(0u, 0u);
      if (e.beta != 0.f) old_bits = *dst;
      __nv_bfloat162 old[2];
      memcpy(old, &old_bits, sizeof(old));
      const float olds[4] = {__low2float(old[0]), __high2float(old[0]), __low2float(old[1]),
                             __high2float(old[1])};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[k] = apply_epilogue(e, sum[k], e.beta != 0.f ? olds[k] : 0.f, col + k);
        if (e.mask != nullptr) v[k] = apply_mask(e, v[k], at + k, true);
      }
      const __nv_bfloat162 out[2] = {__floats2bfloat162_rn(v[0], v[1]),
                                     __floats2bfloat162_rn(v[2], v[3])};
      uint2 out_bits;
      memcpy(&out_bits, out, sizeof(out_bits));
      *dst = out_bits;
    } else {
      float* dst = static_cast<float*>(c) + at;
      float4 old = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e.beta != 0.f) old = *reinterpret_cast<const float4*>(dst);
      const float olds[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[k] = apply_epilogue(e, sum[k], olds[k], col + k);
        if (e.mask != nullptr) v[k] = apply_mask(e, v[k], at + k, false);
      }
      *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
}

std::atomic<bool> g_splitk_reduce4{true};  // measured faster (kernels/matmul.h)

void splitk_reduce(const MatmulProblem& p, const float* ws, int splits, cudaStream_t stream) {
  const int64_t total = int64_t(p.m) * p.n;
  const bool bf16 = p.c_type == DType::BF16;
  const EpilogueArgs e{p.alpha, p.beta, p.bias, int(p.relu), p.mask, p.bias_period};
  // The workspace comes from the stream-ordered allocator (256-byte aligned); null when k == 0.
  if (g_splitk_reduce4.load() && detail::splitk_reduce4_applies(p) &&
      reinterpret_cast<uintptr_t>(ws) % 16 == 0) {
    const int64_t total4 = total / 4;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total4 + 255) / 256, 65536));
    const auto* ws4 = reinterpret_cast<const float4*>(ws);
    if (bf16) {
      launch("splitk_reduce4_kernel", splitk_reduce4_kernel<true>, dim3(blocks), dim3(256), 0,
             stream, ws4, splits, p.m, p.n, p.c, p.ldc, e);
    } else {
      launch("splitk_reduce4_kernel", splitk_reduce4_kernel<false>, dim3(blocks), dim3(256), 0,
             stream, ws4, splits, p.m, p.n, p.c, p.ldc, e);
    }
    return;
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 65536));
  launch("splitk_reduce_kernel", splitk_reduce_kernel, dim3(blocks), dim3(256), 0, stream, ws,
         splits, p.m, p.n, p.c, p.ldc, int(bf16), e);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// dst (rows x k, K-major, row stride ldd, fp32 or bf16) = op(src): src[r*ld + c], or with
// `transposed` src[c*ld + r]. 32 x 32 tiles through shared memory so that both the reads and the
// writes are coalesced whichever way src runs; the pad column avoids bank conflicts.
template <typename Out>
__global__ void pack_k_major_kernel(const float* __restrict__ src, int64_t ld, int transposed,
                                    int rows, int k, Out* __restrict__ dst, int64_t ldd) {
  kernel_entry();
  __shared__ float tile[32][33];
  const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    // Read along src's contiguous dimension.
    const int a = (transposed ? c0 : r0) + i, b = (transposed ? r0 : c0) + threadIdx.x;
    const int r = transposed ? b : a, c = transposed ? a : b;
    float v = 0.f;
    if (r < rows && c < k) v = src[int64_t(a) * ld + b];
    if (transposed) {
      tile[threadIdx.x][i] = v;
    } else {
      tile[i][threadIdx.x] = v;
    }
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) {
    const int r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < ldd) {
      // Columns between k and ldd are the padding of the row: zero, never garbage.
      const float v = c < k ? tile[i][threadIdx.x] : 0.f;
      if constexpr (sizeof(Out) == 2) {
        dst[int64_t(r) * ldd + c] = __float2bfloat16_rn(v);
      } else {
        dst[int64_t(r) * ldd + c] = v;
      }
    }
  }
}

void pack_k_major(const float* src, int64_t ld, bool transposed, int rows, int k, void* dst,
                  int64_t ldd, DType type, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(ldd, 32)), static_cast<unsigned>(ceil_div(rows, 32)));
  const dim3 block(32, 8);
  if (type == DType::BF16) {
    launch("pack_k_major_kernel<bf16>", pack_k_major_kernel<__nv_bfloat16>, grid, block, 0, stream,
           src, ld, int(transposed), rows, k, static_cast<__nv_bfloat16*>(dst), ldd);
  } else {
    launch("pack_k_major_kernel<fp32>", pack_k_major_kernel<float>, grid, block, 0, stream, src, ld,
           int(transposed), rows, k, static_cast<float*>(dst), ldd);
  }
}

}  // namespace

const char* dtype_name(DType dtype) { return dtype == DType::BF16 ? "bf16" : "fp32"; }
int dtype_size(DType dtype) { return dtype == DType::BF16 ? 2 : 4; }

bool tensor_cores_available(int device) {
#ifdef CUDP_HAVE_SM90
  const DeviceInfo& info = device_info(device);
  return info.major == 9 && info.minor == 0;
#else
  (void)device;
  return false;
#endif
}

std::string matmul_unsupported_reason(const MatmulProblem& p, int device) {
  using cudp::detail::str;
  if (p.math == Math::FP32) {
    return "Math::FP32 products run on the SIMT kernels (kernels/gemm.h), not on tensor cores";
  }
  if (!tensor_cores_available(device)) {
    const DeviceInfo& info = device_info(device);
#ifdef CUDP_HAVE_SM90
    return str("tensor-core math (", math_name(p.math), ") needs an sm_90 GPU (H100/H200); device ",
               device, " is sm_", info.major, info.minor, ": use Math::FP32 on it");
#else
    return str("this build of cudp has no sm_90a kernels, so ", math_name(p.math),
               " is unavailable on device ", device, " (sm_", info.major, info.minor,
               "): use Math::FP32");
#endif
  }
  if (p.m < 0 || p.n < 0 || p.k < 0) return str("negative size m=", p.m, " n=", p.n, " k=", p.k);
  if (p.m == 0 || p.n == 0) return "";
  if (p.c == nullptr) return "C is null";
  if (p.ldc < p.n) return str("ldc=", p.ldc, " is smaller than n=", p.n);
  if (p.bias_period < 0 || (p.bias_period > 0 && p.bias == nullptr)) {
    return str("bias_period=", p.bias_period,
               ": it is 0 (one bias a column) or the period of a given bias, > 0");
  }
  if (p.mask != nullptr && (p.beta != 0.f || p.bias != nullptr || p.relu)) {
    return "a ReLU mask (backward-data's fused ReLU backward) goes with beta 0, no bias and no "
           "ReLU";
  }
  if (p.bias_grad != nullptr) {
    return "bias_grad is backward-weight's fused bias gradient (kernels/conv2d.h), not a product "
           "option; take column sums with kernels::bias_grad";
  }
  if (p.column_sums != nullptr) {
    return "column_sums is backward-data's (kernels/conv2d.h, ConvOperands), not a product "
           "option; take column sums with kernels::bias_grad";
  }
  if (p.b_dense_k != 0 || p.b_dense_c != 0) {
    const int64_t k_out = p.b_dense_k, c_in = p.b_dense_c;
    if (k_out <= 0 || c_in <= 0 || k_out % 256 != 0 || c_in % 64 != 0) {
      return str(
          "the dense 2x2 view of B (b_dense_k, b_dense_c) needs K a multiple of 256 and C "
          "a multiple of 64, got K=",
          k_out, " C=", c_in, "; gather W_eff with conv2d_dense_2x2_filters instead");
    }
    if (p.math != Math::BF16 || p.a_transposed) {
      return "the dense 2x2 view of B is read in bf16 with A stored m x k (not a_transposed)";
    }
    const int64_t rows = p.b_transposed ? p.k : p.n, cols = p.b_transposed ? p.n : p.k;
    if (rows != 4 * k_out || cols != 4 * c_in || p.ldb != 9 * c_in) {
      return str("the dense 2x2 view of B is W_eff, 4K x 4C = ", 4 * k_out, " x ", 4 * c_in,
                 ", over filters of row stride ldb = 9C = ", 9 * c_in, "; got ", rows, " x ", cols,
                 " (", p.b_transposed ? "k x n" : "n x k", ") and ldb=", p.ldb);
    }
  }
  if (p.mask != nullptr && !aligned16(p.mask)) {
    return "the ReLU mask must be 16-byte aligned (it is read in pairs with C's row stride)";
  }
  if (p.k == 0) return "";
  const int esize = p.math == Math::BF16 ? 2 : 4;
  const char* want = p.math == Math::BF16 ? "bf16" : "fp32";
  if (p.a == nullptr || p.b == nullptr) return "A or B is null";
  if (p.a_transposed && p.math != Math::BF16) {
    return "A stored k x m (a_transposed) needs bf16 (TF32 transposes B stored k x n only); pass A "
           "as m x k";
  }
  if (p.a_transposed && !p.b_transposed) {
    return "A stored k x m (a_transposed) is supported with B stored k x n (b_transposed) only; "
           "pass A as m x k";
  }
  const int64_t a_row = p.a_transposed ? p.m : p.k;
  if (p.lda < a_row) {
    return str("lda=", p.lda, " is smaller than ", p.a_transposed ? "m=" : "k=", a_row);
  }
  const int64_t b_row = p.b_transposed ? p.n : p.k;
  if (p.ldb < b_row) {
    return str("ldb=", p.ldb, " is smaller than ", p.b_transposed ? "n=" : "k=", b_row);
  }
  if (!aligned16(p.a) || !aligned16(p.b)) {
    return str("A and B must be 16-byte aligned for the tensor-core loads (", want,
               " operands); copy them into aligned buffers");
  }
  if ((p.lda * esize) % 16 != 0 || (p.ldb * esize) % 16 != 0) {
    return str("the row strides lda=", p.lda, " and ldb=", p.ldb, " must be multiples of ",
               16 / esize, " ", want, " elements (16 bytes) for the tensor-core loads; pad the rows");
  }
  return "";
}

int64_t matmul_workspace_bytes(const MatmulProblem& p, const MatmulPlan& plan) {
  return plan.splits > 1 ? int64_t(plan.splits) * p.m * p.n * int64_t(sizeof(float)) : 0;
}

MatmulPlan make_matmul_plan(const MatmulProblem& p, int tile_n, int splits, int sm_count) {
  CUDP_CHECK(tile_n == 64 || tile_n == 128 || tile_n == 256,
             "matmul: tile_n must be 64, 128 or 256, got ", tile_n);
  CUDP_CHECK(splits >= 1, "matmul: splits must be >= 1, got ", splits);
  MatmulPlan plan;
  plan.tile_m = kTileM;
  plan.tile_n = tile_n;
  const int kb = std::max(1, ceil_div(p.k, k_block(p.math)));
  plan.k_blocks_per_split = ceil_div(kb, std::min(splits, kb));
  plan.splits = p.k == 0 ? 1 : ceil_div(kb, plan.k_blocks_per_split);  // none empty
  const int64_t items =
      int64_t(ceil_div(p.m, kTileM)) * ceil_div(p.n, tile_n) * plan.splits;
  plan.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, sm_count)));
  return plan;
}

MatmulPlan plan_matmul(const MatmulProblem& p, int device) {
  if (device < 0) device = current_device();
  using Key = std::tuple<int, int, int, int, int>;
  static std::mutex mutex;
  static std::map<Key, MatmulPlan> cache;
  const Key key{device, int(p.math), p.m, p.n, p.k};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  const int sms = device_info(device).sms;
  MatmulPlan best;
  double best_time = INFINITY;
  const int max_splits = int64_t(p.k) > 16 * int64_t(std::max(p.m, p.n)) ? kMaxSplitsLongK : kMaxSplits;
  for (int tile_n : {256, 128, 64}) {
    for (int splits = 1; splits <= max_splits; ++splits) {
      const MatmulPlan plan = make_matmul_plan(p, tile_n, splits, sms);
      if (plan.splits != splits) break;  // more splits than k blocks
      if (matmul_workspace_bytes(p, plan) > kMaxWorkspaceBytes) break;
      const double t = estimate(p, tile_n, splits, sms);
      if (t < best_time) {
        best_time = t;
        best = plan;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, best);
  return best;
}

void matmul_with_plan(const MatmulProblem& p, const MatmulPlan& plan, cudaStream_t stream) {
  const int device = current_device();
  const std::string why = matmul_unsupported_reason(p, device);
  CUDP_CHECK(why.empty(), "matmul: ", why);
  detail::run_mainloop(p, plan, nullptr, stream);
}

namespace detail {

namespace {
std::atomic<bool> g_splitk_in_kernel{false};  // measured slower (kernels/matmul.h)
}  // namespace

void set_splitk_in_kernel(bool on) {
  g_splitk_in_kernel.store(on);
}
bool splitk_in_kernel_enabled() {
  return g_splitk_in_kernel.load();
}
bool splitk_in_kernel(const MatmulPlan& plan) {
  return plan.splits > 1 && plan.splits <= kMaxSplitsInKernel && g_splitk_in_kernel.load();
}

void set_splitk_reduce_vectorized(bool on) {
  g_splitk_reduce4.store(on);
}
bool splitk_reduce_vectorized() {
  return g_splitk_reduce4.load();
}
bool splitk_reduce4_applies(const MatmulProblem& p) {
  const uintptr_t c_bytes = p.c_type == DType::BF16 ? 8 : 16;
  return p.n % 4 == 0 && p.ldc % 4 == 0 && reinterpret_cast<uintptr_t>(p.c) % c_bytes == 0;
}

void add_column_sums(const void* c, DType type, float* sums, int64_t rows, int64_t cols,
                     cudaStream_t stream) {
  if (type == DType::BF16) {
    detail::bias_grad_deferrable(static_cast<const __nv_bfloat16*>(c), sums, rows, cols, 1.f,
                                 stream);
  } else {
    detail::bias_grad_deferrable(static_cast<const float*>(c), sums, rows, cols, 1.f, stream);
  }
}

void run_mainloop(const MatmulProblem& p, const MatmulPlan& plan, const sm90::ConvGather* conv,
                  cudaStream_t stream, Feed feed, const sm90::PatchTiles* patch) {
  if (p.m == 0 || p.n == 0) return;
  if (p.k == 0) {  // no products: C = epilogue(0)
    splitk_reduce(p, nullptr, 0, stream);
    return;
  }
#ifdef CUDP_HAVE_SM90
  // The switch read once: the kernel and the reduction below must agree on who sums the splits.
  MatmulPlan run = plan;
  run.sum_in_kernel = splitk_in_kernel(plan);
  Workspace partials(size_t(matmul_workspace_bytes(p, plan)), stream,
                     "the tensor-core product's split-K partial sums");
  float* ws = partials.get();
  const bool bf16 = p.math == Math::BF16;
  CUDP_CHECK(p.column_sums == nullptr || (conv != nullptr && p.ldc == p.n),
             "conv: column sums are a convolution's, of a C without gaps between rows");
  // Backward-data's column sums in the epilogue (kernels/sm90/matmul_sm90.cuh, MainloopParams::
  // column_partials): one row of partials per warp of every tile, or per tile when its operands
  // are swapped.
  Workspace column_ws;
  int64_t column_rows = 0;
  if (p.column_sums != nullptr && patch != nullptr &&
      (feed == Feed::ConvTma || feed == Feed::ConvTmaUnrotated) &&
      sm90::column_sums_in_epilogue(p, run)) {
    const bool swapped = bf16 && sm90::conv_swapped_applies(p, run, *patch);
    column_rows = int64_t(patch->tiles_q) * patch->tiles_p * patch->tiles_n * (swapped ? 1 : 8);
    column_ws = Workspace(size_t(column_rows) * size_t(p.n) * sizeof(float), stream,
                          "backward-data's partial column sums");
  }
  if (feed == Feed::ConvTma || feed == Feed::ConvTmaUnrotated) {
    CUDP_CHECK(conv != nullptr && patch != nullptr, "conv: the patch feed needs its tiling");
    CUDP_CHECK(bf16 || feed == Feed::ConvTma,
               "conv: unrotated filters need bf16 (TF32 reads K-major operands only)");
    bf16 ? sm90::conv_tma_bf16(p, *conv, *patch, run, ws, stream, feed == Feed::ConvTmaUnrotated,
                               column_ws.get())
         : sm90::conv_tma_tf32(p, *conv, *patch, run, ws, stream, column_ws.get());
  } else if (feed == Feed::Wgrad || feed == Feed::WgradAlt || feed == Feed::WgradTma ||
             feed == Feed::WgradTmaT) {
    const bool tma = feed == Feed::WgradTma || feed == Feed::WgradTmaT;
    CUDP_CHECK(conv != nullptr, "conv: backward-weight's feed needs its convolution (ConvGather)");
    CUDP_CHECK(bf16 || tma,
               "conv: backward-weight's gather feed (Wgrad, WgradAlt) takes bf16 operands only; "
               "TF32 runs on the patch feed (WgradTma, WgradTmaT) or the copies (WgradShift)");
    CUDP_CHECK(!tma || patch != nullptr, "conv: the patch feed of backward-weight needs its tiling");
    CUDP_CHECK(p.bias_grad == nullptr || tma,
               "conv: the bias gradient is fused into backward-weight's patch feed only");
    if (!bf16) {
      CUDP_CHECK(p.bias_grad == nullptr, "conv: the TF32 backward-weight takes no bias gradient");
      sm90::conv_wgrad_tf32_patch(p, *conv, *patch, run, ws, stream, feed == Feed::WgradTmaT);
    } else {
      const int channels = feed == Feed::WgradTmaT ? p.n : p.m;  // K
      Workspace bias_partials(p.bias_grad ? size_t(plan.splits) * channels * sizeof(float) : 0,
                              stream, "backward-weight's partial bias gradients");
      sm90::conv_wgrad_bf16(p, *conv, run, ws, stream, feed == Feed::WgradAlt,
                            tma ? patch : nullptr, feed == Feed::WgradTmaT, bias_partials.get());
      if (p.bias_grad) {
        bias_grad_from_partials(std::move(bias_partials), p.bias_grad, plan.splits, channels, 1.f,
                                stream);  // or queued (NOTE [Deferred bias gradients])
      }
    }
  } else if (feed == Feed::WgradShift || feed == Feed::WgradShiftT) {
    CUDP_CHECK(p.bias_grad == nullptr,
               "conv: the bias gradient is fused into the bf16 backward-weight's patch feed only");
    CUDP_CHECK(!bf16 && patch != nullptr, "backward-weight's shifted feed needs TF32 and its taps");
    sm90::conv_wgrad_tf32(p, *patch, run, ws, stream, feed == Feed::WgradShiftT);
  } else if (conv != nullptr) {
    bf16 ? sm90::conv_bf16(p, *conv, run, ws, stream) : sm90::conv_tf32(p, *conv, run, ws, stream);
  } else {
    bf16 ? sm90::matmul_bf16(p, run, ws, stream) : sm90::matmul_tf32(p, run, ws, stream);
  }
  if (ws != nullptr && !run.sum_in_kernel) splitk_reduce(p, ws, plan.splits, stream);
  if (column_rows > 0) {
    detail::bias_grad_deferrable(column_ws.get(), p.column_sums, column_rows, p.n, 1.f, stream);
  } else if (p.column_sums != nullptr) {
    add_column_sums(p.c, p.c_type, p.column_sums, p.m, p.n, stream);
  }
#else
  (void)plan;
  (void)conv;
  (void)feed;
  (void)patch;
  CUDP_CHECK(false, "this build of cudp has no sm_90a kernels");
#endif
}

}  // namespace detail

void matmul(const MatmulProblem& p, cudaStream_t stream) {
  const int device = current_device();
  const std::string why = matmul_unsupported_reason(p, device);
  CUDP_CHECK(why.empty(), "matmul: ", why);
  matmul_with_plan(p, plan_matmul(p, device), stream);
}

namespace detail {

int multiprocessor_count(int device) { return device_info(device).sms; }

int require_tensor_cores(const char* what, Math math) {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);  // fails without a driver or a device
  if (status != cudaSuccess) {
    cudaGetLastError();  // the error is not sticky: clear it so later calls start clean
    CUDP_CHECK(false, what, ": Math::", math_name(math),
               " runs on tensor cores and needs an sm_90 GPU (H100/H200), but no CUDA device is "
               "usable here (", cudaGetErrorString(status), "); use Math::FP32");
  }
  if (!tensor_cores_available(device)) {
    const DeviceInfo& info = device_info(device);
    CUDP_CHECK(false, what, ": Math::", math_name(math),
               " runs on tensor cores and needs an sm_90 GPU (H100/H200) and a build with its "
               "sm_90a kernels; device ", device, " is sm_", info.major, info.minor,
               ": use Math::FP32");
  }
  return device;
}

void gemm_tensor_cores(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                       const float* A, int lda, const float* B, int ldb, float beta, float* C,
                       int ldc, cudaStream_t stream, Math math) {
  require_tensor_cores("gemm", math);
  const DType type = math == Math::BF16 ? DType::BF16 : DType::F32;
  const int esize = dtype_size(type);
  if (alpha == 0.f) k = 0;  // BLAS: A and B are not read
  // An operand is used in place when it is an fp32 matrix that TMA can load: A K-major, B either
  // way (stored k x n, op(B) = B, it is read as MatmulProblem::b_transposed: transposed in shared
  // memory by the kernel instead of a packed copy here).
  const bool a_direct = type == DType::F32 && !trans_a && aligned16(A) && (lda * 4) % 16 == 0;
  const bool b_direct = type == DType::F32 && aligned16(B) && (ldb * 4) % 16 == 0;
  const int64_t ldp = (int64_t(k) * esize + 15) / 16 * 16 / esize;  // packed row stride
  const int64_t a_bytes = a_direct || k == 0 ? 0 : (int64_t(m) * ldp * esize + 255) / 256 * 256;
  const int64_t b_bytes = b_direct || k == 0 ? 0 : int64_t(n) * ldp * esize;
  Workspace packed(size_t(a_bytes + b_bytes), stream,
                   "the product's operands packed to 16-byte rows");
  uint8_t* ws = packed.get<uint8_t>();
  MatmulProblem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.math = math;
  p.a = a_direct ? static_cast<const void*>(A) : ws;
  p.lda = a_direct ? lda : ldp;
  p.b = b_direct ? static_cast<const void*>(B) : ws + a_bytes;
  p.ldb = b_direct ? ldb : ldp;
  p.b_transposed = b_direct && !trans_b;
  p.c = C;
  p.ldc = ldc;
  p.c_type = DType::F32;
  p.alpha = alpha;
  p.beta = beta;
  if (k > 0 && !a_direct) pack_k_major(A, lda, trans_a, m, k, ws, ldp, type, stream);
  // op(B) is k x n; its K-major form is n x k: B itself when trans_b, else B transposed.
  if (k > 0 && !b_direct) pack_k_major(B, ldb, !trans_b, n, k, ws + a_bytes, ldp, type, stream);
  matmul(p, stream);
}

}  // namespace detail
}  // namespace cudp::kernels
