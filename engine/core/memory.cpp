#include "engine/core/memory.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/stream.h"

namespace cudp::cuda {
namespace {

std::string bytes_str(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

thread_local const AllocationPurpose* innermost = nullptr;

std::atomic<cudp::detail::AllocationFaultHook> fault_hook{nullptr};

// Whether the test hook (memory.h) fails this allocation.
bool injected_failure(size_t bytes, int device) {
  const cudp::detail::AllocationFaultHook hook = fault_hook.load(std::memory_order_relaxed);
  return hook != nullptr && hook(bytes, device);
}

// " for <purpose> (<what>)", " (<what>)" or "".
std::string purpose_str(std::string_view what) {
  const std::string purpose = AllocationPurpose::current_what();
  std::string out;
  if (!purpose.empty()) out += " for " + purpose;
  if (!what.empty()) out += detail::str(" (", what, ")");
  return out;
}

std::string advice_str(const char* fallback) {
  const std::string advice = AllocationPurpose::current_advice();
  return advice.empty() ? fallback : advice;
}

// The device's pool, configured once: keep freed memory reserved (release threshold = max).
cudaMemPool_t pool(int device) {
  static std::mutex mutex;
  static std::vector<bool> configured;
  cudaMemPool_t p = nullptr;
  CUDP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&p, device));
  std::lock_guard lock(mutex);
  if (configured.size() <= static_cast<size_t>(device)) configured.resize(device + 1, false);
  if (!configured[device]) {
    uint64_t threshold = UINT64_MAX;
    CUDP_CUDA_CHECK(cudaMemPoolSetAttribute(p, cudaMemPoolAttrReleaseThreshold, &threshold));
    configured[device] = true;
  }
  return p;
}

// NOTE [Allocations during stream capture] (memory.h): the open capture's bookkeeping.
struct CaptureBook {
  std::mutex mutex;
  bool open = false;
  std::unordered_set<void*> allocated;                   // graph allocations not yet freed
  std::vector<std::pair<void*, cudaStream_t>> deferred;  // frees to issue after the capture
};
CaptureBook& capture_book() {
  static CaptureBook book;
  return book;
}
std::atomic<bool> capture_open{false};  // read without the lock on every allocation

// Whether work on `stream` is being captured now (or was, in a capture that failed).
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

uint64_t pool_attribute(int device, cudaMemPoolAttr attr) {
  check_device(device);
  uint64_t value = 0;
  CUDP_CUDA_CHECK(cudaMemPoolGetAttribute(pool(device), attr, &value));
  return value;
}

// The OutOfMemoryError of a device allocation of `bytes` (0: `call` did not say) on `device` (-1:
// unknown) that failed.
[[noreturn]] void throw_device_out_of_memory(size_t bytes, int device, std::string_view what,
                                             const char* file, int line,
                                             const char* call = nullptr) {
  cudaGetLastError();  // out of memory is not sticky: leave no error behind
  std::string figures;
  if (device >= 0) {
    size_t free_bytes = 0, total = 0;
    {
      DeviceGuard guard(device);
      cudaMemGetInfo(&free_bytes, &total);
    }
    figures = detail::str("; ", bytes_str(memory_allocated(device)), " allocated by cudp, ",
                          bytes_str(memory_reserved(device)), " reserved, ",
                          bytes_str(free_bytes), " free of ", bytes_str(total), " on the device");
  }
  throw OutOfMemoryError(
      cudaErrorMemoryAllocation,
      detail::str(
          "CUDA out of memory", device >= 0 ? detail::str(" on cuda:", device) : "",
          bytes > 0 || call == nullptr
              ? detail::str(": tried to allocate ", bytes_str(bytes), " (", bytes, " bytes)")
              : detail::str(": ", call, " could not allocate device memory"),
          purpose_str(what), figures, ". ",
          advice_str("Reduce the batch size (--batch-size) or free tensors.")),
      file, line);
}

}  // namespace

AllocationPurpose::AllocationPurpose(std::string what, std::string advice)
    : what_(std::move(what)), advice_(std::move(advice)), outer_(innermost) {
  innermost = this;
}

AllocationPurpose::~AllocationPurpose() { innermost = outer_; }

std::string AllocationPurpose::current_what() {
  std::string out;
  for (const AllocationPurpose* p = innermost; p; p = p->outer_) {
    if (p->what_.empty()) continue;  // advice only
    out = out.empty() ? p->what_ : p->what_ + ": " + out;
  }
  return out;
}

std::string AllocationPurpose::current_advice() {
  for (const AllocationPurpose* p = innermost; p; p = p->outer_) {
    if (!p->advice_.empty()) return p->advice_;
  }
  return {};
}

void* device_allocate(size_t bytes, int device, cudaStream_t stream, std::string_view what) {
  check_device(device);
  if (bytes == 0) return nullptr;
  if (injected_failure(bytes, device)) {
    throw_device_out_of_memory(bytes, device, what, __FILE__, __LINE__);
  }
  // A stream allocated on is alive: if CUDA gave it the handle of a destroyed cuda::Stream (a
  // stream made with the CUDA API directly, which Stream::create does not see), its frees must stay
  // on it, not go to the default stream (NOTE [Memory that outlives its stream]).
  unretire_stream(stream);
  void* ptr = nullptr;
  const cudaError_t status = cudaMallocFromPoolAsync(&ptr, bytes, pool(device), stream);
  if (status == cudaErrorMemoryAllocation) {
    throw_device_out_of_memory(bytes, device, what, __FILE__, __LINE__);
  }
  CUDP_CUDA_CHECK(status);
  note_allocation(ptr, stream);
  return ptr;
}

void check_allocation(cudaError_t status, size_t bytes, std::string_view what, const char* call) {
  if (status == cudaSuccess) return;
  if (status == cudaErrorMemoryAllocation) {
    int device = -1;
    if (device_count() == 0 || cudaGetDevice(&device) != cudaSuccess) device = -1;
    throw_device_out_of_memory(bytes, device, what, __FILE__, __LINE__, call);
  }
  detail::throw_cuda(status, call, __FILE__, __LINE__);
}

namespace {

// NOTE [Memory that outlives its stream]: the handles of destroyed cuda::Streams and their devices.
struct RetiredStreams {
  std::shared_mutex mutex;  // frees and allocations look up (shared); retiring writes
  std::unordered_map<cudaStream_t, int> devices;
};
RetiredStreams& retired_streams() {
  static auto* r = new RetiredStreams;  // never destroyed: frees may run during static destruction
  return *r;
}
std::atomic<bool> any_retired{false};  // the fast path of device_free: no lock until a stream died

}  // namespace

void retire_stream(cudaStream_t stream, int device) noexcept {
  if (stream == nullptr) return;
  RetiredStreams& r = retired_streams();
  const std::lock_guard lock(r.mutex);
  try {
    r.devices[stream] = device;
  } catch (...) {
    return;  // out of host memory: the stream is not recorded (as before this registry existed)
  }
  any_retired.store(true, std::memory_order_release);
}

void unretire_stream(cudaStream_t stream) noexcept {
  if (!any_retired.load(std::memory_order_acquire)) return;
  RetiredStreams& r = retired_streams();
  {
    const std::shared_lock lock(r.mutex);
    if (r.devices.find(stream) == r.devices.end()) return;  // the common case: one lookup
  }
  const std::lock_guard lock(r.mutex);
  r.devices.erase(stream);
}

void device_free(void* ptr, cudaStream_t stream) noexcept {
  if (!ptr) return;
  if (stream != nullptr && any_retired.load(std::memory_order_acquire)) {
    int device = -1;
    {
      RetiredStreams& r = retired_streams();
      const std::shared_lock lock(r.mutex);
      const auto it = r.devices.find(stream);
      if (it != r.devices.end()) device = it->second;
    }
    if (device >= 0) {
      // The stream's work is over (its destructor waited): free on the device's default stream.
      try {
        stream = default_stream(device).get();
      } catch (...) {
        cudaFree(ptr);  // the default stream cannot be made: free synchronously
        return;
      }
    }
  }
  if (capture_open.load(std::memory_order_acquire) && capturing(stream)) {
    CaptureBook& book = capture_book();
    const std::lock_guard lock(book.mutex);
    if (book.allocated.erase(ptr) == 0) {
      book.deferred.emplace_back(ptr, stream);  // not the graph's: freed after the capture
      return;
    }
  }
  cudaFreeAsync(ptr, stream);
}

void begin_capture_allocations() {
  CaptureBook& book = capture_book();
  const std::lock_guard lock(book.mutex);
  CUDP_CHECK(!book.open, "a CUDA graph capture is already open in this process; capture one "
                         "training step at a time");
  book.open = true;
  book.allocated.clear();
  book.deferred.clear();
  capture_open.store(true, std::memory_order_release);
}

size_t end_capture_allocations() noexcept {
  CaptureBook& book = capture_book();
  std::vector<std::pair<void*, cudaStream_t>> deferred;
  size_t unfreed = 0;
  {
    const std::lock_guard lock(book.mutex);
    capture_open.store(false, std::memory_order_release);
    book.open = false;
    unfreed = book.allocated.size();
    book.allocated.clear();
    deferred.swap(book.deferred);
  }
  for (const auto& [ptr, stream] : deferred) cudaFreeAsync(ptr, stream);
  return unfreed;
}

bool capture_is_open() noexcept { return capture_open.load(std::memory_order_acquire); }

void note_allocation(void* ptr, cudaStream_t stream) noexcept {
  if (ptr == nullptr || !capture_open.load(std::memory_order_acquire) || !capturing(stream)) {
    return;
  }
  CaptureBook& book = capture_book();
  const std::lock_guard lock(book.mutex);
  if (book.open) book.allocated.insert(ptr);
}

void* host_allocate(size_t bytes, bool pinned, std::string_view what) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  const char* kind = pinned ? "pinned (page-locked) host memory" : "host memory";
  const auto fail = [&](cudaError_t status, const std::string& cause) {
    throw OutOfMemoryError(
        status,
        detail::str("out of ", kind, ": tried to allocate ", bytes_str(bytes), " (", bytes,
                    " bytes)", purpose_str(what), ": ", cause, ". ",
                    advice_str(pinned ? "Reduce the batch size (--batch-size), the loader's "
                                        "workers or prefetch depth, or turn pin_memory off."
                                      : "Reduce the batch size (--batch-size) or free tensors.")),
        __FILE__, __LINE__);
  };
  if (injected_failure(bytes, -1)) {
    fail(cudaErrorMemoryAllocation, "the test's allocation fault hook refused it");
  }
  if (pinned) {
    const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    // A size beyond what the driver can pin comes back as an invalid value, not as no memory.
    if (status == cudaErrorMemoryAllocation || status == cudaErrorInvalidValue) {
      cudaGetLastError();
      fail(cudaErrorMemoryAllocation, detail::str("cudaHostAlloc reports ", cudaGetErrorName(status)));
    }
    if (status != cudaSuccess) {
      cudaGetLastError();
      cuda::require_available("pinned host memory (pin_memory)");
      detail::throw_cuda(status, "cudaHostAlloc", __FILE__, __LINE__);
    }
    return ptr;
  }
  if (bytes > SIZE_MAX - 63) fail(cudaErrorMemoryAllocation, "more than the address space");
  const size_t rounded = (bytes + 63) / 64 * 64;
  ptr = std::aligned_alloc(64, rounded);
  if (!ptr) fail(cudaErrorMemoryAllocation, "the system allocator returned nothing");
  return ptr;
}

void host_free(void* ptr, bool pinned) noexcept {
  if (!ptr) return;
  if (pinned) {
    cudaFreeHost(ptr);
  } else {
    std::free(ptr);
  }
}

size_t memory_allocated(int device) { return pool_attribute(device, cudaMemPoolAttrUsedMemCurrent); }
size_t max_memory_allocated(int device) { return pool_attribute(device, cudaMemPoolAttrUsedMemHigh); }
size_t memory_reserved(int device) { return pool_attribute(device, cudaMemPoolAttrReservedMemCurrent); }

void reset_peak_memory_stats(int device) {
  check_device(device);
  uint64_t zero = 0;
  CUDP_CUDA_CHECK(cudaMemPoolSetAttribute(pool(device), cudaMemPoolAttrUsedMemHigh, &zero));
  CUDP_CUDA_CHECK(cudaMemPoolSetAttribute(pool(device), cudaMemPoolAttrReservedMemHigh, &zero));
}

void empty_cache(int device) {
  check_device(device);
  synchronize(device);
  CUDP_CUDA_CHECK(cudaMemPoolTrimTo(pool(device), 0));
}

}  // namespace cudp::cuda

namespace cudp::detail {
void set_allocation_fault_hook(AllocationFaultHook hook) {
  cuda::fault_hook.store(hook, std::memory_order_relaxed);
}
}  // namespace cudp::detail
