#include "data/dataset.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "engine/core/checked.h"
#include "engine/core/error.h"

namespace cudp::data {

void Dataset::validate() const {
  CUDP_CHECK(height > 0 && width > 0 && channels > 0, name, ": invalid image size ", height, "x",
             width, "x", channels);
  CUDP_CHECK(num_classes > 0, name, ": num_classes must be positive, got ", num_classes);
  // Checked: a hand-built or corrupt size must not wrap into a match.
  const int64_t pixels = checked_mul(
      size(), checked_mul(checked_mul(height, width, name + ": image size"), channels,
                          name + ": image size"),
      name + ": pixel count");
  CUDP_CHECK(static_cast<int64_t>(images.size()) == pixels, name, ": ", images.size(),
             " pixels do not make ", size(), " images of ", height, "x", width, "x", channels);
  for (size_t i = 0; i < labels.size(); ++i) {
    CUDP_CHECK(labels[i] >= 0 && labels[i] < num_classes, name, ": label ", labels[i],
               " at index ", i, " is out of range [0, ", num_classes, ")");
  }
}

std::string Dataset::str() const {
  return detail::str(name, ": ", size(), " images of ", height, "x", width, "x", channels, ", ",
                     num_classes, " classes");
}

std::vector<int64_t> class_histogram(const Dataset& dataset) {
  std::vector<int64_t> counts(static_cast<size_t>(dataset.num_classes), 0);
  for (int32_t label : dataset.labels) {
    CUDP_CHECK(label >= 0 && label < dataset.num_classes, dataset.name, ": label ", label,
               " is out of range [0, ", dataset.num_classes, ")");
    ++counts[static_cast<size_t>(label)];
  }
  return counts;
}

DatasetSource::DatasetSource(Dataset dataset)
    : DatasetSource(std::make_shared<const Dataset>(std::move(dataset))) {}

DatasetSource::DatasetSource(std::shared_ptr<const Dataset> dataset) : dataset_(std::move(dataset)) {
  CUDP_CHECK(dataset_ != nullptr, "DatasetSource: no Dataset given");
  dataset_->validate();
}

int32_t DatasetSource::label(int64_t index) const {
  CUDP_CHECK(index >= 0 && index < size(), dataset_->name, ": sample ", index,
             " is outside [0, ", size(), ")");
  return dataset_->labels[static_cast<size_t>(index)];
}

const uint8_t* DatasetSource::pixels(int64_t index) const {
  CUDP_CHECK(index >= 0 && index < size(), dataset_->name, ": sample ", index,
             " is outside [0, ", size(), ")");
  return dataset_->image(index);
}

void DatasetSource::read(int64_t index, uint64_t, int, uint8_t* out) const {
  std::memcpy(out, pixels(index), static_cast<size_t>(image_bytes()));
}

Dataset materialize(const SampleSource& source, uint64_t seed, int epoch, int workers) {
  CUDP_CHECK(workers >= 1, "materialize: workers must be at least 1, got ", workers);
  Dataset d;
  d.name = source.name();
  d.height = source.height();
  d.width = source.width();
  d.channels = source.channels();
  d.num_classes = source.num_classes();
  const auto n = static_cast<size_t>(source.size());
  const auto bytes = static_cast<size_t>(source.image_bytes());
  d.images.resize(static_cast<size_t>(
      checked_mul(source.size(), source.image_bytes(), source.name() + ": pixel count")));
  d.labels.resize(n);

  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        d.labels[i] = source.label(static_cast<int64_t>(i));
        source.read(static_cast<int64_t>(i), seed, epoch, d.images.data() + i * bytes);
      } catch (...) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = n;  // the others stop at their next sample
      }
    }
  };
  std::vector<std::thread> threads;
  for (size_t t = 1; t < std::min(static_cast<size_t>(workers), n); ++t) threads.emplace_back(work);
  work();
  for (std::thread& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  d.validate();
  return d;
}

}  // namespace cudp::data
