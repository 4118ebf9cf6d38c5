#include "data/prefetcher.h"

#include <algorithm>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"

namespace cudp::data {

DevicePrefetcher::DevicePrefetcher(Loader& loader, std::vector<int> devices, bool split)
    : loader_(loader), devices_(std::move(devices)), split_(split) {
  CUDP_CHECK(!devices_.empty(), "DevicePrefetcher needs at least one device");
  for (size_t i = 0; i < devices_.size(); ++i) {
    cuda::check_device(devices_[i]);
    CUDP_CHECK(std::count(devices_.begin(), devices_.end(), devices_[i]) == 1,
               "DevicePrefetcher: device ", devices_[i], " is listed twice");
    copy_streams_.push_back(cuda::Stream::create(devices_[i]));
    copied_.push_back(cuda::Event::create(devices_[i]));
  }
}

DevicePrefetcher::~DevicePrefetcher() {
  // Staged tensors are freed on the compute streams: order that after the copies into them.
  try {
    order_compute();
  } catch (...) {  // a destructor must not throw; the device is broken anyway
  }
}

void DevicePrefetcher::start_epoch(int epoch, int64_t first_batch) {
  order_compute();
  loader_.start_epoch(epoch, first_batch);
  pending_ = false;  // stays so if stage() throws
  pending_ = stage();
}

bool DevicePrefetcher::next(DeviceBatch& batch) {
  if (!pending_) return false;
  order_compute();
  batch = std::move(staged_);
  pending_ = false;
  pending_ = stage();
  return true;
}

void DevicePrefetcher::order_compute() {
  if (!pending_) return;
  for (size_t j = 0; j < devices_.size(); ++j) {
    CUDP_CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(devices_[j]), copied_[j].get(), 0));
  }
}

bool DevicePrefetcher::stage() {
  staged_ = DeviceBatch{};
  if (!loader_.next(host_)) return false;
  staged_.epoch = host_.epoch;
  staged_.index = host_.index;
  const int64_t rows = host_.images.size(0);
  const int64_t n = static_cast<int64_t>(devices_.size());
  const int64_t chunk = split_ ? (rows + n - 1) / n : rows;  // torch.chunk's chunk size
  for (int64_t j = 0; j < n; ++j) {
    const int device = devices_[static_cast<size_t>(j)];
    cuda::AllocationPurpose purpose(
        cudp::detail::str("the device prefetcher's copy of batch ", host_.index, " on cuda:", device),
        "Reduce the batch size (--batch-size): each device holds its share of two batches at once.");
    const int64_t begin = split_ ? std::min(j * chunk, rows) : 0;
    const int64_t end = split_ ? std::min(begin + chunk, rows) : rows;
    const cuda::Stream& stream = copy_streams_[static_cast<size_t>(j)];
    for (auto [src, dst] : {std::pair{&host_.images, &staged_.images},
                            std::pair{&host_.labels, &staged_.labels}}) {
      const Tensor part = src->slice(begin, end);
      Tensor copy = Tensor::empty(part.shape(), part.dtype(), Device::cuda(device));
      copy.copy_from(part, stream);
      dst->push_back(std::move(copy));
    }
    copied_[static_cast<size_t>(j)].record(stream);
    host_.record_reader(stream, device);
  }
  return true;
}

}  // namespace cudp::data
