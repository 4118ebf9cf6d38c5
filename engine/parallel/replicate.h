// replicate: persistent replicas of a module, one per device (docs/architecture.md §2.7).
//
// Replica 0 is the module itself (its parameters and buffers must already be on device_ids[0], as
// PyTorch requires); replica i is a deep copy (Module::clone) on device_ids[i], made once and kept.
// At creation every replica's parameters are flattened (Module::flatten_parameters: one buffer for
// the data and one for the gradients, so one NCCL call covers the model), and replica 0's
// parameters and buffers are broadcast to the others through NCCL. From then on nothing is
// re-broadcast:
//   - gradients are summed across replicas by one all-reduce after each backward, so every replica
//     holds the same gradient;
//   - the optimizer runs on every replica (Replicated, data_parallel.h) from identical state, so
//   the
//     parameters stay bit-identical; checksums() and check_identical() verify it;
//   - buffers (BatchNorm running statistics) are broadcast from replica 0 after each training
//     forward (BufferSync::Broadcast, docs/architecture.md §3): replica 0's are PyTorch's, the others follow.
//
// NOTE [Replica gradients are scratch]
// PyTorch's DataParallel accumulates gradients in the original module only; replicas are rebuilt at
// each forward. Here replicas persist, and after an all-reduce every replica holds the total, so a
// second backward before zero_grad() (gradient accumulation) would sum that total once per replica.
// Hence replicas 1.. start every backward from zero gradients (zero_mirror_gradients), and replica
// 0 keeps whatever it accumulated: after the all-reduce, every replica holds replica 0's previous
// gradient plus this backward's gradient of the whole batch, exactly PyTorch's accumulation.
// Replicas that received no chunk (batch 1 on 2 GPUs) contribute their zeros and still receive the
// sum, so they stay identical too. The user zeroes replica 0 (opt.zero_grad()) as with one device.
//
// Dropout: each replica r >= 1 draws its masks from its own seed (derived from replica 0's seed and
// r), at replica 0's offset, synchronised before each forward: the replicas' masks are independent
// of each other, as with PyTorch's per-device generators, and reproducible from replica 0's (seed,
// offset). They are not the masks one device would draw for the whole batch (that needs each
// replica's chunk offset in elements, which the engine does not know before the forward).
//
// Parameter registry: each live ReplicaSet records, for every parameter of replica 0, the matching
// parameters of its other replicas. replica_parameter_lists() reads it, so an optimizer built on a
// model's parameters() (which are replica 0's, also through a bigger model holding several
// DataParallel members) can build one optimizer per replica (Replicated, data_parallel.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engine/parallel/comm.h"
#include "engine/parallel/parallel_apply.h"
#include "layers/module.h"

namespace cudp::parallel {

// What happens to the replicas' buffers after a training forward.
enum class BufferSync {
  Broadcast,  // replica 0's buffers are broadcast to the others (the default)
  None,       // left as they are: for layers that synchronise themselves (a future SyncBatchNorm
              // all-reducing batch statistics through communicator()) or for frozen statistics
};

class ReplicaSet {
 public:
  ReplicaSet(std::shared_ptr<Module> module, const std::vector<int>& device_ids);
  ~ReplicaSet();
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;
  ReplicaSet(ReplicaSet&&) = delete;
  ReplicaSet& operator=(ReplicaSet&&) = delete;

  size_t size() const { return replicas_.size(); }
  const std::vector<int>& devices() const { return devices_; }
  const std::shared_ptr<Module>& replica(size_t i) const { return replicas_.at(i); }
  const std::vector<std::shared_ptr<Module>>& replicas() const { return replicas_; }
  // Null with one device (nothing to communicate).
  Communicator* communicator() const { return comm_.get(); }
  DeviceWorkers& workers() { return *workers_; }

  // Replica 0's parameters and buffers to the others (creation; after load_state_dict on replica
  // 0).
  void broadcast_parameters();
  void broadcast_buffers();
  // NOTE [Replica gradients are scratch].
  void zero_mirror_gradients();
  // Sums every replica's gradients; all hold the sum afterwards.
  void all_reduce_gradients();
  // Before a forward: replicas take replica 0's train/eval mode, module by module, and Dropout
  // offsets.
  void prepare_forward();
  // Keeps the pinned host tensors among `sources` alive until the copies just enqueued from them on
  // the replicas' current streams have run (Tensor::copy_from leaves that to the caller): until the
  // next call with pinned tensors, which first waits for the previous copies. Those were enqueued a
  // step earlier, at the head of that step's work, so the wait normally finds them done, and the
  // previous batch's memory may go. Pageable sources need nothing: CUDA has read them before the
  // copy returns.
  void keep_until_copied(const TensorList& sources);

  // parameters()[r][k]: replica r's k-th parameter (in Module::parameters() order).
  const std::vector<std::vector<Parameter*>>& parameters() const { return params_; }
  // A 64-bit FNV-1a hash of each replica's parameters and buffers, bytes in order (host copies).
  std::vector<uint64_t> checksums() const;
  // Throws cudp::Error naming the first parameter or buffer, element and values where a replica
  // differs from replica 0 (bitwise).
  void check_identical() const;
  // fn(replica, r, device) for every replica, on the devices' worker threads, in parallel.
  void for_each(const std::function<void(Module&, size_t, int)>& fn);

  // DataParallel modules using this set (data_parallel() re-broadcasts only when none does, since
  // nothing else keeps the replicas' parameters in step with replica 0).
  std::atomic<int> wrappers{0};

 private:
  // Each replica's gradients (or data) as lists that match across replicas: the flat buffer when
  // every replica's parameters still view into theirs, else one tensor per parameter (someone
  // re-flattened replica 0, say another ReplicaSet of the same module).
  std::vector<TensorList> parameter_tensors(bool grads) const;
  std::vector<TensorList> buffers() const;
  void register_mirrors();
  void unregister_mirrors();

  std::vector<int> devices_;
  std::vector<std::shared_ptr<Module>> replicas_;
  // Per replica, walked once at creation (Parameter and buffer addresses never change, module.h;
  // the structure must not change after wrapping): parameters, buffers, modules in pre-order.
  std::vector<std::vector<Parameter*>> params_;
  std::vector<std::vector<Tensor*>> buffers_;
  std::vector<std::vector<Module*>> modules_;
  std::vector<std::pair<Tensor, Tensor>> flat_;  // per replica {data, grad}; undefined if not flat
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<DeviceWorkers> workers_;
  TensorList held_;                  // keep_until_copied's tensors
  std::vector<cuda::Event> copied_;  // and an event per device recorded after their copies
};

// The replicas of `module` on `device_ids`: the live set of another user (a DataParallel, the
// data_parallel() cache) when there is one, else a new one. Checks the ids and the module's device.
std::shared_ptr<ReplicaSet> replicate(const std::shared_ptr<Module>& module,
                                      const std::vector<int>& device_ids);

// lists[0] = params; lists[r] = the replica-r parameters matching them (from every live ReplicaSet,
// in order), for parameters that have an r-th replica. Parameters outside any DataParallel appear
// in lists[0] only.
std::vector<std::vector<Parameter*>> replica_parameter_lists(const std::vector<Parameter*>& params);

}  // namespace cudp::parallel
