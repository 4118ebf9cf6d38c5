#include "layers/sequential.h"

#include <string>

namespace cudp {

Sequential::Sequential(const std::vector<std::shared_ptr<Module>>& modules) {
  for (const auto& module : modules) {
    add_module(module);
  }
}

void Sequential::add_module(std::shared_ptr<Module> module) {
  CUDP_CHECK(module != nullptr, "Sequential::add: module ", size(), " is null");
  CUDP_CHECK(module->device() == device_, "Sequential::add: module ", size(), " (",
             module->type_name(), ") is on ", module->device(), " but the Sequential is on ",
             device_, "; build the model on one device and move it whole with .to()");
  register_module(std::to_string(size()), std::move(module));
}

const std::shared_ptr<Module>& Sequential::operator[](size_t index) const {
  CUDP_CHECK(index < size(), "Sequential: index ", index, " out of range for ", size(), " modules");
  return children()[index].second;
}

Tensor Sequential::forward_one(const Tensor& input) {
  Tensor x = input;
  for (const auto& [name, child] : children()) {
    x = child->forward(x);
  }
  return x;
}

Tensor Sequential::backward_one(const Tensor& grad_output) {
  Tensor g = grad_output;
  const auto& modules = children();
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) {
    g = it->second->backward(g);
  }
  return g;
}

std::shared_ptr<Module> Sequential::make_empty_copy() const {
  auto copy = std::make_shared<Sequential>();
  for (const auto& [name, child] : children()) {
    copy->add_module(empty_copy_of(*child));
  }
  return copy;
}

}  // namespace cudp
