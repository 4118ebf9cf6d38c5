// The fp32 GEMM (kernels/gemm.h): a classic SIMT kernel on fp32 FMA, no tensor cores.
//
// Design
// - A block computes a kTileM x 128 tile of C: kTileM = 128 with 256 threads, or 64 with 128
//   threads. Each thread owns an 8 x 8 register tile, so every value read from shared memory feeds
//   8 FMAs. The 8 x 8 is split 2 x (4 x 4): rows ty*4..+3 and kTileM/2 + ty*4..+3, columns
//   likewise, so that neighbouring threads read neighbouring float4s of shared memory. A warp
//   covers 4 ty x 8 tx: its fragment loads read 4 (A) and 8 (B) consecutive float4s, broadcast to
//   the lanes that share them, without bank conflicts.
// - k advances 8 at a time through two shared-memory stages (double buffering): while the block
//   computes on one stage, the next k-tile's global loads are in flight into registers; they are
//   stored into the other stage after the arithmetic, and one __syncthreads() per k-tile both
//   publishes that stage and retires the one just read.
// - Shared memory holds both operands k-major (s[k][row]) whatever their global layout, so the
//   inner loop is the same for all four transpose combinations; they differ only in how a k-tile
//   is loaded, each combination its own instantiation. Rows are padded by 4 floats: the transposed
//   stores of a k-contiguous operand are then conflict-free, and rows stay 16-byte aligned.
// - Global loads are 16 bytes wide when the operand's pointer is 16-byte aligned and its leading
//   dimension a multiple of 4 (checked per call); otherwise, and at the matrix edges, a guarded
//   scalar path loads element by element and reads zeros past the edge, so edge tiles run the same
//   arithmetic. The epilogue's stores of C follow the same rule.
// - With few tiles (a Linear layer's m = 64 products at batch 64) most SMs would idle, so k is
// split
//   (split-K): each split writes its partial tile to a workspace from cudaMallocAsync, and a second
//   kernel sums the splits in a fixed order and applies alpha and beta. No atomics, so results are
//   deterministic. plan_gemm() picks the tile height and the split count with a cost model.
// - At most 128 registers per thread (__launch_bounds__): 2 blocks of 256 threads, or 4 of 128,
//   per SM; ptxas fits all eight kernels in 128 without spilling.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "engine/core/launch.cuh"
#include "kernels/gemm.h"
#include "kernels/matmul.h"
#include "kernels/workspace.h"

namespace cudp::kernels {
namespace {

using detail::GemmPlan;

constexpr int kTileN = 128;  // columns of C per block
constexpr int kTileK = 8;    // k per shared-memory stage
constexpr int kMicro = 8;    // each thread computes kMicro x kMicro outputs
constexpr int kPad = 4;      // floats of padding at the end of each shared-memory row
constexpr int kMaxRegisters = 128;
constexpr int kRegistersPerSm = 65536;

template <int kTileM>
struct TileShape {
  static_assert(kTileM == 64 || kTileM == 128);
  static constexpr int kThreads = (kTileM / kMicro) * (kTileN / kMicro);
  static constexpr int kBlocksPerSm = kRegistersPerSm / (kThreads * kMaxRegisters);
};

int threads_for(int tile_m) {
  return tile_m == 128 ? TileShape<128>::kThreads : TileShape<64>::kThreads;
}
int blocks_per_sm_for(int tile_m) {
  return tile_m == 128 ? TileShape<128>::kBlocksPerSm : TileShape<64>::kBlocksPerSm;
}

struct GemmParams {
  const float* a;
  const float* b;
  float* c;  // C, or the split-K workspace
  int m, n, k;
  int lda, ldb, ldc;
  float alpha, beta;
  int k_chunk;             // k per split (blockIdx.z)
  int64_t c_split_stride;  // elements between the outputs of consecutive splits (0 without split-K)
  bool a_vec, b_vec, c_vec;  // 16-byte global accesses allowed for A, B, C
};

// alpha * v + beta * old, where old is read only when beta != 0 (BLAS: C may be garbage then). One
// formula for the GEMM epilogue and the split-K reduction, so both round alike.
__device__ __forceinline__ float scale_add(float alpha, float v, float beta, const float* old) {
  const float scaled = alpha * v;
  return beta == 0.f ? scaled : fmaf(beta, *old, scaled);
}

// Four consecutive elements from p, of which `avail` exist (rows past the edge: ok == false); the
// missing ones read as 0 so that they add nothing to the products.
__device__ __forceinline__ float4 load4_guarded(const float* p, bool ok, int avail) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (ok) {
    if (avail > 0) v.x = p[0];
    if (avail > 1) v.y = p[1];
    if (avail > 2) v.z = p[2];
    if (avail > 3) v.w = p[3];
  }
  return v;
}

// Moves one operand's share of a k-tile (kD rows of the tile by kTileK) from global memory through
// registers into a shared-memory stage laid out s[kk][d]. d indexes m for A and n for B.
// kKContig: consecutive k are adjacent in global memory (A not transposed, B transposed); each
// float4 then runs along k and is stored transposed. Otherwise it runs along d and is stored as is.
// The operand's description (pointer, leading dimension, extents) is passed to load() rather than
// kept in members: straight from the kernel parameters it costs no registers.
template <int kD, int kThreads, bool kKContig>
class TileLoader {
 public:
  using Stage = float[kTileK][kD + kPad];

  // Loads the k-tile starting at k0 of the block whose tile starts at row d0; rows at or past d_end
  // and k at or past k_end read as 0. vec: 16-byte loads allowed (aligned base, ld % 4 == 0).
  __device__ void load(const float* base, int ld, int d0, int d_end, int k0, int k_end, bool vec) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int2 pos = position(i);
      const int d = d0 + pos.x;
      const int kk = k0 + pos.y;
      if constexpr (kKContig) {
        const float* p = base + static_cast<int64_t>(d) * ld + kk;
        const bool row_ok = d < d_end;
        regs_[i] = row_ok && vec && k_end - kk >= 4 ? *reinterpret_cast<const float4*>(p)
                                                    : load4_guarded(p, row_ok, k_end - kk);
      } else {
        const float* p = base + static_cast<int64_t>(kk) * ld + d;
        const bool row_ok = kk < k_end;
        regs_[i] = row_ok && vec && d_end - d >= 4 ? *reinterpret_cast<const float4*>(p)
                                                   : load4_guarded(p, row_ok, d_end - d);
      }
    }
  }

  __device__ void store(Stage& s) const {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int2 pos = position(i);
      if constexpr (kKContig) {
        s[pos.y + 0][pos.x] = regs_[i].x;
        s[pos.y + 1][pos.x] = regs_[i].y;
        s[pos.y + 2][pos.x] = regs_[i].z;
        s[pos.y + 3][pos.x] = regs_[i].w;
      } else {
        *reinterpret_cast<float4*>(&s[pos.y][pos.x]) = regs_[i];
      }
    }
  }

 private:
  static constexpr int kVecs = kD * kTileK / (4 * kThreads);  // float4s per thread per k-tile
  static_assert(kVecs >= 1 && kD * kTileK % (4 * kThreads) == 0);

  // (d, k) offsets inside the tile of this thread's i-th float4. Consecutive threads take
  // consecutive float4s of global memory (coalesced) and, stored transposed, consecutive d
  // (conflict-free).
  __device__ static int2 position(int i) {
    const int v = static_cast<int>(threadIdx.x) + i * kThreads;
    if constexpr (kKContig) {
      return make_int2(v / (kTileK / 4), (v % (kTileK / 4)) * 4);
    } else {
      return make_int2((v % (kD / 4)) * 4, v / (kD / 4));
    }
  }

  float4 regs_[kVecs];
};

// Writes four consecutive outputs of a row, `avail` of which are inside C.
__device__ __forceinline__ void store4(float* c, const float (&v)[4], int avail, float alpha,
                                       float beta, bool vec) {
  if (vec && avail >= 4) {
    float4 old = make_float4(0.f, 0.f, 0.f, 0.f);
    if (beta != 0.f) old = *reinterpret_cast<const float4*>(c);
    const float4 out =
        make_float4(scale_add(alpha, v[0], beta, &old.x), scale_add(alpha, v[1], beta, &old.y),
                    scale_add(alpha, v[2], beta, &old.z), scale_add(alpha, v[3], beta, &old.w));
    *reinterpret_cast<float4*>(c) = out;
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (q < avail) c[q] = scale_add(alpha, v[q], beta, c + q);
    }
  }
}

template <int kTileM, bool kTransA, bool kTransB>
__global__ void __launch_bounds__(TileShape<kTileM>::kThreads, TileShape<kTileM>::kBlocksPerSm)
    gemm_kernel(const GemmParams p) {
  kernel_entry();
  constexpr int kThreads = TileShape<kTileM>::kThreads;
  using ALoader = TileLoader<kTileM, kThreads, !kTransA>;
  using BLoader = TileLoader<kTileN, kThreads, kTransB>;
  __shared__ __align__(16) typename ALoader::Stage a_s[2];
  __shared__ __align__(16) typename BLoader::Stage b_s[2];

  const int m0 = static_cast<int>(blockIdx.x) * kTileM;
  const int n0 = static_cast<int>(blockIdx.y) * kTileN;
  const int k_begin = static_cast<int>(blockIdx.z) * p.k_chunk;
  const int k_end = k_begin + min(p.k - k_begin, p.k_chunk);
  const int k_tiles = (k_end - k_begin + kTileK - 1) / kTileK;

  // Warp w covers thread rows (w / 2) * 4 + 0..3 and thread columns (w % 2) * 8 + 0..7.
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int ty = (warp / 2) * 4 + lane / 8;
  const int tx = (warp % 2) * 8 + lane % 8;

  ALoader a_load;
  BLoader b_load;
  const auto load_k_tile = [&](int k0) {
    a_load.load(p.a, p.lda, m0, p.m, k0, k_end, p.a_vec);
    b_load.load(p.b, p.ldb, n0, p.n, k0, k_end, p.b_vec);
  };
  float acc[kMicro][kMicro] = {};

  if (k_tiles > 0) {
    load_k_tile(k_begin);
    a_load.store(a_s[0]);
    b_load.store(b_s[0]);
    __syncthreads();
    for (int t = 0; t < k_tiles; ++t) {
      const int cur = t & 1;
      const bool more = t + 1 < k_tiles;
      if (more) load_k_tile(k_begin + (t + 1) * kTileK);  // in flight during the arithmetic below
#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) {
        const float4 a0 = *reinterpret_cast<const float4*>(&a_s[cur][kk][ty * 4]);
        const float4 a1 = *reinterpret_cast<const float4*>(&a_s[cur][kk][kTileM / 2 + ty * 4]);
        const float4 b0 = *reinterpret_cast<const float4*>(&b_s[cur][kk][tx * 4]);
        const float4 b1 = *reinterpret_cast<const float4*>(&b_s[cur][kk][kTileN / 2 + tx * 4]);
        const float a[kMicro] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float b[kMicro] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < kMicro; ++i) {
#pragma unroll
          for (int j = 0; j < kMicro; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
      }
      if (more) {  // the other stage was last read before the previous __syncthreads()
        a_load.store(a_s[cur ^ 1]);
        b_load.store(b_s[cur ^ 1]);
      }
      __syncthreads();
    }
  }

  float* c = p.c + static_cast<int64_t>(blockIdx.z) * p.c_split_stride;
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
    const int row = m0 + (i < 4 ? ty * 4 + i : kTileM / 2 + ty * 4 + (i - 4));
    if (row >= p.m) continue;
    float* c_row = c + static_cast<int64_t>(row) * p.ldc;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = n0 + h * (kTileN / 2) + tx * 4;
      const float v[4] = {acc[i][h * 4 + 0], acc[i][h * 4 + 1], acc[i][h * 4 + 2],
                          acc[i][h * 4 + 3]};
      store4(c_row + col, v, p.n - col, p.alpha, p.beta, p.c_vec);
    }
  }
}

// C = alpha * (sum of the splits' partial products, in split order) + beta * C.
__global__ void gemm_splitk_reduce_kernel(const float* ws, int64_t split_stride, int splits, int m,
                                          int n, int ldw, float alpha, float beta, float* c,
                                          int ldc) {
  kernel_entry();
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= n) return;
  for (int i = static_cast<int>(blockIdx.y); i < m; i += static_cast<int>(gridDim.y)) {
    const float* w = ws + static_cast<int64_t>(i) * ldw + j;
    float sum = 0.f;
#pragma unroll 4
    for (int z = 0; z < splits; ++z) sum += w[z * split_stride];
    float* out = c + static_cast<int64_t>(i) * ldc + j;
    *out = scale_add(alpha, sum, beta, out);
  }
}

constexpr int kReduceThreads = 256;

struct GemmKernel {
  void (*fn)(GemmParams);
  const char* name;
};

GemmKernel select_kernel(int tile_m, bool trans_a, bool trans_b) {
  static constexpr GemmKernel kKernels[2][2][2] = {
      {{{gemm_kernel<64, false, false>, "gemm_kernel<64,N,N>"},
        {gemm_kernel<64, false, true>, "gemm_kernel<64,N,T>"}},
       {{gemm_kernel<64, true, false>, "gemm_kernel<64,T,N>"},
        {gemm_kernel<64, true, true>, "gemm_kernel<64,T,T>"}}},
      {{{gemm_kernel<128, false, false>, "gemm_kernel<128,N,N>"},
        {gemm_kernel<128, false, true>, "gemm_kernel<128,N,T>"}},
       {{gemm_kernel<128, true, false>, "gemm_kernel<128,T,N>"},
        {gemm_kernel<128, true, true>, "gemm_kernel<128,T,T>"}}}};
  return kKernels[tile_m == 128][trans_a][trans_b];
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}


// The cost model's constants, in the unit "FMAs of one SM" (H100/H200-like parts): this kernel
// sustains ~96 FMA per SM and cycle, DRAM delivers ~15 bytes per SM and cycle, so a byte of
// workspace traffic costs ~6 FMAs; a block's fixed costs (first loads' latency, epilogue) equal ~16
// more k; an extra kernel launch on a busy stream costs ~2 us, ~400k FMAs. With fewer than 16
// resident warps an SM hides latency less well: its speed is taken to fall linearly towards half at
// no warps. The 64-row kernel issues ~10% more instructions per FMA than the 128-row one (its main
// loop, in SASS: ~700 against ~630 per 512 FFMA) and loads 50% more bytes per FMA: it must win by
// more than that.
constexpr int kMaxSplits = 32;
constexpr int kMinSplitK = 32;  // k per split, below which splitting further is not considered
constexpr double kFmaPerByte = 6.0;
constexpr double kBlockOverheadK = 16.0;
constexpr double kReduceLaunchFma = 4.0e5;
constexpr double kFullSpeedWarps = 16.0;
constexpr double kShortTileCost = 1.1;
constexpr int64_t kMaxWorkspaceBytes = int64_t(256) << 20;

// Split-K workspace: one m x n partial product per split, rows padded to a multiple of 4 floats.
int64_t workspace_bytes(const GemmPlan& plan, int m, int n) {
  return plan.splits > 1 ? int64_t(plan.splits) * m * ceil_div(n, 4) * 4 * int64_t(sizeof(float))
                         : 0;
}

// Time, in FMAs of the busiest SM, of running the product with `plan`. The block scheduler spreads
// the blocks evenly, so the busiest SM computes ceil(blocks / SMs) tiles over their k_chunk, at a
// speed set by how many warps it holds at once. Split-K adds its workspace traffic (written, then
// read) and the reduction launch.
double plan_cost(const GemmPlan& plan, int m, int n, int sm_count) {
  const int64_t blocks = ceil_div(m, plan.tile_m) * ceil_div(n, kTileN) * plan.splits;
  const int64_t per_sm = ceil_div(blocks, sm_count);
  const int64_t resident = std::min<int64_t>(per_sm, blocks_per_sm_for(plan.tile_m));
  const double warps = double(resident * threads_for(plan.tile_m) / 32);
  const double speed = std::min(1.0, 0.5 + 0.5 * warps / kFullSpeedWarps);
  const double tile_cost = plan.tile_m == 64 ? kShortTileCost : 1.0;
  double cost =
      double(per_sm) * plan.tile_m * kTileN * (plan.k_chunk + kBlockOverheadK) * tile_cost / speed;
  if (plan.splits > 1) {
    cost += 2.0 * double(workspace_bytes(plan, m, n)) / sm_count * kFmaPerByte + kReduceLaunchFma;
  }
  return cost;
}

// Enqueues the product with `plan` (for this k or any other: it is normalised here). Arguments are
// valid (check_gemm_args).
void run_plan(const GemmPlan& plan, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
              const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc,
              cudaStream_t stream) {
  // BLAS: alpha == 0 reads neither A nor B, so no product at all (k = 0) and C = beta * C.
  const int k_used = alpha == 0.f ? 0 : k;
  const GemmPlan p = detail::make_gemm_plan(plan.tile_m, plan.splits, k_used);
  if (m == 0 || n == 0) return;
  CUDP_CHECK(ceil_div(n, kTileN) <= 65535, "gemm: n = ", n, " is too large (at most ",
             65535 * kTileN, " columns)");

  GemmParams params{.a = A,
                    .b = B,
                    .c = C,
                    .m = m,
                    .n = n,
                    .k = k_used,
                    .lda = lda,
                    .ldb = ldb,
                    .ldc = ldc,
                    .alpha = alpha,
                    .beta = beta,
                    .k_chunk = p.k_chunk,
                    .c_split_stride = 0,
                    .a_vec = aligned16(A) && lda % 4 == 0,
                    .b_vec = aligned16(B) && ldb % 4 == 0,
                    .c_vec = aligned16(C) && ldc % 4 == 0};
  const GemmKernel kernel = select_kernel(p.tile_m, trans_a, trans_b);
  const dim3 grid(static_cast<unsigned>(ceil_div(m, p.tile_m)),
                  static_cast<unsigned>(ceil_div(n, kTileN)), static_cast<unsigned>(p.splits));
  if (p.splits == 1) {
    launch(kernel.name, kernel.fn, grid, threads_for(p.tile_m), 0, stream, params);
    return;
  }
  // Split-K: partial products (alpha = 1, beta = 0) into the workspace, whose padded rows allow
  // 16-byte stores, then one reduction applies alpha and beta.
  const int ldw = static_cast<int>(ceil_div(n, 4) * 4);
  Workspace ws(static_cast<size_t>(workspace_bytes(p, m, n)), stream,
               "the GEMM's split-K partial products");
  params.c = ws.get();
  params.ldc = ldw;
  params.alpha = 1.f;
  params.beta = 0.f;
  params.c_split_stride = int64_t(m) * ldw;
  params.c_vec = true;
  launch(kernel.name, kernel.fn, grid, threads_for(p.tile_m), 0, stream, params);
  const dim3 reduce_grid(static_cast<unsigned>(ceil_div(n, kReduceThreads)),
                         static_cast<unsigned>(std::min(m, 65535)));
  launch("gemm_splitk_reduce_kernel", gemm_splitk_reduce_kernel, reduce_grid, kReduceThreads, 0,
         stream, ws.get(), params.c_split_stride, p.splits, m, n, ldw, alpha, beta, C, ldc);
  ws.release();
}

}  // namespace

namespace detail {

GemmPlan make_gemm_plan(int tile_m, int splits, int k) {
  CUDP_CHECK(tile_m == 64 || tile_m == 128, "gemm: tile_m must be 64 or 128, got ", tile_m);
  CUDP_CHECK(splits >= 1, "gemm: splits must be >= 1, got ", splits);
  CUDP_CHECK(k >= 0, "gemm: k must be >= 0, got ", k);
  GemmPlan plan;
  plan.tile_m = tile_m;
  if (splits == 1 || k <= kTileK) {
    plan.k_chunk = k;  // one chunk starting at 0: no alignment needed
    return plan;
  }
  // Chunks start at multiples of kTileK, so the 16-byte loads along k stay aligned.
  const int64_t chunk = ceil_div(ceil_div(k, splits), kTileK) * kTileK;
  plan.k_chunk = static_cast<int>(chunk);
  plan.splits = static_cast<int>(ceil_div(k, chunk));
  return plan;
}

GemmPlan plan_gemm(int m, int n, int k, int sm_count) {
  CUDP_CHECK(sm_count >= 1, "gemm: sm_count must be >= 1, got ", sm_count);
  GemmPlan best = make_gemm_plan(128, 1, k);
  double best_cost = std::numeric_limits<double>::infinity();
  for (const int tile_m : {128, 64}) {  // on a tie the taller tile wins: it loads less per FMA
    for (int splits = 1; splits <= kMaxSplits; ++splits) {
      if (splits > 1 && ceil_div(k, splits) < kMinSplitK) break;
      const GemmPlan plan = make_gemm_plan(tile_m, splits, k);
      if (plan.splits != splits || workspace_bytes(plan, m, n) > kMaxWorkspaceBytes) continue;
      const double cost = plan_cost(plan, m, n, sm_count);
      if (cost < best_cost) {
        best = plan;
        best_cost = cost;
      }
    }
  }
  return best;
}

void gemm_with_plan(const GemmPlan& plan, bool trans_a, bool trans_b, int m, int n, int k,
                    float alpha, const float* A, int lda, const float* B, int ldb, float beta,
                    float* C, int ldc, cudaStream_t stream) {
  check_gemm_args(trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, C, ldc);
  run_plan(plan, trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}

}  // namespace detail

void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* A, int lda,
          const float* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream, Math math) {
  detail::check_gemm_args(trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, C, ldc);
  if (m == 0 || n == 0) return;
  if (math != Math::FP32) {
    detail::gemm_tensor_cores(trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc,
                              stream, math);
    return;
  }
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const GemmPlan plan =
      detail::plan_gemm(m, n, alpha == 0.f ? 0 : k, detail::multiprocessor_count(device));
  run_plan(plan, trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, stream);
}

}  // namespace cudp::kernels
