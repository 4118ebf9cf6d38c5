// GPU tests of the tensor-core matmul (kernels/matmul.h) and of gemm()'s TF32/BF16 path: against
// the double-precision CPU reference on fresh random inputs, odd shapes (no multiple of any tile),
// every tile width and forced split counts, the epilogue (alpha, beta, bias, ReLU, bf16 output),
// poisoned outputs, bitwise determinism, and the errors for what the kernels cannot take.
//
// Error bounds, per element, with p_l = a_l * b_l the k products of an output (|a|, |b| < 1):
// - BF16 operands are exact bf16 values, so the products are exact and only the fp32 accumulation
//   errs: at most u·(|s_1| + ... + |s_k|) for the running sums s_i, u = 2^-24. We bound it by
//   64u·Σ|p_l|, which is about 50 standard deviations of the random-sign walk (its standard
//   deviation is ~u·Σ|p|) and leaves room for an accumulator that rounds less carefully than IEEE.
// - TF32 keeps 10 of fp32's 23 mantissa bits of each operand (rounded or truncated: relative error
//   below 2^-10 each, so below 2^-9 per product). The errors of the k products are independent: a
//   random part with standard deviation below 2^-10·sqrt(Σp²) and, if the hardware truncates, a
//   bias toward zero of at most 2^-9·|c|. tol = 2^-9·|c| + 6·2^-10·sqrt(Σp²) + the bf16 bound.
// - A bf16 output adds its rounding: 2^-8·|c|.
// One wrong or missing product (|p| ~ 0.25 on average) exceeds these bounds for k up to ~10^4 in
// BF16; in TF32 a missing product is ~ sqrt(k) times smaller than |c| and the relative L2 error,
// checked too (bound 2^-9), catches a missing k-block or a wrong row.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/compare.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "common/scoped_switch.h"
#include "kernels/gemm.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"

namespace cudp::kernels {
namespace {

using testing::DeviceBuffer;
using testing::kPoison;

float bf16_value(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// A host matrix of rows x ld elements in the math's operand type, with its float values.
struct Operand {
  std::vector<float> values;  // as the kernel sees them (bf16-rounded for BF16)
  std::vector<uint16_t> bf16;
  int64_t ld = 0;

  Operand(int rows, int cols, int64_t ld_, Math math, uint64_t seed) : ld(ld_) {
    values = testing::random_vector(size_t(rows) * ld, seed);
    if (math == Math::BF16) {
      bf16.resize(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        bf16[i] = detail::f32_to_bf16_bits(values[i]);
        values[i] = bf16_value(bf16[i]);
      }
    }
    (void)cols;
  }
  size_t bytes() const { return bf16.empty() ? values.size() * 4 : bf16.size() * 2; }
  const void* host() const {
    return bf16.empty() ? static_cast<const void*>(values.data()) : bf16.data();
  }
};

struct Case {
  int m, n, k;
  Math math = Math::BF16;
  DType c_type = DType::F32;
  float alpha = 1.f, beta = 0.f;
  bool bias = false, relu = false;
  int pad = 0;  // extra elements per row (kept a multiple of 16 bytes for A and B)
  bool mask = false;  // a ReLU mask in C's layout and type (backward-data's fused ReLU backward)
  bool b_transposed = false;  // B stored k x n (MatmulProblem::b_transposed)
  bool a_transposed = false;  // A stored k x m (MatmulProblem::a_transposed)
};

std::string describe(const Case& c) {
  std::ostringstream s;
  s << math_name(c.math) << " m " << c.m << " n " << c.n << " k " << c.k << " C "
    << dtype_name(c.c_type) << " alpha " << c.alpha << " beta " << c.beta << " bias " << c.bias
    << " relu " << c.relu << " pad " << c.pad << " mask " << c.mask << " B k x n " << c.b_transposed
    << " A k x m " << c.a_transposed;
  return s.str();
}

class Product {
 public:
  explicit Product(const Case& c, uint64_t seed)
      : c_(c),
        esize_(c.math == Math::BF16 ? 2 : 4),
        lda_(((c.a_transposed ? c.m : c.k) + 16 / esize_ - 1) / (16 / esize_) * (16 / esize_) +
             16 / esize_ * c.pad),
        ldb_(c.b_transposed
                 ? (c.n + 16 / esize_ - 1) / (16 / esize_) * (16 / esize_) + 16 / esize_ * c.pad
                 : lda_),
        a_(c.a_transposed ? c.k : c.m, c.a_transposed ? c.m : c.k, lda_, c.math, seed),
        b_(c.b_transposed ? c.k : c.n, c.b_transposed ? c.n : c.k, ldb_, c.math, seed + 1),
        ldc_(c.n + c.pad) {
    bias_ = testing::random_vector(size_t(c.n), seed + 2);
    c0_ = testing::random_vector(size_t(c.m) * ldc_, seed + 3);
    if (c.c_type == DType::BF16) {
      for (float& v : c0_) v = bf16_value(detail::f32_to_bf16_bits(v));
    }
    // Mask values in C's type, both signs and exact zeros (masked like negatives).
    mask_ = testing::random_vector(size_t(c.m) * ldc_, seed + 4);
    for (size_t i = 0; i < mask_.size(); i += 5) mask_[i] = 0.f;
    if (c.c_type == DType::BF16) {
      for (float& v : mask_) v = bf16_value(detail::f32_to_bf16_bits(v));
    }
  }

  MatmulProblem problem(const void* a, const void* b, void* cbuf, const float* bias,
                        const void* mask = nullptr) const {
    MatmulProblem p;
    p.m = c_.m;
    p.n = c_.n;
    p.k = c_.k;
    p.math = c_.math;
    p.a = a;
    p.lda = lda_;
    p.b = b;
    p.ldb = ldb_;
    p.b_transposed = c_.b_transposed;
    p.a_transposed = c_.a_transposed;
    p.c = cbuf;
    p.ldc = ldc_;
    p.c_type = c_.c_type;
    p.alpha = c_.alpha;
    p.beta = c_.beta;
    p.bias = c_.bias ? bias : nullptr;
    p.relu = c_.relu;
    p.mask = mask;
    return p;
  }

  // C as float after the GPU run. With beta == 0 C starts as NaN, which every element must
  // overwrite without reading (0 * NaN is NaN: a deferred zero_grad leaves stale gradients there,
  // layers/module.h), and its padding columns as kPoison, which must stay.
  std::vector<float> gpu(const std::optional<MatmulPlan>& plan) const {
    DeviceBuffer<uint8_t> da(a_.bytes()), db(b_.bytes());
    CUDP_CUDA_CHECK(cudaMemcpy(da.get(), a_.host(), a_.bytes(), cudaMemcpyHostToDevice));
    CUDP_CUDA_CHECK(cudaMemcpy(db.get(), b_.host(), b_.bytes(), cudaMemcpyHostToDevice));
    DeviceBuffer<float> dbias(bias_);
    const size_t count = size_t(c_.m) * ldc_;
    std::vector<float> start = c_.beta != 0.f ? c0_ : std::vector<float>(count, kPoison);
    if (c_.beta == 0.f) {
      for (int i = 0; i < c_.m; ++i) {
        for (int j = 0; j < c_.n; ++j) {
          start[size_t(i) * ldc_ + j] = std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
    std::vector<float> out(count);
    if (c_.c_type == DType::F32) {
      DeviceBuffer<float> dc(start), dmask(mask_);
      launch(da.get(), db.get(), dc.get(), dbias.get(), c_.mask ? dmask.get() : nullptr, plan);
      out = dc.download();
    } else {
      std::vector<uint16_t> bits(count), mask_bits(count);
      for (size_t i = 0; i < count; ++i) bits[i] = detail::f32_to_bf16_bits(start[i]);
      for (size_t i = 0; i < count; ++i) mask_bits[i] = detail::f32_to_bf16_bits(mask_[i]);
      DeviceBuffer<uint16_t> dc(bits), dmask(mask_bits);
      launch(da.get(), db.get(), dc.get(), dbias.get(), c_.mask ? dmask.get() : nullptr, plan);
      bits = dc.download();
      for (size_t i = 0; i < count; ++i) out[i] = bf16_value(bits[i]);
    }
    return out;
  }

  // Per-element reference (double) and bound; checks both and the relative L2 error.
  void check(const std::vector<float>& got) const {
    double err2 = 0, ref2 = 0, worst = 0;
    int64_t bad = 0, worst_at = -1;
    double worst_ref = 0, worst_tol = 0;
    for (int i = 0; i < c_.m; ++i) {
      for (int j = 0; j < c_.n; ++j) {
        double sum = 0, abs_sum = 0, sq_sum = 0;
        for (int l = 0; l < c_.k; ++l) {
          const size_t b_at = c_.b_transposed ? size_t(l) * ldb_ + j : size_t(j) * ldb_ + l;
          const size_t a_at = c_.a_transposed ? size_t(l) * lda_ + i : size_t(i) * lda_ + l;
          const double p = double(a_.values[a_at]) * b_.values[b_at];
          sum += p;
          abs_sum += std::fabs(p);
          sq_sum += p * p;
        }
        const size_t at = size_t(i) * ldc_ + j;
        double ref = double(c_.alpha) * sum;
        if (c_.beta != 0.f) ref += double(c_.beta) * c0_[at];
        if (c_.bias) ref += bias_[j];
        if (c_.relu) ref = std::max(ref, 0.0);
        if (c_.mask && mask_[at] <= 0.f) ref = 0.0;
        double tol = std::ldexp(64.0, -24) * std::fabs(c_.alpha) * abs_sum +
                     std::ldexp(1.0, -22) * (std::fabs(ref) + 1.0);
        if (c_.math == Math::TF32) {
          tol += std::fabs(c_.alpha) *
                 (std::ldexp(1.0, -9) * std::fabs(sum) + 6 * std::ldexp(1.0, -10) * std::sqrt(sq_sum));
        }
        if (c_.c_type == DType::BF16) tol += std::ldexp(1.0, -8) * std::fabs(ref);
        const double e = std::fabs(double(got[at]) - ref);
        err2 += e * e;
        ref2 += ref * ref;
        if (!(e <= tol)) ++bad;
        if (!(e <= worst) || std::isnan(e)) {
          worst = std::isnan(e) ? INFINITY : e;
          worst_at = int64_t(at);
          worst_ref = ref;
          worst_tol = tol;
        }
      }
      // Padding columns of C are never written.
      for (int j = c_.n; j < ldc_; ++j) {
        const size_t at = size_t(i) * ldc_ + j;
        const float expect = c_.beta != 0.f ? c0_[at] : kPoison;
        if (c_.c_type == DType::F32) {
          ASSERT_EQ(got[at], expect) << describe(c_) << ": padding column " << j << " was written";
        }
      }
    }
    EXPECT_EQ(bad, 0) << describe(c_) << ": " << bad << " elements off; worst at row "
                      << worst_at / ldc_ << " col " << worst_at % ldc_ << ": got "
                      << (worst_at >= 0 ? got[size_t(worst_at)] : 0.f) << " want " << worst_ref
                      << " (tolerance " << worst_tol << ")";
    const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
    const double rel_bound = c_.math == Math::TF32 ? std::ldexp(1.0, -9)
                             : c_.c_type == DType::BF16 ? std::ldexp(1.0, -8)
                                                        : std::ldexp(1.0, -14);
    EXPECT_LE(rel, rel_bound) << describe(c_) << ": relative L2 error";
  }

 private:
  template <typename C>
  void launch(const void* a, const void* b, C* cbuf, const float* bias, const void* mask,
              const std::optional<MatmulPlan>& plan) const {
    const MatmulProblem p = problem(a, b, cbuf, bias, mask);
    if (graph_kernels_ != nullptr) {  // gpu_graphed
      cudaStream_t stream = nullptr;
      CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      CUDP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      plan ? matmul_with_plan(p, *plan, stream) : matmul(p, stream);
      cudaGraph_t graph = nullptr;
      CUDP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      size_t count = 0;
      CUDP_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
      std::vector<cudaGraphNode_t> nodes(count);
      CUDP_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
      *graph_kernels_ = 0;
      for (cudaGraphNode_t node : nodes) {
        cudaGraphNodeType type{};
        CUDP_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
        *graph_kernels_ += type == cudaGraphNodeTypeKernel ? 1 : 0;
      }
      cudaGraphExec_t exec = nullptr;
      CUDP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      CUDP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDP_CUDA_CHECK(cudaGraphExecDestroy(exec));
      CUDP_CUDA_CHECK(cudaGraphDestroy(graph));
      CUDP_CUDA_CHECK(cudaStreamDestroy(stream));
      return;
    }
    if (plan) {
      matmul_with_plan(p, *plan, nullptr);
    } else {
      matmul(p, nullptr);
    }
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
  }

 public:
  // As gpu(plan), through a CUDA graph captured on a stream of its own and launched once;
  // *kernels is the number of kernel launches in it.
  std::vector<float> gpu_graphed(const MatmulPlan& plan, int* kernels) const {
    graph_kernels_ = kernels;
    std::vector<float> out = gpu(plan);
    graph_kernels_ = nullptr;
    return out;
  }

 private:
  mutable int* graph_kernels_ = nullptr;

  Case c_;
  int esize_;
  int64_t lda_, ldb_;
  Operand a_, b_;
  int64_t ldc_;
  std::vector<float> bias_, c0_, mask_;
};


class MatmulGpu : public ::testing::TestWithParam<Math> {};

TEST_P(MatmulGpu, OddShapesMatchTheCpuReference) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  uint64_t seed = 100;
  for (const Case& c : {Case{1, 1, 1}, Case{127, 129, 67}, Case{130, 257, 200}, Case{300, 77, 333},
                        Case{64, 4096, 72}, Case{259, 515, 1031}, Case{5, 3, 2000}}) {
    Case cc = c;
    cc.math = math;
    const Product product(cc, seed += 10);
    product.check(product.gpu(std::nullopt));
  }
}

TEST_P(MatmulGpu, EveryTileWidthAndSplitCount) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = detail::multiprocessor_count(device);
  // C += A * B^T without a bias takes the whole-tile accumulation path; with one, the general.
  for (bool bias : {true, false}) {
    Case c{200, 300, 777};
    c.math = math;
    c.beta = 0.5f;
    c.bias = bias;
    const Product run(c, 7);
    for (int tile_n : {64, 128, 256}) {
      for (int splits : {1, 2, 3, 7, 16}) {
        const MatmulPlan plan =
            make_matmul_plan(run.problem(nullptr, nullptr, nullptr, nullptr), tile_n, splits, sms);
        SCOPED_TRACE(::testing::Message()
                     << "bias " << bias << " tile_n " << tile_n << " splits " << plan.splits);
        run.check(run.gpu(plan));
      }
    }
  }
  Case c{200, 300, 777};
  c.math = math;
  c.beta = 0.5f;
  c.bias = true;
  const Product run(c, 7);
  // A grid smaller than the work: each persistent block walks several tiles.
  MatmulPlan few = make_matmul_plan(run.problem(nullptr, nullptr, nullptr, nullptr), 128, 2, 3);
  SCOPED_TRACE("grid of 3 blocks");
  run.check(run.gpu(few));
}

// Operands stored k x n (B: a Linear layer's W in dx = dy W) and k x m (A too: dy in dW = dy^T x),
// on odd shapes, every tile width and split count and a bf16 output: bf16 through wgmma's
// transposed descriptors, TF32 (B stored k x n only) through B's boxes transposed in shared memory.
// A stored k x m alone is refused, and TF32 refuses it in any case.
TEST_P(MatmulGpu, OperandsStoredKMajorLast) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  const auto refused = [&](bool a_t, bool b_t, Math m, const char* why) {
    Case c{64, 64, 64, m};
    c.a_transposed = a_t;
    c.b_transposed = b_t;
    const Product product(c, 1);
    DeviceBuffer<float> buf(size_t(64) * 64 * 2);
    const MatmulProblem p = product.problem(buf.get(), buf.get(), buf.get(), nullptr);
    try {
      matmul(p, nullptr);
      ADD_FAILURE() << describe(c) << " was accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  if (math == Math::TF32) {
    refused(true, true, math, "needs bf16");
    refused(true, false, math, "needs bf16");
  } else {
    refused(true, false, math, "with B stored k x n (b_transposed) only");
  }
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = detail::multiprocessor_count(device);
  uint64_t seed = 900;
  for (bool a_t : {false, true}) {
    if (a_t && math == Math::TF32) continue;
    for (const Case& base : {Case{1, 1, 1}, Case{127, 129, 67}, Case{130, 257, 200},
                             Case{300, 77, 333}, Case{64, 4096, 72}, Case{259, 515, 1031},
                             Case{5, 3, 2000}, Case{64, 1000, 4096}, Case{1000, 4096, 64}}) {
      Case c = base;
      c.math = math;
      c.a_transposed = a_t;
      c.b_transposed = true;
      c.pad = 1;
      const Product product(c, seed += 10);
      product.check(product.gpu(std::nullopt));
    }
    // dW += dy^T x as a Linear layer runs it (beta 1, fp32 C), and a bf16 output with the epilogue.
    Case acc{1000, 520, 300, math, DType::F32, 1.f, 1.f, false, false, 0};
    acc.a_transposed = a_t;
    acc.b_transposed = true;
    const Product accumulate(acc, seed += 10);
    accumulate.check(accumulate.gpu(std::nullopt));
    Case c{200, 300, 777, math, DType::BF16, 0.5f, 0.f, true, true, 0};
    c.a_transposed = a_t;
    c.b_transposed = true;
    const Product run(c, 17);
    for (int tile_n : {64, 128, 256}) {
      for (int splits : {1, 3, 16}) {
        const MatmulPlan plan =
            make_matmul_plan(run.problem(nullptr, nullptr, nullptr, nullptr), tile_n, splits, sms);
        SCOPED_TRACE(::testing::Message()
                     << "A k x m " << a_t << " tile_n " << tile_n << " splits " << plan.splits);
        run.check(run.gpu(plan));
      }
    }
  }
}

TEST_P(MatmulGpu, Epilogues) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  uint64_t seed = 500;
  for (DType c_type : {DType::F32, DType::BF16}) {
    for (float beta : {0.f, 1.f, -0.75f}) {
      for (bool relu : {false, true}) {
        Case c{131, 190, 150, math, c_type, 0.5f, beta, true, relu, 1};
        const Product product(c, seed += 10);
        product.check(product.gpu(std::nullopt));
      }
    }
  }
}

// The ReLU mask of backward-data: fp32 and bf16 C, whole and partial tiles, every tile width and
// split count (the split-K reduction applies it too); masked elements are exact zeros.
TEST_P(MatmulGpu, ReluMask) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  uint64_t seed = 700;
  for (DType c_type : {DType::F32, DType::BF16}) {
    Case c{200, 300, 777, math, c_type};
    c.mask = true;
    const Product run(c, seed += 10);
    int device = 0;
    CUDP_CUDA_CHECK(cudaGetDevice(&device));
    const int sms = detail::multiprocessor_count(device);
    for (int tile_n : {64, 128, 256}) {
      for (int splits : {1, 3}) {
        const MatmulPlan plan =
            make_matmul_plan(run.problem(nullptr, nullptr, nullptr, nullptr), tile_n, splits, sms);
        SCOPED_TRACE(::testing::Message() << "tile_n " << tile_n << " splits " << plan.splits);
        run.check(run.gpu(plan));
      }
    }
  }
}

// A mask goes with beta 0, no bias and no ReLU: anything else is refused with the reason.
TEST_P(MatmulGpu, ReluMaskRefusesAnEpilogue) {
  CUDP_REQUIRE_TENSOR_CORES();
  Case c{64, 64, 64, GetParam()};
  c.mask = true;
  c.beta = 1.f;
  const Product run(c, 3);
  try {
    run.gpu(std::nullopt);
    ADD_FAILURE() << "a mask with beta 1 was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("goes with beta 0, no bias and no ReLU"),
              std::string::npos)
        << e.what();
  }
}

TEST_P(MatmulGpu, VggClassifierShapes) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  // Batch 64: forward of classifier.0/3/6 and their weight gradients (k = batch).
  for (const Case& c : {Case{64, 4096, 25088}, Case{64, 4096, 4096}, Case{64, 1000, 4096},
                        Case{4096, 4096, 64}}) {
    Case cc = c;
    cc.math = math;
    const Product product(cc, 900);
    product.check(product.gpu(std::nullopt));
  }
  // The weight gradient as Linear runs it: accumulated into .grad (beta 1), whole tiles.
  Case acc{4096, 4096, 64};
  acc.math = math;
  acc.beta = 1.f;
  const Product product(acc, 901);
  product.check(product.gpu(std::nullopt));
}

TEST_P(MatmulGpu, Deterministic) {
  CUDP_REQUIRE_TENSOR_CORES();
  Case c{333, 517, 3000};
  c.math = GetParam();
  const Product run(c, 42);
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const MatmulPlan split =
      make_matmul_plan(run.problem(nullptr, nullptr, nullptr, nullptr), 256, 5,
                       detail::multiprocessor_count(device));
  for (const std::optional<MatmulPlan>& plan : {std::optional<MatmulPlan>{}, std::optional{split}}) {
    const std::vector<float> first = run.gpu(plan), second = run.gpu(plan);
    ASSERT_EQ(std::memcmp(first.data(), second.data(), first.size() * 4), 0)
        << "two runs differ (splits " << (plan ? plan->splits : 0) << ")";
  }
}

// Split-K summed in the kernel (the last split of a tile's rows to arrive adds every split's slice
// up and applies the epilogue) gives the reduction kernel's bits: the same sums in the same order,
// the same epilogue. Every tile width, split counts up to kMaxSplitsInKernel, the epilogues (alpha,
// beta, bias, ReLU, a ReLU mask, a bf16 C, a padded C), an odd n (the last column unpaired), a grid
// smaller than the work, and each launch twice (its counters are left zero for the next).
TEST_P(MatmulGpu, SplitKInTheKernelGivesTheReductionKernelsBits) {
  CUDP_REQUIRE_TENSOR_CORES();
  const bool was = detail::splitk_in_kernel_enabled();
  struct Restore {
    bool on;
    ~Restore() { detail::set_splitk_in_kernel(on); }
  } restore{was};
  const Math math = GetParam();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = detail::multiprocessor_count(device);
  std::vector<Case> cases;
  cases.push_back(Case{200, 300, 1500, math});
  cases.push_back(Case{333, 517, 3000, math, DType::F32, 0.5f, -0.75f, true, true, 1});
  cases.push_back(Case{259, 515, 1031, math, DType::BF16, 1.f, 0.f, true, false});
  cases.push_back(Case{130, 257, 900, math, DType::F32, 0.75f, 1.f});
  // Whole tiles (n a multiple of every tile width, an even ldc): the epilogue's fast paths, with a
  // bias and a ReLU, with beta (fp32 C), and a bf16 C.
  cases.push_back(Case{200, 512, 1500, math, DType::F32, 1.f, 0.f, true, true});
  cases.push_back(Case{200, 512, 1500, math, DType::F32, 1.f, 1.f});
  cases.push_back(Case{200, 512, 1500, math, DType::BF16, 1.f, 0.f, true, false});
  for (DType c_type : {DType::F32, DType::BF16}) {
    for (int n : {256, 300}) {  // whole and partial tiles
      Case masked{300, n, 2000, math, c_type};
      masked.mask = true;
      cases.push_back(masked);
    }
  }
  Case b_kn{190, 512, 1200, math};  // B stored k x n (TF32: B's boxes transposed in shared memory)
  b_kn.b_transposed = true;
  cases.push_back(b_kn);
  uint64_t seed = 1200;
  for (const Case& c : cases) {
    const Product run(c, seed += 10);
    const MatmulProblem shape = run.problem(nullptr, nullptr, nullptr, nullptr);
    std::vector<MatmulPlan> plans;
    for (int tile_n : {64, 128, 256}) {
      for (int splits : {2, 3, 7, detail::kMaxSplitsInKernel}) {
        plans.push_back(make_matmul_plan(shape, tile_n, splits, sms));
      }
    }
    plans.push_back(make_matmul_plan(shape, 128, 3, 3));  // each block walks several items
    for (const MatmulPlan& plan : plans) {
      SCOPED_TRACE(::testing::Message() << describe(c) << " tile_n " << plan.tile_n << " splits "
                                        << plan.splits << " grid " << plan.grid);
      detail::set_splitk_in_kernel(false);
      const std::vector<float> want = run.gpu(plan);
      detail::set_splitk_in_kernel(true);
      ASSERT_TRUE(detail::splitk_in_kernel(plan));
      for (int again = 0; again < 2; ++again) {
        const std::vector<float> got = run.gpu(plan);
        ASSERT_EQ(got.size(), want.size());
        ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
            << "the in-kernel sum differs from the reduction kernel's (launch " << again + 1 << ")";
      }
      // In a graph (the counters of a stream being captured, allocated in the capture): one
      // kernel, the product; the reduction kernel's launch is gone.
      int kernels = 0;
      const std::vector<float> graphed = run.gpu_graphed(plan, &kernels);
      EXPECT_EQ(kernels, 1) << "kernel launches in the product's graph";
      ASSERT_EQ(std::memcmp(graphed.data(), want.data(), want.size() * sizeof(float)), 0)
          << "the in-kernel sum in a graph differs from the reduction kernel's";
    }
    run.check(run.gpu(plans.back()));  // and both against the CPU reference once
  }
}

// The split-K reduction four columns a thread (detail::set_splitk_reduce_vectorized) against one
// element a thread: every element's arithmetic is the same, so the same bits, bit for bit (C's
// padding columns included), with every epilogue (bias and ReLU, beta on fp32 C and on bf16 C, a
// mask), C rows wider than n, and 2 to 22 splits (past the kernel's batches of eight loads); the
// shapes it cannot take four at a time (n or ldc not a multiple of 4) fall back to the other
// kernel. Both against the CPU reference once.
TEST_P(MatmulGpu, SplitKReductionFourColumnsAtATimeGivesTheSameBits) {
  CUDP_REQUIRE_TENSOR_CORES();
  const testing::ScopedSwitch<bool> vectorized(detail::splitk_reduce_vectorized,
                                               detail::set_splitk_reduce_vectorized,
                                               detail::splitk_reduce_vectorized());
  // The reduction kernel, in both of its forms.
  const testing::ScopedSwitch<bool> in_kernel(detail::splitk_in_kernel_enabled,
                                              detail::set_splitk_in_kernel, false);
  const Math math = GetParam();
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = detail::multiprocessor_count(device);
  struct Reduction {
    Case c;
    bool four;  // whether the four-column kernel takes it
  };
  std::vector<Reduction> cases;
  cases.push_back({Case{200, 512, 3400, math, DType::F32, 1.f, 0.f, true, true}, true});
  cases.push_back({Case{200, 512, 3400, math, DType::F32, 0.5f, 1.f}, true});
  cases.push_back({Case{130, 300, 3400, math, DType::BF16, 1.f, 0.f, true, false}, true});
  cases.push_back({Case{130, 300, 3400, math, DType::BF16, 0.75f, -0.5f}, true});
  for (DType c_type : {DType::F32, DType::BF16}) {
    Case masked{300, 256, 2000, math, c_type};
    masked.mask = true;
    cases.push_back({masked, true});
  }
  Case wide_rows{200, 512, 1500, math, DType::F32, 1.f, 1.f};  // ldc = n + 4: rows apart
  wide_rows.pad = 4;
  cases.push_back({wide_rows, true});
  Case wide_masked{260, 256, 2000, math, DType::BF16};
  wide_masked.pad = 4;
  wide_masked.mask = true;
  cases.push_back({wide_masked, true});
  cases.push_back({Case{259, 515, 1031, math, DType::BF16, 1.f, 0.f, true, false}, false});
  Case odd_ldc{200, 512, 1500, math, DType::F32, 1.f, 1.f};  // ldc = n + 2
  odd_ldc.pad = 2;
  cases.push_back({odd_ldc, false});
  uint64_t seed = 1700;
  for (const Reduction& r : cases) {
    const Case& c = r.c;
    const Product run(c, seed += 10);
    const MatmulProblem shape = run.problem(nullptr, nullptr, nullptr, nullptr);
    SCOPED_TRACE(describe(c));
    // Device buffers are 256-byte aligned, so the shape decides (C's pointer is null here).
    ASSERT_EQ(detail::splitk_reduce4_applies(shape), r.four);
    std::vector<MatmulPlan> plans;
    for (int splits : {2, 7, 9, 26}) plans.push_back(make_matmul_plan(shape, 128, splits, sms));
    for (const MatmulPlan& plan : plans) {
      SCOPED_TRACE(::testing::Message() << "splits " << plan.splits);
      ASSERT_GT(plan.splits, 1);
      detail::set_splitk_reduce_vectorized(false);
      const std::vector<float> want = run.gpu(plan);
      detail::set_splitk_reduce_vectorized(true);
      const std::vector<float> got = run.gpu(plan);
      ASSERT_EQ(got.size(), want.size());
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
          << "four columns a thread differ from one element a thread";
    }
    run.check(run.gpu(plans.back()));
  }
}

// gemm() in every transpose combination with tensor-core math, packed or direct operands,
// misaligned pointers and padded leading dimensions: the BLAS contract on top of matmul().
TEST_P(MatmulGpu, GemmAllTransposes) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  uint64_t seed = 1000;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // Row pads of A and B and a 4-byte offset. A TF32 operand of 16-byte rows (a row length
      // that is a multiple of 4, no offset) is read in place, the others are packed: A when
      // !trans_a, B either way (trans_b: K-major; !trans_b: stored k x n, through
      // MatmulProblem::b_transposed). With k = 301 and n = 70: pads 3/3 read A (!ta) and B (tb) in
      // place, 2/2 B (!tb) alone, 3/2 both A (!ta) and B (!tb); the offset packs both.
      struct Layout {
        int offset, pad_a, pad_b;
      };
      for (const auto& [offset, pad_a, pad_b] :
           {Layout{0, 3, 3}, Layout{1, 3, 3}, Layout{0, 2, 2}, Layout{0, 3, 2}}) {
        const int m = 133, n = 70, k = 301;
        const int lda = (ta ? m : k) + pad_a, ldb = (tb ? k : n) + pad_b, ldc = n + pad_b;
        std::vector<float> a = testing::random_vector(offset + size_t(ta ? k : m) * lda, seed++);
        std::vector<float> b = testing::random_vector(offset + size_t(tb ? n : k) * ldb, seed++);
        std::vector<float> c0 = testing::random_vector(offset + size_t(m) * ldc, seed++);
        if (math == Math::BF16) {  // the reference multiplies what the kernel multiplies
          for (float& v : a) v = bf16_value(detail::f32_to_bf16_bits(v));
          for (float& v : b) v = bf16_value(detail::f32_to_bf16_bits(v));
        }
        const float alpha = 1.5f, beta = 0.25f;
        std::vector<float> want = c0;
        gemm_cpu(ta, tb, m, n, k, alpha, a.data() + offset, lda, b.data() + offset, ldb, beta,
                 want.data() + offset, ldc);
        DeviceBuffer<float> da(a), db(b), dc(c0);
        gemm(ta, tb, m, n, k, alpha, da.get() + offset, lda, db.get() + offset, ldb, beta,
             dc.get() + offset, ldc, nullptr, math);
        const std::vector<float> got = dc.download();
        // Products of |a|,|b| < 1: Σ|p| <= k, sqrt(Σp²) <= sqrt(k); the bounds of the file comment.
        const double tol = alpha * (std::ldexp(64.0, -24) * k +
                                    (math == Math::TF32 ? std::ldexp(1.0, -9) * k +
                                                              6 * std::ldexp(1.0, -10) * std::sqrt(k)
                                                        : 0.0)) +
                           1e-6;
        SCOPED_TRACE(::testing::Message() << "trans_a " << ta << " trans_b " << tb << " offset "
                                          << offset << " pads " << pad_a << " " << pad_b);
        EXPECT_ALL_CLOSE(got, want, 0.0, tol);
      }
    }
  }
}

TEST_P(MatmulGpu, ZeroKAndZeroAlphaApplyOnlyTheEpilogue) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  const int m = 20, n = 30, k = 40;
  std::vector<float> a(size_t(m) * k, std::nanf("")), b(size_t(k) * n, std::nanf(""));
  std::vector<float> c0 = testing::random_vector(size_t(m) * n, 5);
  DeviceBuffer<float> da(a), db(b), dc(c0);
  gemm(false, false, m, n, k, 0.f, da.get(), k, db.get(), n, 2.f, dc.get(), n, nullptr, math);
  std::vector<float> want = c0;
  for (float& v : want) v *= 2.f;
  EXPECT_ALL_CLOSE(dc.download(), want, 0.0, 0.0);
}

TEST_P(MatmulGpu, RefusesWhatTheLoadsCannotTake) {
  CUDP_REQUIRE_TENSOR_CORES();
  const Math math = GetParam();
  DeviceBuffer<float> buf(4096);
  MatmulProblem p;
  p.m = 8;
  p.n = 8;
  p.k = 8;
  p.math = math;
  p.a = buf.get() + 1;  // 4-byte aligned only
  p.b = buf.get();
  p.c = buf.get() + 1024;
  p.lda = p.ldb = 16;
  p.ldc = 8;
  try {
    matmul(p, nullptr);
    FAIL() << "an unaligned A was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.message()).find("16-byte aligned"), std::string::npos) << e.message();
  }
  p.a = buf.get();
  p.lda = 9;
  p.k = 9;
  try {
    matmul(p, nullptr);
    FAIL() << "a row stride of 9 elements was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.message()).find("multiples of"), std::string::npos) << e.message();
  }
}

INSTANTIATE_TEST_SUITE_P(Math, MatmulGpu, ::testing::Values(Math::BF16, Math::TF32),
                         [](const auto& info) { return std::string(math_name(info.param)); });

}  // namespace
}  // namespace cudp::kernels
