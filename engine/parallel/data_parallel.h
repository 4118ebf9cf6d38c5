// DataParallel: PyTorch's nn.DataParallel (docs/architecture.md §3) on persistent replicas and NCCL.
//
//   forward   scatter the batch along dim 0 (torch.chunk rules) -> each replica's forward on its
//             device's worker thread -> (training) broadcast replica 0's buffers -> gather the
//             outputs on output_device
//   backward  scatter the output gradient with the forward's chunk sizes -> each replica's backward
//             -> gather the input gradient back to the input's device -> all-reduce (SUM) of the
//             replicas' parameter gradients
//
// Gradients are summed, not averaged: the loss on the gathered output is the mean over the whole
// batch, so each replica's gradient already carries 1/B and their sum is the one-device gradient,
// uneven chunks included. A loss computed on each replica (forward_replicas, no gather) must weight
// replica i's mean loss by chunk_weights()[i] = n_i / B for the same result.
//
// The input gradient: when the input came from a previous layer on a GPU (the seed's classifier
// after features), it is gathered back onto that GPU. When the input was a host batch (images from
// the loader) it is not computed back to the host: backward returns an undefined tensor, which
// saves a device-to-host copy and a synchronisation per step that nothing would read.
//
// The optimizer runs on every replica: build it with Replicated<SGD> (or any optimizer of
// layers/optim.h) on model.parameters() -- replica 0's, the module's own -- and it builds one
// optimizer per replica from the engine's parameter registry (replicate.h), steps them together
// with replica 0's learning rate and momentum (what schedulers change), so replicas stay
// bit-identical without any re-broadcast. check_replicas_identical() verifies it. A plain SGD on
// model.parameters() would update replica 0 only and the replicas would drift apart. (A departure
// from docs/architecture.md §3a, which writes `SGD opt(model.parameters(), ...)`: layers/optim.h's Optimizer
// has no hook through which the engine could add the replicas' parameters, so the replicated
// optimizer is a wrapper; with such a hook it could become transparent.)
//
// Usage (docs/architecture.md §3a):
//   auto net = vgg16({...});  net->cuda(0);
//   DataParallel model(net, {0, 1});
//   parallel::Replicated<SGD> opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
//   Tensor out = model.forward(image);           // a pinned host batch, or a tensor on a GPU
//   ... loss on `out` (on cuda:0) ...
//   opt.zero_grad(); model.backward(grad_out); opt.step();
//
// Nesting: DataParallel is a Module, so a model may hold several (the seed wraps `features` and
// `classifier` separately and flattens in between, on the output device) and call them in forward
// and, in reverse, in backward. The members share their device threads and NCCL communicator.
// Call forward() on a DataParallel typed as such: Module::forward (through a Module&) checks that
// the input is on the module's device, which here is output_device, so a host batch is refused
// there; DataParallel::forward takes inputs on any device.
//
// Without any GPU and with device_ids left out, DataParallel runs the module as it is (PyTorch's
// behaviour), so a CPU-only machine runs the same program.
//
// Replicas are made once (replicate.h) from the module as it is at construction. Changes to the
// module's values outside the optimizer (load_state_dict) need broadcast_parameters(); changes to
// its structure or device after wrapping are not supported. train()/eval() are followed.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/parallel/replicate.h"
#include "engine/parallel/scatter_gather.h"
#include "layers/optim.h"

namespace cudp::parallel {

class DataParallel : public Module {
 public:
  // device_ids: all visible devices when left out. output_device: device_ids[0] when left out, -1
  // for the CPU. dim: the dimension to split along (only 0 is supported yet). The module's
  // parameters and buffers must be on device_ids[0].
  explicit DataParallel(std::shared_ptr<Module> module);
  DataParallel(std::shared_ptr<Module> module, std::vector<int> device_ids,
               std::optional<int> output_device = std::nullopt, int dim = 0);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  DataParallel(DataParallel&&) = delete;
  DataParallel& operator=(DataParallel&&) = delete;

  std::string type_name() const override { return "DataParallel"; }

  // Inputs on any device (a host batch, or a GPU tensor from a previous layer); outputs on
  // output_device. These hide Module::forward/forward_all, which require inputs on device().
  Tensor forward(const Tensor& input);
  TensorList forward_all(const TensorList& inputs);

  // The fast path without gather and scatter: outputs[i] is replica i's, on device_ids[i], for the
  // replicas that received a chunk; backward_replicas takes the gradients of those outputs, runs
  // the replicas' backward and the all-reduce, and returns each replica's input gradients (not
  // gathered).
  std::vector<TensorList> forward_replicas(const TensorList& inputs);
  std::vector<TensorList> backward_replicas(const std::vector<TensorList>& grad_outputs);

  const std::shared_ptr<Module>& module() const { return module_; }
  const std::vector<int>& device_ids() const { return device_ids_; }  // empty: pass-through
  int output_device() const { return output_device_; }
  int dim() const { return dim_; }

  // The last forward's rows per replica that ran (torch.chunk sizes), and n_i / B.
  const std::vector<int64_t>& chunk_sizes() const { return sizes_; }
  std::vector<double> chunk_weights() const;

  size_t num_replicas() const;
  std::shared_ptr<Module> replica(size_t i) const;
  // replica_parameters()[r][k]: replica r's k-th parameter; [0] is parameters().
  std::vector<std::vector<Parameter*>> replica_parameters() const;
  // fn(replica, r, device) on every replica's worker thread, in parallel (a hook for per-replica
  // work: an optimizer of one's own, statistics, a loss per replica).
  void for_each_replica(const std::function<void(Module&, size_t, int)>& fn);
  // Replica 0's parameters and buffers to the others (after changing them outside the optimizer).
  void broadcast_parameters();
  // Debug checks (host copies): a checksum per replica, and a bitwise comparison that throws naming
  // the first difference.
  std::vector<uint64_t> replica_checksums() const;
  void check_replicas_identical() const;

  // What happens to BatchNorm running statistics after a training forward (replicate.h).
  void set_buffer_sync(BufferSync sync) { buffer_sync_ = sync; }
  BufferSync buffer_sync() const { return buffer_sync_; }
  // The NCCL communicator of the replicas (null with one device or none): the hook for layers that
  // synchronise across replicas themselves (a future SyncBatchNorm).
  Communicator* communicator() const { return set_ ? set_->communicator() : nullptr; }
  const std::shared_ptr<ReplicaSet>& replicas() const { return set_; }

 protected:
  TensorList forward_impl(const TensorList& inputs) override;
  TensorList backward_impl(const TensorList& grad_outputs) override;
  // DataParallel owns devices and threads: clone the wrapped module and wrap the copy instead.
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  DataParallel(std::shared_ptr<Module> module, std::optional<std::vector<int>> device_ids,
               std::optional<int> output_device, int dim, bool);
  std::vector<TensorList> run_forward(const TensorList& inputs);
  std::vector<TensorList> run_backward(const std::vector<TensorList>& replica_grads);
  std::vector<int> used_devices() const;

  std::shared_ptr<Module> module_;
  std::vector<int> device_ids_;
  int output_device_ = -1;
  int dim_ = 0;
  std::shared_ptr<ReplicaSet> set_;  // null: pass-through (no GPU)
  BufferSync buffer_sync_ = BufferSync::Broadcast;

  // The last forward, for backward.
  std::vector<int64_t> sizes_;
  std::vector<Device> input_devices_;  // where each input's gradient goes back to
  std::vector<std::vector<Shape>> replica_output_shapes_;
  bool replicas_ran_ = false;
};

// One forward on the persistent replicas of `module` (evaluation, inference; docs/architecture.md §3a). The
// replicas are those of a live DataParallel of the same module and device_ids, else made once and
// cached until clear_replica_cache() (the cache holds the module). Without a DataParallel keeping
// them in step, replica 0's parameters and buffers are broadcast before each call, since the module
// may have changed since the last one. The forward overwrites what the replicas saved for backward.
Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input);
Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input,
                     std::vector<int> device_ids, std::optional<int> output_device = std::nullopt,
                     int dim = 0);
TensorList data_parallel_all(const std::shared_ptr<Module>& module, const TensorList& inputs);
TensorList data_parallel_all(const std::shared_ptr<Module>& module, const TensorList& inputs,
                             std::vector<int> device_ids,
                             std::optional<int> output_device = std::nullopt, int dim = 0);
void clear_replica_cache();

// `flag` (a small tensor a step wrote, a skip flag) on each of `devices`: itself where it already
// is, else copies[r] (made once, reused), copied on that device's current stream after the work
// that wrote the flag. The flag's own stream then waits for the copies, so the flag may be freed or
// rewritten after. No host synchronisation.
std::vector<Tensor> flag_on_devices(const Tensor& flag, const std::vector<Device>& devices,
                                    std::vector<Tensor>& copies);

// One optimizer per replica, stepped together (docs/architecture.md §2.7). Built on parameters of replica 0
// (model.parameters() of a DataParallel, or of a bigger model holding DataParallel members), it
// builds Opt on them and one more Opt on each replica's matching parameters
// (replica_parameter_lists). Every replica starts from identical parameters and state and receives
// the identical all-reduced gradient, so identical steps keep them bit-identical. Create it after
// the DataParallel modules, and do not let it outlive them.
template <class Opt>
class Replicated {
 public:
  using Options = std::remove_cvref_t<decltype(std::declval<const Opt&>().options())>;

  Replicated(const std::vector<Parameter*>& params, const Options& options) {
    for (auto& list : replica_parameter_lists(params)) {
      optimizers_.push_back(std::make_unique<Opt>(std::move(list), options));
    }
  }

  // Zeroes every replica's gradients (replicas 1.. are zeroed by each backward anyway).
  void zero_grad() {
    for (auto& opt : optimizers_) {
      opt->zero_grad();
    }
  }

  // Steps every replica, with primary()'s learning rate and momentum.
  void step() {
    follow_primary();
    for (auto& opt : optimizers_) {
      opt->step();
    }
  }
  // The same, skipped on every replica when `skip` (on primary()'s device: nonfinite_flag of the
  // loss and the gradient norm there) is nonzero (Optimizer::step(skip)). The flag is copied to
  // the other replicas' devices on their streams; nothing waits on the host.
  void step(const Tensor& skip) {
    follow_primary();
    std::vector<Device> devices;
    for (auto& opt : optimizers_) devices.push_back(opt->params()[0]->data.device());
    const std::vector<Tensor> flags = flag_on_devices(skip, devices, skip_flags_);
    for (size_t r = 0; r < optimizers_.size(); ++r) {
      optimizers_[r]->step(flags[r]);
    }
  }
  // The steps step(skip) skipped (every replica skips the same ones); waits for the device.
  int64_t skipped_steps() const { return primary().skipped_steps(); }

  // Clips every replica's gradients by the norm of its own, identical, gradients; returns replica
  // 0's norm.
  Tensor clip_grad_norm(double max_norm) {
    Tensor norm;
    for (size_t r = optimizers_.size(); r-- > 0;) {
      norm = cudp::clip_grad_norm(optimizers_[r]->params(), max_norm);
    }
    return norm;
  }

  // The optimizer of the given parameters: what an LR scheduler drives and a checkpoint saves.
  Opt& primary() { return *optimizers_[0]; }
  const Opt& primary() const { return *optimizers_[0]; }
  Opt& replica(size_t r) { return *optimizers_.at(r); }
  size_t size() const { return optimizers_.size(); }

  double lr() const { return primary().lr(); }
  void set_lr(double lr) { primary().set_lr(lr); }

  TensorMap state_dict() const { return primary().state_dict(); }
  // The same state into every replica's optimizer.
  void load_state_dict(const TensorMap& state) {
    for (auto& opt : optimizers_) {
      opt->load_state_dict(state);
    }
  }

  // Replicas take primary()'s learning rate and momentum (what step() does first). A CUDA graph of
  // a step does not run step()'s host code when replayed: call this before each replay
  // (GraphedStepOptions::before_replay, layers/train.h).
  void follow_primary() {
    const Opt& first = *optimizers_[0];
    for (size_t r = 1; r < optimizers_.size(); ++r) {
      optimizers_[r]->set_lr(first.lr());
      optimizers_[r]->set_momentum(first.momentum());
    }
  }

 private:
  std::vector<std::unique_ptr<Opt>> optimizers_;
  std::vector<Tensor> skip_flags_;  // the skip flag on each replica's device (flag_on_devices)
};

}  // namespace cudp::parallel

namespace cudp {
using parallel::data_parallel;
using parallel::DataParallel;
}  // namespace cudp
