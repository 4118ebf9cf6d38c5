// bench_conv2d: our implicit-GEMM convolution (kernels/conv2d.h) against cuDNN, fp32 without TF32,
// NHWC/KRSC, on VGG-16's convolution shapes at 224² batch 64 and 32² batch 256, for the forward,
// backward-data and backward-weight passes.
//
// --math bf16|tf32: our tensor-core convolutions (conv2d_forward_tc, conv2d_backward_data_tc,
// and for backward-weight conv2d_backward_weight_tc (bf16) or conv2d_backward_weight with
// Math::TF32 (fp32 x, dy and dw)) on operands of the math's type (bf16 tensors with a bf16 output;
// fp32 tensors for TF32) against cuDNN on the same types with CUDNN_TENSOR_OP_MATH (TF32 allowed on
// fp32 tensors), its fastest algorithm from cudnnFind*Ex. The first layer's 3 input channels are
// padded to 8 (bf16) or 4 (fp32) for ours, as a layer does; cuDNN reads 3. Ours writes dw in fp32
// under either math; cuDNN writes it in the tensors' type (bf16, or fp32 for TF32). Validation:
// relative L2 distance to cuDNN within 2^-7 (bf16 output: both round to bf16) or 2^-8 (TF32).
//
// For every (layer, pass): cuDNN times all its algorithms (cudnnFind*AlgorithmEx, math
// CUDNN_FMA_MATH, 1 GiB of workspace) and its fastest is the bar. First we validate: ours against a
// cuDNN GEMM-like algorithm (same dot products) with the GPU tests' tolerance, and ours against the
// fastest algorithm (Winograd or FFT round differently) normwise, which shows that the timed call
// computes the same convolution. Then both are timed with time_on_stream (warm-up, median),
// rotating over copies of the inputs so that L2 does not serve them. TFLOP/s counts 2*N*P*Q*K*R*S*C
// per pass. The roofline is min(fp32 FMA peak, arithmetic intensity x measured copy bandwidth),
// with the least bytes a pass must move (its two inputs and its output, once). README-conv2d.md has
// more.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/device_buffer.h"
#include "common/timing.h"
#include "engine/core/error.h"
#include "engine/core/vendor_check.h"
#include "kernels/conv2d.h"
#include "kernels/init.h"
#include "kernels/layout.h"
#include "tests/common/cudnn_conv2d.h"

namespace {

using namespace cudp;
using namespace cudp::kernels;
using bench::DeviceBuffer;

enum class Pass { Forward, BackwardData, BackwardWeight };
constexpr Pass kPasses[] = {Pass::Forward, Pass::BackwardData, Pass::BackwardWeight};

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::Forward:
      return "fwd";
    case Pass::BackwardData:
      return "dgrad";
    case Pass::BackwardWeight:
      return "wgrad";
  }
  return "?";
}

// VGG-16's distinct convolutions: 3x3, stride 1, pad 1; spatial size at 224² and at 32² input.
struct Layer {
  int c, k, at224, at32;
};
constexpr Layer kVgg[] = {{3, 64, 224, 32},    {64, 64, 224, 32}, {64, 128, 112, 16},
                          {128, 128, 112, 16}, {128, 256, 56, 8}, {256, 256, 56, 8},
                          {256, 512, 28, 4},   {512, 512, 28, 4}, {512, 512, 14, 2}};

// The operands of a pass: it reads two tensors and writes one.
struct Operands {
  int64_t in0, in1, out;  // element counts
  int64_t reduction;      // length of each output's dot product
};

Operands operands(const Conv2dShape& s, Pass pass) {
  switch (pass) {
    case Pass::Forward:
      return {s.x_size(), s.w_size(), s.y_size(), int64_t(s.r) * s.s * s.c};
    case Pass::BackwardData:
      return {s.y_size(), s.w_size(), s.x_size(), int64_t(s.r) * s.s * s.k};
    case Pass::BackwardWeight:
      return {s.x_size(), s.y_size(), s.w_size(), int64_t(s.n) * s.p() * s.q()};
  }
  return {};
}

void run_ours(const Conv2dShape& s, Pass pass, const float* in0, const float* in1, float* out,
              cudaStream_t stream) {
  switch (pass) {
    case Pass::Forward:
      return conv2d_forward(s, in0, in1, nullptr, out, false, stream);
    case Pass::BackwardData:
      return conv2d_backward_data(s, in0, in1, out, stream);
    case Pass::BackwardWeight:
      return conv2d_backward_weight(s, in0, in1, out, 0.0f, stream);
  }
}

struct Algo {
  int id = -1;
  size_t workspace = 0;
};

// cuDNN on one shape, on our layouts (tests/common/cudnn_conv2d.h): finds and runs its algorithms.
class CudnnConv {
 public:
  CudnnConv(cudnnHandle_t handle, const Conv2dShape& s, cudnnDataType_t data = CUDNN_DATA_FLOAT,
            cudnnMathType_t math = CUDNN_FMA_MATH)
      : handle_(handle), d_(s, data, math) {}

  // Every algorithm that ran within the workspace, fastest first (cuDNN times them).
  std::vector<Algo> find(Pass pass, const void* in0, const void* in1, void* out, void* ws,
                         size_t ws_bytes) const {
    switch (pass) {
      case Pass::Forward: {
        cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
        int count = 0;
        CUDP_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(
            handle_, d_.x, in0, d_.w, in1, d_.conv, d_.y, out, CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
            &count, perf, ws, ws_bytes));
        return usable(perf, count);
      }
      case Pass::BackwardData: {
        cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
        int count = 0;
        CUDP_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
            handle_, d_.w, in1, d_.y, in0, d_.conv, d_.x, out,
            CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &count, perf, ws, ws_bytes));
        return usable(perf, count);
      }
      case Pass::BackwardWeight: {
        cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
        int count = 0;
        CUDP_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
            handle_, d_.x, in0, d_.y, in1, d_.conv, d_.w, out,
            CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &count, perf, ws, ws_bytes));
        return usable(perf, count);
      }
    }
    return {};
  }

  void run(Pass pass, Algo algo, const void* in0, const void* in1, void* out, void* ws) const {
    const float one = 1.0f, zero = 0.0f;
    switch (pass) {
      case Pass::Forward:
        CUDP_CUDNN_CHECK(cudnnConvolutionForward(handle_, &one, d_.x, in0, d_.w, in1, d_.conv,
                                                 cudnnConvolutionFwdAlgo_t(algo.id), ws,
                                                 algo.workspace, &zero, d_.y, out));
        return;
      case Pass::BackwardData:
        CUDP_CUDNN_CHECK(cudnnConvolutionBackwardData(handle_, &one, d_.w, in1, d_.y, in0, d_.conv,
                                                      cudnnConvolutionBwdDataAlgo_t(algo.id), ws,
                                                      algo.workspace, &zero, d_.x, out));
        return;
      case Pass::BackwardWeight:
        CUDP_CUDNN_CHECK(cudnnConvolutionBackwardFilter(
            handle_, &one, d_.x, in0, d_.y, in1, d_.conv, cudnnConvolutionBwdFilterAlgo_t(algo.id),
            ws, algo.workspace, &zero, d_.w, out));
        return;
    }
  }

 private:
  template <class Perf>
  static std::vector<Algo> usable(const Perf* perf, int count) {
    std::vector<Algo> algos;
    for (int i = 0; i < count; ++i) {
      if (perf[i].status == CUDNN_STATUS_SUCCESS)
        algos.push_back({int(perf[i].algo), perf[i].memory});
    }
    return algos;
  }

  cudnnHandle_t handle_;
  testing::CudnnConv2dDescriptors d_;
};

// The algorithms that compute each output as one dot product, as ours does (no Winograd, FFT).
bool gemm_like(Pass pass, int id) {
  switch (pass) {
    case Pass::Forward:
      return id == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ||
             id == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
             id == CUDNN_CONVOLUTION_FWD_ALGO_GEMM;
    case Pass::BackwardData:
      return id == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || id == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
    case Pass::BackwardWeight:
      return id == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 ||
             id == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 || id == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
  }
  return false;
}

// |a - b| <= atol + rtol |b| everywhere? Prints the worst element either way.
bool validate(const std::string& what, const std::vector<float>& a, const std::vector<float>& b,
              double rtol, double atol) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double excess = std::fabs(double(a[i]) - b[i]) / (atol + rtol * std::fabs(double(b[i])));
    if (!(excess <= worst)) worst = excess, at = i;  // NaN counts as worst
  }
  const bool ok = worst <= 1.0;
  std::printf("  validate %-34s %s (worst %.3g of tolerance at %zu: %.8g vs %.8g)\n", what.c_str(),
              ok ? "ok  " : "FAIL", worst, at, a.empty() ? 0.0 : a[at], b.empty() ? 0.0 : b[at]);
  return ok;
}

// max |a - b| / max |b|: how far apart two results are relative to their scale.
double normwise(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

std::string shape_text(int layer, const Conv2dShape& s) {
  return cudp::detail::str("L", layer, " b", s.n, " ", s.h, "x", s.w, " ", s.c, "->", s.k);
}

struct Result {
  int input_size = 0, layer = 0;
  Pass pass = Pass::Forward;
  Conv2dShape shape;
  double flops = 0, bytes = 0, ours_ms = 0, cudnn_ms = 0, roofline_tflops = 0;
  Algo algo;
  bool valid = true;
  Math math = Math::FP32;

  double ours_tflops() const { return flops / (ours_ms * 1e-3) / 1e12; }
  double cudnn_tflops() const { return flops / (cudnn_ms * 1e-3) / 1e12; }
  std::string shape_text() const { return ::shape_text(layer, shape); }
};

struct Machine {
  double peak_tflops = 0;  // fp32 FMA: SMs x 128 lanes x 2 flops x clock
  double copy_gbs = 0;     // measured device-to-device, read + write
};

constexpr size_t kWorkspaceBytes = size_t(1) << 30;
constexpr double kRtol = 1e-4;  // the GPU tests' tolerance, see conv2d_gpu_test.cpp

// Validates and times the three passes of one layer shape; appends a Result per pass.
void bench_layer(std::vector<Result>& results, int input_size, int layer, const Conv2dShape& s,
                 cudaStream_t stream, cudnnHandle_t handle, void* workspace,
                 const Machine& machine) {
  const CudnnConv cudnn(handle, s);
  const size_t inputs_bytes = size_t(s.x_size() + s.w_size() + s.y_size()) * sizeof(float);
  const int copies = cudp::bench::rotation_copies(inputs_bytes);
  std::vector<std::unique_ptr<DeviceBuffer<float>>> x, w, dy;
  for (int i = 0; i < copies; ++i) {
    x.push_back(std::make_unique<DeviceBuffer<float>>(s.x_size()));
    w.push_back(std::make_unique<DeviceBuffer<float>>(s.w_size()));
    dy.push_back(std::make_unique<DeviceBuffer<float>>(s.y_size()));
    const uint64_t seed = 1000 * uint64_t(layer) + 10 * uint64_t(i);
    uniform(x[i]->p, s.x_size(), -1.f, 1.f, seed, 0, stream);
    uniform(w[i]->p, s.w_size(), -1.f, 1.f, seed + 1, 0, stream);
    uniform(dy[i]->p, s.y_size(), -1.f, 1.f, seed + 2, 0, stream);
  }
  std::printf("layer %d at %d²: %s (%d input copies)\n", layer, input_size,
              shape_text(layer, s).c_str(), copies);

  for (const Pass pass : kPasses) {
    const Operands ops = operands(s, pass);
    const auto in0 = [&](int i) -> const float* {
      return pass == Pass::BackwardData ? dy[i]->p : x[i]->p;
    };
    const auto in1 = [&](int i) -> const float* {
      return pass == Pass::BackwardWeight ? dy[i]->p : w[i]->p;
    };
    DeviceBuffer<float> ours(ops.out), theirs(ops.out);
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<Algo> algos =
        cudnn.find(pass, in0(0), in1(0), theirs.p, workspace, kWorkspaceBytes);
    CUDP_CHECK(!algos.empty(), "cuDNN has no ", pass_name(pass), " algorithm for ",
               shape_text(layer, s));
    const Algo fastest = algos.front();
    const auto exact = std::find_if(algos.begin(), algos.end(),
                                    [&](const Algo& a) { return gemm_like(pass, a.id); });

    run_ours(s, pass, in0(0), in1(0), ours.p, stream);
    const std::vector<float> got = ours.download();
    bool valid = true;
    if (exact != algos.end()) {
      cudnn.run(pass, *exact, in0(0), in1(0), theirs.p, workspace);
      const double atol = 2e-5 * std::sqrt(double(ops.reduction));
      valid &= validate(cudp::detail::str(pass_name(pass), " vs cuDNN algo ", exact->id), got,
                        theirs.download(), kRtol, atol);
    } else {
      std::printf("  validate: cuDNN offers no GEMM-like %s algorithm here\n", pass_name(pass));
    }
    cudnn.run(pass, fastest, in0(0), in1(0), theirs.p, workspace);
    const double apart = normwise(got, theirs.download());
    const bool same = apart <= 1e-3;
    std::printf("  %s vs fastest cuDNN algo %d: normwise %.2e %s\n", pass_name(pass), fastest.id,
                apart, same ? "ok" : "FAIL");
    valid &= same;

    const auto ours_run = [&](int rep) {
      run_ours(s, pass, in0(rep % copies), in1(rep % copies), ours.p, stream);
    };
    const auto cudnn_run = [&](int rep) {
      cudnn.run(pass, fastest, in0(rep % copies), in1(rep % copies), theirs.p, workspace);
    };
    Result r;
    r.input_size = input_size;
    r.layer = layer;
    r.pass = pass;
    r.shape = s;
    r.flops = s.flops();
    r.bytes = double(ops.in0 + ops.in1 + ops.out) * sizeof(float);
    r.roofline_tflops = std::min(machine.peak_tflops, r.flops / r.bytes * machine.copy_gbs / 1e3);
    r.ours_ms = cudp::bench::time_on_stream(stream, ours_run).median_ms;
    r.cudnn_ms = cudp::bench::time_on_stream(stream, cudnn_run).median_ms;
    r.algo = fastest;
    r.valid = valid;
    results.push_back(r);
  }
}

void write_json(const std::string& path, const Machine& machine, const std::string& feed,
                const std::vector<Result>& results) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) CUDP_THROW(IoError, "cannot write ", path);
  std::fprintf(f,
               "{\n  \"benchmark\": \"conv2d\",\n  \"peak_fp32_tflops\": %.3f,\n"
               "  \"copy_bandwidth_gbs\": %.3f,\n  \"feed\": \"%s\",\n  \"results\": [\n",
               machine.peak_tflops, machine.copy_gbs, feed.c_str());
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const Conv2dShape& s = r.shape;
    std::fprintf(f,
                 "    {\"math\": \"%s\", \"input\": %d, \"layer\": %d, \"pass\": \"%s\", \"n\": %d, \"h\": %d, "
                 "\"w\": %d, \"c\": %d, \"k\": %d, \"r\": %d, \"s\": %d, \"flops\": %.0f, "
                 "\"bytes\": %.0f, \"ours_ms\": %.6f, \"cudnn_ms\": %.6f, \"ours_tflops\": %.3f, "
                 "\"cudnn_tflops\": %.3f, \"ours_over_cudnn\": %.4f, \"roofline_tflops\": %.3f, "
                 "\"cudnn_algo\": %d, \"cudnn_workspace_bytes\": %zu, \"valid\": %s}%s\n",
                 math_name(r.math), r.input_size, r.layer, pass_name(r.pass), s.n, s.h, s.w, s.c, s.k, s.r, s.s,
                 r.flops, r.bytes, r.ours_ms, r.cudnn_ms, r.ours_tflops(), r.cudnn_tflops(),
                 r.cudnn_ms / r.ours_ms, r.roofline_tflops, r.algo.id, r.algo.workspace,
                 r.valid ? "true" : "false", i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

void print_tables(const Machine& machine, const std::vector<Result>& results) {
  std::vector<cudp::bench::Row> rows;
  for (const Result& r : results) {
    rows.push_back({cudp::detail::str("conv ", pass_name(r.pass), r.valid ? "" : " (INVALID)"),
                    cudp::detail::str(r.input_size, "²: ", r.shape_text()), r.ours_tflops(),
                    r.cudnn_tflops(), "TFLOP/s", cudp::detail::str("cuDNN algo ", r.algo.id)});
  }
  std::printf("\n");
  cudp::bench::print_table(rows);

  std::printf("\nRoofline: fp32 FMA peak %.1f TFLOP/s, copy bandwidth %.0f GB/s\n\n",
              machine.peak_tflops, machine.copy_gbs);
  std::printf(
      "| pass | shape | flop/byte | roofline TFLOP/s | ours of roofline | cuDNN of roofline |"
      " cuDNN workspace MiB |\n|---|---|---:|---:|---:|---:|---:|\n");
  for (const Result& r : results) {
    std::printf("| %s | %d²: %s | %.0f | %.1f | %.0f%% | %.0f%% | %.0f |\n", pass_name(r.pass),
                r.input_size, r.shape_text().c_str(), r.flops / r.bytes, r.roofline_tflops,
                100 * r.ours_tflops() / r.roofline_tflops,
                100 * r.cudnn_tflops() / r.roofline_tflops, double(r.algo.workspace) / (1 << 20));
  }

  // The worst and the geometric mean of ours/cuDNN per pass and input size.
  std::printf("\n");
  for (const Pass pass : kPasses) {
    for (const int input : {224, 32}) {
      double log_sum = 0;
      int count = 0;
      for (const Result& r : results) {
        if (r.pass == pass && r.input_size == input) {
          log_sum += std::log(r.cudnn_ms / r.ours_ms);
          ++count;
        }
      }
      if (count > 0) {
        std::printf("geomean ours/cuDNN for %s at %d²: %.2f over %d layers\n", pass_name(pass),
                    input, std::exp(log_sum / count), count);
      }
    }
  }
  for (const Pass pass : kPasses) {
    const Result* worst = nullptr;
    for (const Result& r : results) {
      if (r.pass == pass && (!worst || r.cudnn_ms / r.ours_ms < worst->cudnn_ms / worst->ours_ms)) {
        worst = &r;
      }
    }
    if (worst) {
      std::printf("worst ours/cuDNN for %s: %.2f at %d²: %s\n", pass_name(pass),
                  worst->cudnn_ms / worst->ours_ms, worst->input_size, worst->shape_text().c_str());
    }
  }
}

Machine measure_machine(cudaStream_t stream) {
  int device = 0, sms = 0, khz = 0;
  CUDP_CUDA_CHECK(cudaGetDevice(&device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CUDP_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device));
  // 128 fp32 lanes per SM since Ampere's GA10x and Hopper; two flops per FMA.
  return {double(sms) * 128 * 2 * khz * 1e3 / 1e12,
          cudp::bench::measure_copy_bandwidth_gbs(stream)};
}


// ---- tensor cores (--math bf16|tf32) --------------------------------------------------------------

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    r += double(b[i]) * b[i];
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

// A device tensor of n elements of the math's type (bf16 or fp32), uniform in [-1, 1).
struct TypedTensor {
  std::unique_ptr<DeviceBuffer<float>> buf;  // fp32 storage, large enough for either type
  bool bf16;
  int64_t n;
  TypedTensor(int64_t count, bool is_bf16, uint64_t seed, cudaStream_t stream)
      : buf(std::make_unique<DeviceBuffer<float>>(size_t(count))), bf16(is_bf16), n(count) {
    if (seed == 0) return;
    if (bf16) {
      DeviceBuffer<float> tmp{size_t(count)};
      uniform(tmp.p, count, -1.f, 1.f, seed, 0, stream);
      f32_to_bf16(tmp.p, reinterpret_cast<__nv_bfloat16*>(buf->p), count, stream);
      CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    } else {
      uniform(buf->p, count, -1.f, 1.f, seed, 0, stream);
    }
  }
  void* get() const { return buf->p; }
  std::vector<float> download() const {
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> out(static_cast<size_t>(n));
    if (!bf16) {
      CUDP_CUDA_CHECK(cudaMemcpy(out.data(), buf->p, out.size() * 4, cudaMemcpyDeviceToHost));
      return out;
    }
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    CUDP_CUDA_CHECK(cudaMemcpy(bits.data(), buf->p, bits.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < bits.size(); ++i) {
      const uint32_t wide = uint32_t(bits[i]) << 16;
      std::memcpy(&out[i], &wide, 4);
    }
    return out;
  }
};

void bench_layer_tc(std::vector<Result>& results, int input_size, int layer, const Conv2dShape& s,
                    Math math, cudaStream_t stream, cudnnHandle_t handle, void* workspace,
                    const Machine& machine, bool bias_grad) {
  const bool bf16 = math == Math::BF16;
  const CudnnConv cudnn(handle, s, bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT,
                        CUDNN_TENSOR_OP_MATH);
  // Ours reads C padded to 16 bytes' worth (the first layer only).
  Conv2dShape padded = s;
  padded.c = (s.c + (bf16 ? 7 : 3)) / (bf16 ? 8 : 4) * (bf16 ? 8 : 4);
  const int64_t esize = bf16 ? 2 : 4;
  const int copies = cudp::bench::rotation_copies(size_t(s.x_size() + s.w_size() + s.y_size()) * esize);
  std::vector<TypedTensor> x, w, dy, xp, wp;
  for (int i = 0; i < copies; ++i) {
    const uint64_t seed = 1000 * uint64_t(layer) + 10 * uint64_t(i) + 1;
    x.emplace_back(s.x_size(), bf16, seed, stream);
    w.emplace_back(s.w_size(), bf16, seed + 1, stream);
    dy.emplace_back(s.y_size(), bf16, seed + 2, stream);
    if (padded.c != s.c) {  // zero-padded copies of x and w for ours
      xp.emplace_back(padded.x_size(), bf16, 0, stream);
      wp.emplace_back(padded.w_size(), bf16, 0, stream);
      CUDP_CUDA_CHECK(cudaMemset(xp.back().get(), 0, size_t(padded.x_size() * esize)));
      CUDP_CUDA_CHECK(cudaMemset(wp.back().get(), 0, size_t(padded.w_size() * esize)));
      CUDP_CUDA_CHECK(cudaMemcpy2D(xp.back().get(), padded.c * esize, x.back().get(), s.c * esize,
                                   s.c * esize, size_t(s.n) * s.h * s.w, cudaMemcpyDeviceToDevice));
      CUDP_CUDA_CHECK(cudaMemcpy2D(wp.back().get(), padded.c * esize, w.back().get(), s.c * esize,
                                   s.c * esize, size_t(s.k) * s.r * s.s, cudaMemcpyDeviceToDevice));
    }
  }
  const auto our_x = [&](int i) { return padded.c != s.c ? xp[i].get() : x[i].get(); };
  const auto our_w = [&](int i) { return padded.c != s.c ? wp[i].get() : w[i].get(); };
  std::printf("layer %d at %d²: %s, %s (%d input copies)\n", layer, input_size,
              shape_text(layer, s).c_str(), math_name(math), copies);
  const DType out_type = bf16 ? DType::BF16 : DType::F32;
  for (const Pass pass : kPasses) {
    if (pass == Pass::BackwardData && layer == 1) continue;  // the first layer needs no dx
    const int64_t out_n = pass == Pass::Forward ? s.y_size()
                          : pass == Pass::BackwardData ? s.x_size()
                                                       : s.w_size();
    // Ours: y and dx in the math's type; dw in fp32 (weight gradients accumulate in fp32), while
    // cuDNN's legacy API writes dw in the tensors' type.
    TypedTensor ours(pass == Pass::BackwardWeight ? padded.w_size() : pass == Pass::Forward ? out_n : padded.x_size(),
                     pass == Pass::BackwardWeight ? false : bf16, 0, stream);
    TypedTensor theirs(out_n, bf16, 0, stream);
    // --bias-grad: our backward-weight also takes the bias gradient (K floats, accumulated).
    TypedTensor dbias(s.k, false, 0, stream);
    float* db = bias_grad ? static_cast<float*>(dbias.get()) : nullptr;
    const auto run_ours = [&](int i) {
      if (pass == Pass::Forward) {
        ConvOperands ops{math, our_x(i), our_w(i), ours.get(), out_type, nullptr, false};
        ops.live_channels = s.c;  // the channels past it are the padded copies' zeros
        conv2d_forward_tc(padded, ops, stream);
      } else if (pass == Pass::BackwardData) {
        conv2d_backward_data_tc(s, {math, dy[i].get(), w[i].get(), ours.get(), out_type, nullptr,
                                    false}, stream);
      } else if (bf16) {
        conv2d_backward_weight_tc(padded, our_x(i), dy[i].get(), static_cast<float*>(ours.get()),
                                  0.f, stream, db, s.c);
      } else {  // TF32: the float launcher on fp32 operands, x with its channels padded as above
        conv2d_backward_weight(padded, static_cast<const float*>(our_x(i)),
                               static_cast<const float*>(dy[i].get()),
                               static_cast<float*>(ours.get()), 0.f, stream, Math::TF32, {}, db);
      }
    };
    const auto in0 = [&](int i) { return pass == Pass::BackwardData ? dy[i].get() : x[i].get(); };
    const auto in1 = [&](int i) { return pass == Pass::BackwardWeight ? dy[i].get() : w[i].get(); };
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<Algo> algos =
        cudnn.find(pass, in0(0), in1(0), theirs.get(), workspace, kWorkspaceBytes);
    CUDP_CHECK(!algos.empty(), "cuDNN has no ", pass_name(pass), " algorithm for ",
               shape_text(layer, s));
    run_ours(0);
    cudnn.run(pass, algos.front(), in0(0), in1(0), theirs.get(), workspace);
    std::vector<float> got = ours.download();
    if (pass == Pass::BackwardWeight && padded.c != s.c) {  // drop the padding channels
      std::vector<float> kept;
      for (size_t i = 0; i < got.size(); ++i) {
        if (int(i % padded.c) < s.c) kept.push_back(got[i]);
      }
      got = kept;
    }
    const double apart = rel_l2(got, theirs.download());
    const double bound = bf16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -8);
    const bool valid = apart <= bound;
    std::printf("  %s vs cuDNN algo %d: relative L2 %.2e (bound %.2e) %s\n", pass_name(pass),
                algos.front().id, apart, bound, valid ? "ok" : "FAIL");
    const auto cudnn_run = [&](int i) {
      cudnn.run(pass, algos.front(), in0(i % copies), in1(i % copies), theirs.get(), workspace);
    };
    Result r;
    r.input_size = input_size;
    r.layer = layer;
    r.pass = pass;
    r.shape = s;
    r.flops = s.flops();
    r.bytes = double(s.x_size() + s.w_size() + s.y_size()) * double(esize);
    // The datasheet's dense tensor-core rate (H100/H200 SXM), or the memory bound.
    r.roofline_tflops = std::min(bf16 ? 989.0 : 494.7, r.flops / r.bytes * machine.copy_gbs / 1e3);
    r.ours_ms = cudp::bench::time_on_stream(stream, [&](int i) { run_ours(i % copies); }).median_ms;
    r.cudnn_ms = cudp::bench::time_on_stream(stream, cudnn_run).median_ms;
    r.algo = algos.front();
    r.valid = valid;
    r.math = math;
    results.push_back(r);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_conv2d: implicit-GEMM convolution vs cuDNN (fp32 FMA, NHWC) on VGG-16"};
  std::string size = "both", json;
  std::vector<int> layers;
  app.add_option("--size", size, "input resolution: 224 (batch 64), 32 (batch 256) or both")
      ->check(CLI::IsMember({"224", "32", "both"}));
  app.add_option("--layers", layers, "VGG-16 layer shapes to run, 1-9 (default: all)")
      ->delimiter(',')
      ->check(CLI::Range(1, 9));
  app.add_option("--json", json, "write the results to this JSON file");
  std::string math_text = "fp32";
  app.add_option("--math", math_text,
                 "fp32: the SIMT kernels vs cuDNN FMA math; bf16 / tf32: the tensor-core kernels vs "
                 "cuDNN tensor-op math")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}));
  std::string feed = "patch";
  app.add_option("--feed", feed,
                 "tensor cores, stride-1 layers: how our kernels feed the gathered operand. patch "
                 "(the default: 4-D TMA boxes over patch tiles), gather (im2col by the producer "
                 "warps) or patch-streamed (patches, with bf16 filters streamed per k-block even "
                 "where they fit in shared memory whole)")
      ->check(CLI::IsMember({"patch", "gather", "patch-streamed"}));
  std::string swap = "on";
  app.add_option("--swap", swap,
                 "bf16, 64-channel outputs (forward of K = 64, backward-data into C = 64): on (the "
                 "default: the filters as wgmma's A and 128 pixels as its N) or off (pixels as A, "
                 "the filters as a 64-wide B)")
      ->check(CLI::IsMember({"on", "off"}));
  std::string halo = "on";
  app.add_option("--halo", halo,
                 "bf16 3 x 3 layers: on (the default: halo tiles, each tile's input loaded once "
                 "with its border and the taps read as shifted views, on the swapped 64-channel "
                 "layers, the 128/256-wide tiles of outputs that 8 x 16 patches tile exactly, and "
                 "8 x 8 patches over two images where the height is a multiple of 8 only: 56 x "
                 "56), exact (not the image pairs), covering (8 x 16 patches over 56 x 56 too, "
                 "overhanging), swapped (the swapped layers only) or off (nine shifted boxes a "
                 "tile)")
      ->check(CLI::IsMember({"on", "exact", "covering", "swapped", "off"}));
  std::string wgrad_order = "split";
  app.add_option("--wgrad-order", wgrad_order,
                 "bf16 backward-weight's split-K work items: split (split-major, the default) or "
                 "tile (tile-major)")
      ->check(CLI::IsMember({"split", "tile"}));
  std::string bias_grad_text = "none";
  app.add_option(
         "--bias-grad", bias_grad_text,
         "tensor cores: whether our backward-weight rows also take the bias gradient: none "
         "(the default), separate (the reduction a training step runs) or fused (bf16 patch "
         "feed: from the dy tiles the product loads); cuDNN's rows stay the product alone")
      ->check(CLI::IsMember({"none", "separate", "fused"}));
  std::string tf32_wgrad = "auto";
  app.add_option("--tf32-wgrad", tf32_wgrad,
                 "TF32 backward-weight of stride-1 layers: auto (the default: boxes where they "
                 "apply), boxes (TMA boxes transposed in shared memory) or copies (K-major copies "
                 "of x and dy first)")
      ->check(CLI::IsMember({"auto", "boxes", "copies"}));
  if (const auto status = cudp::bench::parse_command_line(app, "bench_conv2d", argc, argv)) {
    return *status;
  }
  if (!cudp::bench::usable_cuda_device("bench_conv2d")) return cudp::bench::kExitUsage;
  using cudp::kernels::detail::Tf32WgradFeed;
  cudp::kernels::detail::set_tf32_wgrad_feed(tf32_wgrad == "boxes"    ? Tf32WgradFeed::boxes
                                             : tf32_wgrad == "copies" ? Tf32WgradFeed::copies
                                                                      : Tf32WgradFeed::automatic);
  const bool bias_grad = bias_grad_text != "none";
  cudp::kernels::detail::set_wgrad_bias_fusion(bias_grad_text == "fused");
  cudp::kernels::detail::set_wgrad_split_major(wgrad_order == "split");
  cudp::kernels::detail::set_conv_swapped(swap == "on");
  cudp::kernels::detail::set_conv_halo(halo != "off");
  using cudp::kernels::detail::HaloWide;
  cudp::kernels::detail::set_conv_halo_wide(halo == "on"         ? HaloWide::pairs
                                            : halo == "exact"    ? HaloWide::exact
                                            : halo == "covering" ? HaloWide::covering
                                                                 : HaloWide::off);
  using cudp::kernels::detail::ConvFeed;
  cudp::kernels::detail::set_conv_feed(feed == "gather"           ? ConvFeed::gather
                                       : feed == "patch-streamed" ? ConvFeed::patch_streamed
                                                                  : ConvFeed::patch);
  const bool tensor_cores = math_text != "fp32";
  const Math math = math_text == "bf16" ? Math::BF16 : math_text == "tf32" ? Math::TF32 : Math::FP32;
  if (layers.empty()) layers = {1, 2, 3, 4, 5, 6, 7, 8, 9};

  try {
    cudaStream_t stream = nullptr;
    CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // As the engine does (docs/architecture.md §2.4): the pool keeps freed memory, so the split reduction's
    // workspace does not go back to the driver at every synchronisation.
    int device = 0;
    CUDP_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    CUDP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep = UINT64_MAX;
    CUDP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));

    cudnnHandle_t handle = nullptr;
    CUDP_CUDNN_CHECK(cudnnCreate(&handle));
    CUDP_CUDNN_CHECK(cudnnSetStream(handle, stream));
    const DeviceBuffer<float> workspace(kWorkspaceBytes / sizeof(float));
    const Machine machine = measure_machine(stream);
    std::printf("fp32 FMA peak %.1f TFLOP/s, device-to-device copy %.0f GB/s\n",
                machine.peak_tflops, machine.copy_gbs);

    std::vector<Result> results;
    for (const int input : {224, 32}) {
      if (size != "both" && size != std::to_string(input)) continue;
      const int batch = input == 224 ? 64 : 256;
      for (const int layer : layers) {
        const Layer& l = kVgg[layer - 1];
        const int spatial = input == 224 ? l.at224 : l.at32;
        const Conv2dShape shape{batch, spatial, spatial, l.c, l.k, 3, 3, 1, 1, 1, 1};
        if (tensor_cores) {
          bench_layer_tc(results, input, layer, shape, math, stream, handle, workspace.p, machine,
                         bias_grad);
        } else {
          bench_layer(results, input, layer, shape, stream, handle, workspace.p, machine);
        }
      }
    }
    print_tables(machine, results);
    if (!json.empty()) write_json(json, machine, feed, results);
    cudnnDestroy(handle);
    const bool all_valid =
        std::all_of(results.begin(), results.end(), [](const Result& r) { return r.valid; });
    return all_valid ? 0 : 1;  // the stream goes with the process
  } catch (const std::exception& e) {
    cudp::bench::print_error("bench_conv2d", e);
    return cudp::bench::kExitUsage;
  }
}
