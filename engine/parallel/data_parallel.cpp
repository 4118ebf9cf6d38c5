#include "engine/parallel/data_parallel.h"

#include "engine/parallel/stats_group.h"
#include "layers/sync_batchnorm.h"

#include <iostream>
#include <map>
#include <mutex>
#include <numeric>
#include <unordered_map>

#include "engine/core/memory.h"
#include "engine/core/nvtx.h"
#include "engine/core/stream.h"

namespace cudp::parallel {
namespace {

std::vector<int> all_devices() {
  std::vector<int> ids(static_cast<size_t>(cuda::device_count()));
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

// -1 (the CPU) or a visible device.
void check_output_device(int output_device, const char* what) {
  if (output_device == -1) return;
  try {
    cuda::check_device(output_device);
  } catch (const ValueError& e) {
    throw ValueError(detail::str(what, ": output_device: ", e.message(), "; -1 names the CPU"),
                     e.file(), e.line());
  }
}

// PyTorch's _check_balance, printed once per process.
void warn_imbalance(const std::vector<int>& device_ids) {
  if (device_ids.size() < 2) return;
  std::vector<cuda::DeviceProperties> properties;
  for (const int id : device_ids) properties.push_back(cuda::get_device_properties(id));
  if (const auto warning = cuda::imbalance_warning(properties)) {
    static std::once_flag warned;
    std::call_once(warned, [&] { std::cerr << "Warning: " << *warning << "\n"; });
  }
}

// Checks inputs to be split along `dim` and returns the batch size.
int64_t batch_size(const TensorList& inputs, int dim, const char* what) {
  CUDP_CHECK(!inputs.empty(), what, ": forward needs at least one input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    CUDP_CHECK(inputs[i].defined(), what, ": input ", i, " is undefined");
    CUDP_CHECK(inputs[i].dim() >= 1, what, ": input ", i, " is ", inputs[i].str(),
               ", a scalar; inputs are split along dim ", dim, " and need at least one dimension");
  }
  CUDP_CHECK(dim == 0, what, ": dim ", dim,
             " is not supported yet: inputs are split along dim 0 "
             "(the batch) only");
  const int64_t batch = inputs[0].size(0);
  CUDP_CHECK(batch > 0, what, ": input 0 (", inputs[0].str(),
             ") is an empty batch: there is "
             "nothing to split across devices");
  for (size_t i = 1; i < inputs.size(); ++i) {
    CUDP_CHECK(inputs[i].size(0) == batch, what, ": input ", i, " (", inputs[i].str(), ") has ",
               inputs[i].size(0), " rows along dim 0 but input 0 (", inputs[0].str(), ") has ",
               batch, "; every input is split into the same chunks");
  }
  return batch;
}

// Scatters `inputs` over the set's devices (torch.chunk), runs each replica that got a chunk on its
// worker, and, in training, synchronises buffers. Returns the outputs of those replicas; `sizes`
// receives the chunk sizes.
std::vector<TensorList> replicated_forward(ReplicaSet& set, const TensorList& inputs, int dim,
                                           BufferSync sync, const char* what,
                                           std::vector<int64_t>& sizes,
                                           StatsGroup* group = nullptr) {
  const int64_t batch = batch_size(inputs, dim, what);
  sizes = chunk_sizes(batch, static_cast<int>(set.size()));
  const size_t used = sizes.size();
  const std::vector<int> ids(set.devices().begin(),
                             set.devices().begin() + static_cast<long>(used));
  std::vector<TensorList> replica_inputs(used);
  for (const Tensor& input : inputs) {
    const TensorList chunks = scatter(input, ids, sizes, dim);
    for (size_t i = 0; i < used; ++i) replica_inputs[i].push_back(chunks[i]);
  }
  set.keep_until_copied(inputs);  // a pinned host batch is read asynchronously
  set.prepare_forward();
  std::vector<TensorList> outputs(used);
  if (group) group->reset();
  set.workers().run(used, [&](size_t i) {
    const cuda::AllocationPurpose purpose(detail::str("replica ", i, "'s forward on cuda:", ids[i],
                                                      " (activations of ", sizes[i],
                                                      " of the batch's ", batch, " rows)"));
    try {
      outputs[i] = set.replica(i)->forward_all(replica_inputs[i]);
    } catch (const std::exception& e) {
      // The other replicas' synchronised layers would wait for this one until the timeout.
      if (group) group->abort(detail::str("replica ", i, "'s forward failed: ", e.what()));
      throw;
    }
  });
  for (size_t i = 1; i < used; ++i) {
    CUDP_CHECK(outputs[i].size() == outputs[0].size(), what, ": replica ", i, " returned ",
               outputs[i].size(), " outputs but replica 0 returned ", outputs[0].size());
  }
  if (sync == BufferSync::Broadcast && set.replica(0)->is_training()) set.broadcast_buffers();
  return outputs;
}

TensorList gather_outputs(const std::vector<TensorList>& outputs, int output_device, int dim) {
  TensorList gathered;
  for (size_t j = 0; j < outputs[0].size(); ++j) {
    TensorList parts;
    for (const TensorList& out : outputs) parts.push_back(out[j]);
    gathered.push_back(gather(parts, output_device, dim));
  }
  return gathered;
}

}  // namespace

// ---- DataParallel -------------------------------------------------------------------------------

DataParallel::DataParallel(std::shared_ptr<Module> module)
    : DataParallel(std::move(module), std::nullopt, DataParallelOptions{}, 0) {}

DataParallel::DataParallel(std::shared_ptr<Module> module, std::vector<int> device_ids,
                           std::optional<int> output_device, int dim)
    : DataParallel(std::move(module), std::move(device_ids),
                   DataParallelOptions{
                       .output_device = output_device, .communicator = nullptr, .reducer = {}},
                   dim) {}

DataParallel::DataParallel(std::shared_ptr<Module> module, std::vector<int> device_ids,
                           DataParallelOptions options)
    : DataParallel(std::move(module), std::optional(std::move(device_ids)), std::move(options), 0) {
}

DataParallel::DataParallel(std::shared_ptr<Module> module,
                           std::optional<std::vector<int>> device_ids, DataParallelOptions options,
                           int dim)
    : module_(std::move(module)), dim_(dim) {
  CUDP_CHECK(module_ != nullptr, "DataParallel: the module is null");
  CUDP_CHECK(dynamic_cast<DataParallel*>(module_.get()) == nullptr,
             "DataParallel: the module is a DataParallel already");
  CUDP_CHECK(dim == 0, "DataParallel: dim ", dim,
             " is not supported yet: inputs are split along "
             "dim 0 (the batch) only");
  register_module("module", module_);
  training_ = module_->is_training();
  if (!device_ids && cuda::device_count() == 0) {
    device_ = module_->device();  // no GPU: run the module as it is, as PyTorch does
    return;
  }
  device_ids_ = device_ids ? *device_ids : all_devices();
  check_device_ids(device_ids_, "DataParallel");
  output_device_ = options.output_device.value_or(device_ids_[0]);
  check_output_device(output_device_, "DataParallel");
  warn_imbalance(device_ids_);
  set_ = std::make_unique<ReplicaSet>(module_, device_ids_, std::move(options.communicator),
                                      options.reducer);
  device_ = output_device_ < 0 ? Device::cpu() : Device::cuda(output_device_);
  if (set_->communicator()) {
    auto group = std::make_shared<CommStatsGroup>(set_->shared_communicator());
    size_t layers = 0;
    for (size_t r = 0; r < set_->size(); ++r) {
      layers = attach_stats_group(*set_->replica(r), group, r);
    }
    if (layers > 0) stats_group_ = std::move(group);
  }
}

DataParallel::~DataParallel() {
  // The module outlives its wrapper: its layers leave the replicas' group (they are BatchNorm2d
  // again until wrapped anew).
  if (stats_group_) attach_stats_group(*module_, nullptr, 0);
}

void DataParallel::set_reducer_options(ReducerOptions options) {
  CUDP_CHECK(options.bucket_cap_bytes > 0, "DataParallel: bucket_cap_bytes must be positive, got ",
             options.bucket_cap_bytes);
  if (set_) set_->set_reducer_options(options);
}

ReducerOptions DataParallel::reducer_options() const {
  return set_ ? set_->reducer_options() : ReducerOptions{};
}

std::shared_ptr<Module> DataParallel::make_empty_copy() const {
  CUDP_THROW(ValueError,
             "DataParallel cannot be cloned (it owns devices, threads and a NCCL "
             "communicator): clone its module() and wrap the copy in a new DataParallel");
}

TensorList DataParallel::forward_all(const TensorList& inputs) {
  const nvtx::Range range("DataParallel forward");
  forward_done_ = false;
  TensorList outputs = forward_impl(inputs);
  forward_done_ = true;
  return outputs;
}

std::vector<int> DataParallel::used_devices() const {
  return {device_ids_.begin(), device_ids_.begin() + static_cast<long>(sizes_.size())};
}

std::vector<TensorList> DataParallel::run_forward(const TensorList& inputs) {
  replicas_ran_ = false;
  module_->set_input_grad(input_grad_);
  for (size_t i = 0; set_ && i < set_->devices().size(); ++i) {
    set_->replica(i)->set_input_grad(input_grad_);
  }
  std::vector<TensorList> outputs;
  if (!set_) {
    sizes_ = {batch_size(inputs, dim_, "DataParallel")};
    outputs = {module_->forward_all(inputs)};
  } else {
    if (stats_group_ && module_->is_training()) {
      const int64_t batch = batch_size(inputs, dim_, "DataParallel");
      const size_t used = parallel::chunk_sizes(batch, static_cast<int>(set_->size())).size();
      CUDP_CHECK(used == set_->size(), "DataParallel: a training batch of ", batch,
                 " rows reaches only ", used, " of the ", set_->size(),
                 " replicas, but the module has synchronised batch norm layers (SyncBatchNorm), "
                 "in which every replica takes part in each training forward; use batches of at "
                 "least ",
                 set_->size(), " rows (drop the last, smaller batch) or fewer devices");
    }
    outputs = replicated_forward(*set_, inputs, dim_, buffer_sync_, "DataParallel", sizes_,
                                 stats_group_.get());
  }
  input_devices_.clear();
  for (const Tensor& input : inputs) input_devices_.push_back(input.device());
  replica_output_shapes_.clear();
  for (const TensorList& out : outputs) {
    std::vector<Shape> shapes;
    for (const Tensor& t : out) shapes.push_back(t.defined() ? t.shape() : Shape{});
    replica_output_shapes_.push_back(std::move(shapes));
  }
  replicas_ran_ = true;
  return outputs;
}

std::vector<TensorList> DataParallel::forward_replicas(const TensorList& inputs) {
  forward_done_ = false;
  std::vector<TensorList> outputs = run_forward(inputs);
  forward_done_ = true;
  return outputs;
}

TensorList DataParallel::forward_impl(const TensorList& inputs) {
  if (!set_) return run_forward(inputs)[0];
  return gather_outputs(run_forward(inputs), output_device_, dim_);
}

std::vector<TensorList> DataParallel::run_backward(const std::vector<TensorList>& replica_grads) {
  if (!set_) return {module_->backward_all(replica_grads[0])};
  const size_t used = sizes_.size();
  // Zeroes the mirrors when they hold the last total (NOTE [Replica gradients are scratch]) and
  // arms the reducer: buckets are all-reduced as the replicas' backward completes them.
  set_->begin_backward(used, gradient_sync_);
  std::vector<TensorList> input_grads(used);
  if (stats_group_) stats_group_->reset();
  try {
    set_->workers().run(used, [&](size_t i) {
      const cuda::AllocationPurpose purpose(
          detail::str("replica ", i, "'s backward on cuda:", device_ids_[i], " (gradients of its ",
                      sizes_[i], " rows)"));
      try {
        input_grads[i] = set_->replica(i)->backward_all(replica_grads[i]);
      } catch (const std::exception& e) {
        if (stats_group_) {
          stats_group_->abort(detail::str("replica ", i, "'s backward failed: ", e.what()));
        }
        throw;
      }
    });
  } catch (...) {
    set_->abandon_backward();
    throw;
  }
  return input_grads;
}

TensorList DataParallel::backward_impl(const TensorList& grad_outputs) {
  CUDP_CHECK(replicas_ran_, "DataParallel: backward() called without a forward() before it");
  if (!set_) return module_->backward_all(grad_outputs);
  const size_t used = sizes_.size();
  const std::vector<Shape>& shapes = replica_output_shapes_[0];
  CUDP_CHECK(grad_outputs.size() == shapes.size(), "DataParallel: ", grad_outputs.size(),
             " output gradients for ", shapes.size(), " outputs");
  const std::vector<int> ids = used_devices();
  std::vector<TensorList> replica_grads(used);
  for (size_t j = 0; j < grad_outputs.size(); ++j) {
    const Tensor& grad = grad_outputs[j];
    if (!grad.defined()) {  // an unused output: undefined for every replica
      for (TensorList& g : replica_grads) g.emplace_back();
      continue;
    }
    // The gathered output's shape: rows summed over replicas (or one per replica for scalars).
    const bool scalar = shapes[j].empty();
    Shape expected = scalar ? Shape{static_cast<int64_t>(used)} : shapes[j];
    if (!scalar) {
      expected[0] = 0;
      for (const auto& s : replica_output_shapes_) expected[0] += s[j][0];
    }
    CUDP_CHECK(grad.shape() == expected, "DataParallel: grad_output ", j, " has shape ",
               shape_str(grad.shape()), " but output ", j, " of the forward had shape ",
               shape_str(expected));
    std::vector<int64_t> rows;
    for (const auto& s : replica_output_shapes_) rows.push_back(scalar ? 1 : s[j][0]);
    const TensorList parts = scatter(grad, ids, rows, dim_);
    for (size_t i = 0; i < used; ++i)
      replica_grads[i].push_back(scalar ? parts[i].view({}) : parts[i]);
  }
  set_->keep_until_copied(grad_outputs);  // output_device -1: gradients may be pinned host tensors
  const std::vector<TensorList> input_grads = run_backward(replica_grads);

  // Input gradients go back to the inputs' devices (not to the host: see the header). They are
  // gathered before compute is made to wait for the last bucket of the all-reduce (NOTE [Comm
  // stream ordering and memory lifetime]), so the gather's copies do not queue behind it.
  TensorList result;
  try {
    for (size_t j = 0; j < input_devices_.size(); ++j) {
      TensorList parts;
      bool defined = input_devices_[j].is_cuda();
      for (size_t i = 0; i < used && defined; ++i) {
        defined = j < input_grads[i].size() && input_grads[i][j].defined();
        if (defined) parts.push_back(input_grads[i][j]);
      }
      result.push_back(defined ? gather(parts, input_devices_[j].index, dim_) : Tensor());
    }
  } catch (...) {
    set_->abandon_backward();
    throw;
  }
  set_->end_backward(gradient_sync_);
  return result;
}

std::vector<TensorList> DataParallel::backward_replicas(
    const std::vector<TensorList>& grad_outputs) {
  CUDP_CHECK(forward_done_ && replicas_ran_,
             "DataParallel: backward_replicas() called without a "
             "forward before it");
  CUDP_CHECK(grad_outputs.size() == sizes_.size(),
             "DataParallel: backward_replicas got gradients for ", grad_outputs.size(),
             " replicas, but ", sizes_.size(), " ran the forward");
  for (size_t i = 0; i < grad_outputs.size(); ++i) {
    const Device device = set_ ? Device::cuda(device_ids_[i]) : module_->device();
    CUDP_CHECK(grad_outputs[i].size() == replica_output_shapes_[i].size(), "DataParallel: replica ",
               i, " got ", grad_outputs[i].size(), " output gradients for ",
               replica_output_shapes_[i].size(), " outputs");
    for (size_t j = 0; j < grad_outputs[i].size(); ++j) {
      const Tensor& g = grad_outputs[i][j];
      if (!g.defined()) continue;
      check_device_of(g, device, "DataParallel: gradient of replica ", i, "'s output ", j);
      check_shape_of(g, replica_output_shapes_[i][j], "DataParallel: gradient of replica ", i,
                     "'s output ", j);
    }
  }
  std::vector<TensorList> input_grads = run_backward(grad_outputs);
  if (set_) set_->end_backward(gradient_sync_);
  forward_done_ = false;  // as Module::backward_all: a second backward needs a new forward
  return input_grads;
}

std::vector<Tensor> flag_on_devices(const Tensor& flag, const std::vector<Device>& devices,
                                    std::vector<Tensor>& copies) {
  CUDP_CHECK(flag.defined(), "flag_on_devices: the flag is undefined");
  copies.resize(devices.size());
  std::vector<Tensor> out;
  std::vector<cuda::Event> copied;
  for (size_t r = 0; r < devices.size(); ++r) {
    const Device device = devices[r];
    if (device == flag.device()) {
      out.push_back(flag);
      continue;
    }
    CUDP_CHECK(device.is_cuda() && flag.device().is_cuda(), "flag_on_devices: the flag is on ",
               flag.device(), " and replica ", r, " on ", device,
               "; the replicas of a step are all on GPUs or all on the CPU");
    Tensor& copy = copies[r];
    if (!copy.defined() || copy.device() != device || copy.shape() != flag.shape() ||
        copy.dtype() != flag.dtype()) {
      const cuda::AllocationPurpose purpose(detail::str("the step's skip flag on ", device));
      copy = Tensor::empty(flag.shape(), flag.dtype(), device);
    }
    const cudaStream_t stream = cuda::current_stream(device.index);
    copy.copy_from(flag, stream);  // ordered after the flag's writer (Tensor::copy_from)
    cuda::Event done = cuda::Event::create(device.index);
    done.record(stream);
    copied.push_back(std::move(done));
    out.push_back(copy);
  }
  if (!copied.empty()) {
    cuda::DeviceGuard guard(flag.device().index);
    const cudaStream_t stream = cuda::current_stream(flag.device().index);
    for (const cuda::Event& done : copied) {
      CUDP_CUDA_CHECK(cudaStreamWaitEvent(stream, done.get(), 0));
    }
  }
  return out;
}

std::vector<double> DataParallel::chunk_weights() const {
  const double total =
      static_cast<double>(std::accumulate(sizes_.begin(), sizes_.end(), int64_t{0}));
  std::vector<double> weights;
  for (const int64_t n : sizes_) weights.push_back(static_cast<double>(n) / total);
  return weights;
}

void DataParallel::release_forward_state() {
  Module::release_forward_state();
  for (size_t r = 1; r < num_replicas(); ++r) replica(r)->release_forward_state();
  replicas_ran_ = false;
}

size_t DataParallel::num_replicas() const {
  return set_ ? set_->size() : 1;
}

std::shared_ptr<Module> DataParallel::replica(size_t i) const {
  if (!set_) {
    CUDP_CHECK(i == 0, "DataParallel: replica ", i, " of 1 (no GPU: the module runs as it is)");
    return module_;
  }
  CUDP_CHECK(i < set_->size(), "DataParallel: replica ", i, " of ", set_->size());
  return set_->replica(i);
}

std::vector<std::vector<Parameter*>> DataParallel::replica_parameters() const {
  if (!set_) return {module_->parameters()};
  return set_->parameters();
}

void DataParallel::for_each_replica(const std::function<void(Module&, size_t, int)>& fn) {
  if (!set_) {
    fn(*module_, 0, module_->device().index);
    return;
  }
  set_->for_each(fn);
}

void DataParallel::broadcast_parameters() {
  if (set_) set_->broadcast_parameters();
}

std::vector<uint64_t> DataParallel::replica_checksums() const {
  if (!set_) return {};
  return set_->checksums();
}

void DataParallel::check_replicas_identical() const {
  if (set_) set_->check_identical();
}

// ---- data_parallel ------------------------------------------------------------------------------

namespace {

TensorList run_data_parallel(ReplicaCache& cache, const std::shared_ptr<Module>& module,
                             const TensorList& inputs,
                             const std::optional<std::vector<int>>& device_ids,
                             std::optional<int> output_device, int dim) {
  CUDP_CHECK(module != nullptr, "data_parallel: the module is null");
  CUDP_CHECK(dynamic_cast<DataParallel*>(module.get()) == nullptr,
             "data_parallel: the module is a DataParallel already; call its forward()");
  if (!device_ids && cuda::device_count() == 0) return module->forward_all(inputs);
  const std::vector<int> ids = device_ids ? *device_ids : all_devices();
  check_device_ids(ids, "data_parallel");
  const int out = output_device.value_or(ids[0]);
  check_output_device(out, "data_parallel");

  ReplicaSet& set = cache.replicas(module, ids);
  set.broadcast_parameters();  // the module may have changed since the last call
  std::vector<int64_t> sizes;
  const auto outputs =
      replicated_forward(set, inputs, dim, BufferSync::Broadcast, "data_parallel", sizes);
  return gather_outputs(outputs, out, dim);
}

Tensor single_output(TensorList outputs) {
  CUDP_CHECK(outputs.size() == 1, "data_parallel: the module has ", outputs.size(),
             " outputs; call data_parallel_all()");
  return outputs[0];
}

}  // namespace

TensorList data_parallel_all(const std::shared_ptr<Module>& module, const TensorList& inputs) {
  return run_data_parallel(default_replica_cache(), module, inputs, std::nullopt, std::nullopt, 0);
}

TensorList data_parallel_all(const std::shared_ptr<Module>& module, const TensorList& inputs,
                             std::vector<int> device_ids, std::optional<int> output_device,
                             int dim) {
  return run_data_parallel(default_replica_cache(), module, inputs, device_ids, output_device, dim);
}

TensorList data_parallel_all(ReplicaCache& cache, const std::shared_ptr<Module>& module,
                             const TensorList& inputs, std::vector<int> device_ids,
                             std::optional<int> output_device, int dim) {
  return run_data_parallel(cache, module, inputs, device_ids, output_device, dim);
}

Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input) {
  return single_output(data_parallel_all(module, {input}));
}

Tensor data_parallel(const std::shared_ptr<Module>& module, const Tensor& input,
                     std::vector<int> device_ids, std::optional<int> output_device, int dim) {
  return single_output(
      data_parallel_all(module, {input}, std::move(device_ids), output_device, dim));
}

// ---- the replica cache --------------------------------------------------------------------------

ReplicaSet& ReplicaCache::replicas(const std::shared_ptr<Module>& module,
                                   const std::vector<int>& device_ids) {
  std::lock_guard lock(mutex_);
  Entry& entry = sets_[{module.get(), device_ids}];
  if (!entry.set) {
    entry.set = std::make_unique<ReplicaSet>(module, device_ids);
    entry.module = module;
  }
  return *entry.set;
}

void ReplicaCache::clear() {
  std::map<std::pair<const Module*, std::vector<int>>, Entry> dropped;
  {
    std::lock_guard lock(mutex_);
    dropped.swap(sets_);
  }
}  // the sets (threads, communicators) end here, outside the lock

size_t ReplicaCache::size() const {
  std::lock_guard lock(mutex_);
  return sets_.size();
}

ReplicaCache& default_replica_cache() {
  static auto* cache = new ReplicaCache;  // never freed: see data_parallel.h
  return *cache;
}

void clear_replica_cache() {
  default_replica_cache().clear();
}

// ---- replicated optimizers ----------------------------------------------------------------------

std::vector<std::vector<Parameter*>> replica_parameter_lists(Module& model) {
  std::vector<std::vector<Parameter*>> lists(1, model.parameters());
  // Replica 0's parameter -> its replicas, from the DataParallel members found in the model.
  std::unordered_map<const Parameter*, std::vector<Parameter*>> mirrors;
  for (auto& [path, module] : model.named_modules()) {
    const auto* dp = dynamic_cast<const DataParallel*>(module);
    if (dp == nullptr) continue;
    const auto replicas = dp->replica_parameters();
    for (size_t r = 1; r < replicas.size(); ++r) {
      for (size_t k = 0; k < replicas[0].size(); ++k) {
        mirrors[replicas[0][k]].push_back(replicas[r][k]);
      }
    }
  }
  for (Parameter* p : lists[0]) {
    const auto it = mirrors.find(p);
    if (it == mirrors.end()) continue;
    if (lists.size() < it->second.size() + 1) lists.resize(it->second.size() + 1);
    for (size_t r = 0; r < it->second.size(); ++r) lists[r + 1].push_back(it->second[r]);
  }
  return lists;
}

}  // namespace cudp::parallel
