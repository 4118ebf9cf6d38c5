// Optimizers (SGD, AdamW) and gradient clipping with PyTorch's formulas (torch.optim with one
// parameter group; kernels/optim.h reproduces the for-each path's fp32 arithmetic step by step):
//
//   SGD     g = grad + weight_decay * p
//           b = g on the first step, else momentum * b + (1 - dampening) * g    (when momentum !=
//           0) g = g + momentum * b if nesterov, else b                             (when momentum
//           != 0) p = p - lr * g
//   AdamW   t = t + 1
//           p = p * (1 - lr * weight_decay)
//           m = beta1 * m + (1 - beta1) * grad,   v = beta2 * v + (1 - beta2) * grad^2
//           p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// An optimizer holds Parameter* (whose addresses are stable, layers/module.h) and reads each
// parameter's data and grad tensors anew at every step, because flatten_parameters() re-points
// them. State (momentum buffers; exp_avg and exp_avg_sq) is created on the first step, as PyTorch
// does, on the parameter's device, in fp32. CUDA parameters are updated by kernels/optim.h on the
// device's current stream with no host synchronisation; CPU parameters by the same formulas'
// references.
//
// One launch for the whole model: when the parameters are consecutive views into one buffer and so
// are their gradients (Module::flatten_parameters), the state is allocated as one buffer too and
// step() updates everything with one kernel launch instead of one per parameter (the alignment
// padding between flat parameters is zero and every update keeps it zero). The same launch writes
// the parameters' bf16 compute copies where they have them (layers/module.h, NOTE [The parameter
// store]), so that a bf16 model's next forward reads its weights without a conversion pass.
// Otherwise (or when the parameters were flattened after the state was created) it runs per
// parameter; the results are identical either way, because every element's update depends on that
// element alone.
//
// Skipping a step on the device (--on-nan skip-step with no host synchronisation per step):
// step(skip) takes a flag the device writes (nonfinite_flag: the step's loss or gradient norm is
// not finite) and the update kernels read it; when it is set the step changes nothing -- no
// parameter, no state element, and no step count (steps(), AdamW's "step", SGD's first step). The
// host issues every step without knowing which the device skipped, so it counts the steps it
// issued, and the device keeps the count of skipped ones (two int64 on the parameters' device) and
// corrects the issued counts by the skips the host has not yet read (kernels/optim.h, StepGate).
// The host reads that count, and folds it into its own, when it asks for a count (steps(),
// skipped_steps(), state_dict(), hyperparameters()) or loads state: those calls wait for the device
// after a gated step, as reading any result of the step would. The CPU path runs the same
// bookkeeping on host memory.
//
// The update beside the backward (set_update_overlap, NOTE [The update beside the backward] in
// optim.cpp): with flat parameters whose gradients a reducer completes bucket by bucket
// (engine/parallel/reducer.h), step() updates each bucket on a stream of the optimizer's own as
// soon as the backward has completed it, while the rest of the backward still runs; the current
// stream waits for all of them at the end of step(). The same bits as one launch (every element's
// update depends on that element alone), the same counts.
//
// State export (checkpoints): state_dict() returns CPU tensors named "<i>.<name>", with i the index
// of the parameter in the list the optimizer was built with (as in PyTorch's optimizer state_dict),
// or "<parameter name>.<name>" when the caller passes the names (layers/checkpoint.h does), and
// PyTorch's state names: "momentum_buffer" (SGD), "exp_avg", "exp_avg_sq", "step" (AdamW, a 0-d f32
// as PyTorch keeps it). A parameter without state has no entries (SGD before its first step or with
// momentum 0). hyperparameters() gives the options as exact strings for a checkpoint's metadata.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/core/stream.h"
#include "kernels/optim.h"
#include "layers/module.h"
#include "layers/safetensors.h"

namespace cudp {

// A piece of the flat gradient buffer that a backward completes at once (a gradient reducer's
// bucket): elements [begin, end) of the buffer at `buffer` (Module::flatten_parameters; the piece
// starts where a parameter starts), final once the work before `ready` has run (an event recorded
// on the parameters' device; null on the CPU, where everything has run).
struct GradientSegment {
  const float* buffer = nullptr;
  int64_t begin = 0, end = 0;
  cudaEvent_t ready = nullptr;
};
// What an optimizer asks at each step() for the pieces of the backward before it, in the order
// they become final; empty: none this step (no backward through the reducer since the last ask:
// one update after it). A source gives each backward's pieces once.
using GradientSegments = std::function<std::vector<GradientSegment>()>;

// How Optimizer::zero_grad leaves the gradients (see there).
enum class ZeroGrad {
  fill,      // every gradient written with zeros now (PyTorch's zero_grad(set_to_none=False))
  deferred,  // written by the next backward where its layer can (as set_to_none=True saves)
};

class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  Optimizer(Optimizer&&) = delete;  // schedules and checkpoints hold references to it
  Optimizer& operator=(Optimizer&&) = delete;

  virtual std::string type_name() const = 0;  // "SGD", "AdamW"

  // Zeroes every gradient on its device's current stream (no host synchronisation); one memset for
  // flat parameters. ZeroGrad::deferred leaves the gradients that their layer's backward writes
  // whole (Conv2d's and Linear's weights, Linear's bias) to that backward, which then writes them
  // instead of adding to zeros: no memset of them and no read of them (layers/module.h, NOTE
  // [Deferred zeroing]); the rest are zeroed in one launch. Until that backward runs those
  // gradients count as zero, and their tensors' contents are unspecified: step(), clip_grad_norm
  // and grad_norm zero any still pending first.
  void zero_grad(ZeroGrad how = ZeroGrad::fill);
  // One update of every parameter. Checks first that each gradient matches its parameter.
  void step();
  // The same update, skipped on the device when `skip` (one i32 element on the parameters' device,
  // nonfinite_flag makes it) is nonzero there: then nothing changes, step counts included. The
  // host does not wait (see above). All parameters must be on the flag's device.
  void step(const Tensor& skip);
  // The same update as step(), and grad_norm(params()) of the gradients it read, the same bits:
  // computed by the update's own launch as it reads the gradients (kernels/optim.h, sgd_step's
  // grad_norm) where the step is one launch over flat parameters (Module::flatten_parameters;
  // not while the update runs beside the backward), so that a training step that logs the norm
  // (or checks it for divergence after the step) does not read every gradient a second time;
  // otherwise by grad_norm() after the update. A 0-d f32 tensor on the parameters' device (a CPU
  // zero for no parameters, as grad_norm); nothing waits for the device. The parameters must be on
  // one device, as for grad_norm (checked before the update). A step that needs the norm before
  // it updates (clipping, step(skip) on a flag made from it) takes grad_norm or clip_grad_norm
  // first instead.
  Tensor step_and_grad_norm();
  // Whether the last step_and_grad_norm() had its update compute the norm (one launch did both);
  // false after a step() or step(skip). A replay of a captured step keeps the capture's answer.
  bool last_norm_was_fused() const { return last_norm_fused_; }
  // The steps skipped so far by step(skip). Waits for the device after a gated step since the last
  // read.
  int64_t skipped_steps() const;

  double lr() const { return lr_; }
  void set_lr(double lr);
  // The momentum a OneCycleLR schedule cycles: SGD's momentum, AdamW's beta1.
  virtual double momentum() const = 0;
  virtual void set_momentum(double momentum) = 0;

  const std::vector<Parameter*>& params() const { return params_; }
  // Steps taken so far: step() calls, less those step(skip) skipped (this optimizer's, or restored
  // by load_hyperparameters). Waits for the device after a gated step since the last read.
  int64_t steps() const;
  // Whether the last step() updated every parameter with one launch (flat parameters), or with
  // one launch per piece of the gradient buffer beside the backward (last_step_overlapped()).
  bool last_step_was_flat() const { return last_step_flat_; }

  // The update beside the backward (see above): from now on, step() asks `segments` for the pieces
  // of the backward before it and updates each after its event, on a stream of this optimizer's
  // own, when the parameters are flat, the step is not gated (step(skip) decides after the whole
  // backward), no gradient was left pending (NOTE [Deferred zeroing]) and the state exists already
  // (the first step makes it); otherwise, and when `segments` gives none, it takes the one launch
  // after everything, with the same results. An empty function turns it off. While it is on,
  // nothing may change the gradients between the backward and step(): clip_grad_norm refuses
  // these parameters (it would scale gradients that an update may already have read), and a
  // caller's own writes to them there (zeroing, scaling) are not seen by the pieces.
  // It asks `segments` once at every step() that is not a replay (a step that cannot overlap uses
  // the buckets up all the same) and once here, so that no step finds buckets an earlier update
  // has used. Replicated::set_update_overlap (engine/parallel/data_parallel.h) gives every
  // replica's optimizer its wrapper's buckets.
  void set_update_overlap(GradientSegments segments);
  bool update_overlap() const { return static_cast<bool>(overlap_); }
  // Whether the last step() updated piece by piece beside the backward.
  bool last_step_overlapped() const { return last_step_overlapped_; }

  // Snapshots (fresh CPU tensors) of the state, named "<i>.<state>" (see above), or
  // "<param_names[i]>.<state>" when the parameters' names are given (one per parameter).
  TensorMap state_dict(const std::vector<std::string>& param_names = {}) const;
  // The same entries as private copies where the state lives: on a GPU, device to device on the
  // current stream, not waited for (layers/checkpoint.h's stage_checkpoint brings them to the host
  // on another thread once that stream has done them).
  TensorMap state_copy(const std::vector<std::string>& param_names = {}) const;
  // Replaces the state with `state` as state_dict(param_names) wrote it. Every key must name a
  // parameter and a state this optimizer keeps, each tensor must have its parameter's shape (a
  // step: one whole number >= 1), and a parameter has either all of its state or none. Everything
  // is validated before anything changes; errors name the key. Tensors are copied to the
  // parameters' devices.
  void load_state_dict(const TensorMap& state, const std::vector<std::string>& param_names = {});
  // The options ("lr", "momentum", ...) and "steps", as exact strings, for a checkpoint's metadata.
  virtual Metadata hyperparameters() const = 0;
  // Restores lr() and steps() from what hyperparameters() wrote, as PyTorch's load_state_dict
  // restores a group's lr. The other options stay as constructed (they are choices of the run, and
  // a schedule sets the momentum it cycles). An lr that is not a finite number >= 0, or steps that
  // are not a whole number >= 0, is a ValueError naming the key; nothing changes then.
  void load_hyperparameters(const Metadata& hyperparameters);

 protected:
  Optimizer(std::vector<Parameter*> params, double lr);

  // What one update() call covers: parameters [first, first + count), as fp32 pointers over n
  // elements: one parameter, or all of them in one flat buffer (alignment padding included, which
  // is zero and stays zero). state[k] points at state_names()[k] over the same range. The device is
  // current; `stream` is its current stream (null on the CPU). `gate` goes to the kernels as it is
  // (kernels/optim.h): the counts update() passes are the ones issued, and the kernels correct them
  // by the skips not yet folded. update() advances its counts as if the step were taken.
  struct Update {
    Device device;
    cudaStream_t stream;
    float* param;
    const float* grad;
    std::vector<float*> state;
    int64_t n;
    size_t first, count;
    kernels::StepGate gate;
    // A captured step (engine/core/graph.h NOTE [Replay scalars]): `device_scalars` is the slot
    // the kernel reads this step's scalars from (kernels/optim.h, SgdScalars, AdamWScalars) and
    // `stage` its host copy, which update() fills. Before a replay update() is called with `stage`
    // alone: it fills it and launches nothing. Both null: an eager step.
    void* device_scalars = nullptr;
    void* stage = nullptr;
    // The bf16 compute copy of the same range, written in the same launch (layers/module.h, NOTE
    // [The parameter store]), or null.
    __nv_bfloat16* compute = nullptr;
    // Where the launch also writes the 2-norm of the range's gradient (step_and_grad_norm: one
    // launch over the whole flat buffer), or null.
    float* grad_norm = nullptr;
  };
  virtual void update(const Update& u) = 0;
  // The bytes of the scalars a captured update reads (sizeof SgdScalars or AdamWScalars).
  virtual size_t scalar_bytes() const = 0;
  // Whether a step now advances per-parameter state (AdamW: always; SGD: with momentum), so that a
  // skip of it counts against the counts the kernels correct.
  virtual bool advances_state() const = 0;
  // Of the steps that advanced the state since the last fold, `issued` were issued and `skipped` of
  // those skipped: bring the per-parameter counts to the steps taken.
  virtual void fold_counts(int64_t issued, int64_t skipped) = 0;
  // Steps that advanced the state issued since the last fold (counted in no per-parameter count of
  // SGD's yet).
  int64_t advancing_steps_unfolded() const { return advancing_since_fold_; }

  // The per-parameter fp32 state tensors, shaped like the parameter (none: {}). May change with the
  // options (SGD keeps a momentum buffer only with momentum != 0).
  virtual std::vector<std::string> state_names() const = 0;
  // Whether parameter i has state yet (PyTorch creates it on the first step).
  virtual bool has_state(size_t i) const = 0;
  // Whether update() may cover parameters [0, size) at once (their bookkeeping agrees).
  virtual bool uniform_state() const = 0;
  // Scalar state beyond state_names(): step counts (AdamW's "step"), exported as 0-d f32 tensors;
  // load_state_dict checks that each holds a whole number >= 1 before import_state sees it.
  virtual std::vector<std::string> scalar_state_names() const { return {}; }
  virtual Tensor export_scalar_state(size_t i, const std::string& name) const { return {}; }
  // Called for every parameter by load_state_dict, after validation: `present` says whether the
  // parameter has state in the loaded dict; `state` and `prefix` ("<i>.") give access to it.
  virtual void import_state(size_t i, bool present, const TensorMap& state,
                            const std::string& prefix) = 0;

  // lr and the other doubles, printed so that they read back exactly.
  static std::string exact(double value);

  double lr_;

 private:
  void check_gradients() const;
  void allocate_state();
  // One step: launched (eager, or captured into a graph when a capture is open on the parameters'
  // device), or, before a replay of a captured step, its host side alone (Issue::Stage): the same
  // checks and counts, and the new scalars written into the slots the capture took.
  enum class Issue { Launch, Stage };
  // grad_norm: step_and_grad_norm's output, written by the update where it is one launch over flat
  // parameters (then last_norm_fused_), else left to the caller.
  void take_step(const Tensor* skip, Issue issue = Issue::Launch, float* grad_norm = nullptr);
  // Brings the host's counts to the steps taken: reads the device's skip counts when a gated step
  // ran since the last fold (waiting for it) and takes the new skips out. Logically const: the
  // accessors report the counts it corrects.
  void fold_skips() const;
  std::string key_prefix(size_t i, const std::vector<std::string>& param_names) const;
  // state_dict's and state_copy's walk: every state entry as `copy` makes it, with its key.
  TensorMap collect_state(const std::vector<std::string>& param_names,
                          const std::function<Tensor(const Tensor&)>& copy) const;
  // Runs update(u) on u.device (made current, with its current stream filled in).
  void dispatch(Update u);

  std::vector<Parameter*> params_;
  // state_[k][i]: state tensor state_names()[k] of parameter i: its own, or a view into
  // flat_state_[k] when the parameters were flat when the state was created.
  std::vector<std::vector<Tensor>> state_;
  std::vector<Tensor> flat_state_;
  std::vector<int64_t> flat_offsets_;  // the parameters' offsets flat_state_ mirrors
  int64_t steps_ = 0;  // issued; fold_skips takes the skipped ones out
  bool last_step_flat_ = false;
  bool last_norm_fused_ = false;
  // Gated steps: skip_counts_ (two int64 on the parameters' device, undefined before the first
  // gated step) holds [0] the steps skipped, [1] those of them that advanced the state; folded_
  // the values already taken out of the host's counts; gated_since_fold_ whether they may differ.
  Tensor skip_counts_;
  int64_t folded_[2] = {0, 0};
  bool gated_since_fold_ = false;
  int64_t advancing_since_fold_ = 0;
  // The last captured step: the host copies of its scalar slots, in dispatch order, and whether it
  // was gated (step(skip)).
  std::vector<void*> captured_slots_;
  bool captured_gated_ = false;
  // The update beside the backward: the source of the pieces; one piece's update (parameters
  // [first, first + count), elements [begin, begin + n) of the flat buffers); the pieces of the
  // last captured step, which a replay's staging walks again; the stream the pieces go to and the
  // event the current stream waits on after them (made on the parameters' device at first use).
  struct Piece {
    int64_t begin = 0, n = 0;
    size_t first = 0, count = 0;
    cudaEvent_t ready = nullptr;
  };
  std::vector<Piece> plan_pieces(const std::vector<int64_t>& offsets, int64_t n, const float* grad,
                                 Device device) const;
  GradientSegments overlap_;
  std::vector<Piece> captured_pieces_;
  cuda::Stream overlap_stream_;
  cuda::Event overlap_done_;
  bool last_step_overlapped_ = false;
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  // Validates as torch.optim.SGD does, with its messages ("Invalid momentum value: -1").
  SGD(std::vector<Parameter*> params, const SGDOptions& options);
  std::string type_name() const override { return "SGD"; }
  double momentum() const override { return options_.momentum; }
  void set_momentum(double momentum) override;
  const SGDOptions& options() const { return options_; }
  Metadata hyperparameters() const override;

 protected:
  void update(const Update& u) override;
  size_t scalar_bytes() const override { return sizeof(kernels::SgdScalars); }
  bool advances_state() const override { return options_.momentum != 0; }
  void fold_counts(int64_t issued, int64_t skipped) override;
  std::vector<std::string> state_names() const override;
  bool has_state(size_t i) const override {
    return started_[i] || advancing_steps_unfolded() > 0;
  }
  bool uniform_state() const override;
  void import_state(size_t i, bool present, const TensorMap& state,
                    const std::string& prefix) override;

 private:
  SGDOptions options_;
  // Parameter i's momentum buffer has history (PyTorch: it is not None), as of the last fold
  // (advancing_steps_unfolded() updates were issued to every buffer since).
  std::vector<bool> started_;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

class AdamW : public Optimizer {
 public:
  // Validates as torch.optim.AdamW does, with its messages ("Invalid beta parameter at index 0").
  AdamW(std::vector<Parameter*> params, const AdamWOptions& options);
  std::string type_name() const override { return "AdamW"; }
  double momentum() const override { return options_.beta1; }
  void set_momentum(double beta1) override;
  const AdamWOptions& options() const { return options_; }
  Metadata hyperparameters() const override;

 protected:
  void update(const Update& u) override;
  size_t scalar_bytes() const override { return sizeof(kernels::AdamWScalars); }
  bool advances_state() const override { return true; }
  void fold_counts(int64_t issued, int64_t skipped) override;
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  bool has_state(size_t i) const override { return step_[i] > 0; }
  bool uniform_state() const override;
  std::vector<std::string> scalar_state_names() const override { return {"step"}; }
  Tensor export_scalar_state(size_t i, const std::string& name) const override;
  void import_state(size_t i, bool present, const TensorMap& state,
                    const std::string& prefix) override;

 private:
  AdamWOptions options_;
  std::vector<int64_t> step_;  // PyTorch's per-parameter "step", as issued (see fold_skips)
};

// A one-element i32 tensor on `loss`'s device, written there without a host read: 1 when the loss
// or the gradient norm (one-element f32 tensors on one device; `norm` may be undefined) is NaN or
// infinite, else 0. The flag Optimizer::step(skip) takes.
Tensor nonfinite_flag(const Tensor& loss, const Tensor& norm = {});

// Scales every gradient by min(1, max_norm / (total_norm + 1e-6)) with total_norm the 2-norm of all
// gradients together (torch.nn.utils.clip_grad_norm_ with norm_type 2), and returns total_norm as a
// 0-d f32 tensor on the parameters' device (a CPU zero for an empty list). On CUDA nothing waits
// for the device: the norm is reduced and the factor applied on the stream, read from device
// memory (read the returned tensor to synchronise). All parameters must be on one device. Flat
// parameters take one reduction over the buffer; others the norm of the per-parameter norms, as
// PyTorch computes it (the two agree to rounding). A non-finite norm is returned as is and the
// gradients are scaled by the factor it gives (NaN for a NaN norm), as PyTorch does with
// error_if_nonfinite=False.
Tensor clip_grad_norm(const std::vector<Parameter*>& params, double max_norm);

// The 2-norm of all gradients together, as clip_grad_norm computes and returns it, without scaling
// anything (torch.nn.utils.get_total_norm of the gradients): what a training step reads to detect
// divergence when it does not clip. On CUDA nothing waits for the device.
Tensor grad_norm(const std::vector<Parameter*>& params);

}  // namespace cudp
