#include "engine/parallel/replicate.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "engine/core/memory.h"
#include "engine/core/nvtx.h"
#include "layers/dropout.h"

namespace cudp::parallel {
namespace {

// Parameter registry (replicate.h): replica 0's parameter -> its replicas in every live set.
struct Registry {
  std::mutex mutex;
  std::unordered_map<const Parameter*, std::vector<Parameter*>> mirrors;
};

Registry& registry() {
  static auto* r = new Registry;  // never freed: sets may outlive static destruction order
  return *r;
}

// Replica r's Dropout seed: replica 0's, mixed with r (splitmix64's finaliser).
uint64_t replica_seed(uint64_t seed, size_t r) {
  uint64_t z = seed ^ (0x9E3779B97F4A7C15ull * (r + 1));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

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

ReplicaSet::ReplicaSet(std::shared_ptr<Module> module, const std::vector<int>& device_ids)
    : devices_(device_ids) {
  CUDP_CHECK(module != nullptr, "replicate: the module is null");
  check_device_ids(devices_, "replicate");
  check_module_device(*module, devices_[0]);
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
  for (size_t r = 1; r < replicas_.size(); ++r) {
    for (size_t k = 0; k < modules_[0].size(); ++k) {
      if (const auto* d0 = dynamic_cast<const Dropout*>(modules_[0][k])) {
        dynamic_cast<Dropout&>(*modules_[r][k]).set_seed(replica_seed(d0->seed(), r), d0->offset());
      }
    }
  }
  workers_ = std::make_unique<DeviceWorkers>(devices_);
  if (replicas_.size() > 1) {
    comm_ = Communicator::shared(devices_);
    broadcast_parameters();
  }
  register_mirrors();
}

ReplicaSet::~ReplicaSet() {
  unregister_mirrors();
  for (const cuda::Event& event : copied_) cudaEventSynchronize(event.get());  // never throws
}

// ---- collectives
// ---------------------------------------------------------------------------------

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
  if (!comm_) return;
  std::vector<TensorList> lists = parameter_tensors(/*grads=*/false);
  const std::vector<TensorList> bufs = buffers();
  for (size_t r = 0; r < lists.size(); ++r)
    lists[r].insert(lists[r].end(), bufs[r].begin(), bufs[r].end());
  comm_->broadcast_many(lists, 0);
}

void ReplicaSet::broadcast_buffers() {
  if (!comm_) return;
  const std::vector<TensorList> bufs = buffers();
  if (!bufs[0].empty()) comm_->broadcast_many(bufs, 0);
}

void ReplicaSet::zero_mirror_gradients() {
  if (replicas_.size() < 2) return;
  std::vector<TensorList> grads = parameter_tensors(/*grads=*/true);
  for (size_t r = 1; r < grads.size(); ++r) {
    for (Tensor& g : grads[r]) g.zero_();
  }
}

void ReplicaSet::all_reduce_gradients() {
  if (!comm_) return;
  const nvtx::Range range("gradient all-reduce");
  comm_->all_reduce_many(parameter_tensors(/*grads=*/true), ReduceOp::Sum);
}

void ReplicaSet::prepare_forward() {
  // Parents before children: a parent's train() sets its subtree, then children that differ from it
  // are set again.
  for (size_t r = 1; r < replicas_.size(); ++r) {
    for (size_t k = 0; k < modules_[0].size(); ++k) {
      Module& from = *modules_[0][k];
      Module& to = *modules_[r][k];
      if (to.is_training() != from.is_training()) to.train(from.is_training());
      if (const auto* d0 = dynamic_cast<const Dropout*>(&from)) {
        dynamic_cast<Dropout&>(to).set_offset(d0->offset());
      }
    }
  }
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

// ---- inspection
// ----------------------------------------------------------------------------------

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

// ---- registry
// ------------------------------------------------------------------------------------

void ReplicaSet::register_mirrors() {
  const auto& params = params_;
  Registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  for (size_t r = 1; r < params.size(); ++r) {
    for (size_t k = 0; k < params[0].size(); ++k) reg.mirrors[params[0][k]].push_back(params[r][k]);
  }
}

void ReplicaSet::unregister_mirrors() {
  const auto& params = params_;
  Registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  for (size_t r = 1; r < params.size(); ++r) {
    for (size_t k = 0; k < params[0].size(); ++k) {
      const auto it = reg.mirrors.find(params[0][k]);
      if (it == reg.mirrors.end()) continue;
      std::erase(it->second, params[r][k]);
      if (it->second.empty()) reg.mirrors.erase(it);
    }
  }
}

std::vector<std::vector<Parameter*>> replica_parameter_lists(
    const std::vector<Parameter*>& params) {
  Registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  std::vector<std::vector<Parameter*>> lists(1, params);
  for (Parameter* p : params) {
    const auto it = reg.mirrors.find(p);
    if (it == reg.mirrors.end()) continue;
    if (lists.size() < it->second.size() + 1) lists.resize(it->second.size() + 1);
    for (size_t r = 0; r < it->second.size(); ++r) lists[r + 1].push_back(it->second[r]);
  }
  return lists;
}

std::shared_ptr<ReplicaSet> replicate(const std::shared_ptr<Module>& module,
                                      const std::vector<int>& device_ids) {
  static std::mutex mutex;
  static auto* sets =
      new std::map<std::pair<const Module*, std::vector<int>>, std::weak_ptr<ReplicaSet>>;
  std::lock_guard lock(mutex);
  std::erase_if(*sets, [](const auto& entry) { return entry.second.expired(); });
  auto& slot = (*sets)[{module.get(), device_ids}];
  if (auto set = slot.lock()) return set;
  auto set = std::make_shared<ReplicaSet>(module, device_ids);
  slot = set;
  return set;
}

}  // namespace cudp::parallel
