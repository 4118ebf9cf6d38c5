#include "layers/schedule.h"

#include <cmath>
#include <numbers>

namespace cudp {
namespace {

// PyTorch's _annealing_cos: from `start` at pct 0 to `end` at pct 1 on a half cosine.
double anneal_cos(double start, double end, double pct) {
  return end + (start - end) / 2.0 * (std::cos(std::numbers::pi * pct) + 1.0);
}

}  // namespace

void LRScheduler::set_step(int64_t n) {
  CUDP_CHECK(n >= 0, "scheduler step must be non-negative, got ", n);
  const double lr = lr_at(n);  // may throw (OneCycleLR past its end): leave the state unchanged
  const std::optional<double> momentum = momentum_at(n);
  step_ = n;
  optimizer_.set_lr(lr);
  if (momentum) {
    optimizer_.set_momentum(*momentum);
  }
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  CUDP_CHECK(step_size > 0, "StepLR: step_size must be positive, got ", step_size);
  set_step(0);
}

double StepLR::lr_at(int64_t n) const {
  const int64_t decays = n / step_size_;  // floor: n >= 0
  return base_lr_ * std::pow(gamma_, static_cast<double>(decays));
}

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, int64_t t_max, double eta_min)
    : LRScheduler(optimizer), t_max_(t_max), eta_min_(eta_min) {
  CUDP_CHECK(t_max > 0, "CosineAnnealingLR: T_max must be positive, got ", t_max);
  set_step(0);
}

double CosineAnnealingLR::lr_at(int64_t n) const {
  return eta_min_ + (base_lr_ - eta_min_) *
                        (1.0 + std::cos(std::numbers::pi * static_cast<double>(n) /
                                        static_cast<double>(t_max_))) /
                        2.0;
}

OneCycleLR::OneCycleLR(Optimizer& optimizer, const OneCycleOptions& options)
    : LRScheduler(optimizer),
      options_(options),
      initial_lr_(options.max_lr / options.div_factor),
      min_lr_(initial_lr_ / options.final_div_factor),
      phase_end_{options.pct_start * static_cast<double>(options.total_steps) - 1.0,
                 static_cast<double>(options.total_steps) - 1.0} {
  CUDP_CHECK(options.total_steps > 0, "Expected positive integer total_steps, but got ",
             options.total_steps);
  CUDP_CHECK(options.pct_start >= 0.0 && options.pct_start <= 1.0,
             "Expected float between 0 and 1 pct_start, but got ", options.pct_start);
  base_lr_ = initial_lr_;
  set_step(0);
}

OneCycleLR::Position OneCycleLR::position(int64_t n) const {
  CUDP_CHECK(n <= options_.total_steps, "Tried to step ", n,
             " times. The specified number of total steps is ", options_.total_steps);
  // PyTorch walks the phases: the first whose end is at or after n, or the last; pct may exceed 1
  // at step total_steps, which PyTorch allows too.
  const double step = static_cast<double>(n);
  const int phase = step <= phase_end_[0] ? 0 : 1;
  const double start = phase == 0 ? 0.0 : phase_end_[0];
  return {phase, (step - start) / (phase_end_[phase] - start)};
}

double OneCycleLR::lr_at(int64_t n) const {
  const auto [phase, pct] = position(n);
  return phase == 0 ? anneal_cos(initial_lr_, options_.max_lr, pct)
                    : anneal_cos(options_.max_lr, min_lr_, pct);
}

std::optional<double> OneCycleLR::momentum_at(int64_t n) const {
  if (!options_.cycle_momentum) {
    return std::nullopt;
  }
  const auto [phase, pct] = position(n);
  return phase == 0 ? anneal_cos(options_.max_momentum, options_.base_momentum, pct)
                    : anneal_cos(options_.base_momentum, options_.max_momentum, pct);
}

}  // namespace cudp
