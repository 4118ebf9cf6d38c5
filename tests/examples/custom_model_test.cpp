// Host tests of the custom-model example (examples/custom_model/seed_cnn.h): a module with two
// outputs (logits and features) and a hand-written backward.
//
//   - structure: PyTorch's state_dict names and shapes, two outputs of the right shapes, clone();
//   - forward against an independent double-precision reference of the PyTorch model (NCHW maths
//     on PyTorch-layout weights from state_dict(), flatten in (c, h, w) order);
//   - backward against central differences of that reference, with the gradient of either output,
//     of both, or with the features' gradient undefined (a zero);
//   - save and load through a safetensors file; a short CPU training run whose loss falls;
//   - the program (main.cpp) as a user runs it: a bad command line is refused before anything
//     runs (exit 2, the option and its range named), errors print without source locations,
//     --gpus none trains on the CPU, and --save is checked before training.
//
// Why the finite differences are taken on the double reference and not on the model's fp32 forward:
// the model is ReLU and max-pooling between convolutions, so a step large enough to drown fp32
// rounding (1/16) crosses kinks everywhere; in double a step of 1e-6 leaves a rounding error of
// about 1e-16 * sum|terms| / 1e-6 = 1e-10 of the gradient and crosses a kink only when a
// pre-activation or a pooling margin is within ~1e-6 of zero (then the quotient is off by at most
// h times the slope change, ~1e-6 again). The numeric gradient is thus exact to ~1e-9 relative.
// The analytic gradient is the model's fp32 backward: every layer's CPU reference accumulates in
// double and rounds once, so through the five layers each gradient carries a few roundings of
// 2^-24 ~ 6e-8 relative to the largest terms of its sums. We allow 1e-4 of the tensor's largest
// gradient plus 1e-4 relative: about 1000x that rounding, while any real error (a term missing, the
// features' gradient not added, a wrong flatten order) is of the order of the gradient itself.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "examples/custom_model/seed_cnn.h"
#include "layers/layer_testing.h"
#include "layers/temp_dir.h"

// The example's program, compiled in with its main() renamed: the example is a project of its own
// that CI builds against the installed package (.ci/run), so this build has no custom_model binary
// to start. The tests below call custom_model_main() as the shell would call main().
#define main custom_model_main
#include "examples/custom_model/main.cpp"
#undef main

namespace cudp {
namespace {

using seed::SeedCnn;
using seed::SeedCnnOptions;
using testing::random_tensor;
using testing::values;

// ---- a double-precision reference of the PyTorch model ------------------------------------------

using Vec = std::vector<double>;
using Params = std::map<std::string, Vec>;  // PyTorch names and layouts (conv weights OIHW)

std::vector<double> to_double(const Tensor& t) {
  const std::vector<float> v = values(t);
  return {v.begin(), v.end()};
}

// NHWC input [n, s, s, c] (cudp's layout, indexed as such), OIHW weights, padding 2.
Vec conv5x5(const Vec& x, int n, int s, int c, const Vec& w, const Vec& b, int o) {
  Vec y(static_cast<size_t>(n) * s * s * o);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < s; ++h)
      for (int v = 0; v < s; ++v)
        for (int k = 0; k < o; ++k) {
          double acc = b[k];
          for (int ch = 0; ch < c; ++ch)
            for (int r = 0; r < 5; ++r)
              for (int q = 0; q < 5; ++q) {
                const int hh = h + r - 2, vv = v + q - 2;
                if (hh < 0 || hh >= s || vv < 0 || vv >= s) continue;
                acc += w[((static_cast<size_t>(k) * c + ch) * 5 + r) * 5 + q] *
                       x[((static_cast<size_t>(i) * s + hh) * s + vv) * c + ch];
              }
          y[((static_cast<size_t>(i) * s + h) * s + v) * o + k] = acc;
        }
  return y;
}

// ReLU then 2x2 max pooling (floor): [n, s, s, c] -> [n, s/2, s/2, c].
Vec relu_pool(const Vec& x, int n, int s, int c) {
  const int p = s / 2;
  Vec y(static_cast<size_t>(n) * p * p * c);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < p; ++h)
      for (int v = 0; v < p; ++v)
        for (int ch = 0; ch < c; ++ch) {
          double m = 0;  // max(relu(.)) = relu(max(.))
          for (int r = 0; r < 2; ++r)
            for (int q = 0; q < 2; ++q)
              m = std::max(m,
                           x[((static_cast<size_t>(i) * s + 2 * h + r) * s + 2 * v + q) * c + ch]);
          y[((static_cast<size_t>(i) * p + h) * p + v) * c + ch] = m;
        }
  return y;
}

struct Outputs {
  Vec logits, features;
};

// The PyTorch model: conv1, conv2, x.view(n, -1) of the NCHW tensor, out.
Outputs reference_forward(const Params& p, const Vec& x, int n, int s, int c, int classes) {
  Vec a =
      relu_pool(conv5x5(x, n, s, c, p.at("conv1.0.weight"), p.at("conv1.0.bias"), 16), n, s, 16);
  a = relu_pool(conv5x5(a, n, s / 2, 16, p.at("conv2.0.weight"), p.at("conv2.0.bias"), 32), n,
                s / 2, 32);
  const int q = s / 4;
  const int f = 32 * q * q;
  Outputs out;
  out.features.resize(static_cast<size_t>(n) * f);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < q; ++h)
      for (int v = 0; v < q; ++v)
        for (int ch = 0; ch < 32; ++ch)  // PyTorch's feature index c*H*W + h*W + w
          out.features[static_cast<size_t>(i) * f + (ch * q + h) * q + v] =
              a[((static_cast<size_t>(i) * q + h) * q + v) * 32 + ch];
  const Vec& w = p.at("out.weight");
  const Vec& b = p.at("out.bias");
  out.logits.resize(static_cast<size_t>(n) * classes);
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < classes; ++k) {
      double acc = b[k];
      for (int j = 0; j < f; ++j)
        acc += w[static_cast<size_t>(k) * f + j] * out.features[static_cast<size_t>(i) * f + j];
      out.logits[static_cast<size_t>(i) * classes + k] = acc;
    }
  return out;
}

// A KRSC gradient ([out, kh, kw, in], cudp's Conv2d layout) in PyTorch's OIHW order.
std::vector<float> krsc_to_oihw(const std::vector<float>& g, const Shape& krsc) {
  const int64_t o = krsc[0], r = krsc[1], s = krsc[2], c = krsc[3];
  std::vector<float> out(g.size());
  for (int64_t a = 0; a < o; ++a)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < s; ++j)
        for (int64_t k = 0; k < c; ++k)
          out[((a * c + k) * r + i) * s + j] = g[((a * r + i) * s + j) * c + k];
  return out;
}

// A tiny model: two 8x8 images, 3 classes, 128 features. Parameters in [-0.3, 0.3), biases
// non-zero (the default init zeroes them).
constexpr int kN = 2, kSize = 8, kClasses = 3;

std::shared_ptr<SeedCnn> tiny_model() {
  auto m = std::make_shared<SeedCnn>(SeedCnnOptions{.n_classes = kClasses, .image_size = kSize});
  testing::randomize_parameters(*m, 11, -0.3f, 0.3f);
  return m;
}

// ---- structure ----------------------------------------------------------------------------------

TEST(CustomModelTest, StateDictHasThePyTorchNamesAndShapes) {
  SeedCnn m;
  std::map<std::string, Shape> shapes;
  for (const auto& [name, t] : m.state_dict()) shapes[name] = t.shape();
  const std::map<std::string, Shape> expected = {
      {"conv1.0.weight", {16, 1, 5, 5}},  {"conv1.0.bias", {16}},
      {"conv2.0.weight", {32, 16, 5, 5}}, {"conv2.0.bias", {32}},
      {"out.weight", {10, 1568}},         {"out.bias", {10}}};
  EXPECT_EQ(shapes, expected);
  EXPECT_EQ(m.num_parameters(), 16 * 25 + 16 + 32 * 16 * 25 + 32 + 1568 * 10 + 10);
}

TEST(CustomModelTest, ReturnsLogitsAndFeatures) {
  SeedCnn m;
  const TensorList out = m.forward_all({random_tensor({3, 28, 28, 1}, 1)});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].shape(), (Shape{3, 10}));
  EXPECT_EQ(out[1].shape(), (Shape{3, 1568}));
  // The one-tensor entry point refuses a module with two outputs, and says what to call instead.
  EXPECT_THROW_WITH(m.forward(random_tensor({1, 28, 28, 1}, 2)), "call forward_all()");
  EXPECT_THROW_WITH(m.backward_all({out[0]}), "SeedCnn has two outputs");
}

// The model calls its children through forward_child: a wrong input's error names the layer by
// its state_dict path (3 channels given to a model of grey images).
TEST(CustomModelTest, AWrongInputNamesTheLayer) {
  SeedCnn m;
  EXPECT_VALUE_ERROR(m.forward_all({random_tensor({2, 28, 28, 3}, 3)}),
                     "in layer conv1.0 (Conv2d) of a SeedCnn: Conv2d: expected");
}

TEST(CustomModelTest, CloneCopiesStructureAndValues) {
  auto m = tiny_model();
  std::shared_ptr<Module> copy = m->clone(Device::cpu());
  ASSERT_NE(dynamic_cast<SeedCnn*>(copy.get()), nullptr);
  const Tensor x = random_tensor({kN, kSize, kSize, 1}, 3);
  const TensorList a = m->forward_all({x}), b = copy->forward_all({x});
  EXPECT_EQ(values(a[0]), values(b[0]));
  EXPECT_EQ(values(a[1]), values(b[1]));
}

// ---- forward and backward against the reference -------------------------------------------------

TEST(CustomModelTest, ForwardMatchesTheDoubleReference) {
  auto m = tiny_model();
  const Tensor x = random_tensor({kN, kSize, kSize, 1}, 4);
  const TensorList out = m->forward_all({x});
  Params p;
  for (const auto& [name, t] : m->state_dict()) p[name] = to_double(t);
  const Outputs ref = reference_forward(p, to_double(x), kN, kSize, 1, kClasses);
  // Each output is a few fp32 roundings of sums whose terms are at most ~max|output|.
  EXPECT_ALL_CLOSE(values(out[0]), ref.logits, 1e-5, 1e-5 * testing::max_abs(values(out[0])));
  EXPECT_ALL_CLOSE(values(out[1]), ref.features, 1e-5, 1e-5 * testing::max_abs(values(out[1])));
}

// Which output gradients a case passes: both, the logits' only (features undefined), or the
// features' only (logits undefined).
struct GradCase {
  const char* name;
  bool logits, features;
};

void PrintTo(const GradCase& c, std::ostream* out) {
  *out << c.name;
}

class CustomModelGradientTest : public ::testing::TestWithParam<GradCase> {};

TEST_P(CustomModelGradientTest, BackwardMatchesFiniteDifferences) {
  const GradCase gc = GetParam();
  auto m = tiny_model();
  const Tensor x = random_tensor({kN, kSize, kSize, 1}, 5);
  const TensorList out = m->forward_all({x});
  const Tensor g0 = random_tensor(out[0].shape(), 6), g1 = random_tensor(out[1].shape(), 7);
  m->zero_grad();
  const Tensor dx = m->backward_all({gc.logits ? g0 : Tensor(), gc.features ? g1 : Tensor()})[0];
  ASSERT_TRUE(dx.defined());

  // L = <g0, logits> + <g1, features> (each term only when its gradient was passed), in double.
  Params p;
  for (const auto& [name, t] : m->state_dict()) p[name] = to_double(t);
  Vec xd = to_double(x);
  const Vec w0 = to_double(g0), w1 = to_double(g1);
  auto loss = [&] {
    const Outputs o = reference_forward(p, xd, kN, kSize, 1, kClasses);
    double l = 0;
    if (gc.logits)
      for (size_t i = 0; i < o.logits.size(); ++i) l += w0[i] * o.logits[i];
    if (gc.features)
      for (size_t i = 0; i < o.features.size(); ++i) l += w1[i] * o.features[i];
    return l;
  };
  // zero: the tensor does not reach L (out.* when only the features' gradient is passed), so its
  // gradient must be exactly zero.
  auto check = [&](const std::string& what, Vec& v, const std::vector<float>& analytic, bool zero) {
    ASSERT_EQ(analytic.size(), v.size()) << what;
    const double h = 1e-6;
    std::vector<double> numeric;
    std::vector<float> picked;
    for (size_t i : testing::sample_coords(v.size(), 60)) {
      const double saved = v[i];
      v[i] = saved + h;
      const double lp = loss();
      v[i] = saved - h;
      const double lm = loss();
      v[i] = saved;
      numeric.push_back((lp - lm) / (2 * h));
      picked.push_back(analytic[i]);
    }
    double scale = 0;
    for (double d : numeric) scale = std::max(scale, std::fabs(d));
    if (zero) {
      EXPECT_EQ(scale, 0) << what;
      EXPECT_EQ(testing::max_abs(analytic), 0) << what;
      return;
    }
    EXPECT_GT(scale, 0) << what << ": the gradient is zero at every sampled coordinate";
    EXPECT_TRUE(testing::all_close(picked, numeric, 1e-4, 1e-4 * scale)) << what;
  };
  check("input", xd, values(dx), false);
  for (const auto& [name, param] : m->named_parameters()) {
    std::vector<float> g = values(param->grad);
    if (param->grad.dim() == 4) g = krsc_to_oihw(g, param->grad.shape());  // Conv2d: KRSC
    check(name, p.at(name), g, !gc.logits && name.starts_with("out."));
  }
}

INSTANTIATE_TEST_SUITE_P(Outputs, CustomModelGradientTest,
                         ::testing::Values(GradCase{"Both", true, true},
                                           GradCase{"LogitsOnly", true, false},
                                           GradCase{"FeaturesOnly", false, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// An undefined gradient is a zero gradient: the same bits as passing zeros.
TEST(CustomModelTest, AnUnusedOutputCountsAsZero) {
  auto m = tiny_model();
  auto twin = std::static_pointer_cast<SeedCnn>(m->clone(Device::cpu()));
  const Tensor x = random_tensor({kN, kSize, kSize, 1}, 8);
  const TensorList out = m->forward_all({x});
  twin->forward_all({x});
  const Tensor g0 = random_tensor(out[0].shape(), 9);
  const Tensor dx = m->backward_all({g0, Tensor()})[0];
  const Tensor dx_zeros = twin->backward_all({g0, Tensor::zeros(out[1].shape())})[0];
  EXPECT_EQ(values(dx), values(dx_zeros));
  const auto a = m->named_parameters(), b = twin->named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(values(a[i].second->grad), values(b[i].second->grad)) << a[i].first;
  }
  // Neither output used: nothing runs, no gradient accumulates, the input gradient is undefined.
  m->zero_grad();
  m->forward_all({x});
  EXPECT_FALSE(m->backward_all({Tensor(), Tensor()})[0].defined());
  for (const auto& [name, p] : m->named_parameters()) {
    for (float v : values(p->grad)) ASSERT_EQ(v, 0.f) << name;
  }
}

// Under the bf16 policy the features are bf16 (Flatten keeps the activations' dtype), so their
// gradient is too: a zero one adds nothing (the example's add_into sums in fp32 and rounds once,
// exact here), and an f32 one is refused with a message that says what to give.
TEST(CustomModelTest, UnderBf16TheFeaturesAndTheirGradientAreBf16) {
  auto m = tiny_model();
  m->set_precision(Precision::bf16);
  auto twin = std::static_pointer_cast<SeedCnn>(m->clone(Device::cpu()));
  const Tensor x = random_tensor({kN, kSize, kSize, 1}, 18);
  const TensorList out = m->forward_all({x});
  twin->forward_all({x});
  ASSERT_EQ(out[1].dtype(), DType::bf16);
  const Tensor g0 = random_tensor(out[0].shape(), 19);
  const Tensor zeros = convert(Tensor::zeros(out[1].shape()), DType::bf16);
  const Tensor dx = m->backward_all({g0, Tensor()})[0];
  const Tensor dx_zeros = twin->backward_all({g0, zeros})[0];
  EXPECT_EQ(values(dx), values(dx_zeros));
  m->forward_all({x});
  EXPECT_THROW_WITH(m->backward_all({g0, Tensor::zeros(out[1].shape())}),
                    "but the features are bf16; give it in their dtype");
}

// ---- saving, loading, training ------------------------------------------------------------------

TEST(CustomModelTest, WeightsRoundTripThroughSafetensors) {
  testing::TempDir dir;
  auto m = tiny_model();
  save_weights(dir.file("cnn.safetensors"), *m);
  SeedCnn loaded(init::skip_init, SeedCnnOptions{.n_classes = kClasses, .image_size = kSize});
  load_weights(dir.file("cnn.safetensors"), loaded);
  const Tensor x = random_tensor({kN, kSize, kSize, 1}, 10);
  EXPECT_EQ(values(m->forward_all({x})[0]), values(loaded.forward_all({x})[0]));
}

// The example's training loop on the CPU, on 16x16 synthetic images (small, to keep it quick): the
// loss on a fixed batch falls well below its starting value.
TEST(CustomModelTest, ShortCpuTrainingLowersTheLoss) {
  data::SyntheticOptions so;
  so.n_train = 128;
  so.h = so.w = 16;
  const data::Dataset set = data::make_synthetic(so, true);
  data::LoaderOptions lo;
  lo.batch_size = 32;
  lo.shuffle = false;
  lo.workers = 1;
  lo.normalization = data::compute_normalization(set);
  data::Loader loader(set, lo);
  std::vector<std::pair<Tensor, Tensor>> batches;
  loader.start_epoch(0);
  for (data::Batch b; loader.next(b);) batches.emplace_back(b.images.clone(), b.labels.clone());

  SeedCnn m(SeedCnnOptions{.image_size = 16, .seed = 3});
  SGD opt(m.parameters(), {.lr = 0.05, .momentum = 0.9});
  CrossEntropyLoss criterion;
  auto loss_on_first = [&] {
    criterion.forward(m.forward_all({batches[0].first})[0], batches[0].second);
    return criterion.item();
  };
  const float before = loss_on_first();
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (const auto& [images, labels] : batches) {
      criterion.forward(m.forward_all({images})[0], labels);
      opt.zero_grad();
      m.backward_all({criterion.backward(), Tensor()});
      opt.step();
    }
  }
  const float after = loss_on_first();
  EXPECT_LT(after, 0.5f * before) << "before " << before << ", after " << after;
}

// ---- the program: command line, errors, --save ------------------------------------------------

struct ProgramRun {
  int code = -1;
  std::string out, err;  // stdout, stderr
};

// custom_model `args` (split at spaces), its stdout and stderr captured.
ProgramRun run_program(const std::string& args) {
  std::vector<std::string> words = {"custom_model"};
  std::stringstream ss(args);
  for (std::string w; ss >> w;) words.push_back(w);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  ProgramRun r;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  r.code = custom_model_main(static_cast<int>(words.size()), argv.data());
  r.out = ::testing::internal::GetCapturedStdout();
  r.err = ::testing::internal::GetCapturedStderr();
  return r;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A quick run on the CPU: 64 synthetic images, one step.
const std::string kQuick = "--data synthetic --synthetic-size 64 --batch-size 32 --steps 1 ";

// Every value is parsed whole and checked against its range before anything runs: exit 2, the
// option, the allowed values and the given text named, and nothing printed on stdout (no device,
// data or model was touched).
TEST(CustomModelProgramTest, RefusesABadCommandLineBeforeRunning) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--lr -1", "--lr: must be a number greater than 0 (got \"-1\")"},
      {"--lr nan", "--lr: must be a number greater than 0 (got \"nan\")"},
      {"--lr inf", "--lr: must be a number greater than 0 (got \"inf\")"},
      {"--lr 0", "--lr: must be a number greater than 0 (got \"0\")"},
      {"--lr 0.1x", "--lr: must be a number greater than 0 (got \"0.1x\")"},
      {"--momentum 5", "--momentum: must be a number from 0 to 0.999 (got \"5\")"},
      {"--momentum -0.1", "--momentum: must be a number from 0 to 0.999 (got \"-0.1\")"},
      {"--batch-size 10abc",
       "--batch-size: must be a whole number from 1 to 1048576 (got \"10abc\")"},
      {"--batch-size 0", "--batch-size: must be a whole number from 1 to 1048576 (got \"0\")"},
      {"--batch-size +8", "--batch-size: must be a whole number from 1 to 1048576 (got \"+8\")"},
      {"--epochs 0", "--epochs: must be a whole number from 1 to 1000000 (got \"0\")"},
      {"--epochs 2.5", "--epochs: must be a whole number from 1 to 1000000 (got \"2.5\")"},
      {"--steps -1", "--steps: must be a whole number from 0 to 2147483647 (got \"-1\")"},
      {"--synthetic-size 0",
       "--synthetic-size: must be a whole number from 1 to 1048576 (got \"0\")"},
      {"--seed -1", "--seed: must be a whole number from 0 to 18446744073709551615 (got \"-1\")"},
      {"--seed 18446744073709551616",
       "--seed: must be a whole number from 0 to 18446744073709551615"},
      {"--seed 1e3", "--seed: must be a whole number from 0 to 18446744073709551615"},
      {"--gpus 0,x", "--gpus: \"x\" is not a device id (a whole number >= 0, or none)"},
      {"--gpus 0,,1", "--gpus: \"\" is not a device id"},
      {"--gpus -1", "--gpus: \"-1\" is not a device id"},
      {"--precision fp16", "--precision: must be one of fp32, bf16, tf32 (got \"fp16\")"},
      {"--data cifar10", "--data: must be one of fashion-mnist, synthetic (got \"cifar10\")"},
      {"--lr", "--lr needs a value"},
      {"--learning-rate 0.1", "unknown option --learning-rate"},
  };
  for (const auto& [args, message] : cases) {
    // The quick options first: were the bad value taken, the run would be short.
    const ProgramRun r = run_program(kQuick + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out << r.err;
    EXPECT_TRUE(has(r.err, "custom_model: " + message)) << args << "\n" << r.err;
    EXPECT_TRUE(has(r.err, "custom_model --help")) << args << "\n" << r.err;
    EXPECT_EQ(r.out, "") << args;
  }
}

// --name=value is --name value.
TEST(CustomModelProgramTest, TakesNameEqualsValue) {
  const ProgramRun r = run_program(
      "--data=synthetic --synthetic-size=64 --batch-size=32 "
      "--steps=1 --lr=-1");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.err, "--lr: must be a number greater than 0 (got \"-1\")")) << r.err;
}

// A library error prints its message alone (cudp::Error::message()), not what() with cudp's file
// and line; CUDP_VERBOSE=1 adds them. An invalid GPU id is a usage error, as in cudp-vgg.
TEST(CustomModelProgramTest, ErrorsPrintTheMessageWithoutTheSourceLocation) {
  testing::TempDir dir;
  const std::string missing = dir.file("no-such-folder");
  ProgramRun r = run_program("--data-dir " + missing);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_TRUE(has(r.err, "custom_model: fashion-mnist file not found: " + missing)) << r.err;
  EXPECT_FALSE(has(r.err, ".cpp:")) << r.err;

  ::setenv("CUDP_VERBOSE", "1", 1);
  r = run_program("--data-dir " + missing);
  ::unsetenv("CUDP_VERBOSE");
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(has(r.err, ".cpp:")) << r.err;

  r = run_program(kQuick + "--gpus 4095");  // no machine has as many
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_TRUE(has(r.err, "custom_model: --gpus: invalid device id 4095")) << r.err;
  EXPECT_FALSE(has(r.err, ".cpp:")) << r.err;
}

// --gpus none: the CPU, GPUs or not (cudp-vgg's meaning).
TEST(CustomModelProgramTest, GpusNoneTrainsOnTheCpu) {
  const ProgramRun r = run_program(kQuick + "--gpus none");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(has(r.out, "--gpus none: the model trains on the CPU")) << r.out;
  // Not wrapped: a DataParallel given no device list would take every visible GPU (the GPU
  // machine's run failed so: its parameters on the CPU, its device_ids[0] cuda:0).
  EXPECT_FALSE(has(r.out, "DataParallel over")) << r.out;
  EXPECT_TRUE(has(r.out, "epoch 1: 1 steps")) << r.out;
}

// --save is checked before anything trains: a folder, a missing folder or one that cannot be
// written ends the run at once (exit 1), with no file left behind; a good path gets the model and
// the optimizer state.
TEST(CustomModelProgramTest, SavePathIsCheckedBeforeTraining) {
  testing::TempDir dir;
  std::filesystem::create_directory(dir.file("x"));
  ProgramRun r = run_program(kQuick + "--save " + dir.file("x"));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_TRUE(has(r.err, "custom_model: --save " + dir.file("x") +
                             " is a folder; give a file name (e.g. " + dir.file("x") +
                             "/cnn.safetensors)"))
      << r.err;
  EXPECT_FALSE(has(r.out, "epoch 1")) << r.out;
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"x"});

  const std::string nowhere = dir.file("missing/cnn.safetensors");
  r = run_program(kQuick + "--save " + nowhere);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_TRUE(has(r.err, "custom_model: --save " + nowhere + ": the folder " + dir.file("missing") +
                             " does not exist"))
      << r.err;
  EXPECT_FALSE(has(r.out, "epoch 1")) << r.out;

  // The optimizer state's file is checked too: a folder in its place.
  const std::string model = dir.file("m.safetensors");
  std::filesystem::create_directory(optimizer_state_path(model));
  r = run_program(kQuick + "--save " + model);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_TRUE(has(r.err, "--save " + optimizer_state_path(model) + " is a folder")) << r.err;
  EXPECT_FALSE(has(r.out, "epoch 1")) << r.out;
  std::filesystem::remove(optimizer_state_path(model));

  if (::geteuid() != 0) {  // root writes anywhere
    std::filesystem::create_directory(dir.file("ro"));
    ::chmod(dir.file("ro").c_str(), 0555);
    r = run_program(kQuick + "--save " + dir.file("ro/cnn.safetensors"));
    ::chmod(dir.file("ro").c_str(), 0755);
    EXPECT_EQ(r.code, 1) << r.out << r.err;
    EXPECT_TRUE(has(r.err, "cannot be written")) << r.err;
    EXPECT_FALSE(has(r.out, "epoch 1")) << r.out;
  }

  r = run_program(kQuick + "--save " + model);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(std::filesystem::is_regular_file(model));
  EXPECT_TRUE(std::filesystem::is_regular_file(optimizer_state_path(model)));
  for (const std::string& name : dir.entries()) {
    EXPECT_FALSE(has(name, "probe")) << "the writability probe is left: " << name;
  }
}

}  // namespace
}  // namespace cudp
