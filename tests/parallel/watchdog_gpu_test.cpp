// The collective watchdog on two GPUs, through the real adapter (events after each collective,
// ncclCommGetAsyncError, ncclCommAbort): two ranks, one thread each (ncclCommInitRank, as one
// process per GPU would), agree on one all-reduce; then rank 1 skips the next one. Rank 0 must end
// with the watchdog's error, naming itself, its device, the collective and its size, once the
// timeout has passed and well before it would otherwise give up (never).
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <latch>
#include <thread>

#include "common/gpu.h"
#include "engine/parallel/comm.h"

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

}  // namespace
}  // namespace cudp::parallel
