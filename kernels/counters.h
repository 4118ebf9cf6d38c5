// Arrival counters for kernels whose blocks wait on each other's work within one launch (the
// in-kernel split-K sum of the tensor-core products): int words in device memory that are zero
// before such a launch and that the launch leaves zero when it ends.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cudp::kernels {

// At least `units` zeroed counters for the launches enqueued on `stream` of the current device.
// One set per (device, stream, whether the stream is being captured): launches on one stream run
// one after another (a programmatic launch waits, at its kernel_entry, for the kernel before it to
// have finished), so each may use the counters from its first word, as long as it leaves them zero;
// launches on different streams may run at once and get sets apart; a captured graph has a set
// apart from the eager work on its stream, so that it may be replayed beside that work (not beside
// another graph captured on the same stream). A set that grows keeps its old memory (a captured
// graph may still use it). The sets live until release_arrival_counters. Out of memory names
// `what`.
int* arrival_counters(cudaStream_t stream, int64_t units, const char* what);

// Frees every set. For the end of a program, after its last launch and graph that used one, so
// that a leak check finds everything returned (the tests' main calls it); a launch after it makes a
// new set. Makes no CUDA call if no set was made.
void release_arrival_counters() noexcept;

}  // namespace cudp::kernels
