// Helpers shared by the layer tests: random tensors and parameters, finite-difference gradient
// checks on the CPU path, and CPU-versus-GPU comparisons of a whole module.
//
// Gradient checks. With a fixed random upstream gradient g, the scalar L(v) = sum_j g_j y_j(v) has
// dL/dv equal to what backward(g) returns (for the input, and accumulated into each parameter's
// grad). We take central differences of L along single coordinates of the input and of every
// parameter, computing L in double from the layer's own fp32 forward, and compare.
//
// Why the tolerance is sound. Let y_j be the fp32 output and Y_j the exact one. The kernels' CPU
// references accumulate in double and round once per fp32 result; a layer chains at most `ulps`
// such roundings, each of a value no larger than `scale` (the largest |y| and the largest input or
// parameter magnitude), so |y_j - Y_j| <= ulps * 2^-24 * (|y_j| + scale) =: e_j. Then L is known to
// within B = sum_j |g_j| e_j (the double sum adds nothing measurable), and the central difference
// (L(v+) - L(v-)) / (v+ - v-), with v+- the fp32 values actually used (their difference is exact),
// is within (B+ + B-) / (v+ - v-) of the exact difference quotient. For the layers checked this
// way the exact quotient *is* the derivative: they are linear in each input or parameter
// (Linear, Conv2d, pooling by average, Flatten, Dropout with a fixed mask, BatchNorm's weight and
// bias) or piecewise linear with the test inputs kept further than h from every kink (ReLU: |x| >=
// 0.1; MaxPool: values on a grid of spacing 0.1 so that no perturbation changes an argmax). So a
// large step (h = 1/8 to 1/32) makes the rounding term small and the check tight. The analytic
// gradient is itself fp32 (one rounding of a double sum): it gets rtol = 1e-5 more.
// BatchNorm's input gradient is not piecewise linear; its test takes differences of the kernel's
// double-precision reference instead (batchnorm_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <vector>

#include "common/compare.h"
#include "common/expect_error.h"
#include "engine/core/tensor.h"
#include "layers/module.h"

namespace cudp::testing {

inline Tensor random_tensor(const Shape& shape, uint64_t seed, float lo = -1.f, float hi = 1.f,
                            Device device = Device::cpu()) {
  return Tensor::from_vector(random_vector(static_cast<size_t>(shape_numel(shape)), seed, lo, hi),
                             shape, device);
}

// Values in +-[lo, hi]: random magnitudes and signs, never near zero (ReLU's kink).
inline Tensor away_from_zero(const Shape& shape, uint64_t seed, float lo = 0.1f, float hi = 1.f) {
  std::vector<float> v = random_vector(static_cast<size_t>(shape_numel(shape)), seed, lo, hi);
  const std::vector<float> sign = random_vector(v.size(), seed + 1);
  for (size_t i = 0; i < v.size(); ++i) v[i] = sign[i] < 0 ? -v[i] : v[i];
  return Tensor::from_vector(v, shape);
}

// A random permutation of {k * spacing - offset}: distinct values, any two at least `spacing` apart
// (MaxPool's argmax cannot change under a perturbation smaller than spacing / 2).
inline Tensor distinct_values(const Shape& shape, uint64_t seed, float spacing = 0.1f) {
  const size_t n = static_cast<size_t>(shape_numel(shape));
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = spacing * static_cast<float>(i) - spacing * n / 2;
  const std::vector<float> keys = random_vector(n, seed);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = v[order[i]];
  return Tensor::from_vector(out, shape);
}

// Fills every parameter with uniform values in [lo, hi) (biases non-zero, unlike the VGG init).
inline void randomize_parameters(Module& m, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  for (auto& [name, p] : m.named_parameters()) p->data.uniform_(lo, hi, seed++);
}

// The elements as floats (bf16 widened, exactly).
inline std::vector<float> values(const Tensor& t) {
  return convert(t, DType::f32).to_vector<float>();
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// At most `limit` coordinates of [0, n), spread evenly, the first and the last included.
inline std::vector<size_t> sample_coords(size_t n, size_t limit) {
  std::vector<size_t> out;
  if (n <= limit) {
    for (size_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  for (size_t k = 0; k < limit; ++k) out.push_back(k * (n - 1) / (limit - 1));
  return out;
}

struct GradCheckOptions {
  double h = 1.0 / 16;      // the step (see the header comment for why large steps are sound)
  int ulps = 4;             // fp32 roundings a layer may chain per output
  size_t max_coords = 150;  // coordinates checked per tensor
  double rtol = 1e-5;       // for the fp32 analytic gradient
  bool check_input = true;
  // Runs the forward for each evaluation (default: module.forward); a Dropout test rewinds its
  // offset here so that every evaluation uses the same mask.
  std::function<Tensor(Module&, const Tensor&)> forward = nullptr;
};

namespace detail {

// L = <g, y> and the bound on its error from y's fp32 rounding.
struct Loss {
  double value = 0, bound = 0;
};

inline Loss dot_loss(const std::vector<float>& y, const std::vector<float>& g, double scale,
                     int ulps) {
  Loss l;
  const double unit = ulps * std::ldexp(1.0, -24);
  for (size_t j = 0; j < y.size(); ++j) {
    l.value += static_cast<double>(g[j]) * y[j];
    l.bound += std::fabs(g[j]) * unit * (std::fabs(y[j]) + scale);
  }
  return l;
}

// Central differences of L along the sampled coordinates of `v`, compared with `analytic`.
inline ::testing::AssertionResult check_coordinates(const std::string& what, float* v, size_t n,
                                                    const std::vector<float>& analytic,
                                                    const std::function<Loss()>& loss,
                                                    const GradCheckOptions& o) {
  if (analytic.size() != n) {
    return ::testing::AssertionFailure()
           << what << ": gradient has " << analytic.size() << " elements, expected " << n;
  }
  int bad = 0;
  std::ostringstream report;
  double worst = -1;
  for (size_t i : sample_coords(n, o.max_coords)) {
    const float saved = v[i];
    const float plus = static_cast<float>(saved + o.h), minus = static_cast<float>(saved - o.h);
    v[i] = plus;
    const Loss lp = loss();
    v[i] = minus;
    const Loss lm = loss();
    v[i] = saved;
    const double step = static_cast<double>(plus) - static_cast<double>(minus);
    const double numeric = (lp.value - lm.value) / step;
    const double tol = (lp.bound + lm.bound) / step + o.rtol * std::fabs(numeric) + 1e-12;
    const double err = std::fabs(analytic[i] - numeric);
    if (err - tol > worst) worst = err - tol;
    if (err > tol && bad++ < 5) {
      report << "\n  " << what << "[" << i << "]: backward " << analytic[i] << ", differences "
             << numeric << " (tolerance " << tol << ")";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " coordinates of " << what
                                       << " disagree with finite differences" << report.str();
}

}  // namespace detail

// Checks backward's input gradient and every parameter gradient of `m` (on the CPU) at input `x`
// against central differences of its forward. Leaves the parameters as they were and their grads
// holding exactly one backward's gradient.
inline void check_gradients(Module& m, const Tensor& x, uint64_t seed, GradCheckOptions o = {}) {
  if (!o.forward) o.forward = [](Module& mod, const Tensor& in) { return mod.forward(in); };
  // Each evaluation gets a fresh copy of the input: an in-place layer overwrites it.
  auto run = [&](const Tensor& input) { return values(o.forward(m, input.clone())); };

  m.zero_grad();
  const Tensor y = o.forward(m, x.clone());
  const std::vector<float> g = random_vector(static_cast<size_t>(y.numel()), seed);
  const Tensor dx = m.backward(Tensor::from_vector(g, y.shape()));

  double scale = std::max(max_abs(values(y)), max_abs(values(x)));
  for (auto& [name, p] : m.named_parameters()) scale = std::max(scale, max_abs(values(p->data)));

  Tensor probe = x.clone();
  auto loss = [&] { return detail::dot_loss(run(probe), g, scale, o.ulps); };
  if (o.check_input) {
    EXPECT_TRUE(detail::check_coordinates("input", probe.data<float>(),
                                          static_cast<size_t>(probe.numel()), values(dx), loss, o));
  }
  for (auto& [name, p] : m.named_parameters()) {
    auto param_loss = [&] { return detail::dot_loss(run(x), g, scale, o.ulps); };
    EXPECT_TRUE(detail::check_coordinates(name, p->data.data<float>(),
                                          static_cast<size_t>(p->data.numel()), values(p->grad),
                                          param_loss, o));
  }
}

// ---- GPU comparisons ----------------------------------------------------------------------------

// GPU results against the CPU reference: |gpu - cpu| <= atol * max(1, max|cpu|) + rtol * |cpu|.
// The absolute term scales with the tensor's largest element, because sums that cancel to near
// zero carry the rounding error of their largest terms, not of their result. A bf16 result is one
// rounding of an fp32 value that the two sides compute in different orders: where that value lies
// within their difference of a rounding boundary, the two round to neighbours, one bf16 unit in
// the last place apart, which is at most 2^-7 of the value (8 significant bits); so rtol is at
// least that for bf16 tensors (and the dtypes must agree).
inline ::testing::AssertionResult gpu_close(const Tensor& gpu, const Tensor& cpu, double rtol,
                                            double atol) {
  if (gpu.dtype() != cpu.dtype()) {
    return ::testing::AssertionFailure()
           << "dtypes differ: GPU " << gpu.str() << ", CPU " << cpu.str();
  }
  if (cpu.dtype() == DType::bf16) rtol = std::max(rtol, 1.0 / 128);
  const std::vector<float> reference = values(cpu);
  return all_close(values(gpu), reference, rtol, atol * std::max(1.0, max_abs(reference)));
}

// Runs `cpu_module` (on the CPU) and its clone on `device` on the same input and upstream gradient,
// and compares outputs, input gradients, parameter gradients and buffers with gpu_close. The CPU
// path is the reference. Returns the GPU clone for further checks.
inline std::shared_ptr<Module> expect_gpu_matches_cpu(Module& cpu_module, const Tensor& x,
                                                      uint64_t seed, double rtol = 1e-5,
                                                      double atol = 1e-5,
                                                      Device device = Device::cuda(0)) {
  std::shared_ptr<Module> gpu = cpu_module.clone(device);
  cpu_module.zero_grad();
  const Tensor y_cpu = cpu_module.forward(x.clone());
  const Tensor y_gpu = gpu->forward(x.to(device));
  EXPECT_EQ(y_gpu.device(), device);
  EXPECT_TRUE(gpu_close(y_gpu, y_cpu, rtol, atol)) << "forward output";
  // The upstream gradient has the output's dtype (the same values on both sides).
  const Tensor g = convert(random_tensor(y_cpu.shape(), seed), y_cpu.dtype());
  const Tensor dx_cpu = cpu_module.backward(g.clone());
  const Tensor dx_gpu = gpu->backward(g.to(device));
  EXPECT_TRUE(gpu_close(dx_gpu, dx_cpu, rtol, atol)) << "input gradient";
  const auto cpu_params = cpu_module.named_parameters();
  const auto gpu_params = gpu->named_parameters();
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    EXPECT_EQ(gpu_params[i].second->grad.device(), device);
    EXPECT_TRUE(gpu_close(gpu_params[i].second->grad, cpu_params[i].second->grad, rtol, atol))
        << "gradient of " << cpu_params[i].first;
  }
  const auto cpu_buffers = cpu_module.named_buffers();
  const auto gpu_buffers = gpu->named_buffers();
  for (size_t i = 0; i < cpu_buffers.size(); ++i) {
    if (cpu_buffers[i].second->dtype() != DType::f32) {
      EXPECT_EQ(gpu_buffers[i].second->to_vector<int64_t>(),
                cpu_buffers[i].second->to_vector<int64_t>())
          << cpu_buffers[i].first;
      continue;
    }
    EXPECT_TRUE(gpu_close(*gpu_buffers[i].second, *cpu_buffers[i].second, rtol, atol))
        << "buffer " << cpu_buffers[i].first;
  }
  return gpu;
}

}  // namespace cudp::testing
