// Memory: device allocations from CUDA's stream-ordered allocator, host allocations (aligned, or
// pinned for asynchronous copies), and torch.cuda-style statistics.
//
// Device memory comes from each device's default memory pool through cudaMallocAsync, with the
// pool's release threshold raised to "never", so freed blocks stay reserved and are reused without
// going back to the driver (docs/architecture.md §2.4). That is the caching allocator; cudp does
// not write its own. An allocation is ordered on a stream and freed on the same stream; memory used
// on another stream must be ordered with an event before it is freed (the engine does this).
//
// Out of memory must explain itself: "cudaHostAlloc failed: cudaErrorMemoryAllocation" tells a user
// nothing. An allocation knows its bytes and device but not what it is for, so the owners of
// allocations name their purpose and the setting to change with an AllocationPurpose on their
// thread; the OutOfMemoryError then carries the purpose, the tensor, the bytes, the device and that
// advice. The owners: the data loader's batch buffers and the prefetcher's device copies (data/),
// each replica of a model with its parameters and gradients, each replica's forward and backward
// (activations) on its worker thread, scatter and gather (engine/parallel/), the optimizers' state
// (layers/optim.cpp), a training step (layers/train.cpp, the trainer), BatchNorm2d's parameters,
// running statistics and saved batch statistics, the bf16 weight copies of Linear and Conv2d, a
// CUDA graph's memory at instantiation and launch (engine/core/graph.cpp), and every kernel
// workspace, which names itself (kernels/workspace.h, check_allocation below) inside its caller's
// purpose. An owner's advice replaces its caller's, so an owner gives one only where it knows
// better what to change.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace cudp::cuda {

// Names what the allocations made on this thread, while it lives, are for, and what the user can
// change when they fail ("the data loader's 5 batch buffers", "reduce --batch-size or the loader's
// prefetch depth"). Nested purposes add up, outermost first. Not copyable; destroy in reverse order.
class AllocationPurpose {
 public:
  AllocationPurpose(std::string what, std::string advice = {});
  ~AllocationPurpose();
  AllocationPurpose(const AllocationPurpose&) = delete;
  AllocationPurpose& operator=(const AllocationPurpose&) = delete;

  // "for <outer>: <inner>" and the innermost advice given; empty without a purpose.
  static std::string current_what();
  static std::string current_advice();

 private:
  std::string what_, advice_;
  const AllocationPurpose* outer_;
};

// Allocates `bytes` on `device`, ordered on `stream`. Throws OutOfMemoryError naming the device, the
// bytes asked for, `what` (the tensor), the current AllocationPurpose, what is allocated and reserved,
// and what to change.
void* device_allocate(size_t bytes, int device, cudaStream_t stream, std::string_view what = {});
// Frees on `stream`. During a stream capture (below), memory that the capture did not allocate is
// freed when the capture ends instead. Memory whose stream was destroyed first is freed on its
// device's default stream (NOTE [Memory that outlives its stream]).
void device_free(void* ptr, cudaStream_t stream) noexcept;

// NOTE [Memory that outlives its stream]
// A tensor frees its memory on the stream it was allocated on, and tensors often outlive that
// stream: an output made on a DataParallel's worker stream kept after the DataParallel is gone, a
// user's stream of a StreamGuard destroyed before the tensors made under it. cudaFreeAsync on a
// destroyed stream is undefined (it crashed in the driver in a test that did just that), so a
// cuda::Stream tells the allocator when it dies: its destructor waits for the stream's work (the
// memory's last uses on it are then over), retires the handle here and destroys it; device_free
// then frees that memory on the device's default stream. A handle CUDA hands out again for a new
// stream is un-retired when cuda::Stream::create receives it, or when memory is allocated on it
// (a stream made with the CUDA API directly may receive it too: one allocated on is alive). Streams
// the caller created with the CUDA API directly are the caller's to keep alive while memory
// allocated on them lives.
// For cuda::Stream (stream.cpp) only.
void retire_stream(cudaStream_t stream, int device) noexcept;
void unretire_stream(cudaStream_t stream) noexcept;

// NOTE [Allocations during stream capture]
// While a stream is captured into a CUDA graph (engine/core/graph.h), cudaMallocFromPoolAsync and
// cudaMallocAsync on it create the graph's allocation nodes: the memory belongs to the graph, has a
// fixed address over its replays, and a cudaFreeAsync on the captured stream becomes a free node.
// A free node only takes the graph's own allocations, though, and a captured step frees memory it
// did not allocate: the tensors a module kept from the last eager step (its saved activations),
// released when the captured forward replaces them. Those frees are deferred: device_free records
// them and end_capture_allocations() issues them on their streams once the capture has ended,
// ordered after the eager work that used them and before the graph's first launch. Memory the
// capture allocated and did not free (what something kept past the captured step) stays the
// graph's; it is freed by the graph's next launch (instantiated with auto-free on launch) or by a
// later eager step, outside the graph, as CUDA allows. A training step leaves none (layers free
// what they saved at backward, GraphedStep's bodies release the criterion), and that matters
// beyond memory: compute-sanitizer's memcheck takes such an allocation as live from the start of
// every launch, so a workspace freed earlier in the graph at the same address reads to it as an
// out-of-bounds access although CUDA allows the reuse.
//
// The bookkeeping, for engine/core/graph.cpp:
// Starts the bookkeeping of one capture (one at a time in the process; throws if one is open).
void begin_capture_allocations();
// Ends it and issues the deferred frees. Returns how many graph allocations the capture left
// unfreed (the graph owns them).
size_t end_capture_allocations() noexcept;
// Records a graph allocation made without device_allocate (a kernel workspace's cudaMallocAsync),
// so that its free stays in the graph. A no-op outside a capture.
void note_allocation(void* ptr, cudaStream_t stream) noexcept;
// Whether a capture's bookkeeping is open.
bool capture_is_open() noexcept;

// For device memory allocated on the current device outside device_allocate (a kernel's workspace
// from cudaMallocAsync, a CUDA graph's memory at instantiation or launch): returns when `status` is
// cudaSuccess; out of memory throws the OutOfMemoryError device_allocate would (the device,
// `bytes`, `what`, the thread's purpose, the pool's figures and the advice; bytes == 0: `call` did
// not say how many); any other status throws CudaError naming `call`.
void check_allocation(cudaError_t status, size_t bytes, std::string_view what, const char* call);

// Host memory aligned to 64 bytes; pinned (page-locked, portable across devices) when asked, which
// asynchronous host-to-device copies need. Throws OutOfMemoryError like device_allocate.
void* host_allocate(size_t bytes, bool pinned, std::string_view what = {});
void host_free(void* ptr, bool pinned) noexcept;

// Statistics of `device`'s pool, in bytes: what tensors hold now, the peak since the last reset,
// and what the pool holds from the driver (torch.cuda.memory_allocated / max_memory_allocated /
// memory_reserved).
size_t memory_allocated(int device);
size_t max_memory_allocated(int device);
size_t memory_reserved(int device);
void reset_peak_memory_stats(int device);
// Returns the pool's unused reserved memory to the driver (torch.cuda.empty_cache).
void empty_cache(int device);

}  // namespace cudp::cuda

namespace cudp::detail {
// Test hook: asked before every device_allocate and host_allocate with the bytes and the device
// (-1: host memory, pinned or not); returning true makes that allocation fail as out of memory
// would, with the same OutOfMemoryError. Lets host tests force the failure of one owner's
// allocation (chosen by size or by AllocationPurpose::current_what()). Null, the default, asks
// nothing; set it back to null at the end of the test. Not thread-safe to change while other
// threads allocate.
using AllocationFaultHook = bool (*)(size_t bytes, int device);
void set_allocation_fault_hook(AllocationFaultHook hook);
}  // namespace cudp::detail
