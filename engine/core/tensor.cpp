#include "engine/core/tensor.h"

#include <cstring>
#include <sstream>

#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "kernels/init.h"

namespace cudp {

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: return 2;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

std::string shape_str(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    CUDP_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
    if (__builtin_mul_overflow(n, d, &n)) {
      CUDP_THROW(ValueError, "shape ", shape_str(shape),
                 " has more elements than 64-bit sizes can count");
    }
  }
  return n;
}

size_t shape_nbytes(const Shape& shape, DType dtype) {
  const int64_t numel = shape_numel(shape);
  int64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(element_size(dtype)), &bytes)) {
    CUDP_THROW(ValueError, "a tensor of shape ", shape_str(shape), " and dtype ", dtype_name(dtype),
               " needs more bytes than 64-bit sizes can count");
  }
  return static_cast<size_t>(bytes);
}

cudaStream_t stream_for(Device device) {
  return device.is_cuda() ? cuda::current_stream(device.index) : nullptr;
}

Storage::Storage(size_t bytes_, Device device_, bool pinned_, std::string_view what)
    : bytes(bytes_), device(device_), pinned(pinned_) {
  if (device.is_cuda()) {
    cuda::DeviceGuard guard(device.index);
    stream = cuda::current_stream(device.index);
    ptr = cuda::device_allocate(bytes, device.index, stream, what);
  } else {
    ptr = cuda::host_allocate(bytes, pinned, what);
  }
}

Storage::~Storage() {
  if (device.is_cuda()) {
    cuda::device_free(ptr, stream);
  } else {
    cuda::host_free(ptr, pinned);
  }
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, bool pinned) {
  CUDP_CHECK(!(pinned && device.is_cuda()), "pinned memory is host memory; asked for ", device);
  const size_t bytes = shape_nbytes(shape, dtype);
  Tensor t;
  t.storage_ = std::make_shared<Storage>(
      bytes, device, pinned, detail::str("a tensor ", shape_str(shape), " ", dtype_name(dtype)));
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  return std::move(empty(shape, dtype, device).zero_());
}

Tensor Tensor::full(const Shape& shape, float value, Device device) {
  return std::move(empty(shape, DType::f32, device).fill_(value));
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  CUDP_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ",
             values.size(), " values do not fill shape ", shape_str(shape));
  Tensor host = empty(shape, dtype_of<T>());
  if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), host.nbytes());
  return host.to(device);
}

int64_t Tensor::size(int64_t d) const {
  const int64_t n = dim();
  CUDP_CHECK(d >= -n && d < n, "dimension ", d, " out of range for ", str());
  return shape_[d < 0 ? d + n : d];
}

Device Tensor::device() const { return storage_ ? storage_->device : Device::cpu(); }

void* Tensor::data_ptr() const {
  return storage_ ? static_cast<char*>(storage_->ptr) + offset_ : nullptr;
}

Tensor Tensor::view(const Shape& shape) const {
  CUDP_CHECK(defined(), "view of an undefined tensor");
  Shape resolved = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      CUDP_CHECK(infer < 0, "view: only one dimension may be -1, got ", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      CUDP_CHECK(shape[i] >= 0, "view: invalid shape ", shape_str(shape));
      CUDP_CHECK(!__builtin_mul_overflow(known, shape[i], &known), "view: shape ", shape_str(shape),
                 " has more elements than 64-bit sizes can count");
    }
  }
  if (infer >= 0) {
    CUDP_CHECK(known > 0 && numel() % known == 0, "view: shape ", shape_str(shape),
               " is invalid for a tensor of ", numel(), " elements");
    resolved[infer] = numel() / known;
  }
  CUDP_CHECK(shape_numel(resolved) == numel(), "view: shape ", shape_str(shape),
             " is invalid for input of size ", numel(), " (", str(), ")");
  Tensor t = *this;
  t.shape_ = resolved;
  return t;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  CUDP_CHECK(defined() && dim() >= 1, "slice needs a tensor of at least one dimension, got ", str());
  CUDP_CHECK(0 <= begin && begin <= end && end <= shape_[0], "slice [", begin, ", ", end,
             ") out of range for dim 0 of size ", shape_[0]);
  Tensor t = *this;
  const size_t row_bytes = nbytes() / std::max<int64_t>(shape_[0], 1);
  t.offset_ += static_cast<size_t>(begin) * row_bytes;
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::to(Device device) const {
  CUDP_CHECK(defined(), "to(", device, ") of an undefined tensor");
  if (device == this->device()) return *this;
  Tensor out = empty(shape_, dtype_, device);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::cuda(int device) const {
  return to(Device::cuda(device < 0 ? cuda::current_device() : device));
}

Tensor Tensor::pin_memory() const {
  Tensor out = empty(shape_, dtype_, Device::cpu(), /*pinned=*/true);
  out.copy_from(*this);
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape_, dtype_, device());
  out.copy_from(*this);
  return out;
}

Tensor Tensor::clone_async() const {
  if (is_cpu()) return clone();
  Tensor out = empty(shape_, dtype_, device());
  out.copy_from(*this, cuda::current_stream(device().index));
  return out;
}

void Tensor::copy_from(const Tensor& src, cudaStream_t stream) {
  CUDP_CHECK(defined() && src.defined(), "copy_from with an undefined tensor");
  CUDP_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy_from: source ", src.str(),
             " does not match destination ", str());
  const size_t bytes = nbytes();
  const Device dst_dev = device(), src_dev = src.device();
  if (bytes == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(data_ptr(), src.data_ptr(), bytes);
    return;
  }
  const Device run_on = dst_dev.is_cuda() ? dst_dev : src_dev;
  cuda::DeviceGuard guard(run_on.index);
  const bool wait = stream == nullptr;
  if (wait) stream = cuda::current_stream(run_on.index);
  if (dst_dev.is_cuda() && src_dev.is_cuda() && dst_dev != src_dev) {
    // The source was written on its own device's stream: order the copy after that work.
    cuda::Event ready = cuda::Event::create(src_dev.index);
    ready.record(cuda::current_stream(src_dev.index));
    CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, ready.get(), 0));
    CUDP_CUDA_CHECK(cudaMemcpyPeerAsync(data_ptr(), dst_dev.index, src.data_ptr(), src_dev.index,
                                        bytes, stream));
  } else {
    if (dst_dev.is_cpu() || src_dev.is_cpu()) {
      // A host side is read or written by the host thread only after the stream gets there; work
      // already queued on the device's current stream comes first.
      if (stream != cuda::current_stream(run_on.index)) {
        cuda::Event ready = cuda::Event::create(run_on.index);
        ready.record(cuda::current_stream(run_on.index));
        CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, ready.get(), 0));
      }
    }
    CUDP_CUDA_CHECK(cudaMemcpyAsync(data_ptr(), src.data_ptr(), bytes, cudaMemcpyDefault, stream));
  }
  if (wait) CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

Tensor& Tensor::zero_() {
  if (nbytes() == 0) return *this;
  if (is_cpu()) {
    std::memset(data_ptr(), 0, nbytes());
  } else {
    cuda::DeviceGuard guard(device().index);
    CUDP_CUDA_CHECK(cudaMemsetAsync(data_ptr(), 0, nbytes(), stream_for(device())));
  }
  return *this;
}

Tensor& Tensor::fill_(float value) {
  float* p = data<float>();
  if (is_cpu()) {
    kernels::fill_cpu(p, numel(), value);
  } else {
    cuda::DeviceGuard guard(device().index);
    kernels::fill(p, numel(), value, stream_for(device()));
  }
  return *this;
}

Tensor& Tensor::uniform_(float lo, float hi, uint64_t seed, uint64_t offset) {
  float* p = data<float>();
  if (is_cpu()) {
    kernels::uniform_cpu(p, numel(), lo, hi, seed, offset);
  } else {
    cuda::DeviceGuard guard(device().index);
    kernels::uniform(p, numel(), lo, hi, seed, offset, stream_for(device()));
  }
  return *this;
}

Tensor& Tensor::normal_(float mean, float std, uint64_t seed, uint64_t offset) {
  float* p = data<float>();
  if (is_cpu()) {
    kernels::normal_cpu(p, numel(), mean, std, seed, offset);
  } else {
    cuda::DeviceGuard guard(device().index);
    kernels::normal(p, numel(), mean, std, seed, offset, stream_for(device()));
  }
  return *this;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  CUDP_CHECK(dtype_of<T>() == dtype_, "to_vector<", dtype_name(dtype_of<T>()), "> of ", str());
  const Tensor host = cpu();
  std::vector<T> out(static_cast<size_t>(numel()));
  if (!out.empty()) std::memcpy(out.data(), host.data_ptr(), nbytes());
  return out;
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return detail::str("Tensor", shape_str(shape_), " ", dtype_name(dtype_), " ", device().str());
}

std::ostream& operator<<(std::ostream& out, const Tensor& t) { return out << t.str(); }

void check_device(const Tensor& t, Device expected, const char* what) {
  CUDP_CHECK(t.defined(), what, " is undefined");
  CUDP_CHECK(t.device() == expected, what, " is on ", t.device(), " but is expected on ", expected,
             "; move it with .to(", expected, ") first");
}

void check_shape(const Tensor& t, const Shape& expected, const char* what) {
  CUDP_CHECK(t.defined(), what, " is undefined");
  CUDP_CHECK(t.shape() == expected, what, " has invalid shape ", shape_str(t.shape()),
             ", but expected ", shape_str(expected));
}

#define CUDP_INSTANTIATE(T)                                                               \
  template Tensor Tensor::from_vector<T>(const std::vector<T>&, const Shape&, Device); \
  template std::vector<T> Tensor::to_vector<T>() const;
CUDP_INSTANTIATE(float)
CUDP_INSTANTIATE(__nv_bfloat16)
CUDP_INSTANTIATE(__half)
CUDP_INSTANTIATE(int32_t)
CUDP_INSTANTIATE(int64_t)
CUDP_INSTANTIATE(uint8_t)
#undef CUDP_INSTANTIATE

}  // namespace cudp
