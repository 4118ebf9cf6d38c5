// bench_elementwise: the element-wise, bias, dropout and layout kernels against the device's
// measured copy bandwidth (the ceiling of a one-pass kernel), and against cuDNN where it has the
// op.
//
// First every op is validated against its CPU reference on a reduced shape of the same kind (odd
// sizes, the same code paths); if any disagrees, nothing is timed and the program exits with 1.
// Then each op is timed with time_on_stream at a VGG-sized tensor, rotating over as many copies of
// its buffers as keep L2 from serving them. GB/s counts the least bytes the op must move (each
// input read once, each output written once; README-elementwise.md lists them). The brief's floor
// is 70% of the copy bandwidth for the ops marked "floor" at the large size (64x64x224x224 floats).
// --json PATH writes the results, --quick times the medium size only.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/timing.h"
#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/vendor_check.h"
#include "kernels/bias.h"
#include "kernels/dropout.h"
#include "kernels/elementwise.h"
#include "kernels/init.h"
#include "kernels/layout.h"

namespace {

using namespace cudp;
using namespace cudp::kernels;

constexpr double kFloor = 0.70;

// Device memory from the stream-ordered pool (so bias_grad's workspace is reused as in training).
template <typename T>
class Array {
 public:
  Array(size_t n, cudaStream_t stream)
      : n_(n),
        stream_(stream),
        p_(static_cast<T*>(cuda::device_allocate(std::max<size_t>(n, 1) * sizeof(T), 0, stream))) {}
  ~Array() { cuda::device_free(p_, stream_); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  T* get() const { return p_; }
  void upload(const std::vector<T>& v) {
    CUDP_CUDA_CHECK(
        cudaMemcpyAsync(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, stream_));
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    CUDP_CUDA_CHECK(cudaMemcpyAsync(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    CUDP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return v;
  }

 private:
  size_t n_;
  cudaStream_t stream_;
  T* p_;
};

using Floats = std::shared_ptr<Array<float>>;

// `copies` arrays of n floats, uniform in [-1, 1) unless `random` is false.
std::vector<Floats> arrays(int copies, size_t n, cudaStream_t stream, bool random = true) {
  static uint64_t seed = 1;
  std::vector<Floats> out;
  for (int i = 0; i < copies; ++i) {
    out.push_back(std::make_shared<Array<float>>(n, stream));
    if (random) {
      uniform(out.back()->get(), int64_t(n), -1.f, 1.f, ++seed, 0, stream);
    }
  }
  return out;
}

// ---- validation on reduced shapes ---------------------------------------------------------------

std::vector<float> host_random(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  uniform_cpu(v.data(), int64_t(n), -1.f, 1.f, seed, 0);
  return v;
}

bool report(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
            double atol) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - double(want[i]));
    if (!(err <= worst)) {  // NaN is the worst
      worst = err;
      at = i;
    }
  }
  const bool ok = worst <= atol;
  std::printf("  validate %-34s %s (worst |diff| %.3g at %zu, allowed %.3g)\n", what.c_str(),
              ok ? "ok  " : "FAIL", worst, at, atol);
  return ok;
}

bool validate(cudaStream_t stream) {
  std::printf("validation against the CPU references (reduced shapes):\n");
  bool ok = true;
  const int64_t n = (int64_t(1) << 22) + 3;
  const std::vector<float> a = host_random(n, 11), b = host_random(n, 12);
  Array<float> da(n, stream), db(n, stream), dout(n, stream);
  da.upload(a);
  db.upload(b);
  std::vector<float> want(n);

  relu_forward(da.get(), dout.get(), n, stream);
  relu_forward_cpu(a.data(), want.data(), n);
  ok &= report("relu_forward", dout.download(), want, 0);
  relu_backward(da.get(), db.get(), dout.get(), n, stream);
  relu_backward_cpu(a.data(), b.data(), want.data(), n);
  ok &= report("relu_backward", dout.download(), want, 0);
  add(da.get(), db.get(), dout.get(), n, stream);
  add_cpu(a.data(), b.data(), want.data(), n);
  ok &= report("add", dout.download(), want, 0);
  dout.upload(b);
  want = b;
  axpy(0.37f, da.get(), dout.get(), n, stream);
  axpy_cpu(0.37f, a.data(), want.data(), n);
  ok &= report("axpy", dout.download(), want, 0);
  scale(dout.get(), -1.3f, n, stream);
  scale_cpu(want.data(), -1.3f, n);
  ok &= report("scale", dout.download(), want, 0);
  dropout_forward(da.get(), dout.get(), n, 0.5f, 99, 12, stream);
  dropout_forward_cpu(a.data(), want.data(), n, 0.5f, 99, 12);
  ok &= report("dropout_forward", dout.download(), want, 0);
  dropout_backward(db.get(), dout.get(), n, 0.1f, 98, 8, stream);
  dropout_backward_cpu(b.data(), want.data(), n, 0.1f, 98, 8);
  ok &= report("dropout_backward", dout.download(), want, 0);

  // Bias over an NHWC activation (rows = N*H*W, cols = C) and a Linear output.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2 * 57 * 61, 64}, {256, 4096}, {4099, 3}}) {
    const std::string shape = std::to_string(rows) + "x" + std::to_string(cols);
    const std::vector<float> y = host_random(rows * cols, 13), bias = host_random(cols, 14);
    Array<float> dy(rows * cols, stream), dbias(cols, stream);
    dy.upload(y);
    dbias.upload(bias);
    std::vector<float> want_y = y, want_b = bias;
    bias_add(dy.get(), dbias.get(), rows, cols, stream);
    bias_add_cpu(want_y.data(), bias.data(), rows, cols);
    ok &= report("bias_add " + shape, dy.download(), want_y, 0);
    bias_grad(dy.get(), dbias.get(), rows, cols, 1.0f, stream);
    bias_grad_cpu(want_y.data(), want_b.data(), rows, cols, 1.0f);
    // bias.h's bound: chains under 300 additions, so |error| <= 512 * 2^-24 * sum |terms|, with
    // |y + bias| < 2 per row and |dbias| < 1.
    ok &= report("bias_grad " + shape, dbias.download(), want_b,
                 512 * std::ldexp(1.0, -24) * (2.0 * double(rows) + 1.0));
  }

  // Layouts on odd image and weight shapes, there and back.
  const int64_t N = 2, C = 64, H = 57, W = 61, K = 67, R = 3, S = 3;
  const std::vector<float> img = host_random(N * C * H * W, 15),
                           wts = host_random(K * C * R * S, 16);
  Array<float> di(img.size(), stream), dm(img.size(), stream), dw(wts.size(), stream),
      dwm(wts.size(), stream);
  di.upload(img);
  dw.upload(wts);
  std::vector<float> want_i(img.size()), want_w(wts.size());
  nchw_to_nhwc(di.get(), dm.get(), N, C, H, W, stream);
  nchw_to_nhwc_cpu(img.data(), want_i.data(), N, C, H, W);
  ok &= report("nchw_to_nhwc", dm.download(), want_i, 0);
  nhwc_to_nchw(dm.get(), di.get(), N, C, H, W, stream);
  ok &= report("nhwc_to_nchw (round trip)", di.download(), img, 0);
  oihw_to_krsc(dw.get(), dwm.get(), K, C, R, S, stream);
  oihw_to_krsc_cpu(wts.data(), want_w.data(), K, C, R, S);
  ok &= report("oihw_to_krsc", dwm.download(), want_w, 0);
  krsc_to_oihw(dwm.get(), dw.get(), K, C, R, S, stream);
  ok &= report("krsc_to_oihw (round trip)", dw.download(), wts, 0);

  // bf16 there and back; the narrowing compared on the bits.
  Array<__nv_bfloat16> dh(n, stream);
  f32_to_bf16(da.get(), dh.get(), n, stream);
  std::vector<__nv_bfloat16> want_h(n);
  f32_to_bf16_cpu(a.data(), want_h.data(), n);
  const std::vector<__nv_bfloat16> got_h = dh.download();
  const bool bits_ok = std::memcmp(got_h.data(), want_h.data(), n * sizeof(__nv_bfloat16)) == 0;
  std::printf("  validate %-34s %s\n", "f32_to_bf16 (bits)", bits_ok ? "ok  " : "FAIL");
  ok &= bits_ok;
  bf16_to_f32(dh.get(), dout.get(), n, stream);
  bf16_to_f32_cpu(want_h.data(), want.data(), n);
  ok &= report("bf16_to_f32", dout.download(), want, 0);
  return ok;
}

// ---- timing ------------------------------------------------------------------------------------

struct Case {
  std::string op, shape;
  double bytes = 0;  // the least the op moves per call
  bool floor = false;
  std::function<void(int)> ours, cudnn;  // cudnn empty where cuDNN has no such op
};

struct Result {
  std::string op, shape;
  double bytes = 0, ours_ms = 0, cudnn_ms = 0;
  bool floor = false;
};

struct Cudnn {
  cudnnHandle_t handle = nullptr;
  explicit Cudnn(cudaStream_t stream) {
    CUDP_CUDNN_CHECK(cudnnCreate(&handle));
    CUDP_CUDNN_CHECK(cudnnSetStream(handle, stream));
  }
  ~Cudnn() { cudnnDestroy(handle); }
};

struct Desc {
  cudnnTensorDescriptor_t d = nullptr;
  Desc(cudnnTensorFormat_t format, int n, int c, int h, int w) {
    CUDP_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
    CUDP_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, format, CUDNN_DATA_FLOAT, n, c, h, w));
  }
  ~Desc() { cudnnDestroyTensorDescriptor(d); }
};

struct Activation {
  cudnnActivationDescriptor_t d = nullptr;
  Activation() {
    CUDP_CUDNN_CHECK(cudnnCreateActivationDescriptor(&d));
    CUDP_CUDNN_CHECK(
        cudnnSetActivationDescriptor(d, CUDNN_ACTIVATION_RELU, CUDNN_PROPAGATE_NAN, 0.0));
  }
  ~Activation() { cudnnDestroyActivationDescriptor(d); }
};

constexpr float kOne = 1.f, kZero = 0.f;

// All cases for one activation tensor of n x c x h x w floats.
std::vector<Case> cases_for(int n, int c, int h, int w, bool floor, cudaStream_t stream,
                            Cudnn& cudnn) {
  const size_t count = size_t(n) * c * h * w;
  const double f = 4.0 * double(count);  // bytes of one fp32 tensor
  const std::string shape = std::to_string(n) + "x" + std::to_string(c) + "x" + std::to_string(h) +
                            "x" + std::to_string(w);
  const auto rows = int64_t(n) * h * w;
  const auto m = int64_t(count);
  const int k2 = cudp::bench::rotation_copies(size_t(2 * f));
  const int k3 = cudp::bench::rotation_copies(size_t(3 * f));
  auto nhwc = std::make_shared<Desc>(CUDNN_TENSOR_NHWC, n, c, h, w);
  auto nchw = std::make_shared<Desc>(CUDNN_TENSOR_NCHW, n, c, h, w);
  auto bias_desc = std::make_shared<Desc>(CUDNN_TENSOR_NHWC, 1, c, 1, 1);
  auto act = std::make_shared<Activation>();
  cudnnHandle_t hd = cudnn.handle;
  std::vector<Case> out;

  {
    auto x = arrays(k2, count, stream), y = arrays(k2, count, stream, false);
    out.push_back({"relu_forward", shape, 2 * f, floor,
                   [=](int i) { relu_forward(x[i % k2]->get(), y[i % k2]->get(), m, stream); },
                   [=](int i) {
                     CUDP_CUDNN_CHECK(cudnnActivationForward(hd, act->d, &kOne, nhwc->d,
                                                             x[i % k2]->get(), &kZero, nhwc->d,
                                                             y[i % k2]->get()));
                   }});
  }
  {
    auto y = arrays(k3, count, stream), dy = arrays(k3, count, stream),
         dx = arrays(k3, count, stream, false);
    out.push_back({"relu_backward", shape, 3 * f, floor,
                   [=](int i) {
                     relu_backward(y[i % k3]->get(), dy[i % k3]->get(), dx[i % k3]->get(), m,
                                   stream);
                   },
                   [=](int i) {
                     // cuDNN also takes x; for ReLU y stands in for it (same sign).
                     CUDP_CUDNN_CHECK(cudnnActivationBackward(
                         hd, act->d, &kOne, nhwc->d, y[i % k3]->get(), nhwc->d, dy[i % k3]->get(),
                         nhwc->d, y[i % k3]->get(), &kZero, nhwc->d, dx[i % k3]->get()));
                   }});
  }
  {
    auto x = arrays(k2, count, stream);
    out.push_back({"scale (in place)",
                   shape,
                   2 * f,
                   false,
                   [=](int i) { scale(x[i % k2]->get(), 0.999f, m, stream); },
                   {}});
  }
  {
    auto x = arrays(k3, count, stream), y = arrays(k3, count, stream);
    out.push_back({"axpy",
                   shape,
                   3 * f,
                   floor,
                   [=](int i) { axpy(0.001f, x[i % k3]->get(), y[i % k3]->get(), m, stream); },
                   {}});
  }
  {
    auto a = arrays(k3, count, stream), b = arrays(k3, count, stream),
         o = arrays(k3, count, stream, false);
    out.push_back(
        {"add",
         shape,
         3 * f,
         false,
         [=](int i) { add(a[i % k3]->get(), b[i % k3]->get(), o[i % k3]->get(), m, stream); },
         {}});
  }
  {
    auto y = arrays(k2, count, stream), b = arrays(k2, size_t(c), stream);
    out.push_back({"bias_add (NHWC)", shape, 2 * f, floor,
                   [=](int i) { bias_add(y[i % k2]->get(), b[i % k2]->get(), rows, c, stream); },
                   [=](int i) {
                     CUDP_CUDNN_CHECK(cudnnAddTensor(hd, &kOne, bias_desc->d, b[i % k2]->get(),
                                                     &kOne, nhwc->d, y[i % k2]->get()));
                   }});
  }
  {
    const int k1 = cudp::bench::rotation_copies(size_t(f));
    auto dy = arrays(k1, count, stream), db = arrays(k1, size_t(c), stream, false);
    out.push_back(
        {"bias_grad (NHWC)", shape, f, false,
         [=](int i) { bias_grad(dy[i % k1]->get(), db[i % k1]->get(), rows, c, 0.0f, stream); },
         [=](int i) {
           CUDP_CUDNN_CHECK(cudnnConvolutionBackwardBias(hd, &kOne, nhwc->d, dy[i % k1]->get(),
                                                         &kZero, bias_desc->d, db[i % k1]->get()));
         }});
  }
  {
    auto x = arrays(k2, count, stream), y = arrays(k2, count, stream, false);
    out.push_back({"dropout_forward p=0.5",
                   shape,
                   2 * f,
                   floor,
                   [=](int i) {
                     dropout_forward(x[i % k2]->get(), y[i % k2]->get(), m, 0.5f, 7,
                                     uint64_t(i) * m, stream);
                   },
                   {}});
    out.push_back({"dropout_backward p=0.5",
                   shape,
                   2 * f,
                   floor,
                   [=](int i) {
                     dropout_backward(x[i % k2]->get(), y[i % k2]->get(), m, 0.5f, 7,
                                      uint64_t(i) * m, stream);
                   },
                   {}});
  }
  {
    auto x = arrays(k2, count, stream), y = arrays(k2, count, stream, false);
    out.push_back(
        {"nchw_to_nhwc", shape, 2 * f, floor,
         [=](int i) { nchw_to_nhwc(x[i % k2]->get(), y[i % k2]->get(), n, c, h, w, stream); },
         [=](int i) {
           CUDP_CUDNN_CHECK(cudnnTransformTensor(hd, &kOne, nchw->d, x[i % k2]->get(), &kZero,
                                                 nhwc->d, y[i % k2]->get()));
         }});
    out.push_back(
        {"nhwc_to_nchw", shape, 2 * f, floor,
         [=](int i) { nhwc_to_nchw(x[i % k2]->get(), y[i % k2]->get(), n, c, h, w, stream); },
         [=](int i) {
           CUDP_CUDNN_CHECK(cudnnTransformTensor(hd, &kOne, nhwc->d, x[i % k2]->get(), &kZero,
                                                 nchw->d, y[i % k2]->get()));
         }});
  }
  {
    const int k = cudp::bench::rotation_copies(size_t(1.5 * f));
    auto x = arrays(k, count, stream);
    std::vector<std::shared_ptr<Array<__nv_bfloat16>>> hb;
    for (int i = 0; i < k; ++i) {
      hb.push_back(std::make_shared<Array<__nv_bfloat16>>(count, stream));
    }
    out.push_back({"f32_to_bf16",
                   shape,
                   1.5 * f,
                   false,
                   [=](int i) { f32_to_bf16(x[i % k]->get(), hb[i % k]->get(), m, stream); },
                   {}});
    out.push_back({"bf16_to_f32",
                   shape,
                   1.5 * f,
                   false,
                   [=](int i) { bf16_to_f32(hb[i % k]->get(), x[i % k]->get(), m, stream); },
                   {}});
  }
  return out;
}

// A VGG conv weight, OIHW -> KRSC (checkpoint loading; small, not in the floor).
Case weight_case(int k, int c, int r, int s, cudaStream_t stream) {
  const size_t count = size_t(k) * c * r * s;
  const double f = 4.0 * double(count);
  const int copies = cudp::bench::rotation_copies(size_t(2 * f), 64);
  auto x = arrays(copies, count, stream), y = arrays(copies, count, stream, false);
  const std::string shape = std::to_string(k) + "x" + std::to_string(c) + "x" + std::to_string(r) +
                            "x" + std::to_string(s);
  return {
      "oihw_to_krsc",
      shape,
      2 * f,
      false,
      [=](int i) { oihw_to_krsc(x[i % copies]->get(), y[i % copies]->get(), k, c, r, s, stream); },
      {}};
}

Result run(const Case& c, cudaStream_t stream) {
  Result r{c.op, c.shape, c.bytes, 0, 0, c.floor};
  r.ours_ms = cudp::bench::time_on_stream(stream, c.ours).median_ms;
  if (c.cudnn) {
    r.cudnn_ms = cudp::bench::time_on_stream(stream, c.cudnn).median_ms;
  }
  return r;
}

double gbs(double bytes, double ms) {
  return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0.0;
}

void write_json(const std::string& path, const std::string& device, double copy_gbs,
                const std::vector<Result>& results) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    CUDP_THROW(IoError, "cannot write ", path);
  }
  std::fprintf(f, "{\n  \"benchmark\": \"elementwise\",\n  \"device\": \"%s\",\n", device.c_str());
  std::fprintf(f, "  \"copy_bandwidth_gbs\": %.3f,\n  \"floor_of_copy\": %.2f,\n  \"results\": [\n",
               copy_gbs, kFloor);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const double ours = gbs(r.bytes, r.ours_ms), theirs = gbs(r.bytes, r.cudnn_ms);
    std::fprintf(f,
                 "    {\"op\": \"%s\", \"shape\": \"%s\", \"bytes\": %.0f, \"ours_ms\": %.6f, "
                 "\"ours_gbs\": %.3f, "
                 "\"ours_over_copy\": %.4f, \"cudnn_ms\": %.6f, \"cudnn_gbs\": %.3f, "
                 "\"ours_over_cudnn\": %.4f, "
                 "\"floor\": %s, \"meets_floor\": %s}%s\n",
                 r.op.c_str(), r.shape.c_str(), r.bytes, r.ours_ms, ours, ours / copy_gbs,
                 r.cudnn_ms, theirs, theirs > 0 ? ours / theirs : 0.0, r.floor ? "true" : "false",
                 !r.floor || ours >= kFloor * copy_gbs ? "true" : "false",
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "bench_elementwise: element-wise, bias, dropout and layout kernels vs copy bandwidth and "
      "cuDNN"};
  std::string json;
  bool quick = false;
  app.add_option("--json", json, "write the results to this JSON file");
  app.add_flag("--quick", quick, "the medium size only (256x64x32x32)");
  if (const auto status = cudp::bench::parse_command_line(app, "bench_elementwise", argc, argv)) {
    return *status;
  }
  if (!cudp::bench::usable_cuda_device("bench_elementwise")) return cudp::bench::kExitUsage;
  cudaStream_t stream = nullptr;
  try {
    CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const std::string device = cuda::device_name(0);
    std::printf("device 0: %s\n", device.c_str());
    if (!validate(stream)) {
      std::printf("validation failed: nothing timed\n");
      return 1;
    }
    const double copy_gbs = cudp::bench::measure_copy_bandwidth_gbs(stream);
    std::printf("device-to-device copy: %.1f GB/s (bytes read + written)\n\n", copy_gbs);

    Cudnn cudnn(stream);
    std::vector<Result> results;
    const auto run_all = [&](std::vector<Case> cases) {
      for (const Case& c : cases) {
        results.push_back(run(c, stream));
      }
    };
    run_all(cases_for(256, 64, 32, 32, false, stream, cudnn));  // CIFAR, batch 256: 16.8M floats
    if (!quick) {
      run_all(cases_for(64, 64, 224, 224, true, stream, cudnn));  // VGG's first layers
    }
    run_all({weight_case(512, 512, 3, 3, stream), weight_case(64, 3, 3, 3, stream)});

    std::vector<cudp::bench::Row> rows, vs_cudnn;
    bool floor_met = true;
    for (const Result& r : results) {
      const double ours = gbs(r.bytes, r.ours_ms);
      const bool below = r.floor && ours < kFloor * copy_gbs;
      floor_met &= !below;
      rows.push_back({r.op + (r.floor ? " [floor]" : "") + (below ? " BELOW FLOOR" : ""), r.shape,
                      ours, copy_gbs, "GB/s", "D2D copy"});
      if (r.cudnn_ms > 0) {
        vs_cudnn.push_back({r.op, r.shape, ours, gbs(r.bytes, r.cudnn_ms), "GB/s", "cuDNN"});
      }
    }
    std::printf("ours against the device-to-device copy (ratio = fraction of copy bandwidth):\n");
    cudp::bench::print_table(rows);
    std::printf("\nours against cuDNN where it has the op:\n");
    cudp::bench::print_table(vs_cudnn);
    std::printf("\nfloor (>= %.0f%% of copy for the [floor] rows): %s\n", 100 * kFloor,
                quick       ? "not checked (--quick)"
                : floor_met ? "met"
                            : "NOT met");
    if (!json.empty()) {
      write_json(json, device, copy_gbs, results);
    }
    cudaStreamDestroy(stream);
    return 0;
  } catch (const std::exception& e) {
    cudp::bench::print_error("bench_elementwise", e);
    return cudp::bench::kExitUsage;
  }
}
