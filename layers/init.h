// Parameter initialisation as torchvision's VGG does it (`VGG._initialize_weights`), reproducible
// from one seed on any device.
//
//   Conv2d      weight ~ N(0, sqrt(2 / (out * kh * kw)))   kaiming_normal_(mode='fan_out', relu)
//               bias = 0
//   Linear      weight ~ N(0, 0.01), bias = 0
//   BatchNorm2d weight = 1, bias = 0 (and fresh running statistics)
//
// Random values come from Tensor::normal_ (Philox, identical on CPU and GPU). How seeds are
// derived:
//   - a layer constructed with seed s fills its parameter named `p` ("weight") from
//     Philox(seed = derive_seed(s, "p"), offset 0): element i is a pure function of (that seed, i);
//   - reset_parameters(model, S) gives the layer at dotted path q ("features.0") the layer seed
//     derive_seed(S, "q").
// So features.0.weight of a VGG built with seed S equals the weight of a Conv2d of the same shape
// built alone with seed derive_seed(S, "features.0"), and changing one layer of a model leaves the
// values of every other layer unchanged. derive_seed hashes the name (FNV-1a) into the seed and
// mixes the result with splitmix64's finaliser, so nearby seeds and similar names give unrelated
// streams.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/tensor.h"

namespace cudp {

class Module;

namespace init {

// Pass to a layer's constructor to allocate its parameters without initialising them, for a module
// whose values come next from clone(), load_state_dict() or reset_parameters().
struct SkipInit {};
inline constexpr SkipInit skip_init{};

uint64_t derive_seed(uint64_t seed, std::string_view name);

// N(0, sqrt(2 / fan_out)): kaiming_normal_ with mode='fan_out' and nonlinearity='relu'.
void kaiming_normal_fan_out(Tensor& weight, int64_t fan_out, uint64_t seed);

// Re-initialises every Conv2d, Linear and BatchNorm2d in `root` (root included) as described above.
void reset_parameters(Module& root, uint64_t seed);

}  // namespace init
}  // namespace cudp
