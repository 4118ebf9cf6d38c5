// Dropout(p): inverted dropout with a counter-based mask (kernels/dropout.h), PyTorch's nn.Dropout.
//
// Training: y = x * keep / (1 - p) with keep a pure function of (seed, offset + element index);
// evaluation (or p == 0): the identity, forward returning its input and backward its gradient.
// Nothing but the (seed, offset) of the last forward is kept for backward, which regenerates the
// mask.
//
// The mask state: the seed comes from the constructor (or set_seed), and each training forward
// advances the offset by its element count rounded up to a multiple of 4 (the kernels' fast path),
// so every step draws a fresh mask and the whole sequence is reproducible from (seed, offset). The
// offset is part of the module's state but not of state_dict() (torchvision's Dropout has no state
// and its checkpoints must load strictly): a checkpoint that resumes exactly saves offset() and
// restores it with set_offset(); clone() copies both.
//
// CUDA graphs: a forward captured into a graph reads (seed, offset) from device memory, and before
// each replay the host advances the offset as an eager forward would and writes it there, so
// replays draw the masks eager steps would, and offset() stays right for checkpoints.
//
// Data parallelism (sync_replica): each replica r >= 1 draws from its own seed, derived from
// replica 0's seed and r, at replica 0's offset, taken before each forward: masks independent
// across devices, as PyTorch's per-device generators give, and reproducible from replica 0's (seed,
// offset). They are not the masks one device would draw for the whole batch; that would need the
// property below with each replica's chunk offset in elements, known only inside the forward:
// element i of a forward at offset o gets the mask of element i + d at offset
// o - d, so replicas that each set offset = (the step's base offset) + (their chunk's first
// element) draw together exactly the mask one device would draw for the whole batch.
#pragma once

#include "layers/module.h"

namespace cudp {

class Dropout : public Module {
 public:
  explicit Dropout(float p = 0.5f, uint64_t seed = 0);
  std::string type_name() const override { return "Dropout"; }
  // PyTorch's "p=0.5, inplace=False". cudp's Dropout always writes a new tensor: inplace=False.
  std::string extra_repr() const override;

  float p() const { return p_; }
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  // A new seed restarts the sequence at offset 0 (or at the offset given).
  void set_seed(uint64_t seed, uint64_t offset = 0) {
    seed_ = seed;
    offset_ = offset;
  }
  void set_offset(uint64_t offset) { offset_ = offset; }
  // Replica r >= 1 draws from its own seed, derived from replica 0's seed and r, at replica 0's
  // offset (see the header comment's last paragraph for why not the one-device masks).
  void sync_replica(const Module& primary, size_t replica, ReplicaSync when) override;
  // Replica r's seed: `seed` mixed with r (splitmix64's finaliser), so that replicas' masks are
  // independent of each other and reproducible from replica 0's seed.
  static uint64_t replica_seed(uint64_t seed, size_t replica);

 protected:
  Tensor forward_one(const Tensor& input) override;
  Tensor backward_one(const Tensor& grad_output) override;
  std::shared_ptr<Module> make_empty_copy() const override;

 private:
  float p_;
  uint64_t seed_;
  uint64_t offset_ = 0;
  // The last forward's mask: whether it dropped at all, and from which (seed, offset).
  bool saved_active_ = false;
  uint64_t saved_seed_ = 0;
  uint64_t saved_offset_ = 0;
  Shape saved_shape_;
  // A captured forward's (seed, offset) slot in device memory, read by its kernels and by the
  // backward's (engine/core/graph.h NOTE [Replay scalars]); null after an eager forward.
  const uint64_t* saved_slot_ = nullptr;
};

}  // namespace cudp
