// Module: the unit of a model (docs/architecture.md §2.1: explicit forward and backward, no tape).
//
// A module owns named parameters (each with its gradient), named buffers (BatchNorm's running
// statistics) and named children, with PyTorch's names so that state_dict() keys match torchvision
// ("features.0.weight", "classifier.6.bias", "features.1.running_mean").
//
// forward() and backward() are non-virtual: they check the inputs' devices against the module's
// (and that backward follows a forward) once, then call the layer's implementation. A layer keeps
// what its backward needs from the last forward. Parameter gradients accumulate (+=) until
// zero_grad(); the gradient with respect to the input is returned (written, not accumulated).
//
// Most layers take one tensor and return one: they override forward_one / backward_one. A module
// with several inputs or outputs (a model returning logits and features, say) overrides
// forward_impl / backward_impl, which take and return lists; an undefined Tensor among the output
// gradients means "this output was not used" (a zero gradient).
//
// Activations are NHWC on every device: images enter a model as [N, H, W, C].
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/tensor.h"
#include "layers/precision.h"

namespace cudp {

using TensorList = std::vector<Tensor>;

// A learnable tensor and its gradient (same shape, device and dtype; allocated with the data).
//
// NOTE [The parameter store]
// Under the bf16 policy a flattened model (flatten_parameters, which DataParallel,
// DistributedDataParallel and the trainers call) keeps, beside its flat fp32 master weights and
// flat fp32 gradients, one flat bf16 copy of the weights: `compute`, a view into it, holds
// bf16(data) rounded to nearest even, the operand Conv2d and Linear read instead of converting
// their weights at every forward. Invariant: while `compute` is defined it equals bf16(data)
// whenever a kernel reads it. Every writer of parameters in cudp keeps it: the optimizers write it
// in the launch that updates data (kernels/optim.h); load_state_dict, the layers'
// reset_parameters, DataParallel's and DistributedDataParallel's broadcasts refresh it
// (Module::refresh_compute_copies); to() and
// set_precision to another policy drop it. Code that writes `data` itself (through data<float>())
// calls refresh_compute_copies() on the model afterwards. Undefined: the layers convert as before.
//
// NOTE [Deferred zeroing]
// Optimizer::zero_grad(ZeroGrad::deferred) (what train_step and the trainers use) does not write
// the gradients whose layer writes them whole in its backward (`backward_writes_grad`: Conv2d's
// weight, Linear's weight and bias): it marks them `grad_zero_pending`, and that backward writes
// the gradient with beta 0 instead of adding to zeros with beta 1 (grad_beta(), then
// grad_written()). A step then neither memsets those gradients nor reads them back, PyTorch's
// zero_grad(set_to_none=True) without taking the tensors away. While the flag is set the gradient
// counts as zero and its contents are unspecified; whatever reads gradients (Optimizer::step,
// clip_grad_norm, grad_norm, the gradient reducers, DataParallel's all-reduce) first zeroes those
// still pending (zero_pending_grads: a parameter whose module's backward did not run). Every other
// gradient is zeroed by zero_grad as before. Bit for bit the same sums as zeroing first, but for
// the sign of a zero sum (beta 0 keeps -0, adding it to +0 gives +0).
struct Parameter {
  Tensor data;
  Tensor grad;
  Tensor compute{};  // bf16(data) under the bf16 policy when flattened; see the NOTE above
  bool backward_writes_grad = false;  // set by the layer: see NOTE [Deferred zeroing]
  bool grad_zero_pending = false;     // the gradient counts as zero; its contents are stale
  // An optimizer updates it beside the backward (Optimizer::set_update_overlap): nothing may
  // scale its gradient between the backward and the step (clip_grad_norm refuses it).
  bool update_beside_backward = false;

  // The beta of a backward's write of this gradient: 0 while it counts as zero (the write replaces
  // whatever the tensor holds and never reads it), else 1 (accumulate).
  float grad_beta() const { return grad_zero_pending ? 0.f : 1.f; }
  // Called by that backward once the write is enqueued: from then on the gradient holds a value. A
  // backward that throws before it leaves the flag set, so that a retry still writes.
  void grad_written() { grad_zero_pending = false; }
};

// Zeroes (on their devices' current streams) the gradients of `params` that still count as zero
// under NOTE [Deferred zeroing], and clears their flags: what reads gradients calls it first.
void zero_pending_grads(const std::vector<Parameter*>& params);
// Zeroes the gradients of `params` but those that count as zero (their flags stay set). `flat`:
// the buffer of `flat_size` floats that every one of them views (flatten_parameters), zeroed in
// one launch, the padding between them included; null: one memset per gradient. All on one device,
// its current stream.
void zero_grads_not_pending(const std::vector<Parameter*>& params, float* flat, int64_t flat_size);

class Module : public std::enable_shared_from_this<Module> {
 public:
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The layer's type, as PyTorch prints it ("Conv2d", "Sequential").
  virtual std::string type_name() const = 0;

  // PyTorch's print(model): this module and its descendants in PyTorch's text, one module a line,
  // each child as "(name): " and its own text, indented by two spaces a level:
  //   Sequential(
  //     (0): Conv2d(1, 16, kernel_size=(5, 5), stride=(1, 1), padding=(2, 2))
  //     (1): ReLU()
  //   )
  // operator<< (below) writes the same text.
  std::string repr() const;
  // The configuration a module's line shows between its parentheses, PyTorch's extra_repr(): the
  // layers' constructor options in PyTorch's words and defaults ("64, eps=1e-05, momentum=0.1,
  // affine=True, track_running_stats=True"). Empty by default (a container shows its children).
  // Several lines may be separated by '\n'.
  virtual std::string extra_repr() const { return {}; }

  Tensor forward(const Tensor& input);
  Tensor backward(const Tensor& grad_output);
  // Virtual so that a module with its own rules for where inputs may live overrides them and is
  // still called through a Module& (DataParallel takes a host batch and scatters it; every layer
  // uses these as they are).
  virtual TensorList forward_all(const TensorList& inputs);
  virtual TensorList backward_all(const TensorList& grad_outputs);

  // Called at the end of every backward_all of this module, on the thread that ran it, once the
  // kernels writing this module's own parameter gradients are enqueued on its device's current
  // stream: the signal a gradient reducer (engine/parallel/reducer.h) waits for before it sums
  // them across replicas while the rest of the backward still runs. One hook per module; an empty
  // function removes it. Clones do not copy it.
  void set_backward_hook(std::function<void()> hook) { backward_hook_ = std::move(hook); }
  bool has_backward_hook() const { return static_cast<bool>(backward_hook_); }

  // Data parallelism: how per-replica state that is neither a parameter nor a buffer follows
  // replica 0 (parameters and buffers are the engine's to broadcast and reduce). The engine
  // (engine/parallel/replicate.h) calls it on every module of replica r >= 1 with the module at
  // the same place in replica 0, so that it names no concrete layer itself. The default does
  // nothing; Dropout derives its own random stream from replica 0's (Created) and takes replica
  // 0's offset (BeforeForward); BatchNorm2d takes replica 0's host batch count after the engine
  // has broadcast the running statistics (BuffersBroadcast).
  enum class ReplicaSync {
    Created,           // once, after the replica was cloned from replica 0
    BeforeForward,     // on the calling thread, before each forward of the replicas
    BuffersBroadcast,  // after replica 0's buffers were copied to this replica
  };
  virtual void sync_replica(const Module& primary, size_t replica, ReplicaSync when);

  // Parameters, buffers and children, recursively, with dotted PyTorch names, in registration order.
  std::vector<std::pair<std::string, Parameter*>> named_parameters();
  std::vector<Parameter*> parameters();
  // This module's own parameters, without its children's, in registration order.
  std::vector<Parameter*> own_parameters();
  std::vector<std::pair<std::string, Tensor*>> named_buffers();
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }
  // Model surgery (convert_sync_batchnorm): child `index` (children() order) becomes `child`, under
  // the same name. Do it before the module is wrapped (DataParallel copies the structure it sees).
  void replace_child(size_t index, std::shared_ptr<Module> child);
  // This module (named "") and every descendant with its dotted path, parents before children.
  std::vector<std::pair<std::string, Module*>> named_modules();
  int64_t num_parameters();

  // Parameters and buffers in PyTorch's layout (conv weights OIHW), as CPU tensors.
  std::map<std::string, Tensor> state_dict();
  // state_dict() in two halves, for a caller that brings the state to the host on another thread
  // while this module trains on (layers/checkpoint.h, stage_checkpoint): copy_state() takes a
  // private copy of every parameter and buffer where it lives (on a GPU, device to device on the
  // current stream, without waiting for it), and StateCopy::to_host() (after that stream has done
  // the copies) turns them into state_dict()'s CPU tensors. to_host reads only the copies and the
  // owners' fixed configuration (the export hooks): the module must outlive it and keep its
  // structure, but its values may change meanwhile.
  struct StateCopy {
    struct Item {
      std::string name;     // dotted PyTorch name
      const Module* owner;  // for its export hook
      std::string local;    // the name inside the owner
      Tensor copy;          // the private copy, internal layout
    };
    std::vector<Item> items;
    std::map<std::string, Tensor> to_host() const;
  };
  StateCopy copy_state();
  // Loads PyTorch-layout tensors; strict: every key present and no extra key. Errors name the key.
  void load_state_dict(const std::map<std::string, Tensor>& state, bool strict = true);

  // The precision policy (layers/precision.h) of this module and every descendant: how Conv2d and
  // Linear compute their products. Clones and replicas inherit it; set it before data_parallel
  // or DataParallel makes replicas (they copy the model as it is then), and before
  // flatten_parameters, which makes the bf16 compute copies. A policy other than bf16 drops them.
  void set_precision(Precision precision);
  Precision precision() const { return precision_; }

  // Whether backward computes the gradient with respect to the input (by default it does). A
  // model's images need none: set_input_grad(false) on the model spares its first layer's
  // backward-data (a container passes the setting on to the child that receives its input,
  // DataParallel to its replicas, at each forward), and that layer's backward then returns an
  // undefined tensor.
  void set_input_grad(bool on) { input_grad_ = on; }
  bool input_grad() const { return input_grad_; }

  // Whether the layer computes on bf16 inputs itself (the bf16 policy's activations). A layer that
  // does not gets its bf16 inputs converted to f32 before its forward, and its input gradients
  // converted back to bf16 after its backward, so that every layer works in a bf16 model and a
  // gradient always has its value's dtype.
  virtual bool takes_bf16() const { return false; }

  // ReLU fusion. A layer that can apply max(y, 0) to its own output in forward, and mask the
  // gradient it is given by y > 0 in backward, says so with can_fuse_relu(); Sequential then runs a
  // ReLU that directly follows such a layer inside it (fuse_relu(true) before that forward) and
  // skips the ReLU module in forward and backward. fuse_relu(true) holds for the next forward only
  // (a direct call after it computes the layer alone); the layer keeps what its backward needs.
  // relu_fused() says whether the last forward applied a fused ReLU. The model's structure, names
  // and state_dict do not change, and the results are the same bit for bit (max and the mask are
  // exact; a bias gradient taken by the bias hand-off below is the same sum in another order).
  // set_fusion(false) turns this off for a module and its descendants (to compare, or to profile
  // layers one by one); clones and replicas inherit the setting.
  virtual bool can_fuse_relu() const { return false; }
  void fuse_relu(bool on);
  bool relu_fused() const { return last_relu_fused_; }
  void set_fusion(bool on);
  bool fusion() const { return fusion_; }

  // ReLU mask hand-off. A fused ReLU's backward (dy zeroed where y <= 0) can be done by the layer
  // that reads y next, where that layer's backward writes the gradient anyway: max pooling's
  // backward knows its window's maximum already (the codes it kept, kernels/pool.h), and
  // backward-data's epilogue writes dx. Then nothing reads and writes dy a second time for the
  // mask. Sequential asks the layer after a fused ReLU (request_input_grad_mask(true), for its next
  // forward) when the fused layer can leave its mask (can_take_masked_grad); the layer decides in
  // that forward whether it will (only where it costs no pass of its own on the GPU); if so, its
  // backward returns dx zeroed where its input is <= 0 (input_grad_masked()), and the fused layer
  // is told its gradient arrives masked (set_output_grad_masked). The hand-off is the Sequential's:
  // its backward gives the same bits as with the ReLU modules (the mask is a select).
  virtual bool can_take_masked_grad() const { return false; }  // a fused layer that can hand off
  void request_input_grad_mask(bool on) { mask_requested_ = on; }
  bool input_grad_masked() const { return input_grad_masked_; }
  // Drops the output kept for the mask (keep_fused_relu_output) when the next layer masks.
  void set_output_grad_masked(bool on) {
    output_grad_masked_ = on;
    if (on) fused_relu_output_ = Tensor();
  }

  // Bias-gradient hand-off. The bias gradient of a layer is the column sum of the gradient of its
  // output, which the next layer writes in its own backward: the layer after a fused ReLU (with
  // the mask's hand-off, masked), or the layer directly after an unfused one (a BatchNorm after a
  // convolution, whose dx pass writes it); where that pass can add its values up on the way, the
  // layer need not read the gradient again for them. Before that layer's backward, Sequential asks
  // the producing layer where the sums go (output_grad_sums_target: its bias gradient, or null
  // when it has no use for them: no bias, its mask in a pass of its own, the CPU) and hands the
  // address over (request_input_grad_sums); a layer that honours it adds the column sums of the
  // gradient it returns there (+=, as gradients accumulate) and says so (input_grad_summed), and
  // the producing layer is told (set_output_grad_summed) and skips its own sum. The result is the
  // same sum in another order (fp32, deterministic); both requests hold for one backward. A module
  // whose input came in bf16 and was widened declines it (backward_all): its gradient goes back
  // rounded to bf16, and the sums of the values before that rounding would not be the same sum.
  virtual float* output_grad_sums_target() { return nullptr; }
  void request_input_grad_sums(float* into) { grad_sums_into_ = into; }
  bool input_grad_summed() const { return input_grad_summed_; }
  void set_output_grad_summed(bool on) { output_grad_summed_ = on; }

  void train(bool on = true);
  void eval() { train(false); }

  // Drops what the last forward saved for its backward, in this module and every descendant, as
  // a backward does (release_saved below): for a forward no backward follows (an evaluation), so
  // that nothing holds its activations afterwards, and a captured evaluation keeps no memory past
  // its end. A backward then needs a new forward. DataParallel releases its replicas' too.
  virtual void release_forward_state();
  bool is_training() const { return training_; }
  void zero_grad();

  // Moves parameters, gradients and buffers (a copy per tensor; module-level, not a clone).
  Module& to(Device device);
  Module& cuda(int device = -1);
  Module& cpu() { return to(Device::cpu()); }
  Device device() const { return device_; }

  // A deep copy (structure, parameters, buffers, training flag; no activations) on `device`: the
  // engine's replicate() uses it.
  std::shared_ptr<Module> clone(Device device) const;

  // Re-points every parameter's data (and every gradient) into one flat buffer each, so that one
  // all-reduce or one optimizer launch covers the whole model. Returns {flat_data, flat_grad}.
  // Each parameter starts on a 256-byte boundary (zero padding between them). A later to() to
  // another device or clone() gives separate tensors again: flatten after moving. When this module
  // or a descendant has the bf16 policy, a third flat buffer, bf16 at the same element offsets,
  // holds the parameters' compute copies (NOTE [The parameter store]); set the precision first.
  std::pair<Tensor, Tensor> flatten_parameters();
  // Writes bf16(data) into every parameter's compute copy that is defined, through the module that
  // owns the parameter (its device, that device's current stream): after writing parameters' data
  // other than through cudp's optimizers, load_state_dict or the parallel wrappers' broadcasts,
  // which do it themselves.
  void refresh_compute_copies();

 protected:
  Module() = default;

  // Drops what the last forward saved for backward (inputs, outputs, masks, statistics). Called
  // by backward_all once this module's backward is done, and by to() when the module leaves its
  // device: as in PyTorch, a backward frees the saved activations, so that nothing holds them
  // between steps, through an evaluation, or past the end of a captured CUDA graph step (whose
  // memory would otherwise outlive the step inside the graph), and a second backward needs a new
  // forward. Leaf layers override it; containers' children release their own.
  virtual void release_saved() {}

  // A fused ReLU's mask, the layer's own output: kept by a forward that applied the ReLU (call it
  // with the output in forward), dropped when the layer after it takes the mask over
  // (set_output_grad_masked) and with the rest of the saved state after a backward.
  void keep_fused_relu_output(const Tensor& y) { fused_relu_output_ = relu_fused_ ? y : Tensor(); }
  // The output this backward masks its gradient by, or null: no ReLU fused, or the layer after it
  // masked the gradient already. Throws if the output was dropped and is needed after all.
  const Tensor* fused_relu_mask() const;

  Parameter& register_parameter(const std::string& name, Tensor data);
  Tensor& register_buffer(const std::string& name, Tensor data);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    children_.emplace_back(name, child);
    return child;
  }

  virtual TensorList forward_impl(const TensorList& inputs);
  virtual TensorList backward_impl(const TensorList& grad_outputs);
  virtual Tensor forward_one(const Tensor& input);
  virtual Tensor backward_one(const Tensor& grad_output);

  // A new module of the same type and configuration with uninitialised parameters/buffers of the
  // same shapes on the CPU; clone() copies the values. Every concrete layer implements it.
  virtual std::shared_ptr<Module> make_empty_copy() const = 0;
  // make_empty_copy() of another module (a container copying its children: C++ lets a derived class
  // call a protected member only through its own type, so containers go through this).
  static std::shared_ptr<Module> empty_copy_of(const Module& module) {
    return module.make_empty_copy();
  }

  // NOTE [Locating errors in children]
  // A ValueError raised by a child's forward or backward (a shape, a device or a dtype the child
  // refuses) says what is wrong but not where in the model. A container calls its children through
  // forward_child / backward_child, which rethrow it as a ValueError (the original's file and
  // line kept) that names the child by its path and type:
  //   in layer 3 (Conv2d) of a Sequential: Conv2d: expected an NHWC f32 input [N, H, W, 16], got
  //   Tensor[2, 4, 4, 8] f32 cpu
  // Containers nest without a stack of prefixes: when the error a container caught is the one its
  // child located (the thread remembers the last one, with its parts), the container extends that
  // path with the child's name, so the outermost container names the whole path with PyTorch's
  // dotted names ("in layer features.3 (Conv2d) of a VGG: ..."; "in layer 0.3 ..." for a
  // Sequential in a Sequential); no message is parsed. Where a child's error comes in another text
  // (DataParallel's "Caught ValueError in replica 0 ..."), the path stops at that child. Only
  // ValueError itself, the caller's mistake: CudaError, OutOfMemoryError, the others and
  // subclasses of ValueError pass unchanged. Until something throws, the only cost is the try
  // block, which costs nothing (zero-cost exceptions).
  Tensor forward_child(Module& child, const Tensor& input) {
    try {
      return child.forward(input);
    } catch (const ValueError& error) {
      rethrow_in_child(error, child);
    }
  }
  Tensor backward_child(Module& child, const Tensor& grad_output) {
    try {
      return child.backward(grad_output);
    } catch (const ValueError& error) {
      rethrow_in_child(error, child);
    }
  }
  // Rethrows `error`, raised by the forward or backward of `child`, located as above. Call it only
  // inside a catch block: when `child` is not one of this module's children (no name to give), it
  // rethrows the exception being handled unchanged.
  [[noreturn]] void rethrow_in_child(const ValueError& error, const Module& child) const;

  // Python's text of a value, for extra_repr: Python's repr(float) of the shortest decimal that
  // reads back as this float, which is the value written in the source ("1e-05" for 1e-5f, as
  // PyTorch prints eps=1e-5; "0.1", "2.0"), not the float's exact binary value; True / False.
  static std::string py_float(float value);
  static const char* py_bool(bool value) { return value ? "True" : "False"; }

  // Hooks for layers whose internal layout differs from PyTorch's (Conv2d stores KRSC).
  virtual Tensor export_tensor(const std::string& local_name, const Tensor& internal) const;
  virtual Tensor import_tensor(const std::string& local_name, const Tensor& pytorch) const;
  // The shape export_tensor gives a tensor of `internal` shape (load_state_dict checks against it and
  // names it in errors, so they speak PyTorch's layout). Identity unless overridden.
  virtual Shape export_shape(const std::string& local_name, const Shape& internal) const;

  // on_device (engine/core/tensor.h) on the module's device: what every layer's forward and
  // backward go through.
  template <typename Cpu, typename Gpu>
  void run(Cpu&& cpu, Gpu&& gpu) const {
    on_device(device_, std::forward<Cpu>(cpu), std::forward<Gpu>(gpu));
  }

  bool training_ = true;
  Precision precision_ = Precision::fp32;
  bool fusion_ = true;
  bool input_grad_ = true;
  // This forward applies a fused ReLU (set by the enclosing Sequential; read it in forward only),
  // and whether the last forward did.
  bool relu_fused_ = false;
  bool last_relu_fused_ = false;
  // The ReLU mask hand-off (above). mask_requested_ holds for one forward, in which a layer that
  // honours it sets input_grad_masked_ (cleared before each forward); output_grad_masked_ is set
  // by Sequential after the forward of the layer that reads this one's output, cleared before
  // this one's next forward.
  bool mask_requested_ = false;
  bool input_grad_masked_ = false;
  bool output_grad_masked_ = false;
  Tensor fused_relu_output_;  // keep_fused_relu_output
  // The bias-gradient hand-off (above): grad_sums_into_ and output_grad_summed_ are set by
  // Sequential for one backward; a layer that honours the request sets input_grad_summed_ in that
  // backward (cleared before each backward).
  float* grad_sums_into_ = nullptr;
  bool input_grad_summed_ = false;
  bool output_grad_summed_ = false;
  Device device_ = Device::cpu();
  bool forward_done_ = false;

 private:
  std::function<void()> backward_hook_;  // set_backward_hook
  std::vector<bool> widened_;  // inputs of the last forward converted from bf16 (takes_bf16)
  struct Entry;  // a parameter or buffer with its dotted name and owner (module.cpp)
  void collect_entries(const std::string& path, std::vector<Entry>& out);
  void check_inputs(const TensorList& tensors, const char* what, bool allow_undefined) const;

  // deques: a Parameter's or buffer's address never changes once registered, so layers and
  // optimizers may keep Parameter* and Tensor* (never the raw data pointers inside them).
  std::deque<std::pair<std::string, Parameter>> params_;
  std::deque<std::pair<std::string, Tensor>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// Writes module.repr(): std::cout << *model prints the model as PyTorch's print(model) does.
std::ostream& operator<<(std::ostream& out, const Module& module);

namespace detail {
// The bias hand-off (Module::request_input_grad_sums) on (the default) or off for every Sequential
// in the process: to compare, as bench_train --bias-handoff does. Off, each layer takes its bias
// gradient in a pass of its own, as before the hand-off.
void set_bias_handoff(bool on);
bool bias_handoff();
// BatchNorm2d's mask hand-off (its fused ReLU's mask done by the layer after it) on (the default)
// or off for every BatchNorm2d: to compare, as bench_train --bn-mask-handoff does. Off, BatchNorm
// keeps its output and masks in its own backward, as before.
void set_batchnorm_mask_handoff(bool on);
bool batchnorm_mask_handoff();
// The parameter store's bf16 copies (NOTE [The parameter store]) made by flatten_parameters (the
// default) or not, for models flattened after the call: to compare, as bench_train --param-store
// does. Off, Conv2d and Linear convert their weights at every forward, as before the store.
void set_parameter_store(bool on);
bool parameter_store();
// A convolution's or linear layer's backward-weight on a second stream beside its backward-data,
// so that the two products, independent of each other, share the GPU where one alone leaves SMs
// idle; joined before the layer's backward returns. For layers of at most `max_rows` output rows
// (batch x height x width; a linear layer's batch): 0 never (one after the other on the layer's
// stream), a negative bound always. The same kernels, so the same bits whatever the bound; the
// default is in module.cpp with its measurement. For comparisons (bench_train --wgrad-stream).
void set_concurrent_weight_grad(int64_t max_rows);
int64_t concurrent_weight_grad_rows();
// Whether a layer of `rows` output rows takes its backward-weight beside its backward-data.
bool concurrent_weight_grad(int64_t rows);
}  // namespace detail

}  // namespace cudp
