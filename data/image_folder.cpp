#include "data/image_folder.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "engine/core/error.h"

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

std::vector<unsigned char> read_file(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    CUDP_THROW(IoError, path, " is not a regular file");
  }
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof()) CUDP_THROW(IoError, "cannot read ", path);
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

// Resamples n_in samples to n_out with a triangle filter stretched over the source pixels a target
// pixel covers (PIL's bilinear reduction; plain bilinear when enlarging): weights[i] for target i,
// starting at source index first[i].
struct Taps {
  std::vector<int64_t> first;
  std::vector<std::vector<float>> weights;
};
Taps taps(int64_t n_in, int64_t n_out) {
  const double scale = static_cast<double>(n_in) / static_cast<double>(n_out);
  const double support = std::max(1.0, scale);
  Taps t;
  for (int64_t i = 0; i < n_out; ++i) {
    const double center = (static_cast<double>(i) + 0.5) * scale;
    const auto lo = std::max<int64_t>(0, static_cast<int64_t>(std::floor(center - support)));
    const auto hi = std::min<int64_t>(n_in, static_cast<int64_t>(std::ceil(center + support)));
    std::vector<float> w;
    double sum = 0;
    for (int64_t j = lo; j < hi; ++j) {
      const double x = (static_cast<double>(j) + 0.5 - center) / support;
      const double v = std::max(0.0, 1.0 - std::fabs(x));
      w.push_back(static_cast<float>(v));
      sum += v;
    }
    for (float& v : w) v = static_cast<float>(v / sum);
    t.first.push_back(lo);
    t.weights.push_back(std::move(w));
  }
  return t;
}

bool has_image_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

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

Image resize_center_crop(const Image& image, int64_t resize, int64_t size) {
  CUDP_CHECK(resize >= size && size > 0, "resize_center_crop: resize ", resize,
             " must be at least the crop size ", size, " (> 0)");
  const int64_t w = image.width, h = image.height;
  // torchvision's Resize(int): the shorter side becomes `resize`, the longer keeps the aspect ratio.
  const int64_t out_w = w <= h ? resize : resize * w / h;
  const int64_t out_h = w <= h ? resize * h / w : resize;
  const int64_t top = std::llround(static_cast<double>(out_h - size) / 2.0);
  const int64_t left = std::llround(static_cast<double>(out_w - size) / 2.0);
  const Taps tx = taps(w, out_w), ty = taps(h, out_h);
  // Horizontal pass over every source row for the crop's columns, then the vertical pass.
  std::vector<float> rows(static_cast<size_t>(h * size * 3));
  for (int64_t y = 0; y < h; ++y) {
    for (int64_t x = 0; x < size; ++x) {
      const auto& wts = tx.weights[static_cast<size_t>(left + x)];
      const int64_t first = tx.first[static_cast<size_t>(left + x)];
      for (int c = 0; c < 3; ++c) {
        float acc = 0;
        for (size_t k = 0; k < wts.size(); ++k) {
          acc += wts[k] * image.rgb[static_cast<size_t>(((y * w) + first + static_cast<int64_t>(k)) * 3 + c)];
        }
        rows[static_cast<size_t>((y * size + x) * 3 + c)] = acc;
      }
    }
  }
  Image out;
  out.width = out.height = size;
  out.rgb.resize(static_cast<size_t>(size * size * 3));
  for (int64_t y = 0; y < size; ++y) {
    const auto& wts = ty.weights[static_cast<size_t>(top + y)];
    const int64_t first = ty.first[static_cast<size_t>(top + y)];
    for (int64_t x = 0; x < size * 3; ++x) {
      float acc = 0;
      for (size_t k = 0; k < wts.size(); ++k) {
        acc += wts[k] * rows[static_cast<size_t>((first + static_cast<int64_t>(k)) * size * 3 + x)];
      }
      out.rgb[static_cast<size_t>(y * size * 3 + x)] =
          static_cast<uint8_t>(std::clamp(std::lround(acc), 0L, 255L));
    }
  }
  return out;
}

std::vector<std::string> image_folder_classes(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    CUDP_THROW(IoError, root, " is not a folder (an ImageFolder is root/<class>/<image>)");
  }
  std::vector<std::string> classes;
  for (const auto& entry : fs::directory_iterator(root)) {
    if (entry.is_directory()) classes.push_back(entry.path().filename().string());
  }
  std::sort(classes.begin(), classes.end());
  if (classes.empty()) {
    CUDP_THROW(ValueError, root, " has no class folders (an ImageFolder is root/<class>/<image>)");
  }
  return classes;
}

Dataset load_image_folder(const std::string& root, const ImageFolderOptions& options,
                          const std::string& name) {
  CUDP_CHECK(options.size > 0 && options.size <= 4096, "ImageFolder: size ", options.size,
             " must be in [1, 4096]");
  const std::vector<std::string> classes =
      options.classes.empty() ? image_folder_classes(root) : options.classes;
  std::vector<std::pair<std::string, int32_t>> files;
  for (size_t c = 0; c < classes.size(); ++c) {
    const fs::path dir = fs::path(root) / classes[c];
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      CUDP_THROW(IoError, root, ": the class folder ", classes[c],
                 " is missing (every split needs the same class folders)");
    }
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) {
      if (entry.is_regular_file() && has_image_extension(entry.path())) {
        names.push_back(entry.path().string());
      }
    }
    std::sort(names.begin(), names.end());
    for (auto& n : names) files.emplace_back(std::move(n), static_cast<int32_t>(c));
  }
  if (files.empty()) {
    CUDP_THROW(ValueError, root, " holds no .jpg, .jpeg or .png images in its class folders");
  }

  Dataset d;
  d.name = name;
  d.height = d.width = options.size;
  d.channels = 3;
  d.num_classes = static_cast<int>(classes.size());
  const auto bytes = static_cast<size_t>(d.image_bytes());
  d.images.resize(files.size() * bytes);
  d.labels.resize(files.size());
  const auto resize = static_cast<int64_t>(std::lround(static_cast<double>(options.size) / 0.875));

  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  const auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < files.size();) {
      try {
        const Image img = resize_center_crop(decode_image(files[i].first), resize, options.size);
        std::memcpy(d.images.data() + i * bytes, img.rgb.data(), bytes);
        d.labels[i] = files[i].second;
      } catch (...) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (!failure) failure = std::current_exception();
        next = files.size();  // stop every worker
      }
    }
  };
  const int n = std::max(1, std::min<int>(options.workers, static_cast<int>(files.size())));
  std::vector<std::thread> threads;
  for (int t = 1; t < n; ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  d.validate();
  return d;
}

}  // namespace cudp::data
