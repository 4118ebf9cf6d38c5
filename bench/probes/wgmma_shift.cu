// probe_wgmma_shift: which shared-memory descriptors let one wgmma read its A operand from a
// 128-byte-swizzled buffer at a row offset that is not a multiple of the 8-row swizzle atom.
//
// The question behind it (bench/NOTES-tensor-cores.md, "Halo tiles"): a convolution tile could load
// its input patch once, with its border, and read the nine taps as views shifted by whole pixels
// (one pixel = one 128-byte row of 64 bf16 channels). A shift of one pixel moves the view's start
// by 128 bytes, so its rows no longer start at the swizzle pattern's phase 0; the descriptor's
// "matrix base offset" field (bits 49-51) is documented for such starts. A view of a patch 8 pixels
// wide whose rows are 10 pixels apart (the border) also needs a stride-byte offset of 1,280 bytes
// between 8-row groups instead of 1,024; a box 16 pixels wide, 2,048 (every group at the phase of
// the first).
//
// The probe fills a buffer the way TMA's 128-byte swizzle writes one (16-byte chunk c of a row at
// byte address a lands at chunk c ^ ((a >> 7) & 7)), and for each row shift s (0..15), each
// stride-byte offset (1,024, 1,280 and 2,048) and each base offset (0..7) runs one m64n64k16
// product over K = 64 (four k16 steps, the start advanced 32 bytes each, as the kernels do) and
// compares it with the host's product of the rows the view should see. Small integers: every sum is
// exact. It prints which base offsets reproduce the reference for each shift. Exit 1 only if the
// layout every kernel uses today (shift 0, 1,024, base offset 0) fails: then the probe itself is
// wrong.
//
//   build/bench/probe_wgmma_shift
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/probes/probe.h"

#include "kernels/sm90/wgmma.cuh"

namespace {

constexpr int kRows = 160;  // rows of X, the buffer views are taken from
constexpr int kK = 64;      // bf16 per row: 128 bytes
constexpr int kN = 64;      // B: 64 rows (n) of 64 k
constexpr int kM = 64;      // one warpgroup's product

constexpr char kProbe[] = "probe_wgmma_shift";  // for PROBE_CHECK

__device__ uint64_t descriptor(uint32_t addr, uint32_t stride, uint32_t base_offset) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) |
         (uint64_t(stride >> 4) << 32) | (uint64_t(base_offset & 7) << 49) | (uint64_t(1) << 62);
}

// Writes `rows` x 64 bf16 from global memory into shared memory at `base` (1,024-byte aligned) as
// TMA's 128-byte swizzle would.
__device__ void store_swizzled(uint8_t* base, const __nv_bfloat16* src, int rows) {
  const uint32_t base_addr = static_cast<uint32_t>(__cvta_generic_to_shared(base));
  for (int i = threadIdx.x; i < rows * 8; i += blockDim.x) {
    const int row = i / 8, chunk = i % 8;
    const uint32_t row_addr = base_addr + 128u * row;
    const int phys = chunk ^ static_cast<int>((row_addr >> 7) & 7);
    const uint4 v = reinterpret_cast<const uint4*>(src + row * kK)[chunk];
    *reinterpret_cast<uint4*>(base + 128 * row + 16 * phys) = v;
  }
}

__global__ void __launch_bounds__(128) probe(const __nv_bfloat16* x, const __nv_bfloat16* b,
                                             float* out, int shift, int stride, int base_offset) {
  extern __shared__ uint8_t raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  uint8_t* xs = smem;                // kRows rows of 128 bytes
  uint8_t* bs = smem + kRows * 128;  // kN rows of 128 bytes, 1,024-byte aligned
  store_swizzled(xs, x, kRows);
  store_swizzled(bs, b, kN);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes -> wgmma reads
  __syncthreads();

  const uint32_t a_addr = static_cast<uint32_t>(__cvta_generic_to_shared(xs)) + 128u * shift;
  const uint32_t b_addr = static_cast<uint32_t>(__cvta_generic_to_shared(bs));
  float d[32];
  for (float& v : d) v = 0.f;
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  for (int kk = 0; kk < kK / 16; ++kk) {
    cudp::kernels::sm90::WgmmaBf16<64>::mma(d, descriptor(a_addr + 32 * kk, stride, base_offset),
                                            descriptor(b_addr + 32 * kk, 1024, 0), 1);
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");

  // The accumulator layout of m64nNk16: warp w, lane l hold rows 16w + l/4 (+8) and columns
  // 8j + 2(l%4) (+1).
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = 0; i < 32; ++i) {
    const int row = 16 * warp + lane / 4 + 8 * ((i / 2) % 2);
    const int col = 8 * (i / 4) + 2 * (lane % 4) + (i % 2);
    out[row * kN + col] = d[i];
  }
}

}  // namespace

int main(int argc, char** argv) {
  probe_command_line(
      kProbe,
      "which shared-memory descriptor base offsets let wgmma read a 128-byte-swizzled operand from "
      "a view shifted by whole 128-byte rows (what halo tiles rely on)",
      argc, argv);
  cudaDeviceProp prop{};
  if (!probe_sm90_device(kProbe, "wgmma", &prop)) return cudp::bench::kExitUsage;

  std::vector<float> xf(kRows * kK), bf(kN * kK);
  uint32_t state = 12345;
  const auto small = [&] {  // -3..3: every product sum is exact in fp32
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int>((state >> 16) % 7) - 3);
  };
  for (float& v : xf) v = small();
  for (float& v : bf) v = small();
  std::vector<__nv_bfloat16> xh(xf.size()), bh(bf.size());
  for (size_t i = 0; i < xf.size(); ++i) xh[i] = __float2bfloat16(xf[i]);
  for (size_t i = 0; i < bf.size(); ++i) bh[i] = __float2bfloat16(bf[i]);

  __nv_bfloat16 *x = nullptr, *b = nullptr;
  float* out = nullptr;
  PROBE_CHECK(cudaMalloc(&x, xh.size() * sizeof(__nv_bfloat16)));
  PROBE_CHECK(cudaMalloc(&b, bh.size() * sizeof(__nv_bfloat16)));
  PROBE_CHECK(cudaMalloc(&out, kM * kN * sizeof(float)));
  PROBE_CHECK(cudaMemcpy(x, xh.data(), xh.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  PROBE_CHECK(cudaMemcpy(b, bh.data(), bh.size() * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  const size_t smem_bytes = 1024 + (kRows + kN) * 128;

  bool canonical_ok = false;
  constexpr int kStrides[] = {1024, 1280, 2048};
  std::printf(
      "base offsets (0..7) whose product matches the reference, by row shift and stride-byte "
      "offset\n%9s | %-24s | %-24s | %s\n",
      "row shift", "stride 1024", "stride 1280", "stride 2048");
  std::vector<float> got(kM * kN);
  for (int shift = 0; shift < 16; ++shift) {
    std::string cells[3];
    for (int s = 0; s < 3; ++s) {
      const int stride = kStrides[s];
      for (int base_offset = 0; base_offset < 8; ++base_offset) {
        PROBE_CHECK(cudaMemset(out, 0xFF, kM * kN * sizeof(float)));
        probe<<<1, 128, smem_bytes>>>(x, b, out, shift, stride, base_offset);
        PROBE_CHECK(cudaGetLastError());
        PROBE_CHECK(cudaDeviceSynchronize());
        PROBE_CHECK(
            cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
        int wrong = 0;
        for (int m = 0; m < kM; ++m) {
          const int row = shift + (m / 8) * (stride / 128) + m % 8;  // the X row view row m is
          for (int n = 0; n < kN; ++n) {
            float ref = 0.f;
            for (int k = 0; k < kK; ++k) ref += xf[row * kK + k] * bf[n * kK + k];
            wrong += got[m * kN + n] != ref;
          }
        }
        if (wrong == 0) cells[s] += std::to_string(base_offset) + " ";
        if (wrong == 0 && shift == 0 && stride == 1024 && base_offset == 0) canonical_ok = true;
      }
      if (cells[s].empty()) cells[s] = "none";
    }
    std::printf("%9d | %-24s | %-24s | %s\n", shift, cells[0].c_str(), cells[1].c_str(),
                cells[2].c_str());
  }
  std::printf(
      "reading: if the swizzle follows the absolute address, base offset 0 matches at every "
      "shift; if it follows the offset from the view's start, the base offset that matches is "
      "the shift %% 8 (the buffer is 1,024-byte aligned)\n");
  cudaFree(x);
  cudaFree(b);
  cudaFree(out);
  if (!canonical_ok) {
    std::printf(
        "probe_wgmma_shift: the canonical layout (shift 0, stride 1024, base offset 0) did "
        "not match: the probe is wrong\n");
    return 1;
  }
  return 0;
}
