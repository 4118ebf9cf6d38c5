#include "engine/parallel/replicate.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "engine/core/memory.h"
#include "engine/core/nvtx.h"

namespace cudp::parallel {
namespace {

void check_module_device(Module& module, int device) {
  const Device expected = Device::cuda(device);
  auto complain = [&](const Tensor& t) {
    CUDP_CHECK(t.device() == expected, "module must have its parameters and buffers on device ",
               expected, " (device_ids[0]) but found one of them on device: ", t.device());
  };
  for (const auto& [name, p] : module.named_parameters()) complain(p->data);
  for (const auto& [name, b] : module.named_buffers()) complain(*b);
}

uint64_t fnv1a(uint64_t hash, const Tensor& t) {
  const Tensor host = t.cpu();
  const auto* bytes = static_cast<const unsigned char*>(host.data_ptr());
  for (size_t i = 0; i < host.nbytes(); ++i) hash = (hash ^ bytes[i]) * 0x100000001B3ull;
  return hash;
}

std::string element_str(const Tensor& host, size_t index) {
  if (host.dtype() == DType::f32) {
    std::ostringstream out;
    out.precision(9);
    out << static_cast<const float*>(host.data_ptr())[index];
    return out.str();
  }
  return detail::str("(", dtype_name(host.dtype()), " element)");
}

}  // namespace

ReplicaSet::ReplicaSet(std::shared_ptr<Module> module, const std::vector<int>& device_ids,
                       std::shared_ptr<Communicator> comm, ReducerOptions reducer)
    : devices_(device_ids), comm_(std::move(comm)), reducer_options_(reducer) {
  CUDP_CHECK(module != nullptr, "replicate: the module is null");
  check_device_ids(devices_, "replicate");
  check_module_device(*module, devices_[0]);
  check_not_reduced(*module, "replicate");  // before anything is flattened
  if (comm_) {
    CUDP_CHECK(comm_->devices() == devices_ && comm_->world_size() == comm_->size(),
               "replicate: the communicator to share drives devices ",
               shape_str(Shape(comm_->devices().begin(), comm_->devices().end())),
               " of a world of ", comm_->world_size(), " but the replicas are on ",
               shape_str(Shape(devices_.begin(), devices_.end())),
               "; share a communicator only between users of the same devices in this process");
  }
  replicas_.push_back(std::move(module));
  const std::string advice =
      "Every GPU holds a whole copy of the model with its gradients and optimizer state: use a "
      "smaller model, or GPUs with more free memory.";
  for (size_t r = 1; r < devices_.size(); ++r) {
    const cuda::AllocationPurpose purpose(
        detail::str("replica ", r, " of the model on cuda:", devices_[r],
                    " (a copy of its parameters, gradients and buffers)"),
        advice);
    replicas_.push_back(replicas_[0]->clone(Device::cuda(devices_[r])));
  }
  for (size_t r = 0; r < replicas_.size(); ++r) {
    const auto& replica = replicas_[r];
    const cuda::AllocationPurpose purpose(
        detail::str("the flat parameter and gradient buffers of replica ", r, " on cuda:",
                    devices_[r]),
        advice);
    std::pair<Tensor, Tensor> flat;
    try {
      flat = replica->flatten_parameters();
    } catch (const ValueError&) {
      flat = {};  // parameters that cannot share one fp32 buffer: per-parameter collectives
    }
    flat_.push_back(std::move(flat));
  }
  for (const auto& replica : replicas_) {
    params_.push_back(replica->parameters());
    std::vector<Tensor*> bufs;
    for (const auto& [name, b] : replica->named_buffers()) bufs.push_back(b);
    buffers_.push_back(std::move(bufs));
    std::vector<Module*> modules;
    for (const auto& [name, m] : replica->named_modules()) modules.push_back(m);
    modules_.push_back(std::move(modules));
  }
  sync_replicas(Module::ReplicaSync::Created);
  workers_ = std::make_unique<DeviceWorkers>(devices_);
  if (replicas_.size() > 1) {
    if (!comm_) comm_ = std::make_shared<Communicator>(devices_);
    broadcast_parameters();
  }
  make_reducer();
}

ReplicaSet::~ReplicaSet() {
  reducer_.reset();  // its hooks leave the replicas' modules first
  for (const cuda::Event& event : copied_) cudaEventSynchronize(event.get());  // never throws
}

// ---- collectives --------------------------------------------------------------------------------

std::vector<TensorList> ReplicaSet::parameter_tensors(bool grads) const {
  const auto& params = params_;
  bool flat = true;
  for (size_t r = 0; r < replicas_.size() && flat; ++r) {
    const auto& [data, grad] = flat_[r];
    flat = data.defined() && std::all_of(params[r].begin(), params[r].end(), [&](Parameter* p) {
             return p->data.shares_storage(data) && p->grad.shares_storage(grad);
           });
  }
  std::vector<TensorList> lists(replicas_.size());
  for (size_t r = 0; r < replicas_.size(); ++r) {
    if (flat) {
      lists[r].push_back(grads ? flat_[r].second : flat_[r].first);
      continue;
    }
    for (Parameter* p : params[r]) lists[r].push_back(grads ? p->grad : p->data);
  }
  return lists;
}

std::vector<TensorList> ReplicaSet::buffers() const {
  std::vector<TensorList> lists;
  for (const auto& bufs : buffers_) {
    TensorList list;
    for (const Tensor* b : bufs) list.push_back(*b);
    lists.push_back(std::move(list));
  }
  return lists;
}

void ReplicaSet::broadcast_parameters() {
  if (comm_) {
    std::vector<TensorList> lists = parameter_tensors(/*grads=*/false);
    const std::vector<TensorList> bufs = buffers();
    for (size_t r = 0; r < lists.size(); ++r)
      lists[r].insert(lists[r].end(), bufs[r].begin(), bufs[r].end());
    comm_->broadcast_many(lists, 0);
  }
  // The bf16 compute copies follow their master weights (NOTE [The parameter store]), on each
  // device's compute stream, which waits for the broadcast; replica 0's too (on one device as
  // well), since a caller broadcasts after changing its weights (broadcast_parameters()'s
  // contract).
  for (const auto& replica : replicas_) replica->refresh_compute_copies();
  if (comm_) sync_replicas(Module::ReplicaSync::BuffersBroadcast);
}

void ReplicaSet::broadcast_buffers() {
  if (!comm_) return;
  const std::vector<TensorList> bufs = buffers();
  if (bufs[0].empty()) return;
  comm_->broadcast_many(bufs, 0);
  sync_replicas(Module::ReplicaSync::BuffersBroadcast);
}

void ReplicaSet::zero_mirror_gradients() {
  if (replicas_.size() < 2 || !mirrors_hold_total_) return;
  // Those a deferred zero_grad left pending are written by the next backward, not zeroed here
  // (NOTE [Deferred zeroing], layers/module.h).
  const std::vector<TensorList> grads = parameter_tensors(/*grads=*/true);
  for (size_t r = 1; r < grads.size(); ++r) {
    const bool flat = grads[r].size() == 1 && flat_[r].second.defined() &&
                      grads[r][0].data_ptr() == flat_[r].second.data_ptr();
    zero_grads_not_pending(params_[r], flat ? flat_[r].second.data<float>() : nullptr,
                           flat ? flat_[r].second.numel() : 0);
  }
  mirrors_hold_total_ = false;
}

void ReplicaSet::all_reduce_gradients() {
  if (!comm_) return;
  // Unused parameters, replicas without a chunk: what is still pending counts as zero.
  for (const auto& params : params_) zero_pending_grads(params);
  const nvtx::Range range("gradient all-reduce");
  comm_->all_reduce_many(parameter_tensors(/*grads=*/true), ReduceOp::Sum);
  mirrors_hold_total_ = true;
}

void ReplicaSet::make_reducer() {
  reducer_.reset();
  group_.reset();
  segments_open_.clear();
  if (!comm_ && !(one_device_reducer_ && devices_.size() == 1)) return;
  // A model without parameters has no gradient to reduce (all_reduce_gradients has nothing to do
  // either); its flat buffers are empty, not undefined.
  if (params_.empty() || params_[0].empty()) return;
  TensorList flat_grads;
  for (const auto& [data, grad] : flat_) {
    if (!grad.defined()) return;  // not flat: the per-parameter all-reduce
    flat_grads.push_back(grad);
  }
  if (comm_) {
    group_ = std::make_unique<CommunicatorGroup>(*comm_);
  } else {
    group_ = std::make_unique<LocalGroup>(devices_[0]);
  }
  reducer_ = std::make_unique<Reducer>(params_, std::move(flat_grads), *group_, reducer_options_);
  for (size_t r = 0; r < replicas_.size(); ++r) reducer_->attach(r, *replicas_[r]);
}

void ReplicaSet::set_reducer_options(ReducerOptions options) {
  CUDP_CHECK(!reducing_, "ReplicaSet: the reducer's options cannot change during a backward");
  reducer_options_ = options;
  make_reducer();
}

void ReplicaSet::reduce_on_one_device() {
  if (one_device_reducer_ || devices_.size() != 1) return;
  CUDP_CHECK(!reducing_, "ReplicaSet: a reducer cannot be made during a backward");
  one_device_reducer_ = true;
  make_reducer();
}

std::vector<GradientSegment> ReplicaSet::take_gradient_segments(size_t r) {
  if (!reducer_ || r >= segments_open_.size() || !segments_open_[r]) return {};
  segments_open_[r] = false;
  return reducer_->gradient_segments(r);
}

void ReplicaSet::begin_backward(size_t active, bool reduce) {
  segments_open_.clear();
  zero_mirror_gradients();  // NOTE [Replica gradients are scratch]
  const bool reducing = reduce && reducer_ && reducer_->layout_intact();
  if (reducing) reducer_->prepare(active);  // first: if it throws, no backward is marked as running
  reducing_ = reducing;
}

void ReplicaSet::end_backward(bool reduce) {
  if (!reduce) return;
  if (reducing_) {
    reducing_ = false;
    const nvtx::Range range("gradient all-reduce (last buckets)");
    reducer_->finish();
    mirrors_hold_total_ = true;
    segments_open_.assign(replicas_.size(), true);
  } else {
    all_reduce_gradients();
  }
}

void ReplicaSet::abandon_backward() {
  segments_open_.clear();
  if (reducing_) reducer_->abandon();
  reducing_ = false;
}

void ReplicaSet::sync_replicas(Module::ReplicaSync when) {
  for (size_t r = 1; r < replicas_.size(); ++r) {
    for (size_t k = 0; k < modules_[0].size(); ++k) {
      modules_[r][k]->sync_replica(*modules_[0][k], r, when);
    }
  }
}

void ReplicaSet::prepare_forward() {
  segments_open_.clear();  // a new step: the last backward's buckets are no one's to update
  // Parents before children: a parent's train() sets its subtree, then children that differ from it
  // are set again.
  for (size_t r = 1; r < replicas_.size(); ++r) {
    for (size_t k = 0; k < modules_[0].size(); ++k) {
      Module& from = *modules_[0][k];
      Module& to = *modules_[r][k];
      if (to.is_training() != from.is_training()) to.train(from.is_training());
    }
  }
  sync_replicas(Module::ReplicaSync::BeforeForward);
}

void ReplicaSet::keep_until_copied(const TensorList& sources) {
  TensorList pinned;
  for (const Tensor& t : sources) {
    if (t.defined() && t.is_cpu() && t.is_pinned()) pinned.push_back(t);
  }
  if (pinned.empty()) return;  // nothing new to hold: what is held stays until a later call
  for (const cuda::Event& event : copied_) event.synchronize();
  copied_.clear();
  held_ = std::move(pinned);
  for (const int device : devices_) {
    cuda::DeviceGuard guard(device);
    copied_.push_back(cuda::Event::create(device));
    copied_.back().record(cuda::current_stream(device));
  }
}

// ---- inspection ---------------------------------------------------------------------------------

std::vector<uint64_t> ReplicaSet::checksums() const {
  std::vector<uint64_t> sums;
  for (const auto& replica : replicas_) {
    uint64_t hash = 0xCBF29CE484222325ull;
    for (const auto& [name, p] : replica->named_parameters()) hash = fnv1a(hash, p->data);
    for (const auto& [name, b] : replica->named_buffers()) hash = fnv1a(hash, *b);
    sums.push_back(hash);
  }
  return sums;
}

void ReplicaSet::check_identical() const {
  auto tensors_of = [](Module& m) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (const auto& [name, p] : m.named_parameters())
      out.emplace_back("parameter '" + name + "'", p->data);
    for (const auto& [name, b] : m.named_buffers()) out.emplace_back("buffer '" + name + "'", *b);
    return out;
  };
  const auto reference = tensors_of(*replicas_[0]);
  for (size_t r = 1; r < replicas_.size(); ++r) {
    const auto other = tensors_of(*replicas_[r]);
    for (size_t k = 0; k < reference.size(); ++k) {
      const Tensor a = reference[k].second.cpu();
      const Tensor b = other[k].second.cpu();
      const auto* pa = static_cast<const unsigned char*>(a.data_ptr());
      const auto* pb = static_cast<const unsigned char*>(b.data_ptr());
      if (a.nbytes() == 0 || std::memcmp(pa, pb, a.nbytes()) == 0) continue;
      const size_t byte = static_cast<size_t>(std::mismatch(pa, pa + a.nbytes(), pb).first - pa);
      const size_t index = byte / element_size(a.dtype());
      CUDP_THROW(Error, "replicas differ: replica ", r, " (cuda:", devices_[r], ") ",
                 reference[k].first, " element ", index, " is ", element_str(b, index),
                 " but replica 0 (cuda:", devices_[0], ") has ", element_str(a, index),
                 ". Every replica must take the same optimizer step (parallel::Replicated), and "
                 "changes to replica 0 outside it need broadcast_parameters()");
    }
  }
}

void ReplicaSet::for_each(const std::function<void(Module&, size_t, int)>& fn) {
  workers_->run(size(), [&](size_t r) { fn(*replicas_[r], r, devices_[r]); });
}

}  // namespace cudp::parallel
