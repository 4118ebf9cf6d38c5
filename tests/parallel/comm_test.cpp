// Host tests of the device-id checks shared by Communicator, replicate and DataParallel: their
// texts for an empty list, a repeated id and an id outside the visible devices, with or without a
// GPU.
#include <gtest/gtest.h>

#include "engine/core/device.h"
#include "engine/parallel/comm.h"

namespace cudp::parallel {
namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no exception)";
}

TEST(DeviceIds, EmptyListIsAnError) {
  EXPECT_THROW(check_device_ids({}, "DataParallel"), ValueError);
  EXPECT_EQ(error_of([] { check_device_ids({}, "DataParallel"); }),
            "DataParallel: device_ids is empty; give at least one CUDA device id");
}

TEST(DeviceIds, RepeatedIdIsAnErrorEvenWithoutAGpu) {
  EXPECT_EQ(error_of([] {
              check_device_ids({0, 1, 0}, "DataParallel");
            }),
            "DataParallel: device_ids has device 0 twice (at index 0 and 2); each device holds one "
            "replica");
  EXPECT_EQ(error_of([] {
              check_device_ids({3, 3}, "Communicator");
            }),
            "Communicator: device_ids has device 3 twice (at index 0 and 1); each device holds one "
            "replica");
}

TEST(DeviceIds, IdOutsideTheVisibleDevicesNamesTheRange) {
  const int count = cuda::device_count();
  const std::string text = error_of([&] { check_device_ids({0, count + 5}, "DataParallel"); });
  if (count == 0) {
    // Without a GPU the first id already fails.
    EXPECT_EQ(text.rfind(
                  "DataParallel: device_ids[0]: invalid device id 0: no CUDA device is visible", 0),
              0u)
        << text;
  } else {
    EXPECT_EQ(text.rfind(detail::str("DataParallel: device_ids[1]: invalid device id ", count + 5,
                                     ": valid ids are 0..", count - 1),
                         0),
              0u)
        << text;
  }
  EXPECT_THROW(check_device_ids({-1}, "DataParallel"), ValueError);
  EXPECT_NE(error_of([] { check_device_ids({-1}, "DataParallel"); }).find("invalid device id -1"),
            std::string::npos);
}

TEST(DeviceIds, CommunicatorChecksItsIdsFirst) {
  EXPECT_EQ(error_of([] { Communicator comm(std::vector<int>{}); }),
            "Communicator: device_ids is empty; give at least one CUDA device id");
  EXPECT_EQ(error_of([] {
              Communicator comm(std::vector<int>{1, 1});
            }),
            "Communicator: device_ids has device 1 twice (at index 0 and 1); each device holds one "
            "replica");
}

TEST(ReduceOps, HaveNames) {
  EXPECT_STREQ(reduce_op_name(ReduceOp::Sum), "sum");
  EXPECT_STREQ(reduce_op_name(ReduceOp::Average), "average");
  EXPECT_STREQ(reduce_op_name(ReduceOp::Max), "max");
  EXPECT_STREQ(reduce_op_name(ReduceOp::Min), "min");
  EXPECT_STREQ(reduce_op_name(ReduceOp::Product), "product");
}

}  // namespace
}  // namespace cudp::parallel
