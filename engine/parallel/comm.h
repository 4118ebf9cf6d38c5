// Communicator: NCCL collectives over the devices of one process (or one rank of several
// processes), each device with its own communication stream, ordered after and before compute with
// events.
//
// One process drives all GPUs of a machine (docs/architecture.md §2.8): the communicators come from
// ncclCommInitAll, and every collective is issued for all local ranks by the calling thread inside
// one ncclGroupStart/ncclGroupEnd. That is the one safe way to drive several ranks from a process:
// a collective launched for rank 0 but not yet for rank 1 (two threads, no group) blocks rank 0's
// kernel until rank 1's launch, and any implicitly synchronising CUDA call on rank 1's thread in
// between (a cudaMalloc, a cudaFree, a synchronous copy) waits for rank 0's kernel: a deadlock. One
// thread, one group: every rank's kernel is enqueued before ncclGroupEnd returns. A mutex makes
// each collective atomic when several threads share a communicator. The multi-process constructor
// (ncclCommInitRank, one rank per process, the unique id shared through MPI) keeps the door open
// for mpirun/srun launches; its collectives take one tensor, the local rank's.
//
// Tensors are given per local rank: `tensors[i]` lives on devices()[i]. The "compute stream" of
// device d is the calling thread's current stream for d (cuda::current_stream): the engine's worker
// threads run their jobs on the caller's current streams (parallel_apply.h), so both agree.
//
// Every collective is watched (engine/parallel/watchdog.h): an event recorded after it on the comm
// stream tells the watchdog's thread when it completes; one still in flight after timeout() (10
// minutes unless set), or an asynchronous NCCL error, aborts the communicator (ncclCommAbort) and
// raises a CollectiveError naming the rank, its device, the collective and its size in the thread
// that waits for it (synchronize()) and in the next collective. The event is a fresh one per
// collective and rank (cudaEventCreate costs microseconds, no synchronisation), so that each
// collective's completion is known by itself. A collective captured into a CUDA graph is not
// watched (it does not run then); the graph's launches are, through watch_graph_launch. The
// watchdog's queries never invalidate a capture.
//
// NOTE [Comm stream ordering and memory lifetime]
// A collective on tensors written by compute runs on the device's communication stream, so:
//   1. before: an event recorded on the compute stream; the comm stream waits for it. The
//      collective cannot read a gradient that a backward kernel is still writing.
//   2. after: an event recorded on the comm stream; the compute stream waits for it. Work enqueued
//      on compute after the call (the optimizer reading the summed gradients) runs after the
//      collective. Nothing waits on the host: both are cudaStreamWaitEvent.
//   3. memory: every tensor of ours is allocated and freed on its compute stream (core/memory.h,
//      stream-ordered allocator). A tensor dropped right after the call is freed by a cudaFreeAsync
//      enqueued on the compute stream *after* the wait of step 2, so the pool cannot hand its
//      memory to a new allocation before the collective is done with it; without step 2, a free on
//      compute would be ordered only after earlier compute work, not after the comm stream's use,
//      and the block could be reused (and overwritten) while NCCL still reads or writes it. This is
//      why step 2 is never skipped, even when no later compute work reads the result.
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/core/stream.h"
#include "engine/parallel/watchdog.h"
#include "layers/module.h"

namespace cudp::parallel {

enum class ReduceOp { Sum, Average, Max, Min, Product };

const char* reduce_op_name(ReduceOp op);  // "sum", "average", ...

// Checks a list of device ids for data parallelism, with PyTorch's wording where it has one: not
// empty, no id repeated (checked without a GPU), then every id visible (cuda::check_device).
// `what` names the caller in messages ("DataParallel").
void check_device_ids(const std::vector<int>& device_ids, const char* what);

class Communicator {
 public:
  // Rank i drives device_ids[i]; all ranks live in this process (ncclCommInitAll).
  explicit Communicator(const std::vector<int>& device_ids);
  // This process is rank `rank` of `world_size`, driving `device`. Every rank passes the `id` that
  // one of them got from unique_id() (exchanged through MPI or any out-of-band channel).
  Communicator(int device, int rank, int world_size, const ncclUniqueId& id);
  static ncclUniqueId unique_id();

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  Communicator(Communicator&&) = delete;
  Communicator& operator=(Communicator&&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }  // local ranks
  int world_size() const { return world_size_; }
  int rank(int i) const { return first_rank_ + i; }  // global rank of local rank i
  const std::vector<int>& devices() const { return devices_; }
  const cuda::Stream& stream(int i) const { return streams_[static_cast<size_t>(i)]; }

  // One tensor per local rank, same shape and dtype everywhere; in place. `root` is a global rank.
  // Average is NCCL's ncclAvg (sum divided by world_size()).
  void all_reduce(const TensorList& tensors, ReduceOp op = ReduceOp::Sum);
  void broadcast(const TensorList& tensors, int root = 0);
  // Only the root's tensor receives the result; the others are left as they were.
  void reduce(const TensorList& tensors, int root = 0, ReduceOp op = ReduceOp::Sum);
  // outputs[i] holds world_size() * inputs[i].numel() elements: every rank's input, in rank order.
  void all_gather(const TensorList& inputs, const TensorList& outputs);

  // Lists per local rank (tensors[i][j]: rank i's tensor j, matching every rank's tensor j): one
  // collective per tensor, all in one group (NCCL aggregates them into few launches).
  void all_reduce_many(const std::vector<TensorList>& tensors, ReduceOp op = ReduceOp::Sum);
  void broadcast_many(const std::vector<TensorList>& tensors, int root = 0);
  void reduce_many(const std::vector<TensorList>& tensors, int root = 0,
                   ReduceOp op = ReduceOp::Sum);
  void all_gather_many(const std::vector<TensorList>& inputs,
                       const std::vector<TensorList>& outputs);

  // The reducer's collective (engine/parallel/reducer.h): all-reduce of tensors[i] (rank i's, one
  // per local rank) on rank i's comm stream, after `after[i]` (an event the caller recorded on
  // rank i's compute stream when that tensor was complete) instead of after everything queued on
  // compute so far, and with `done[i]` recorded on the comm stream after it. Compute is not made
  // to wait: the caller makes compute[i] wait for `done[i]` (NOTE [Comm stream ordering and memory
  // lifetime], step 2) before anything reads or frees the tensors. Several such calls run on the
  // comm stream in the order they are issued, so waiting for the last one's `done` waits for all.
  // `compute[i]` is rank i's compute stream; it tells whether the call is being captured into a
  // CUDA graph, since the calling thread need not be the one whose current stream it is.
  void all_reduce_after(const TensorList& tensors, const std::vector<cudaEvent_t>& after,
                        const std::vector<cudaEvent_t>& done,
                        const std::vector<cudaStream_t>& compute, ReduceOp op = ReduceOp::Sum);

  // CUDA graphs. A collective issued while its compute stream is being captured runs at each
  // launch of the graph, where run() cannot watch it; captured() counts those (since
  // construction: collectives and the bytes each local rank moves). watch_graph_launch() watches
  // one launch, just enqueued on every local rank's compute stream (the calling thread's current
  // streams), as one collective named `what` of holds.bytes bytes: it completes when the streams
  // reach an event recorded now, and one past the timeout, or an NCCL error meanwhile, fails and
  // aborts the communicator as a collective issued eagerly does. So a replayed training step whose
  // all-reduce a peer never joins ends in the watchdog's error instead of hanging
  // (GraphedStepOptions::after_launch, layers/train.h, calls it). `holds`: what the graph's
  // capture added to captured().
  struct Captured {
    int64_t collectives = 0;
    int64_t bytes = 0;
    Captured operator-(const Captured& o) const {
      return {collectives - o.collectives, bytes - o.bytes};
    }
  };
  Captured captured() const;
  void watch_graph_launch(const std::string& what, Captured holds) {
    watch_launch(graph_launch_name(what, holds), holds.bytes);
  }
  // A GraphedStepOptions::after_launch for a graph captured after this call: at its first call it
  // takes what the capture added to captured(), and every call watches the launch just made under
  // `what`. The communicator must outlive it.
  std::function<void()> launch_watcher(std::string what);

  // The deadline of each collective issued from now on (engine/parallel/watchdog.h). A new
  // communicator starts with default_timeout().
  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;
  // The timeout of communicators created from now on (cudp-vgg --collective-timeout sets it before
  // DataParallel creates its communicator); kDefaultCollectiveTimeout until set.
  static void set_default_timeout(std::chrono::milliseconds timeout);
  static std::chrono::milliseconds default_timeout();

  // Blocks the host until every collective issued so far has completed; throws CollectiveError
  // when the watchdog found one failed or past its timeout. Not needed for ordering (NOTE below);
  // it is the place where a hang becomes an error in the calling thread.
  void synchronize();
  // Ends this communicator without waiting for any other rank (ncclCommAbort); later collectives
  // throw. For a rank that gives up on its peers, e.g. after another communicator's error.
  void abort();
  bool aborted() const { return aborted_; }

 private:
  enum class Kind { AllReduce, Broadcast, Reduce, AllGather };
  // all_reduce_after's events and streams; all null: the compute streams are the calling thread's
  // current ones, and NOTE [Comm stream ordering and memory lifetime] runs in full.
  struct Ordering {
    const std::vector<cudaEvent_t>* after = nullptr;
    const std::vector<cudaEvent_t>* done = nullptr;
    const std::vector<cudaStream_t>* compute = nullptr;
  };
  // Checks the lists, then runs NOTE [Comm stream ordering and memory lifetime] around one group
  // holding every rank's calls. `outputs` is all_gather's (null for the in-place collectives).
  void run(Kind kind, const std::vector<TensorList>& tensors,
           const std::vector<TensorList>* outputs, int root, ReduceOp op,
           const Ordering* ordering = nullptr);
  void create_streams();  // and the watchdog
  // watch_graph_launch's name for a launch holding `holds`, and its watch under a name made once.
  static std::string graph_launch_name(const std::string& what, Captured holds);
  void watch_launch(const std::string& name, int64_t bytes);
  void abort_comms();     // once, whoever calls first: the watchdog or abort()
  std::string async_error(int i);

  std::vector<int> devices_;
  int world_size_ = 0;
  int first_rank_ = 0;
  std::vector<ncclComm_t> comms_;
  std::vector<cuda::Stream> streams_;
  std::vector<cuda::Event> ready_;  // recorded on compute, waited on by comm
  std::vector<cuda::Event> done_;   // recorded on comm, waited on by compute
  mutable std::mutex mutex_;
  std::mutex abort_mutex_;  // an abort never overlaps the watchdog's look at a communicator
  std::atomic<bool> aborted_ = false;
  Captured captured_;                   // under mutex_
  std::unique_ptr<Watchdog> watchdog_;  // last: its thread stops first
};

}  // namespace cudp::parallel
