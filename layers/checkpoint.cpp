#include "layers/checkpoint.h"

#include <iomanip>
#include <random>
#include <unordered_map>
#include <vector>

namespace cudp {
namespace {

constexpr const char* kIdKey = "cudp.checkpoint_id";
constexpr const char* kOptimizerPrefix = "optimizer.";
constexpr const char* kTypeKey = "optimizer.type";

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// A fresh 128-bit id in hex: the two files of one save share it.
std::string new_checkpoint_id() {
  std::random_device device;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    id += detail::str(std::hex, std::setw(8), std::setfill('0'), device());
  }
  return id;
}

// The model's name of each optimizer parameter, by index. Throws for one the model does not own.
std::vector<std::string> parameter_names(Module& model, const Optimizer& optimizer) {
  std::unordered_map<const Parameter*, std::string> names;
  for (const auto& [name, p] : model.named_parameters()) {
    names.emplace(p, name);
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < optimizer.params().size(); ++i) {
    const auto it = names.find(optimizer.params()[i]);
    CUDP_CHECK(it != names.end(), "checkpoint: parameter ", i, " of the ", optimizer.type_name(),
               " optimizer is not a parameter of the ", model.type_name(), " model");
    out.push_back(it->second);
  }
  return out;
}

}  // namespace

std::string optimizer_state_path(const std::string& path) {
  const std::string suffix = ".safetensors";
  const bool has_suffix = path.size() > suffix.size() &&
                          path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
  return (has_suffix ? path.substr(0, path.size() - suffix.size()) : path) + ".train.safetensors";
}

void save_checkpoint(const std::string& path, Module& model, const Optimizer* optimizer,
                     const Metadata& metadata) {
  for (const auto& [key, value] : metadata) {
    CUDP_CHECK(!starts_with(key, "cudp.") && !starts_with(key, kOptimizerPrefix),
               "save_checkpoint: metadata key '", key,
               "' uses a reserved prefix (\"cudp.\" or \"optimizer.\")");
  }
  const std::string id = new_checkpoint_id();
  Metadata train_metadata = metadata;
  train_metadata[kIdKey] = id;
  TensorMap train_tensors;
  if (optimizer) {
    train_tensors = optimizer->state_dict(parameter_names(model, *optimizer));
    train_metadata[kTypeKey] = optimizer->type_name();
    for (const auto& [key, value] : optimizer->hyperparameters()) {
      train_metadata[kOptimizerPrefix + key] = value;
    }
  }
  save_safetensors(optimizer_state_path(path), train_tensors, train_metadata);
  save_safetensors(path, model.state_dict(), {{"format", "pt"}, {kIdKey, id}});
}

Metadata load_checkpoint(const std::string& path, Module& model, Optimizer* optimizer) {
  const std::string train_path = optimizer_state_path(path);
  const SafetensorsFile model_file = load_safetensors(path);
  const SafetensorsFile train_file = load_safetensors(train_path);

  const auto model_id = model_file.metadata.find(kIdKey);
  const auto train_id = train_file.metadata.find(kIdKey);
  if (model_id == model_file.metadata.end() || train_id == train_file.metadata.end() ||
      model_id->second != train_id->second) {
    CUDP_THROW(IoError, "checkpoint '", path, "': the model file and the training-state file '",
               train_path, "' do not belong to the same save (",
               model_id == model_file.metadata.end() ? "no checkpoint id in the model file"
               : train_id == train_file.metadata.end()
                   ? "no checkpoint id in the training-state file"
                   : "checkpoint ids " + model_id->second + " and " + train_id->second + " differ",
               "); was a save interrupted?");
  }

  // Check that the training state fits the optimizer before loading anything.
  Metadata hyperparameters;
  std::vector<std::string> names;
  if (optimizer) {
    const auto type = train_file.metadata.find(kTypeKey);
    if (type == train_file.metadata.end()) {
      CUDP_THROW(IoError, "checkpoint '", path, "': '", train_path,
                 "' holds no optimizer state, but a ", optimizer->type_name(),
                 " optimizer was given to load it into");
    }
    if (type->second != optimizer->type_name()) {
      CUDP_THROW(IoError, "checkpoint '", path, "': '", train_path, "' holds ", type->second,
                 " state, but the optimizer is ", optimizer->type_name());
    }
    names = parameter_names(model, *optimizer);
    for (const auto& [key, value] : train_file.metadata) {
      if (starts_with(key, kOptimizerPrefix)) {
        hyperparameters[key.substr(std::string(kOptimizerPrefix).size())] = value;
      }
    }
  }

  model.load_state_dict(model_file.tensors, /*strict=*/true);
  if (optimizer) {
    optimizer->load_state_dict(train_file.tensors, names);
    optimizer->load_hyperparameters(hyperparameters);
  }
  Metadata user;
  for (const auto& [key, value] : train_file.metadata) {
    if (!starts_with(key, "cudp.") && !starts_with(key, kOptimizerPrefix)) {
      user.emplace(key, value);
    }
  }
  return user;
}

void save_weights(const std::string& path, Module& model, const Metadata& metadata) {
  Metadata with_format = metadata;
  with_format.emplace("format", "pt");
  save_safetensors(path, model.state_dict(), with_format);
}

void load_weights(const std::string& path, Module& model, bool strict) {
  model.load_state_dict(load_safetensors(path).tensors, strict);
}

}  // namespace cudp
