#include "engine/parallel/scatter_gather.h"

#include <algorithm>
#include <iostream>
#include <mutex>
#include <numeric>
#include <set>

#include "engine/core/memory.h"
#include "engine/core/stream.h"

namespace cudp::parallel {
namespace {

// Only dim 0 (or its negative spelling) is supported: chunks along it are contiguous byte ranges.
void check_dim(int dim, const Tensor& t, const char* what) {
  const int64_t n = t.dim();
  CUDP_CHECK(dim >= -n && dim < n, what, ": dim ", dim, " is out of range for ", t.str());
  CUDP_CHECK(dim == 0 || dim == -n, what, " along dim ", dim,
             " is not supported yet: cudp splits "
             "and concatenates along dim 0 (the batch) only");
}

// A copy of `bytes` from `src` to `dst` (a CUDA tensor's memory) on `stream`, a stream of dst's
// device: a peer copy when the source is on another GPU (the caller orders it with events), else a
// plain copy (host to device, or device to device on one GPU).
void copy_bytes(const Tensor& dst, const Tensor& src, cudaStream_t stream) {
  if (dst.nbytes() == 0) return;
  if (src.is_cuda() && src.device() != dst.device()) {
    CUDP_CUDA_CHECK(cudaMemcpyPeerAsync(dst.data_ptr(), dst.device().index, src.data_ptr(),
                                        src.device().index, dst.nbytes(), stream));
  } else {
    CUDP_CUDA_CHECK(
        cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(), cudaMemcpyDefault, stream));
  }
}

// An event recorded now on `device`'s current stream.
cuda::Event mark(int device) {
  cuda::DeviceGuard guard(device);
  cuda::Event event = cuda::Event::create(device);
  event.record(cuda::current_stream(device));
  return event;
}

// `device`'s current stream waits for `event` (recorded on any device).
void wait(int device, const cuda::Event& event) {
  cuda::DeviceGuard guard(device);
  CUDP_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device), event.get(), 0));
}

}  // namespace

std::vector<int64_t> chunk_sizes(int64_t n, int k) {
  CUDP_CHECK(k > 0, "chunk_sizes: cannot split into ", k, " chunks; give at least one device");
  CUDP_CHECK(n > 0, "chunk_sizes: cannot split ", n,
             " rows into chunks (an empty batch has nothing "
             "to scatter)");
  const int64_t size = (n + k - 1) / k;
  std::vector<int64_t> sizes;
  for (int64_t begin = 0; begin < n; begin += size) sizes.push_back(std::min(size, n - begin));
  return sizes;
}

TensorList scatter(const Tensor& input, const std::vector<int>& device_ids, int dim) {
  CUDP_CHECK(input.defined(), "scatter: the input is undefined");
  CUDP_CHECK(input.dim() >= 1, "scatter: cannot split ", input.str(),
             ": a scalar has no dimension to split along");
  check_dim(dim, input, "scatter");
  return scatter(input, device_ids, chunk_sizes(input.size(0), static_cast<int>(device_ids.size())),
                 dim);
}

TensorList scatter(const Tensor& input, const std::vector<int>& device_ids,
                   const std::vector<int64_t>& sizes, int dim) {
  CUDP_CHECK(input.defined(), "scatter: the input is undefined");
  CUDP_CHECK(input.dim() >= 1, "scatter: cannot split ", input.str(),
             ": a scalar has no dimension to split along");
  check_dim(dim, input, "scatter");
  CUDP_CHECK(!sizes.empty() && sizes.size() <= device_ids.size(), "scatter: ", sizes.size(),
             " chunks for ", device_ids.size(), " devices; give between 1 and ", device_ids.size(),
             " chunk sizes");
  CUDP_CHECK(std::all_of(sizes.begin(), sizes.end(), [](int64_t s) { return s >= 0; }) &&
                 std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) == input.size(0),
             "scatter: chunk sizes ", shape_str(sizes), " do not split the ", input.size(0),
             " rows along dim 0 of ", input.str());
  for (size_t i = 0; i < sizes.size(); ++i) cuda::check_device(device_ids[i]);

  // NOTE [Cross-device copies and memory lifetime]: destinations wait for the source's stream, and
  // the source's stream waits for every copy.
  const bool from_gpu = input.is_cuda();
  cuda::Event source_ready;
  if (from_gpu) source_ready = mark(input.device().index);
  std::vector<cuda::Event> copied;

  TensorList chunks;
  int64_t begin = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int device = device_ids[i];
    const Tensor piece = input.slice(begin, begin + sizes[i]);
    begin += sizes[i];
    if (input.device() == Device::cuda(device)) {
      chunks.push_back(piece);  // already there: a view, no copy
      continue;
    }
    cuda::DeviceGuard guard(device);
    const cuda::AllocationPurpose purpose(
        detail::str("scatter: chunk ", i, " (", sizes[i], " rows) on cuda:", device));
    Tensor chunk = Tensor::empty(piece.shape(), piece.dtype(), Device::cuda(device));
    if (from_gpu) wait(device, source_ready);
    copy_bytes(chunk, piece, cuda::current_stream(device));
    if (from_gpu) copied.push_back(mark(device));
    chunks.push_back(std::move(chunk));
  }
  for (const cuda::Event& event : copied) wait(input.device().index, event);
  return chunks;
}

Tensor gather(const TensorList& tensors, int output_device, int dim) {
  CUDP_CHECK(!tensors.empty(), "gather: no tensors to gather");
  for (size_t i = 0; i < tensors.size(); ++i) {
    CUDP_CHECK(tensors[i].defined(), "gather: input tensor at index ", i, " is undefined");
  }
  CUDP_CHECK(output_device >= -1, "gather: output_device ", output_device,
             " is neither a CUDA device id nor -1 (the CPU)");
  const Device out = output_device < 0 ? Device::cpu() : Device::cuda(output_device);
  if (out.is_cuda()) cuda::check_device(output_device);

  // Scalars (a loss per replica) become a vector of one element per tensor, as in PyTorch.
  const bool scalars =
      std::all_of(tensors.begin(), tensors.end(), [](const Tensor& t) { return t.dim() == 0; });
  TensorList parts = tensors;
  if (scalars) {
    static std::once_flag warned;
    std::call_once(warned, [] {
      std::cerr << "Warning: Was asked to gather along dimension 0, but all input tensors were "
                   "scalars; will instead unsqueeze and return a vector.\n";
    });
    for (Tensor& t : parts) t = t.view({1});
  }
  const Tensor& first = parts[0];
  CUDP_CHECK(first.dim() >= 1, "gather: input tensor at index 0 is a scalar but others are not");
  check_dim(dim, first, "gather");
  int64_t rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Tensor& t = parts[i];
    Shape expected = first.shape();
    if (t.dim() >= 1) expected[0] = t.size(0);
    CUDP_CHECK(t.shape() == expected, "Input tensor at index ", i, " has invalid shape ",
               shape_str(t.shape()), ", but expected ", shape_str(expected));
    CUDP_CHECK(t.dtype() == first.dtype(), "Input tensor at index ", i, " has dtype ",
               dtype_name(t.dtype()), ", but expected ", dtype_name(first.dtype()));
    rows += t.size(0);
  }
  if (parts.size() == 1 && first.device() == out) return first;

  Shape shape = first.shape();
  shape[0] = rows;
  const cuda::AllocationPurpose purpose(
      detail::str("gather: ", rows, " rows from ", parts.size(), " replicas on ", out));
  Tensor result = Tensor::empty(shape, first.dtype(), out);
  if (out.is_cpu()) {
    // The caller reads the host tensor right away: each copy completes before the next.
    int64_t begin = 0;
    for (const Tensor& t : parts) {
      result.slice(begin, begin + t.size(0)).copy_from(t);
      begin += t.size(0);
    }
    return result;
  }

  // NOTE [Cross-device copies and memory lifetime]: each copy waits for its source's stream; each
  // source's stream then waits for the copies.
  cuda::DeviceGuard guard(output_device);
  const cudaStream_t stream = cuda::current_stream(output_device);
  std::set<int> sources;
  int64_t begin = 0;
  for (const Tensor& t : parts) {
    const Tensor dst = result.slice(begin, begin + t.size(0));
    begin += t.size(0);
    if (t.is_cuda() && t.device() != out) {
      wait(output_device, mark(t.device().index));
      sources.insert(t.device().index);
    }
    copy_bytes(dst, t, stream);
  }
  if (!sources.empty()) {
    const cuda::Event copied = mark(output_device);
    for (const int source : sources) wait(source, copied);
  }
  return result;
}

}  // namespace cudp::parallel
