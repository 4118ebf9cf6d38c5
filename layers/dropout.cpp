#include "layers/dropout.h"

#include <cstring>

#include "engine/core/graph.h"
#include "kernels/dropout.h"

namespace cudp {

Dropout::Dropout(float p, uint64_t seed) : p_(p), seed_(seed) {
  CUDP_CHECK(p_ >= 0.0f && p_ < 1.0f, "Dropout: p must be in [0, 1), got ", p_);
}

Tensor Dropout::forward_one(const Tensor& input) {
  CUDP_CHECK(input.dtype() == DType::f32, "Dropout: input must be f32, got ", input.str());
  saved_shape_ = input.shape();
  saved_active_ = training_ && p_ > 0.0f;
  if (!saved_active_) {
    return input;
  }
  saved_seed_ = seed_;
  saved_offset_ = offset_;
  const int64_t n = input.numel();
  const auto advance = static_cast<uint64_t>((n + 3) / 4 * 4);
  offset_ += advance;
  saved_slot_ = nullptr;
  if (device_.is_cuda()) {
    if (cuda::ReplayScalars* replay = cuda::ReplayScalars::active(device_.index)) {
      // Captured: the kernels read (seed, offset) from a slot, and each replay advances the
      // offset as this forward just did (engine/core/graph.h NOTE [Replay scalars]).
      const cuda::ReplayScalars::Slot slot = replay->slot(device_.index, 2 * sizeof(uint64_t));
      const uint64_t values[2] = {saved_seed_, saved_offset_};
      std::memcpy(slot.host, values, sizeof values);
      saved_slot_ = static_cast<const uint64_t*>(slot.device);
      replay->on_replay([this, advance, host = slot.host] {
        saved_seed_ = seed_;
        saved_offset_ = offset_;
        offset_ += advance;
        const uint64_t next[2] = {saved_seed_, saved_offset_};
        std::memcpy(host, next, sizeof next);
      });
    }
  }
  Tensor y = Tensor::empty(input.shape(), DType::f32, device_);
  const float* x = input.data<float>();
  float* out = y.data<float>();
  const float p = p_;
  const uint64_t seed = seed_, offset = saved_offset_;
  const uint64_t* slot = saved_slot_;
  run([&] { kernels::dropout_forward_cpu(x, out, n, p, seed, offset); },
      [&](cudaStream_t s) {
        if (slot != nullptr) {
          kernels::dropout_forward(x, out, n, p, slot, s);
        } else {
          kernels::dropout_forward(x, out, n, p, seed, offset, s);
        }
      });
  return y;
}

Tensor Dropout::backward_one(const Tensor& grad_output) {
  check_shape(grad_output, saved_shape_, "Dropout: grad_output");
  if (!saved_active_) {
    return grad_output;
  }
  const int64_t n = grad_output.numel();
  Tensor dx = Tensor::empty(grad_output.shape(), DType::f32, device_);
  const float* dy = grad_output.data<float>();
  float* out = dx.data<float>();
  const float p = p_;
  const uint64_t seed = saved_seed_, offset = saved_offset_;
  const uint64_t* slot = saved_slot_;
  run([&] { kernels::dropout_backward_cpu(dy, out, n, p, seed, offset); },
      [&](cudaStream_t s) {
        if (slot != nullptr) {
          kernels::dropout_backward(dy, out, n, p, slot, s);
        } else {
          kernels::dropout_backward(dy, out, n, p, seed, offset, s);
        }
      });
  return dx;
}

uint64_t Dropout::replica_seed(uint64_t seed, size_t replica) {
  uint64_t z = seed ^ (0x9E3779B97F4A7C15ull * (replica + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void Dropout::sync_replica(const Module& primary, size_t replica, ReplicaSync when) {
  const auto* first = dynamic_cast<const Dropout*>(&primary);
  CUDP_CHECK(first != nullptr, "Dropout: replica ", replica, "'s Dropout matches a ",
             primary.type_name(), " in replica 0; replicas must have replica 0's structure");
  switch (when) {
    case ReplicaSync::Created:
      set_seed(replica_seed(first->seed(), replica), first->offset());
      break;
    case ReplicaSync::BeforeForward:
      set_offset(first->offset());
      break;
    case ReplicaSync::BuffersBroadcast:
      break;
  }
}

std::string Dropout::extra_repr() const {
  return detail::str("p=", py_float(p_), ", inplace=False");
}

std::shared_ptr<Module> Dropout::make_empty_copy() const {
  auto copy = std::make_shared<Dropout>(p_, seed_);
  copy->offset_ = offset_;
  return copy;
}

}  // namespace cudp
