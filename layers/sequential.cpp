#include "layers/sequential.h"

#include <string>

#include "layers/activation.h"

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
  const auto& modules = children();
  skipped_.assign(modules.size(), false);
  fused_before_.assign(modules.size(), -1);
  if (!modules.empty()) modules[0].second->set_input_grad(input_grad_);
  Tensor x = input;
  for (size_t i = 0; i < modules.size(); ++i) {
    Module& child = *modules[i].second;
    if (child.can_fuse_relu()) {
      const bool fuse = fusion_ && i + 1 < modules.size() &&
                        dynamic_cast<const ReLU*>(modules[i + 1].second.get()) != nullptr;
      child.fuse_relu(fuse);
      if (fuse) skipped_[i + 1] = true;
    }
    // The layer after a fused ReLU is asked to do the ReLU's backward mask (Module's hand-off).
    Module* fused = i >= 2 && skipped_[i - 1] ? modules[i - 2].second.get() : nullptr;
    child.request_input_grad_mask(fused != nullptr && fused->can_take_masked_grad());
    x = forward_child(child, x);  // a ValueError names the child (module.h)
    if (fused != nullptr) {
      fused->set_output_grad_masked(child.input_grad_masked());
      fused_before_[i] = static_cast<int>(i - 2);
    }
    if (i + 1 < modules.size() && skipped_[i + 1]) ++i;
  }
  return x;
}

Tensor Sequential::backward_one(const Tensor& grad_output) {
  Tensor g = grad_output;
  const auto& modules = children();
  for (size_t i = modules.size(); i-- > 0;) {
    if (skipped_[i]) continue;
    Module& child = *modules[i].second;
    // The bias hand-off (Module): the layer whose backward writes a layer's output gradient may
    // add up that layer's bias gradient on the way: the layer after a fused ReLU for the fused
    // layer, else the layer directly after it (a BatchNorm after a convolution). Both only with
    // fusion on (set_fusion(false) runs each layer's backward whole).
    Module* producer = nullptr;
    if (i < fused_before_.size() && fused_before_[i] >= 0) {
      producer = modules[static_cast<size_t>(fused_before_[i])].second.get();
    } else if (fusion() && i > 0 && !skipped_[i - 1]) {
      producer = modules[i - 1].second.get();
    }
    float* sums = producer != nullptr && detail::bias_handoff()
                      ? producer->output_grad_sums_target()
                      : nullptr;
    child.request_input_grad_sums(sums);
    g = backward_child(child, g);
    if (producer != nullptr)
      producer->set_output_grad_summed(sums != nullptr && child.input_grad_summed());
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
