// The collective watchdog on two GPUs, through the real adapter (events after each collective,
// ncclCommGetAsyncError, ncclCommAbort): two ranks, one thread each (ncclCommInitRank, as one
// process per GPU would), agree on one step; then rank 1 skips the next one. Rank 0 must end with
// the watchdog's error, naming itself, its device, the collective and its size, once the timeout
// has passed and well before it would otherwise give up (never). The step is an all-reduce, then
// the same all-reduce captured into a CUDA graph, whose launches are watched.
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <functional>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/gpu.h"
#include "engine/parallel/comm.h"
#include "layers/train.h"

namespace cudp::parallel {
namespace {

using namespace std::chrono_literals;

constexpr auto kTimeout = 3s;
constexpr int64_t kN = 4099;  // 16396 bytes of f32

struct Outcome {
  std::string error;  // the CollectiveError rank 0 got
  std::chrono::steady_clock::duration waited{};
};

// Two ranks on threads of their own, each with a Communicator of two ranks (timeout kTimeout).
// `agree(rank, comm)` runs what both ranks take part in and returns the next step; rank 1 skips
// it (alive until its peer has given up, then it aborts), rank 0 takes it and must end with the
// watchdog's error, after which the communicator stays failed.
Outcome rank_one_skips_the_next_step(
    const std::function<std::function<void()>(int rank, Communicator& comm)>& agree) {
  const ncclUniqueId id = Communicator::unique_id();
  std::latch rank0_gave_up(1);
  Outcome out;
  std::vector<std::exception_ptr> failures(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        cuda::set_device(rank);
        Communicator comm(rank, rank, 2, id);
        comm.set_timeout(kTimeout);
        const std::function<void()> next = agree(rank, comm);
        if (rank == 1) {
          rank0_gave_up.wait();  // skips the next step, alive until its peer has given up
          comm.abort();          // then ends without waiting for that peer
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        next();
        try {
          comm.synchronize();
          ADD_FAILURE() << "rank 0's step completed without its peer";
        } catch (const CollectiveError& e) {
          out.error = e.message();
        }
        out.waited = std::chrono::steady_clock::now() - start;
        const Tensor t = Tensor::full({1}, 1.f, Device::cuda(rank));
        EXPECT_THROW(comm.all_reduce({t}), CollectiveError) << "a failed communicator stays failed";
        rank0_gave_up.count_down();
        cuda::synchronize(rank);  // the aborted communicator's kernel has returned
      } catch (...) {
        failures[static_cast<size_t>(rank)] = std::current_exception();
        if (rank == 0) rank0_gave_up.count_down();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& f : failures) {
    if (f) std::rethrow_exception(f);
  }
  return out;
}

void expect_the_watchdogs_error(const Outcome& out, const std::string& what) {
  for (const std::string& part :
       {what, std::string("did not complete within the collective timeout of 3 s"),
        std::string("aborted")}) {
    EXPECT_NE(out.error.find(part), std::string::npos) << "lacks \"" << part << "\": " << out.error;
  }
  EXPECT_GE(out.waited, kTimeout);
  EXPECT_LT(out.waited, kTimeout + 10s)
      << "the watchdog polls every 100 ms; the abort takes the rest";
}

TEST(WatchdogGpu, ARankThatSkipsAnAllReduceEndsItsPeerWithTheWatchdogsError) {
  CUDP_REQUIRE_GPUS(2);
  const Outcome out = rank_one_skips_the_next_step([](int rank, Communicator& comm) {
    auto t = std::make_shared<Tensor>(
        Tensor::full({kN}, static_cast<float>(rank + 1), Device::cuda(rank)));
    // Both ranks: the first all-reduce sets up NCCL's connections and must just work.
    comm.all_reduce({*t});
    comm.synchronize();
    EXPECT_EQ(t->to_vector<float>(), std::vector<float>(kN, 3.f)) << "rank " << rank;
    return std::function<void()>([&comm, t] { comm.all_reduce({*t}); });
  });
  expect_the_watchdogs_error(out, "rank 0 on cuda:0: all_reduce of 16396 bytes");
}

// Through a CUDA graph (layers/train.h's GraphedStep, as a DistributedDataParallel step under
// cudp-vgg --graphs on): the all-reduce is captured, so it runs at each launch of the graph, and
// Communicator::launch_watcher watches the launches. Both ranks run the step once eagerly and once
// captured (its first launch); then rank 1 skips a launch.
TEST(WatchdogGpu, ARankThatSkipsAGraphLaunchEndsItsPeerWithTheWatchdogsError) {
  CUDP_REQUIRE_GPUS(2);
  const Outcome out = rank_one_skips_the_next_step([](int rank, Communicator& comm) {
    const Device gpu = Device::cuda(rank);
    // The step: t = rank + 1 everywhere, summed over the ranks (3 where both take part).
    struct Step {
      Step(Communicator& comm, int rank, Device gpu)
          : graphed(
                [&comm](const Tensor& x, const Tensor&) {
                  Tensor t = x.clone_async();
                  comm.all_reduce({t});
                  return TensorList{t};
                },
                gpu,
                {.warmup_steps = 1,
                 .enabled = true,
                 .before_replay = {},
                 .after_launch = comm.launch_watcher("a replayed step")}),
            x(Tensor::full({kN}, static_cast<float>(rank + 1), gpu)),
            y(Tensor::full({1}, 0.f, gpu)) {}
      GraphedStep graphed;
      Tensor x, y;
    };
    auto step = std::make_shared<Step>(comm, rank, gpu);
    for (int i = 0; i < 2; ++i) {  // eager, then captured and launched: both ranks
      const TensorList r = step->graphed.run(step->x, step->y);
      comm.synchronize();
      EXPECT_EQ(r[0].to_vector<float>(), std::vector<float>(kN, 3.f))
          << "rank " << rank << ", step " << i;
    }
    EXPECT_TRUE(step->graphed.captured());
    EXPECT_EQ(step->graphed.replays(), 1);
    return std::function<void()>([step] { step->graphed.run(step->x, step->y); });
  });
  expect_the_watchdogs_error(
      out,
      "rank 0 on cuda:0: a replayed step (1 captured collective of this communicator) of "
      "16396 bytes");
}

}  // namespace
}  // namespace cudp::parallel
