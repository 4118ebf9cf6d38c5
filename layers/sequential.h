// Sequential: children run in order in forward and in reverse order in backward, each through its
// own checked forward()/backward(). Children are named by their index ("0", "1", ...), as in
// PyTorch, so a torchvision state_dict's "features.10.weight" lands on the eleventh child.
//
// A ReLU that directly follows a child able to apply it (Module::can_fuse_relu: Conv2d,
// BatchNorm2d) runs inside that child: one pass over the data instead of two in each direction.
//
// A ValueError raised by a child names it: "in layer 3 (Conv2d) of a Sequential: Conv2d: ...", and
// through nested containers the whole dotted path ("in layer 0.3 ..."): NOTE [Locating errors in
// children] (layers/module.h).
#pragma once

#include <memory>
#include <vector>

#include "layers/module.h"

namespace cudp {

class Sequential : public Module {
 public:
  Sequential() = default;
  explicit Sequential(const std::vector<std::shared_ptr<Module>>& modules);
  std::string type_name() const override { return "Sequential"; }
  bool takes_bf16() const override { return true; }  // each child decides for itself

  // Appends `module` under the next index and returns it. It must be on the Sequential's device
  // (moves are explicit: build on one device, then move the whole model with to()).
  template <typename M>
  std::shared_ptr<M> add(std::shared_ptr<M> module) {
    add_module(module);
    return module;
  }

  size_t size() const { return children().size(); }
  const std::shared_ptr<Module>& operator[](size_t index) const;

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  void add_module(std::shared_ptr<Module> module);

  // skipped_[i]: child i is a ReLU that the last forward ran inside child i - 1.
  std::vector<bool> skipped_;
  // fused_before_[i]: the index of the fused layer whose ReLU child i read in the last forward (the
  // mask and bias hand-offs, Module), or -1.
  std::vector<int> fused_before_;
};

}  // namespace cudp
