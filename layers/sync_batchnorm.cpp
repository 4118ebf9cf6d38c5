#include "layers/sync_batchnorm.h"

#include <typeinfo>

#include "engine/core/memory.h"
#include "kernels/batchnorm.h"

namespace cudp {

Rendezvous::Rendezvous(size_t participants, std::chrono::milliseconds timeout)
    : slots_(participants, nullptr), arrived_(participants, false), timeout_(timeout) {
  CUDP_CHECK(participants >= 1, "Rendezvous: needs at least one participant, got 0");
}

void Rendezvous::arrive(size_t participant, void* slot, const char* what,
                        const std::function<void(const std::vector<void*>&)>& action) {
  std::unique_lock<std::mutex> lock(mutex_);
  CUDP_CHECK(aborted_.empty(), what, ": aborted: ", aborted_);
  CUDP_CHECK(!broken_, what,
             ": the group is unusable since a participant failed to arrive (see that first "
             "error); make a new group");
  CUDP_CHECK(participant < slots_.size(), what, ": participant ", participant,
             " is outside the group of ", slots_.size());
  CUDP_CHECK(!arrived_[participant], what, ": participant ", participant,
             " called twice in one round; every participant must make the same calls in the "
             "same order");
  slots_[participant] = slot;
  arrived_[participant] = true;
  const uint64_t round = generation_;
  if (++count_ == slots_.size()) {
    std::exception_ptr error;
    try {
      action(slots_);
    } catch (...) {
      error = std::current_exception();
    }
    error_ = error;
    count_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), false);
    ++generation_;
    cv_.notify_all();
    if (error) std::rethrow_exception(error);
    return;
  }
  const bool done = cv_.wait_for(
      lock, timeout_, [&] { return generation_ != round || broken_ || !aborted_.empty(); });
  if (generation_ == round && !aborted_.empty()) {
    CUDP_THROW(ValueError, what, ": participant ", participant, " stopped waiting: ", aborted_);
  }
  if (!done || generation_ == round) {
    std::string missing;
    for (size_t p = 0; p < arrived_.size(); ++p) {
      if (!arrived_[p]) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
    }
    broken_ = true;
    cv_.notify_all();
    CUDP_THROW(ValueError, what, ": participant ", participant, " waited ", timeout_.count(),
               " ms for participant(s) ", missing.empty() ? std::string("?") : missing, " of ",
               slots_.size(),
               " that never arrived; every participant must run every training forward and "
               "backward of the synchronised layers (a replica without rows, or a rank that "
               "stopped)");
  }
  if (error_) std::rethrow_exception(error_);
}

void Rendezvous::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.empty()) aborted_ = reason.empty() ? std::string("aborted") : reason;  // the first
  cv_.notify_all();
}

void Rendezvous::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_.clear();
  broken_ = false;
  count_ = 0;
  std::fill(arrived_.begin(), arrived_.end(), false);
  ++generation_;
}

void HostStatsGroup::all_reduce_sum(size_t participant, Tensor& data, cudaStream_t) {
  CUDP_CHECK(data.device().is_cpu() && data.dtype() == DType::f32, "HostStatsGroup: participant ",
             participant, " gave ", data.str(),
             "; it sums f32 CPU tensors (use the NCCL group for device tensors)");
  rendezvous_.arrive(participant, &data, "HostStatsGroup::all_reduce_sum",
                     [](const std::vector<void*>& slots) {
                       std::vector<Tensor*> t;
                       for (void* s : slots) t.push_back(static_cast<Tensor*>(s));
                       const int64_t n = t[0]->numel();
                       for (size_t p = 1; p < t.size(); ++p) {
                         CUDP_CHECK(t[p]->numel() == n, "HostStatsGroup: participant ", p, " gave ",
                                    t[p]->numel(), " elements but participant 0 gave ", n,
                                    "; every participant sums vectors of the same size");
                       }
                       std::vector<float> sum(t[0]->data<float>(), t[0]->data<float>() + n);
                       for (size_t p = 1; p < t.size(); ++p) {
                         const float* d = t[p]->data<float>();
                         for (int64_t i = 0; i < n; ++i) sum[i] += d[i];
                       }
                       for (Tensor* d : t) std::copy(sum.begin(), sum.end(), d->data<float>());
                     });
}

void SyncBatchNorm2d::set_stats_group(std::shared_ptr<StatsGroup> group, size_t participant) {
  CUDP_CHECK(!group || participant < group->size(), "SyncBatchNorm2d: participant ", participant,
             " is outside its group of ", group ? group->size() : 0);
  group_ = std::move(group);
  participant_ = participant;
}

template <typename T>
void SyncBatchNorm2d::forward_synced(const Tensor& input, Tensor& y) {
  const int64_t rows = rows_of(input);
  const int parts = int(group_->size());
  const int64_t size = kernels::batchnorm_summary_size(c_);
  Tensor summaries, save_mean, save_invstd, coef;
  {
    const cuda::AllocationPurpose purpose(
        detail::str("SyncBatchNorm2d(", c_, ")'s statistics of ", parts, " participants"),
        "They are kept with the activations for the backward: reduce the batch size "
        "(--batch-size).");
    summaries = Tensor::zeros({parts * size}, DType::f32, device_);
    save_mean = Tensor::empty({c_}, DType::f32, device_);
    save_invstd = Tensor::empty({c_}, DType::f32, device_);
    if (!device_.is_cpu()) coef = Tensor::empty({4 * c_}, DType::f32, device_);
  }
  const T* x = input.data<T>();
  T* out = y.data<T>();
  float* slot = summaries.data<float>() + int64_t(participant_) * size;
  const float* gamma = weight_->data.data<float>();
  const float* beta = bias_->data.data<float>();
  float* mean = running_mean_->data<float>();
  float* var = running_var_->data<float>();
  float* sm = save_mean.data<float>();
  float* si = save_invstd.data<float>();
  const int c = c_;
  const float eps = eps_, momentum = momentum_;
  const kernels::BnActivation act =
      relu_fused_ ? kernels::BnActivation::relu : kernels::BnActivation::none;
  run([&] { kernels::batchnorm_local_stats_cpu(x, rows, c, slot); },
      [&](cudaStream_t s) { kernels::batchnorm_local_stats(x, rows, c, slot, s); });
  run([&] { group_->all_reduce_sum(participant_, summaries, nullptr); },
      [&](cudaStream_t s) { group_->all_reduce_sum(participant_, summaries, s); });
  const float* all = summaries.data<float>();
  run(
      [&] {
        std::vector<double> k(4 * size_t(c));
        kernels::batchnorm_merge_stats_cpu(all, parts, c, gamma, beta, mean, var, sm, si, momentum,
                                           eps, k.data());
        kernels::batchnorm_apply_cpu(x, out, k.data(), rows, c, act);
      },
      [&](cudaStream_t s) {
        float* k = coef.data<float>();
        kernels::batchnorm_merge_stats(all, parts, c, gamma, beta, mean, var, sm, si, momentum, eps,
                                       k, s);
        kernels::batchnorm_apply(x, out, k, rows, c, act, s);
      });
  count_batch();
  save_mean_ = save_mean;
  save_invstd_ = save_invstd;
}

Tensor SyncBatchNorm2d::forward_one(const Tensor& input) {
  if (!syncing()) {
    synced_ = false;
    return BatchNorm2d::forward_one(input);
  }
  rows_of(input);
  Tensor y = Tensor::empty(input.shape(), input.dtype(), device_);
  saved_training_ = true;
  input_ = input;
  if (input.dtype() == DType::bf16) {
    forward_synced<__nv_bfloat16>(input, y);
  } else {
    forward_synced<float>(input, y);
  }
  keep_fused_relu_output(y);
  synced_ = true;
  return y;
}

template <typename T>
void SyncBatchNorm2d::backward_synced(const Tensor& grad_output, Tensor& dx) {
  const Operands<T> o = operands<T>(grad_output, dx);
  const float* mean = save_mean_.data<float>();
  const float* invstd = save_invstd_.data<float>();
  Tensor sums;
  {
    const cuda::AllocationPurpose purpose(detail::str("SyncBatchNorm2d(", c_, ")'s gradient sums"),
                                          "Reduce the batch size (--batch-size).");
    sums = Tensor::empty({2 * int64_t(o.c) + 1}, DType::f32, device_);
  }
  float* sum = sums.data<float>();
  run(
      [&] {
        kernels::batchnorm_backward_local_cpu(o.x, o.dy, o.mask, mean, invstd, o.rows, o.c, sum,
                                              o.dgamma, o.dbeta, 1.0f);
      },
      [&](cudaStream_t s) {
        kernels::batchnorm_backward_local(o.x, o.dy, o.mask, mean, invstd, o.rows, o.c, sum,
                                          o.dgamma, o.dbeta, 1.0f, s);
      });
  run([&] { group_->all_reduce_sum(participant_, sums, nullptr); },
      [&](cudaStream_t s) { group_->all_reduce_sum(participant_, sums, s); });
  run(
      [&] {
        kernels::batchnorm_backward_global_cpu(o.x, o.dy, o.mask, o.gamma, mean, invstd, sum, o.dx,
                                               o.rows, o.c);
      },
      [&](cudaStream_t s) {
        kernels::batchnorm_backward_global(o.x, o.dy, o.mask, o.gamma, mean, invstd, sum, o.dx,
                                           o.rows, o.c, s);
      });
}

Tensor SyncBatchNorm2d::backward_one(const Tensor& grad_output) {
  if (!(saved_training_ && synced_)) return BatchNorm2d::backward_one(grad_output);
  Tensor dx = new_grad_input(grad_output, "SyncBatchNorm2d");
  if (input_.dtype() == DType::bf16) {
    backward_synced<__nv_bfloat16>(grad_output, dx);
  } else {
    backward_synced<float>(grad_output, dx);
  }
  return dx;
}

std::shared_ptr<Module> SyncBatchNorm2d::make_empty_copy() const {
  auto copy = std::make_shared<SyncBatchNorm2d>(init::skip_init, c_, eps_, momentum_);
  copy->batches_tracked_ = batches_tracked_;
  return copy;
}

std::shared_ptr<Module> convert_sync_batchnorm(std::shared_ptr<Module> module) {
  CUDP_CHECK(module != nullptr, "convert_sync_batchnorm: the module is null");
  if (typeid(*module) == typeid(BatchNorm2d)) {
    auto& bn = static_cast<BatchNorm2d&>(*module);
    auto sync = std::make_shared<SyncBatchNorm2d>(init::skip_init, bn.num_features(), bn.eps(),
                                                  bn.momentum());
    sync->load_state_dict(bn.state_dict());  // CPU copies; num_batches_tracked's host count too
    if (!bn.device().is_cpu()) sync->to(bn.device());
    sync->train(bn.is_training());
    sync->set_precision(bn.precision());
    sync->set_fusion(bn.fusion());
    sync->set_input_grad(bn.input_grad());
    return sync;
  }
  const size_t n = module->children().size();
  for (size_t i = 0; i < n; ++i) {
    const std::shared_ptr<Module> child = module->children()[i].second;
    std::shared_ptr<Module> converted = convert_sync_batchnorm(child);
    if (converted != child) module->replace_child(i, std::move(converted));
  }
  return module;
}

size_t attach_stats_group(Module& module, const std::shared_ptr<StatsGroup>& group,
                          size_t participant) {
  size_t count = 0;
  for (const auto& [name, m] : module.named_modules()) {
    if (auto* sync = dynamic_cast<SyncBatchNorm2d*>(m)) {
      sync->set_stats_group(group, participant);
      ++count;
    }
  }
  return count;
}

}  // namespace cudp
