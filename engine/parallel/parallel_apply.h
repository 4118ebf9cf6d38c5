// parallel_apply: one job per device, each on that device's persistent host thread
// (docs/architecture.md §2.8).
//
// Threads. A DeviceWorkers owns one worker thread per entry of its device list, started by its
// constructor and joined by its destructor; nothing is shared through the process. A DataParallel
// owns its DeviceWorkers for its whole life, so its threads are created once, not per step; two
// DataParallel members of one model have a thread each per device, which costs a few idle threads
// and no contention. Each worker makes its device current once and then waits on a job queue (a
// mutex and a condition variable). Device -1 names a host worker, for CPU-only jobs.
//
// Streams. run() reads the caller's current stream of each device (cuda::current_stream, which a
// StreamGuard may have changed) and the job runs with that stream current on its worker, so
// everything a replica enqueues lands on the stream the caller would have used: events recorded by
// the caller afterwards (comm.h, scatter_gather.h) order later work after the replica's.
//
// Allocation purposes. The caller's cuda::AllocationPurpose (engine/core/memory.h) applies to the
// jobs too, as its streams do, so an out-of-memory error in a replica says what the caller was
// doing; a job may add its own inside it.
//
// Exceptions. A job that throws does not stop the others; run() waits for all of them and re-raises
// the first failure (by index) on the caller as PyTorch words it: "Caught ValueError in replica 1
// on device 1: <message>". The type stays a cudp type (ValueError, OutOfMemoryError, CudaError,
// ...; anything else becomes cudp::Error), so callers can still catch what they expect.
//
// A job that itself calls run() for its own device (a DataParallel nested inside a replica) runs
// that inner job inline instead of queueing it behind itself, which would deadlock. Jobs for other
// devices are queued: replicas whose jobs wait for each other's devices (a DataParallel over all
// devices nested inside each replica of another) would deadlock and are not supported.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layers/module.h"

namespace cudp::parallel {

class Worker;  // one persistent thread and its queue (parallel_apply.cpp)

class DeviceWorkers {
 public:
  // One worker thread for each entry of `devices` (CUDA ids, or -1 for the host), started here.
  explicit DeviceWorkers(const std::vector<int>& devices);
  ~DeviceWorkers();
  DeviceWorkers(const DeviceWorkers&) = delete;
  DeviceWorkers& operator=(const DeviceWorkers&) = delete;
  DeviceWorkers(DeviceWorkers&&) = delete;
  DeviceWorkers& operator=(DeviceWorkers&&) = delete;

  const std::vector<int>& devices() const { return devices_; }
  size_t size() const { return devices_.size(); }

  // Runs job(i) for i in [0, n) on devices()[i]'s worker, with that device current and the caller's
  // current stream of it current; blocks until every job has finished; re-raises a failure as the
  // header says. n <= size(): DataParallel uses the first `chunks` devices only.
  void run(size_t n, const std::function<void(size_t)>& job);
  void run(const std::function<void(size_t)>& job) { run(size(), job); }

 private:
  std::vector<int> devices_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

// PyTorch's parallel_apply: outputs[i] = modules[i]->forward_all(inputs[i]) on devices[i]'s worker.
std::vector<TensorList> parallel_apply(const std::vector<std::shared_ptr<Module>>& modules,
                                       const std::vector<TensorList>& inputs,
                                       DeviceWorkers& workers);
std::vector<TensorList> parallel_apply(const std::vector<std::shared_ptr<Module>>& modules,
                                       const std::vector<TensorList>& inputs,
                                       const std::vector<int>& devices);

// "Caught <type> in replica <i> on device <d>: <message>", the text run() raises (d is "cpu" for
// -1).
std::string caught_message(const std::string& type, size_t replica, int device,
                           const std::string& message);

}  // namespace cudp::parallel
