// GPU tests of the optimizer and norm kernels: SGD and AdamW bitwise against the CPU reference
// (which shares the per-element formula), on odd sizes, aligned and unaligned buffers, VGG-16's
// parameter count; norms against double sums and bitwise deterministic; clipping bitwise.
#include <cuda_runtime.h>  // before device_buffer.h: cudaMalloc(T**) for DeviceBuffer<T>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "kernels/optim.h"

namespace cudp::kernels {
namespace {

using testing::DeviceBuffer;

constexpr int64_t kOdd = 1000003;      // a prime: a scalar tail after the float4s
constexpr int64_t kVgg16 = 138357544;  // torchvision vgg16's parameter count

// A device buffer holding `host` from element `offset` on (offset 1 breaks 16-byte alignment).
DeviceBuffer<float> upload_at(const std::vector<float>& host, size_t offset) {
  std::vector<float> padded(host.size() + offset, testing::kPoison);
  std::copy(host.begin(), host.end(), padded.begin() + offset);
  return DeviceBuffer<float>(padded);
}

std::vector<float> download_at(const DeviceBuffer<float>& b, size_t offset) {
  const std::vector<float> all = b.download();
  return std::vector<float>(all.begin() + offset, all.end());
}

// Bitwise equality with the number of differing elements and the first of them.
::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0 && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << a.size() << " differ; first at " << first
                                       << ": " << a[first] << " vs " << b[first];
}

struct SgdConfig {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(SgdGpu, BitwiseMatchesCpu) {
  CUDP_REQUIRE_GPU();
  for (const SgdConfig& cfg :
       {SgdConfig{0.1, 0, 0, 0, false}, SgdConfig{0.05, 0, 0, 5e-4, false},
        SgdConfig{0.05, 0.9, 0, 5e-4, false}, SgdConfig{0.05, 0.9, 0.1, 1e-2, false},
        SgdConfig{0.05, 0.9, 0, 5e-4, true}}) {
    for (const size_t offset : {size_t(0), size_t(1)}) {
      SCOPED_TRACE(::testing::Message()
                   << "momentum " << cfg.momentum << " dampening " << cfg.dampening << " wd "
                   << cfg.weight_decay << " nesterov " << cfg.nesterov << " offset " << offset);
      std::vector<float> p = testing::random_vector(kOdd, 301), buf(kOdd, testing::kPoison);
      auto pg = upload_at(p, offset), bg = upload_at(buf, offset);
      const bool has_buf = cfg.momentum != 0;
      for (int t = 0; t < 3; ++t) {
        const std::vector<float> grad = testing::random_vector(kOdd, 302 + t);
        const auto gg = upload_at(grad, offset);
        sgd_step(pg.get() + offset, gg.get() + offset, has_buf ? bg.get() + offset : nullptr, kOdd,
                 cfg.lr, cfg.momentum, cfg.dampening, cfg.weight_decay, cfg.nesterov, t == 0,
                 nullptr);
        sgd_step_cpu(p.data(), grad.data(), has_buf ? buf.data() : nullptr, kOdd, cfg.lr,
                     cfg.momentum, cfg.dampening, cfg.weight_decay, cfg.nesterov, t == 0);
      }
      EXPECT_TRUE(bitwise_equal(download_at(pg, offset), p));
      EXPECT_TRUE(bitwise_equal(download_at(bg, offset), buf));  // untouched when momentum is 0
    }
  }
}

TEST(SgdGpu, BitwiseMatchesCpuOnVgg16Size) {
  CUDP_REQUIRE_GPU();
  std::vector<float> p = testing::random_vector(kVgg16, 311),
                     buf = testing::random_vector(kVgg16, 312);
  const std::vector<float> grad = testing::random_vector(kVgg16, 313);
  DeviceBuffer<float> pg(p), bg(buf);
  const DeviceBuffer<float> gg(grad);
  sgd_step(pg.get(), gg.get(), bg.get(), kVgg16, 0.05, 0.9, 0, 5e-4, false, false, nullptr);
  sgd_step_cpu(p.data(), grad.data(), buf.data(), kVgg16, 0.05, 0.9, 0, 5e-4, false, false);
  EXPECT_TRUE(bitwise_equal(pg.download(), p));
  EXPECT_TRUE(bitwise_equal(bg.download(), buf));
}

TEST(AdamWGpu, BitwiseMatchesCpu) {
  CUDP_REQUIRE_GPU();
  struct Config {
    double lr, beta1, beta2, eps, weight_decay;
  };
  // beta1 = 0.3 makes lerp's weight 0.7: its second branch.
  for (const Config& cfg :
       {Config{1e-3, 0.9, 0.999, 1e-8, 0.0}, Config{1e-3, 0.9, 0.999, 1e-8, 1e-2},
        Config{3e-4, 0.3, 0.95, 1e-6, 0.1}}) {
    for (const size_t offset : {size_t(0), size_t(1)}) {
      SCOPED_TRACE(::testing::Message()
                   << "beta1 " << cfg.beta1 << " wd " << cfg.weight_decay << " offset " << offset);
      std::vector<float> p = testing::random_vector(kOdd, 321), m(kOdd, 0.f), v(kOdd, 0.f);
      auto pg = upload_at(p, offset), mg = upload_at(m, offset), vg = upload_at(v, offset);
      for (int step = 1; step <= 3; ++step) {
        const std::vector<float> grad = testing::random_vector(kOdd, 322 + step);
        const auto gg = upload_at(grad, offset);
        adamw_step(pg.get() + offset, gg.get() + offset, mg.get() + offset, vg.get() + offset, kOdd,
                   cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, step, nullptr);
        adamw_step_cpu(p.data(), grad.data(), m.data(), v.data(), kOdd, cfg.lr, cfg.beta1,
                       cfg.beta2, cfg.eps, cfg.weight_decay, step);
      }
      // The same fp32 operations in the same order (explicit fmaf, IEEE sqrt and division on both
      // sides): bit for bit.
      EXPECT_TRUE(bitwise_equal(download_at(pg, offset), p));
      EXPECT_TRUE(bitwise_equal(download_at(mg, offset), m));
      EXPECT_TRUE(bitwise_equal(download_at(vg, offset), v));
    }
  }
}

// Gated steps on the device: flags and skip counts in device memory, written and read only there
// (nonfinite_flag from a device loss and norm, count_skipped_step after each call), never folded,
// so the calls after a skip correct their counts on the device. A skipped call (with NaN
// gradients) leaves every byte as it was; the whole run equals the CPU reference's gated run bit
// for bit (AdamW's bias corrections after a skip are then computed on the device, with CUDA's
// pow, against the host's pow: the fp32 scalars agree unless a double result lies within 2 ulp of
// a rounding boundary).
TEST(GatedStepGpu, SkippedCallsWriteNothingAndTheRestMatchesCpu) {
  CUDP_REQUIRE_GPU();
  const std::vector<int32_t> skips = {1, 0, 1, 0, 0};
  const std::vector<float> nans(kOdd, std::nanf(""));
  const DeviceBuffer<float> finite(std::vector<float>{0.5f}), nan(std::vector<float>{nans[0]});
  for (const size_t offset : {size_t(0), size_t(1)}) {
    SCOPED_TRACE(::testing::Message() << "offset " << offset);
    // SGD with momentum and dampening, then AdamW, on the same schedule of skips.
    std::vector<float> p = testing::random_vector(kOdd, 501), buf(kOdd, testing::kPoison);
    std::vector<float> ap = testing::random_vector(kOdd, 502), am(kOdd, 0.f), av(kOdd, 0.f);
    auto pg = upload_at(p, offset), bg = upload_at(buf, offset);
    auto apg = upload_at(ap, offset), amg = upload_at(am, offset), avg = upload_at(av, offset);
    DeviceBuffer<int32_t> flag(1);
    DeviceBuffer<int64_t> sgd_counts(std::vector<int64_t>{0, 0}),
        adamw_counts(std::vector<int64_t>{0, 0});
    int64_t cpu_sgd_counts[2] = {0, 0}, cpu_adamw_counts[2] = {0, 0};
    for (size_t t = 0; t < skips.size(); ++t) {
      const std::vector<float>& grad =
          skips[t] ? nans : testing::random_vector(kOdd, 510 + int(t));
      const auto gg = upload_at(grad, offset);
      // The flag the trainer's step writes: the loss (here finite) and the norm (NaN or not).
      nonfinite_flag(finite.get(), skips[t] ? nan.get() : finite.get(), flag.get(), nullptr);
      const std::vector<float> p_before = download_at(pg, offset);
      const std::vector<float> b_before = download_at(bg, offset);
      const std::vector<float> a_before = download_at(apg, offset);
      sgd_step(pg.get() + offset, gg.get() + offset, bg.get() + offset, kOdd, 0.05, 0.9, 0.1, 5e-4,
               false, int64_t(t), StepGate{flag.get(), sgd_counts.get() + 1, 0}, nullptr);
      count_skipped_step(flag.get(), sgd_counts.get(), true, nullptr);
      adamw_step(apg.get() + offset, gg.get() + offset, amg.get() + offset, avg.get() + offset,
                 kOdd, 1e-2, 0.8, 0.95, 1e-8, 0.1, int64_t(t) + 1,
                 StepGate{flag.get(), adamw_counts.get() + 1, 0}, nullptr);
      count_skipped_step(flag.get(), adamw_counts.get(), true, nullptr);
      if (skips[t]) {
        EXPECT_TRUE(bitwise_equal(download_at(pg, offset), p_before)) << "call " << t;
        EXPECT_TRUE(bitwise_equal(download_at(bg, offset), b_before)) << "call " << t;
        EXPECT_TRUE(bitwise_equal(download_at(apg, offset), a_before)) << "call " << t;
      }
      sgd_step_cpu(p.data(), grad.data(), buf.data(), kOdd, 0.05, 0.9, 0.1, 5e-4, false,
                   int64_t(t), StepGate{&skips[t], &cpu_sgd_counts[1], 0});
      count_skipped_step_cpu(&skips[t], cpu_sgd_counts, true);
      adamw_step_cpu(ap.data(), grad.data(), am.data(), av.data(), kOdd, 1e-2, 0.8, 0.95, 1e-8,
                     0.1, int64_t(t) + 1, StepGate{&skips[t], &cpu_adamw_counts[1], 0});
      count_skipped_step_cpu(&skips[t], cpu_adamw_counts, true);
    }
    EXPECT_TRUE(bitwise_equal(download_at(pg, offset), p));
    EXPECT_TRUE(bitwise_equal(download_at(bg, offset), buf));
    EXPECT_TRUE(bitwise_equal(download_at(apg, offset), ap));
    EXPECT_TRUE(bitwise_equal(download_at(amg, offset), am));
    EXPECT_TRUE(bitwise_equal(download_at(avg, offset), av));
    EXPECT_EQ(sgd_counts.download(), (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(adamw_counts.download(), (std::vector<int64_t>{2, 2}));
  }
}

TEST(GatedStepGpu, NonfiniteFlagOnTheDevice) {
  CUDP_REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  const DeviceBuffer<float> values(std::vector<float>{1.f, 3e38f, std::nanf(""), inf, -inf, -0.f});
  DeviceBuffer<int32_t> flag(1);
  const auto at = [&](int i) { return values.get() + i; };
  const auto check = [&](const float* a, const float* b, int32_t expected) {
    flag.fill(-1);
    nonfinite_flag(a, b, flag.get(), nullptr);
    EXPECT_EQ(flag.download()[0], expected)
        << (a - values.get()) << ", " << (b ? b - values.get() : -1);
  };
  check(at(0), at(1), 0);
  check(at(5), nullptr, 0);
  check(at(2), at(0), 1);
  check(at(0), at(3), 1);
  check(at(4), nullptr, 1);
  check(at(0), at(2), 1);
}

TEST(NormGpu, MatchesDoubleSumsAndIsDeterministic) {
  CUDP_REQUIRE_GPU();
  for (const int64_t n : {int64_t(0), int64_t(1), int64_t(5), kOdd, kVgg16}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    const std::vector<float> x = testing::random_vector(size_t(n), 331);
    float sum_ref = 0, norm_ref = 0;
    sum_of_squares_cpu(x.data(), n, &sum_ref);
    global_norm_cpu(x.data(), n, &norm_ref);
    const auto aligned = upload_at(x, 0), unaligned = upload_at(x, 1);
    DeviceBuffer<float> out(4);
    out.fill(testing::kPoison);
    sum_of_squares(aligned.get(), n, out.get(), nullptr);
    global_norm(aligned.get(), n, out.get() + 1, nullptr);
    sum_of_squares(aligned.get(), n, out.get() + 2, nullptr);
    sum_of_squares(unaligned.get() + 1, n, out.get() + 3, nullptr);
    const std::vector<float> r = out.download();
    // fp32 partial sums of positive terms, each thread's run at most ~530 terms (then trees): the
    // rounding errors are random-signed, ~sqrt(530) * 6e-8 = 1.4e-6 relative; 2e-5 also covers
    // the unlikely worst case of a run (530 * 6e-8 = 3e-5 on one thread's share only).
    EXPECT_ALL_CLOSE(std::vector<float>{r[0]}, std::vector<float>{sum_ref}, 2e-5, 0);
    EXPECT_ALL_CLOSE(std::vector<float>{r[1]}, std::vector<float>{norm_ref}, 1e-5, 0);
    // The partition depends on n only: same bits on a second run and from an unaligned copy.
    EXPECT_EQ(std::memcmp(&r[0], &r[2], sizeof(float)), 0) << r[0] << " vs " << r[2];
    EXPECT_EQ(std::memcmp(&r[0], &r[3], sizeof(float)), 0) << r[0] << " vs " << r[3];
  }
}

TEST(ClipGradNormGpu, ScalesBitwiseLikeCpu) {
  CUDP_REQUIRE_GPU();
  for (const size_t offset : {size_t(0), size_t(1)}) {
    for (const float max_norm : {1.f, 1e9f}) {
      SCOPED_TRACE(::testing::Message() << "max_norm " << max_norm << " offset " << offset);
      std::vector<float> g = testing::random_vector(kOdd, 341);
      auto gg = upload_at(g, offset);
      DeviceBuffer<float> norm(1);
      norm.fill(testing::kPoison);
      clip_grad_norm(gg.get() + offset, kOdd, max_norm, norm.get(), nullptr);
      // The CPU scales by the GPU's norm: the coefficient and products are then bitwise equal.
      const float gpu_norm = norm.download()[0];
      float norm_ref = 0;
      global_norm_cpu(g.data(), kOdd, &norm_ref);
      EXPECT_ALL_CLOSE(std::vector<float>{gpu_norm}, std::vector<float>{norm_ref}, 1e-5, 0);
      const std::vector<float> original = g;
      scale_by_clip_coefficient_cpu(g.data(), kOdd, &gpu_norm, max_norm);
      EXPECT_TRUE(bitwise_equal(download_at(gg, offset), g));
      if (max_norm > 1e8f) {
        EXPECT_TRUE(bitwise_equal(g, original));  // coefficient exactly 1
      }
    }
  }
}

// The update that also writes the gradients' norm (grad_norm, the trainer's step): the norm has
// global_norm's bits and the update its own launch's (parameters, state, bf16 copy), for SGD and
// AdamW, eager and captured scalars, a skipped step (nothing written, the norm still), aligned and
// unaligned buffers, sizes with a scalar tail, below one block and past the norm's 1,024 blocks
// (several chunks a thread).
TEST(UpdateWithNormGpu, NormHasGlobalNormsBitsAndTheUpdateItsOwn) {
  CUDP_REQUIRE_GPU();
  const int64_t past_blocks = 4 * 256 * 1024 * 3 + 7;
  for (const int64_t n : {int64_t(0), int64_t(1), int64_t(6), int64_t(1023), kOdd, past_blocks}) {
    const std::vector<float> grad = testing::random_vector(size_t(n), 601);
    const std::vector<float> p0 = testing::random_vector(size_t(n), 602);
    const std::vector<float> b0 = testing::random_vector(size_t(n), 603);
    const std::vector<float> v0(size_t(n), 0.25f);
    float ref = 0;
    global_norm_cpu(grad.data(), n, &ref);
    for (const size_t offset : {size_t(0), size_t(1)}) {
      for (const int32_t skip : {0, 1}) {
        for (const bool captured : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "n " << n << " offset " << offset << " skip " << skip
                                            << " captured " << captured);
          const auto gg = upload_at(grad, offset);
          const float* g = gg.get() + offset;
          const DeviceBuffer<int32_t> flag(std::vector<int32_t>{skip});
          const StepGate gate{flag.get(), nullptr, 0};
          const SgdScalars sgd = sgd_scalars(n, 0.05, 0.9, 0.1, 5e-4, false, 1, 0);
          const AdamWScalars adamw = adamw_scalars(n, 1e-2, 0.8, 0.95, 1e-8, 0.1, 2, 0);
          const DeviceBuffer<SgdScalars> sgd_slot(std::vector<SgdScalars>{sgd});
          const DeviceBuffer<AdamWScalars> adamw_slot(std::vector<AdamWScalars>{adamw});
          // Run 0: each update alone, then global_norm twice; run 1: the updates with the norm.
          struct Run {
            DeviceBuffer<float> sgd_p, sgd_buf, adamw_p, adamw_m, adamw_v, norms;
            DeviceBuffer<__nv_bfloat16> copy;
          };
          std::vector<Run> runs;
          for (int r = 0; r < 2; ++r) {
            runs.push_back(Run{upload_at(p0, offset), upload_at(b0, offset), upload_at(p0, offset),
                               upload_at(b0, offset), upload_at(v0, offset),
                               DeviceBuffer<float>(std::vector<float>(2, testing::kPoison)),
                               DeviceBuffer<__nv_bfloat16>(std::vector<__nv_bfloat16>(
                                   size_t(n) + offset, __float2bfloat16(-7.f)))});
          }
          for (int r = 0; r < 2; ++r) {
            Run& run = runs[size_t(r)];
            const auto at = [&](DeviceBuffer<float>& b) { return b.get() + offset; };
            __nv_bfloat16* copy = run.copy.get() + offset;
            float* sgd_norm = r == 1 ? run.norms.get() : nullptr;
            float* adamw_norm = r == 1 ? run.norms.get() + 1 : nullptr;
            if (captured) {
              sgd_step_captured(at(run.sgd_p), g, at(run.sgd_buf), n, sgd, sgd_slot.get(), gate,
                                nullptr, copy, sgd_norm);
              adamw_step_captured(at(run.adamw_p), g, at(run.adamw_m), at(run.adamw_v), n,
                                  adamw_slot.get(), gate, nullptr, nullptr, adamw_norm);
            } else {
              sgd_step(at(run.sgd_p), g, at(run.sgd_buf), n, 0.05, 0.9, 0.1, 5e-4, false, 1, gate,
                       nullptr, copy, sgd_norm);
              adamw_step(at(run.adamw_p), g, at(run.adamw_m), at(run.adamw_v), n, 1e-2, 0.8, 0.95,
                         1e-8, 0.1, 2, gate, nullptr, nullptr, adamw_norm);
            }
            if (r == 0) {
              global_norm(g, n, run.norms.get(), nullptr);
              global_norm(g, n, run.norms.get() + 1, nullptr);
            }
          }
          Run &alone = runs[0], &with = runs[1];
          EXPECT_TRUE(
              bitwise_equal(download_at(with.sgd_p, offset), download_at(alone.sgd_p, offset)));
          EXPECT_TRUE(
              bitwise_equal(download_at(with.sgd_buf, offset), download_at(alone.sgd_buf, offset)));
          EXPECT_TRUE(
              bitwise_equal(download_at(with.adamw_p, offset), download_at(alone.adamw_p, offset)));
          EXPECT_TRUE(
              bitwise_equal(download_at(with.adamw_m, offset), download_at(alone.adamw_m, offset)));
          EXPECT_TRUE(
              bitwise_equal(download_at(with.adamw_v, offset), download_at(alone.adamw_v, offset)));
          const std::vector<__nv_bfloat16> c0 = alone.copy.download(), c1 = with.copy.download();
          EXPECT_EQ(std::memcmp(c0.data(), c1.data(), c0.size() * sizeof(__nv_bfloat16)), 0);
          const std::vector<float> norms = with.norms.download();
          EXPECT_TRUE(bitwise_equal(norms, alone.norms.download()));
          EXPECT_ALL_CLOSE(norms, (std::vector<float>{ref, ref}), 1e-5, 0);
          if (skip != 0) {  // nothing written, the norm all the same
            EXPECT_TRUE(bitwise_equal(download_at(with.sgd_p, offset), p0));
            EXPECT_TRUE(bitwise_equal(download_at(with.sgd_buf, offset), b0));
            EXPECT_TRUE(bitwise_equal(download_at(with.adamw_p, offset), p0));
            EXPECT_TRUE(bitwise_equal(download_at(with.adamw_m, offset), b0));
            EXPECT_TRUE(bitwise_equal(download_at(with.adamw_v, offset), v0));
            EXPECT_TRUE(std::all_of(c1.begin(), c1.end(),
                                    [](__nv_bfloat16 c) { return __bfloat162float(c) == -7.f; }));
          } else if (n > 0) {
            EXPECT_FALSE(bitwise_equal(download_at(with.sgd_p, offset), p0)) << "no update ran";
            EXPECT_FALSE(bitwise_equal(download_at(with.adamw_p, offset), p0)) << "no update ran";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace cudp::kernels
