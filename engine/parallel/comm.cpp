#include "engine/parallel/comm.h"

#include <optional>

#include <map>
#include <set>
#include <utility>

#include "engine/core/vendor_check.h"

namespace cudp::parallel {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  CUDP_THROW(ValueError, "no NCCL type for dtype ", dtype_name(dtype));
}

std::atomic<int64_t> g_default_timeout_ms{kDefaultCollectiveTimeout.count()};

// The watchdog's queries run in relaxed capture mode: a CUDA graph captured in global mode on
// another thread forbids "potentially unsafe" calls in every thread that is not relaxed, and a
// query from the watchdog's thread must never invalidate such a capture.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// A watched collective of one rank: the event after it on the comm stream, once recorded.
struct Completion {
  enum Phase : int { Pending, Recorded, Cancelled };
  cuda::Event event;
  std::atomic<int> phase = Pending;
  bool done() const {
    const int p = phase.load();
    if (p != Recorded) return p == Cancelled;
    const RelaxedCapture relaxed;
    return event.query();
  }
};

// Completions still Pending when it ends are cancelled: the collective (or launch) they watch was
// never enqueued, because a throw came part-way through enqueueing it, and the watchdog forgets
// them instead of ending a healthy communicator at its timeout.
struct CancelUnrecorded {
  std::vector<std::shared_ptr<Completion>>& list;
  ~CancelUnrecorded() {
    for (auto& c : list) {
      int pending = Completion::Pending;
      c->phase.compare_exchange_strong(pending, Completion::Cancelled);
    }
  }
};

// Whether one of the compute streams is being captured into a CUDA graph: a collective captured
// there does not run now, so there is nothing to watch (the graph's launches are the caller's).
bool capturing(const std::vector<cudaStream_t>& streams) {
  for (const cudaStream_t stream : streams) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    CUDP_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    if (status != cudaStreamCaptureStatusNone) return true;
  }
  return false;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return ncclSum;
    case ReduceOp::Average:
      return ncclAvg;
    case ReduceOp::Max:
      return ncclMax;
    case ReduceOp::Min:
      return ncclMin;
    case ReduceOp::Product:
      return ncclProd;
  }
  return ncclSum;
}

}  // namespace

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Average:
      return "average";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Product:
      return "product";
  }
  return "?";
}

void check_device_ids(const std::vector<int>& device_ids, const char* what) {
  CUDP_CHECK(!device_ids.empty(), what, ": device_ids is empty; give at least one CUDA device id");
  std::map<int, size_t> first;
  for (size_t i = 0; i < device_ids.size(); ++i) {
    const auto [it, fresh] = first.emplace(device_ids[i], i);
    CUDP_CHECK(fresh, what, ": device_ids has device ", device_ids[i], " twice (at index ",
               it->second, " and ", i, "); each device holds one replica");
  }
  for (size_t i = 0; i < device_ids.size(); ++i) {
    try {
      cuda::check_device(device_ids[i]);
    } catch (const ValueError& e) {
      throw ValueError(detail::str(what, ": device_ids[", i, "]: ", e.message()), e.file(),
                       e.line());
    }
  }
}

// ---- creation and destruction -------------------------------------------------------------------

Communicator::Communicator(const std::vector<int>& device_ids)
    : devices_(device_ids), world_size_(static_cast<int>(device_ids.size())) {
  check_device_ids(devices_, "Communicator");
  comms_.resize(devices_.size(), nullptr);
  {
    // ncclCommInitAll switches devices itself; restore the caller's.
    cuda::DeviceGuard guard(cuda::current_device());
    CUDP_NCCL_CHECK(ncclCommInitAll(comms_.data(), world_size_, devices_.data()));
  }
  create_streams();
}

Communicator::Communicator(int device, int rank, int world_size, const ncclUniqueId& id)
    : devices_{device}, world_size_(world_size), first_rank_(rank) {
  cuda::check_device(device);
  CUDP_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "Communicator: rank ", rank,
             " is outside a world of ", world_size, " ranks");
  comms_.resize(1, nullptr);
  {
    cuda::DeviceGuard guard(device);
    CUDP_NCCL_CHECK(ncclCommInitRank(&comms_[0], world_size, id, rank));
  }
  create_streams();
}

ncclUniqueId Communicator::unique_id() {
  ncclUniqueId id;
  CUDP_NCCL_CHECK(ncclGetUniqueId(&id));
  return id;
}

void Communicator::create_streams() {
  std::vector<Watchdog::Rank> ranks;
  for (size_t i = 0; i < devices_.size(); ++i) {
    const int device = devices_[i];
    streams_.push_back(cuda::Stream::create(device));
    ready_.push_back(cuda::Event::create(device));
    done_.push_back(cuda::Event::create(device));
    ranks.push_back({rank(static_cast<int>(i)), device});
  }
  Watchdog::Options options;
  options.timeout = default_timeout();
  watchdog_ = std::make_unique<Watchdog>(
      std::move(ranks),
      WatchdogHooks{[this](int i) { return async_error(i); }, [this] { abort_comms(); }}, options);
}

// ---- the watchdog's adapter: NCCL's asynchronous error and abort --------------------------------

std::string Communicator::async_error(int i) {
  std::lock_guard lock(abort_mutex_);
  if (aborted_) return {};
  const RelaxedCapture relaxed;
  ncclResult_t result = ncclSuccess;
  const ncclResult_t status = ncclCommGetAsyncError(comms_[static_cast<size_t>(i)], &result);
  if (status != ncclSuccess) {
    return detail::str("ncclCommGetAsyncError failed: ", ncclGetErrorString(status));
  }
  if (result == ncclSuccess || result == ncclInProgress) return {};
  return detail::str(ncclGetErrorString(result), " (", ncclGetLastError(nullptr), ")");
}

void Communicator::abort_comms() {
  std::lock_guard lock(abort_mutex_);
  if (aborted_.exchange(true)) return;
  std::string failures;
  for (size_t i = 0; i < comms_.size(); ++i) {
    const ncclResult_t status = ncclCommAbort(comms_[i]);
    if (status != ncclSuccess) {
      failures +=
          detail::str(" rank ", rank(static_cast<int>(i)), ": ", ncclGetErrorString(status));
    }
  }
  if (!failures.empty()) CUDP_THROW(LibraryError, "ncclCommAbort failed on", failures);
}

void Communicator::abort() { abort_comms(); }

void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  watchdog_->set_timeout(timeout);
}

std::chrono::milliseconds Communicator::timeout() const { return watchdog_->timeout(); }

void Communicator::set_default_timeout(std::chrono::milliseconds timeout) {
  CUDP_CHECK(timeout.count() > 0, "the collective timeout must be positive, got ", timeout.count(),
             " ms");
  g_default_timeout_ms = timeout.count();
}

std::chrono::milliseconds Communicator::default_timeout() {
  return std::chrono::milliseconds(g_default_timeout_ms.load());
}

Communicator::Captured Communicator::captured() const {
  std::lock_guard lock(mutex_);
  return captured_;
}

std::string Communicator::graph_launch_name(const std::string& what, Captured holds) {
  return detail::str(what, " (", holds.collectives, " captured collective",
                     holds.collectives == 1 ? "" : "s", " of this communicator)");
}

void Communicator::watch_launch(const std::string& name, int64_t bytes) {
  std::lock_guard lock(mutex_);
  watchdog_->check();  // a failed communicator raises its error here too
  CUDP_CHECK(!aborted_, "Communicator::watch_graph_launch: this communicator was aborted ",
             "(Communicator::abort); make a new one to communicate again");
  // As run()'s: a throw part-way cancels the entries already watched.
  std::vector<std::shared_ptr<Completion>> completions;
  const CancelUnrecorded cancel_unrecorded{completions};
  for (size_t i = 0; i < devices_.size(); ++i) {
    auto completion = std::make_shared<Completion>();
    completion->event = cuda::Event::create(devices_[i]);
    completions.push_back(completion);
    watchdog_->watch(static_cast<int>(i), name, bytes, [completion] { return completion->done(); });
  }
  for (size_t i = 0; i < devices_.size(); ++i) {
    const cuda::DeviceGuard guard(devices_[i]);
    completions[i]->event.record(cuda::current_stream(devices_[i]));
    completions[i]->phase = Completion::Recorded;
  }
}

std::function<void()> Communicator::launch_watcher(std::string what) {
  struct State {
    Captured before;
    std::optional<Captured> holds;  // what the graph holds, known after its capture
    std::string name;               // the watch's name, made with it
  };
  auto state = std::make_shared<State>(State{captured(), std::nullopt, {}});
  return [this, state, what = std::move(what)] {
    if (!state->holds) {
      state->holds = captured() - state->before;
      state->name = graph_launch_name(what, *state->holds);
    }
    watch_launch(state->name, state->holds->bytes);
  };
}

void Communicator::synchronize() {
  watchdog_->wait_all();
  CUDP_CHECK(!aborted_,
             "Communicator::synchronize: this communicator was aborted (Communicator::abort); make "
             "a new one to communicate again");
}

Communicator::~Communicator() {
  watchdog_.reset();  // its thread uses the communicators
  if (aborted_) return;  // ncclCommAbort freed them
  // Finalising waits for every rank to be quiescent: with several ranks in this thread, their
  // finalisations must be in one group, or the first would wait for the others forever. Errors
  // are ignored: destructors never throw, and a failed teardown leaves nothing to recover.
  ncclGroupStart();
  for (ncclComm_t comm : comms_) {
    if (comm) ncclCommFinalize(comm);
  }
  ncclGroupEnd();
  for (ncclComm_t comm : comms_) {
    if (comm) ncclCommDestroy(comm);
  }
}

// ---- collectives --------------------------------------------------------------------------------

void Communicator::all_reduce(const TensorList& tensors, ReduceOp op) {
  std::vector<TensorList> lists;
  for (const Tensor& t : tensors) lists.push_back({t});
  run(Kind::AllReduce, lists, nullptr, 0, op);
}

void Communicator::broadcast(const TensorList& tensors, int root) {
  std::vector<TensorList> lists;
  for (const Tensor& t : tensors) lists.push_back({t});
  run(Kind::Broadcast, lists, nullptr, root, ReduceOp::Sum);
}

void Communicator::reduce(const TensorList& tensors, int root, ReduceOp op) {
  std::vector<TensorList> lists;
  for (const Tensor& t : tensors) lists.push_back({t});
  run(Kind::Reduce, lists, nullptr, root, op);
}

void Communicator::all_gather(const TensorList& inputs, const TensorList& outputs) {
  std::vector<TensorList> in, out;
  for (const Tensor& t : inputs) in.push_back({t});
  for (const Tensor& t : outputs) out.push_back({t});
  run(Kind::AllGather, in, &out, 0, ReduceOp::Sum);
}

void Communicator::all_reduce_many(const std::vector<TensorList>& tensors, ReduceOp op) {
  run(Kind::AllReduce, tensors, nullptr, 0, op);
}

void Communicator::broadcast_many(const std::vector<TensorList>& tensors, int root) {
  run(Kind::Broadcast, tensors, nullptr, root, ReduceOp::Sum);
}

void Communicator::reduce_many(const std::vector<TensorList>& tensors, int root, ReduceOp op) {
  run(Kind::Reduce, tensors, nullptr, root, op);
}

void Communicator::all_gather_many(const std::vector<TensorList>& inputs,
                                   const std::vector<TensorList>& outputs) {
  run(Kind::AllGather, inputs, &outputs, 0, ReduceOp::Sum);
}

void Communicator::all_reduce_after(const TensorList& tensors,
                                    const std::vector<cudaEvent_t>& after,
                                    const std::vector<cudaEvent_t>& done,
                                    const std::vector<cudaStream_t>& compute, ReduceOp op) {
  CUDP_CHECK(after.size() == devices_.size() && done.size() == devices_.size() &&
                 compute.size() == devices_.size(),
             "Communicator::all_reduce_after: one event before, one after and one compute stream "
             "per local rank (",
             devices_.size(), "), got ", after.size(), ", ", done.size(), " and ", compute.size());
  std::vector<TensorList> lists;
  for (const Tensor& t : tensors) lists.push_back({t});
  const Ordering ordering{&after, &done, &compute};
  run(Kind::AllReduce, lists, nullptr, 0, op, &ordering);
}

void Communicator::run(Kind kind, const std::vector<TensorList>& tensors,
                       const std::vector<TensorList>* outputs, int root, ReduceOp op,
                       const Ordering* given) {
  const Ordering ordering = given ? *given : Ordering{};
  static constexpr const char* kNames[] = {"all_reduce", "broadcast", "reduce", "all_gather"};
  const char* what = kNames[static_cast<int>(kind)];
  const size_t ranks = devices_.size();
  // Everything is checked before the group starts: a call failing half-way through a group would
  // leave some ranks' collectives enqueued and others not.
  CUDP_CHECK(tensors.size() == ranks, "Communicator::", what, ": got tensors for ", tensors.size(),
             " ranks, but this process drives ", ranks, " (devices ",
             shape_str(Shape(devices_.begin(), devices_.end())), ")");
  const size_t count = tensors[0].size();
  for (size_t i = 0; i < ranks; ++i) {
    CUDP_CHECK(tensors[i].size() == count, "Communicator::", what, ": rank ", rank(int(i)), " has ",
               tensors[i].size(), " tensors but rank ", rank(0), " has ", count);
    if (outputs) {
      CUDP_CHECK(outputs->size() == ranks && (*outputs)[i].size() == count, "Communicator::", what,
                 ": the outputs do not match the inputs (one output per input and rank)");
    }
  }
  if (kind == Kind::Broadcast || kind == Kind::Reduce) {
    CUDP_CHECK(root >= 0 && root < world_size_, "Communicator::", what, ": root ", root,
               " is outside the ", world_size_, " ranks");
  }
  for (size_t j = 0; j < count; ++j) {
    const Tensor& first = tensors[0][j];
    for (size_t i = 0; i < ranks; ++i) {
      const Tensor& t = tensors[i][j];
      const std::string label =
          detail::str("Communicator::", what, ": tensor ", j, " of rank ", rank(int(i)));
      check_device(t, Device::cuda(devices_[i]), label.c_str());
      CUDP_CHECK(t.dtype() == first.dtype() && t.numel() == first.numel(), label, " is ", t.str(),
                 " but rank ", rank(0), "'s is ", first.str(),
                 "; every rank needs the same size and "
                 "dtype");
      if (outputs) {
        const Tensor& out = (*outputs)[i][j];
        const std::string out_label =
            detail::str("Communicator::", what, ": output ", j, " of rank ", rank(int(i)));
        check_device(out, Device::cuda(devices_[i]), out_label.c_str());
        CUDP_CHECK(out.dtype() == t.dtype() && out.numel() == t.numel() * world_size_, out_label,
                   " is ", out.str(), " but must hold ", world_size_, " x ", t.numel(), " ",
                   dtype_name(t.dtype()), " elements");
      }
    }
    nccl_type(first.dtype());  // throws now, not inside the group, for a type NCCL lacks
  }
  if (count == 0) return;

  std::lock_guard lock(mutex_);
  watchdog_->check();  // a failed communicator raises its error, in every later collective too
  CUDP_CHECK(!aborted_, "Communicator::", what, ": this communicator was aborted ",
             "(Communicator::abort); make a new one to communicate again");
  // The watchdog's clock starts before the group: with NCCL's lazy connection set-up, ncclGroupEnd
  // itself can wait for a peer that never comes.
  std::vector<cudaStream_t> compute;
  if (ordering.compute) {
    compute = *ordering.compute;
  } else {
    for (const int device : devices_) compute.push_back(cuda::current_stream(device));
  }
  std::vector<std::shared_ptr<Completion>> completions;
  // A collective that fails to start is not in flight: the watchdog forgets it. Armed before the
  // first watch(), and each completion listed before it is watched, so that a throw part-way
  // (an event that cannot be made for the next rank) cancels every entry already watched, which
  // would otherwise stay pending and end a healthy communicator at its timeout.
  const CancelUnrecorded cancel_unrecorded{completions};
  const bool captured = capturing(compute);
  for (size_t i = 0, watched = captured ? 0 : ranks; i < watched; ++i) {
    int64_t bytes = 0;
    for (const Tensor& t : tensors[i]) bytes += static_cast<int64_t>(t.nbytes());
    auto completion = std::make_shared<Completion>();
    completion->event = cuda::Event::create(devices_[i]);
    completions.push_back(completion);
    watchdog_->watch(static_cast<int>(i), what, bytes, [completion] { return completion->done(); });
  }
  // 1. The comm stream waits for the compute work queued so far (or up to the caller's event).
  for (size_t i = 0; i < ranks; ++i) {
    cuda::DeviceGuard guard(devices_[i]);
    if (ordering.after) {
      CUDP_CUDA_CHECK(cudaStreamWaitEvent(streams_[i], (*ordering.after)[i], 0));
    } else {
      ready_[i].record(compute[i]);
      streams_[i].wait(ready_[i]);
    }
  }
  // 2. Every rank's calls in one group, issued from this thread.
  CUDP_NCCL_CHECK(ncclGroupStart());
  ncclResult_t status = ncclSuccess;
  const char* failed = nullptr;
  for (size_t i = 0; i < ranks && status == ncclSuccess; ++i) {
    for (size_t j = 0; j < count && status == ncclSuccess; ++j) {
      const Tensor& t = tensors[i][j];
      if (t.numel() == 0) continue;  // the same on every rank (checked): nothing to move
      const auto n = static_cast<size_t>(t.numel());
      const ncclDataType_t type = nccl_type(t.dtype());
      void* data = t.data_ptr();
      switch (kind) {
        case Kind::AllReduce:
          status = ncclAllReduce(data, data, n, type, nccl_op(op), comms_[i], streams_[i]);
          failed = "ncclAllReduce";
          break;
        case Kind::Broadcast:
          status = ncclBroadcast(data, data, n, type, root, comms_[i], streams_[i]);
          failed = "ncclBroadcast";
          break;
        case Kind::Reduce:
          status = ncclReduce(data, data, n, type, nccl_op(op), root, comms_[i], streams_[i]);
          failed = "ncclReduce";
          break;
        case Kind::AllGather:
          status =
              ncclAllGather(data, (*outputs)[i][j].data_ptr(), n, type, comms_[i], streams_[i]);
          failed = "ncclAllGather";
          break;
      }
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (status != ncclSuccess) {
    CUDP_THROW(LibraryError, "Communicator::", what, ": ", failed,
               " failed: ", ncclGetErrorString(status), " (", ncclGetLastError(nullptr), ")");
  }
  if (end != ncclSuccess) {
    CUDP_THROW(LibraryError, "Communicator::", what,
               ": ncclGroupEnd failed: ", ncclGetErrorString(end), " (", ncclGetLastError(nullptr),
               ")");
  }
  if (captured) {  // it runs at the graph's launches: watch_graph_launch watches those
    int64_t bytes = 0;
    for (const Tensor& t : tensors[0]) bytes += static_cast<int64_t>(t.nbytes());
    captured_.collectives += 1;
    captured_.bytes += bytes;
  }
  // 3. Compute waits for the collective: results are read, and memory freed, only after it (with
  // the caller's `done` events, the caller makes it wait).
  for (size_t i = 0; i < ranks; ++i) {
    cuda::DeviceGuard guard(devices_[i]);
    if (ordering.done) {
      CUDP_CUDA_CHECK(cudaEventRecord((*ordering.done)[i], streams_[i]));
    } else {
      done_[i].record(streams_[i]);
      CUDP_CUDA_CHECK(cudaStreamWaitEvent(compute[i], done_[i].get(), 0));
    }
    if (i < completions.size()) {
      completions[i]->event.record(streams_[i]);
      completions[i]->phase = Completion::Recorded;
    }
  }
}

}  // namespace cudp::parallel
