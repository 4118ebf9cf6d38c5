// Checkpoints: a model, its optimizer and the training position, in safetensors files that PyTorch
// reads (DESIGN.md §5).
//
// A checkpoint at `path` is two files:
//
//   <path>                     the model file: exactly model.state_dict() (PyTorch's names and
//                              layouts, buffers included) and nothing else, so that
//                                m = torchvision.models.vgg16()
//                                m.load_state_dict(safetensors.torch.load_file(path), strict=True)
//                              works. Its __metadata__ (which load_file ignores) holds
//                              "format": "pt" and "cudp.checkpoint_id".
//   <stem>.train.safetensors   the training state (optimizer_state_path(path); <stem> is `path`
//                              without a ".safetensors" suffix): the optimizer's tensors named
//                              "<parameter name>.<state>" ("features.0.weight.momentum_buffer",
//                              "classifier.6.bias.exp_avg", "...step"), and in __metadata__ the
//                              caller's metadata (step, epoch, seed, RNG offset, data position:
//                              any string pairs), the optimizer's type and hyperparameters under
//                              "optimizer.*" ("optimizer.type", "optimizer.lr", "optimizer.steps",
//                              ...) and the same "cudp.checkpoint_id".
//
// The model file cannot hold the optimizer state: a strict torchvision load rejects extra keys. The
// training-state file is always written (the caller's metadata lives there), with no optimizer
// entries when no optimizer is given.
//
// Both files are written atomically (layers/safetensors.h), the training state first. A crash
// between the two leaves the new training state beside the old model; the shared random
// checkpoint id tells load_checkpoint that they do not belong together, and it refuses the pair
// instead of resuming a model with another step's optimizer state.
#pragma once

#include <string>

#include "layers/module.h"
#include "layers/optim.h"
#include "layers/safetensors.h"

namespace cudp {

// `metadata` keys must not start with "cudp." or "optimizer." (reserved). The optimizer's
// parameters must all be parameters of `model` (their names come from the model).
void save_checkpoint(const std::string& path, Module& model, const Optimizer* optimizer,
                     const Metadata& metadata = {});

// Loads the model strictly (every key, no extra: Module::load_state_dict, errors name the tensor)
// and, when `optimizer` is given, its state and lr/steps (the checkpoint must hold state of the
// same optimizer type; errors name the tensor). Returns the caller's metadata as saved. Both files
// are read and checked against each other before anything is loaded; the model is loaded before the
// optimizer, so an error in the optimizer state leaves the model loaded and the optimizer as it
// was.
Metadata load_checkpoint(const std::string& path, Module& model, Optimizer* optimizer = nullptr);

// The training-state file that belongs to a checkpoint at `path`.
std::string optimizer_state_path(const std::string& path);

// Just the model: the model file alone, as PyTorch reads and writes it (e.g. weights exported by
// `safetensors.torch.save_file(model.state_dict(), path)`). Atomic; strict unless told otherwise.
void save_weights(const std::string& path, Module& model, const Metadata& metadata = {});
void load_weights(const std::string& path, Module& model, bool strict = true);

}  // namespace cudp
