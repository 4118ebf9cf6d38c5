// Shared by the SyncBatchNorm2d tests (host and GPU): the whole-batch truth (one BatchNorm2d) and
// the tolerances within which N participants must reproduce it, derived below.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "layers/batchnorm.h"
#include "tests/layers/layer_testing.h"

namespace cudp::testing {

// What a training step of batch norm produces: y, dx, dgamma, dbeta (summed over participants) and
// the running statistics after it.
struct BnStep {
  std::vector<float> y, dx, dgamma, dbeta, running_mean, running_var;
};

// Bounds on |participants - whole batch| for one step, from the whole batch's data.
//
// Let u = 2^-24 (f32 rounding), per channel R = max x - min x (so |x - K| <= R for any sample shift
// K), var the biased variance, invstd = 1 / sqrt(var + eps), xhat = (x - mean) * invstd, X = max
// |xhat|, g the gradient reaching the normalisation, G = max |g|, k = gamma * invstd. The
// whole-batch BatchNorm2d computes everything in double and rounds once on store (CPU) or in f32
// from the same partials (GPU, where the same bound holds with u for each f32 operation: the
// merge adds one step per participant). The participants differ from it only by:
//   - each participant's summary (mean of x - K_p, M2_p) rounded to f32, relative u: the merged
//     mean moves by at most u R, and the merged M2 / n by at most u (var + 4 R^2) (u var from the
//     M2s, and each Chan cross term n_a n_b / n (delta)^2 with |delta| <= R moved by at most 2 u R
//     in delta, the weights n_a n_b / n^2 summing to less than 1);
//   - so e = u (R invstd + (var + 4 R^2) / (var + eps)) + 2 u bounds the saved mean's error in
//   units
//     of the deviation (u R invstd), the relative error of invstd (half the variance's relative
//     error) and their f32 rounding (one u each);
//   - backward: each participant's sums rounded to f32, then summed over N participants in f32:
//     relative N u of sum |g| and sum |g (x - mean)|.
// First order in these errors (their products are below u^2), with dx = k (g - a - xhat b),
// a = mean g, b = mean g xhat (|a| <= G, |b| <= G X):
//   |d y|          <= |gamma| e (1 + X) + ulp(y)   (e from the mean, X e from invstd)
//   |d running_mean| <= m u R + ulp, |d running_var| <= m u (var + 4 R^2) n / (n - 1) + ulp
//   |d dx|         <= |k|max G (e (2 + X^2 + 2 X (1 + X)) + N u (1 + X^2)) + ulp(dx)
//   |d dgamma|     <= (e + N u) sum |g| (1 + |xhat|),   |d dbeta| <= N u sum |g|
// ulp(v) is one f32 unit in the last place of max |v| (both sides round once to f32). The bounds
// take the maximum over channels; the tests compare every element against them.
//
// GPU participants (f32_arithmetic) against the CPU's double truth add the f32 arithmetic of the
// kernels: any sum of L = rows terms in any order (per thread, across the block's tree, across
// partials, across Chan merges) errs by at most (L - 1) u of the sum of |terms|, so e gains L u
// and the backward sums' N u becomes (N + L) u; the element-wise pass (x - K, - mean, gamma *
// invstd, 1 / sqrtf, one fma) adds u (2 R invstd + 4) to e, and its own rounding one more ulp.
struct BnTolerance {
  double y = 0, dx = 0, dgamma = 0, dbeta = 0, running_mean = 0, running_var = 0;
};

inline double ulp_of(double v) {
  const float f = float(std::fabs(v));
  return double(std::nextafter(f, INFINITY)) - double(f);
}

inline double max_abs_of(const std::vector<float>& v) {
  double m = 0;
  for (float e : v) m = std::max(m, std::fabs(double(e)));
  return m;
}

// x, g: [rows, c] (g: the gradient reaching the normalisation, after any ReLU mask); gamma: c.
inline BnTolerance sync_bn_tolerance(const std::vector<float>& x, const std::vector<float>& g,
                                     const std::vector<float>& gamma, int c, double eps,
                                     double momentum, int participants, const BnStep& truth,
                                     bool f32_arithmetic = false) {
  const double u = std::ldexp(1.0, -24);
  const size_t rows = x.size() / c;
  BnTolerance t;
  double y_bound = 0, dx_bound = 0, dgamma_bound = 0, dbeta_bound = 0, rm_bound = 0, rv_bound = 0;
  for (int ch = 0; ch < c; ++ch) {
    double lo = INFINITY, hi = -INFINITY, mean = 0;
    for (size_t r = 0; r < rows; ++r) {
      lo = std::min(lo, double(x[r * c + ch]));
      hi = std::max(hi, double(x[r * c + ch]));
      mean += x[r * c + ch];
    }
    mean /= double(rows);
    double m2 = 0;
    for (size_t r = 0; r < rows; ++r) m2 += std::pow(x[r * c + ch] - mean, 2);
    const double var = m2 / double(rows), invstd = 1 / std::sqrt(var + eps), range = hi - lo;
    const double steps = f32_arithmetic ? double(rows) : 0.0;
    const double e = u * (range * invstd + (var + 4 * range * range) / (var + eps)) + 2 * u +
                     (f32_arithmetic ? u * (steps + 2 * range * invstd + 4) : 0.0);
    double xmax = 0, gmax = 0, sum_g = 0, sum_g_xhat = 0;
    for (size_t r = 0; r < rows; ++r) {
      const double xhat = std::fabs(x[r * c + ch] - mean) * invstd, gr = std::fabs(g[r * c + ch]);
      xmax = std::max(xmax, xhat);
      gmax = std::max(gmax, gr);
      sum_g += gr;
      sum_g_xhat += gr * (1 + xhat);
    }
    const double k = std::fabs(gamma[ch]) * invstd, n = participants + steps;
    y_bound = std::max(y_bound, std::fabs(gamma[ch]) * e * (1 + xmax));
    dx_bound = std::max(
        dx_bound,
        k * gmax * (e * (2 + xmax * xmax + 2 * xmax * (1 + xmax)) + n * u * (1 + xmax * xmax)));
    dgamma_bound = std::max(dgamma_bound, (e + n * u) * sum_g_xhat);
    dbeta_bound = std::max(dbeta_bound, n * u * sum_g);
    rm_bound = std::max(rm_bound, momentum * u * range * (1 + steps));
    rv_bound = std::max(rv_bound, momentum * u * (var + 4 * range * range) * (1 + steps) *
                                      double(rows) / double(rows - 1));
  }
  const double ulps = f32_arithmetic ? 2 : 1;
  t.y = y_bound + ulps * ulp_of(max_abs_of(truth.y));
  t.dx = dx_bound + ulps * ulp_of(max_abs_of(truth.dx));
  t.dgamma = dgamma_bound + ulps * ulp_of(max_abs_of(truth.dgamma));
  t.dbeta = dbeta_bound + ulps * ulp_of(max_abs_of(truth.dbeta));
  // f32: the update (1 - m) r + m v rounds three times, and K + mean once more.
  t.running_mean = rm_bound + (f32_arithmetic ? 4 : 1) * ulp_of(max_abs_of(truth.running_mean));
  t.running_var = rv_bound + (f32_arithmetic ? 3 : 1) * ulp_of(max_abs_of(truth.running_var));
  return t;
}

// One training step of batch norm (or of a module around it) on `x` with output gradient `dy`, the
// gradients zeroed first: y, dx, the first two parameters' gradients (gamma's and beta's) and the
// first two buffers (the running mean and variance) after it.
inline BnStep bn_training_step(Module& bn, const Tensor& x, const Tensor& dy) {
  bn.zero_grad();
  BnStep s;
  s.y = values(bn.forward(x));
  s.dx = values(bn.backward(dy));
  const auto params = bn.named_parameters();
  s.dgamma = values(params.at(0).second->grad);
  s.dbeta = values(params.at(1).second->grad);
  const auto buffers = bn.named_buffers();
  s.running_mean = values(*buffers.at(0).second);
  s.running_var = values(*buffers.at(1).second);
  return s;
}

inline void expect_within(const std::vector<float>& actual, const std::vector<float>& expected,
                          double tolerance, const char* what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double d = std::fabs(double(actual[i]) - double(expected[i]));
    if (!(d <= tolerance) && bad++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << actual[i] << " vs " << expected[i]
                    << " (difference " << d << ", tolerance " << tolerance << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": elements beyond the tolerance " << tolerance;
}

}  // namespace cudp::testing
