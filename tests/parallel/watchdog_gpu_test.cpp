// The collective watchdog on two GPUs, through the real adapter (events after each collective,
// ncclCommGetAsyncError, ncclCommAbort): two ranks, one thread each (ncclCommInitRank, as one
// process per GPU would), agree on one all-reduce; then rank 1 skips the next one. Rank 0 must end
// with the watchdog's error, naming itself, its device, the collective and its size, once the
// timeout has passed and well before it would otherwise give up (never). Likewise for a collective
// captured into a CUDA graph, whose launches are watched.
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <latch>
#include <thread>

#include "common/gpu.h"
#include "engine/parallel/comm.h"
#include "layers/train.h"

namespace cudp::parallel {
namespace {

using namespace std::chrono_literals;

TEST(WatchdogGpu, ARankThatSkipsAnAllReduceEndsItsPeerWithTheWatchdogsError) {
  CUDP_REQUIRE_GPUS(2);
  constexpr auto kTimeout = 3s;
  constexpr int64_t kN = 4099;  // 16396 bytes of f32
  const ncclUniqueId id = Communicator::unique_id();
  std::latch rank0_gave_up(1);
  std::string error;
  std::chrono::steady_clock::duration waited{};
  std::vector<std::exception_ptr> failures(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        cuda::set_device(rank);
        Communicator comm(rank, rank, 2, id);
        comm.set_timeout(kTimeout);
        Tensor t = Tensor::full({kN}, static_cast<float>(rank + 1), Device::cuda(rank));
        // Both ranks: the first all-reduce sets up NCCL's connections and must just work.
        comm.all_reduce({t});
        comm.synchronize();
        EXPECT_EQ(t.to_vector<float>(), std::vector<float>(kN, 3.f)) << "rank " << rank;
        if (rank == 1) {
          rank0_gave_up.wait();  // skips the second all-reduce, alive until its peer has given up
          comm.abort();          // then ends without waiting for that peer
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        comm.all_reduce({t});
        try {
          comm.synchronize();
          ADD_FAILURE() << "rank 0's all-reduce completed without its peer";
        } catch (const CollectiveError& e) {
          error = e.message();
        }
        waited = std::chrono::steady_clock::now() - start;
        EXPECT_THROW(comm.all_reduce({t}), CollectiveError) << "a failed communicator stays failed";
        rank0_gave_up.count_down();
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
  for (const char* part : {"rank 0 on cuda:0: all_reduce of 16396 bytes",
                           "did not complete within the collective timeout of 3 s", "aborted"}) {
    EXPECT_NE(error.find(part), std::string::npos) << "lacks \"" << part << "\": " << error;
  }
  EXPECT_GE(waited, kTimeout);
  EXPECT_LT(waited, kTimeout + 10s) << "the watchdog polls every 100 ms; the abort takes the rest";
}

// The same through a CUDA graph (layers/train.h's GraphedStep, as a DistributedDataParallel step
// under cudp-vgg --graphs on): the all-reduce is captured, so it runs at each launch of the graph,
// and Communicator::watch_graph_launch watches the launches. Both ranks run the step once eagerly
// and once captured (its first launch); then rank 1 skips a launch, and rank 0 must end with the
// watchdog's error naming the replayed step and what it holds.
TEST(WatchdogGpu, ARankThatSkipsAGraphLaunchEndsItsPeerWithTheWatchdogsError) {
  CUDP_REQUIRE_GPUS(2);
  constexpr auto kTimeout = 3s;
  constexpr int64_t kN = 4099;  // 16396 bytes of f32
  const ncclUniqueId id = Communicator::unique_id();
  std::latch rank0_gave_up(1);
  std::string error;
  std::chrono::steady_clock::duration waited{};
  std::vector<std::exception_ptr> failures(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        cuda::set_device(rank);
        const Device gpu = Device::cuda(rank);
        Communicator comm(rank, rank, 2, id);
        comm.set_timeout(kTimeout);
        // The step: t = rank + 1 everywhere, summed over the ranks (3 where both take part).
        const auto body = [&](const Tensor& x, const Tensor&) {
          Tensor t = x.clone_async();
          comm.all_reduce({t});
          return TensorList{t};
        };
        GraphedStep graphed(body, gpu,
                            {.warmup_steps = 1,
                             .enabled = true,
                             .before_replay = {},
                             .after_launch = comm.launch_watcher("a replayed step")});
        const Tensor x = Tensor::full({kN}, static_cast<float>(rank + 1), gpu);
        const Tensor y = Tensor::full({1}, 0.f, gpu);
        for (int i = 0; i < 2; ++i) {  // eager, then captured and launched: both ranks
          const TensorList r = graphed.run(x, y);
          comm.synchronize();
          EXPECT_EQ(r[0].to_vector<float>(), std::vector<float>(kN, 3.f))
              << "rank " << rank << ", step " << i;
        }
        EXPECT_TRUE(graphed.captured());
        EXPECT_EQ(graphed.replays(), 1);
        if (rank == 1) {
          rank0_gave_up.wait();  // skips the next launch, alive until its peer has given up
          comm.abort();
          return;
        }
        const auto start = std::chrono::steady_clock::now();
        graphed.run(x, y);
        try {
          comm.synchronize();
          ADD_FAILURE() << "rank 0's replayed all-reduce completed without its peer";
        } catch (const CollectiveError& e) {
          error = e.message();
        }
        waited = std::chrono::steady_clock::now() - start;
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
  for (const char* part : {"rank 0 on cuda:0: a replayed step (1 captured collective of this "
                           "communicator) of 16396 bytes",
                           "did not complete within the collective timeout of 3 s", "aborted"}) {
    EXPECT_NE(error.find(part), std::string::npos) << "lacks \"" << part << "\": " << error;
  }
  EXPECT_GE(waited, kTimeout);
  EXPECT_LT(waited, kTimeout + 10s) << "the watchdog polls every 100 ms; the abort takes the rest";
}

}  // namespace
}  // namespace cudp::parallel
