// bench_gemm: our fp32 GEMM (kernels/gemm.h) against cuBLAS SGEMM with TF32 off, at 4096^3 and at
// the products of VGG-16's classifier at batch 64 (README-gemm.md).
//
// For every shape: validate ours against cuBLAS on the first input set (the GPU tests' error model;
// a failure marks the row INVALID and the exit status 1), then time both with time_on_stream
// (warm-up, median), rotating over copies of the operands so that L2 does not serve them. TFLOP/s
// counts 2·m·n·k per product. The roofline is the fp32 FMA peak: SMs x clock x 128 FMA per SM and
// cycle x 2.
// --json PATH writes the rows as JSON.
//
// --math tf32|bf16 times the tensor-core matmul (kernels/matmul.h) instead: both operands K-major
// (C = A B^T, the layout the tensor cores read) in the math's type (bf16, or fp32 for TF32), against
// cublasGemmEx with the same operand types, fp32 accumulation and fp32 C (CUBLAS_COMPUTE_32F, or
// CUBLAS_COMPUTE_32F_FAST_TF32). Shapes: 4096^3, 8192^3 and every product of the VGG-16 classifier
// at batch 64 as an (m, n, k) of that form. Validation: ours against cuBLAS with the bound of the
// precision (tests/kernels/matmul_gpu_test.cpp derives it), relative L2 error printed. The roofline is
// the datasheet's dense tensor-core rate (H100/H200 SXM: 989 bf16, 495 TF32 TFLOP/s).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/cli.h"
#include "common/device_buffer.h"
#include "common/timing.h"
#include "engine/core/error.h"
#include "engine/core/vendor_check.h"
#include "kernels/gemm.h"
#include "kernels/init.h"
#include "kernels/layout.h"
#include "kernels/matmul.h"

namespace {

using namespace cudp;
using namespace cudp::kernels;
using bench::DeviceBuffer;

// One product C = op(A) op(B) + beta C, row-major with tight leading dimensions.
struct Shape {
  std::string op;  // what it is ("gemm", "fc1 forward", ...)
  bool ta, tb;
  int m, n, k;
  float beta;

  int lda() const { return ta ? m : k; }
  int ldb() const { return tb ? k : n; }
  size_t a_size() const { return size_t(m) * k; }
  size_t b_size() const { return size_t(k) * n; }
  size_t c_size() const { return size_t(m) * n; }
  double flops() const { return 2.0 * m * n * k; }
  std::string text() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + " " +
           (ta ? "T" : "N") + (tb ? "T" : "N") + (beta != 0.f ? " beta=1" : "");
  }
};

std::vector<Shape> shapes(const std::string& set) {
  std::vector<Shape> s = {{"gemm", false, false, 4096, 4096, 4096, 0.f}};
  if (set == "all") {
    s.push_back({"gemm", false, true, 4096, 4096, 4096, 0.f});
    s.push_back({"gemm", true, false, 4096, 4096, 4096, 0.f});
    s.push_back({"gemm", true, true, 4096, 4096, 4096, 0.f});
    s.push_back({"gemm", false, false, 8192, 8192, 8192, 0.f});
  }
  // Linear(in, out) at batch 64: Y = X W^T, dX = dY W, dW += dY^T X (gradients accumulate: beta 1).
  for (const auto& [name, in, out] : {std::tuple{"fc1", 25088, 4096}, std::tuple{"fc2", 4096, 4096},
                                      std::tuple{"fc3", 4096, 1000}}) {
    const std::string layer = name;
    s.push_back({layer + " forward", false, true, 64, out, in, 0.f});
    s.push_back({layer + " backward-data", false, false, 64, in, out, 0.f});
    s.push_back({layer + " backward-weight", true, false, out, in, 64, 1.f});
  }
  return s;
}

// cuBLAS SGEMM, fp32 arithmetic (CUBLAS_DEFAULT_MATH: no TF32), row-major through swapped operands:
// row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
class Cublas {
 public:
  explicit Cublas(cudaStream_t stream) {
    CUDP_CUBLAS_CHECK(cublasCreate(&handle_));
    CUDP_CUBLAS_CHECK(cublasSetStream(handle_, stream));
    CUDP_CUBLAS_CHECK(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH));
  }
  ~Cublas() { cublasDestroy(handle_); }
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;

  void gemm(const Shape& s, const float* a, const float* b, float* c) {
    const float alpha = 1.f;
    CUDP_CUBLAS_CHECK(cublasSgemm(handle_, s.tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  s.ta ? CUBLAS_OP_T : CUBLAS_OP_N, s.n, s.m, s.k, &alpha, b,
                                  s.ldb(), a, s.lda(), &s.beta, c, s.n));
  }

 private:
  cublasHandle_t handle_ = nullptr;
};

void ours(const Shape& s, const float* a, const float* b, float* c, cudaStream_t stream) {
  gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a, s.lda(), b, s.ldb(), s.beta, c, s.n, stream);
}

// Ours against cuBLAS, both with fp32 accumulation of k products of inputs in [-1, 1): each is off
// the exact result by a random walk of ~2^-24·k/7, so 4·2^-24·(k + |beta|) (about 14 of those, for
// the two) plus rtol 2e-5 passes any correct kernel and no wrong product (tests/kernels/
// gemm_gpu_test.cpp has the reasoning). Prints the worst element either way.
bool validate(const Shape& s, const std::vector<float>& got, const std::vector<float>& want) {
  const double atol = 4.0 * std::ldexp(1.0, -24) * (s.k + std::fabs(s.beta)), rtol = 2e-5;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double excess =
        std::fabs(double(got[i]) - want[i]) / (atol + rtol * std::fabs(double(want[i])));
    if (!(excess <= worst)) {  // NaN counts as worst
      worst = excess;
      at = i;
    }
  }
  const bool ok = worst <= 1.0;
  std::printf("  validate %-28s %-22s %s (worst %.3g of tolerance at %zu: %.8g vs %.8g)\n",
              s.op.c_str(), s.text().c_str(), ok ? "ok  " : "FAIL", worst, at, got[at], want[at]);
  return ok;
}

struct Result {
  Shape shape;
  kernels::detail::GemmPlan plan;
  double ours_ms = 0, cublas_ms = 0;
  bool valid = true;

  double ours_tflops() const { return shape.flops() / (ours_ms * 1e-3) / 1e12; }
  double cublas_tflops() const { return shape.flops() / (cublas_ms * 1e-3) / 1e12; }
};

Result run(const Shape& s, int reps, int sm_count, Cublas& cublas, cudaStream_t stream) {
  const size_t bytes = (s.a_size() + s.b_size() + s.c_size()) * sizeof(float);
  const int copies = cudp::bench::rotation_copies(bytes);
  std::vector<std::unique_ptr<DeviceBuffer<float>>> a, b, c;
  for (int i = 0; i < copies; ++i) {
    a.push_back(std::make_unique<DeviceBuffer<float>>(s.a_size()));
    b.push_back(std::make_unique<DeviceBuffer<float>>(s.b_size()));
    c.push_back(std::make_unique<DeviceBuffer<float>>(s.c_size()));
    uniform(a[i]->p, int64_t(s.a_size()), -1.f, 1.f, 10 + i, 0, stream);
    uniform(b[i]->p, int64_t(s.b_size()), -1.f, 1.f, 20 + i, 0, stream);
    uniform(c[i]->p, int64_t(s.c_size()), -1.f, 1.f, 30 + i, 0, stream);
  }

  Result r{s, kernels::detail::plan_gemm(s.m, s.n, s.k, sm_count)};
  {
    DeviceBuffer<float> reference(s.c_size());
    CUDP_CUDA_CHECK(cudaMemcpyAsync(reference.p, c[0]->p, s.c_size() * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream));
    ours(s, a[0]->p, b[0]->p, c[0]->p, stream);
    cublas.gemm(s, a[0]->p, b[0]->p, reference.p);
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    r.valid = validate(s, c[0]->download(), reference.download());
  }
  // C accumulates over the repetitions when beta = 1; with inputs in [-1, 1) it stays far from
  // overflow, and the time of an FMA does not depend on the values.
  const auto run_ours = [&](int i) {
    const int j = i % copies;
    ours(s, a[j]->p, b[j]->p, c[j]->p, stream);
  };
  const auto run_cublas = [&](int i) {
    const int j = i % copies;
    cublas.gemm(s, a[j]->p, b[j]->p, c[j]->p);
  };
  r.ours_ms = cudp::bench::time_on_stream(stream, run_ours, 5, reps).median_ms;
  r.cublas_ms = cudp::bench::time_on_stream(stream, run_cublas, 5, reps).median_ms;
  return r;
}

struct DeviceInfo {
  std::string name;
  int sm_count = 0;
  double clock_ghz = 0;
  double peak_tflops = 0;  // fp32 FMA: SMs x clock x 128 FMA/cycle x 2 flop
};

DeviceInfo device_info() {
  int device = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int clock_khz = 0;
  DeviceInfo d;
  d.name = prop.name;
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  d.clock_ghz = clock_khz * 1e-6;
  d.peak_tflops = d.sm_count * (clock_khz * 1e3) * 128 * 2 / 1e12;
  return d;
}

void write_json(const std::string& path, const DeviceInfo& d, const std::vector<Result>& results) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) CUDP_THROW(IoError, "cannot write ", path);
  std::fprintf(f,
               "{\n  \"benchmark\": \"gemm\",\n  \"device\": \"%s\",\n  \"sm_count\": %d,\n"
               "  \"clock_ghz\": %.3f,\n  \"fp32_peak_tflops\": %.3f,\n  \"results\": [\n",
               d.name.c_str(), d.sm_count, d.clock_ghz, d.peak_tflops);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const Shape& s = r.shape;
    std::fprintf(f,
                 "    {\"op\": \"%s\", \"shape\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, "
                 "\"trans_a\": %s, \"trans_b\": %s, \"beta\": %g, \"tile_m\": %d, \"splits\": %d, "
                 "\"ours_ms\": %.6f, \"cublas_ms\": %.6f, \"ours_tflops\": %.3f, "
                 "\"cublas_tflops\": %.3f, \"ours_over_cublas\": %.4f, \"ours_of_peak\": %.4f, "
                 "\"cublas_of_peak\": %.4f, \"valid\": %s}%s\n",
                 s.op.c_str(), s.text().c_str(), s.m, s.n, s.k, s.ta ? "true" : "false",
                 s.tb ? "true" : "false", s.beta, r.plan.tile_m, r.plan.splits, r.ours_ms,
                 r.cublas_ms, r.ours_tflops(), r.cublas_tflops(), r.cublas_ms / r.ours_ms,
                 r.ours_tflops() / d.peak_tflops, r.cublas_tflops() / d.peak_tflops,
                 r.valid ? "true" : "false", i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}


// ---- tensor-core products (--math tf32|bf16) ------------------------------------------------------

struct TcShape {
  std::string op;
  int m, n, k;
  double flops() const { return 2.0 * m * n * k; }
  std::string text() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
  }
};

std::vector<TcShape> tc_shapes() {
  std::vector<TcShape> s = {{"gemm", 4096, 4096, 4096}, {"gemm", 8192, 8192, 8192}};
  for (const auto& [name, in, out] : {std::tuple{"fc1", 25088, 4096}, std::tuple{"fc2", 4096, 4096},
                                      std::tuple{"fc3", 4096, 1000}}) {
    const std::string layer = name;
    s.push_back({layer + " forward", 64, out, in});
    s.push_back({layer + " backward-data", 64, in, out});
    s.push_back({layer + " backward-weight", out, in, 64});
  }
  return s;
}

struct TcResult {
  TcShape shape;
  MatmulPlan plan;
  double ours_ms = 0, cublas_ms = 0, rel_l2 = 0;
  bool valid = true;
  double ours_tflops() const { return shape.flops() / (ours_ms * 1e-3) / 1e12; }
  double cublas_tflops() const { return shape.flops() / (cublas_ms * 1e-3) / 1e12; }
};

TcResult run_tc(const TcShape& s, Math math, int reps, cublasHandle_t handle, cudaStream_t stream) {
  const bool bf16 = math == Math::BF16;
  const size_t esize = bf16 ? 2 : 4;
  const size_t a_n = size_t(s.m) * s.k, b_n = size_t(s.n) * s.k, c_n = size_t(s.m) * s.n;
  const int copies = cudp::bench::rotation_copies((a_n + b_n) * esize + c_n * 4);
  std::vector<std::unique_ptr<DeviceBuffer<float>>> a32, b32, c;
  std::vector<std::unique_ptr<DeviceBuffer<__nv_bfloat16>>> a16, b16;
  for (int i = 0; i < copies; ++i) {
    a32.push_back(std::make_unique<DeviceBuffer<float>>(a_n));
    b32.push_back(std::make_unique<DeviceBuffer<float>>(b_n));
    c.push_back(std::make_unique<DeviceBuffer<float>>(c_n));
    uniform(a32[i]->p, int64_t(a_n), -1.f, 1.f, 10 + i, 0, stream);
    uniform(b32[i]->p, int64_t(b_n), -1.f, 1.f, 20 + i, 0, stream);
    if (bf16) {
      a16.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(a_n));
      b16.push_back(std::make_unique<DeviceBuffer<__nv_bfloat16>>(b_n));
      f32_to_bf16(a32[i]->p, a16[i]->p, int64_t(a_n), stream);
      f32_to_bf16(b32[i]->p, b16[i]->p, int64_t(b_n), stream);
    }
  }
  const auto a = [&](int j) -> const void* { return bf16 ? (const void*)a16[j]->p : a32[j]->p; };
  const auto b = [&](int j) -> const void* { return bf16 ? (const void*)b16[j]->p : b32[j]->p; };
  const auto problem = [&](int j) {
    MatmulProblem p;
    p.m = s.m;
    p.n = s.n;
    p.k = s.k;
    p.math = math;
    p.a = a(j);
    p.lda = s.k;
    p.b = b(j);
    p.ldb = s.k;
    p.c = c[j]->p;
    p.ldc = s.n;
    return p;
  };
  // cuBLAS, column-major: row-major C (m x n) is column-major C^T = B A^T with B (n x k row-major =
  // k x n column-major, op T) and A likewise.
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t compute = bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_FAST_TF32;
  const auto vendor = [&](int j, float* out) {
    const float alpha = 1.f, beta = 0.f;
    CUDP_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.n, s.m, s.k, &alpha, b(j),
                                   type, s.k, a(j), type, s.k, &beta, out, CUDA_R_32F, s.n, compute,
                                   CUBLAS_GEMM_DEFAULT));
  };
  TcResult r{s, plan_matmul(problem(0))};
  {
    DeviceBuffer<float> reference(c_n);
    matmul(problem(0), stream);
    vendor(0, reference.p);
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> got = c[0]->download(), want = reference.download();
    double err2 = 0, ref2 = 0;
    for (size_t i = 0; i < c_n; ++i) {
      const double e = double(got[i]) - want[i];
      err2 += e * e;
      ref2 += double(want[i]) * want[i];
    }
    r.rel_l2 = std::sqrt(err2 / std::max(ref2, 1e-300));
    // Both sides err by at most the precision's bound of matmul_gpu_test.cpp (2^-9 relative in
    // TF32; fp32 accumulation in bf16): twice that bounds their difference. NaN fails.
    const double bound = bf16 ? std::ldexp(2.0, -14) : std::ldexp(2.0, -9);
    r.valid = r.rel_l2 <= bound;
    std::printf("  validate %-24s %-16s %s (relative L2 vs cuBLAS %.3g, bound %.3g)\n",
                s.op.c_str(), s.text().c_str(), r.valid ? "ok  " : "FAIL", r.rel_l2, bound);
  }
  const auto run_ours = [&](int i) { matmul(problem(i % copies), stream); };
  const auto run_cublas = [&](int i) { vendor(i % copies, c[i % copies]->p); };
  r.ours_ms = cudp::bench::time_on_stream(stream, run_ours, 5, reps).median_ms;
  r.cublas_ms = cudp::bench::time_on_stream(stream, run_cublas, 5, reps).median_ms;
  return r;
}

int run_tensor_cores(Math math, int reps, const std::string& json, cudaStream_t stream) {
  const DeviceInfo d = device_info();
  const double peak = math == Math::BF16 ? 989.0 : 494.7;
  std::printf("%s: %d SMs; %s tensor-core peak %.0f TFLOP/s (datasheet, dense)\n", d.name.c_str(),
              d.sm_count, math_name(math), peak);
  cublasHandle_t handle = nullptr;
  CUDP_CUBLAS_CHECK(cublasCreate(&handle));
  CUDP_CUBLAS_CHECK(cublasSetStream(handle, stream));
  std::vector<TcResult> results;
  for (const TcShape& s : tc_shapes()) results.push_back(run_tc(s, math, reps, handle, stream));
  cublasDestroy(handle);
  std::vector<cudp::bench::Row> rows;
  bool all_valid = true;
  for (const TcResult& r : results) {
    rows.push_back({r.shape.op + (r.valid ? "" : " (INVALID)"), r.shape.text(), r.ours_tflops(),
                    r.cublas_tflops(), "TFLOP/s", "cuBLAS"});
    all_valid &= r.valid;
  }
  std::printf("\n");
  cudp::bench::print_table(rows);
  std::printf("\n| op | shape | plan | ours ms | cuBLAS ms | ours of peak | cuBLAS of peak |\n"
              "|---|---|---|---:|---:|---:|---:|\n");
  for (const TcResult& r : results) {
    std::printf("| %s | %s | 128x%d, split %d | %.4f | %.4f | %.0f%% | %.0f%% |\n",
                r.shape.op.c_str(), r.shape.text().c_str(), r.plan.tile_n, r.plan.splits,
                r.ours_ms, r.cublas_ms, 100 * r.ours_tflops() / peak,
                100 * r.cublas_tflops() / peak);
  }
  if (!json.empty()) {
    std::FILE* f = std::fopen(json.c_str(), "w");
    if (!f) CUDP_THROW(IoError, "cannot write ", json);
    std::fprintf(f, "{\n  \"benchmark\": \"gemm\",\n  \"math\": \"%s\",\n  \"device\": \"%s\",\n"
                 "  \"sm_count\": %d,\n  \"peak_tflops\": %.1f,\n  \"results\": [\n",
                 math_name(math), d.name.c_str(), d.sm_count, peak);
    for (size_t i = 0; i < results.size(); ++i) {
      const TcResult& r = results[i];
      std::fprintf(f,
                   "    {\"op\": \"%s\", \"shape\": \"%s\", \"math\": \"%s\", \"m\": %d, \"n\": %d, "
                   "\"k\": %d, \"tile_n\": %d, \"splits\": %d, \"ours_ms\": %.6f, \"cublas_ms\": "
                   "%.6f, \"ours_tflops\": %.3f, \"cublas_tflops\": %.3f, \"ours_over_cublas\": "
                   "%.4f, \"rel_l2_vs_cublas\": %.3g, \"valid\": %s}%s\n",
                   r.shape.op.c_str(), r.shape.text().c_str(), math_name(math), r.shape.m,
                   r.shape.n, r.shape.k, r.plan.tile_n, r.plan.splits, r.ours_ms, r.cublas_ms,
                   r.ours_tflops(), r.cublas_tflops(), r.cublas_ms / r.ours_ms, r.rel_l2,
                   r.valid ? "true" : "false", i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return all_valid ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_gemm: fp32 GEMM, ours vs cuBLAS SGEMM (TF32 off)"};
  std::string set = "standard", json;
  int reps = 30;
  app.add_option("--shapes", set,
                 "standard: 4096^3 and the VGG-16 classifier at batch 64; "
                 "all: also 4096^3 transposed and 8192^3")
      ->check(CLI::IsMember({"standard", "all"}));
  app.add_option("--json", json, "write the results to this JSON file");
  std::string math_text = "fp32";
  app.add_option("--math", math_text,
                 "fp32: the SIMT kernel vs SGEMM; tf32 / bf16: the tensor-core matmul vs cublasGemmEx")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}));
  app.add_option("--reps", reps, "timed repetitions per measurement (median reported)")
      ->check(CLI::Range(1, 10000));
  if (const auto status = cudp::bench::parse_command_line(app, "bench_gemm", argc, argv)) {
    return *status;
  }
  if (!cudp::bench::usable_cuda_device("bench_gemm")) return cudp::bench::kExitUsage;
  cudaStream_t stream = nullptr;
  try {
    CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Split-K takes its workspace from the stream-ordered allocator; keep freed memory in the pool,
    // as the engine does (docs/architecture.md §2.4), so that the timing sees reuse, not driver allocations.
    int device = 0;
    CUDP_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    CUDP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t threshold = UINT64_MAX;
    CUDP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));

    if (math_text != "fp32") {
      return run_tensor_cores(math_text == "bf16" ? Math::BF16 : Math::TF32, reps, json, stream);
    }
    const DeviceInfo d = device_info();
    std::printf("%s: %d SMs at %.2f GHz; fp32 FMA peak %.1f TFLOP/s (SMs x clock x 128 FMA x 2)\n",
                d.name.c_str(), d.sm_count, d.clock_ghz, d.peak_tflops);
    Cublas cublas(stream);
    std::vector<Result> results;
    for (const Shape& s : shapes(set)) results.push_back(run(s, reps, d.sm_count, cublas, stream));

    std::vector<cudp::bench::Row> rows;
    bool all_valid = true;
    for (const Result& r : results) {
      rows.push_back({r.shape.op + (r.valid ? "" : " (INVALID)"), r.shape.text(), r.ours_tflops(),
                      r.cublas_tflops(), "TFLOP/s", "cuBLAS"});
      all_valid &= r.valid;
    }
    std::printf("\n");
    cudp::bench::print_table(rows);
    std::printf(
        "\n| op | shape | plan | ours ms | cuBLAS ms | ours of peak | cuBLAS of peak |\n"
        "|---|---|---|---:|---:|---:|---:|\n");
    for (const Result& r : results) {
      std::printf("| %s | %s | %dx128, split %d | %.3f | %.3f | %.0f%% | %.0f%% |\n",
                  r.shape.op.c_str(), r.shape.text().c_str(), r.plan.tile_m, r.plan.splits,
                  r.ours_ms, r.cublas_ms, 100 * r.ours_tflops() / d.peak_tflops,
                  100 * r.cublas_tflops() / d.peak_tflops);
    }
    if (!json.empty()) write_json(json, d, results);
    return all_valid ? 0 : 1;  // the stream goes with the process
  } catch (const std::exception& e) {
    cudp::bench::print_error("bench_gemm", e);
    return cudp::bench::kExitUsage;
  }
}
