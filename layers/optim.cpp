#include "layers/optim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include "engine/core/graph.h"
#include "engine/core/memory.h"
#include "kernels/optim.h"

namespace cudp {
namespace {

// Flat parameters (Module::flatten_parameters): every parameter's data is a view into one buffer,
// in list order, and every gradient sits at the same offset of another buffer. Gaps between
// parameters may only be alignment padding (under 256 bytes), which flatten_parameters zeroes and
// which every update here keeps at zero, so one launch may cover the whole span.
// The bf16 compute copies (layers/module.h, NOTE [The parameter store]) are flat too when every
// parameter has one at its data's offset of a third buffer: then the launch writes them over the
// same span (padding included: zeros). Some parameters with copies and some without (a part of the
// model set to another policy), or copies elsewhere: `compute_mixed`, and step() updates each
// parameter with its own.
struct Flat {
  Device device;
  float* data;
  float* grad;
  int64_t n;                     // the span, padding included
  std::vector<int64_t> offsets;  // of each parameter, in floats
  __nv_bfloat16* compute = nullptr;
  bool compute_mixed = false;
};

constexpr int64_t kMaxPaddingFloats = 256 / sizeof(float);

std::optional<Flat> find_flat(const std::vector<Parameter*>& params) {
  if (params.size() < 2) {
    return std::nullopt;  // nothing to gain
  }
  const Tensor& first = params[0]->data;
  const Tensor& first_grad = params[0]->grad;
  Flat flat{first.device(), first.data<float>(), first_grad.data<float>(), 0, {}};
  int64_t end = 0;
  for (const Parameter* p : params) {
    if (!p->data.shares_storage(first) || !p->grad.shares_storage(first_grad)) {
      return std::nullopt;
    }
    const int64_t offset = p->data.data<float>() - flat.data;
    if (p->grad.data<float>() - flat.grad != offset) {
      return std::nullopt;
    }
    if (offset < end || offset - end >= kMaxPaddingFloats) {
      return std::nullopt;
    }
    flat.offsets.push_back(offset);
    end = offset + p->data.numel();
  }
  flat.n = end;
  const Tensor& first_compute = params[0]->compute;
  size_t copies = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& c = params[i]->compute;
    if (!c.defined()) continue;
    ++copies;
    if (!first_compute.defined() || !c.shares_storage(first_compute) ||
        c.data<__nv_bfloat16>() - first_compute.data<__nv_bfloat16>() != flat.offsets[i]) {
      flat.compute_mixed = true;
    }
  }
  if (copies != 0 && copies != params.size()) flat.compute_mixed = true;
  if (copies == params.size() && !flat.compute_mixed) {
    flat.compute = first_compute.data<__nv_bfloat16>();
  }
  return flat;
}

// Parameter i's compute copy for its own update, or null.
__nv_bfloat16* compute_copy(const Parameter& p) {
  return p.compute.defined() ? p.compute.data<__nv_bfloat16>() : nullptr;
}

// Throws unless parameter i's gradient matches its data (fp32, same shape, same device).
void check_parameter(const Parameter& p, size_t i, const char* op) {
  CUDP_CHECK(p.data.defined() && p.data.dtype() == DType::f32, op, ": parameter ", i,
             " must be a defined f32 tensor, got ", p.data.str());
  CUDP_CHECK(p.grad.defined(), op, ": parameter ", i, " ", p.data.str(), " has no gradient");
  CUDP_CHECK(p.grad.dtype() == DType::f32 && p.grad.shape() == p.data.shape() &&
                 p.grad.device() == p.data.device(),
             op, ": gradient ", p.grad.str(), " of parameter ", i, " does not match its data ",
             p.data.str());
  CUDP_CHECK(!p.compute.defined() ||
                 (p.compute.dtype() == DType::bf16 && p.compute.numel() == p.data.numel() &&
                  p.compute.device() == p.data.device()),
             op, ": the compute copy ", p.compute.str(), " of parameter ", i,
             " does not mirror its data ", p.data.str(), "; flatten_parameters() again");
}

Device common_device(const std::vector<Parameter*>& params, const char* op) {
  const Device device = params[0]->data.device();
  for (size_t i = 0; i < params.size(); ++i) {
    CUDP_CHECK(params[i]->data.device() == device, op, ": parameter ", i, " is on ",
               params[i]->data.device(), " but parameter 0 is on ", device,
               "; all parameters must be on one device");
  }
  return device;
}

}  // namespace

// ---- Optimizer ----------------------------------------------------------------------------------

Optimizer::Optimizer(std::vector<Parameter*> params, double lr)
    : lr_(lr), params_(std::move(params)) {
  CUDP_CHECK(!params_.empty(), "optimizer got an empty parameter list");
  std::set<const Parameter*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    CUDP_CHECK(params_[i] != nullptr, "optimizer: parameter ", i, " is null");
    CUDP_CHECK(seen.insert(params_[i]).second, "optimizer: parameter ", i,
               " appears more than once in the parameter list");
    CUDP_CHECK(params_[i]->data.defined() && params_[i]->data.dtype() == DType::f32,
               "optimizer: parameter ", i, " must be a defined f32 tensor, got ",
               params_[i]->data.str());
  }
  set_lr(lr);
}

Optimizer::~Optimizer() {
  // The parameters outlive their optimizer (it holds their addresses); only one that overlapped
  // touches them here.
  if (overlap_) {
    for (Parameter* p : params_) p->update_beside_backward = false;
  }
}

void Optimizer::set_update_overlap(GradientSegments segments) {
  overlap_ = std::move(segments);
  // Buckets of a backward before now may have been updated in one launch already (a step while
  // the overlap was off): a step() after this must not find them.
  if (overlap_) (void)overlap_();
  for (Parameter* p : params_) p->update_beside_backward = static_cast<bool>(overlap_);
  // The stream and its event are made now where the parameters are on a GPU already, not inside
  // a captured step.
  const Device device = params_[0]->data.device();
  if (overlap_ && device.is_cuda() && overlap_stream_.device() != device.index) {
    overlap_stream_ = cuda::Stream::create(device.index);
    overlap_done_ = cuda::Event::create(device.index);
  }
}

// NOTE [The update beside the backward]
// A flat update is per element (kernels/optim.h), so it may run as several launches over pieces of
// the flat buffers with the same bits. A gradient reducer completes its buckets in reverse
// parameter order while the backward still runs: the buckets holding the last layers' weights
// (most of VGG's) are final before the first layers' backward has started. step() is issued on
// the host after the whole backward, but the device is behind it (and a captured step has only
// the dependencies it was given), so each bucket's update, on the optimizer's own stream after
// that bucket's event, runs beside the rest of the backward; the current stream then waits for
// the last of them, so what follows the step sees every update. Nothing the backward still does
// reads what the updates write: a layer's backward reads its own weights (and their bf16 copies)
// only, and has run before its bucket completes; the next forward comes after the wait.
//
// Each piece starts where a parameter starts and covers whole parameters (the padding after them
// included), so `first` and `count` name its parameters, and the per-parameter counts (AdamW's
// step, SGD's first step) advance piece by piece as they do in one launch. Every piece reads the
// same scalars; a captured step keeps its pieces, and staging a replay walks them again in the same
// order, one scalar slot each. Not overlapped, with the same results: a gated step (its flag comes
// after the whole backward), parameters that are not flat, a gradient still pending (its zeroing
// goes to the current stream after the backward), a step that creates the state (allocated and
// zeroed on the current stream after the backward: the first step, or SGD's first with momentum),
// and a step with no pieces from the source (each backward's pieces are given to one step()).
std::vector<Optimizer::Piece> Optimizer::plan_pieces(const std::vector<int64_t>& offsets, int64_t n,
                                                     const float* grad, Device device) const {
  const std::vector<GradientSegment> segments = overlap_();
  std::vector<Piece> pieces;
  for (size_t s = 0; s < segments.size(); ++s) {
    const GradientSegment& g = segments[s];
    CUDP_CHECK(g.buffer == grad, type_name(), ": gradient segment ", s,
               " lies in another buffer than these parameters' gradients; give the optimizer the "
               "segments of the reducer over its own parameters");
    CUDP_CHECK(g.ready != nullptr || !device.is_cuda(), type_name(), ": gradient segment ", s,
               " has no event on ", device, ", so its update could not wait for its gradients");
    const auto it = std::lower_bound(offsets.begin(), offsets.end(), g.begin);
    CUDP_CHECK(g.end > g.begin && it != offsets.end() && *it == g.begin, type_name(),
               ": gradient segment ", s, " [", g.begin, ", ", g.end,
               ") does not start where a parameter starts");
    Piece piece;
    piece.begin = g.begin;
    piece.n = std::min(g.end, n) - g.begin;
    piece.first = static_cast<size_t>(it - offsets.begin());
    piece.count =
        static_cast<size_t>(std::lower_bound(it, offsets.end(), g.end) - offsets.begin()) -
        piece.first;
    piece.ready = g.ready;
    pieces.push_back(piece);
  }
  // Together they cover the buffer once.
  std::vector<Piece> sorted = pieces;
  std::sort(sorted.begin(), sorted.end(),
            [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  int64_t covered = 0;
  for (const Piece& piece : sorted) {
    CUDP_CHECK(piece.begin == covered, type_name(), ": the gradient segments ",
               piece.begin < covered ? "overlap" : "leave a gap", " at element ",
               std::min(piece.begin, covered), "; they must cover the flat buffer once");
    covered = piece.begin + piece.n;
  }
  CUDP_CHECK(pieces.empty() || covered == n, type_name(), ": the gradient segments cover ", covered,
             " of the flat buffer's ", n, " elements; they must cover all of it");
  return pieces;
}

void Optimizer::set_lr(double lr) {
  CUDP_CHECK(lr >= 0, "Invalid learning rate: ", lr);
  lr_ = lr;
}

void Optimizer::zero_grad(ZeroGrad how) {
  for (Parameter* p : params_) {
    p->grad_zero_pending =
        how == ZeroGrad::deferred && p->backward_writes_grad && p->grad.defined();
  }
  const std::optional<Flat> flat = find_flat(params_);
  zero_grads_not_pending(params_, flat ? flat->grad : nullptr, flat ? flat->n : 0);
}

void Optimizer::check_gradients() const {
  for (size_t i = 0; i < params_.size(); ++i) {
    check_parameter(*params_[i], i, "optimizer step");
  }
}

void Optimizer::allocate_state() {
  const std::vector<std::string> names = state_names();
  if (names.empty() || !state_.empty()) {
    return;
  }
  std::string list;
  for (const std::string& name : names) list += (list.empty() ? "" : " and ") + name;
  const cuda::AllocationPurpose purpose(
      detail::str(type_name(), "'s ", list, " (", names.size(), " fp32 cop",
                  names.size() == 1 ? "y" : "ies", " of the parameters)"),
      "The optimizer keeps its state beside the model on every GPU (SGD with momentum: one fp32 "
      "copy of the parameters, AdamW: two): use a smaller model, SGD without momentum, or GPUs "
      "with more free memory.");
  // Built aside and kept only when all of it was allocated: an allocation that fails (out of
  // memory) leaves the optimizer without state, so that a later step tries again.
  std::vector<std::vector<Tensor>> state(names.size(), std::vector<Tensor>(params_.size()));
  if (const std::optional<Flat> flat = find_flat(params_)) {
    // The state mirrors the parameters' layout, so one launch covers parameters and state alike.
    std::vector<Tensor> flat_state;
    for (size_t k = 0; k < names.size(); ++k) {
      flat_state.push_back(Tensor::zeros({flat->n}, DType::f32, flat->device));
      for (size_t i = 0; i < params_.size(); ++i) {
        const Tensor& data = params_[i]->data;
        state[k][i] = flat_state[k]
                          .slice(flat->offsets[i], flat->offsets[i] + data.numel())
                          .view(data.shape());
      }
    }
    flat_offsets_ = flat->offsets;
    flat_state_ = std::move(flat_state);
  } else {
    for (size_t k = 0; k < names.size(); ++k) {
      for (size_t i = 0; i < params_.size(); ++i) {
        const Tensor& data = params_[i]->data;
        state[k][i] = Tensor::zeros(data.shape(), DType::f32, data.device());
      }
    }
  }
  state_ = std::move(state);
}

void Optimizer::step() { take_step(nullptr); }

void Optimizer::step(const Tensor& skip) {
  CUDP_CHECK(skip.defined() && skip.dtype() == DType::i32 && skip.numel() == 1, type_name(),
             ".step(skip): the skip flag must be one i32 element (nonfinite_flag makes it), got ",
             skip.defined() ? skip.str() : std::string("an undefined tensor"));
  for (size_t i = 0; i < params_.size(); ++i) {
    CUDP_CHECK(params_[i]->data.device() == skip.device(), type_name(),
               ".step(skip): parameter ", i, " is on ", params_[i]->data.device(),
               " but the skip flag is on ", skip.device(),
               "; make the flag where the parameters are (parallel::Replicated copies it to "
               "every replica)");
  }
  take_step(&skip);
}

int64_t Optimizer::steps() const {
  fold_skips();
  return steps_;
}

int64_t Optimizer::skipped_steps() const {
  fold_skips();
  return folded_[0];
}

void Optimizer::fold_skips() const {
  if (!gated_since_fold_ && advancing_since_fold_ == 0) return;
  // Never a const object here: only step() and step(skip), which are not const, leave anything to
  // fold.
  auto& self = const_cast<Optimizer&>(*this);
  int64_t skipped = 0, skipped_advancing = 0;
  if (gated_since_fold_) {
    const std::vector<int64_t> counts = skip_counts_.to_vector<int64_t>();  // waits for the steps
    skipped = counts[0] - folded_[0];
    skipped_advancing = counts[1] - folded_[1];
    self.folded_[0] = counts[0];
    self.folded_[1] = counts[1];
    self.gated_since_fold_ = false;
  }
  self.steps_ -= skipped;
  self.fold_counts(advancing_since_fold_, skipped_advancing);
  self.advancing_since_fold_ = 0;
}

Tensor Optimizer::step_and_grad_norm() {
  if (params_.empty()) {
    step();
    return grad_norm(params_);
  }
  // grad_norm's requirement, checked before anything changes (the fallback takes it after).
  const Device device = common_device(params_, "step_and_grad_norm");
  Tensor norm;
  {
    const cuda::AllocationPurpose purpose("the gradients' norm");
    norm = Tensor::empty({}, DType::f32, device);
  }
  take_step(nullptr, Issue::Launch, norm.data<float>());
  return last_norm_fused_ ? norm : grad_norm(params_);
}

void Optimizer::take_step(const Tensor* skip, Issue issue, float* grad_norm) {
  const bool stage = issue == Issue::Stage;
  check_gradients();
  const bool any_pending = std::any_of(params_.begin(), params_.end(),
                                       [](const Parameter* p) { return p->grad_zero_pending; });
  // A parameter no backward wrote since a deferred zero_grad. Not when staging a replay: the
  // graph holds what its capture issued, and the host's flags describe the captured step's end.
  if (!stage) zero_pending_grads(params_);
  // Without unread gated steps, folding is bookkeeping on the host; with them it would wait for the
  // device, so the counts stay issued and the kernels correct them.
  if (!gated_since_fold_) fold_skips();
  const bool gated = stage ? captured_gated_ : skip != nullptr;
  if (gated && !skip_counts_.defined()) {
    CUDP_CHECK(!stage, type_name(), ": the captured step was gated but the optimizer has no "
                                    "count of skipped steps; capture the step again");
    const cuda::AllocationPurpose purpose(type_name() + "'s count of skipped steps");
    skip_counts_ = Tensor::zeros({2}, DType::i64, skip->device());
  }
  if (stage) {
    CUDP_CHECK(state_names().empty() || !state_.empty(), type_name(),
               ": the optimizer's state was created after the step was captured; capture again");
  }
  // State made now is allocated and zeroed on the current stream after the whole backward: a step
  // that makes it does not overlap (NOTE [The update beside the backward]).
  const bool fresh_state = state_.empty() && !state_names().empty();
  allocate_state();
  kernels::StepGate gate;
  if (skip_counts_.defined()) {
    // Kernels after a gated step (gated or not) correct the issued counts by unread skips.
    gate.skipped = skip_counts_.data<int64_t>() + 1;
    gate.folded = folded_[1];
  }
  if (skip != nullptr) gate.skip = skip->data<int32_t>();
  const bool advances = advances_state();
  const std::optional<Flat> flat = find_flat(params_);
  // One launch needs the parameters flat now, the state created flat in the same layout, and
  // agreeing bookkeeping.
  const bool together = flat && !flat->compute_mixed &&
                        (state_.empty() || flat->offsets == flat_offsets_) && uniform_state();
  // Captured into a graph when a capture is open on the parameters' device (engine/core/graph.h
  // NOTE [Replay scalars]): each update reads its scalars from a slot, and before every replay
  // Issue::Stage writes the replay's own into the same slots, in the same order.
  const Device device = flat ? flat->device : params_[0]->data.device();
  cuda::ReplayScalars* replay =
      !stage && device.is_cuda() ? cuda::ReplayScalars::active(device.index) : nullptr;
  if (replay != nullptr) captured_slots_.clear();
  size_t staged = 0;
  const auto issue_update = [&](Update u) {
    if (stage) {
      CUDP_CHECK(staged < captured_slots_.size(), type_name(),
                 ": the parameters changed since the step was captured (more updates than the "
                 "capture's ", captured_slots_.size(), "); capture the step again");
      u.stage = captured_slots_[staged++];
      update(u);  // fills the slot, launches nothing
      return;
    }
    if (replay != nullptr) {
      const cuda::ReplayScalars::Slot slot = replay->slot(u.device.index, scalar_bytes());
      u.device_scalars = slot.device;
      u.stage = slot.host;
      captured_slots_.push_back(slot.host);
    }
    if (u.stream != nullptr) {  // a piece beside the backward, on the optimizer's stream
      const cuda::DeviceGuard guard(u.device.index);
      update(u);
    } else {
      dispatch(u);
    }
  };
  // NOTE [The update beside the backward]
  std::vector<Piece> pieces;
  if (together && stage) {
    pieces = captured_pieces_;
  } else if (together && overlap_ && !gated && !any_pending && !fresh_state) {
    pieces = plan_pieces(flat->offsets, flat->n, flat->grad, flat->device);
  } else if (overlap_ && !stage) {
    // This step's one update uses up the backward's buckets: a second step() after it must not
    // find them, or its pieces would wait on events from before this update.
    (void)overlap_();
  }
  if (replay != nullptr) captured_pieces_ = pieces;
  if (!pieces.empty()) {
    cudaStream_t stream = nullptr;
    if (!stage && device.is_cuda()) {
      const cuda::DeviceGuard guard(device.index);
      if (overlap_stream_.device() != device.index) {  // the parameters moved since
        overlap_stream_ = cuda::Stream::create(device.index);
        overlap_done_ = cuda::Event::create(device.index);
      }
      stream = overlap_stream_.get();
    }
    for (const Piece& piece : pieces) {
      if (stream != nullptr && piece.ready != nullptr) {
        CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, piece.ready, 0));
      }
      std::vector<float*> state;
      for (Tensor& t : flat_state_) state.push_back(t.data<float>() + piece.begin);
      Update u{device,
               stream,
               flat->data + piece.begin,
               flat->grad + piece.begin,
               state,
               piece.n,
               piece.first,
               piece.count,
               gate};
      u.compute = flat->compute != nullptr ? flat->compute + piece.begin : nullptr;
      issue_update(u);
    }
    if (stream != nullptr) {
      // What follows the step on the current stream sees every piece's update.
      const cuda::DeviceGuard guard(device.index);
      overlap_done_.record(stream);
      CUDP_CUDA_CHECK(
          cudaStreamWaitEvent(cuda::current_stream(device.index), overlap_done_.get(), 0));
    }
  } else if (together) {
    std::vector<float*> state;
    for (Tensor& t : flat_state_) {
      state.push_back(t.data<float>());
    }
    Update u{flat->device, nullptr, flat->data,     flat->grad, state,
             flat->n,      0,       params_.size(), gate};
    u.compute = flat->compute;
    u.grad_norm = grad_norm;
    issue_update(u);
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      const Parameter& p = *params_[i];
      std::vector<float*> state;
      for (auto& per_param : state_) {
        state.push_back(per_param[i].data<float>());
      }
      Update u{p.data.device(),
               nullptr,
               p.data.data<float>(),
               p.grad.data<float>(),
               state,
               p.data.numel(),
               i,
               1,
               gate};
      u.compute = compute_copy(p);
      issue_update(u);
    }
  }
  CUDP_CHECK(!stage || staged == captured_slots_.size(), type_name(),
             ": the parameters changed since the step was captured (", staged,
             " updates, the capture had ", captured_slots_.size(), "); capture the step again");
  if (skip != nullptr && !stage) {
    // After every update of the step has read the counts.
    int64_t* counts = skip_counts_.data<int64_t>();
    on_device(
        skip->device(), [&] { kernels::count_skipped_step_cpu(gate.skip, counts, advances); },
        [&](cudaStream_t stream) {
          kernels::count_skipped_step(gate.skip, counts, advances, stream);
        });
  }
  if (gated) gated_since_fold_ = true;
  last_step_flat_ = together;
  last_step_overlapped_ = !pieces.empty();
  // A replay's staging leaves it as the capture set it: the graph holds the captured step's launch.
  if (!stage) last_norm_fused_ = grad_norm != nullptr && together && pieces.empty();
  ++steps_;
  if (advances) ++advancing_since_fold_;
  if (replay != nullptr) {
    captured_gated_ = gated;
    replay->on_replay([this] { take_step(nullptr, Issue::Stage); });
  }
}

void Optimizer::dispatch(Update u) {
  on_device(
      u.device, [&] { update(u); },
      [&](cudaStream_t stream) {
        u.stream = stream;
        update(u);
      });
}

std::string Optimizer::key_prefix(size_t i, const std::vector<std::string>& param_names) const {
  if (param_names.empty()) {
    return std::to_string(i) + ".";
  }
  CUDP_CHECK(param_names.size() == params_.size(), type_name(), ": ", param_names.size(),
             " parameter names given for ", params_.size(), " parameters");
  return param_names[i] + ".";
}

TensorMap Optimizer::state_dict(const std::vector<std::string>& param_names) const {
  // Host snapshots that never alias the live state, each copied to the host directly.
  return collect_state(param_names,
                       [](const Tensor& t) { return t.is_cpu() ? t.clone() : t.cpu(); });
}

TensorMap Optimizer::state_copy(const std::vector<std::string>& param_names) const {
  return collect_state(param_names, [](const Tensor& t) { return t.clone_async(); });
}

TensorMap Optimizer::collect_state(const std::vector<std::string>& param_names,
                                   const std::function<Tensor(const Tensor&)>& copy) const {
  fold_skips();
  TensorMap out;
  const std::vector<std::string> names = state_names();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!has_state(i)) {
      continue;
    }
    const std::string prefix = key_prefix(i, param_names);
    for (size_t k = 0; k < state_.size() && k < names.size(); ++k) {
      out[prefix + names[k]] = copy(state_[k][i]);
    }
    for (const std::string& name : scalar_state_names()) {
      out[prefix + name] = export_scalar_state(i, name);
    }
  }
  return out;
}

void Optimizer::load_state_dict(const TensorMap& state,
                                const std::vector<std::string>& param_names) {
  fold_skips();  // the counts replaced below must not be corrected by skips before them
  const std::vector<std::string> names = state_names();
  const std::vector<std::string> scalars = scalar_state_names();
  std::map<std::string, size_t> index;  // "<i or name>." -> i
  for (size_t i = 0; i < params_.size(); ++i) {
    index.emplace(key_prefix(i, param_names), i);
  }

  // Validate everything first: which parameters have state, and that each tensor fits.
  std::vector<size_t> found(params_.size(), 0);
  for (const auto& [key, t] : state) {
    const size_t dot = key.rfind('.');  // state names have no dots; parameter names may
    const auto it = dot == std::string::npos ? index.end() : index.find(key.substr(0, dot + 1));
    CUDP_CHECK(it != index.end(), type_name(), ".load_state_dict: key '", key,
               "' does not name a parameter of this optimizer (keys are '<",
               param_names.empty() ? "parameter index" : "parameter name", ">.<state name>')");
    const size_t i = it->second;
    const std::string name = key.substr(dot + 1);
    const bool is_tensor = std::find(names.begin(), names.end(), name) != names.end();
    const bool is_scalar = std::find(scalars.begin(), scalars.end(), name) != scalars.end();
    CUDP_CHECK(is_tensor || is_scalar, type_name(), ".load_state_dict: key '", key,
               "': unknown state '", name, "' for ", type_name(),
               names.empty() && scalars.empty() ? " with these options (it keeps no state)" : "");
    CUDP_CHECK(t.defined() && t.dtype() == DType::f32, type_name(), ".load_state_dict: key '", key,
               "' must be an f32 tensor, got ", t.str());
    if (is_tensor) {
      CUDP_CHECK(t.shape() == params_[i]->data.shape(), type_name(), ".load_state_dict: key '", key,
                 "' has shape ", shape_str(t.shape()), " but its parameter has shape ",
                 shape_str(params_[i]->data.shape()));
    } else {  // a step count
      CUDP_CHECK(t.numel() == 1, type_name(), ".load_state_dict: key '", key,
                 "' must hold one value, got ", t.str());
      const float count = t.to_vector<float>()[0];
      CUDP_CHECK(count >= 1 && count == std::floor(count), type_name(), ".load_state_dict: key '",
                 key, "' must be a whole number >= 1, got ", count);
    }
    ++found[i];
  }
  const size_t per_param = names.size() + scalars.size();
  for (size_t i = 0; i < params_.size(); ++i) {
    CUDP_CHECK(found[i] == 0 || found[i] == per_param, type_name(), ".load_state_dict: parameter '",
               key_prefix(i, param_names), "..' has ", found[i], " of its ", per_param,
               " state entries; a parameter has all of them or none");
  }
  allocate_state();
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string prefix = key_prefix(i, param_names);
    for (size_t k = 0; k < names.size(); ++k) {
      if (found[i]) {
        state_[k][i].copy_from(state.at(prefix + names[k]));
      } else {
        state_[k][i].zero_();
      }
    }
    import_state(i, found[i] > 0, state, prefix);
  }
}

namespace {

// The number written under `key` by hyperparameters(), parsed whole (std::stod / std::stoll).
template <typename T, typename Parse>
T parse_entry(const Metadata& entries, const std::string& key, const std::string& owner,
              Parse parse) {
  const auto it = entries.find(key);
  CUDP_CHECK(it != entries.end(), owner, ": hyperparameters lack \"", key, "\"");
  size_t used = 0;
  T value{};
  try {
    value = parse(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  CUDP_CHECK(used > 0 && used == it->second.size(), owner, ": hyperparameter \"", key,
             "\" is not a number: '", it->second, "'");
  return value;
}

}  // namespace

void Optimizer::load_hyperparameters(const Metadata& hyperparameters) {
  const double lr =
      parse_entry<double>(hyperparameters, "lr", type_name(),
                          [](const std::string& s, size_t* used) { return std::stod(s, used); });
  const auto steps = parse_entry<int64_t>(
      hyperparameters, "steps", type_name(),
      [](const std::string& s, size_t* used) { return static_cast<int64_t>(std::stoll(s, used)); });
  // std::stod takes "inf" and "nan": a learning rate read from a file must be a usable one.
  CUDP_CHECK(std::isfinite(lr) && lr >= 0, type_name(), ": hyperparameter \"lr\" is '",
             hyperparameters.at("lr"), "', not a finite number >= 0");
  CUDP_CHECK(steps >= 0, type_name(), ": hyperparameter \"steps\" is negative: ", steps);
  fold_skips();  // skips before this must not be taken out of the restored count
  set_lr(lr);
  steps_ = steps;
}

std::string Optimizer::exact(double value) {
  std::ostringstream out;
  out << std::setprecision(std::numeric_limits<double>::max_digits10) << value;
  return out.str();
}

// ---- SGD ----------------------------------------------------------------------------------------

SGD::SGD(std::vector<Parameter*> params, const SGDOptions& options)
    : Optimizer(std::move(params), options.lr), options_(options), started_(this->params().size()) {
  kernels::detail::sgd_coefficients(0, options.lr, options.momentum, options.dampening,
                                    options.weight_decay, options.nesterov, false, "SGD");
}

void SGD::set_momentum(double momentum) {
  kernels::detail::sgd_coefficients(0, lr_, momentum, options_.dampening, options_.weight_decay,
                                    options_.nesterov, false, "SGD::set_momentum");
  options_.momentum = momentum;
}

std::vector<std::string> SGD::state_names() const {
  if (options_.momentum == 0 && advancing_steps_unfolded() == 0 &&
      std::none_of(started_.begin(), started_.end(), [](bool b) { return b; })) {
    return {};
  }
  return {"momentum_buffer"};
}

bool SGD::uniform_state() const {
  return std::all_of(started_.begin(), started_.end(), [&](bool b) { return b == started_[0]; });
}

void SGD::update(const Update& u) {
  float* buffer = u.state.empty() ? nullptr : u.state[0];
  // Updates of this buffer issued before this one (a buffer with history counts as one at least).
  const int64_t issued = advancing_steps_unfolded() + (started_[u.first] ? 1 : 0);
  if (u.device.is_cpu()) {
    kernels::sgd_step_cpu(u.param, u.grad, buffer, u.n, lr_, options_.momentum, options_.dampening,
                          options_.weight_decay, options_.nesterov, issued, u.gate, u.compute,
                          u.grad_norm);
    return;
  }
  if (u.stage == nullptr) {
    kernels::sgd_step(u.param, u.grad, buffer, u.n, lr_, options_.momentum, options_.dampening,
                      options_.weight_decay, options_.nesterov, issued, u.gate, u.stream, u.compute,
                      u.grad_norm);
    return;
  }
  const kernels::SgdScalars scalars =
      kernels::sgd_scalars(u.n, lr_, options_.momentum, options_.dampening, options_.weight_decay,
                           options_.nesterov, issued, u.gate.folded);
  CUDP_CHECK(scalars.k.momentum == 0.f || buffer != nullptr,
             "SGD: momentum ", options_.momentum, " needs a momentum buffer, and the captured "
             "step had none (momentum was 0 when it was captured); capture the step again");
  std::memcpy(u.stage, &scalars, sizeof scalars);
  if (u.device_scalars != nullptr) {
    kernels::sgd_step_captured(u.param, u.grad, buffer, u.n, scalars,
                               static_cast<const kernels::SgdScalars*>(u.device_scalars), u.gate,
                               u.stream, u.compute, u.grad_norm);
  }
}

void SGD::fold_counts(int64_t issued, int64_t skipped) {
  if (issued - skipped > 0) started_.assign(started_.size(), true);  // every buffer took an update
}

void SGD::import_state(size_t i, bool present, const TensorMap&, const std::string&) {
  started_[i] = present;
}

Metadata SGD::hyperparameters() const {
  return {{"lr", exact(lr_)},
          {"momentum", exact(options_.momentum)},
          {"dampening", exact(options_.dampening)},
          {"weight_decay", exact(options_.weight_decay)},
          {"nesterov", options_.nesterov ? "true" : "false"},
          {"steps", std::to_string(steps())}};
}

// ---- AdamW --------------------------------------------------------------------------------------

AdamW::AdamW(std::vector<Parameter*> params, const AdamWOptions& options)
    : Optimizer(std::move(params), options.lr), options_(options), step_(this->params().size(), 0) {
  kernels::detail::adamw_coefficients(0, options.lr, options.beta1, options.beta2, options.eps,
                                      options.weight_decay, 1, "AdamW");
}

void AdamW::set_momentum(double beta1) {
  kernels::detail::adamw_coefficients(0, lr_, beta1, options_.beta2, options_.eps,
                                      options_.weight_decay, 1, "AdamW::set_momentum");
  options_.beta1 = beta1;
}

bool AdamW::uniform_state() const {
  return std::all_of(step_.begin(), step_.end(), [&](int64_t s) { return s == step_[0]; });
}

void AdamW::update(const Update& u) {
  const int64_t step = step_[u.first] + 1;
  if (u.device.is_cpu()) {
    kernels::adamw_step_cpu(u.param, u.grad, u.state[0], u.state[1], u.n, lr_, options_.beta1,
                            options_.beta2, options_.eps, options_.weight_decay, step, u.gate,
                            u.compute, u.grad_norm);
  } else if (u.stage == nullptr) {
    kernels::adamw_step(u.param, u.grad, u.state[0], u.state[1], u.n, lr_, options_.beta1,
                        options_.beta2, options_.eps, options_.weight_decay, step, u.gate, u.stream,
                        u.compute, u.grad_norm);
  } else {
    const kernels::AdamWScalars scalars =
        kernels::adamw_scalars(u.n, lr_, options_.beta1, options_.beta2, options_.eps,
                               options_.weight_decay, step, u.gate.folded);
    std::memcpy(u.stage, &scalars, sizeof scalars);
    if (u.device_scalars != nullptr) {
      kernels::adamw_step_captured(u.param, u.grad, u.state[0], u.state[1], u.n,
                                   static_cast<const kernels::AdamWScalars*>(u.device_scalars),
                                   u.gate, u.stream, u.compute, u.grad_norm);
    }
  }
  for (size_t i = u.first; i < u.first + u.count; ++i) {
    step_[i] = step;
  }
}

void AdamW::fold_counts(int64_t, int64_t skipped) {
  for (int64_t& s : step_) s -= skipped;
}

Tensor AdamW::export_scalar_state(size_t i, const std::string&) const {
  // PyTorch keeps the step as a 0-d float32 tensor.
  return Tensor::from_vector<float>({static_cast<float>(step_[i])}, {});
}

void AdamW::import_state(size_t i, bool present, const TensorMap& state,
                         const std::string& prefix) {
  if (!present) {
    step_[i] = 0;
    return;
  }
  // load_state_dict checked that it is a whole number >= 1.
  step_[i] = static_cast<int64_t>(state.at(prefix + "step").to_vector<float>()[0]);
}

Metadata AdamW::hyperparameters() const {
  return {{"lr", exact(lr_)},
          {"beta1", exact(options_.beta1)},
          {"beta2", exact(options_.beta2)},
          {"eps", exact(options_.eps)},
          {"weight_decay", exact(options_.weight_decay)},
          {"steps", std::to_string(steps())}};
}

// ---- the skip flag ------------------------------------------------------------------------------

Tensor nonfinite_flag(const Tensor& loss, const Tensor& norm) {
  const auto check = [](const Tensor& t, const char* what) {
    CUDP_CHECK(t.defined() && t.dtype() == DType::f32 && t.numel() == 1, "nonfinite_flag: the ",
               what, " must be one f32 element, got ",
               t.defined() ? t.str() : std::string("an undefined tensor"));
  };
  check(loss, "loss");
  if (norm.defined()) {
    check(norm, "gradient norm");
    CUDP_CHECK(norm.device() == loss.device(), "nonfinite_flag: the loss is on ", loss.device(),
               " but the gradient norm is on ", norm.device(), "; compute both on one device");
  }
  const cuda::AllocationPurpose purpose("the step's skip flag");
  Tensor flag = Tensor::empty({1}, DType::i32, loss.device());
  const float* n = norm.defined() ? norm.data<float>() : nullptr;
  const float* l = loss.data<float>();
  int32_t* f = flag.data<int32_t>();
  on_device(
      loss.device(), [&] { kernels::nonfinite_flag_cpu(l, n, f); },
      [&](cudaStream_t stream) { kernels::nonfinite_flag(l, n, f, stream); });
  return flag;
}

// ---- clipping -----------------------------------------------------------------------------------

namespace {

// The gradients' 2-norm into a 0-d tensor (see clip_grad_norm) and, when `max_norm` is given,
// the clipping: every gradient scaled by min(1, max_norm / (norm + 1e-6)).
Tensor gradient_norm(const std::vector<Parameter*>& params, std::optional<float> max_norm,
                     const char* what) {
  if (params.empty()) {
    return Tensor::zeros({});
  }
  for (size_t i = 0; i < params.size(); ++i) {
    check_parameter(*params[i], i, what);
  }
  const Device device = common_device(params, what);
  if (max_norm) {
    for (size_t i = 0; i < params.size(); ++i) {
      CUDP_CHECK(!params[i]->update_beside_backward, what, ": parameter ", i,
                 "'s optimizer updates it beside the backward (set_update_overlap), where an "
                 "update may read its gradient before a clip could scale it; turn that overlap "
                 "off to clip gradients");
    }
  }
  zero_pending_grads(params);  // NOTE [Deferred zeroing] (layers/module.h)
  const cuda::AllocationPurpose purpose("the gradients' norm");
  Tensor total = Tensor::empty({}, DType::f32, device);
  float* norm = total.data<float>();
  const auto count = static_cast<int64_t>(params.size());
  // Flat parameters: one norm over the flat span (its padding is zero). Either way each parameter
  // is scaled, never the span: a non-finite norm makes the factor NaN, and NaN times the padding's
  // zeros would leave NaN in the padding, in every later norm over the span, for good.
  const std::optional<Flat> flat = find_flat(params);
  Tensor norms;
  float* each = nullptr;
  if (!flat) {  // PyTorch's way: the norm of the per-parameter norms
    norms = Tensor::empty({count}, DType::f32, device);
    each = norms.data<float>();
  }
  on_device(
      device,
      [&] {
        if (flat) {
          kernels::global_norm_cpu(flat->grad, flat->n, norm);
        } else {
          for (int64_t i = 0; i < count; ++i) {
            kernels::global_norm_cpu(params[i]->grad.data<float>(), params[i]->grad.numel(),
                                     each + i);
          }
          kernels::global_norm_cpu(each, count, norm);
        }
        if (!max_norm) return;
        for (Parameter* p : params) {
          kernels::scale_by_clip_coefficient_cpu(p->grad.data<float>(), p->grad.numel(), norm,
                                                 *max_norm);
        }
      },
      [&](cudaStream_t stream) {
        if (flat) {
          kernels::global_norm(flat->grad, flat->n, norm, stream);
        } else {
          for (int64_t i = 0; i < count; ++i) {
            kernels::global_norm(params[i]->grad.data<float>(), params[i]->grad.numel(), each + i,
                                 stream);
          }
          kernels::global_norm(each, count, norm, stream);
        }
        if (!max_norm) return;
        for (Parameter* p : params) {
          kernels::scale_by_clip_coefficient(p->grad.data<float>(), p->grad.numel(), norm,
                                             *max_norm, stream);
        }
      });
  return total;
}

}  // namespace

Tensor clip_grad_norm(const std::vector<Parameter*>& params, double max_norm) {
  return gradient_norm(params, static_cast<float>(max_norm), "clip_grad_norm");
}

Tensor grad_norm(const std::vector<Parameter*>& params) {
  return gradient_norm(params, std::nullopt, "grad_norm");
}

}  // namespace cudp
