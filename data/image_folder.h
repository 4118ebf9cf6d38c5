// ImageFolder: your own images as a Dataset, laid out as torchvision's ImageFolder reads them:
//
//   root/<class name>/<image>.jpg|.jpeg|.png     (classes sorted by name, label = index)
//
// JPEG is decoded by libjpeg-turbo (its TurboJPEG API), PNG by libpng (its simplified API), each
// resized so that the shorter side is round(size / 0.875) (bilinear, averaging the source pixels a
// target pixel covers when shrinking) and centre-cropped to size x size: torchvision's evaluation
// recipe Resize(256) + CenterCrop(224) at any size. Every image becomes RGB (grey and palette
// images expanded, alpha dropped).
//
// Why the decoders are loaded at run time (dlopen of libturbojpeg.so.0 and libpng16.so.16) rather
// than linked: cudp and every program built on it keep no new link dependency for a feature most of
// them do not use, the library builds on machines without the codecs' development packages, and a
// missing codec is a clear error naming the Debian/Ubuntu package (libturbojpeg0, libpng16-16) at
// the moment an image needs it. The API used is small and stable (TurboJPEG 2.x, libpng 1.6).
//
// Images are decoded once, in parallel on `workers` threads, into the Dataset's uint8 NHWC buffer
// (size * size * 3 bytes each: 10,000 images at 224 take 1.5 GB), so the loader's workers only
// normalise, crop and flip. What torchvision does at every epoch (RandomResizedCrop of the full
// image) is therefore not reproduced: training augments the fixed crop with the loader's random
// shift and flip (data/loader.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"

namespace cudp::data {

struct ImageFolderOptions {
  int64_t size = 224;  // output side (pixels)
  int workers = 4;     // decoding threads
  // Class names to use (their order gives the labels), e.g. the training set's for the test set.
  // Empty: the sub-folders of root, sorted.
  std::vector<std::string> classes;
};

// Reads every image under root/<class>/ (name as `name` in the Dataset). Throws IoError naming the
// file for an unreadable or undecodable image, ValueError for a folder with no classes or images.
Dataset load_image_folder(const std::string& root, const ImageFolderOptions& options,
                          const std::string& name = "folder");

// The sub-folders of root, sorted (the class names).
std::vector<std::string> image_folder_classes(const std::string& root);

// One decoded image, RGB, row-major.
struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // width * height * 3
};

// Decodes a JPEG or PNG file (chosen by its first bytes, not its name) to RGB.
Image decode_image(const std::string& path);
// Shorter side to `resize` (bilinear, area-averaged when shrinking), then the centre size x size.
Image resize_center_crop(const Image& image, int64_t resize, int64_t size);

// Whether the decoders can be loaded; when not, `why` names the package to install.
bool jpeg_available(std::string* why = nullptr);
bool png_available(std::string* why = nullptr);

}  // namespace cudp::data
