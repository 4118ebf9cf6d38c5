// Fuzz target: the checkpoint loader. An input is up to four files separated by "@@FILE@@": the
// model file, the training-state file, and the previous save's two (absent when the input has fewer
// parts); its last byte picks the optimizer (SGD, AdamW, none). Loading must succeed or throw IoError (a damaged or mismatched file) or ValueError (a
// tensor that does not fit the model or the optimizer), never anything else, never crash. The
// metadata of what loads, read through the validated getters, must throw IoError only.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/checkpoint.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"

namespace cudp::fuzz {

// The model the seeds were saved from (fuzz/make_seeds.cpp builds the same one).
std::shared_ptr<Sequential> seed_model() {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 2, 3, 1, 1, true, 1), std::make_shared<BatchNorm2d>(2),
      std::make_shared<ReLU>(), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(2 * 2 * 2, 3, true, 2)});
}

}  // namespace cudp::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cudp;
  static const std::string path = fuzz::scratch_file("ckpt.safetensors");
  static const std::string files[] = {path, optimizer_state_path(path),
                                      previous_checkpoint_path(path),
                                      optimizer_state_path(previous_checkpoint_path(path))};
  static const auto model = fuzz::seed_model();
  static SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9});
  static AdamW adamw(model->parameters(), {.lr = 1e-3});
  static const bool quiet = [] {  // a fallback is an expected outcome, not news
    detail::set_checkpoint_warning_handler([](const std::string&) {});
    return true;
  }();
  (void)quiet;

  std::string_view rest = fuzz::as_text(data, size);
  constexpr std::string_view kSeparator = "@@FILE@@";
  for (const std::string& file : files) {
    std::error_code ignored;
    std::filesystem::remove(file, ignored);
  }
  for (const std::string& file : files) {
    if (rest.empty()) break;
    const size_t end = rest.find(kSeparator);
    fuzz::write_input(file, rest.substr(0, end));
    rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end + kSeparator.size());
  }

  // The last byte picks the optimizer to load into (the seeds hold SGD, AdamW and no state).
  Optimizer* const optimizers[] = {&sgd, &adamw, nullptr};
  Optimizer* optimizer = size > 0 ? optimizers[data[size - 1] % 3] : nullptr;
  Metadata metadata;
  try {
    metadata = load_checkpoint(path, *model, optimizer);
  } catch (const IoError&) {
    return 0;
  } catch (const ValueError&) {
    return 0;
  }
  // What a trainer does next: read its settings through the validated getters.
  try {
    metadata_int(metadata, "epoch", 0, 1 << 20, path);
    metadata_uint(metadata, "seed", path);
    metadata_double(metadata, "lr", 0, 1e3, path);
    metadata_choice(metadata, "data", {"fashion-mnist", "mnist", "cifar10", "synthetic"}, path);
  } catch (const IoError&) {
  }
  return 0;
}
