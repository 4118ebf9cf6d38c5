// The collective watchdog's logic on the CPU: a clock moved by hand and fake probes stand in for
// time, CUDA events and NCCL (the real adapter is engine/parallel/comm.cpp's, tested on two GPUs
// by watchdog_gpu_test). What must hold: a collective that never completes ends, once its timeout
// has passed and not before, with an error naming the rank, its device, the collective, its size
// and the time in flight, raised in the thread waiting for it after the communicator was aborted
// (once); one that completes never does; an asynchronous error does the same at once.
#include "engine/parallel/watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

namespace cudp::parallel {
namespace {

using namespace std::chrono_literals;
using Time = std::chrono::steady_clock::time_point;

// A clock the test moves, and the fakes of NCCL the watchdog sees.
struct Fakes {
  std::atomic<int64_t> now_ms{1'000'000};
  std::atomic<int> aborts{0};
  std::mutex mutex;
  std::vector<std::string> async_errors = {"", ""};

  Watchdog make(std::chrono::milliseconds timeout = 600s) {
    Watchdog::Options options;
    options.timeout = timeout;
    options.thread = false;
    options.report = false;
    options.clock = [this] { return Time(std::chrono::milliseconds(now_ms.load())); };
    WatchdogHooks hooks{[this](int i) {
                          std::lock_guard lock(mutex);
                          return async_errors[static_cast<size_t>(i)];
                        },
                        [this] { ++aborts; }};
    return Watchdog({{4, 0}, {5, 1}}, std::move(hooks), options);
  }
  void advance(std::chrono::milliseconds d) { now_ms += d.count(); }
};

// Runs f on another thread and says whether it has finished within `patience`.
template <typename F>
bool finishes(std::future<F>& f, std::chrono::milliseconds patience = 2s) {
  return f.wait_for(patience) == std::future_status::ready;
}

TEST(Watchdog, ACollectiveThatNeverCompletesEndsWithAnErrorAfterItsTimeout) {
  Fakes fakes;
  Watchdog dog = fakes.make(600s);
  const uint64_t ticket = dog.watch(1, "all_reduce", 16396, [] { return false; });
  auto waiter = std::async(std::launch::async, [&] { dog.wait(ticket); });

  fakes.advance(599'999ms);
  dog.poll();
  EXPECT_FALSE(dog.failed()) << "not before the timeout";
  EXPECT_FALSE(finishes(waiter, 50ms)) << "the waiting thread still waits";
  EXPECT_EQ(fakes.aborts, 0);

  fakes.advance(2ms);
  dog.poll();
  ASSERT_TRUE(finishes(waiter)) << "the waiting thread is released";
  try {
    waiter.get();
    FAIL() << "wait() returned normally for a collective that never completed";
  } catch (const CollectiveError& e) {
    const std::string what = e.what();
    for (const char* part : {"rank 5", "cuda:1", "all_reduce of 16396 bytes",
                             "did not complete within the collective timeout of 600 s",
                             "in flight for 600 s", "aborted", "--collective-timeout"}) {
      EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
    }
  }
  EXPECT_EQ(fakes.aborts, 1) << "the communicator is aborted once";
  dog.poll();
  EXPECT_EQ(fakes.aborts, 1);
  EXPECT_THROW(dog.check(), CollectiveError) << "and stays failed";
  EXPECT_THROW(dog.watch(0, "broadcast", 4, [] { return true; }), CollectiveError);
}

TEST(Watchdog, ACompletedCollectiveNeverTimesOut) {
  Fakes fakes;
  Watchdog dog = fakes.make(10s);
  std::atomic<bool> done{false};
  const uint64_t ticket = dog.watch(0, "all_reduce", 400, [&] { return done.load(); });
  fakes.advance(9s);
  dog.poll();
  done = true;  // completes just before its deadline
  dog.poll();
  fakes.advance(1h);
  dog.poll();
  EXPECT_FALSE(dog.failed());
  EXPECT_EQ(fakes.aborts, 0);
  dog.wait(ticket);  // returns at once
  dog.wait_all();
  EXPECT_NO_THROW(dog.check());
}

TEST(Watchdog, TheTimeoutCountsFromEachCollectivesStart) {
  Fakes fakes;
  Watchdog dog = fakes.make(10s);
  std::atomic<bool> first_done{false};
  dog.watch(0, "all_reduce", 4, [&] { return first_done.load(); });
  fakes.advance(8s);
  dog.watch(0, "broadcast", 8, [] { return false; });
  first_done = true;
  fakes.advance(8s);  // 16 s after the first, 8 s after the second
  dog.poll();
  EXPECT_FALSE(dog.failed());
  fakes.advance(2s);
  dog.poll();
  ASSERT_TRUE(dog.failed());
  try {
    dog.check();
  } catch (const CollectiveError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 4 on cuda:0: broadcast of 8 bytes"),
              std::string::npos)
        << e.what();
  }
}

TEST(Watchdog, AnAsynchronousErrorAbortsAtOnceAndNamesTheCollective) {
  Fakes fakes;
  Watchdog dog = fakes.make(600s);
  dog.watch(0, "all_gather", 1024, [] { return false; });
  const uint64_t ticket = dog.watch(1, "all_gather", 1024, [] { return false; });
  dog.poll();
  EXPECT_FALSE(dog.failed());
  {
    std::lock_guard lock(fakes.mutex);
    fakes.async_errors[1] = "remote process exited or there was a network error";
  }
  fakes.advance(3s);
  dog.poll();
  EXPECT_EQ(fakes.aborts, 1);
  try {
    dog.wait(ticket);
    FAIL() << "no error";
  } catch (const CollectiveError& e) {
    const std::string what = e.what();
    for (const char* part : {"rank 5 on cuda:1: all_gather of 1024 bytes",
                             "asynchronous error: remote process exited", "in flight for 3 s"}) {
      EXPECT_NE(what.find(part), std::string::npos) << "lacks \"" << part << "\": " << what;
    }
  }
}

TEST(Watchdog, AProbeThatThrowsIsAFailure) {
  Fakes fakes;
  Watchdog dog = fakes.make();
  dog.watch(0, "reduce", 12,
            []() -> bool { throw std::runtime_error("an illegal memory access"); });
  dog.poll();
  ASSERT_TRUE(dog.failed());
  EXPECT_EQ(fakes.aborts, 1);
  EXPECT_THROW(dog.check(), CollectiveError);
}

// The same with the watchdog's own thread and the real clock: nobody calls poll().
TEST(Watchdog, ItsThreadEndsAHungCollectiveWithinTheTimeout) {
  std::atomic<int> aborts{0};
  Watchdog::Options options;
  options.timeout = 200ms;
  options.poll_interval = 10ms;
  options.report = false;
  Watchdog dog({{0, 3}}, WatchdogHooks{[](int) { return std::string(); }, [&] { ++aborts; }},
               options);
  std::atomic<bool> done{false};
  dog.watch(0, "all_reduce", 4, [&] { return done.load(); });  // completes
  done = true;
  dog.wait_all();
  const auto start = std::chrono::steady_clock::now();
  dog.watch(0, "all_reduce", 4, [] { return false; });  // never completes
  EXPECT_THROW(dog.wait_all(), CollectiveError);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 200ms);
  EXPECT_LT(waited, 5s);
  EXPECT_EQ(aborts, 1);
}

TEST(Watchdog, BadSettingsAreErrors) {
  Watchdog::Options options;
  options.thread = false;
  options.timeout = 0ms;
  EXPECT_THROW(Watchdog({{0, 0}}, WatchdogHooks{}, options), ValueError);
  options.timeout = 1s;
  Watchdog dog({{0, 0}}, WatchdogHooks{}, options);
  EXPECT_THROW(dog.set_timeout(-1s), ValueError);
  EXPECT_THROW(dog.watch(1, "all_reduce", 4, [] { return true; }), ValueError);
  dog.set_timeout(3s);
  EXPECT_EQ(dog.timeout(), 3s);
}

}  // namespace
}  // namespace cudp::parallel
