#include "engine/parallel/reducer.h"

#include <unordered_map>

#include "engine/core/nvtx.h"

namespace cudp::parallel {

// ---- CommunicatorGroup --------------------------------------------------------------------------

void CommunicatorGroup::begin(size_t buckets) {
  const std::vector<int>& devices = comm_.devices();
  compute_.clear();
  for (const int device : devices) compute_.push_back(cuda::current_stream(device));
  // Events are made once per bucket count and reused: recording one again is stream-ordered
  // after the waits already enqueued on it, and nothing is created inside a captured step.
  while (ready_events_.size() < buckets) {
    std::vector<cuda::Event> ready, done;
    std::vector<cudaEvent_t> ready_raw, done_raw;
    for (const int device : devices) {
      ready.push_back(cuda::Event::create(device));
      done.push_back(cuda::Event::create(device));
      ready_raw.push_back(ready.back().get());
      done_raw.push_back(done.back().get());
    }
    ready_events_.push_back(std::move(ready));
    done_events_.push_back(std::move(done));
    ready_.push_back(std::move(ready_raw));
    done_.push_back(std::move(done_raw));
  }
  last_ = -1;
}

void CommunicatorGroup::mark_ready(size_t rank, size_t bucket) {
  const int device = comm_.devices()[rank];
  cuda::DeviceGuard guard(device);
  CUDP_CUDA_CHECK(cudaEventRecord(ready_[bucket][rank], compute_[rank]));
}

void CommunicatorGroup::all_reduce(size_t bucket, const TensorList& views) {
  const nvtx::Range range("gradient bucket all-reduce");
  comm_.all_reduce_after(views, ready_[bucket], done_[bucket], compute_, ReduceOp::Sum);
  last_ = static_cast<int64_t>(bucket);
}

void CommunicatorGroup::finish() {
  if (last_ < 0) return;
  // The buckets ran in order on each comm stream: the last one's event covers them all.
  const std::vector<int>& devices = comm_.devices();
  for (size_t i = 0; i < devices.size(); ++i) {
    cuda::DeviceGuard guard(devices[i]);
    CUDP_CUDA_CHECK(cudaStreamWaitEvent(compute_[i], done_[static_cast<size_t>(last_)][i], 0));
  }
  last_ = -1;
}

// ---- LocalGroup --------------------------------------------------------------------------------

void LocalGroup::begin(size_t buckets) {
  compute_ = cuda::current_stream(device_);
  while (ready_.size() < buckets) ready_.push_back(cuda::Event::create(device_));
}

void LocalGroup::mark_ready(size_t rank, size_t bucket) {
  CUDP_CHECK(rank == 0, "LocalGroup: rank ", rank, " of one");
  cuda::DeviceGuard guard(device_);
  ready_.at(bucket).record(compute_);
}

// ---- Reducer ------------------------------------------------------------------------------------

Reducer::Reducer(std::vector<std::vector<Parameter*>> params, TensorList flat_grads,
                 ReduceGroup& group, ReducerOptions options)
    : params_(std::move(params)), flat_(std::move(flat_grads)), group_(group), options_(options) {
  const size_t ranks = params_.size();
  CUDP_CHECK(ranks >= 1 && flat_.size() == ranks && group_.local_ranks() == ranks,
             "Reducer: ", ranks, " parameter lists, ", flat_.size(), " flat buffers and ",
             group_.local_ranks(), " local ranks in the group; give one of each per rank");
  CUDP_CHECK(options_.bucket_cap_bytes > 0, "Reducer: bucket_cap_bytes must be positive, got ",
             options_.bucket_cap_bytes);
  const size_t count = params_[0].size();
  CUDP_CHECK(count > 0, "Reducer: the model has no parameters; there is nothing to reduce");
  for (size_t r = 0; r < ranks; ++r) {
    CUDP_CHECK(params_[r].size() == count, "Reducer: rank ", r, " has ", params_[r].size(),
               " parameters but rank 0 has ", count, "; every rank holds the same model");
    CUDP_CHECK(flat_[r].defined() && flat_[r].dtype() == DType::f32 && flat_[r].dim() == 1,
               "Reducer: rank ", r,
               "'s flat gradient buffer must be a 1-d f32 tensor "
               "(Module::flatten_parameters makes it)");
  }
  // Offsets in the flat buffer, from rank 0, checked on every rank: in increasing order, as
  // flatten_parameters lays parameters, so that a run of consecutive parameters is one slice.
  const auto offset_of = [&](size_t r, size_t k) -> int64_t {
    const Tensor& grad = params_[r][k]->grad;
    const auto* base = static_cast<const char*>(flat_[r].data_ptr());
    const auto* at = static_cast<const char*>(grad.data_ptr());
    CUDP_CHECK(grad.shares_storage(flat_[r]) && grad.dtype() == DType::f32, "Reducer: rank ", r,
               "'s parameter ", k,
               " does not view the flat gradient buffer; call "
               "flatten_parameters() on the model before making a Reducer");
    return static_cast<int64_t>((at - base) / static_cast<std::ptrdiff_t>(sizeof(float)));
  };
  for (size_t k = 0; k < count; ++k) {
    offsets_.push_back(offset_of(0, k));
    CUDP_CHECK(k == 0 || offsets_[k] >= offsets_[k - 1] + params_[0][k - 1]->grad.numel(),
               "Reducer: parameter ", k, " lies before parameter ", k - 1,
               " in the flat buffer; buckets need them in order (flatten_parameters lays them so)");
    for (size_t r = 1; r < ranks; ++r) {
      CUDP_CHECK(offset_of(r, k) == offsets_[k], "Reducer: rank ", r, "'s parameter ", k,
                 " is at element ", offset_of(r, k), " of its flat buffer but rank 0's at ",
                 offsets_[k], "; every rank must flatten the same model");
    }
  }
  // Buckets in reverse parameter order. Parameter k's region runs to the next one's start (or the
  // buffer's end), padding included, so the buckets tile the whole buffer.
  const int64_t total = flat_[0].numel();
  bucket_of_.assign(count, 0);
  Bucket current;
  current.end = total;
  for (size_t k = count; k-- > 0;) {
    current.begin = offsets_[k];
    current.params.push_back(k);
    bucket_of_[k] = buckets_.size();
    const int64_t bytes = (current.end - current.begin) * static_cast<int64_t>(sizeof(float));
    if (bytes >= options_.bucket_cap_bytes || k == 0) {
      if (k == 0) current.begin = 0;  // the first parameter starts the buffer
      buckets_.push_back(current);
      current = Bucket{};
      current.end = offsets_[k];
    }
  }
  for (const Bucket& b : buckets_) {
    TensorList views;
    for (size_t r = 0; r < ranks; ++r) views.push_back(flat_[r].slice(b.begin, b.end));
    views_.push_back(std::move(views));
  }
  left_.assign(buckets_.size(), std::vector<int>(ranks, 0));
  ranks_left_ = std::make_unique<std::atomic<int>[]>(buckets_.size());
}

Reducer::~Reducer() {
  for (Module* m : hooked_) m->set_backward_hook({});
}

void check_not_reduced(Module& model, const std::string& who) {
  // One owner per module: a second hook would replace the first, and the first owner's buckets
  // would never complete (or two owners would sum the same gradients twice).
  for (auto& [path, module] : model.named_modules()) {
    CUDP_CHECK(!module->has_backward_hook(), who, ": module '", path.empty() ? "(the model)" : path,
               "' (", module->type_name(),
               ") already signals its backward to a gradient reducer: the model is wrapped by "
               "another DataParallel or DistributedDataParallel, or data_parallel() keeps "
               "replicas of it (parallel::clear_replica_cache() drops those). Its gradients can "
               "be all-reduced by one wrapper only: wrap the model once, or destroy the first "
               "wrapper before making the second");
  }
}

void Reducer::attach(size_t rank, Module& model) {
  CUDP_CHECK(rank < params_.size(), "Reducer::attach: rank ", rank, " of ", params_.size());
  check_not_reduced(model, detail::str("Reducer::attach (rank ", rank, ")"));
  std::unordered_map<const Parameter*, size_t> index;
  for (size_t k = 0; k < params_[rank].size(); ++k) index.emplace(params_[rank][k], k);
  // Everything is checked before any hook is set: a refused attach leaves the model as it was.
  std::vector<std::pair<Module*, std::vector<size_t>>> hooks;
  size_t found = 0;
  for (auto& [path, module] : model.named_modules()) {
    std::vector<size_t> own;
    for (Parameter* p : module->own_parameters()) {
      const auto it = index.find(p);
      CUDP_CHECK(it != index.end(), "Reducer::attach: module '", path, "' (", module->type_name(),
                 ") of rank ", rank,
                 " owns a parameter the reducer was not given; attach the model whose "
                 "parameters() made the reducer's lists");
      own.push_back(it->second);
    }
    if (own.empty()) continue;
    found += own.size();
    hooks.emplace_back(module, std::move(own));
  }
  CUDP_CHECK(found == params_[rank].size(), "Reducer::attach: rank ", rank, "'s model owns ", found,
             " of the reducer's ", params_[rank].size(),
             " parameters; attach the model whose parameters() made the reducer's lists");
  for (auto& [module, own] : hooks) {
    module->set_backward_hook([this, rank, own = std::move(own)] { on_backward(rank, own); });
    hooked_.push_back(module);
  }
}

bool Reducer::layout_intact() const {
  for (size_t r = 0; r < params_.size(); ++r) {
    const auto* base = static_cast<const float*>(flat_[r].data_ptr());
    for (size_t k = 0; k < params_[r].size(); ++k) {
      if (params_[r][k]->grad.data_ptr() != base + offsets_[k]) return false;
    }
  }
  return true;
}

void Reducer::prepare(size_t active_ranks) {
  const size_t ranks = params_.size();
  CUDP_CHECK(active_ranks >= 1 && active_ranks <= ranks, "Reducer::prepare: ", active_ranks,
             " active ranks of ", ranks);
  group_.begin(buckets_.size());
  // Ranks without a chunk run no backward: what a deferred zero_grad left them counts as zero
  // (NOTE [Deferred zeroing], layers/module.h), zeroed before their buckets are marked ready.
  for (size_t r = active_ranks; r < ranks; ++r) zero_pending_grads(params_[r]);
  next_ = 0;
  issued_early_ = 0;
  complete_ = false;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int n = static_cast<int>(buckets_[b].params.size());
    for (size_t r = 0; r < ranks; ++r) left_[b][r] = r < active_ranks ? n : 0;
    ranks_left_[b] = static_cast<int>(active_ranks);
    // Ranks without a chunk hold their (zeroed) gradients already.
    for (size_t r = active_ranks; r < ranks; ++r) group_.mark_ready(r, b);
  }
  armed_ = options_.overlap;
}

void Reducer::on_backward(size_t rank, const std::vector<size_t>& params) {
  if (!armed_) return;  // a backward outside a prepared step, or overlap off
  for (const size_t k : params) {
    const size_t b = bucket_of_[k];
    const int left = --left_[b][rank];
    CUDP_CHECK(left >= 0, "Reducer: parameter ", k, " of rank ", rank,
               " was completed twice in one backward (a module whose backward runs twice, "
               "sharing its weights); its bucket may already be summed. Turn overlap off for "
               "such a model: DataParallel::set_reducer_options({.overlap = false}), or "
               "DistributedDataParallelOptions::reducer.overlap = false");
    if (left > 0) continue;
    group_.mark_ready(rank, b);
    if (--ranks_left_[b] == 0) {
      std::lock_guard lock(mutex_);
      issue_ready();
    }
  }
}

void Reducer::issue_ready() {
  while (next_ < buckets_.size() && ranks_left_[next_] == 0) {
    if (options_.sum) group_.all_reduce(next_, views_[next_]);
    ++next_;
    ++issued_early_;
  }
}

void Reducer::finish() {
  armed_ = false;
  std::lock_guard lock(mutex_);
  const size_t early = issued_early_;
  for (size_t b = next_; b < buckets_.size(); ++b) {
    for (size_t r = 0; r < params_.size(); ++r) {
      if (left_[b][r] > 0) {
        // A module whose backward did not run: its gradients that a deferred zero_grad left
        // pending count as zero (NOTE [Deferred zeroing], layers/module.h).
        std::vector<Parameter*> unwritten;
        for (const size_t k : buckets_[b].params) unwritten.push_back(params_[r][k]);
        zero_pending_grads(unwritten);
        left_[b][r] = 0;
        group_.mark_ready(r, b);
      }
    }
    ranks_left_[b] = 0;
  }
  issue_ready();
  issued_early_ = early;
  group_.finish();
  complete_ = true;
}

std::vector<GradientSegment> Reducer::gradient_segments(size_t rank) const {
  if (!complete_ || rank >= params_.size()) return {};
  const auto* base = static_cast<const float*>(flat_[rank].data_ptr());
  std::vector<GradientSegment> segments;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const cudaEvent_t ready =
        options_.sum ? group_.final_event(rank, b) : group_.ready_event(rank, b);
    if (ready == nullptr && flat_[rank].is_cuda()) return {};
    segments.push_back({base, buckets_[b].begin, buckets_[b].end, ready});
  }
  return segments;
}

void Reducer::abandon() {
  armed_ = false;
  complete_ = false;
  std::lock_guard lock(mutex_);
  next_ = buckets_.size();
  try {
    group_.finish();  // compute still waits for what was issued: its memory stays safe
  } catch (...) {
    // the step's error is the one the caller reports
  }
}

}  // namespace cudp::parallel
