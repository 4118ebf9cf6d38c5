// DataParallel: PyTorch's nn.DataParallel (docs/architecture.md §3) on persistent replicas and
// NCCL.
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
// layers/optim.h) on the model -- the DataParallel, or a bigger model holding DataParallel members
// -- and it builds one optimizer per replica from those members' replicas, steps them together
// with replica 0's learning rate and momentum (what schedulers change), so replicas stay
// bit-identical without any re-broadcast. check_replicas_identical() verifies it. A plain SGD on
// model.parameters() would update replica 0 only and the replicas would drift apart. (A departure
// from PyTorch, where `SGD opt(model.parameters(), ...)` suffices: layers/optim.h's Optimizer has
// no hook through which the engine could add the replicas' parameters, so the replicated optimizer
// is a wrapper; with such a hook it could become transparent.)
//
// Gradients are summed by a Reducer (engine/parallel/reducer.h): buckets of the flat gradient
// buffer (25 MiB unless set_reducer_options says otherwise), each all-reduced as soon as the
// backward has completed it on every replica, on the communication streams; compute waits only for
// the last, at the end of backward. set_gradient_sync(false) or a no_sync() guard leaves gradients
// local to each replica (accumulation over micro-batches: one all-reduce at the end, PyTorch DDP's
// no_sync()).
//
// Usage (docs/architecture.md §3a):
//   auto net = vgg16({...});  net->cuda(0);
//   DataParallel model(net, {0, 1});
//   parallel::Replicated<SGD> opt(model, {.lr = 0.05, .momentum = 0.9});
//   Tensor out = model.forward(image);           // a pinned host batch, or a tensor on a GPU
//   ... loss on `out` (on cuda:0) ...
//   opt.zero_grad(); model.backward(grad_out); opt.step();
//
// Nesting: DataParallel is a Module, so a model may hold several (the seed wraps `features` and
// `classifier` separately and flattens in between, on the output device) and call them in forward
// and, in reverse, in backward. Each member owns its replicas, device threads and reducer; members
// on the same devices may share one NCCL communicator (DataParallelOptions::communicator, from
// the first member's shared_communicator()). forward_all overrides Module's, so a DataParallel
// takes inputs on any device (a host batch, a GPU tensor) also when called through a Module&.
//
// Without any GPU and with device_ids left out, DataParallel runs the module as it is (PyTorch's
// behaviour), so a CPU-only machine runs the same program.
//
// Synchronised batch norm: layers that synchronise statistics across replicas (SyncBatchNorm2d,
// made by convert_sync_batchnorm before wrapping) get one group over this DataParallel's
// communicator (engine/parallel/stats_group.h), replica i as participant i, through
// attach_stats_group: the engine names no layer. Every replica must then run every training
// forward, so a training batch smaller than the devices is refused. With one device there is no
// group and the layers are BatchNorm2d (PyTorch's SyncBatchNorm with one process).
//
// Replicas are made once (replicate.h) from the module as it is at construction. Changes to the
// module's values outside the optimizer (load_state_dict) need broadcast_parameters(); changes to
// its structure or device after wrapping are not supported. train()/eval() are followed.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/parallel/replicate.h"
#include "engine/parallel/scatter_gather.h"
#include "layers/optim.h"

namespace cudp {
class StatsGroup;
}

namespace cudp::parallel {

struct DataParallelOptions {
  std::optional<int> output_device;  // device_ids[0] when left out; -1: the CPU
  // Another DataParallel's communicator over the same device_ids (shared_communicator()), to share
  // instead of making one; null: its own.
  std::shared_ptr<Communicator> communicator;
  ReducerOptions reducer;  // bucket size and overlap of the gradient all-reduce
};

class DataParallel : public Module {
 public:
  // device_ids: all visible devices when left out. output_device: device_ids[0] when left out, -1
  // for the CPU. dim: the dimension to split along (only 0 is supported yet). The module's
  // parameters and buffers must be on device_ids[0].
  explicit DataParallel(std::shared_ptr<Module> module);
  DataParallel(std::shared_ptr<Module> module, std::vector<int> device_ids,
               std::optional<int> output_device = std::nullopt, int dim = 0);
  DataParallel(std::shared_ptr<Module> module, std::vector<int> device_ids,
               DataParallelOptions options);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  DataParallel(DataParallel&&) = delete;
  DataParallel& operator=(DataParallel&&) = delete;

  std::string type_name() const override { return "DataParallel"; }

  // Inputs on any device (a host batch, or a GPU tensor from a previous layer); outputs on
  // output_device. Module::forward comes here too.
  TensorList forward_all(const TensorList& inputs) override;

  // The fast path without gather and scatter: outputs[i] is replica i's, on device_ids[i], for the
  // replicas that received a chunk; backward_replicas takes the gradients of those outputs, runs
  // the replicas' backward and the all-reduce, and returns each replica's input gradients (not
  // gathered).
  std::vector<TensorList> forward_replicas(const TensorList& inputs);
  std::vector<TensorList> backward_replicas(const std::vector<TensorList>& grad_outputs);

  const std::shared_ptr<Module>& module() const { return module_; }
  // Module's, for every replica (replica 0 is the wrapped module, a child; the others are not).
  void release_forward_state() override;
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
  // The NCCL communicator of the replicas (null with one device or none): what layers that
  // synchronise across replicas sum over (SyncBatchNorm2d, through CommStatsGroup), and what
  // another DataParallel on the same devices may share (DataParallelOptions::communicator).
  Communicator* communicator() const { return set_ ? set_->communicator() : nullptr; }
  std::shared_ptr<Communicator> shared_communicator() const {
    return set_ ? set_->shared_communicator() : nullptr;
  }
  // The replicas, owned by this DataParallel (null: pass-through, no GPU).
  ReplicaSet* replicas() const { return set_.get(); }

  // The gradient all-reduce's buckets and overlap (engine/parallel/reducer.h); set them before a
  // CUDA graph of the step is captured. reducer() is null with one device or without flat
  // parameters.
  void set_reducer_options(ReducerOptions options);
  ReducerOptions reducer_options() const;
  const Reducer* reducer() const { return set_ ? set_->reducer() : nullptr; }
  // Replica r's buckets of the last backward, each with the event after which it is summed on its
  // device (Reducer::gradient_segments), once per backward: what Replicated::set_update_overlap
  // gives the replicas' optimizers. Empty when that backward did not go through the reducer, when
  // they were taken already, and after a forward. On one device there is a reducer (with nothing
  // to sum) only after reduce_on_one_device(), which makes one (call it before a CUDA graph of the
  // step is captured).
  std::vector<GradientSegment> take_gradient_segments(size_t r) {
    return set_ ? set_->take_gradient_segments(r) : std::vector<GradientSegment>{};
  }
  void reduce_on_one_device() {
    if (set_) set_->reduce_on_one_device();
  }

  // Whether backward sums the replicas' gradients (true unless set). Off, each replica keeps its
  // own share and accumulates the next backward's onto it; the first backward with it on again
  // sums everything accumulated (PyTorch DDP's require_backward_grad_sync). A captured CUDA graph
  // keeps the setting it was captured with.
  void set_gradient_sync(bool on) { gradient_sync_ = on; }
  bool gradient_sync() const { return gradient_sync_; }
  // PyTorch DDP's no_sync(): gradient sync off while the guard lives, then as it was.
  using NoSync = GradientSyncOff<DataParallel>;
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

 protected:
  TensorList forward_impl(const TensorList& inputs) override;
  TensorList backward_impl(const TensorList& grad_outputs) override;
  // DataParallel owns devices and threads: clone the wrapped module and wrap the copy instead.
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  DataParallel(std::shared_ptr<Module> module, std::optional<std::vector<int>> device_ids,
               DataParallelOptions options, int dim);
  std::vector<TensorList> run_forward(const TensorList& inputs);
  std::vector<TensorList> run_backward(const std::vector<TensorList>& replica_grads);
  std::vector<int> used_devices() const;

  std::shared_ptr<Module> module_;
  std::vector<int> device_ids_;
  int output_device_ = -1;
  int dim_ = 0;
  std::unique_ptr<ReplicaSet> set_;  // null: pass-through (no GPU)
  // The replicas' SyncBatchNorm2d group (null: none, or one device).
  std::shared_ptr<StatsGroup> stats_group_;
  BufferSync buffer_sync_ = BufferSync::Broadcast;
  bool gradient_sync_ = true;

  // The last forward, for backward.
  std::vector<int64_t> sizes_;
  std::vector<Device> input_devices_;  // where each input's gradient goes back to
  std::vector<std::vector<Shape>> replica_output_shapes_;
  bool replicas_ran_ = false;
};

// The replicas data_parallel() keeps between calls, one ReplicaSet per (module, device_ids), each
// holding its module alive. Its owner decides its lifetime: data_parallel_all(cache, ...) uses
// the caller's; the forms without a cache use default_replica_cache(), which lives from its first
// use to the end of the process (never destroyed: NCCL teardown at exit would race the CUDA
// runtime's) and which clear_replica_cache() empties. Not thread-safe between calls on one module.
class ReplicaCache {
 public:
  ReplicaCache() = default;
  ReplicaCache(const ReplicaCache&) = delete;
  ReplicaCache& operator=(const ReplicaCache&) = delete;
  // The set of `module` on `device_ids`, made on first use.
  ReplicaSet& replicas(const std::shared_ptr<Module>& module, const std::vector<int>& device_ids);
  void clear();
  size_t size() const;

 private:
  struct Entry {
    std::shared_ptr<Module> module;  // keeps the key's address valid
    std::unique_ptr<ReplicaSet> set;
  };
  mutable std::mutex mutex_;
  std::map<std::pair<const Module*, std::vector<int>>, Entry> sets_;
};
ReplicaCache& default_replica_cache();
void clear_replica_cache();  // default_replica_cache().clear()

// One forward on persistent replicas of `module` (evaluation, inference; docs/architecture.md §3a):
// PyTorch's data_parallel(module, inputs, device_ids, output_device). The replicas are the
// cache's (above), not a DataParallel's, and replica 0's parameters and buffers are broadcast to
// them before each call, since the module may have changed since the last one (PyTorch replicates
// at every call). The forward overwrites what the replicas saved for backward.
Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input);
Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input,
                     std::vector<int> device_ids, std::optional<int> output_device = std::nullopt,
                     int dim = 0);
TensorList data_parallel_all(const std::shared_ptr<Module>& module, const TensorList& inputs);
TensorList data_parallel_all(const std::shared_ptr<Module>& module, const TensorList& inputs,
                             std::vector<int> device_ids,
                             std::optional<int> output_device = std::nullopt, int dim = 0);
TensorList data_parallel_all(ReplicaCache& cache, const std::shared_ptr<Module>& module,
                             const TensorList& inputs, std::vector<int> device_ids,
                             std::optional<int> output_device = std::nullopt, int dim = 0);

// lists[0] = model.parameters(); lists[r] = replica r's parameters matching them, found through
// the DataParallel modules inside `model` (or `model` itself), for parameters that have an r-th
// replica. Parameters outside any DataParallel appear in lists[0] only.
std::vector<std::vector<Parameter*>> replica_parameter_lists(Module& model);

// `flag` (a small tensor a step wrote, a skip flag) on each of `devices`: itself where it already
// is, else copies[r] (made once, reused), copied on that device's current stream after the work
// that wrote the flag. The flag's own stream then waits for the copies, so the flag may be freed or
// rewritten after. No host synchronisation.
std::vector<Tensor> flag_on_devices(const Tensor& flag, const std::vector<Device>& devices,
                                    std::vector<Tensor>& copies);

// One optimizer per replica, stepped together (docs/architecture.md §2.7). Built on a model (a
// DataParallel, or a bigger model holding DataParallel members), it builds Opt on
// model.parameters() and one more Opt on each replica's matching parameters
// (replica_parameter_lists). Every replica starts from identical parameters and state and receives
// the identical all-reduced gradient, so identical steps keep them bit-identical. Create it after
// the DataParallel modules, and do not let it outlive them.
template <class Opt>
class Replicated {
 public:
  using Options = std::remove_cvref_t<decltype(std::declval<const Opt&>().options())>;

  Replicated(Module& model, const Options& options)
      : Replicated(replica_parameter_lists(model), options) {}
  // lists[r]: replica r's parameters, matching lists[0] element by element.
  Replicated(std::vector<std::vector<Parameter*>> lists, const Options& options) {
    CUDP_CHECK(!lists.empty(), "Replicated: no parameter lists");
    for (auto& list : lists) {
      optimizers_.push_back(std::make_unique<Opt>(std::move(list), options));
    }
  }

  // Zeroes every replica's gradients (replicas 1.. are zeroed by each backward anyway), or defers
  // it to the next backward (Optimizer::zero_grad).
  void zero_grad(ZeroGrad how = ZeroGrad::fill) {
    for (auto& opt : optimizers_) {
      opt->zero_grad(how);
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
  // step(), and the norm of primary()'s gradients (every replica holds the same all-reduced ones)
  // as grad_norm(primary().params()) gives it, computed by primary()'s update as it reads them
  // where it can (Optimizer::step_and_grad_norm).
  Tensor step_and_grad_norm() {
    follow_primary();
    Tensor norm = optimizers_[0]->step_and_grad_norm();
    for (size_t r = 1; r < optimizers_.size(); ++r) {
      optimizers_[r]->step();
    }
    return norm;
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

  // The update beside the backward (Optimizer::set_update_overlap, NOTE [The update beside the
  // backward] in layers/optim.cpp): each replica's optimizer updates the buckets of `dp`'s reducer
  // as the replica's backward completes them (on one GPU `dp` makes a reducer for it), instead of
  // all parameters after the whole backward; off: that one update. `dp` is the DataParallel whose
  // replicas these optimizers update (the whole model: one flat buffer each), or the
  // DistributedDataParallel whose module they update (engine/parallel/ddp.h: one replica). Same
  // results either way; clip_grad_norm refuses while it is on. Set it before a CUDA graph of the
  // step is captured.
  template <class Wrapper>
  void set_update_overlap(Wrapper& dp, bool on) {
    CUDP_CHECK(!on || dp.num_replicas() == optimizers_.size(),
               "Replicated::set_update_overlap: ", optimizers_.size(), " optimizers but the ",
               dp.type_name(), " has ", dp.num_replicas(),
               " replicas; give it the wrapper whose replicas these optimizers "
               "update");
    if (on) dp.reduce_on_one_device();
    for (size_t r = 0; r < optimizers_.size(); ++r) {
      optimizers_[r]->set_update_overlap(
          on ? GradientSegments([&dp, r] { return dp.take_gradient_segments(r); })
             : GradientSegments{});
    }
  }
  bool last_step_overlapped() const { return primary().last_step_overlapped(); }

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
using parallel::data_parallel_all;
using parallel::DataParallel;
}  // namespace cudp
