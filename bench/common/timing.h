// Timing for benchmarks: CUDA events recorded on the stream around the timed region, untimed
// warm-up runs first, the median of many repetitions reported (with the minimum and maximum), and
// rotation over several input sets so that L2 does not serve them.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

namespace cudp::bench {

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  int repetitions = 0;
};

// The median of `values` (not empty): the middle one, or the mean of the two middle ones for an
// even count.
double median(std::vector<double> values);

// Runs fn(rep) `warmup` times, then `reps` times each between two events on `stream`; fn receives the
// repetition index so that it can rotate between input copies. Returns the statistics in ms.
Timing time_on_stream(cudaStream_t stream, const std::function<void(int)>& fn, int warmup = 5,
                      int reps = 30);

// How many copies of a working set of `bytes` to rotate through so that together they exceed the L2
// cache twice over (at least 1, at most `max_copies`).
int rotation_copies(size_t bytes, int max_copies = 8);

// Measured device-to-device copy bandwidth (bytes read + bytes written per second), GB/s.
double measure_copy_bandwidth_gbs(cudaStream_t stream, size_t bytes = size_t(1) << 30);

// One row of a benchmark table: a shape, our figure, the vendor's, their ratio.
struct Row {
  std::string op;
  std::string shape;
  double ours = 0;     // in `unit`
  double vendor = 0;   // in `unit`
  std::string unit;    // "TFLOP/s" or "GB/s"
  std::string vendor_name;
};

// Prints rows as a Markdown table (ours, vendor, ratio) and returns it as a string.
std::string print_table(const std::vector<Row>& rows);

}  // namespace cudp::bench
