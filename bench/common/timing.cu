#include "common/timing.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "engine/core/error.h"

namespace cudp::bench {

double median(std::vector<double> values) {
  CUDP_CHECK(!values.empty(), "median of no values");
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

Timing time_on_stream(cudaStream_t stream, const std::function<void(int)>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn(i);
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  CUDP_CUDA_CHECK(cudaEventCreate(&start));
  CUDP_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    CUDP_CUDA_CHECK(cudaEventRecord(start, stream));
    fn(i);
    CUDP_CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDP_CUDA_CHECK(cudaEventDestroy(start));
  CUDP_CUDA_CHECK(cudaEventDestroy(stop));
  Timing t;
  t.repetitions = reps;
  t.median_ms = median(times);
  t.min_ms = *std::min_element(times.begin(), times.end());
  t.max_ms = *std::max_element(times.begin(), times.end());
  return t;
}

int rotation_copies(size_t bytes, int max_copies) {
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  int l2 = 0;
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  const size_t want = 2 * static_cast<size_t>(l2);
  const int copies = static_cast<int>((want + bytes - 1) / std::max<size_t>(bytes, 1));
  return std::clamp(copies, 1, max_copies);
}

double measure_copy_bandwidth_gbs(cudaStream_t stream, size_t bytes) {
  void *a = nullptr, *b = nullptr;
  CUDP_CUDA_CHECK(cudaMallocAsync(&a, bytes, stream));
  CUDP_CUDA_CHECK(cudaMallocAsync(&b, bytes, stream));
  CUDP_CUDA_CHECK(cudaMemsetAsync(a, 1, bytes, stream));
  const Timing t = time_on_stream(
      stream, [&](int) { CUDP_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); },
      3, 20);
  CUDP_CUDA_CHECK(cudaFreeAsync(a, stream));
  CUDP_CUDA_CHECK(cudaFreeAsync(b, stream));
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return 2.0 * static_cast<double>(bytes) / (t.median_ms * 1e-3) / 1e9;
}

std::string print_table(const std::vector<Row>& rows) {
  std::ostringstream out;
  out << "| op | shape | ours | vendor | unit | ours/vendor |\n|---|---|---:|---:|---|---:|\n";
  char line[512];
  for (const Row& r : rows) {
    std::snprintf(line, sizeof line, "| %s | %s | %.2f | %.2f (%s) | %s | %.2f |\n", r.op.c_str(),
                  r.shape.c_str(), r.ours, r.vendor, r.vendor_name.c_str(), r.unit.c_str(),
                  r.vendor > 0 ? r.ours / r.vendor : 0.0);
    out << line;
  }
  std::fputs(out.str().c_str(), stdout);
  return out.str();
}

}  // namespace cudp::bench
