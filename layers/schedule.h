// Learning-rate schedules with PyTorch's formulas (torch.optim.lr_scheduler).
//
// A scheduler drives one optimizer, as PyTorch's do: constructing it sets the optimizer's learning
// rate for step 0, and each step() (called after optimizer.step()) advances one step, or one epoch
// when the caller steps per epoch, and sets the rate for it. Every rate is computed in closed form
// from the step count, in double, so that a resumed run only needs set_step(n) to land on exactly
// the rate the interrupted run would have used (PyTorch's recursive forms agree with the closed
// forms to rounding; cudp's tests compare with PyTorch's documented closed forms).
//
// The base rate of StepLR and CosineAnnealingLR is the optimizer's rate when the scheduler is
// constructed (PyTorch's "initial_lr"). OneCycleLR sets its own, max_lr / div_factor, and by
// default also cycles the momentum (SGD's momentum, AdamW's beta1) inversely to the rate, as
// PyTorch does with cycle_momentum=True.
#pragma once

#include <cstdint>
#include <optional>

#include "layers/optim.h"

namespace cudp {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;
  LRScheduler(LRScheduler&&) = delete;
  LRScheduler& operator=(LRScheduler&&) = delete;

  // Advances one step and sets the optimizer's rate (and momentum) for it.
  void step() { set_step(step_ + 1); }
  // Jumps to step `n` (resuming from a checkpoint) and sets the rate for it.
  void set_step(int64_t n);
  // The number of step() calls so far (PyTorch's last_epoch).
  int64_t last_step() const { return step_; }
  // The rate set for the current step (PyTorch's get_last_lr()[0]).
  double last_lr() const { return optimizer_.lr(); }

  // The rate, and the momentum where the schedule sets one, at step n.
  virtual double lr_at(int64_t n) const = 0;
  virtual std::optional<double> momentum_at(int64_t n) const { return std::nullopt; }

 protected:
  explicit LRScheduler(Optimizer& optimizer) : optimizer_(optimizer), base_lr_(optimizer.lr()) {}

  Optimizer& optimizer_;
  double base_lr_;
  int64_t step_ = 0;
};

// lr = base_lr * gamma^floor(n / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double lr_at(int64_t n) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * n / T_max)) / 2 (the closed form; past T_max
// it rises again, as PyTorch's closed form does).
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& optimizer, int64_t t_max, double eta_min = 0.0);
  double lr_at(int64_t n) const override;

 private:
  int64_t t_max_;
  double eta_min_;
};

struct OneCycleOptions {
  double max_lr = 0.1;
  int64_t total_steps = 0;        // required, > 0
  double pct_start = 0.3;         // share of the steps spent rising
  double div_factor = 25.0;       // initial_lr = max_lr / div_factor
  double final_div_factor = 1e4;  // min_lr = initial_lr / final_div_factor
  bool cycle_momentum = true;
  double base_momentum = 0.85;
  double max_momentum = 0.95;
};

// PyTorch's OneCycleLR with anneal_strategy="cos" and three_phase=False: the rate rises from
// initial_lr to max_lr over the first float(pct_start * total_steps) - 1 steps, then falls to
// min_lr at step total_steps - 1, each phase on a half cosine; momentum moves the opposite way
// between max_momentum and base_momentum. Stepping past total_steps throws ValueError with
// PyTorch's text.
class OneCycleLR : public LRScheduler {
 public:
  OneCycleLR(Optimizer& optimizer, const OneCycleOptions& options);
  double lr_at(int64_t n) const override;
  std::optional<double> momentum_at(int64_t n) const override;

 private:
  // The phase holding step n and how far into it n is (0 at its start, 1 at its end).
  struct Position {
    int phase;
    double pct;
  };
  Position position(int64_t n) const;

  OneCycleOptions options_;
  double initial_lr_, min_lr_;
  double phase_end_[2];  // the step each phase ends at
};

}  // namespace cudp
