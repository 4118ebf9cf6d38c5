#include "data/image_folder.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "kernels/philox.h"

namespace cudp::data {
namespace fs = std::filesystem;

namespace {

// ---- the codecs, loaded on first use --------------------------------------------------------------

// TurboJPEG 2.x (turbojpeg.h), the functions used.
using tjhandle = void*;
constexpr int kTjPixelRgb = 0;  // TJPF_RGB
struct TurboJpeg {
  tjhandle (*init_decompress)();
  int (*decompress_header3)(tjhandle, const unsigned char*, unsigned long, int*, int*, int*, int*);
  int (*decompress2)(tjhandle, const unsigned char*, unsigned long, unsigned char*, int, int, int,
                     int, int);
  int (*destroy)(tjhandle);
  char* (*error_string2)(tjhandle);
};

// libpng 1.6's simplified API (png.h: png_image, PNG_IMAGE_VERSION, PNG_FORMAT_RGB).
struct PngImage {
  void* opaque;
  uint32_t version, width, height, format, flags, colormap_entries, warning_or_error;
  char message[64];
};
constexpr uint32_t kPngImageVersion = 1;
constexpr uint32_t kPngFormatRgb = 2;
struct LibPng {
  int (*begin_read_from_memory)(PngImage*, const void*, size_t);
  int (*finish_read)(PngImage*, const void*, void*, int32_t, void*);
  void (*free)(PngImage*);
};

template <class Fn>
bool bind(void* lib, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  return fn != nullptr;
}

struct Codecs {
  TurboJpeg jpeg{};
  LibPng png{};
  bool has_jpeg = false, has_png = false;
  std::string jpeg_why, png_why;

  Codecs() {
    if (void* lib = dlopen("libturbojpeg.so.0", RTLD_NOW | RTLD_LOCAL)) {
      has_jpeg = bind(lib, "tjInitDecompress", jpeg.init_decompress) &&
                 bind(lib, "tjDecompressHeader3", jpeg.decompress_header3) &&
                 bind(lib, "tjDecompress2", jpeg.decompress2) &&
                 bind(lib, "tjDestroy", jpeg.destroy) &&
                 bind(lib, "tjGetErrorStr2", jpeg.error_string2);
      if (!has_jpeg) jpeg_why = "libturbojpeg.so.0 lacks the TurboJPEG 2 functions";
    } else {
      jpeg_why = "JPEG needs libjpeg-turbo's libturbojpeg.so.0: install the Debian/Ubuntu package "
                 "libturbojpeg0";
    }
    if (void* lib = dlopen("libpng16.so.16", RTLD_NOW | RTLD_LOCAL)) {
      has_png = bind(lib, "png_image_begin_read_from_memory", png.begin_read_from_memory) &&
                bind(lib, "png_image_finish_read", png.finish_read) &&
                bind(lib, "png_image_free", png.free);
      if (!has_png) png_why = "libpng16.so.16 lacks the simplified API";
    } else {
      png_why = "PNG needs libpng16.so.16: install the Debian/Ubuntu package libpng16-16";
    }
  }
};

const Codecs& codecs() {
  static const Codecs c;
  return c;
}

// The largest image file read. A photograph is a few MiB; a file above this bound is far more
// likely a mistaken path than a training image, and is refused before it is read into memory.
constexpr uint64_t kMaxImageFileBytes = uint64_t{256} << 20;

std::vector<unsigned char> read_file(const std::string& path) {
  // InputFile: a FIFO or a device planted in a class folder is an error, not a hang.
  InputFile file(path, "JPEG or PNG image");
  if (file.size() > kMaxImageFileBytes) {
    CUDP_THROW(IoError, path, " is ", file.size(), " bytes: an image file is refused above ",
               kMaxImageFileBytes >> 20, " MiB (is it an image?)");
  }
  std::vector<unsigned char> bytes(file.size());
  file.read_exact(bytes.data(), bytes.size(), "its bytes");
  return bytes;
}

Image decode_jpeg(const std::string& path, const std::vector<unsigned char>& bytes) {
  const Codecs& c = codecs();
  if (!c.has_jpeg) CUDP_THROW(IoError, path, ": ", c.jpeg_why);
  tjhandle h = c.jpeg.init_decompress();
  if (!h) CUDP_THROW(IoError, path, ": TurboJPEG could not start a decompressor");
  struct Destroy {
    const Codecs& c;
    tjhandle h;
    ~Destroy() { c.jpeg.destroy(h); }
  } guard{c, h};
  int w = 0, ht = 0, subsampling = 0, colorspace = 0;
  if (c.jpeg.decompress_header3(h, bytes.data(), bytes.size(), &w, &ht, &subsampling,
                                &colorspace) != 0) {
    CUDP_THROW(IoError, path, ": not a readable JPEG (", c.jpeg.error_string2(h), ")");
  }
  if (w <= 0 || ht <= 0 || static_cast<int64_t>(w) * ht > (int64_t{1} << 28)) {
    CUDP_THROW(IoError, path, ": a JPEG of ", w, "x", ht, " pixels is not supported");
  }
  Image img;
  img.width = w;
  img.height = ht;
  img.rgb.resize(static_cast<size_t>(w) * ht * 3);
  if (c.jpeg.decompress2(h, bytes.data(), bytes.size(), img.rgb.data(), w, 0, ht, kTjPixelRgb,
                         0) != 0) {
    CUDP_THROW(IoError, path, ": JPEG decoding failed (", c.jpeg.error_string2(h), ")");
  }
  return img;
}

Image decode_png(const std::string& path, const std::vector<unsigned char>& bytes) {
  const Codecs& c = codecs();
  if (!c.has_png) CUDP_THROW(IoError, path, ": ", c.png_why);
  PngImage p{};
  p.version = kPngImageVersion;
  if (!c.png.begin_read_from_memory(&p, bytes.data(), bytes.size())) {
    CUDP_THROW(IoError, path, ": not a readable PNG (", p.message, ")");
  }
  if (p.width == 0 || p.height == 0 || static_cast<int64_t>(p.width) * p.height > (int64_t{1} << 28)) {
    c.png.free(&p);
    CUDP_THROW(IoError, path, ": a PNG of ", p.width, "x", p.height, " pixels is not supported");
  }
  p.format = kPngFormatRgb;  // grey, palette and 16-bit expanded; alpha composited on black
  Image img;
  img.width = p.width;
  img.height = p.height;
  img.rgb.resize(static_cast<size_t>(p.width) * p.height * 3);
  if (!c.png.finish_read(&p, nullptr, img.rgb.data(), 0, nullptr)) {
    const std::string message = p.message;
    c.png.free(&p);
    CUDP_THROW(IoError, path, ": PNG decoding failed (", message, ")");
  }
  return img;
}

// Resampling one axis: target i of n_out reads the source samples [first[i], first[i] + count[i])
// of the range [in0, in0 + in_len) with the weights weights[i * stride + k]. The filter is the
// triangle of bilinear interpolation, stretched by the reduction factor when shrinking (so a target
// pixel averages the source pixels it covers: antialiasing), centred on the target's centre mapped
// into the range, and normalised to sum 1 over the taps inside the range (PIL's definition, which
// torchvision uses for PIL images and, with antialias, for tensors).
struct Taps {
  int64_t stride = 0;
  std::vector<int64_t> first, count;
  std::vector<float> weights;
};

Taps taps(int64_t in0, int64_t in_len, int64_t n_out) {
  const double scale = static_cast<double>(in_len) / static_cast<double>(n_out);
  const double support = std::max(1.0, scale);  // the triangle's half-width, in source pixels
  Taps t;
  t.stride = 2 * static_cast<int64_t>(std::ceil(support)) + 2;
  t.first.resize(static_cast<size_t>(n_out));
  t.count.resize(static_cast<size_t>(n_out));
  t.weights.assign(static_cast<size_t>(n_out * t.stride), 0.0f);
  for (int64_t i = 0; i < n_out; ++i) {
    const double center = static_cast<double>(in0) + (static_cast<double>(i) + 0.5) * scale;
    const int64_t lo = std::max(in0, static_cast<int64_t>(std::floor(center - support)));
    const int64_t hi = std::min(in0 + in_len, static_cast<int64_t>(std::ceil(center + support)));
    const auto weight = [&](int64_t j) {
      return std::max(0.0, 1.0 - std::fabs((static_cast<double>(j) + 0.5 - center) / support));
    };
    double sum = 0;
    for (int64_t j = lo; j < hi; ++j) sum += weight(j);
    t.first[static_cast<size_t>(i)] = lo;
    t.count[static_cast<size_t>(i)] = hi - lo;  // at most stride
    for (int64_t j = lo; j < hi; ++j) {
      t.weights[static_cast<size_t>(i * t.stride + j - lo)] = static_cast<float>(weight(j) / sum);
    }
  }
  return t;
}

// Resamples the rectangle `box` of `image` to out_w x out_h and returns the window `crop` of that
// result: a horizontal pass over the source rows the window needs, then a vertical pass, in float,
// rounded to 8 bits once at the end.
Image resample(const Image& image, const CropBox& box, int64_t out_w, int64_t out_h,
               const CropBox& crop) {
  CUDP_CHECK(box.left >= 0 && box.top >= 0 && box.width > 0 && box.height > 0 &&
                 box.left + box.width <= image.width && box.top + box.height <= image.height,
             "resample: the box (top ", box.top, ", left ", box.left, ", ", box.height, "x",
             box.width, ") is not inside the ", image.height, "x", image.width, " image");
  CUDP_CHECK(out_w > 0 && out_h > 0 && crop.left >= 0 && crop.top >= 0 && crop.width > 0 &&
                 crop.height > 0 && crop.left + crop.width <= out_w &&
                 crop.top + crop.height <= out_h,
             "resample: the window (top ", crop.top, ", left ", crop.left, ", ", crop.height, "x",
             crop.width, ") is not inside the ", out_h, "x", out_w, " result");
  const Taps tx = taps(box.left, box.width, out_w), ty = taps(box.top, box.height, out_h);
  const auto at = [](const std::vector<int64_t>& v, int64_t i) { return v[static_cast<size_t>(i)]; };
  // The source rows the window's vertical taps read.
  int64_t y_lo = std::numeric_limits<int64_t>::max(), y_hi = 0;
  for (int64_t y = crop.top; y < crop.top + crop.height; ++y) {
    y_lo = std::min(y_lo, at(ty.first, y));
    y_hi = std::max(y_hi, at(ty.first, y) + at(ty.count, y));
  }
  const int64_t cw = crop.width, w = image.width;
  std::vector<float> rows(static_cast<size_t>((y_hi - y_lo) * cw * 3));
  for (int64_t y = y_lo; y < y_hi; ++y) {
    const uint8_t* src = image.rgb.data() + y * w * 3;
    float* dst = rows.data() + (y - y_lo) * cw * 3;
    for (int64_t x = 0; x < cw; ++x) {
      const int64_t i = crop.left + x;
      const float* wt = tx.weights.data() + i * tx.stride;
      const uint8_t* p = src + at(tx.first, i) * 3;
      float r = 0, g = 0, b = 0;
      for (int64_t k = 0; k < at(tx.count, i); ++k) {
        r += wt[k] * p[3 * k];
        g += wt[k] * p[3 * k + 1];
        b += wt[k] * p[3 * k + 2];
      }
      dst[3 * x] = r;
      dst[3 * x + 1] = g;
      dst[3 * x + 2] = b;
    }
  }
  Image out;
  out.width = cw;
  out.height = crop.height;
  out.rgb.resize(static_cast<size_t>(crop.height * cw * 3));
  for (int64_t y = 0; y < crop.height; ++y) {
    const int64_t i = crop.top + y;
    const float* wt = ty.weights.data() + i * ty.stride;
    const float* src = rows.data() + (at(ty.first, i) - y_lo) * cw * 3;
    uint8_t* dst = out.rgb.data() + y * cw * 3;
    for (int64_t x = 0; x < cw * 3; ++x) {
      float acc = 0;
      for (int64_t k = 0; k < at(ty.count, i); ++k) acc += wt[k] * src[k * cw * 3 + x];
      dst[x] = static_cast<uint8_t>(std::clamp(std::lround(acc), 0L, 255L));
    }
  }
  return out;
}

// Python's round(): to the nearest integer, halves to the even one.
int64_t round_half_even(double x) {
  const double down = std::floor(x), frac = x - down;
  const auto n = static_cast<int64_t>(down);
  if (frac > 0.5) return n + 1;
  if (frac < 0.5) return n;
  return n % 2 == 0 ? n : n + 1;
}

bool has_image_extension(const fs::path& p, bool* jpeg) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  *jpeg = ext == ".jpg" || ext == ".jpeg";
  return *jpeg || ext == ".png";
}

// Philox's high counter word for a sample's draws: block << 40 | epoch << 8 | 0x12 (data/loader.cpp
// uses purposes 0x10 and 0x11, data/synthetic.cpp 1-3).
constexpr uint64_t kSampleDraws = 0x12;

}  // namespace

bool jpeg_available(std::string* why) {
  if (why) *why = codecs().jpeg_why;
  return codecs().has_jpeg;
}

bool png_available(std::string* why) {
  if (why) *why = codecs().png_why;
  return codecs().has_png;
}

Image decode_image(const std::string& path) {
  const std::vector<unsigned char> bytes = read_file(path);
  if (bytes.size() >= 3 && bytes[0] == 0xff && bytes[1] == 0xd8 && bytes[2] == 0xff) {
    return decode_jpeg(path, bytes);
  }
  static const unsigned char kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) return decode_png(path, bytes);
  CUDP_THROW(IoError, path, ": neither a JPEG nor a PNG (its first bytes say neither)");
}

CropBox random_resized_crop_box(int64_t width, int64_t height, const std::function<double()>& uniform,
                                const RandomResizedCropOptions& o) {
  CUDP_CHECK(width > 0 && height > 0, "random_resized_crop_box: the image is ", width, "x", height);
  CUDP_CHECK(o.scale_min > 0 && o.scale_min <= o.scale_max && o.ratio_min > 0 &&
                 o.ratio_min <= o.ratio_max,
             "random_resized_crop_box: scale (", o.scale_min, ", ", o.scale_max, ") and ratio (",
             o.ratio_min, ", ", o.ratio_max, ") must be positive, each (min, max)");
  const double area = static_cast<double>(width) * static_cast<double>(height);
  const double log_lo = std::log(o.ratio_min), log_hi = std::log(o.ratio_max);
  const auto below = [&](int64_t n) {  // uniform in [0, n)
    return std::min(n - 1, static_cast<int64_t>(uniform() * static_cast<double>(n)));
  };
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * (o.scale_min + (o.scale_max - o.scale_min) * uniform());
    const double ratio = std::exp(log_lo + (log_hi - log_lo) * uniform());
    const int64_t w = round_half_even(std::sqrt(target * ratio));
    const int64_t h = round_half_even(std::sqrt(target / ratio));
    if (0 < w && w <= width && 0 < h && h <= height) {
      const int64_t top = below(height - h + 1);
      const int64_t left = below(width - w + 1);
      return {top, left, h, w};
    }
  }
  // torchvision's fallback: the centre crop, of the whole image when its ratio is within bounds.
  const double ratio = static_cast<double>(width) / static_cast<double>(height);
  int64_t w = width, h = height;
  if (ratio < o.ratio_min) {
    h = round_half_even(static_cast<double>(w) / o.ratio_min);
  } else if (ratio > o.ratio_max) {
    w = round_half_even(static_cast<double>(h) * o.ratio_max);
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

SampleRandom::SampleRandom(uint64_t seed, int epoch, int64_t index)
    : seed_(seed), index_(static_cast<uint64_t>(index)), epoch_(static_cast<uint64_t>(epoch)) {
  CUDP_CHECK(epoch >= 0 && index >= 0, "SampleRandom: epoch ", epoch, " and index ", index,
             " must not be negative");
}

double SampleRandom::uniform() {
  if (used_ == 4) {
    const kernels::Philox4 r =
        kernels::philox(seed_, index_, (block_++ << 40) | (epoch_ << 8) | kSampleDraws);
    std::copy(r.v, r.v + 4, words_);
    used_ = 0;
  }
  const uint64_t hi = words_[used_] >> 5, lo = words_[used_ + 1] >> 6;  // 27 + 26 bits
  used_ += 2;
  return static_cast<double>((hi << 26) | lo) * (1.0 / 9007199254740992.0);  // / 2^53
}

Image resized_crop(const Image& image, const CropBox& box, int64_t width, int64_t height) {
  return resample(image, box, width, height, {0, 0, height, width});
}

int64_t eval_resize(int64_t size) { return std::lround(static_cast<double>(size) * 256.0 / 224.0); }

Image resize_center_crop(const Image& image, int64_t resize, int64_t size) {
  CUDP_CHECK(resize >= size && size > 0, "resize_center_crop: resize ", resize,
             " must be at least the crop size ", size, " (> 0)");
  const int64_t w = image.width, h = image.height;
  // torchvision's Resize(int): the shorter side becomes `resize`, the longer keeps the aspect ratio
  // (int(resize * long / short), which is this integer division).
  const int64_t out_w = w <= h ? resize : resize * w / h;
  const int64_t out_h = w <= h ? resize * h / w : resize;
  // CenterCrop: int(round((resized - size) / 2.0)), Python's round.
  const int64_t top = round_half_even(static_cast<double>(out_h - size) / 2.0);
  const int64_t left = round_half_even(static_cast<double>(out_w - size) / 2.0);
  return resample(image, {0, 0, h, w}, out_w, out_h, {top, left, size, size});
}

Image train_transform(const Image& image, int64_t size, uint64_t seed, int epoch, int64_t index) {
  SampleRandom random(seed, epoch, index);
  const CropBox box =
      random_resized_crop_box(image.width, image.height, [&random] { return random.uniform(); });
  Image out = resized_crop(image, box, size, size);
  if (random.uniform() < 0.5) {  // RandomHorizontalFlip(p=0.5): torch.rand(1) < p
    for (int64_t y = 0; y < size; ++y) {
      uint8_t* row = out.rgb.data() + y * size * 3;
      for (int64_t x = 0; x < size / 2; ++x) {
        std::swap_ranges(row + x * 3, row + x * 3 + 3, row + (size - 1 - x) * 3);
      }
    }
  }
  return out;
}

Image eval_transform(const Image& image, int64_t size) {
  return resize_center_crop(image, eval_resize(size), size);
}

Normalization imagenet_normalization() {
  return {{0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}};
}

namespace {

// The sub-folders of root, sorted; IoError where root is not a folder.
std::vector<std::string> class_folders(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    CUDP_THROW(IoError, root, " is not a folder (an ImageFolder is root/<class>/<image>)");
  }
  std::vector<std::string> classes;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (entry.is_directory()) classes.push_back(entry.path().filename().string());
  }
  std::sort(classes.begin(), classes.end());
  return classes;
}

// 'a', 'b', 'c': at most 10 names, then how many in all.
std::string quoted_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 10; ++i) {
    out += cudp::detail::str(i == 0 ? "" : ", ", "'", names[i], "'");
  }
  if (names.size() > 10) out += cudp::detail::str(", ... (", names.size(), " in all)");
  return out;
}

// A split given the training split's classes must have exactly those class folders: one missing
// leaves a class untested, and one more would be dropped unseen here, where torchvision's
// ImageFolder, which numbers each split's sorted folders, would shift the labels after it.
void check_same_classes(const std::string& root, const std::vector<std::string>& expected) {
  const std::vector<std::string> present = class_folders(root);
  std::vector<std::string> sorted = expected, missing, extra;
  std::sort(sorted.begin(), sorted.end());
  std::set_difference(sorted.begin(), sorted.end(), present.begin(), present.end(),
                      std::back_inserter(missing));
  std::set_difference(present.begin(), present.end(), sorted.begin(), sorted.end(),
                      std::back_inserter(extra));
  if (missing.empty() && extra.empty()) return;
  const auto folders = [](const std::vector<std::string>& names, const char* one,
                          const char* many) {
    return cudp::detail::str(names.size() == 1 ? "the class folder " : "the class folders ",
                             quoted_names(names), names.size() == 1 ? one : many);
  };
  std::string what;
  if (!missing.empty()) what = folders(missing, " is missing", " are missing");
  if (!extra.empty()) {
    what += cudp::detail::str(
        what.empty() ? "" : "; ",
        folders(extra, " is not in the training split", " are not in the training split"));
  }
  CUDP_THROW(IoError, root, ": ", what, " (every split needs the same class folders as the ",
             "training split, which has ", quoted_names(expected),
             ": torchvision's ImageFolder numbers each split's class folders in sorted order, so ",
             "a folder only one split has would shift the labels of those after it)");
}

}  // namespace

std::vector<std::string> image_folder_classes(const std::string& root) {
  std::vector<std::string> classes = class_folders(root);
  if (classes.empty()) {
    CUDP_THROW(ValueError, root, " has no class folders (an ImageFolder is root/<class>/<image>)");
  }
  return classes;
}

ImageFolder::ImageFolder(const std::string& root, ImageFolderOptions options, std::string name)
    : options_(std::move(options)), name_(std::move(name)) {
  CUDP_CHECK(options_.size > 0 && options_.size <= 4096, "ImageFolder: size ", options_.size,
             " must be in [1, 4096]");
  classes_ = options_.classes.empty() ? image_folder_classes(root) : options_.classes;
  if (!options_.classes.empty()) check_same_classes(root, classes_);
  int64_t jpegs = 0, pngs = 0;
  for (size_t c = 0; c < classes_.size(); ++c) {
    const fs::path dir = fs::path(root) / classes_[c];
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      CUDP_THROW(IoError, root, ": the class folder ", classes_[c],
                 " is missing (every split needs the same class folders)");
    }
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) {
      bool jpeg = false;
      // Not only regular files: a FIFO or a broken link named like an image is a mistake in the
      // data set that reading it reports by name (read_file), where a skip would hide a sample.
      if (!entry.is_directory() && has_image_extension(entry.path(), &jpeg)) {
        names.push_back(entry.path().string());
        ++(jpeg ? jpegs : pngs);
      }
    }
    std::sort(names.begin(), names.end());
    for (auto& n : names) {
      files_.push_back(std::move(n));
      labels_.push_back(static_cast<int32_t>(c));
    }
  }
  if (files_.empty()) {
    CUDP_THROW(ValueError, root, " holds no .jpg, .jpeg or .png images in its class folders");
  }
  std::string why;
  if (jpegs > 0 && !jpeg_available(&why)) {
    CUDP_THROW(IoError, root, " holds ", jpegs, " JPEG file(s): ", why);
  }
  if (pngs > 0 && !png_available(&why)) {
    CUDP_THROW(IoError, root, " holds ", pngs, " PNG file(s): ", why);
  }
}

const std::string& ImageFolder::file(int64_t index) const {
  CUDP_CHECK(index >= 0 && index < size(), name_, ": sample ", index, " is outside [0, ", size(),
             ")");
  return files_[static_cast<size_t>(index)];
}

int32_t ImageFolder::label(int64_t index) const {
  file(index);  // the range check
  return labels_[static_cast<size_t>(index)];
}

void ImageFolder::keep_first(int64_t n) {
  CUDP_CHECK(n > 0, name_, ": keep_first(", n, "): keep at least one image");
  if (n >= size()) return;
  files_.resize(static_cast<size_t>(n));
  labels_.resize(static_cast<size_t>(n));
}

void ImageFolder::read(int64_t index, uint64_t seed, int epoch, uint8_t* out) const {
  const Image decoded = decode_image(file(index));
  const Image image = options_.transform == ImageTransform::Train
                          ? train_transform(decoded, options_.size, seed, epoch, index)
                          : eval_transform(decoded, options_.size);
  std::memcpy(out, image.rgb.data(), image.rgb.size());
}

}  // namespace cudp::data
