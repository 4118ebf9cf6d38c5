// Named ranges for profilers: Nsight Systems shows them on each thread's timeline, and Nsight
// Compute can select kernels by them (--nvtx --nvtx-include "Conv2d backward/"). They come from
// NVTX v3 (the CUDA Toolkit's header-only nvtx3): without a profiler attached, a range costs a few
// nanoseconds. Ranges nest per thread; a Range object opens one and closes it when it goes out of
// scope.
//
// cudp names every module's forward and backward by its type ("Conv2d forward"), DataParallel's
// phases (scatter, replicas' forward and backward, gather, gradient all-reduce) and the trainer's
// (training step, evaluation, checkpoint).
#pragma once

#include <string>

namespace cudp::nvtx {

class Range {
 public:
  explicit Range(const char* name);
  explicit Range(const std::string& name) : Range(name.c_str()) {}
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;
};

}  // namespace cudp::nvtx
