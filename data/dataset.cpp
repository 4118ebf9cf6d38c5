#include "data/dataset.h"

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

}  // namespace cudp::data
