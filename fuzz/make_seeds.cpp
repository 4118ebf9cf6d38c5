// Writes the seed corpora of the fuzz targets: small valid files of every kind the readers accept,
// made with the library's own writers, so no binary file is kept in the repository and the seeds
// follow the formats as the code changes. Usage: cudp-fuzz-seeds <directory>; it creates
// <directory>/{safetensors,checkpoint,idx,cifar,gzip,image_decode}/.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "data/cifar.h"
#include "data/file_io.h"
#include "data/idx.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/checkpoint.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "tests/examples/image_files.h"

namespace fs = std::filesystem;
using namespace cudp;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void put(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void put(const fs::path& path, const std::vector<uint8_t>& bytes, bool gzip = false) {
  data::write_file(path.string(), bytes, gzip);
}

// The checkpoint target's model (fuzz/checkpoint_fuzz.cpp builds the same one).
std::shared_ptr<Sequential> seed_model() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 2, 3, 1, 1, true, 1), std::make_shared<BatchNorm2d>(2),
      std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(2 * 2 * 2, 3, true, 2)});
}

void safetensors_seeds(const fs::path& dir, const fs::path& scratch) {
  const TensorMap all = {
      {"f32", Tensor::full({2, 3}, 1.5f)},
      {"i64", Tensor::from_vector<int64_t>({1, -2}, {2})},
      {"u8", Tensor::from_vector<uint8_t>({1, 2, 3}, {3})},
      {"scalar", Tensor::full({}, 2.0f)},
      {"empty", Tensor::zeros({0, 4})},
      {"bf16", Tensor::zeros({3}, DType::bf16)},
  };
  const std::string file = (scratch / "s.safetensors").string();
  save_safetensors(file, all, {{"format", "pt"}, {"step", "7"}});
  put(dir / "all-dtypes", slurp(file));
  save_safetensors(file, {{"w", Tensor::full({4}, 1.0f)}});
  put(dir / "one-tensor", slurp(file));
  save_safetensors(file, {}, {{"only", "metadata"}});
  put(dir / "metadata-only", slurp(file));
}

void checkpoint_seeds(const fs::path& dir, const fs::path& scratch) {
  const std::string separator = "@@FILE@@";
  const std::string path = (scratch / "c.safetensors").string();
  auto model = seed_model();
  for (Parameter* p : model->parameters()) p->grad.fill_(0.25f);
  SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 1e-4});
  sgd.step();
  const Metadata meta = {{"epoch", "2"}, {"seed", "42"}, {"lr", "0.1"}, {"data", "mnist"}};
  save_checkpoint(path, *model, &sgd, meta);
  save_checkpoint(path, *model, &sgd, meta);  // a previous save beside it
  const std::string m = slurp(path), t = slurp(optimizer_state_path(path));
  const std::string pm = slurp(previous_checkpoint_path(path));
  const std::string pt = slurp(optimizer_state_path(previous_checkpoint_path(path)));
  put(dir / "sgd-pair", m + separator + t);
  put(dir / "sgd-two-saves", m + separator + t + separator + pm + separator + pt);
  put(dir / "sgd-torn", m + separator + pt + separator + pm + separator + pt);
  put(dir / "sgd-model-only", m);

  AdamW adamw(model->parameters(), {.lr = 1e-3});
  adamw.step();
  save_checkpoint(path, *model, &adamw, meta);
  put(dir / "adamw-pair", slurp(path) + separator + slurp(optimizer_state_path(path)));
  save_checkpoint(path, *model, nullptr, {});
  put(dir / "no-optimizer", slurp(path) + separator + slurp(optimizer_state_path(path)));
}

void idx_seeds(const fs::path& dir) {
  std::vector<uint8_t> pixels(3 * 4 * 5);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 7);
  const auto images = data::encode_idx_images(pixels, 3, 4, 5);
  const auto labels = data::encode_idx_labels(std::vector<uint8_t>{1, 9, 0});
  put(dir / "images", images);
  put(dir / "images.gz", images, true);
  put(dir / "labels", labels);
  put(dir / "labels.gz", labels, true);
  put(dir / "no-images", data::encode_idx_images({}, 0, 28, 28));
}

void cifar_seeds(const fs::path& dir) {
  std::vector<uint8_t> records(2 * data::kCifarRecordBytes);
  for (size_t i = 0; i < records.size(); ++i) records[i] = static_cast<uint8_t>(i * 13);
  records[0] = 3;
  records[data::kCifarRecordBytes] = 9;
  put(dir / "two-records", records);
  put(dir / "two-records.gz", records, true);
}

void gzip_seeds(const fs::path& dir) {
  // The target reads its first byte as a setting and the rest as the stream.
  for (const auto& [name, size] : {std::pair{"small", 100}, std::pair{"large", 70000}}) {
    std::vector<uint8_t> plain(static_cast<size_t>(size));
    for (size_t i = 0; i < plain.size(); ++i) plain[i] = static_cast<uint8_t>((i * i) >> 3);
    const fs::path tmp = dir / "tmp.gz";
    put(tmp, plain, true);
    put(dir / name, std::string(1, '\x07') + slurp(tmp.string()));
    fs::remove(tmp);
  }
  const fs::path a = dir / "a.gz", b = dir / "b.gz";
  put(a, std::vector<uint8_t>{1, 2, 3}, true);
  put(b, std::vector<uint8_t>{4, 5}, true);
  put(dir / "two-members", std::string(1, '\x02') + slurp(a.string()) + slurp(b.string()));
  fs::remove(a);
  fs::remove(b);
}

// A small image as a PNG (written by hand: tests/examples/image_files.h) and, where libjpeg-turbo
// is installed, as a JPEG through its encoder.
void image_decode_seeds(const fs::path& dir) {
  std::vector<uint8_t> rgb;
  for (int y = 0; y < 6; ++y) {
    for (int x = 0; x < 5; ++x) rgb.insert(rgb.end(), {uint8_t(40 * x), uint8_t(30 * y), 128});
  }
  testing::write_png((dir / "rgb.png").string(), 5, 6, rgb);
  if (!testing::write_jpeg((dir / "rgb.jpg").string(), 5, 6, rgb, 90)) {
    std::fprintf(stderr, "cudp-fuzz-seeds: no JPEG seed (libturbojpeg.so.0 is not installed)\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus directory>\n", argv[0]);
    return 2;
  }
  try {
    const fs::path root = argv[1];
    const fs::path scratch = root / ".scratch";
    for (const char* d :
         {"safetensors", "checkpoint", "idx", "cifar", "gzip", "image_decode", ".scratch"}) {
      fs::create_directories(root / d);
    }
    safetensors_seeds(root / "safetensors", scratch);
    checkpoint_seeds(root / "checkpoint", scratch);
    idx_seeds(root / "idx");
    cifar_seeds(root / "cifar");
    gzip_seeds(root / "gzip");
    image_decode_seeds(root / "image_decode");
    fs::remove_all(scratch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cudp-fuzz-seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
