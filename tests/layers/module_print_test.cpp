// Module::repr (print(model)) on the CPU: every layer's line against the text PyTorch prints for
// the same layer, nesting and indentation as PyTorch's Module.__repr__, Python's float text, and
// VGG-16-BN against torchvision's print(torchvision.models.vgg16_bn()). The expected strings are
// PyTorch's output written out by hand.
#include <gtest/gtest.h>

#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/pooling.h"
#include "layers/sequential.h"
#include "layers/sync_batchnorm.h"
#include "layers/vgg.h"

namespace cudp {
namespace {

// Every layer with its options away from the defaults where it has some, and at them.
std::shared_ptr<Sequential> small_model() {
  auto net = std::make_shared<Sequential>();
  net->add(std::make_shared<Conv2d>(1, 16, 5, 1, 2));
  net->add(std::make_shared<ReLU>());
  net->add(std::make_shared<MaxPool2d>(2));
  net->add(std::make_shared<Conv2d>(16, 32, 3, 2, 0, /*bias=*/false));
  net->add(std::make_shared<BatchNorm2d>(32, 1e-3f, 0.01f));
  net->add(std::make_shared<ReLU>(/*inplace=*/true));
  net->add(std::make_shared<MaxPool2d>(3, 2, 1));
  net->add(std::make_shared<AdaptiveAvgPool2d>(1));
  net->add(std::make_shared<Flatten>());
  net->add(std::make_shared<Dropout>(0.25f));
  net->add(std::make_shared<Linear>(32, 10, /*bias=*/false));
  return net;
}

// print(nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.ReLU(), nn.MaxPool2d(2),
//     nn.Conv2d(16, 32, 3, 2, 0, bias=False), nn.BatchNorm2d(32, 1e-3, 0.01), nn.ReLU(True),
//     nn.MaxPool2d(3, 2, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.25),
//     nn.Linear(32, 10, bias=False)))
constexpr const char* kSmallModel = R"(Sequential(
  (0): Conv2d(1, 16, kernel_size=(5, 5), stride=(1, 1), padding=(2, 2))
  (1): ReLU()
  (2): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
  (3): Conv2d(16, 32, kernel_size=(3, 3), stride=(2, 2), bias=False)
  (4): BatchNorm2d(32, eps=0.001, momentum=0.01, affine=True, track_running_stats=True)
  (5): ReLU(inplace=True)
  (6): MaxPool2d(kernel_size=3, stride=2, padding=1, dilation=1, ceil_mode=False)
  (7): AdaptiveAvgPool2d(output_size=1)
  (8): Flatten(start_dim=1, end_dim=-1)
  (9): Dropout(p=0.25, inplace=False)
  (10): Linear(in_features=32, out_features=10, bias=False)
))";

TEST(ModulePrintTest, SmallModelPrintsAsPyTorch) {
  auto net = small_model();
  EXPECT_EQ(net->repr(), kSmallModel);
  std::ostringstream out;
  out << *net;
  EXPECT_EQ(out.str(), kSmallModel);
  // A clone is the same model, and prints the same (AdaptiveAvgPool2d's one size included).
  EXPECT_EQ(net->clone(Device::cpu())->repr(), kSmallModel);
}

TEST(ModulePrintTest, LeavesPrintOnOneLine) {
  EXPECT_EQ(Conv2d(3, 64, 3, 1, 1).repr(),
            "Conv2d(3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))");
  EXPECT_EQ(Linear(init::skip_init, 25088, 4096).repr(),
            "Linear(in_features=25088, out_features=4096, bias=True)");
  EXPECT_EQ(BatchNorm2d(64).repr(),
            "BatchNorm2d(64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)");
  EXPECT_EQ(SyncBatchNorm2d(8).repr(),
            "SyncBatchNorm(8, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)");
  EXPECT_EQ(Dropout().repr(), "Dropout(p=0.5, inplace=False)");
  EXPECT_EQ(AdaptiveAvgPool2d(7, 7).repr(), "AdaptiveAvgPool2d(output_size=(7, 7))");
  EXPECT_EQ(AdaptiveAvgPool2d(2, 3).repr(), "AdaptiveAvgPool2d(output_size=(2, 3))");
  EXPECT_EQ(Sequential().repr(), "Sequential()");
}

// A module of one's own: the extra_repr lines come first, then the children (PyTorch's order), and
// a child's lines after its first are indented under it, at every depth.
class Block : public Module {
 public:
  Block(std::string extra, std::shared_ptr<Module> child) : extra_(std::move(extra)) {
    if (child) register_module("inner", std::move(child));
  }
  std::string type_name() const override { return "Block"; }
  std::string extra_repr() const override { return extra_; }

 protected:
  std::shared_ptr<Module> make_empty_copy() const override { return nullptr; }

 private:
  std::string extra_;
};

TEST(ModulePrintTest, NestingAndExtraLinesFollowPyTorch) {
  auto inner = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Linear>(4, 3), std::make_shared<Sequential>()});
  Sequential outer({inner, std::make_shared<ReLU>()});
  EXPECT_EQ(outer.repr(), R"(Sequential(
  (0): Sequential(
    (0): Linear(in_features=4, out_features=3, bias=True)
    (1): Sequential()
  )
  (1): ReLU()
))");
  EXPECT_EQ(Block("width=3", nullptr).repr(), "Block(width=3)");
  EXPECT_EQ(Block("", nullptr).repr(), "Block()");
  EXPECT_EQ(Block("width=3", std::make_shared<ReLU>()).repr(), R"(Block(
  width=3
  (inner): ReLU()
))");
  EXPECT_EQ(Block("width=3\ndepth=2", nullptr).repr(), R"(Block(
  width=3
  depth=2
))");
  auto block = std::make_shared<Block>("width=3\ndepth=2", std::make_shared<ReLU>());
  EXPECT_EQ(Sequential({block}).repr(), R"(Sequential(
  (0): Block(
    width=3
    depth=2
    (inner): ReLU()
  )
))");
}

// py_float is protected (for extra_repr): reached through a derived class.
struct PyText : Module {
  using Module::py_bool;
  using Module::py_float;
};

// Python's repr(float(x)) of the value written in the source (the float's shortest digits).
TEST(ModulePrintTest, FloatsPrintAsPython) {
  EXPECT_EQ(PyText::py_float(1e-5f), "1e-05");
  EXPECT_EQ(PyText::py_float(3e-5f), "3e-05");
  EXPECT_EQ(PyText::py_float(1.5e-7f), "1.5e-07");
  EXPECT_EQ(PyText::py_float(1e-4f), "0.0001");
  EXPECT_EQ(PyText::py_float(0.001f), "0.001");
  EXPECT_EQ(PyText::py_float(0.1f), "0.1");
  EXPECT_EQ(PyText::py_float(0.3f), "0.3");
  EXPECT_EQ(PyText::py_float(0.5f), "0.5");
  EXPECT_EQ(PyText::py_float(0.f), "0.0");
  EXPECT_EQ(PyText::py_float(-0.f), "-0.0");
  EXPECT_EQ(PyText::py_float(1.f), "1.0");
  EXPECT_EQ(PyText::py_float(-2.5f), "-2.5");
  EXPECT_EQ(PyText::py_float(123.25f), "123.25");
  EXPECT_EQ(PyText::py_float(100.f), "100.0");
  EXPECT_EQ(PyText::py_float(1e15f), "1000000000000000.0");
  EXPECT_EQ(PyText::py_float(1e16f), "1e+16");
  EXPECT_EQ(PyText::py_float(1e20f), "1e+20");
  EXPECT_EQ(PyText::py_float(-1e-10f), "-1e-10");
  EXPECT_EQ(PyText::py_float(std::numeric_limits<float>::infinity()), "inf");
  EXPECT_EQ(PyText::py_float(-std::numeric_limits<float>::infinity()), "-inf");
  EXPECT_EQ(PyText::py_float(std::numeric_limits<float>::quiet_NaN()), "nan");
  EXPECT_STREQ(PyText::py_bool(true), "True");
  EXPECT_STREQ(PyText::py_bool(false), "False");
}

// print(torchvision.models.vgg16_bn()), with one line more: cudp's VGG has a Flatten module where
// torchvision calls torch.flatten in its forward (layers/vgg.h).
constexpr const char* kVgg16Bn = R"(VGG(
  (features): Sequential(
    (0): Conv2d(3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (1): BatchNorm2d(64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (2): ReLU(inplace=True)
    (3): Conv2d(64, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (4): BatchNorm2d(64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (5): ReLU(inplace=True)
    (6): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
    (7): Conv2d(64, 128, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (8): BatchNorm2d(128, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (9): ReLU(inplace=True)
    (10): Conv2d(128, 128, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (11): BatchNorm2d(128, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (12): ReLU(inplace=True)
    (13): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
    (14): Conv2d(128, 256, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (15): BatchNorm2d(256, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (16): ReLU(inplace=True)
    (17): Conv2d(256, 256, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (18): BatchNorm2d(256, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (19): ReLU(inplace=True)
    (20): Conv2d(256, 256, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (21): BatchNorm2d(256, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (22): ReLU(inplace=True)
    (23): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
    (24): Conv2d(256, 512, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (25): BatchNorm2d(512, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (26): ReLU(inplace=True)
    (27): Conv2d(512, 512, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (28): BatchNorm2d(512, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (29): ReLU(inplace=True)
    (30): Conv2d(512, 512, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (31): BatchNorm2d(512, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (32): ReLU(inplace=True)
    (33): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
    (34): Conv2d(512, 512, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (35): BatchNorm2d(512, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (36): ReLU(inplace=True)
    (37): Conv2d(512, 512, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (38): BatchNorm2d(512, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (39): ReLU(inplace=True)
    (40): Conv2d(512, 512, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (41): BatchNorm2d(512, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
    (42): ReLU(inplace=True)
    (43): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
  )
  (avgpool): AdaptiveAvgPool2d(output_size=(7, 7))
  (flatten): Flatten(start_dim=1, end_dim=-1)
  (classifier): Sequential(
    (0): Linear(in_features=25088, out_features=4096, bias=True)
    (1): ReLU(inplace=True)
    (2): Dropout(p=0.5, inplace=False)
    (3): Linear(in_features=4096, out_features=4096, bias=True)
    (4): ReLU(inplace=True)
    (5): Dropout(p=0.5, inplace=False)
    (6): Linear(in_features=4096, out_features=1000, bias=True)
  )
))";

// Built without initialisation: the text depends on the structure alone.
TEST(ModulePrintTest, Vgg16BnPrintsAsTorchvision) {
  const Vgg net(init::skip_init, 'D', {.batch_norm = true});
  EXPECT_EQ(net.repr(), kVgg16Bn);
}

// The compact head (no avgpool, 512-wide classifier) and the SyncBatchNorm conversion.
TEST(ModulePrintTest, CompactVggWithSyncBatchNorm) {
  auto net = convert_sync_batchnorm(
      vgg11({.in_channels = 1, .num_classes = 10, .batch_norm = true, .head = VggHead::Compact}));
  const std::string text = net->repr();
  EXPECT_EQ(text.substr(0, text.find("    (2)")), R"(VGG(
  (features): Sequential(
    (0): Conv2d(1, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
    (1): SyncBatchNorm(64, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
)");
  EXPECT_NE(text.find(R"(
  )
  (flatten): Flatten(start_dim=1, end_dim=-1)
  (classifier): Sequential(
    (0): Linear(in_features=512, out_features=512, bias=True)
)"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("avgpool"), std::string::npos) << text;
}

}  // namespace
}  // namespace cudp
