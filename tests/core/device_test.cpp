// Host tests of the device layer: the CUDA_VISIBLE_DEVICES mapping, the imbalance warning and the
// error texts. Pure functions, so they run without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/tensor.h"

namespace cudp::cuda {
namespace {

TEST(VisibleDevices, UnsetMeansEveryGpuUnderItsOwnNumber) {
  const VisibleDevices v = parse_visible_devices(nullptr);
  EXPECT_FALSE(v.set);
  EXPECT_EQ(physical_id(3, v), "3");
}

TEST(VisibleDevices, ZeroFourIsSeenAsIdsZeroAndOne) {
  const VisibleDevices v = parse_visible_devices("0,4");
  ASSERT_TRUE(v.set);
  ASSERT_EQ(v.entries, (std::vector<std::string>{"0", "4"}));
  EXPECT_EQ(physical_id(0, v), "0");
  EXPECT_EQ(physical_id(1, v), "4");
  EXPECT_EQ(physical_id(2, v), "?");
}

TEST(VisibleDevices, OneAloneIsIdZero) {
  const VisibleDevices v = parse_visible_devices("1");
  EXPECT_EQ(v.entries, (std::vector<std::string>{"1"}));
  EXPECT_EQ(physical_id(0, v), "1");
}

TEST(VisibleDevices, ParsingStopsAtTheFirstInvalidOrRepeatedEntry) {
  EXPECT_EQ(parse_visible_devices("2,x,3").entries, (std::vector<std::string>{"2"}));
  EXPECT_EQ(parse_visible_devices("1,1,2").entries, (std::vector<std::string>{"1"}));
  EXPECT_EQ(parse_visible_devices("-1,0").entries.size(), 0u);
  EXPECT_EQ(parse_visible_devices("").entries.size(), 0u);
  EXPECT_EQ(parse_visible_devices(" 3 , 04").entries, (std::vector<std::string>{"3", "4"}));
}

TEST(VisibleDevices, UuidsAreKept) {
  const VisibleDevices v = parse_visible_devices("GPU-8f2a,MIG-1b");
  EXPECT_EQ(v.entries, (std::vector<std::string>{"GPU-8f2a", "MIG-1b"}));
}

DeviceProperties props(int index, size_t memory, int sms) {
  DeviceProperties p;
  p.index = index;
  p.total_memory = memory;
  p.multiprocessors = sms;
  return p;
}

TEST(Imbalance, BalancedGpusGiveNoWarning) {
  EXPECT_FALSE(imbalance_warning({props(0, 140, 132), props(1, 140, 132)}));
  EXPECT_FALSE(imbalance_warning({props(0, 140, 132)}));
  EXPECT_FALSE(imbalance_warning({props(0, 100, 100), props(1, 76, 76)}));
}

TEST(Imbalance, LessThanThreeQuartersOfMemoryOrCoresWarnsNamingBoth) {
  const auto memory = imbalance_warning({props(0, 80, 132), props(1, 140, 132)});
  ASSERT_TRUE(memory);
  EXPECT_NE(memory->find("There is an imbalance between your GPUs"), std::string::npos);
  EXPECT_NE(memory->find("exclude GPU 0"), std::string::npos) << *memory;
  EXPECT_NE(memory->find("of GPU 1"), std::string::npos) << *memory;
  const auto cores = imbalance_warning({props(0, 140, 132), props(1, 140, 66)});
  ASSERT_TRUE(cores);
  EXPECT_NE(cores->find("exclude GPU 1"), std::string::npos) << *cores;
}

TEST(DeviceIds, InvalidIdNamesTheRangeAndTheVisibleSet) {
  const int count = device_count();
  try {
    check_device(count + 3);
    FAIL() << "no exception";
  } catch (const ValueError& e) {
    const std::string msg = e.message();
    EXPECT_NE(msg.find("invalid device id " + std::to_string(count + 3)), std::string::npos) << msg;
    EXPECT_NE(msg.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << msg;
    if (count > 0) {
      EXPECT_NE(msg.find("valid ids are 0.." + std::to_string(count - 1)), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("no CUDA device is visible"), std::string::npos) << msg;
    }
  }
  EXPECT_THROW(check_device(-1), ValueError);
  EXPECT_THROW(set_device(count), ValueError);
}

// Without a usable GPU, every call that needs one says so in the same words (the CUDA runtime's
// own error, without a driver, reads as if the driver were too old); with one, the calls work.
TEST(DeviceIds, CallsThatNeedAGpuSayThereIsNoneInTheSameWords) {
  const auto expect_no_device = [](const auto& call, const std::string& who) {
    try {
      call();
      ADD_FAILURE() << who << ": no exception";
    } catch (const ValueError& e) {
      EXPECT_NE(e.message().find(who + ": no CUDA device is visible (CUDA_VISIBLE_DEVICES"),
                std::string::npos)
          << e.message();
    }
  };
  const Tensor host = Tensor::zeros({4});
  if (device_count() > 0) {
    EXPECT_GE(current_device(), 0);
    EXPECT_LT(current_device(), device_count());
    EXPECT_NO_THROW(require_available("a test"));
    EXPECT_TRUE(host.pin_memory().is_pinned());
    EXPECT_TRUE(host.cuda().is_cuda());
    return;
  }
  expect_no_device([] { current_device(); }, "cuda::current_device");
  expect_no_device([] { require_available("a test"); }, "a test");
  expect_no_device([&] { host.pin_memory(); }, "pinned host memory (pin_memory)");
  expect_no_device([&] { host.cuda(); }, "cuda::current_device");
  expect_no_device([&] { host.cuda(0); }, "invalid device id 0");
}

// Why a machine shows no GPU, from what CUDA reported (cudaGetDeviceCount's status and count, the
// driver's and the runtime's versions): only a broken set-up gets a reason, so that a program that
// would quietly fall back to the CPU reports it instead.
TEST(UnavailableReason, NothingWhereThereAreGpusNoDriverOrGpusHiddenOnPurpose) {
  const auto reason = [](int status, int count, int driver, const char* visible) {
    return cudp::detail::cuda_unavailable_reason(status, count, driver, 13000,
                                                 parse_visible_devices(visible));
  };
  EXPECT_EQ(reason(cudaSuccess, 2, 13000, nullptr), "");
  // No NVIDIA driver at all (a machine without GPUs): CUDA says its driver is insufficient.
  EXPECT_EQ(reason(cudaErrorInsufficientDriver, 0, 0, nullptr), "");
  EXPECT_EQ(reason(cudaErrorNoDevice, 0, 13000, ""), "");
  EXPECT_EQ(reason(cudaErrorNoDevice, 0, 13000, " -1"), "");
  EXPECT_EQ(reason(cudaErrorNoDevice, 0, 13000, "NoDevFiles"), "");
  // A driver and no GPU (a CPU host with the driver's libraries installed).
  EXPECT_EQ(reason(cudaErrorNoDevice, 0, 13000, nullptr), "");
}

TEST(UnavailableReason, AnOldDriverAMaskThatNamesNoGpuAndOtherErrorsSayWhatToDo) {
  const auto reason = [](int status, int count, int driver, const char* visible) {
    return cudp::detail::cuda_unavailable_reason(status, count, driver, 13000,
                                                 parse_visible_devices(visible));
  };
  EXPECT_EQ(reason(cudaErrorInsufficientDriver, 0, 12040, nullptr),
            "the NVIDIA driver supports CUDA 12.4 and cudp needs 13.0: update the driver");
  const std::string mask = reason(cudaErrorNoDevice, 0, 13000, "GPU-xyz");
  EXPECT_NE(mask.find("CUDA_VISIBLE_DEVICES=\"GPU-xyz\" leaves no GPU visible"), std::string::npos)
      << mask;
  EXPECT_NE(mask.find("nvidia-smi -L"), std::string::npos) << mask;
  // Whatever CUDA answers for a mask of ids that match nothing, the mask is what is named.
  EXPECT_NE(reason(cudaErrorInvalidDevice, 0, 13000, "7").find("CUDA_VISIBLE_DEVICES=\"7\""),
            std::string::npos);
  const std::string other = reason(cudaErrorSystemDriverMismatch, 0, 13000, nullptr);
  EXPECT_NE(other.find("cudaErrorSystemDriverMismatch"), std::string::npos) << other;
  EXPECT_NE(other.find("nvidia-smi"), std::string::npos) << other;
}

TEST(DeviceType, PrintsLikePyTorch) {
  EXPECT_EQ(Device::cpu().str(), "cpu");
  EXPECT_EQ(Device::cuda(1).str(), "cuda:1");
  EXPECT_EQ(Device::cuda(1), Device::cuda(1));
  EXPECT_NE(Device::cuda(0), Device::cpu());
}

}  // namespace
}  // namespace cudp::cuda
