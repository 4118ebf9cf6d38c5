// Host tests of the worker threads with host workers (device -1): persistence, parallelism of the
// jobs, PyTorch's "Caught ... in replica i on device d" texts and the types they keep, nested runs,
// and parallel_apply over CPU modules.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <stdexcept>
#include <thread>

#include "engine/core/memory.h"
#include "engine/parallel/parallel_apply.h"

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

TEST(DeviceWorkers, RunEveryJobOnAPersistentThreadThatIsNotTheCaller) {
  DeviceWorkers workers({-1, -1});
  std::vector<std::thread::id> first(2), second(2);
  workers.run([&](size_t i) { first[i] = std::this_thread::get_id(); });
  workers.run([&](size_t i) { second[i] = std::this_thread::get_id(); });
  EXPECT_EQ(first, second);  // the same threads, step after step
  EXPECT_NE(first[0], std::this_thread::get_id());
  EXPECT_NE(first[0], first[1]);  // one thread per entry, even for the same device
  // Another DeviceWorkers owns threads of its own: nothing is shared through the process.
  DeviceWorkers other({-1});
  std::thread::id id;
  other.run([&](size_t) { id = std::this_thread::get_id(); });
  EXPECT_NE(id, first[0]);
  EXPECT_NE(id, first[1]);
}

TEST(DeviceWorkers, RunsOnlyTheFirstNJobs) {
  DeviceWorkers workers({-1, -1, -1});
  std::atomic<int> calls{0};
  workers.run(2, [&](size_t i) {
    EXPECT_LT(i, 2u);
    ++calls;
  });
  EXPECT_EQ(calls, 2);
  EXPECT_THROW(workers.run(4, [](size_t) {}), ValueError);
}

TEST(DeviceWorkers, ExceptionNamesTheReplicaAndDeviceAndKeepsItsType) {
  DeviceWorkers workers({-1, -1});
  std::atomic<int> ran{0};
  auto job = [&](size_t i) {
    ++ran;
    if (i == 1) CUDP_THROW(ValueError, "shapes do not agree");
  };
  EXPECT_THROW(workers.run(job), ValueError);
  EXPECT_EQ(ran, 2);  // the failure of one job does not stop the others
  EXPECT_EQ(error_of([&] { workers.run(job); }),
            "Caught ValueError in replica 1 on device cpu: shapes do not agree");
}

TEST(DeviceWorkers, TheFirstFailureByIndexIsReported) {
  DeviceWorkers workers({-1, -1, -1});
  const std::string text = error_of([&] {
    workers.run([](size_t i) {
      if (i >= 1) CUDP_THROW(IoError, "replica ", i, " failed");
    });
  });
  EXPECT_EQ(text, "Caught IoError in replica 1 on device cpu: replica 1 failed");
}

TEST(DeviceWorkers, ForeignExceptionsBecomeCudpErrors) {
  DeviceWorkers workers({-1, -1});
  try {
    workers.run([](size_t i) {
      if (i == 0) throw std::out_of_range("index 9 is out of range");
    });
    FAIL() << "no exception";
  } catch (const ValueError&) {
    FAIL() << "a std::out_of_range is not a ValueError";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(),
              "Caught out_of_range in replica 0 on device cpu: index 9 is out of range");
  }
  EXPECT_EQ(error_of([&] {
              workers.run([](size_t i) {
                if (i == 1) throw 42;
              });
            }),
            "Caught Error in replica 1 on device cpu: an exception that is not a std::exception");
}

TEST(DeviceWorkers, KeepsTheOriginalLocation) {
  DeviceWorkers workers({-1});
  try {
    workers.run([](size_t) { CUDP_THROW(ValueError, "bad"); });
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.file()).find("parallel_apply_test.cpp"), std::string::npos) << e.file();
    EXPECT_NE(std::string(e.what()).find("parallel_apply_test.cpp"), std::string::npos);
  }
}

TEST(DeviceWorkers, ANestedRunOnTheSameWorkerRunsInline) {
  DeviceWorkers workers({-1});
  int inner = 0;
  workers.run([&](size_t) {
    DeviceWorkers nested({-1});
    nested.run([&](size_t) { ++inner; });  // would wait for itself if it were queued
  });
  EXPECT_EQ(inner, 1);
}

// An out-of-memory error in a replica says what the caller was doing: the caller's allocation
// purpose applies on the worker threads, once (also to a nested run inline), and ends with the job.
TEST(DeviceWorkers, JobsAllocateUnderTheCallersPurpose) {
  DeviceWorkers workers({-1, -1});
  std::vector<std::string> what(2), advice(2), nested(2);
  {
    cuda::AllocationPurpose purpose("the test's step", "Use a smaller test.");
    workers.run([&](size_t i) {
      const cuda::AllocationPurpose inner("replica " + std::to_string(i));
      what[i] = cuda::AllocationPurpose::current_what();
      advice[i] = cuda::AllocationPurpose::current_advice();
      DeviceWorkers same({-1});
      same.run([&](size_t) { nested[i] = cuda::AllocationPurpose::current_what(); });
    });
  }
  EXPECT_EQ(what, (std::vector<std::string>{"the test's step: replica 0",
                                            "the test's step: replica 1"}));
  EXPECT_EQ(advice, (std::vector<std::string>{"Use a smaller test.", "Use a smaller test."}));
  EXPECT_EQ(nested[0], "the test's step: replica 0");
  // Without a purpose on the caller, none on the workers (the last one ended with its job).
  std::vector<std::string> none(2, "unset");
  workers.run([&](size_t i) { none[i] = cuda::AllocationPurpose::current_what(); });
  EXPECT_EQ(none, (std::vector<std::string>{"", ""}));
}

TEST(DeviceWorkers, InvalidDeviceIsRefused) {
  EXPECT_EQ(error_of([] { DeviceWorkers workers({-2}); }),
            "DeviceWorkers: device -2 is neither a CUDA device id nor -1 (the host)");
}

TEST(CaughtMessage, UsesPyTorchsWording) {
  EXPECT_EQ(caught_message("ValueError", 1, 1, "boom"),
            "Caught ValueError in replica 1 on device 1: boom");
  EXPECT_EQ(caught_message("Error", 0, -1, "x"), "Caught Error in replica 0 on device cpu: x");
}

// A CPU module that doubles its input, or throws when told to.
class Doubler : public Module {
 public:
  explicit Doubler(bool fail) : fail_(fail) {}
  std::string type_name() const override { return "Doubler"; }

 protected:
  Tensor forward_one(const Tensor& x) override {
    CUDP_CHECK(!fail_, "Doubler: told to fail on ", x.str());
    std::vector<float> v = x.to_vector<float>();
    for (float& f : v) f *= 2.f;
    return Tensor::from_vector(v, x.shape());
  }
  std::shared_ptr<Module> make_empty_copy() const override {
    return std::make_shared<Doubler>(fail_);
  }

 private:
  bool fail_;
};

TEST(ParallelApply, RunsEachModuleOnItsInputs) {
  std::vector<std::shared_ptr<Module>> modules = {std::make_shared<Doubler>(false),
                                                  std::make_shared<Doubler>(false)};
  const auto outputs =
      parallel_apply(modules, {{Tensor::full({2}, 1.f)}, {Tensor::full({3}, 5.f)}}, {-1, -1});
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_EQ(outputs[0][0].to_vector<float>(), (std::vector<float>{2.f, 2.f}));
  EXPECT_EQ(outputs[1][0].to_vector<float>(), (std::vector<float>{10.f, 10.f, 10.f}));
}

TEST(ParallelApply, AReplicasExceptionIsReRaisedWithItsIndex) {
  std::vector<std::shared_ptr<Module>> modules = {std::make_shared<Doubler>(false),
                                                  std::make_shared<Doubler>(true)};
  EXPECT_EQ(
      error_of([&] {
        parallel_apply(modules, {{Tensor::full({2}, 1.f)}, {Tensor::full({2}, 1.f)}}, {-1, -1});
      }),
      "Caught ValueError in replica 1 on device cpu: Doubler: told to fail on Tensor[2] f32 cpu");
  EXPECT_EQ(error_of([&] {
              parallel_apply(modules, {{Tensor::full({2}, 1.f)}}, {-1, -1});
            }),
            "parallel_apply: 2 modules but 1 inputs");
}

}  // namespace
}  // namespace cudp::parallel
