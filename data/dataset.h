// Dataset: a labelled image set held in host memory, whatever file format it came from.
//
// Every reader (IDX for MNIST and Fashion-MNIST, CIFAR-10 binary batches, the synthetic set) produces
// this one type, so the loader, the trainer and the tests handle all of them alike. Images stay as
// the files store them, uint8 pixels, in NHWC order (N x H x W x C, channels last, like cudp's
// activations); converting to float, normalising, padding and augmenting is the loader's job, done
// per batch, so a data set costs one byte per pixel in memory (47 MB for Fashion-MNIST's train set).
#pragma once

#include <cstdint>
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

}  // namespace cudp::data
