// GPU tests of the Communicator: every collective against host arithmetic, lists in one group,
// ordering with compute without host synchronisation (and the memory-lifetime rule of comm.h), the
// shared cache, the error texts, and the multi-process constructor driven from two threads.
#include <gtest/gtest.h>

#include <exception>
#include <thread>

#include "common/compare.h"
#include "common/gpu.h"
#include "engine/parallel/comm.h"

namespace cudp::parallel {
namespace {

using cudp::testing::random_vector;

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no exception)";
}

Tensor on(int device, const std::vector<float>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())}, Device::cuda(device));
}

constexpr int64_t kN = (1 << 20) + 37;  // big enough for NCCL to split it, odd to test the tail

TEST(CommunicatorGpu, AllReduceSumAverageMaxMatchHostArithmetic) {
  CUDP_REQUIRE_GPUS(2);
  Communicator comm({0, 1});
  EXPECT_EQ(comm.size(), 2);
  EXPECT_EQ(comm.world_size(), 2);
  const auto a = random_vector(kN, 11), b = random_vector(kN, 12);
  std::vector<float> sum(kN), avg(kN), max(kN);
  for (int64_t i = 0; i < kN; ++i) {
    sum[i] = a[i] + b[i];  // two operands: one rounding, whichever rank adds
    avg[i] = (a[i] + b[i]) / 2;
    max[i] = std::max(a[i], b[i]);
  }
  {
    Tensor x = on(0, a), y = on(1, b);
    comm.all_reduce({x, y});
    EXPECT_EQ(x.to_vector<float>(), sum);
    EXPECT_EQ(y.to_vector<float>(), sum);
  }
  {
    Tensor x = on(0, a), y = on(1, b);
    comm.all_reduce({x, y}, ReduceOp::Average);
    EXPECT_ALL_CLOSE(x.to_vector<float>(), avg, 1e-6, 1e-7);
    EXPECT_EQ(x.to_vector<float>(), y.to_vector<float>());  // every rank gets the same bits
  }
  {
    Tensor x = on(0, a), y = on(1, b);
    comm.all_reduce({x, y}, ReduceOp::Max);
    EXPECT_EQ(x.to_vector<float>(), max);
    EXPECT_EQ(y.to_vector<float>(), max);
  }
}

TEST(CommunicatorGpu, BroadcastReduceAllGather) {
  CUDP_REQUIRE_GPUS(2);
  Communicator comm({0, 1});
  const auto a = random_vector(kN, 21), b = random_vector(kN, 22);
  for (int root : {0, 1}) {
    Tensor x = on(0, a), y = on(1, b);
    comm.broadcast({x, y}, root);
    const auto& expected = root == 0 ? a : b;
    EXPECT_EQ(x.to_vector<float>(), expected) << "root " << root;
    EXPECT_EQ(y.to_vector<float>(), expected) << "root " << root;
  }
  {
    Tensor x = on(0, a), y = on(1, b);
    comm.reduce({x, y}, /*root=*/1);
    std::vector<float> sum(kN);
    for (int64_t i = 0; i < kN; ++i) sum[i] = a[i] + b[i];
    EXPECT_EQ(y.to_vector<float>(), sum);
    EXPECT_EQ(x.to_vector<float>(), a);  // not the root: unchanged
  }
  {
    const Tensor x = on(0, a), y = on(1, b);
    Tensor gx = Tensor::empty({2 * kN}, DType::f32, Device::cuda(0));
    Tensor gy = Tensor::empty({2 * kN}, DType::f32, Device::cuda(1));
    comm.all_gather({x, y}, {gx, gy});
    std::vector<float> both = a;
    both.insert(both.end(), b.begin(), b.end());
    EXPECT_EQ(gx.to_vector<float>(), both);
    EXPECT_EQ(gy.to_vector<float>(), both);
  }
}

TEST(CommunicatorGpu, ListsOfTensorsOfSeveralDtypesInOneGroup) {
  CUDP_REQUIRE_GPUS(2);
  Communicator comm({0, 1});
  const std::vector<int64_t> ia = {1, -2, 3, 1LL << 40}, ib = {10, 20, -30, 5};
  const std::vector<int32_t> ja = {7, 8, 9}, jb = {-7, 1, 2};
  const auto fa = random_vector(1001, 31), fb = random_vector(1001, 32);
  std::vector<TensorList> lists = {{on(0, fa), Tensor::from_vector(ia, {4}, Device::cuda(0)),
                                    Tensor::from_vector(ja, {3}, Device::cuda(0))},
                                   {on(1, fb), Tensor::from_vector(ib, {4}, Device::cuda(1)),
                                    Tensor::from_vector(jb, {3}, Device::cuda(1))}};
  comm.all_reduce_many(lists);
  std::vector<float> fsum(1001);
  for (size_t i = 0; i < fsum.size(); ++i) fsum[i] = fa[i] + fb[i];
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(lists[r][0].to_vector<float>(), fsum);
    EXPECT_EQ(lists[r][1].to_vector<int64_t>(),
              (std::vector<int64_t>{11, 18, -27, (1LL << 40) + 5}));
    EXPECT_EQ(lists[r][2].to_vector<int32_t>(), (std::vector<int32_t>{0, 9, 11}));
  }
  comm.broadcast_many(
      {{lists[0][0], lists[0][1]}, {on(1, fb), Tensor::zeros({4}, DType::i64, Device::cuda(1))}},
      0);
}

// The collective waits for the compute work before it (fill_), and compute work after it (the
// second fill_) waits for the collective: no host synchronisation anywhere in between.
TEST(CommunicatorGpu, OrderedWithComputeWithoutHostSynchronisation) {
  CUDP_REQUIRE_GPUS(2);
  Communicator comm({0, 1});
  for (int iteration = 0; iteration < 20; ++iteration) {
    Tensor x = Tensor::empty({kN}, DType::f32, Device::cuda(0));
    Tensor y = Tensor::empty({kN}, DType::f32, Device::cuda(1));
    x.fill_(1.f + static_cast<float>(iteration));
    y.fill_(2.f);
    comm.all_reduce({x, y});
    x.fill_(100.f);  // must not overtake the collective reading x
    const float expected = 3.f + static_cast<float>(iteration);
    EXPECT_EQ(y.to_vector<float>(), std::vector<float>(kN, expected)) << iteration;
    EXPECT_EQ(x.to_vector<float>(), std::vector<float>(kN, 100.f)) << iteration;
  }
}

// NOTE [Comm stream ordering and memory lifetime]: tensors dropped right after a collective are
// freed on the compute stream after it, so new allocations reusing their memory are not overwritten
// by the collective's late writes.
TEST(CommunicatorGpu, MemoryFreedAfterACollectiveIsNotOverwrittenByIt) {
  CUDP_REQUIRE_GPUS(2);
  Communicator comm({0, 1});
  for (int iteration = 0; iteration < 20; ++iteration) {
    {
      Tensor x = Tensor::full({kN}, 1.f, Device::cuda(0));
      Tensor y = Tensor::full({kN}, 2.f, Device::cuda(1));
      comm.all_reduce({x, y});
    }  // freed here, on the compute streams
    Tensor fresh0 = Tensor::full({kN}, 7.f, Device::cuda(0));
    Tensor fresh1 = Tensor::full({kN}, 7.f, Device::cuda(1));
    EXPECT_EQ(fresh0.to_vector<float>(), std::vector<float>(kN, 7.f)) << iteration;
    EXPECT_EQ(fresh1.to_vector<float>(), std::vector<float>(kN, 7.f)) << iteration;
  }
}

TEST(CommunicatorGpu, OneDeviceIsAnIdentity) {
  CUDP_REQUIRE_GPU();
  Communicator comm({0});
  const auto a = random_vector(333, 41);
  Tensor x = on(0, a);
  comm.all_reduce({x});
  comm.broadcast({x});
  EXPECT_EQ(x.to_vector<float>(), a);
}

TEST(CommunicatorGpu, ErrorTexts) {
  CUDP_REQUIRE_GPUS(2);
  Communicator comm({0, 1});
  Tensor x = Tensor::zeros({8}, DType::f32, Device::cuda(0));
  Tensor y = Tensor::zeros({8}, DType::f32, Device::cuda(1));
  EXPECT_EQ(error_of([&] { comm.all_reduce({x}); }),
            "Communicator::all_reduce: got tensors for 1 ranks, but this process drives 2 (devices "
            "[0, 1])");
  EXPECT_EQ(
      error_of([&] {
        comm.all_reduce({x, x});
      }),
      "Communicator::all_reduce: tensor 0 of rank 1 is on cuda:0 but is expected on cuda:1; move "
      "it with .to(cuda:1) first");
  EXPECT_EQ(error_of([&] {
              comm.all_reduce({x, Tensor::zeros({9}, DType::f32, Device::cuda(1))});
            }),
            "Communicator::all_reduce: tensor 0 of rank 1 is Tensor[9] f32 cuda:1 but rank 0's is "
            "Tensor[8] f32 cuda:0; every rank needs the same size and dtype");
  EXPECT_EQ(error_of([&] {
              comm.broadcast({x, y}, 2);
            }),
            "Communicator::broadcast: root 2 is outside the 2 ranks");
  EXPECT_EQ(
      error_of([&] {
        comm.all_gather({x, y}, {x, y});
      }),
      "Communicator::all_gather: output 0 of rank 0 is Tensor[8] f32 cuda:0 but must hold 2 x 8 "
      "f32 elements");
  EXPECT_EQ(error_of([&] {
              comm.all_reduce_many({{x, x}, {y}});
            }),
            "Communicator::all_reduce: rank 1 has 1 tensors but rank 0 has 2");
}

// The door for multi-process launches: one rank per thread here, with ncclCommInitRank.
TEST(CommunicatorGpu, InitRankOneRankPerThread) {
  CUDP_REQUIRE_GPUS(2);
  const ncclUniqueId id = Communicator::unique_id();
  std::vector<std::vector<float>> results(2);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        cuda::set_device(rank);
        Communicator comm(rank, rank, 2, id);
        EXPECT_EQ(comm.size(), 1);
        EXPECT_EQ(comm.world_size(), 2);
        EXPECT_EQ(comm.rank(0), rank);
        Tensor t = Tensor::full({4099}, static_cast<float>(rank + 1), Device::cuda(rank));
        comm.all_reduce({t});
        results[rank] = t.to_vector<float>();
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  EXPECT_EQ(results[0], std::vector<float>(4099, 3.f));
  EXPECT_EQ(results[1], std::vector<float>(4099, 3.f));
}

}  // namespace
}  // namespace cudp::parallel
