// Module's shared machinery: the checked forward/backward wrappers, the recursive walks over
// parameters, buffers and children, state_dict in PyTorch's layout, device moves, cloning and
// parameter flattening. Layers implement only their maths (forward_one/backward_one) and their
// make_empty_copy; everything that must behave the same for every layer lives here, once.
//
// Conventions this file fixes for all layers:
//   - Gradients are allocated (zeros) with the data, on the same device, and accumulate until
//     zero_grad(); a Parameter's address never changes (module.h), its tensors may (to(), flatten).
//   - state_dict() returns a snapshot: fresh CPU tensors that never alias the live parameters, so a
//     checkpoint can be written while training goes on.
//   - load_state_dict() validates every key before it copies anything: a failed load leaves the
//     module unchanged, and its error lists every problem, not just the first.
#include "layers/module.h"

#include "engine/core/memory.h"
#include "engine/core/nvtx.h"
#include "kernels/bias.h"
#include "kernels/elementwise.h"
#include "kernels/layout.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <typeinfo>

namespace cudp {

struct Module::Entry {
  std::string name;   // dotted PyTorch name
  Module* owner;      // the module that registered it (for export/import hooks)
  std::string local;  // its name inside the owner
  Tensor* tensor;     // a parameter's data or a buffer
};

// ---- forward and backward -----------------------------------------------------------------------

void Module::check_inputs(const TensorList& tensors, const char* what, bool allow_undefined) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string label = tensors.size() == 1 ? std::string(what) : detail::str(what, " ", i);
    const Tensor& t = tensors[i];
    if (!t.defined()) {
      CUDP_CHECK(allow_undefined, type_name(), ": ", label, " is undefined");
      continue;
    }
    CUDP_CHECK(t.device() == device_, type_name(), ": ", label, " is on ", t.device(),
               " but the module's parameters are on ", device_, "; move the ", what, " with .to(",
               device_, ") or the module with .to(", t.device(), ")");
  }
}

TensorList Module::forward_all(const TensorList& inputs) {
  const nvtx::Range range(type_name() + " forward");
  check_inputs(inputs, "input", /*allow_undefined=*/false);
  forward_done_ = false;  // a forward that throws leaves nothing for a backward to use
  widened_.assign(inputs.size(), false);
  // A layer that does not take bf16 computes on its bf16 inputs widened (the list is copied only
  // then: most forwards pass it as it is).
  TensorList widened;
  if (!takes_bf16()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].dtype() != DType::bf16) continue;
      if (widened.empty()) widened = inputs;
      widened[i] = convert(inputs[i], DType::f32);
      widened_[i] = true;
    }
  }
  input_grad_masked_ = false;
  output_grad_masked_ = false;
  input_grad_summed_ = output_grad_summed_ = false;
  grad_sums_into_ = nullptr;
  TensorList outputs;
  try {
    outputs = forward_impl(widened.empty() ? inputs : widened);
  } catch (...) {
    relu_fused_ = mask_requested_ = false;  // hold for one forward, failed ones included
    throw;
  }
  last_relu_fused_ = relu_fused_;
  relu_fused_ = false;  // fuse_relu(true) holds for one forward
  mask_requested_ = false;
  forward_done_ = true;
  return outputs;
}

TensorList Module::backward_all(const TensorList& grad_outputs) {
  const nvtx::Range range(type_name() + " backward");
  CUDP_CHECK(forward_done_, type_name(),
             ": backward() called without a forward() since the last backward (or after the module "
             "was moved); run forward() first: backward uses what the forward saved, and frees it");
  check_inputs(grad_outputs, "grad_output", /*allow_undefined=*/true);
  // The bias gradients' last launches queued and run as one at the end (kernels/bias.h, NOTE
  // [Deferred bias gradients]): by the thread's outermost backward only; inner ones flush before
  // their hooks.
  std::optional<kernels::DeferredBiasGrads> deferred;
  if (!device_.is_cpu()) deferred.emplace(device_.index, stream_for(device_));
  input_grad_summed_ = false;
  // The bias hand-off asks for the column sums of the gradient this module hands back; one that
  // came in bf16 and was widened goes back rounded to bf16 (below), and the layer before must sum
  // the rounded values, as it does without the hand-off: the request is declined.
  if (!widened_.empty() && widened_[0]) grad_sums_into_ = nullptr;
  TensorList grads;
  try {
    grads = backward_impl(grad_outputs);
  } catch (...) {
    grad_sums_into_ = nullptr;  // the bias hand-off's requests hold for one backward
    output_grad_summed_ = false;
    throw;
  }
  grad_sums_into_ = nullptr;
  output_grad_summed_ = false;
  release_saved();
  fused_relu_output_ = Tensor();
  forward_done_ = false;
  for (size_t i = 0; i < grads.size() && i < widened_.size(); ++i) {
    if (widened_[i]) grads[i] = convert(grads[i], DType::bf16);
  }
  // A hook (the Reducer's all-reduce of this module's bucket) reads the gradients: they are
  // complete before it, as they are when the outermost backward returns.
  if (backward_hook_ || (deferred && deferred->active())) kernels::flush_deferred_bias_grads();
  if (backward_hook_) backward_hook_();
  // Sums the hook itself queued (cudp's hooks queue none), before the outermost scope closes.
  if (backward_hook_ && deferred && deferred->active()) kernels::flush_deferred_bias_grads();
  return grads;
}

void Module::release_forward_state() {
  for (auto& [path, module] : named_modules()) {
    module->release_saved();
    module->fused_relu_output_ = Tensor();
    module->forward_done_ = false;
  }
}

Tensor Module::forward(const Tensor& input) {
  TensorList outputs = forward_all({input});
  CUDP_CHECK(outputs.size() == 1, type_name(),
             ": forward() returns one tensor but this module has ", outputs.size(),
             " outputs; call forward_all()");
  return outputs[0];
}

Tensor Module::backward(const Tensor& grad_output) {
  CUDP_CHECK(grad_output.defined(), type_name(), ": grad_output is undefined");
  TensorList grads = backward_all({grad_output});
  CUDP_CHECK(grads.size() == 1, type_name(), ": backward() returns one tensor but this module has ",
             grads.size(), " inputs; call backward_all()");
  return grads[0];
}

TensorList Module::forward_impl(const TensorList& inputs) {
  CUDP_CHECK(inputs.size() == 1, type_name(), " takes one input, got ", inputs.size());
  return {forward_one(inputs[0])};
}

TensorList Module::backward_impl(const TensorList& grad_outputs) {
  CUDP_CHECK(grad_outputs.size() == 1, type_name(), " has one output, got ", grad_outputs.size(),
             " gradients");
  CUDP_CHECK(grad_outputs[0].defined(), type_name(), ": grad_output is undefined");
  return {backward_one(grad_outputs[0])};
}

Tensor Module::forward_one(const Tensor&) {
  CUDP_THROW(ValueError, type_name(), " implements neither forward_one nor forward_impl");
}

Tensor Module::backward_one(const Tensor&) {
  CUDP_THROW(ValueError, type_name(), " implements neither backward_one nor backward_impl");
}

// ---- errors located in children (NOTE [Locating errors in children], module.h) ------------------

namespace {

// The last error rethrow_in_child located on this thread: which module threw it, its whole message
// and its parts. A parent extends the path only when the error it caught is that one and came from
// the child it called: no text that merely looks like a located error is taken apart.
struct LocatedError {
  const Module* by = nullptr;
  std::string message, path, type, original;
};
thread_local LocatedError t_located;

}  // namespace

void Module::rethrow_in_child(const ValueError& error, const Module& child) const {
  const auto named = std::find_if(children_.begin(), children_.end(),
                                  [&](const auto& entry) { return entry.second.get() == &child; });
  // Not our child (no name to give), or a subclass of ValueError (whose type a new ValueError
  // would lose): unchanged.
  if (named == children_.end() || typeid(error) != typeid(ValueError)) throw;
  LocatedError located{this, "", named->first, child.type_name(), error.message()};
  // A container child located it already: its path goes under the child's name, and the original
  // text follows once.
  if (t_located.by == &child && t_located.message == error.message()) {
    located.path += "." + t_located.path;
    located.type = t_located.type;
    located.original = t_located.original;
  }
  located.message = detail::str("in layer ", located.path, " (", located.type, ") of a ",
                                type_name(), ": ", located.original);
  t_located = std::move(located);
  throw ValueError(t_located.message, error.file(), error.line());
}

// ---- printing (PyTorch's Module.__repr__) -------------------------------------------------------

std::string Module::repr() const {
  // PyTorch's text: the extra_repr lines, then "(name): <child's text>" for each child with the
  // child's lines after its first indented by two spaces (_addindent); a single extra line and no
  // children stay on the module's own line.
  std::vector<std::string> lines;
  const std::string extra = extra_repr();
  if (!extra.empty()) {
    std::string_view rest = extra;
    for (size_t end; (end = rest.find('\n')) != std::string_view::npos;
         rest.remove_prefix(end + 1)) {
      lines.emplace_back(rest.substr(0, end));
    }
    lines.emplace_back(rest);
  }
  const size_t extra_lines = lines.size();
  for (const auto& [name, child] : children_) {
    std::string line = detail::str("(", name, "): ");
    for (const char c : child->repr()) {
      line += c;
      if (c == '\n') line += "  ";
    }
    lines.push_back(std::move(line));
  }
  std::string out = type_name() + "(";
  if (extra_lines == 1 && children_.empty()) {
    out += lines[0];
  } else if (!lines.empty()) {
    for (const std::string& line : lines) out += "\n  " + line;
    out += "\n";
  }
  return out + ")";
}

std::ostream& operator<<(std::ostream& out, const Module& module) {
  return out << module.repr();
}

std::string Module::py_float(float value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value < 0 ? "-inf" : "inf";
  // The shortest digits that read back as this float, "d[.ddd]e±xx", then Python's repr layout of
  // them: positional for exponents -4 to 15 (always with a fractional part, "2.0"), else
  // scientific with at least two exponent digits ("1e-05").
  char buffer[32];
  const auto [end, ec] =
      std::to_chars(buffer, buffer + sizeof buffer, value, std::chars_format::scientific);
  CUDP_CHECK(ec == std::errc(), "py_float: cannot format ", value);
  std::string_view text(buffer, static_cast<size_t>(end - buffer));
  std::string out;
  if (text.front() == '-') {
    out = "-";
    text.remove_prefix(1);
  }
  const size_t e = text.find('e');
  std::string digits;
  for (const char c : text.substr(0, e)) {
    if (c != '.') digits += c;
  }
  const int exponent = std::stoi(std::string(text.substr(e + 1)));
  const int n = static_cast<int>(digits.size());
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int magnitude = std::abs(exponent);
    out += detail::str(exponent < 0 ? "e-" : "e+", magnitude < 10 ? "0" : "", magnitude);
  } else if (exponent < 0) {
    out += "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  } else if (n > exponent + 1) {
    out += digits.substr(0, static_cast<size_t>(exponent + 1)) + "." +
           digits.substr(static_cast<size_t>(exponent + 1));
  } else {
    out += digits + std::string(static_cast<size_t>(exponent + 1 - n), '0') + ".0";
  }
  return out;
}

// ---- registration and walks ---------------------------------------------------------------------

Parameter& Module::register_parameter(const std::string& name, Tensor data) {
  CUDP_CHECK(data.defined(), type_name(), ": parameter '", name, "' is undefined");
  Tensor grad = Tensor::zeros(data.shape(), data.dtype(), data.device());
  params_.emplace_back(name, Parameter{std::move(data), std::move(grad)});
  return params_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor data) {
  CUDP_CHECK(data.defined(), type_name(), ": buffer '", name, "' is undefined");
  buffers_.emplace_back(name, std::move(data));
  return buffers_.back().second;
}

namespace {

// PyTorch's dotted names: "features" + "0" -> "features.0"; an empty side is the root.
std::string dotted(const std::string& parent, const std::string& name) {
  if (parent.empty()) {
    return name;
  }
  if (name.empty()) {
    return parent;
  }
  std::string out = parent;
  out += '.';
  out += name;
  return out;
}

}  // namespace

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out{{"", this}};
  for (auto& [name, child] : children_) {
    for (auto& [sub, module] : child->named_modules()) {
      out.emplace_back(dotted(name, sub), module);
    }
  }
  return out;
}

std::vector<std::pair<std::string, Parameter*>> Module::named_parameters() {
  std::vector<std::pair<std::string, Parameter*>> out;
  for (auto& [path, module] : named_modules()) {
    for (auto& [name, param] : module->params_) {
      out.emplace_back(dotted(path, name), &param);
    }
  }
  return out;
}

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  for (auto& [name, param] : named_parameters()) {
    out.push_back(param);
  }
  return out;
}

std::vector<std::pair<std::string, Tensor*>> Module::named_buffers() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (auto& [path, module] : named_modules()) {
    for (auto& [name, buffer] : module->buffers_) {
      out.emplace_back(dotted(path, name), &buffer);
    }
  }
  return out;
}

std::vector<Parameter*> Module::own_parameters() {
  std::vector<Parameter*> out;
  for (auto& [name, param] : params_) {
    out.push_back(&param);
  }
  return out;
}

void Module::sync_replica(const Module&, size_t, ReplicaSync) {}

int64_t Module::num_parameters() {
  int64_t n = 0;
  for (Parameter* p : parameters()) {
    n += p->data.numel();
  }
  return n;
}

// PyTorch's state_dict order: a module's parameters, then its buffers, then its children's.
void Module::collect_entries(const std::string& path, std::vector<Entry>& out) {
  for (auto& [name, param] : params_) {
    out.push_back({dotted(path, name), this, name, &param.data});
  }
  for (auto& [name, buffer] : buffers_) {
    out.push_back({dotted(path, name), this, name, &buffer});
  }
  for (auto& [name, child] : children_) {
    child->collect_entries(dotted(path, name), out);
  }
}

// ---- state_dict ---------------------------------------------------------------------------------

Tensor Module::export_tensor(const std::string&, const Tensor& internal) const {
  return internal;
}
Tensor Module::import_tensor(const std::string&, const Tensor& pytorch) const {
  return pytorch;
}
Shape Module::export_shape(const std::string&, const Shape& internal) const {
  return internal;
}

namespace {

// A CPU tensor holding `exported`'s values that does not alias `internal`.
Tensor snapshot(const Tensor& exported, const Tensor& internal) {
  if (!exported.is_cpu()) {
    return exported.cpu();
  }
  return exported.shares_storage(internal) ? exported.clone() : exported;
}

std::string join(const std::vector<std::string>& lines) {
  std::ostringstream out;
  for (const std::string& line : lines) {
    out << "\n  " << line;
  }
  return out.str();
}

}  // namespace

std::map<std::string, Tensor> Module::state_dict() {
  std::vector<Entry> entries;
  collect_entries("", entries);
  std::map<std::string, Tensor> state;
  for (const Entry& e : entries) {
    state.emplace(e.name, snapshot(e.owner->export_tensor(e.local, *e.tensor), *e.tensor));
  }
  return state;
}

Module::StateCopy Module::copy_state() {
  std::vector<Entry> entries;
  collect_entries("", entries);
  StateCopy copy;
  copy.items.reserve(entries.size());
  for (const Entry& e : entries) {
    copy.items.push_back({e.name, e.owner, e.local, e.tensor->clone_async()});
  }
  return copy;
}

std::map<std::string, Tensor> Module::StateCopy::to_host() const {
  std::map<std::string, Tensor> state;
  for (const Item& item : items) {
    // The copy is private: what the hook returns may alias it (snapshot's clone is not needed).
    Tensor exported = item.owner->export_tensor(item.local, item.copy);
    state.emplace(item.name, exported.is_cpu() ? exported : exported.cpu());
  }
  return state;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& state, bool strict) {
  std::vector<Entry> entries;
  collect_entries("", entries);
  std::vector<std::string> problems;
  std::vector<std::pair<const Entry*, const Tensor*>> loads;
  std::set<std::string> known;
  for (const Entry& e : entries) {
    known.insert(e.name);
    const auto it = state.find(e.name);
    const Shape expected = e.owner->export_shape(e.local, e.tensor->shape());
    if (it == state.end()) {
      if (strict) {
        problems.push_back(detail::str("missing key '", e.name, "' (", e.owner->type_name(), " ",
                                       e.local, ", expected shape ", shape_str(expected), " ",
                                       dtype_name(e.tensor->dtype()), ")"));
      }
      continue;
    }
    const Tensor& t = it->second;
    if (!t.defined()) {
      problems.push_back(detail::str("key '", e.name, "' holds an undefined tensor"));
    } else if (t.shape() != expected) {
      problems.push_back(detail::str("size mismatch for '", e.name, "': found shape ",
                                     shape_str(t.shape()), ", the module expects ",
                                     shape_str(expected)));
    } else if (t.dtype() != e.tensor->dtype()) {
      problems.push_back(detail::str("dtype mismatch for '", e.name, "': found ",
                                     dtype_name(t.dtype()), ", the module expects ",
                                     dtype_name(e.tensor->dtype())));
    } else {
      loads.emplace_back(&e, &t);
    }
  }
  if (strict) {
    for (const auto& [name, t] : state) {
      if (!known.count(name)) {
        problems.push_back(detail::str("unexpected key '", name, "'"));
      }
    }
  }
  CUDP_CHECK(problems.empty(), "Error(s) in loading state_dict for ", type_name(), ":",
             join(problems));
  for (const auto& [e, t] : loads) {
    e->tensor->copy_from(e->owner->import_tensor(e->local, *t));
  }
  refresh_compute_copies();
}

// ---- modes, gradients, devices ------------------------------------------------------------------

void Module::train(bool on) {
  for (auto& [path, module] : named_modules()) {
    module->training_ = on;
  }
}

void Module::set_precision(Precision precision) {
  for (auto& [path, module] : named_modules()) {
    module->precision_ = precision;
    if (precision != Precision::bf16) {
      for (auto& [name, param] : module->params_) param.compute = Tensor();
    }
  }
}

void Module::fuse_relu(bool on) {
  CUDP_CHECK(!on || can_fuse_relu(), type_name(),
             " cannot apply a ReLU to its output; run the ReLU "
             "module after it");
  relu_fused_ = on;
}

void Module::set_fusion(bool on) {
  for (auto& [path, module] : named_modules()) {
    module->fusion_ = on;
  }
}

const Tensor* Module::fused_relu_mask() const {
  if (!last_relu_fused_ || output_grad_masked_) return nullptr;
  CUDP_CHECK(fused_relu_output_.defined(), type_name(),
             ": the output its fused ReLU's mask needs was dropped (its gradient was said to "
             "arrive masked, then not); run forward() again");
  return &fused_relu_output_;
}

void Module::zero_grad() {
  for (Parameter* p : parameters()) {
    if (p->grad.defined()) p->grad.zero_();
    p->grad_zero_pending = false;
  }
}

void zero_grads_not_pending(const std::vector<Parameter*>& params, float* flat, int64_t flat_size) {
  if (flat == nullptr) {
    for (Parameter* p : params) {
      if (!p->grad_zero_pending && p->grad.defined()) p->grad.zero_();
    }
    return;
  }
  CUDP_CHECK(!params.empty(), "zero_grads_not_pending: a flat buffer without parameters");
  const Device device = params[0]->grad.device();
  // The pending gradients' spans, in buffer order; the ranges to zero are the gaps around them.
  std::vector<kernels::FloatRange> pending;
  for (const Parameter* p : params) {
    if (!p->grad_zero_pending) continue;
    const int64_t begin = p->grad.data<float>() - flat;
    CUDP_CHECK(p->grad.device() == device && begin >= 0 && begin + p->grad.numel() <= flat_size,
               "zero_grads_not_pending: a gradient ", p->grad.str(),
               " is not inside the flat buffer of ", flat_size, " floats on ", device);
    pending.push_back({begin, begin + p->grad.numel()});
  }
  std::sort(
      pending.begin(), pending.end(),
      [](const kernels::FloatRange& a, const kernels::FloatRange& b) { return a.begin < b.begin; });
  std::vector<kernels::FloatRange> ranges;
  int64_t from = 0;
  for (const kernels::FloatRange& span : pending) {
    if (span.begin > from) ranges.push_back({from, span.begin});
    from = std::max(from, span.end);
  }
  if (from < flat_size) ranges.push_back({from, flat_size});
  const auto count = static_cast<int64_t>(ranges.size());
  if (device.is_cpu()) {
    kernels::zero_ranges_cpu(flat, ranges.data(), count);
    return;
  }
  const cuda::DeviceGuard guard(device.index);
  const cudaStream_t stream = stream_for(device);
  if (pending.empty()) {
    // As Tensor::zero_ (a memset node in a graph): nothing deferred, the whole span.
    CUDP_CUDA_CHECK(cudaMemsetAsync(flat, 0, flat_size * sizeof(float), stream));
  } else {
    kernels::zero_ranges(flat, ranges.data(), count, stream);
  }
}

void zero_pending_grads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) {
    if (!p->grad_zero_pending) continue;
    if (p->grad.defined()) p->grad.zero_();
    p->grad_zero_pending = false;
  }
}

void Module::replace_child(size_t index, std::shared_ptr<Module> child) {
  CUDP_CHECK(index < children_.size(), type_name(), "::replace_child: index ", index, " of ",
             children_.size(), " children");
  CUDP_CHECK(child != nullptr, type_name(), "::replace_child: child ", children_[index].first,
             " would be null");
  children_[index].second = std::move(child);
}

Module& Module::to(Device device) {
  if (device.is_cuda()) {
    cuda::check_device(device.index);
  }
  const cuda::AllocationPurpose purpose(
      detail::str(type_name(), "'s parameters, gradients and buffers, moved to ", device),
      "The model's parameters alone do not fit in the device's free memory: free what else is on "
      "it, or use a smaller model (DataParallel keeps a whole copy on every GPU).");
  for (auto& [path, module] : named_modules()) {
    for (auto& [name, param] : module->params_) {
      // The parameter store stays behind on another device (flatten again there).
      if (param.data.device() != device) param.compute = Tensor();
      param.data = param.data.to(device);
      param.grad = param.grad.to(device);
    }
    for (auto& [name, buffer] : module->buffers_) {
      buffer = buffer.to(device);
    }
    if (module->device_ != device) {
      module->release_saved();  // what the forward saved stays on the old device: drop it
      module->fused_relu_output_ = Tensor();
      module->forward_done_ = false;
    }
    module->device_ = device;
  }
  return *this;
}

Module& Module::cuda(int device) {
  return to(Device::cuda(device < 0 ? cuda::current_device() : device));
}

std::shared_ptr<Module> Module::clone(Device device) const {
  if (device.is_cuda()) {
    cuda::check_device(device.index);
  }
  std::shared_ptr<Module> copy = make_empty_copy();
  // Walks the original and its empty copy side by side: same structure by construction.
  auto fill = [&device](const Module& src, Module& dst, const auto& self) -> void {
    CUDP_CHECK(src.params_.size() == dst.params_.size() &&
                   src.buffers_.size() == dst.buffers_.size() &&
                   src.children_.size() == dst.children_.size(),
               src.type_name(), "::make_empty_copy() built a module of another structure");
    for (size_t i = 0; i < src.params_.size(); ++i) {
      const Tensor& from = src.params_[i].second.data;
      Parameter& param = dst.params_[i].second;
      param.data = Tensor::empty(from.shape(), from.dtype(), device);
      param.data.copy_from(from);
      param.grad = Tensor::zeros(from.shape(), from.dtype(), device);
    }
    for (size_t i = 0; i < src.buffers_.size(); ++i) {
      const Tensor& from = src.buffers_[i].second;
      Tensor& buffer = dst.buffers_[i].second;
      buffer = Tensor::empty(from.shape(), from.dtype(), device);
      buffer.copy_from(from);
    }
    dst.training_ = src.training_;
    dst.precision_ = src.precision_;
    dst.fusion_ = src.fusion_;
    dst.input_grad_ = src.input_grad_;
    dst.device_ = device;
    dst.forward_done_ = false;
    for (size_t i = 0; i < src.children_.size(); ++i) {
      self(*src.children_[i].second, *dst.children_[i].second, self);
    }
  };
  fill(*this, *copy, fill);
  return copy;
}

// ---- flat parameters ----------------------------------------------------------------------------

namespace {

// Each parameter starts on a 256-byte boundary of the flat buffers (what cudaMalloc guarantees a
// fresh allocation), so a kernel that vectorises on its weights' alignment sees the same alignment
// after flattening. The gaps are zeros in both buffers and stay zero under SGD and Adam.
constexpr int64_t kFlatAlignFloats = 256 / sizeof(float);

int64_t align_up(int64_t n) {
  return (n + kFlatAlignFloats - 1) / kFlatAlignFloats * kFlatAlignFloats;
}

}  // namespace

std::pair<Tensor, Tensor> Module::flatten_parameters() {
  const auto params = named_parameters();
  int64_t total = 0;
  for (const auto& [name, p] : params) {
    CUDP_CHECK(p->data.dtype() == DType::f32, type_name(),
               ": flatten_parameters needs f32 parameters, '", name, "' is ",
               dtype_name(p->data.dtype()));
    CUDP_CHECK(p->data.device() == device_, type_name(), ": parameter '", name, "' is on ",
               p->data.device(), " but the module is on ", device_);
    total += align_up(p->data.numel());
  }
  Tensor flat_data = Tensor::zeros({total}, DType::f32, device_);
  Tensor flat_grad = Tensor::zeros({total}, DType::f32, device_);
  // The bf16 compute copies (NOTE [The parameter store]), at the same element offsets, so that one
  // optimizer launch writes them beside the master weights.
  bool bf16 = false;
  for (const auto& [path, module] : named_modules()) {
    bf16 = bf16 || module->precision_ == Precision::bf16;
  }
  bf16 = bf16 && detail::parameter_store();
  Tensor flat_compute;
  if (bf16) {
    const cuda::AllocationPurpose purpose(
        detail::str(type_name(), "'s bf16 copy of its weights (the bf16 policy's parameter store)"),
        "Under bf16 the model keeps one bf16 copy of its weights beside the fp32 master weights: "
        "use a smaller model or GPUs with more free memory.");
    flat_compute = Tensor::empty({total}, DType::bf16, device_);
  }
  int64_t offset = 0;
  for (const auto& [name, p] : params) {
    const int64_t n = p->data.numel();
    Tensor data = flat_data.slice(offset, offset + n).view(p->data.shape());
    Tensor grad = flat_grad.slice(offset, offset + n).view(p->data.shape());
    data.copy_from(p->data);
    grad.copy_from(p->grad);
    p->data = data;
    p->grad = grad;
    p->compute = bf16 ? flat_compute.slice(offset, offset + n).view(p->data.shape()) : Tensor();
    offset += align_up(n);
  }
  if (bf16) {
    // The whole buffer at once: the padding's zeros become bf16 zeros.
    run(
        [&] {
          kernels::f32_to_bf16_cpu(flat_data.data<float>(), flat_compute.data<__nv_bfloat16>(),
                                   total);
        },
        [&](cudaStream_t stream) {
          kernels::f32_to_bf16(flat_data.data<float>(), flat_compute.data<__nv_bfloat16>(), total,
                               stream);
        });
  }
  return {flat_data, flat_grad};
}

void Module::refresh_compute_copies() {
  // Each parameter through the module that owns it: a wrapper (DataParallel) may sit on another
  // device than the model it holds, whose parameters live on their owner's device.
  for (const auto& [path, owner] : named_modules()) {
    for (auto& [local, p] : owner->params_) {
      if (!p.compute.defined()) continue;
      CUDP_CHECK(p.compute.dtype() == DType::bf16 && p.compute.numel() == p.data.numel() &&
                     p.compute.device() == owner->device_ && p.data.device() == owner->device_,
                 owner->type_name(), ": parameter '", dotted(path, local), "' has a compute copy ",
                 p.compute.str(), " that does not mirror its data ", p.data.str(),
                 " on the module's ", owner->device_, "; flatten_parameters() again");
      const float* data = p.data.data<float>();
      __nv_bfloat16* compute = p.compute.data<__nv_bfloat16>();
      const int64_t n = p.data.numel();
      owner->run([&] { kernels::f32_to_bf16_cpu(data, compute, n); },
                 [&](cudaStream_t stream) { kernels::f32_to_bf16(data, compute, n, stream); });
    }
  }
}

namespace detail {
namespace {
std::atomic<bool> g_bias_handoff{true};
}  // namespace
void set_bias_handoff(bool on) {
  g_bias_handoff.store(on);
}
bool bias_handoff() {
  return g_bias_handoff.load();
}
namespace {
std::atomic<bool> g_batchnorm_mask_handoff{true};
}  // namespace
void set_batchnorm_mask_handoff(bool on) {
  g_batchnorm_mask_handoff.store(on);
}
bool batchnorm_mask_handoff() {
  return g_batchnorm_mask_handoff.load();
}
namespace {
// Up to 16,384 rows: VGG's layers at 8 x 8 and below at batch 256, at 14 x 14 at batch 64. On an
// H100 (bench/NOTES-tensor-cores.md, session 28) VGG-16 bf16 gains 2.4% at 32^2 (1.7% with
// BatchNorm) and nothing is lost at 224^2; with every layer beside, 224^2 lost 1.3%.
std::atomic<int64_t> g_concurrent_weight_grad_rows{16384};
}  // namespace
void set_concurrent_weight_grad(int64_t max_rows) {
  g_concurrent_weight_grad_rows.store(max_rows);
}
int64_t concurrent_weight_grad_rows() {
  return g_concurrent_weight_grad_rows.load();
}
bool concurrent_weight_grad(int64_t rows) {
  const int64_t bound = g_concurrent_weight_grad_rows.load();
  return bound < 0 || rows <= bound;
}
namespace {
std::atomic<bool> g_parameter_store{true};
}  // namespace
void set_parameter_store(bool on) {
  g_parameter_store.store(on);
}
bool parameter_store() {
  return g_parameter_store.load();
}
}  // namespace detail

}  // namespace cudp
