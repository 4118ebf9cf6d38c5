// Dataset: a labelled image set held in host memory, whatever file format it came from.
//
// Every reader (IDX for MNIST and Fashion-MNIST, CIFAR-10 binary batches, the synthetic set) produces
// this one type, so the loader, the trainer and the tests handle all of them alike. Images stay as
// the files store them, uint8 pixels, in NHWC order (N x H x W x C, channels last, like cudp's
// activations); converting to float, normalising, padding and augmenting is the loader's job, done
// per batch, so a data set costs one byte per pixel in memory (47 MB for Fashion-MNIST's train set).
//
// SampleSource: what the loader reads, a data set as a number of labelled samples of one shape,
// each produced on demand on the loader's worker threads. A Dataset is one (DatasetSource: its
// samples served from memory, the same at every epoch); an image folder is another
// (data/image_folder.h: each sample decoded from its file and randomly cropped at every epoch), which
// is why a folder of photographs needs no memory for decoded images.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace cudp::data {

struct Dataset {
  std::string name;             // "fashion-mnist/train", "cifar10/test", "synthetic/train"
  int64_t height = 0, width = 0, channels = 0;
  int num_classes = 0;
  std::vector<uint8_t> images;  // size() * height * width * channels pixels, NHWC
  std::vector<int32_t> labels;  // one per image, each in [0, num_classes)

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  int64_t image_bytes() const { return height * width * channels; }
  const uint8_t* image(int64_t i) const { return images.data() + i * image_bytes(); }

  // Throws ValueError naming the data set and the problem unless the sizes agree with each other and
  // every label is in range (readers call it last; a hand-built Dataset should too).
  void validate() const;
  // "fashion-mnist/train: 60000 images of 28x28x1, 10 classes"
  std::string str() const;
};

// How many images of each class (the test's check of a real data set, a trainer's sanity print).
std::vector<int64_t> class_histogram(const Dataset& dataset);

class SampleSource {
 public:
  virtual ~SampleSource() = default;

  virtual const std::string& name() const = 0;
  virtual int64_t size() const = 0;  // samples
  virtual int64_t height() const = 0;
  virtual int64_t width() const = 0;
  virtual int64_t channels() const = 0;
  virtual int num_classes() const = 0;
  virtual int32_t label(int64_t index) const = 0;  // in [0, num_classes)

  // Writes sample `index` (in [0, size)) as it is served in `epoch`: height x width x channels uint8
  // pixels, HWC, to `out`. What it draws at random is a function of (seed, epoch, index) alone, so
  // the batches do not depend on which thread prepares them, on timing or on where a run resumed.
  // Called from several threads at once. Throws (IoError, ValueError) naming what is wrong and
  // where, e.g. the file of a sample that does not decode.
  virtual void read(int64_t index, uint64_t seed, int epoch, uint8_t* out) const = 0;
  // The pixels of sample `index` where they are held in memory and do not change with the epoch:
  // the loader reads them in place instead of calling read(). nullptr (the default) otherwise.
  virtual const uint8_t* pixels(int64_t index) const { return nullptr; }

  int64_t image_bytes() const { return height() * width() * channels(); }
};

// A Dataset as a SampleSource.
class DatasetSource final : public SampleSource {
 public:
  explicit DatasetSource(Dataset dataset);  // takes it
  // Shares it (a shared_ptr without ownership, e.g. to a Dataset the caller keeps alive, works too).
  explicit DatasetSource(std::shared_ptr<const Dataset> dataset);

  const Dataset& dataset() const { return *dataset_; }
  const std::string& name() const override { return dataset_->name; }
  int64_t size() const override { return dataset_->size(); }
  int64_t height() const override { return dataset_->height; }
  int64_t width() const override { return dataset_->width; }
  int64_t channels() const override { return dataset_->channels; }
  int num_classes() const override { return dataset_->num_classes; }
  int32_t label(int64_t index) const override;
  void read(int64_t index, uint64_t seed, int epoch, uint8_t* out) const override;
  const uint8_t* pixels(int64_t index) const override;

 private:
  std::shared_ptr<const Dataset> dataset_;
};

// Every sample of `source` as it is served in `epoch`, read on `workers` threads, as one Dataset
// (a test set written to a file, a reference in a test).
Dataset materialize(const SampleSource& source, uint64_t seed = 0, int epoch = 0, int workers = 1);

}  // namespace cudp::data
