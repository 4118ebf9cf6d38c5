// replicate: persistent replicas of a module, one per device (docs/architecture.md §2.7).
//
// Replica 0 is the module itself (its parameters and buffers must already be on device_ids[0], as
// PyTorch requires); replica i is a deep copy (Module::clone) on device_ids[i], made once and kept.
// At creation every replica's parameters are flattened (Module::flatten_parameters: one buffer for
// the data and one for the gradients, so one NCCL call covers the model), and replica 0's
// parameters and buffers are broadcast to the others through NCCL. From then on nothing is
// re-broadcast:
//   - gradients are summed across replicas after each backward (below), so every replica holds the
//     same gradient;
//   - the optimizer runs on every replica (Replicated, data_parallel.h) from identical state, so
//     the parameters stay bit-identical; checksums() and check_identical() verify it;
//   - buffers (BatchNorm running statistics) are broadcast from replica 0 after each training
//     forward (BufferSync::Broadcast, docs/architecture.md §3): replica 0's are PyTorch's, the
//     others follow.
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
// A backward that skips the all-reduce (DataParallel::no_sync) leaves each replica with its own
// share, so the next backward does not zero them: they go on accumulating, and the all-reduce that
// ends the accumulation sums replica 0's gradient (its earlier total and its shares) with every
// other replica's shares since the last all-reduce: the whole accumulated batch's gradient.
//
// Per-replica state that is neither a parameter nor a buffer (Dropout's random stream, BatchNorm's
// host batch count) follows replica 0 through Module::sync_replica, which the set calls on every
// module of replicas 1.. at creation, before each forward and after each buffer broadcast; the
// engine names no concrete layer.
//
// Ownership. A ReplicaSet is owned by one user (a DataParallel, or a ReplicaCache entry of
// data_parallel()); it owns the replicas, the device worker threads, the gradient Reducer, and the
// Communicator unless it was given one to share (two DataParallel members of one model on the same
// devices may share one: NCCL communicators cost memory and set-up time). Nothing is registered
// anywhere else: an optimizer finds the replicas' parameters through the DataParallel modules of
// the model it is given (Replicated, data_parallel.h).
//
// Gradients are summed by the Reducer (engine/parallel/reducer.h) in buckets, overlapped with the
// backward, when every replica's parameters view their flat buffers; otherwise (parameters that
// cannot share one fp32 buffer, or re-flattened since) by one grouped all-reduce per parameter
// after the backward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engine/parallel/comm.h"
#include "engine/parallel/parallel_apply.h"
#include "engine/parallel/reducer.h"
#include "layers/module.h"

namespace cudp::parallel {

// What happens to the replicas' buffers after a training forward.
enum class BufferSync {
  Broadcast,  // replica 0's buffers are broadcast to the others (the default)
  None,       // left as they are: for frozen statistics, or models whose only buffers are
              // SyncBatchNorm2d's (identical on every replica: layers/sync_batchnorm.h)
};

class ReplicaSet {
 public:
  // `comm`: a communicator over exactly `device_ids` to share, or null to make one (with two or
  // more devices).
  ReplicaSet(std::shared_ptr<Module> module, const std::vector<int>& device_ids,
             std::shared_ptr<Communicator> comm = nullptr, ReducerOptions reducer = {});
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
  const std::shared_ptr<Communicator>& shared_communicator() const { return comm_; }
  DeviceWorkers& workers() { return *workers_; }

  // Replica 0's parameters and buffers to the others (creation; after load_state_dict on replica
  // 0).
  void broadcast_parameters();
  void broadcast_buffers();
  // NOTE [Replica gradients are scratch]: zeroes replicas 1.. when they hold the last
  // all-reduce's total (not after backwards that skipped it: no_sync accumulation).
  void zero_mirror_gradients();
  // Sums every replica's gradients with one all-reduce over the flat buffers (or one per
  // parameter), after everything queued; all hold the sum afterwards.
  void all_reduce_gradients();
  // The bucketed path around a backward of the first `active` replicas: begin_backward before the
  // replicas' backward (it zeroes the mirrors as above), end_backward after it returned
  // (`reduce` false: gradients stay local, for accumulation). With no reducer (one device, or
  // parameters that are not flat) end_backward runs all_reduce_gradients.
  void begin_backward(size_t active, bool reduce);
  void end_backward(bool reduce);
  void abandon_backward();
  // The bucketed all-reduce's settings: the reducer is remade with them (not inside a captured
  // step). Null reducer(): none (one device, or parameters that are not flat).
  void set_reducer_options(ReducerOptions options);
  const ReducerOptions& reducer_options() const { return reducer_options_; }
  const Reducer* reducer() const { return reducer_.get(); }
  // Replica r's buckets of the last backward with the events after which each is summed
  // (Reducer::gradient_segments), once: a second call, a call after a forward, and a call when that
  // backward did not go through the reducer (no reducer, gradient sync off, a layout that changed,
  // a backward that failed) give none.
  std::vector<GradientSegment> take_gradient_segments(size_t r);
  // A reducer on one device too (a LocalGroup: nothing to sum), so that take_gradient_segments
  // gives the buckets an optimizer updates beside the backward. With two or more devices it has
  // one.
  void reduce_on_one_device();
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

 private:
  // Each replica's gradients (or data) as lists that match across replicas: the flat buffer when
  // every replica's parameters still view into theirs, else one tensor per parameter (someone
  // re-flattened replica 0, say another ReplicaSet of the same module).
  std::vector<TensorList> parameter_tensors(bool grads) const;
  std::vector<TensorList> buffers() const;
  void make_reducer();
  void sync_replicas(Module::ReplicaSync when);

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
  ReducerOptions reducer_options_;
  std::unique_ptr<ReduceGroup> group_;  // the reducer's view of comm_ (or of the one device)
  std::unique_ptr<Reducer> reducer_;
  bool one_device_reducer_ = false;  // reduce_on_one_device() was called
  bool reducing_ = false;            // between begin_backward and end_backward, with the reducer
  // Per replica: the last backward went through the reducer and its buckets were not yet taken
  // (empty: none are).
  std::vector<bool> segments_open_;
  bool mirrors_hold_total_ = false;  // replicas 1.. hold the last all-reduce's total
  TensorList held_;                  // keep_until_copied's tensors
  std::vector<cuda::Event> copied_;  // and an event per device recorded after their copies
};

}  // namespace cudp::parallel
