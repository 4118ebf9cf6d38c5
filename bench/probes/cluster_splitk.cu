// probe_cluster_splitk: what summing a split-K product's partial tiles through distributed shared
// memory would cost, against what the library does today.
//
// The question behind it (bench/NOTES-tensor-cores.md, session 33): at 32² the late layers'
// products are split along k (4 splits at 2 x 2 images, 3 to 26 for backward-weight), each split
// writing a 128-row fp32 partial tile to a workspace and splitk_reduce_kernel adding them up in
// split order in a launch of its own: 13 launches and ~0.10 ms of a 1.5 ms step under ncu. Session
// 27's in-kernel sum (the last split to arrive reads every split's slice, one warp a slice) was
// twice as slow, because at one wave every split finishes at once and a fraction of the warps did
// all the reading. With the splits of a tile as the CTAs of one cluster, all of them are resident
// together by construction: each keeps its accumulators in its own shared memory, the cluster waits
// once, and CTA r adds up row slice r of the tile over every CTA's shared memory, in split order,
// as the reduction kernel does (so the same bits), and stores it. Every CTA of the cluster reads,
// and nothing goes through the workspace.
//
// The probe times, for S = 2, 4, 8 splits, tiles 128 x 128 and 128 x 256 (fp32 partials), and 16
// or 32 tiles (the 2 x 2 and 4 x 4 layers' counts at batch 256):
//   cluster: one launch of clusters of S CTAs: each CTA writes its partial tile (values made from
//            its coordinates, standing in for the accumulators) to its shared memory, the cluster
//            syncs, each CTA sums its 128 / S rows over the S CTAs' tiles and writes them in bf16;
//   today:   the same partials written to a global workspace [split][m][n] by one kernel, then a
//            reduction kernel like splitk_reduce_kernel (the sum in split order from 0.f, one
//            element a thread), in two launches on one stream;
// and checks that both give the same bf16 output, bit for bit, with values whose sums round (a
// third output, summed in reverse order, must differ somewhere from 3 splits on, or the check would
// not show the order). Each path is captured 50 times into one CUDA graph, as a training step's
// graph holds it, and the two graphs' windows alternate (11 each): it prints the median
// microseconds per sum, their ratio, and how many of the clusters the GPU holds at once
// (cudaOccupancyMaxActiveClusters). The partial tile of a real product lives in registers: writing
// it to shared memory is part of the cluster's cost here, as writing it to the workspace is part of
// today's (whose writing kernel, unlike a persistent product, may run several CTAs an SM: slightly
// in today's favour). Not measured: the product's mainloop beside the sum.
//
//   build/bench/probe_cluster_splitk
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench/probes/probe.h"

namespace {

constexpr int kTileM = 128;
constexpr int kThreads = 256;  // the product's two consumer warpgroups

constexpr char kProbe[] = "probe_cluster_splitk";  // for PROBE_CHECK

// The stand-in for split `split`'s accumulator of element (row, col) of tile `tile`: full
// mantissas of both signs over 16 binades, so that the fp32 sums round and their order shows in
// the bits (the probe checks that it does).
__device__ __forceinline__ float partial_value(int tile, int split, int row, int col) {
  uint32_t h = uint32_t(tile) * 0x9E3779B1u ^ uint32_t(split) * 0x85EBCA77u ^
               uint32_t(row) * 0xC2B2AE3Du ^ uint32_t(col) * 0x27D4EB2Fu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 13;
  h *= 0x297A2D39u;
  h ^= h >> 16;
  return (float(h) - 2147483648.f) * 0x1p-31f * exp2f(float(int(h >> 28)) - 8.f);
}

__device__ __forceinline__ void cluster_barrier() {  // release our writes, acquire the others'
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

// One cluster of kSplits CTAs per tile; the output is tiles x (128 x n) bf16, row-major per tile.
// The peers' tiles are read with ld.shared::cluster at mapa addresses, as a product's epilogue
// would (a generic pointer from cooperative_groups' map_shared_rank compiles to generic loads).
template <int kSplits>
__global__ void __launch_bounds__(kThreads, 1) cluster_sum(int n, __nv_bfloat16* out) {
  extern __shared__ float4 partial4[];  // 128 x n floats
  float* partial = reinterpret_cast<float*>(partial4);
  uint32_t split = 0;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(split));
  const int tile = static_cast<int>(blockIdx.x) / kSplits;
  for (int i = threadIdx.x; i < kTileM * n; i += kThreads) {
    partial[i] = partial_value(tile, int(split), i / n, i % n);
  }
  cluster_barrier();  // every split's tile is in its shared memory
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(partial4));
  uint32_t peers[kSplits];
#pragma unroll
  for (int s = 0; s < kSplits; ++s) {
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peers[s]) : "r"(local), "r"(s));
  }
  const int rows = kTileM / kSplits;
  const int first = int(split) * rows * n / 4;  // this CTA's slice, in float4s
  for (int i = threadIdx.x; i < rows * n / 4; i += kThreads) {
    const uint32_t offset = uint32_t(first + i) * 16u;
    float4 v[kSplits];
#pragma unroll
    for (int s = 0; s < kSplits; ++s) {  // all loads first
      asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(v[s].x), "=f"(v[s].y), "=f"(v[s].z), "=f"(v[s].w)
                   : "r"(peers[s] + offset));
    }
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < kSplits; ++s) {  // then the sums in split order, from 0.f
      sum.x += v[s].x;
      sum.y += v[s].y;
      sum.z += v[s].z;
      sum.w += v[s].w;
    }
    const __nv_bfloat162 lo = __floats2bfloat162_rn(sum.x, sum.y);
    const __nv_bfloat162 hi = __floats2bfloat162_rn(sum.z, sum.w);
    uint2 packed;
    memcpy(&packed.x, &lo, 4);
    memcpy(&packed.y, &hi, 4);
    reinterpret_cast<uint2*>(out + int64_t(tile) * kTileM * n)[first + i] = packed;
  }
  cluster_barrier();  // no CTA leaves while another still reads its shared memory
}

// Today's first half: every (tile, split) CTA writes its partial to ws[split][tile rows][n].
__global__ void __launch_bounds__(kThreads)
    write_partials(int splits, int tiles, int n, float* ws) {
  const int tile = static_cast<int>(blockIdx.x) / splits;
  const int split = static_cast<int>(blockIdx.x) % splits;
  float* dst = ws + (int64_t(split) * tiles + tile) * kTileM * n;
  for (int i = threadIdx.x; i < kTileM * n; i += kThreads) {
    dst[i] = partial_value(tile, split, i / n, i % n);
  }
}

// Today's second half, as splitk_reduce_kernel (kernels/matmul.cu) does it without an epilogue.
// `reversed` sums the splits last to first: only for the check that the order shows in the bits.
__global__ void reduce(const float* __restrict__ ws, int splits, int64_t total, __nv_bfloat16* out,
                       bool reversed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) sum += ws[int64_t(reversed ? splits - 1 - s : s) * total + i];
    out[i] = __float2bfloat16_rn(sum);
  }
}

// `launch` (work on `stream`) 50 times as one CUDA graph: what a training step's graph holds.
template <typename Launch>
cudaGraphExec_t capture(cudaStream_t stream, Launch launch) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  PROBE_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 50; ++i) launch();
  PROBE_CHECK(cudaStreamEndCapture(stream, &graph));
  PROBE_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  PROBE_CHECK(cudaGraphDestroy(graph));
  return exec;
}

// The median microseconds of one iteration of each graph, their windows alternating (11 each,
// after 3 launches of each to warm up).
void median_us(cudaStream_t stream, cudaGraphExec_t a, cudaGraphExec_t b, float& us_a,
               float& us_b) {
  cudaEvent_t start, stop;
  PROBE_CHECK(cudaEventCreate(&start));
  PROBE_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) {
    PROBE_CHECK(cudaGraphLaunch(a, stream));
    PROBE_CHECK(cudaGraphLaunch(b, stream));
  }
  std::vector<float> times[2];
  for (int w = 0; w < 11; ++w) {
    for (int which = 0; which < 2; ++which) {
      PROBE_CHECK(cudaEventRecord(start, stream));
      PROBE_CHECK(cudaGraphLaunch(which == 0 ? a : b, stream));
      PROBE_CHECK(cudaEventRecord(stop, stream));
      PROBE_CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      PROBE_CHECK(cudaEventElapsedTime(&ms, start, stop));
      times[which].push_back(ms * 1000.f / 50);
    }
  }
  PROBE_CHECK(cudaEventDestroy(start));
  PROBE_CHECK(cudaEventDestroy(stop));
  for (auto& t : times) std::sort(t.begin(), t.end());
  us_a = times[0][5];
  us_b = times[1][5];
}

template <int kSplits>
bool run(int tiles, int n) {
  const int64_t total = int64_t(tiles) * kTileM * n;
  const size_t smem = size_t(kTileM) * n * sizeof(float);
  __nv_bfloat16 *out_cluster = nullptr, *out_today = nullptr, *out_reversed = nullptr;
  float* ws = nullptr;
  PROBE_CHECK(cudaMalloc(&out_cluster, total * sizeof(__nv_bfloat16)));
  PROBE_CHECK(cudaMalloc(&out_today, total * sizeof(__nv_bfloat16)));
  PROBE_CHECK(cudaMalloc(&out_reversed, total * sizeof(__nv_bfloat16)));
  PROBE_CHECK(cudaMalloc(&ws, total * kSplits * sizeof(float)));
  PROBE_CHECK(cudaFuncSetAttribute(cluster_sum<kSplits>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));

  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = kSplits;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(tiles * kSplits));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.attrs = &attr;
  config.numAttrs = 1;
  cudaStream_t stream = nullptr;
  PROBE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto cluster = [&] {
    PROBE_CHECK(cudaLaunchKernelEx(&config, cluster_sum<kSplits>, n, out_cluster));
  };
  config.stream = stream;
  int clusters = 0;  // how many such clusters the GPU holds at once
  PROBE_CHECK(cudaOccupancyMaxActiveClusters(&clusters, cluster_sum<kSplits>, &config));
  const unsigned reduce_blocks = unsigned(std::min<int64_t>((total + 255) / 256, 65536));
  const auto today = [&](__nv_bfloat16* out, bool reversed) {
    write_partials<<<tiles * kSplits, kThreads, 0, stream>>>(kSplits, tiles, n, ws);
    reduce<<<reduce_blocks, 256, 0, stream>>>(ws, kSplits, total, out, reversed);
    PROBE_CHECK(cudaGetLastError());
  };

  // Every output poisoned differently, so that an element a path leaves unwritten differs.
  PROBE_CHECK(cudaMemsetAsync(out_cluster, 0xFF, total * sizeof(__nv_bfloat16), stream));
  PROBE_CHECK(cudaMemsetAsync(out_today, 0x7F, total * sizeof(__nv_bfloat16), stream));
  PROBE_CHECK(cudaMemsetAsync(out_reversed, 0x3F, total * sizeof(__nv_bfloat16), stream));
  cluster();
  today(out_today, false);
  today(out_reversed, true);
  PROBE_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> a(total), b(total), r(total);
  PROBE_CHECK(cudaMemcpy(a.data(), out_cluster, total * 2, cudaMemcpyDeviceToHost));
  PROBE_CHECK(cudaMemcpy(b.data(), out_today, total * 2, cudaMemcpyDeviceToHost));
  PROBE_CHECK(cudaMemcpy(r.data(), out_reversed, total * 2, cudaMemcpyDeviceToHost));
  const bool same = a == b;
  // With 2 splits both orders add the same two numbers to 0.f; from 3 on, some sums must differ,
  // or the values are too tame for the check above to mean "in split order".
  const bool order_shows = kSplits < 3 || b != r;

  cudaGraphExec_t graph_cluster = capture(stream, cluster);
  cudaGraphExec_t graph_today = capture(stream, [&] { today(out_today, false); });
  float t_cluster = 0.f, t_today = 0.f;
  median_us(stream, graph_cluster, graph_today, t_cluster, t_today);
  std::printf("%6d | %5d | %3d | %8d | %10.2f | %10.2f | %6.2f | %s%s\n", kSplits, tiles, n,
              clusters, t_cluster, t_today, t_today / t_cluster, same ? "same bits" : "DIFFERENT",
              order_shows ? "" : " (but the order does not show: the check is void)");
  PROBE_CHECK(cudaGraphExecDestroy(graph_cluster));
  PROBE_CHECK(cudaGraphExecDestroy(graph_today));
  PROBE_CHECK(cudaStreamDestroy(stream));
  cudaFree(out_reversed);
  cudaFree(out_cluster);
  cudaFree(out_today);
  cudaFree(ws);
  return same && order_shows;
}

}  // namespace

int main(int argc, char** argv) {
  probe_command_line(kProbe,
                     "what summing a split-K product's partial tiles through a cluster's "
                     "distributed shared memory costs, against the workspace and reduction launch "
                     "used today, and whether both give the same bf16 bits",
                     argc, argv);
  cudaDeviceProp prop{};
  if (!probe_sm90_device(kProbe, "clusters", &prop)) return cudp::bench::kExitUsage;
  std::printf("%s, %d SMs: microseconds per product's sum (median)\n", prop.name,
              prop.multiProcessorCount);
  std::printf("%6s | %5s | %3s | %8s | %10s | %10s | %6s | %s\n", "splits", "tiles", "n",
              "clusters", "cluster", "today", "ratio", "check");
  bool ok = true;
  for (const int tiles : {16, 32}) {
    for (const int n : {128, 256}) {
      ok &= run<2>(tiles, n);
      ok &= run<4>(tiles, n);
      ok &= run<8>(tiles, n);
    }
  }
  std::printf(
      "reading: 'today' includes a second launch and the workspace's round trip; a ratio well "
      "above 1 at 4 splits (the 2 x 2 layers' choice) makes the cluster sum worth building\n");
  return ok ? 0 : 1;
}
