// ReLU: y = max(x, 0), elementwise on any shape.
//
// The backward needs only the sign of the *output* (kernels/elementwise.h), so ReLU keeps y, not x.
// That makes ReLU(inplace = true) safe, as torchvision's VGG uses it: the forward overwrites its
// input with the output (saving an activation per layer), and the backward writes the input
// gradient over the output gradient it was given. With inplace = false (the default) both are fresh
// tensors and the caller's tensors are left alone.
#pragma once

#include "layers/module.h"

namespace cudp {

class ReLU : public Module {
 public:
  explicit ReLU(bool inplace = false) : inplace_(inplace) {}
  std::string type_name() const override { return "ReLU"; }
  std::string extra_repr() const override;  // "inplace=True", or nothing: "ReLU()"
  bool takes_bf16() const override { return true; }
  bool inplace() const { return inplace_; }

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  void release_saved() override { output_ = Tensor(); }
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  bool inplace_;
  Tensor output_;  // saved for backward
};

}  // namespace cudp
