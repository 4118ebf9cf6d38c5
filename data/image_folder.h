// ImageFolder: your own images as a SampleSource, laid out as torchvision's ImageFolder reads them:
//
//   root/<class name>/<image>.jpg|.jpeg|.png     (classes sorted by name, label = index)
//
// Only the files' paths and labels are held in memory. A sample is made when the loader asks for it,
// on the loader's worker thread, at every epoch (torchvision's Dataset.__getitem__): the file is
// read and decoded - JPEG by libjpeg-turbo (its TurboJPEG API), PNG by libpng (its simplified API) -
// to RGB (grey and palette images expanded, alpha dropped), then transformed to size x size as in
// torchvision's ImageNet recipe:
//
//   Train: RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)) + RandomHorizontalFlip(0.5)
//   Eval:  Resize(round(size * 256 / 224)) of the shorter side + CenterCrop(size)
//
// both with bilinear resampling, antialiased as torchvision's and PIL's (a triangle filter stretched
// over the source pixels a target pixel covers when shrinking). The random draws of a sample are
// Philox(seed, sample index, epoch), so a batch does not depend on the number of workers, and a
// resumed run sees exactly the crops it would have seen. Resampling accumulates in float and rounds
// once; PIL rounds to 8 bits between its horizontal and vertical passes, so a pixel may differ from
// torchvision's by one grey level.
//
// Why the decoders are loaded at run time (dlopen of libturbojpeg.so.0 and libpng16.so.16) rather
// than linked: cudp and every program built on it keep no new link dependency for a feature most of
// them do not use, the library builds on machines without the codecs' development packages, and a
// missing codec is a clear error naming the Debian/Ubuntu package (libturbojpeg0, libpng16-16) when
// the folder is opened (by file extension) or an image needs it. The API used is small and stable
// (TurboJPEG 2.x, libpng 1.6).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/loader.h"

namespace cudp::data {

enum class ImageTransform {
  Eval,   // Resize(round(size * 256 / 224)) of the shorter side, CenterCrop(size)
  Train,  // RandomResizedCrop(size), RandomHorizontalFlip
};

struct ImageFolderOptions {
  int64_t size = 224;  // output side (pixels)
  ImageTransform transform = ImageTransform::Eval;
  // Class names to use (their order gives the labels), e.g. the training set's for the test set:
  // root must then have exactly these class folders (IoError naming those missing and those
  // extra). Empty: the sub-folders of root, sorted.
  std::vector<std::string> classes;
};

class ImageFolder final : public SampleSource {
 public:
  // Lists root/<class>/*.{jpg,jpeg,png} (extensions in any case; other files are ignored). Throws
  // IoError for a missing folder, a class folder missing or extra (options.classes), or when a
  // decoder the files need is not installed; ValueError for a folder with no classes or no images.
  // Files are not read here: one that does not decode (or is not a regular file: a FIFO, a broken
  // link) is an IoError naming it when the loader reaches it.
  ImageFolder(const std::string& root, ImageFolderOptions options, std::string name = "folder");

  const std::string& name() const override { return name_; }
  int64_t size() const override { return static_cast<int64_t>(files_.size()); }
  int64_t height() const override { return options_.size; }
  int64_t width() const override { return options_.size; }
  int64_t channels() const override { return 3; }
  int num_classes() const override { return static_cast<int>(classes_.size()); }
  int32_t label(int64_t index) const override;
  // Reads, decodes and transforms file(index).
  void read(int64_t index, uint64_t seed, int epoch, uint8_t* out) const override;

  const std::vector<std::string>& classes() const { return classes_; }
  const std::string& file(int64_t index) const;
  const ImageFolderOptions& options() const { return options_; }
  // Keeps the first n samples (in the sorted order: class, then file name); n >= size() keeps all.
  void keep_first(int64_t n);

 private:
  ImageFolderOptions options_;
  std::string name_;
  std::vector<std::string> classes_, files_;
  std::vector<int32_t> labels_;
};

// The sub-folders of root, sorted (the class names).
std::vector<std::string> image_folder_classes(const std::string& root);

// torchvision's ImageNet normalisation, Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224,
// 0.225)): what a model trained on photographs with torchvision's recipe expects.
Normalization imagenet_normalization();

// ---- the pieces, public for tests and for programs with their own pipeline --------------------------

// One decoded image, RGB, row-major.
struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // width * height * 3
};

// Decodes a JPEG or PNG file (chosen by its first bytes, not its name) to RGB. Throws IoError
// naming the file for one that does not decode, is not a regular file (a FIFO is refused without
// waiting for a writer) or holds more than 256 MiB.
Image decode_image(const std::string& path);

// A rectangle of an image: rows [top, top + height), columns [left, left + width).
struct CropBox {
  int64_t top = 0, left = 0, height = 0, width = 0;
  bool operator==(const CropBox&) const = default;
};

struct RandomResizedCropOptions {
  double scale_min = 0.08, scale_max = 1.0;              // of the image's area
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;  // width / height, drawn log-uniformly
};

// torchvision's RandomResizedCrop.get_params for a width x height image, drawing from `uniform`
// (numbers in [0, 1)): up to 10 attempts, each an area fraction uniform in [scale_min, scale_max)
// and a ratio whose logarithm is uniform in [log ratio_min, log ratio_max), width = round(sqrt(area
// * ratio)), height = round(sqrt(area / ratio)) (round half to even, as Python's round); the first
// that fits is placed uniformly (top in [0, H - h], left in [0, W - w]). When none fits, the
// centre crop of the whole image, narrowed to the ratio bounds when its own ratio is outside them.
CropBox random_resized_crop_box(int64_t width, int64_t height, const std::function<double()>& uniform,
                                const RandomResizedCropOptions& options = {});

// The random numbers of sample `index` in `epoch` under `seed`: uniform doubles in [0, 1) with 53
// random bits, from Philox(seed, index, epoch) (a stream of its own, apart from the loader's).
class SampleRandom {
 public:
  SampleRandom(uint64_t seed, int epoch, int64_t index);
  double uniform();

 private:
  uint64_t seed_, index_, epoch_, block_ = 0;
  uint32_t words_[4] = {};
  int used_ = 4;
};

// Crops `box` out of `image` and resizes it to width x height (bilinear, antialiased).
Image resized_crop(const Image& image, const CropBox& box, int64_t width, int64_t height);
// torchvision's Resize(resize) (shorter side to `resize`, the longer one to floor(resize * long /
// short)) then CenterCrop(size) (top and left offsets round((resized - size) / 2), half to even).
Image resize_center_crop(const Image& image, int64_t resize, int64_t size);
// The resize of the evaluation transform: round(size * 256 / 224).
int64_t eval_resize(int64_t size);
// The transforms an ImageFolder applies: train draws its crop and flip from SampleRandom(seed,
// epoch, index) in torchvision's order (crop, then flip when a uniform draw is below 0.5).
Image train_transform(const Image& image, int64_t size, uint64_t seed, int epoch, int64_t index);
Image eval_transform(const Image& image, int64_t size);

// Whether the decoders can be loaded; when not, `why` names the package to install.
bool jpeg_available(std::string* why = nullptr);
bool png_available(std::string* why = nullptr);

}  // namespace cudp::data
