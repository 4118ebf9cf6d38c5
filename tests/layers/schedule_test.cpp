// Host tests of the learning-rate schedules against values worked out by hand from PyTorch's
// documented formulas (torch.optim.lr_scheduler; OneCycleLR's _annealing_cos and phase table).
#include "layers/schedule.h"

#include <gtest/gtest.h>

#include <cmath>

namespace cudp {
namespace {

// One parameter is all an optimizer needs to be driven by a schedule.
struct OneParameter {
  Parameter p{Tensor::zeros({2}), Tensor::zeros({2})};
  std::vector<Parameter*> list() { return {&p}; }
};

constexpr double kTol = 1e-12;

TEST(StepLR, DecaysByGammaEveryStepSize) {
  OneParameter p;
  SGD sgd(p.list(), {.lr = 0.1});
  StepLR schedule(sgd, /*step_size=*/3, /*gamma=*/0.5);
  const double expected[] = {0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.0125};
  for (int n = 0; n < 10; ++n) {
    EXPECT_NEAR(sgd.lr(), expected[n], kTol) << "step " << n;
    EXPECT_EQ(schedule.last_step(), n);
    schedule.step();
  }
}

TEST(CosineAnnealingLR, FollowsTheClosedForm) {
  OneParameter p;
  SGD sgd(p.list(), {.lr = 0.1});
  CosineAnnealingLR schedule(sgd, /*t_max=*/4, /*eta_min=*/0.001);
  // eta_min + (0.1 - eta_min) * (1 + cos(pi n / 4)) / 2
  const double expected[] = {0.1, 0.0855017856687341, 0.0505, 0.0154982143312659, 0.001};
  for (int n = 0; n <= 4; ++n) {
    EXPECT_NEAR(schedule.last_lr(), expected[n], kTol) << "step " << n;
    schedule.step();
  }
  // Past T_max the closed form rises again (cos(5 pi / 4) = cos(3 pi / 4)).
  EXPECT_NEAR(sgd.lr(), expected[3], kTol);
}

// max_lr 1, total 10, pct_start 0.3: initial_lr 0.04, min_lr 4e-6; the rise ends at step
// 0.3 * 10 - 1 = 2, the fall at step 9. Momentum moves from 0.95 to 0.85 and back.
const double kOneCycleLr[] = {0.04,
                              0.52,
                              1.0,
                              0.9504846320134737,
                              0.8117456539497631,
                              0.6112620219362893,
                              0.38874197806371075,
                              0.18825834605023697,
                              0.049519367986526286,
                              4e-06,
                              0.04951936798652623};
const double kOneCycleMomentum[] = {0.95,
                                    0.9,
                                    0.85,
                                    0.854951556604879,
                                    0.8688255099070633,
                                    0.8888739533021842,
                                    0.9111260466978157,
                                    0.9311744900929366,
                                    0.945048443395121,
                                    0.95,
                                    0.945048443395121};

TEST(OneCycleLR, MatchesPyTorchsPhasesForRateAndMomentum) {
  OneParameter p;
  SGD sgd(p.list(), {.lr = 123.0, .momentum = 0.5});  // both overwritten by the schedule
  OneCycleLR schedule(sgd, {.max_lr = 1.0, .total_steps = 10});
  for (int n = 0; n <= 10; ++n) {
    EXPECT_NEAR(sgd.lr(), kOneCycleLr[n], kTol) << "step " << n;
    EXPECT_NEAR(sgd.momentum(), kOneCycleMomentum[n], kTol) << "step " << n;
    if (n < 10) schedule.step();
  }
  // PyTorch allows total_steps steps and refuses the next, with this text.
  try {
    schedule.step();
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "Tried to step 11 times. The specified number of total steps is 10"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(schedule.last_step(), 10);  // unchanged by the refused step
}

TEST(OneCycleLR, CyclesAdamWsBeta1AndCanLeaveMomentumAlone) {
  OneParameter p;
  AdamW adamw(p.list(), {.lr = 1.0});
  OneCycleLR cycling(adamw, {.max_lr = 1.0, .total_steps = 10});
  cycling.set_step(4);
  EXPECT_NEAR(adamw.momentum(), kOneCycleMomentum[4], kTol);
  EXPECT_NEAR(adamw.options().beta1, kOneCycleMomentum[4], kTol);

  OneParameter q;
  SGD sgd(q.list(), {.lr = 1.0, .momentum = 0.5});
  OneCycleLR rate_only(sgd, {.max_lr = 1.0, .total_steps = 10, .cycle_momentum = false});
  rate_only.set_step(3);
  EXPECT_NEAR(sgd.lr(), kOneCycleLr[3], kTol);
  EXPECT_EQ(sgd.momentum(), 0.5);
}

TEST(LRScheduler, SetStepLandsWhereSteppingDoes) {
  OneParameter a, b;
  SGD sa(a.list(), {.lr = 0.3}), sb(b.list(), {.lr = 0.3});
  CosineAnnealingLR stepped(sa, 7, 0.01), jumped(sb, 7, 0.01);
  for (int n = 0; n < 5; ++n) stepped.step();
  jumped.set_step(5);
  EXPECT_EQ(sa.lr(), sb.lr());
  EXPECT_EQ(jumped.last_step(), 5);
}

TEST(LRScheduler, RejectsInvalidArguments) {
  OneParameter p;
  SGD sgd(p.list(), {.lr = 0.1});
  EXPECT_THROW(StepLR(sgd, 0), ValueError);
  EXPECT_THROW(CosineAnnealingLR(sgd, 0), ValueError);
  EXPECT_THROW(OneCycleLR(sgd, {.max_lr = 1.0, .total_steps = 0}), ValueError);
  EXPECT_THROW(OneCycleLR(sgd, {.max_lr = 1.0, .total_steps = 5, .pct_start = 1.5}), ValueError);
  StepLR schedule(sgd, 2);
  EXPECT_THROW(schedule.set_step(-1), ValueError);
}

}  // namespace
}  // namespace cudp
