#include "engine/core/graph.h"

#include <cstring>
#include <utility>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "kernels/scalars.h"

namespace cudp::cuda {
namespace {

// "cudaErrorStreamCaptureInvalidated (operation failed due to a previous error during capture)"
std::string status_str(cudaError_t status) {
  return cudp::detail::str(cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
}

std::mutex active_mutex;
ReplayScalars* active_scalars = nullptr;

// Out of memory while a graph's memory is mapped (at instantiation or at a launch): the
// OutOfMemoryError of any device allocation, naming the graph and what to change.
void check_graph_memory(cudaError_t status, const std::string& what, const char* call) {
  if (status != cudaErrorMemoryAllocation) return;
  cudaGetLastError();
  const AllocationPurpose purpose(
      cudp::detail::str("the CUDA graph of ", what.empty() ? std::string("the work") : what),
      "A graph's memory (its step's activations and temporaries) is its own, beside what eager "
      "steps left reserved in the memory pool: run without graphs (--graphs off) or reduce the "
      "batch size (--batch-size).");
  check_allocation(status, 0, "the memory of its allocation nodes", call);
}

}  // namespace

// ---- CudaGraph ----------------------------------------------------------------------------------

CudaGraph::~CudaGraph() {
  capture_abort();
  reset();
}

CudaGraph::CudaGraph(CudaGraph&& other) noexcept
    : graph_(std::exchange(other.graph_, nullptr)),
      exec_(std::exchange(other.exec_, nullptr)),
      capturing_(std::exchange(other.capturing_, nullptr)),
      device_(other.device_),
      what_(std::move(other.what_)) {}

CudaGraph& CudaGraph::operator=(CudaGraph&& other) noexcept {
  if (this != &other) {
    capture_abort();
    reset();
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
    capturing_ = std::exchange(other.capturing_, nullptr);
    device_ = other.device_;
    what_ = std::move(other.what_);
  }
  return *this;
}

void CudaGraph::reset() noexcept {
  if (exec_ != nullptr) {
    DeviceGuard guard(device_);
    cudaGraphExecDestroy(exec_);
    exec_ = nullptr;
  }
  if (graph_ != nullptr) {
    cudaGraphDestroy(graph_);
    graph_ = nullptr;
  }
}

void CudaGraph::capture_begin(int device, cudaStream_t stream, std::string what) {
  CUDP_CHECK(capturing_ == nullptr, "CudaGraph: a capture of ", what_, " on cuda:", device_,
             " is already open; end it before capturing ", what);
  CUDP_CHECK(stream != nullptr, "CudaGraph: ", what, " on cuda:", device,
             " cannot be captured from the legacy default stream; use a stream of "
             "cuda::Stream::create or the device's default compute stream");
  reset();
  device_ = device;
  what_ = std::move(what);
  DeviceGuard guard(device);
  begin_capture_allocations();
  const cudaError_t status = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (status != cudaSuccess) {
    end_capture_allocations();
    throw CudaError(
        status,
        cudp::detail::str("could not start capturing ", what_, " on cuda:", device,
                          " into a CUDA graph: cudaStreamBeginCapture failed with ",
                          status_str(status),
                          ". Is the stream already being captured, or busy with a "
                          "synchronisation? Run the step without a graph (--graphs off)."),
        __FILE__, __LINE__);
  }
  capturing_ = stream;
}

void CudaGraph::capture_end() {
  CUDP_CHECK(capturing_ != nullptr, "CudaGraph::capture_end: no capture is open");
  DeviceGuard guard(device_);
  cudaGraph_t graph = nullptr;
  const cudaError_t status = cudaStreamEndCapture(std::exchange(capturing_, nullptr), &graph);
  graph_owned_ = end_capture_allocations();
  if (status != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw CudaError(
        status,
        cudp::detail::str(
            "capturing ", what_, " on cuda:", device_,
            " into a CUDA graph failed: "
            "cudaStreamEndCapture reports ",
            status_str(status),
            ". Something in it is not allowed in a graph (a host synchronisation, a "
            "pageable host copy, a synchronous allocation, or work on a stream that did "
            "not rejoin the captured one); run it without a graph (--graphs off)"),
        __FILE__, __LINE__);
  }
  graph_ = graph;
  const cudaError_t inst =
      cudaGraphInstantiateWithFlags(&exec_, graph_, cudaGraphInstantiateFlagAutoFreeOnLaunch);
  if (inst != cudaSuccess) {
    exec_ = nullptr;
    cudaGetLastError();
    reset();
    check_graph_memory(inst, what_, "cudaGraphInstantiateWithFlags");
    throw CudaError(inst,
                    cudp::detail::str("instantiating the CUDA graph of ", what_, " on cuda:",
                                      device_, " failed: cudaGraphInstantiateWithFlags reports ",
                                      status_str(inst), "; run it without a graph (--graphs off)"),
                    __FILE__, __LINE__);
  }
}

void CudaGraph::fork(int device, cudaStream_t other) {
  CUDP_CHECK(capturing_ != nullptr, "CudaGraph::fork: no capture is open");
  if (other == capturing_) return;
  const Event start = Event::create(device_);
  start.record(capturing_);
  const DeviceGuard guard(device);
  CUDP_CUDA_CHECK(cudaStreamWaitEvent(other, start.get(), 0));
}

void CudaGraph::join(int device, cudaStream_t other) {
  CUDP_CHECK(capturing_ != nullptr, "CudaGraph::join: no capture is open");
  if (other == capturing_) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDP_CUDA_CHECK(cudaStreamIsCapturing(other, &status));
  if (status != cudaStreamCaptureStatusActive) return;
  const DeviceGuard guard(device);
  const Event done = Event::create(device);
  done.record(other);
  CUDP_CUDA_CHECK(cudaStreamWaitEvent(capturing_, done.get(), 0));
}

void CudaGraph::capture_abort() noexcept {
  if (capturing_ == nullptr) return;
  DeviceGuard guard(device_);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(std::exchange(capturing_, nullptr), &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();  // the capture's error was reported by whoever abandoned it
  end_capture_allocations();
}

void CudaGraph::launch(cudaStream_t stream) const {
  CUDP_CHECK(exec_ != nullptr, "CudaGraph::launch: ", what_.empty() ? "the graph" : what_,
             " was not captured and instantiated (capture_begin, then capture_end)");
  DeviceGuard guard(device_);
  const cudaError_t status = cudaGraphLaunch(exec_, stream);
  if (status != cudaSuccess) {
    check_graph_memory(status, what_, "cudaGraphLaunch");
    throw CudaError(status,
                    cudp::detail::str("launching the CUDA graph of ", what_, " on cuda:", device_,
                                      " failed: cudaGraphLaunch reports ", status_str(status)),
                    __FILE__, __LINE__);
  }
}

size_t CudaGraph::node_count() const {
  if (graph_ == nullptr) return 0;
  size_t count = 0;
  CUDP_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &count));
  return count;
}

// ---- ReplayScalars ------------------------------------------------------------------------------

ReplayScalars::ReplayScalars(const std::vector<int>& devices) {
  blocks_.reserve(devices.size());
  for (const int device : devices) {
    CUDP_CHECK(capture_is_open() == false,
               "ReplayScalars: allocate the blocks before a "
               "capture opens (they must not be graph memory)");
    const DeviceGuard guard(device);
    Block b{device, nullptr, {}, 0, Event::create(device)};
    b.memory = device_allocate(kCapacity, device, current_stream(device),
                               "the replay scalars of a CUDA graph");
    b.host.assign(kCapacity, 0);
    blocks_.push_back(std::move(b));
  }
}

ReplayScalars::~ReplayScalars() {
  {
    const std::lock_guard lock(active_mutex);
    if (active_scalars == this) active_scalars = nullptr;
  }
  for (Block& b : blocks_) {
    const DeviceGuard guard(b.device);
    device_free(b.memory, current_stream(b.device));
  }
}

ReplayScalars* ReplayScalars::active(int device) {
  const std::lock_guard lock(active_mutex);
  if (active_scalars == nullptr) return nullptr;
  for (const Block& b : active_scalars->blocks_) {
    if (b.device == device) return active_scalars;
  }
  return nullptr;
}

ReplayScalars::Activation::Activation(ReplayScalars& scalars) {
  const std::lock_guard lock(active_mutex);
  CUDP_CHECK(active_scalars == nullptr, "ReplayScalars: another capture's scalars are active");
  active_scalars = &scalars;
}

ReplayScalars::Activation::~Activation() {
  const std::lock_guard lock(active_mutex);
  active_scalars = nullptr;
}

ReplayScalars::Block& ReplayScalars::block(int device) {
  for (Block& b : blocks_) {
    if (b.device == device) return b;
  }
  CUDP_THROW(ValueError, "ReplayScalars: no block on cuda:", device,
             "; create the scalars with every device the captured step runs on");
}

ReplayScalars::Slot ReplayScalars::slot(int device, size_t bytes) {
  const std::lock_guard lock(mutex_);
  Block& b = block(device);
  const size_t size = (bytes + 15) / 16 * 16;
  CUDP_CHECK(b.used + size <= kCapacity, "ReplayScalars: the captured step needs more than ",
             kCapacity, " bytes of per-replay scalars on cuda:", device, " (", b.used, " in use, ",
             size,
             " more asked for): too many separately updated parameters, update pieces (a "
             "gradient bucket each, with the update beside the backward) or Dropout layers for "
             "one graph; flatten the parameters, use larger buckets, or run without a graph");
  Slot s{static_cast<unsigned char*>(b.memory) + b.used, b.host.data() + b.used};
  std::memset(s.host, 0, size);
  b.used += size;
  ++slot_count_;
  return s;
}

void ReplayScalars::on_replay(std::function<void()> refresh) {
  const std::lock_guard lock(mutex_);
  refresh_.push_back(std::move(refresh));
}

void ReplayScalars::prepare_replay() {
  for (const auto& refresh : refresh_) refresh();
}

void ReplayScalars::upload(cudaStream_t launch_stream) {
  for (Block& b : blocks_) {
    if (b.used == 0) continue;
    const DeviceGuard guard(b.device);
    const cudaStream_t stream = current_stream(b.device);
    kernels::write_bytes(b.memory, b.host.data(), b.used, stream);
    if (stream != launch_stream) {
      b.written.record(stream);
      CUDP_CUDA_CHECK(cudaStreamWaitEvent(launch_stream, b.written.get(), 0));
    }
  }
}

void ReplayScalars::clear() {
  const std::lock_guard lock(mutex_);
  for (Block& b : blocks_) b.used = 0;
  refresh_.clear();
  slot_count_ = 0;
}

}  // namespace cudp::cuda
