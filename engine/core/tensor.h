// Tensor: a shape, a dtype, a device and contiguous storage shared between views.
//
// Tensors are always contiguous (row-major over their shape); views, reshapes and slices along
// dim 0 share the storage of the tensor they come from. Copies between devices are explicit and
// never implicit: to(device), cpu(), cuda(i) and copy_from(src, stream). A CUDA tensor's memory comes
// from its device's stream-ordered pool (engine/core/memory.h) and is allocated and freed on the
// device's current stream at the time of creation.
//
// Operations on a CUDA tensor run on its device's current stream (engine/core/stream.h) with that
// device made current, so they may be called from any thread.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/error.h"

namespace cudp {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8 };

size_t element_size(DType dtype);
const char* dtype_name(DType dtype);  // "f32", "bf16", ...

template <typename T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<__half>() { return DType::f16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);  // "[3, 4]"
// The number of elements; throws ValueError for a negative dimension or a product that overflows
// int64 (shapes read from files or built from command-line sizes must not wrap).
int64_t shape_numel(const Shape& shape);
// The bytes of a tensor of `shape` and `dtype`, checked the same way.
size_t shape_nbytes(const Shape& shape, DType dtype);

// The memory behind one or more tensors. Freed when the last tensor using it goes.
struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device device;
  bool pinned = false;
  cudaStream_t stream = nullptr;  // the stream a CUDA allocation is ordered on and freed on

  // `what` names the memory in an out-of-memory error ("a tensor [256, 32, 32, 1] f32").
  Storage(size_t bytes, Device device, bool pinned, std::string_view what = {});
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: holds nothing

  // Uninitialised memory. `pinned` applies to CPU tensors (page-locked, for asynchronous copies).
  static Tensor empty(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu(),
                      bool pinned = false);
  static Tensor zeros(const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu());
  static Tensor full(const Shape& shape, float value, Device device = Device::cpu());
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape,
                            Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  bool is_cuda() const { return device().is_cuda(); }
  bool is_cpu() const { return device().is_cpu(); }
  bool is_pinned() const { return storage_ && storage_->pinned; }

  void* data_ptr() const;
  template <typename T>
  T* data() const {
    CUDP_CHECK(dtype_of<T>() == dtype_, "tensor ", str(), " accessed as ", dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_ptr());
  }

  // A tensor over the same storage with another shape of the same numel; one entry may be -1.
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const { return view(shape); }
  // Rows [begin, end) along dim 0, sharing storage (scatter splits batches this way).
  Tensor slice(int64_t begin, int64_t end) const;

  // Copies to `device` and returns when the copy is complete (a tensor already there is returned
  // as is, like PyTorch's .to()).
  Tensor to(Device device) const;
  Tensor cpu() const { return to(Device::cpu()); }
  Tensor cuda(int device = -1) const;  // -1: the current device
  Tensor pin_memory() const;           // a pinned host copy
  Tensor clone() const;                // a copy on the same device
  // A copy on the same device enqueued on that device's current stream and not waited for (a CPU
  // tensor is copied at once): the source may change after the stream has reached the copy.
  Tensor clone_async() const;

  // Copies `src` (same shape and dtype, any device) into this tensor, enqueued on `stream`, or, when
  // `stream` is null, on the current stream of the CUDA device involved (the destination's if both
  // are CUDA) followed by a wait for completion. With an explicit stream the copy is asynchronous:
  // from pinned host memory it overlaps with the host; the caller keeps `src` alive and unchanged
  // until the stream reaches it.
  void copy_from(const Tensor& src, cudaStream_t stream = nullptr);

  Tensor& zero_();
  Tensor& fill_(float value);  // f32
  // Seeded, counter-based random values (kernels/philox.h): element i is a pure function of
  // (seed, offset + i), identical on CPU and GPU.
  Tensor& uniform_(float lo, float hi, uint64_t seed, uint64_t offset = 0);
  Tensor& normal_(float mean, float std, uint64_t seed, uint64_t offset = 0);

  // The elements, copied to the host.
  template <typename T>
  std::vector<T> to_vector() const;

  std::string str() const;  // "Tensor[2, 3] f32 cuda:0"
  bool shares_storage(const Tensor& other) const { return storage_ && storage_ == other.storage_; }

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::f32;
};

std::ostream& operator<<(std::ostream& out, const Tensor& t);

// Throws ValueError unless `t` is defined and on `expected`; names `what`, both devices and the fix.
void check_device(const Tensor& t, Device expected, const char* what);
// Throws ValueError unless `t` has `expected` shape, naming `what`, the shape found and expected.
void check_shape(const Tensor& t, const Shape& expected, const char* what);
// The same two checks with the name given in parts (detail::str's arguments), joined only when
// the check fails: for callers on a step's path whose name is composed (a layer's path, a
// replica's index), which would otherwise build a string at every call.
template <typename... Parts>
void check_device_of(const Tensor& t, Device expected, const Parts&... what) {
  if (!t.defined() || t.device() != expected)
    check_device(t, expected, detail::str(what...).c_str());
}
template <typename... Parts>
void check_shape_of(const Tensor& t, const Shape& expected, const Parts&... what) {
  if (!t.defined() || t.shape() != expected) check_shape(t, expected, detail::str(what...).c_str());
}

// The stream that work on tensors of `device` goes to (null for the CPU).
cudaStream_t stream_for(Device device);

// Runs `cpu()` for the host, or `gpu(stream)` with `device` current and its current stream: the
// one dispatch that layers, losses and optimizers go through.
template <typename Cpu, typename Gpu>
void on_device(Device device, Cpu&& cpu, Gpu&& gpu) {
  if (device.is_cpu()) {
    cpu();
  } else {
    const cuda::DeviceGuard guard(device.index);
    gpu(stream_for(device));
  }
}

}  // namespace cudp
