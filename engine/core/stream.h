// Streams and events: RAII, move-only handles bound to a device.
//
// Each device has one default compute stream, created on first use and kept for the life of the
// process (non-blocking with respect to the legacy NULL stream). Work on a device goes to its
// *current* stream: the default compute stream unless a StreamGuard on this thread names another, so
// the engine's per-device threads and a user's own streams both work without passing a stream
// through every call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cudp::cuda {

class Event;

class Stream {
 public:
  Stream() = default;  // no stream
  // A new non-blocking stream on `device` (lower number = higher priority, as CUDA's).
  static Stream create(int device, int priority = 0);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT: a handle used as one
  int device() const { return device_; }

  void synchronize() const;
  // Later work on this stream waits for `event` (recorded on any stream, any device).
  void wait(const Event& event) const;

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
};

class Event {
 public:
  Event() = default;
  // A new event on `device`; timing events can measure elapsed time, others are cheaper.
  static Event create(int device, bool timing = false);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }
  void record(cudaStream_t stream) const;
  void synchronize() const;
  bool query() const;  // true when the recorded work has completed
  // Milliseconds between two recorded timing events.
  static float elapsed_ms(const Event& start, const Event& stop);

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

// A second stream beside `stream` on the same device, for work independent of what `stream` does
// next (a layer's backward-weight beside its backward-data): the constructor makes the side stream
// wait for everything issued on `stream` so far, and join() makes everything issued on `stream`
// afterwards wait for everything issued on the side stream. Memory the side stream reads may be
// freed on `stream` once joined. Inside a stream capture the side stream joins the capture through
// the first wait and leaves it through the second, so a captured graph holds the two branches.
// One side stream per (device, stream), made on first use and kept for the life of the process
// with its two events (a program that makes streams without end keeps one for each).
class SideStream {
 public:
  // Throws where `stream` has a side stream open already (join it first).
  SideStream(int device, cudaStream_t stream);
  // A side stream only where `wanted` and `stream` has none open already (two threads may issue to
  // one stream: threads without a StreamGuard share the device's default stream). Otherwise none:
  // get() is `stream` itself and join() does nothing, so the work runs in order on `stream`, with
  // the same results, and the caller's code is the same either way.
  struct IfFree {};
  static constexpr IfFree if_free{};
  SideStream(int device, cudaStream_t stream, IfFree, bool wanted = true);
  ~SideStream();  // joins if join() was not called (an error then is not reported)
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t get() const;
  void join();
  bool forked() const { return slot_ != nullptr; }
  // Side streams forked in this process so far (for tests: that a path took one).
  static uint64_t forks();

  struct Slot;  // the side stream and its events (stream.cpp)

 private:
  void fork(int device, bool if_free);
  Slot* slot_ = nullptr;  // null: not forked (not wanted, or if_free found the slot open)
  cudaStream_t stream_ = nullptr;
  bool joined_ = false;
};

// The device's default compute stream (created on first use).
const Stream& default_stream(int device);

// The stream that work on `device` goes to from this thread.
cudaStream_t current_stream(int device);

// Makes `stream` the calling thread's current stream for `device` while in scope.
class StreamGuard {
 public:
  StreamGuard(int device, cudaStream_t stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  int device_;
  cudaStream_t previous_;
};

}  // namespace cudp::cuda
