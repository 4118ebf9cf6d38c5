#include "engine/core/stream.h"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"

namespace cudp::cuda {

Stream Stream::create(int device, int priority) {
  DeviceGuard guard(device);
  Stream s;
  CUDP_CUDA_CHECK(cudaStreamCreateWithPriority(&s.stream_, cudaStreamNonBlocking, priority));
  s.device_ = device;
  unretire_stream(s.stream_);  // CUDA may reuse a destroyed stream's handle
  return s;
}

Stream::~Stream() {
  if (!stream_) return;
  // NOTE [Memory that outlives its stream] (memory.h): memory allocated on this stream may be freed
  // after it is gone, on the device's default stream; its uses here must be over by then. Retired
  // before it is destroyed: no free may reach the dead handle, and a stream made meanwhile on
  // another thread cannot get the handle before it is retired (it un-retires it then). A stream in
  // a capture cannot be synchronised (that would end the capture in error): destroying it there is
  // the caller's mistake, and nothing is waited for.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream_, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusNone) {
    cudaStreamSynchronize(stream_);
  }
  retire_stream(stream_, device_);
  cudaStreamDestroy(stream_);
}

Stream::Stream(Stream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), device_(std::exchange(other.device_, -1)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  std::swap(stream_, other.stream_);
  std::swap(device_, other.device_);
  return *this;
}

void Stream::synchronize() const { CUDP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void Stream::wait(const Event& event) const {
  CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream_, event.get(), 0));
}

Event Event::create(int device, bool timing) {
  DeviceGuard guard(device);
  Event e;
  CUDP_CUDA_CHECK(cudaEventCreateWithFlags(&e.event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  e.device_ = device;
  return e;
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

Event::Event(Event&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)), device_(std::exchange(other.device_, -1)) {}

Event& Event::operator=(Event&& other) noexcept {
  std::swap(event_, other.event_);
  std::swap(device_, other.device_);
  return *this;
}

void Event::record(cudaStream_t stream) const { CUDP_CUDA_CHECK(cudaEventRecord(event_, stream)); }
void Event::synchronize() const { CUDP_CUDA_CHECK(cudaEventSynchronize(event_)); }

bool Event::query() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  CUDP_CUDA_CHECK(status);
  return true;
}

float Event::elapsed_ms(const Event& start, const Event& stop) {
  float ms = 0;
  CUDP_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return ms;
}

namespace {

// Default streams live until the process ends; they are deliberately never destroyed, because
// static destructors would run after the CUDA runtime has begun to unload.
struct DefaultStreams {
  std::mutex mutex;
  std::vector<Stream*> streams;
};

DefaultStreams& default_streams() {
  static auto* s = new DefaultStreams;
  return *s;
}

thread_local std::unordered_map<int, cudaStream_t> t_current;

}  // namespace

const Stream& default_stream(int device) {
  DefaultStreams& d = default_streams();
  std::lock_guard lock(d.mutex);
  // A stream exists only for a device that was valid when it was made: only creation validates, so
  // the lookup every tensor operation does (current_stream) costs no driver call.
  if (device >= 0 && static_cast<size_t>(device) < d.streams.size() && d.streams[device]) {
    return *d.streams[device];
  }
  check_device(device);
  if (d.streams.size() <= static_cast<size_t>(device)) d.streams.resize(device + 1, nullptr);
  d.streams[device] = new Stream(Stream::create(device));
  return *d.streams[device];
}

cudaStream_t current_stream(int device) {
  const auto it = t_current.find(device);
  if (it != t_current.end()) return it->second;
  return default_stream(device).get();
}

struct SideStream::Slot {
  Stream side;
  Event forked;  // recorded on the main stream, waited for by the side stream
  Event done;    // recorded on the side stream, waited for by the main stream
  std::atomic<bool> open{false};
};

namespace {

// Kept for the life of the process, as the default streams are (above).
struct SideStreams {
  std::mutex mutex;
  std::map<std::pair<int, cudaStream_t>, SideStream::Slot*> slots;
};

SideStreams& side_streams() {
  static auto* s = new SideStreams;
  return *s;
}

std::atomic<uint64_t> g_forks{0};

}  // namespace

SideStream::SideStream(int device, cudaStream_t stream) : stream_(stream) {
  fork(device, false);
}

SideStream::SideStream(int device, cudaStream_t stream, IfFree, bool wanted) : stream_(stream) {
  if (wanted) fork(device, true);
}

void SideStream::fork(int device, bool if_free) {
  Slot* slot = nullptr;
  {
    SideStreams& s = side_streams();
    std::lock_guard lock(s.mutex);
    Slot*& entry = s.slots[{device, stream_}];
    if (entry == nullptr) {
      entry = new Slot{Stream::create(device), Event::create(device), Event::create(device)};
    }
    if (entry->open) {
      if (if_free) return;
      CUDP_THROW(Error, "SideStream: cuda:", device,
                 " already has a side stream open beside this stream; join it first");
    }
    entry->open = true;
    slot = entry;
  }
  try {
    DeviceGuard guard(device);
    slot->forked.record(stream_);
    slot->side.wait(slot->forked);
  } catch (...) {
    slot->open = false;  // no destructor runs: free the slot for the next fork
    throw;
  }
  slot_ = slot;
  g_forks.fetch_add(1, std::memory_order_relaxed);
}

uint64_t SideStream::forks() {
  return g_forks.load(std::memory_order_relaxed);
}

cudaStream_t SideStream::get() const {
  return slot_ ? slot_->side.get() : stream_;
}

void SideStream::join() {
  if (joined_ || slot_ == nullptr) return;
  joined_ = true;
  DeviceGuard guard(slot_->side.device());
  slot_->done.record(slot_->side);
  const cudaError_t status = cudaStreamWaitEvent(stream_, slot_->done.get(), 0);
  slot_->open = false;  // after the events' last use: another thread may fork now
  CUDP_CUDA_CHECK(status);
}

// No DeviceGuard here (its queries may throw, and this may run while an exception unwinds): the
// event and the streams name their device themselves.
SideStream::~SideStream() {
  if (joined_ || slot_ == nullptr) return;
  if (cudaEventRecord(slot_->done.get(), slot_->side.get()) == cudaSuccess) {
    cudaStreamWaitEvent(stream_, slot_->done.get(), 0);
  }
  slot_->open = false;
}

StreamGuard::StreamGuard(int device, cudaStream_t stream)
    : device_(device), previous_(current_stream(device)) {
  t_current[device] = stream;
}

StreamGuard::~StreamGuard() { t_current[device_] = previous_; }

}  // namespace cudp::cuda
