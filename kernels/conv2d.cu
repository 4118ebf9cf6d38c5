// 2-D convolution as implicit GEMM, fp32 (the API and layouts are in conv2d.h).
//
// Why implicit GEMM: each pass is a matrix product whose operands are views of NHWC activations and
// KRSC weights. Gathering the tiles of those views on the fly (with the zero padding as a bounds
// check) costs no workspace and no extra pass over memory, unlike im2col, and unlike Winograd or
// FFT it computes exactly the dot products that the CPU reference does, in fp32 FMA.
//
//   pass      GEMM rows (M)     GEMM columns (N)  reduction         A (M x red)   B (red x N)
//   forward   pixels n,p,q      channels k        taps r,s,c        x gathered    w
//   bwd data  pixels n,h,w      channels c        taps r,s,k        dy gathered   w
//   bwd wgt   channels k        taps r,s,c        pixels n,p,q      dy            x gathered
//
// One kernel template serves the three passes. A pass names two operand "sources" that say how a
// (fixed index, reduction index) pair maps to an address or to a padding zero; a TileLoader moves a
// kBK-deep slice of either operand into shared memory, stored reduction-major ([kBK][BM] and
// [kBK][BN]) so that each thread reads its 8-float fragments with two 16-byte loads. Operands
// contiguous along the reduction are transposed on the way, through registers; the others are
// copied by cp.async. The block computes a BM x BN tile with BM*BN/64 threads, each owning an 8 x 8
// register tile split into 2 x 2 quadrants of 4 x 4 (so a warp's fragment loads are contiguous and
// conflict-free). Shared memory is double-buffered: the loads of slice t+1 are issued before the
// FMAs of slice t and land after them, one __syncthreads per slice.
//
// Vector path: when the contiguous dimension of every operand is a multiple of 4 and the pointers
// are 16-byte aligned, operands move in float4 (along C or K). Otherwise (first layer, C = 1 or 3,
// or odd test sizes) the same kernel moves single floats.
//
// Split reduction: when the output tiles alone do not fill the GPU (always for backward-weight,
// whose reduction is N*P*Q long while M and N are small; and for deep layers at small spatial
// sizes) the reduction is cut into slices, one block per (tile, slice). Each block writes its
// partial tile to a workspace from the stream-ordered allocator, and a second kernel sums the
// slices in a fixed order and applies the epilogue, so results are identical run to run.
//
// Epilogue: forward fuses bias and ReLU; backward-weight applies dw = beta*dw + grad (dw is not
// read when beta is 0); backward-data writes.
//
// Backward-data for the first layer (C <= 4) would waste almost all of a 64-wide GEMM column tile,
// so 3-wide filters at stride 1 (VGG's first layer) take a direct kernel instead: a thread computes
// 8 neighbouring pixels' channels, reusing each dy value it loads for up to 3 x 4 x 8 FMAs.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "engine/core/launch.cuh"
#include "kernels/bias.h"
#include "kernels/conv2d.h"
#include "kernels/workspace.h"

namespace cudp::kernels {

int Conv2dShape::p() const {
  return (h + 2 * pad_h - r) / stride_h + 1;
}
int Conv2dShape::q() const {
  return (w + 2 * pad_w - s) / stride_w + 1;
}

void Conv2dShape::validate() const {
  const std::pair<int, const char*> positive[] = {{n, "n"},
                                                  {h, "h"},
                                                  {w, "w"},
                                                  {c, "c"},
                                                  {k, "k"},
                                                  {r, "r"},
                                                  {s, "s"},
                                                  {stride_h, "stride_h"},
                                                  {stride_w, "stride_w"}};
  for (const auto& [value, name] : positive) {
    CUDP_CHECK(value > 0, "Conv2dShape: ", name, " must be positive, got ", value);
  }
  CUDP_CHECK(pad_h >= 0, "Conv2dShape: pad_h must be non-negative, got ", pad_h);
  CUDP_CHECK(pad_w >= 0, "Conv2dShape: pad_w must be non-negative, got ", pad_w);
  // The kernels index GEMM rows, columns and reductions with int, keep coordinates within 2^30
  // (see kOutside below) and read a tile past the end: every extent stays below 2^30.
  constexpr int64_t kMaxExtent = int64_t(1) << 30;
  const int64_t padded_h = h + 2 * int64_t(pad_h), padded_w = w + 2 * int64_t(pad_w);
  CUDP_CHECK(padded_h < kMaxExtent && padded_w < kMaxExtent,
             "Conv2dShape: h + 2*pad_h and w + 2*pad_w must be below 2^30, got ", padded_h, " and ",
             padded_w);
  // Before p() and q(): C++ division truncates towards zero, so a numerator of -1 would give 1.
  CUDP_CHECK(padded_h >= r,
             "Conv2dShape: output height p must be at least 1, but the filter height r = ", r,
             " exceeds h + 2*pad_h = ", padded_h);
  CUDP_CHECK(padded_w >= s,
             "Conv2dShape: output width q must be at least 1, but the filter width s = ", s,
             " exceeds w + 2*pad_w = ", padded_w);
  const std::pair<int64_t, const char*> extents[] = {{int64_t(n) * h * w, "n*h*w"},
                                                     {int64_t(n) * p() * q(), "n*p*q"},
                                                     {int64_t(r) * s * c, "r*s*c"},
                                                     {int64_t(r) * s * k, "r*s*k"}};
  for (const auto& [value, name] : extents) {
    CUDP_CHECK(value < kMaxExtent, "Conv2dShape: ", name, " must be below 2^30, got ", value);
  }
}

namespace {

constexpr int kBK = 8;   // reduction depth of one shared-memory slice
constexpr int kPad = 4;  // floats added to a shared-memory row: see TileLoader::store

constexpr int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

// A BM x BN block tile has one thread per 8 x 8 sub-tile.
constexpr int threads_for(int bm, int bn) {
  return bm * bn / 64;
}

// Division of a non-negative int by a divisor fixed at launch, as a multiply-high, an add and a
// shift instead of the ~20-instruction integer division: the loaders decompose indices every slice.
// With l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, n / d = (mulhi(m, n) + n) >> l for
// 0 <= n < 2^31 (Granlund and Montgomery, 1994); the sum cannot overflow because mulhi(m, n) <= n.
struct FastDiv {
  unsigned multiplier = 1, shift = 0;  // the default divides by 1
  FastDiv() = default;
  explicit FastDiv(int d) {
    const uint64_t divisor = uint64_t(d);
    while ((uint64_t(1) << shift) < divisor) ++shift;
    multiplier = unsigned(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor)) / divisor + 1);
  }
  __device__ int div(int n) const {
    return int((__umulhi(unsigned(n), multiplier) + unsigned(n)) >> shift);
  }
};

// The shape as the kernels see it: extents, products and divisors computed once on the host.
struct Geometry {
  int n, h, w, c, k, r, s, p, q;
  int stride_h, stride_w, pad_h, pad_w;
  int npq, rsc, rsk, nhw;
  FastDiv div_c, div_k, div_s, div_q, div_pq, div_w, div_hw;

  explicit Geometry(const Conv2dShape& sh)
      : n(sh.n),
        h(sh.h),
        w(sh.w),
        c(sh.c),
        k(sh.k),
        r(sh.r),
        s(sh.s),
        p(sh.p()),
        q(sh.q()),
        stride_h(sh.stride_h),
        stride_w(sh.stride_w),
        pad_h(sh.pad_h),
        pad_w(sh.pad_w),
        npq(sh.n * p * q),
        rsc(sh.r * sh.s * sh.c),
        rsk(sh.r * sh.s * sh.k),
        nhw(sh.n * sh.h * sh.w),
        div_c(sh.c),
        div_k(sh.k),
        div_s(sh.s),
        div_q(q),
        div_pq(p * q),
        div_w(sh.w),
        div_hw(sh.h * sh.w) {}
};

// ---- operand sources ----------------------------------------------------------------------------
// A source describes one GEMM operand: fixed(i) precomputes what a thread needs about GEMM row or
// column i (constant over the whole reduction), red(kk) decomposes reduction index kk (once per
// slice), and at() returns the address of element (i, kk), or null where it is a padding zero or
// outside the matrix. kVecAlongRed says which index is contiguous in memory: the vector path moves
// 4 consecutive reduction indices (kVecAlongRed) or 4 consecutive fixed indices (otherwise).

// Fixed contexts live in registers for the whole reduction, so they are kept small: an index past
// the end of the matrix is marked by a coordinate of kOutside, which every bounds check below
// rejects, instead of a separate flag. validate() keeps real coordinates within +-2^30, so sums of
// two of them cannot overflow.
constexpr int kOutside = -(1 << 30);

// Where output pixel (n, p, q)'s receptive field starts in x; ih0 and iw0 are negative in padding.
struct Window {
  int n, ih0, iw0;
};
// Filter tap (r, s) at input channel c: reduction index ((r*S + s)*C + c) of the forward pass.
struct Tap {
  int r, s, c;
};

__device__ Window window(const Geometry& g, int npq) {
  const int n = g.div_pq.div(npq);
  const int pq = npq - n * g.p * g.q;
  const int p = g.div_q.div(pq);
  const int q = pq - p * g.q;
  return {n, npq < g.npq ? p * g.stride_h - g.pad_h : kOutside, q * g.stride_w - g.pad_w};
}

__device__ Tap tap(const Geometry& g, int rsc) {
  const int rs = g.div_c.div(rsc);
  const int r = g.div_s.div(rs);
  return {rsc < g.rsc ? r : kOutside, rs - r * g.s, rsc - rs * g.c};
}

__device__ const float* x_at(const Geometry& g, const float* x, const Window& v, const Tap& t) {
  const int ih = v.ih0 + t.r, iw = v.iw0 + t.s;
  if (unsigned(ih) >= unsigned(g.h) || unsigned(iw) >= unsigned(g.w)) return nullptr;
  return x + ((int64_t(v.n) * g.h + ih) * g.w + iw) * g.c + t.c;
}

// Reduction index (r*S + s)*K + k of backward-data: the filter tap and the output channel.
struct TapK {
  int r, s, k;
  bool ok;
};

__device__ TapK tap_k(const Geometry& g, int rsk) {
  const int rs = g.div_k.div(rsk);
  const int r = g.div_s.div(rs);
  return {r, rs - r * g.s, rsk - rs * g.k, rsk < g.rsk};
}

// Forward, A: x gathered, rows are output pixels, reduction over taps (contiguous along c).
struct ForwardX {
  static constexpr bool kVecAlongRed = true;
  using Fixed = Window;
  using Red = Tap;
  static __device__ Fixed fixed(const Geometry& g, int npq) { return window(g, npq); }
  static __device__ Red red(const Geometry& g, int rsc) { return tap(g, rsc); }
  static __device__ const float* at(const Geometry& g, const float* x, const Fixed& f,
                                    const Red& t) {
    return x_at(g, x, f, t);
  }
};

// Forward, B: w as a K x (R*S*C) row-major matrix.
struct ForwardW {
  static constexpr bool kVecAlongRed = true;
  struct Fixed {
    int k;
  };
  struct Red {
    int rsc;
  };
  static __device__ Fixed fixed(const Geometry&, int k) { return {k}; }
  static __device__ Red red(const Geometry&, int rsc) { return {rsc}; }
  static __device__ const float* at(const Geometry& g, const float* w, const Fixed& f,
                                    const Red& t) {
    return f.k < g.k && t.rsc < g.rsc ? w + int64_t(f.k) * g.rsc + t.rsc : nullptr;
  }
};

// Backward-data, A: dy gathered, rows are input pixels (n, h, w), reduction over (r, s, k).
// Input pixel h receives output row p = (h + pad_h - r) / stride_h where that divides exactly.
struct BackwardDataDy {
  static constexpr bool kVecAlongRed = true;
  struct Fixed {
    int n, hp, wp;  // hp = h + pad_h (kOutside past the last pixel), wp = w + pad_w
  };
  using Red = TapK;
  static __device__ Fixed fixed(const Geometry& g, int nhw) {
    const int n = g.div_hw.div(nhw);
    const int hw = nhw - n * g.h * g.w;
    const int h = g.div_w.div(hw);
    return {n, nhw < g.nhw ? h + g.pad_h : kOutside, hw - h * g.w + g.pad_w};
  }
  static __device__ Red red(const Geometry& g, int rsk) { return tap_k(g, rsk); }
  static __device__ const float* at(const Geometry& g, const float* dy, const Fixed& f,
                                    const Red& t) {
    int p = f.hp - t.r, q = f.wp - t.s;
    if (!t.ok) return nullptr;
    if (g.stride_h != 1 || g.stride_w != 1) {  // the generic path; VGG's stride 1 skips it
      if (p < 0 || q < 0 || p % g.stride_h != 0 || q % g.stride_w != 0) return nullptr;
      p /= g.stride_h;
      q /= g.stride_w;
    }
    if (unsigned(p) >= unsigned(g.p) || unsigned(q) >= unsigned(g.q)) return nullptr;
    return dy + ((int64_t(f.n) * g.p + p) * g.q + q) * g.k + t.k;
  }
};

// Backward-data, B: w[k][r][s][c] as an (R*S*K) x C matrix, contiguous along c.
struct BackwardDataW {
  static constexpr bool kVecAlongRed = false;
  struct Fixed {
    int c;
  };
  struct Red {
    int64_t base;  // offset of w[k][r][s][0]
    bool ok;
  };
  static __device__ Fixed fixed(const Geometry&, int c) { return {c}; }
  static __device__ Red red(const Geometry& g, int rsk) {
    const TapK t = tap_k(g, rsk);
    return {((int64_t(t.k) * g.r + t.r) * g.s + t.s) * g.c, t.ok};
  }
  static __device__ const float* at(const Geometry& g, const float* w, const Fixed& f,
                                    const Red& t) {
    return f.c < g.c && t.ok ? w + t.base + f.c : nullptr;
  }
};

// Backward-weight, A: dy as a (N*P*Q) x K matrix read transposed, contiguous along k.
struct BackwardWeightDy {
  static constexpr bool kVecAlongRed = false;
  struct Fixed {
    int k;
  };
  struct Red {
    int npq;
  };
  static __device__ Fixed fixed(const Geometry&, int k) { return {k}; }
  static __device__ Red red(const Geometry&, int npq) { return {npq}; }
  static __device__ const float* at(const Geometry& g, const float* dy, const Fixed& f,
                                    const Red& t) {
    return f.k < g.k && t.npq < g.npq ? dy + int64_t(t.npq) * g.k + f.k : nullptr;
  }
};

// Backward-weight, B: x gathered as in the forward pass, with the roles of the indices swapped.
struct BackwardWeightX {
  static constexpr bool kVecAlongRed = false;
  using Fixed = Tap;
  using Red = Window;
  static __device__ Fixed fixed(const Geometry& g, int rsc) { return tap(g, rsc); }
  static __device__ Red red(const Geometry& g, int npq) { return window(g, npq); }
  static __device__ const float* at(const Geometry& g, const float* x, const Fixed& t,
                                    const Red& v) {
    return x_at(g, x, v, t);
  }
};

struct ForwardPass {
  using A = ForwardX;
  using B = ForwardW;
};
struct BackwardDataPass {
  using A = BackwardDataDy;
  using B = BackwardDataW;
};
struct BackwardWeightPass {
  using A = BackwardWeightDy;
  using B = BackwardWeightX;
};

// ---- tile loading -------------------------------------------------------------------------------

// Copies Bytes (4 or 16) from global to shared memory without passing through registers; with
// valid false it writes zeros and reads nothing. Complete after cp_async_wait().
template <int Bytes>
__device__ __forceinline__ void cp_async(float* dst, const float* src, bool valid) {
  const unsigned shared = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared),
               "l"(__cvta_generic_to_global(src)), "n"(Bytes), "r"(valid ? Bytes : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Moves an L x kBK slice of one operand into shared memory laid out [kBK][L + kPad]. T threads
// share the work; a thread owns kNF fixed indices (their contexts precomputed once) and kNK
// reduction indices per slice. load() starts the slice; it has landed after store() and
// cp_async_wait().
//
// Vectors along the reduction must be transposed (their 4 values go to 4 rows), so they are staged
// in registers: load() issues the global loads before the FMAs of the previous slice and store()
// writes them after. Everything else is a straight copy done by cp.async, which needs no registers:
// those hold the 8 x 8 accumulators.
template <class Src, int L, int T, bool Vec>
class TileLoader {
  static constexpr bool kStaged = Vec && Src::kVecAlongRed;
  static constexpr bool kFixedVec = Vec && !Src::kVecAlongRed;
  static constexpr int kVF = kFixedVec ? 4 : 1;  // elements per unit along the fixed index
  static constexpr int kVK = kStaged ? 4 : 1;    // ... along the reduction
  static constexpr int kUF = L / kVF, kUK = kBK / kVK;
  // Staged: the kBK/4 threads of a row are neighbours, so a warp reads whole 32-byte sectors.
  // Otherwise neighbouring threads take neighbouring fixed units: coalesced reads of the
  // fixed-contiguous operands, consecutive shared-memory words for the single floats.
  static constexpr int kTK = kStaged ? kUK : T / (T < kUF ? T : kUF);
  static constexpr int kTF = T / kTK;
  static constexpr int kNF = kUF / kTF, kNK = kUK / kTK;
  static_assert(kTF * kTK == T && kUF % kTF == 0 && kUK % kTK == 0, "tile does not split evenly");
  static_assert(L % 8 == 0, "rows of L + kPad floats must keep 16-byte alignment and bank spread");

 public:
  static constexpr int kPitch = L + kPad;

  __device__ TileLoader(const Geometry& g, int start, int tid) {
    const int uf = kStaged ? tid / kTK : tid % kTF;
    const int uk = kStaged ? tid % kTK : tid / kTF;
    f_ = uf * kVF;
    k_ = uk * kVK;
#pragma unroll
    for (int i = 0; i < kNF; ++i) fixed_[i] = Src::fixed(g, start + f_ + i * kTF * kVF);
  }

  __device__ void load(const Geometry& g, const float* src, int red_start, float* tile) {
#pragma unroll(kStaged ? kNK : 1)
    for (int j = 0; j < kNK; ++j) {
      const typename Src::Red red = Src::red(g, red_start + k_ + j * kTK * kVK);
#pragma unroll
      for (int i = 0; i < kNF; ++i) {
        const float* p = Src::at(g, src, fixed_[i], red);
        if constexpr (kStaged) {
          staged_[i][j] = p ? __ldg(reinterpret_cast<const float4*>(p)) : float4{};
        } else {
          cp_async<4 * kVF>(tile + offset(i, j), p ? p : src, p != nullptr);
        }
      }
    }
  }

  // Two threads per fixed index write rows 4 apart; kPad makes 4 * kPitch = 16 (mod 32) words, so
  // the two halves of a warp hit disjoint banks.
  __device__ void store(float* tile) const {
    if constexpr (kStaged) {
#pragma unroll
      for (int i = 0; i < kNF; ++i) {
#pragma unroll
        for (int j = 0; j < kNK; ++j) {
          float* dst = tile + offset(i, j);
          dst[0] = staged_[i][j].x;
          dst[kPitch] = staged_[i][j].y;
          dst[2 * kPitch] = staged_[i][j].z;
          dst[3 * kPitch] = staged_[i][j].w;
        }
      }
    }
  }

 private:
  __device__ int offset(int i, int j) const {
    return (k_ + j * kTK * kVK) * kPitch + f_ + i * kTF * kVF;
  }

  typename Src::Fixed fixed_[kNF];
  int f_ = 0, k_ = 0;
  float4 staged_[kStaged ? kNF : 1][kStaged ? kNK : 1];
};

// ---- the GEMM kernel ----------------------------------------------------------------------------

// What happens to a finished sum before it is stored; the same for the fused and the split paths.
struct Epilogue {
  const float* bias;  // per GEMM column (forward: per output channel), or null
  float beta;         // out = beta*out + ..., out not read when 0
  bool relu;

  __device__ float apply(float acc, int col, const float* out) const {
    float v = acc;
    if (bias) v += __ldg(bias + col);
    if (beta != 0.f) v = fmaf(beta, *out, v);
    return relu && v <= 0.f ? 0.f : v;  // kernels/elementwise.h's ReLU: NaN kept, -0 to +0
  }
  __device__ float4 apply(float4 acc, int col, const float* out) const {
    return {apply(acc.x, col, out), apply(acc.y, col + 1, out + 1), apply(acc.z, col + 2, out + 2),
            apply(acc.w, col + 3, out + 3)};
  }
};

struct GemmArgs {
  Geometry g;
  const float* a;  // the A and B sources' base pointers
  const float* b;
  float* out;      // M x N row-major: y, dx or dw
  float* partial;  // split x M x N partial sums when gridDim.y > 1
  Epilogue epilogue;
  int m, n, red;
  int tiles_n;      // column tiles; blockIdx.x = row tile * tiles_n + column tile
  int slice_tiles;  // kBK-slices per split of the reduction
  bool vec_out;     // n % 4 == 0 and out 16-byte aligned
};

// Which rows and columns of the block tile a thread owns: rows ty*4 + [0,4) and BM/2 + ty*4 +
// [0,4), columns likewise. A warp covers ly x lx threads (8 wide where the tile allows) so that its
// A and B fragment loads touch 4 x 16 and 8 x 16 contiguous bytes: one shared-memory wavefront
// each.
template <int BM, int BN>
struct ThreadTile {
  static constexpr int kTX = BN / 8, kTY = BM / 8;
  static constexpr int kLX = kTX < 8 ? kTX : 8, kLY = 32 / kLX;
  static_assert(kTX % kLX == 0 && kTY % kLY == 0 && kTX * kTY % 32 == 0,
                "tile must be whole warps");
  int tx, ty;
  __device__ explicit ThreadTile(int tid) {
    const int lane = tid % 32, warp = tid / 32;
    tx = (warp % (kTX / kLX)) * kLX + lane % kLX;
    ty = (warp / (kTX / kLX)) * kLY + lane / kLX;
  }
};

__device__ __forceinline__ void unpack(float4 lo, float4 hi, float (&v)[8]) {
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
  v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

// One block per (BM x BN output tile, slice of the reduction). The launch bounds cap registers at
// 65536 / 512 = 128 per thread, so that 512 threads (2 blocks of 256, 4 of 128) share an SM.
template <class Pass, int BM, int BN, bool Vec>
__global__ void __launch_bounds__(threads_for(BM, BN), 512 / threads_for(BM, BN))
    conv_gemm_kernel(const GemmArgs args) {
  kernel_entry();
  constexpr int kThreads = threads_for(BM, BN);
  using LoaderA = TileLoader<typename Pass::A, BM, kThreads, Vec>;
  using LoaderB = TileLoader<typename Pass::B, BN, kThreads, Vec>;
  __shared__ __align__(16) float a_tile[2][kBK * LoaderA::kPitch];
  __shared__ __align__(16) float b_tile[2][kBK * LoaderB::kPitch];

  const Geometry& g = args.g;
  // Column tiles vary fastest, so the blocks that share an A tile (the large gathered operand of
  // the forward and backward-data passes) run at the same time and read it once from DRAM.
  const int m0 = int(blockIdx.x / args.tiles_n) * BM;
  const int n0 = int(blockIdx.x % args.tiles_n) * BN;
  const int t_begin = int(blockIdx.y) * args.slice_tiles;
  const int t_end = min(t_begin + args.slice_tiles, ceil_div(args.red, kBK));

  LoaderA loader_a(g, m0, threadIdx.x);
  LoaderB loader_b(g, n0, threadIdx.x);
  const ThreadTile<BM, BN> tt(threadIdx.x);

  float acc[8][8] = {};
  loader_a.load(g, args.a, t_begin * kBK, a_tile[0]);
  loader_b.load(g, args.b, t_begin * kBK, b_tile[0]);
  loader_a.store(a_tile[0]);
  loader_b.store(b_tile[0]);
  cp_async_wait();
  __syncthreads();

  for (int t = t_begin; t < t_end; ++t) {
    const int buf = (t - t_begin) & 1;
    const bool more = t + 1 < t_end;
    // The other buffer was last read in the previous iteration, before its closing barrier.
    if (more) {
      loader_a.load(g, args.a, (t + 1) * kBK, a_tile[buf ^ 1]);
      loader_b.load(g, args.b, (t + 1) * kBK, b_tile[buf ^ 1]);
    }
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      const float* a_row = a_tile[buf] + kk * LoaderA::kPitch + tt.ty * 4;
      const float* b_row = b_tile[buf] + kk * LoaderB::kPitch + tt.tx * 4;
      float a[8], b[8];
      unpack(*reinterpret_cast<const float4*>(a_row),
             *reinterpret_cast<const float4*>(a_row + BM / 2), a);
      unpack(*reinterpret_cast<const float4*>(b_row),
             *reinterpret_cast<const float4*>(b_row + BN / 2), b);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
    }
    if (more) {
      loader_a.store(a_tile[buf ^ 1]);
      loader_b.store(b_tile[buf ^ 1]);
    }
    cp_async_wait();
    __syncthreads();
  }

  const bool split = gridDim.y > 1;
  float* const out = split ? args.partial + int64_t(blockIdx.y) * args.m * args.n : args.out;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = m0 + (i / 4) * (BM / 2) + tt.ty * 4 + i % 4;
    if (row >= args.m) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = n0 + half * (BN / 2) + tt.tx * 4;
      float* dst = out + int64_t(row) * args.n + col;
      const float* v = &acc[i][half * 4];
      if (args.vec_out) {
        if (col >= args.n) continue;
        const float4 sum = {v[0], v[1], v[2], v[3]};
        *reinterpret_cast<float4*>(dst) = split ? sum : args.epilogue.apply(sum, col, dst);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (col + j < args.n) dst[j] = split ? v[j] : args.epilogue.apply(v[j], col + j, dst + j);
        }
      }
    }
  }
}

// out[i] = epilogue(sum over s of partial[s][i]), summed in order s = 0, 1, ... (deterministic).
template <bool Vec>
__global__ void split_reduce_kernel(const float* partial, int splits, int64_t mn, int n, float* out,
                                    Epilogue epilogue) {
  kernel_entry();
  using Value = std::conditional_t<Vec, float4, float>;
  constexpr int kWidth = Vec ? 4 : 1;
  const auto* in = reinterpret_cast<const Value*>(partial);
  auto* dst = reinterpret_cast<Value*>(out);
  const int64_t count = mn / kWidth;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    Value sum = in[i];
    for (int s = 1; s < splits; ++s) {
      const Value v = in[s * count + i];
      if constexpr (Vec) {
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
      } else {
        sum += v;
      }
    }
    dst[i] = epilogue.apply(sum, int(i * kWidth % n), out + i * kWidth);
  }
}

// ---- backward-data for the first layer ----------------------------------------------------------
constexpr int kStrip = 8;          // neighbouring output pixels (along w) per thread
constexpr int kNarrowChunk = 128;  // output channels k staged in shared memory at a time
constexpr int kNarrowThreads = 128;

__device__ __forceinline__ float component(float4 v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// dx[n][h][w0 + j][c] = sum over r, s, k of dy[n][h + pad_h - r][w0 + j + pad_w - s][k]
// w[k][r][s][c] for S = 3, stride 1, C <= 4 (channels padded to a float4). For each r and k, the
// thread loads the kStrip + 2 dy values its strip touches and uses each for up to 3 taps x 4 k x
// kStrip pixels. w[k][r][s][:] for the current r and k-chunk sits in shared memory (every thread
// reads the same word: a broadcast).
__global__ void __launch_bounds__(kNarrowThreads)
    backward_data_narrow_kernel(const Geometry g, const float* dy, const float* w, float* dx) {
  kernel_entry();
  __shared__ float4 w_tile[3][kNarrowChunk];
  const int strips = ceil_div(g.w, kStrip);
  const int64_t idx = int64_t(blockIdx.x) * kNarrowThreads + threadIdx.x;
  const bool valid = idx < int64_t(g.n) * g.h * strips;
  const int w0 = int(idx % strips) * kStrip;
  const int h = int(idx / strips % g.h);
  const int64_t n = idx / strips / g.h;

  float4 acc[kStrip] = {};
  for (int r = 0; r < g.r; ++r) {
    const int p = h + g.pad_h - r;
    const bool row_ok = valid && unsigned(p) < unsigned(g.p);
    const int64_t row = (n * g.p + p) * g.q * g.k;  // dy[n][p][0][0], used only when row_ok
    for (int k0 = 0; k0 < g.k; k0 += kNarrowChunk) {
      const int kn = min(kNarrowChunk, g.k - k0);
      __syncthreads();  // everyone is done with the previous chunk
      for (int e = threadIdx.x; e < 3 * kNarrowChunk; e += kNarrowThreads) {
        const int s = e / kNarrowChunk, kk = e % kNarrowChunk;
        float4 v = {};
        if (kk < kn) {
          const float* src = w + ((int64_t(k0 + kk) * g.r + r) * 3 + s) * g.c;
          v.x = __ldg(src);
          if (g.c > 1) v.y = __ldg(src + 1);
          if (g.c > 2) v.z = __ldg(src + 2);
          if (g.c > 3) v.w = __ldg(src + 3);
        }
        w_tile[s][kk] = v;
      }
      __syncthreads();
      if (!row_ok) continue;
      for (int kk = 0; kk < kn; kk += 4) {
        float4 d[kStrip + 2];  // dy at q = w0 + pad_w - 2 + t
#pragma unroll
        for (int t = 0; t < kStrip + 2; ++t) {
          const int q = w0 + g.pad_w - 2 + t;
          d[t] = unsigned(q) < unsigned(g.q)
                     ? __ldg(reinterpret_cast<const float4*>(dy + row + int64_t(q) * g.k + k0 + kk))
                     : float4{};
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
          for (int s = 0; s < 3; ++s) {
            const float4 wv = w_tile[s][kk + e];
#pragma unroll
            for (int j = 0; j < kStrip; ++j) {
              const float dv = component(d[j + 2 - s], e);
              acc[j].x = fmaf(dv, wv.x, acc[j].x);
              acc[j].y = fmaf(dv, wv.y, acc[j].y);
              acc[j].z = fmaf(dv, wv.z, acc[j].z);
              acc[j].w = fmaf(dv, wv.w, acc[j].w);
            }
          }
        }
      }
    }
  }
  if (!valid) return;
  for (int j = 0; j < kStrip && w0 + j < g.w; ++j) {
    float* dst = dx + ((n * g.h + h) * g.w + w0 + j) * g.c;
    for (int c = 0; c < g.c; ++c) dst[c] = component(acc[j], c);
  }
}

// ---- host side ----------------------------------------------------------------------------------

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void check_call(const char* name, const Conv2dShape& shape, Math math) {
  shape.validate();
  CUDP_CHECK(math == Math::FP32, name, ": math ", math_name(math),
             " is not implemented for this pass yet; use Math::FP32");
}

void check_converted(const char* name, Math math, const Bf16Operands& converted) {
  CUDP_CHECK(math == Math::BF16 || (!converted.x && !converted.dy), name,
             ": converted operands are bf16 copies and go with Math::BF16 only, got Math::",
             math_name(math));
}

int multiprocessors() {
  int device = 0, count = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// How many slices to cut the reduction into, given `tiles` output tiles, `slices` kBK-slices of
// reduction, room for `resident` blocks at once, and `partial_bytes` of workspace per slice. The
// cost model counts slices on the critical path: waves of resident blocks times slices per block,
// plus a flat charge for the reduction pass. Among splits within 5% of the best we take the
// smallest (least workspace). Each slice of the reduction keeps at least kMinSlices so that
// per-block set-up stays small, the workspace stays under kMaxWorkspace, and beyond kMaxSplit
// (several waves of the smallest blocks on any current GPU) more slices gain nothing.
int choose_split(int tiles, int slices, int resident, int64_t partial_bytes) {
  constexpr int kMinSlices = 16, kReduceCost = 4, kMaxSplit = 8192;
  constexpr int64_t kMaxWorkspace = int64_t(128) << 20;
  const int max_split = int(std::clamp<int64_t>(
      std::min<int64_t>(slices / kMinSlices, kMaxWorkspace / partial_bytes), 1, kMaxSplit));
  const auto cost = [&](int split) {
    const int64_t waves = (int64_t(tiles) * split + resident - 1) / resident;
    return waves * ceil_div(slices, split) + (split > 1 ? kReduceCost : 0);
  };
  int64_t best = cost(1);
  for (int split = 2; split <= max_split; ++split) best = std::min(best, cost(split));
  int split = 1;
  while (cost(split) * 100 > best * 105) ++split;
  return split;
}


template <class Pass, int BM, int BN, bool Vec>
void run_gemm(GemmArgs args, cudaStream_t stream) {
  constexpr int kThreads = threads_for(BM, BN);
  const auto kernel = conv_gemm_kernel<Pass, BM, BN, Vec>;
  args.tiles_n = ceil_div(args.n, BN);
  const int tiles = ceil_div(args.m, BM) * args.tiles_n;
  const int slices = ceil_div(args.red, kBK);
  int per_sm = 0;
  CUDP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  const int64_t mn = int64_t(args.m) * args.n;
  args.slice_tiles = ceil_div(
      slices, choose_split(tiles, slices, per_sm * multiprocessors(), mn * int64_t(sizeof(float))));
  const int split = ceil_div(slices, args.slice_tiles);  // no empty slices
  const dim3 grid(tiles, split);
  if (split == 1) {
    launch("conv_gemm_kernel", kernel, grid, kThreads, 0, stream, args);
    return;
  }
  Workspace partial(size_t(split) * mn * sizeof(float), stream,
                    "the convolution's split-K partial sums");
  args.partial = partial.get();
  launch("conv_gemm_kernel", kernel, grid, kThreads, 0, stream, args);
  constexpr int kReduceThreads = 256;
  const int64_t items = args.vec_out ? mn / 4 : mn;
  const unsigned blocks = std::min<unsigned>(grid_for(items, kReduceThreads), 4096u);
  if (args.vec_out) {
    launch("split_reduce_kernel", split_reduce_kernel<true>, blocks, kReduceThreads, 0, stream,
           args.partial, split, mn, args.n, args.out, args.epilogue);
  } else {
    launch("split_reduce_kernel", split_reduce_kernel<false>, blocks, kReduceThreads, 0, stream,
           args.partial, split, mn, args.n, args.out, args.epilogue);
  }
}

template <class Pass, int BM, int BN>
void run_gemm(bool vec, const GemmArgs& args, cudaStream_t stream) {
  if (vec) {
    run_gemm<Pass, BM, BN, true>(args, stream);
  } else {
    run_gemm<Pass, BM, BN, false>(args, stream);
  }
}

GemmArgs gemm_args(const Conv2dShape& shape, const float* a, const float* b, float* out,
                   Epilogue epilogue, int m, int n, int red) {
  return {
      Geometry(shape), a, b, out, nullptr, epilogue, m, n, red, 0, 0, n % 4 == 0 && aligned16(out)};
}

}  // namespace

void conv2d_forward(const Conv2dShape& shape, const float* x, const float* w, const float* bias,
                    float* y, bool relu, cudaStream_t stream, Math math,
                    const Bf16Operands& converted) {
  check_converted("conv2d_forward", math, converted);
  if (math != Math::FP32) {
    detail::conv2d_forward_tc_f32(shape, x, w, bias, y, relu, stream, math, converted);
    return;
  }
  check_call("conv2d_forward", shape, math);
  CUDP_CHECK(x && w && y, "conv2d_forward: x, w and y must not be null");
  const GemmArgs args =
      gemm_args(shape, x, w, y, {bias, 0.f, relu}, shape.n * shape.p() * shape.q(), shape.k,
                shape.r * shape.s * shape.c);
  const bool vec = shape.c % 4 == 0 && aligned16(x) && aligned16(w);
  // 64-wide column tiles for 64 or fewer output channels (VGG's first block) waste nothing there.
  if (shape.k <= 64) {
    run_gemm<ForwardPass, 128, 64>(vec, args, stream);
  } else {
    run_gemm<ForwardPass, 128, 128>(vec, args, stream);
  }
}

void conv2d_backward_data(const Conv2dShape& shape, const float* dy, const float* w, float* dx,
                          cudaStream_t stream, Math math, const Bf16Operands& converted) {
  check_converted("conv2d_backward_data", math, converted);
  if (math != Math::FP32) {
    detail::conv2d_backward_data_tc_f32(shape, dy, w, dx, stream, math, converted);
    return;
  }
  check_call("conv2d_backward_data", shape, math);
  CUDP_CHECK(dy && w && dx, "conv2d_backward_data: dy, w and dx must not be null");
  if (shape.c <= 4 && shape.s == 3 && shape.stride_h == 1 && shape.stride_w == 1 &&
      shape.k % 4 == 0 && aligned16(dy)) {
    const int64_t threads = int64_t(shape.n) * shape.h * ceil_div(shape.w, kStrip);
    launch("backward_data_narrow_kernel", backward_data_narrow_kernel,
           grid_for(threads, kNarrowThreads), kNarrowThreads, 0, stream, Geometry(shape), dy, w,
           dx);
    return;
  }
  const GemmArgs args =
      gemm_args(shape, dy, w, dx, {nullptr, 0.f, false}, shape.n * shape.h * shape.w, shape.c,
                shape.r * shape.s * shape.k);
  const bool vec = shape.k % 4 == 0 && shape.c % 4 == 0 && aligned16(dy) && aligned16(w);
  if (shape.c <= 64) {
    run_gemm<BackwardDataPass, 128, 64>(vec, args, stream);
  } else {
    run_gemm<BackwardDataPass, 128, 128>(vec, args, stream);
  }
}

void conv2d_backward_weight(const Conv2dShape& shape, const float* x, const float* dy, float* dw,
                            float beta, cudaStream_t stream, Math math,
                            const Bf16Operands& converted, float* dbias) {
  check_converted("conv2d_backward_weight", math, converted);
  if (math == Math::BF16) {  // dy as the bf16 product reads it: the launcher takes dbias along
    detail::conv2d_backward_weight_tc_f32(shape, x, dy, dw, beta, stream, math, converted, dbias);
    return;
  }
  if (math == Math::TF32) {
    detail::conv2d_backward_weight_tc_f32(shape, x, dy, dw, beta, stream, math, converted, nullptr);
  } else {
    check_call("conv2d_backward_weight", shape, math);
    CUDP_CHECK(x && dy && dw, "conv2d_backward_weight: x, dy and dw must not be null");
    const GemmArgs args = gemm_args(shape, dy, x, dw, {nullptr, beta, false}, shape.k,
                                    shape.r * shape.s * shape.c, shape.n * shape.p() * shape.q());
    const bool vec = shape.k % 4 == 0 && shape.c % 4 == 0 && aligned16(x) && aligned16(dy);
    // Rows are output channels: 64-row tiles for VGG's first block, and 32-wide column tiles for
    // the first layer's 27 taps.
    if (shape.k > 64) {
      run_gemm<BackwardWeightPass, 128, 128>(vec, args, stream);
    } else if (args.n > 32) {
      run_gemm<BackwardWeightPass, 64, 128>(vec, args, stream);
    } else {
      run_gemm<BackwardWeightPass, 64, 32>(vec, args, stream);
    }
  }
  // fp32 dy (FP32, TF32): the bias gradient is the reduction of dy as it is.
  if (dbias) bias_grad(dy, dbias, int64_t(shape.n) * shape.p() * shape.q(), shape.k, 1.f, stream);
}

}  // namespace cudp::kernels
