// CUDA graphs: a piece of stream work captured once and replayed with one launch.
//
// A training step of a small model is ~150 kernel launches whose host cost can exceed their device
// time (32x32 images). Captured into a graph, the step is one launch: the device runs the kernels
// back to back and the host is free. What a replay cannot do is run host code, so everything a step
// decides on the host must either be the same at every step (shapes, pointers: the allocator gives
// a captured allocation a fixed address, engine/core/memory.h NOTE [Allocations during stream
// capture]) or be read by the kernels from device memory that the host writes before each launch:
// ReplayScalars below.
//
// CudaGraph captures the work issued on one stream (and on any stream that joins it through an
// event) by the calling thread's code and by other threads launching onto those streams, in
// thread-local mode: another thread may keep allocating and copying (the data loader) without
// breaking the capture, while a host synchronisation or synchronous allocation on the capturing
// thread fails the capture with CUDA's error, which capture_end reports with the device and what
// to do. The graph is instantiated with auto-free on launch, so memory it allocated and did not
// free (what modules keep from the captured step) is freed by its next launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "engine/core/stream.h"

namespace cudp::cuda {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(CudaGraph&& other) noexcept;
  CudaGraph& operator=(CudaGraph&& other) noexcept;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Starts capturing `stream` of `device`; `what` names the work in errors ("the training step").
  // One capture at a time in the process. The previous graph, if any, is destroyed first.
  void capture_begin(int device, cudaStream_t stream, std::string what);
  // Ends the capture and instantiates the graph. Throws CudaError naming the device and the work
  // when the capture was invalidated (something in it is not allowed in a graph).
  void capture_end();
  // Brings `other` (a stream of `device`, another device's compute stream) into the capture: it
  // waits for the captured stream, so that what is issued on it from now on, allocations included,
  // is captured too (and must rejoin before capture_end: join).
  void fork(int device, cudaStream_t other);
  // Makes the captured stream wait for the work issued so far on `other` (a stream of `device`)
  // when `other` has joined the capture (through an event of the captured stream, as a copy to
  // another device does), so that the capture can end; a stream outside the capture is left alone.
  void join(int device, cudaStream_t other);
  // Ends a capture abandoned by an exception and discards it (never throws).
  void capture_abort() noexcept;
  bool capturing() const { return capturing_ != nullptr; }

  // Launches the instantiated graph on `stream` (any stream of its device).
  void launch(cudaStream_t stream) const;
  bool instantiated() const { return exec_ != nullptr; }
  // Nodes in the captured graph (kernels, copies, memsets, allocations, frees).
  size_t node_count() const;
  int device() const { return device_; }
  // Allocations the capture made and did not free: memory the graph owns past its end (memory.h
  // NOTE [Allocations during stream capture]). A training step leaves none.
  size_t graph_owned_allocations() const { return graph_owned_; }

 private:
  void reset() noexcept;

  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaStream_t capturing_ = nullptr;
  int device_ = -1;
  size_t graph_owned_ = 0;
  std::string what_;
};

// NOTE [Replay scalars]
// Values that a captured kernel must read anew at every replay (the optimizer's learning rate and
// step counts, Dropout's random-number offset) live in a small block of device memory per device.
// While a capture runs, the component that launches such a kernel takes a slot in the block
// (slot()), fills its host copy with this step's values and passes the slot's device address to
// the kernel instead of the values; it also registers what to do before each later replay
// (on_replay()): advance its host-side state exactly as an eager step would and write the new
// values into the slot's host copy. Before every launch the owner of the graph calls
// prepare_replay() (the callbacks, skipped for the first launch: the capture itself ran the host
// side of that step) and upload() (host copies to the device, as kernel arguments, ordered before
// the launch on its stream). The components find the block through active(device) while a capture
// is open, so the layers need no graph argument.
class ReplayScalars {
 public:
  static constexpr size_t kCapacity = 16 * 1024;  // bytes per device

  // Allocates a block on each of `devices` (outside any capture: the blocks must not be graph
  // memory).
  explicit ReplayScalars(const std::vector<int>& devices);
  ~ReplayScalars();
  ReplayScalars(const ReplayScalars&) = delete;
  ReplayScalars& operator=(const ReplayScalars&) = delete;
  ReplayScalars(ReplayScalars&&) = delete;
  ReplayScalars& operator=(ReplayScalars&&) = delete;

  // The set taking slots for `device` while a capture is open (Activation), else null.
  static ReplayScalars* active(int device);

  // Makes `scalars` the active set while in scope.
  class Activation {
   public:
    explicit Activation(ReplayScalars& scalars);
    ~Activation();
    Activation(const Activation&) = delete;
    Activation& operator=(const Activation&) = delete;
  };

  struct Slot {
    void* device;  // what the kernel reads
    void* host;    // what the owner writes (before upload)
  };
  // `bytes` (aligned to 16) in `device`'s block, its host copy zeroed. Throws when the block is
  // full, naming the device and the bytes in use.
  Slot slot(int device, size_t bytes);
  void on_replay(std::function<void()> refresh);

  // Runs the on_replay callbacks in the order they were registered.
  void prepare_replay();
  // Writes every device's host copy to its block on that device's current stream, and makes
  // `launch_stream` wait for each.
  void upload(cudaStream_t launch_stream);

  // Forgets every slot and callback (before a new capture).
  void clear();
  size_t slots() const { return slot_count_; }

 private:
  struct Block {
    int device;
    void* memory;
    std::vector<unsigned char> host;
    size_t used = 0;
    Event written;
  };
  Block& block(int device);

  std::mutex mutex_;
  std::vector<Block> blocks_;
  std::vector<std::function<void()>> refresh_;
  size_t slot_count_ = 0;
};

}  // namespace cudp::cuda
