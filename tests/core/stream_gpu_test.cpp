// GPU tests of cuda::SideStream (engine/core/stream.h): work on the side stream runs after what
// the main stream was given before the fork, work given to the main stream after the join runs
// after the side stream's, and inside a capture the side stream's work lands in the graph.
// The orderings are made observable with host functions that sleep before they write the pinned
// value a copy reads: without the event the copy would read the value from before.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "common/gpu.h"
#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/stream.h"

namespace cudp {
namespace {

struct Pinned {
  int* p = nullptr;
  Pinned() { CUDP_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p), 4 * sizeof(int))); }
  ~Pinned() { cudaFreeHost(p); }
};

struct Late {
  int* where;
  int value;
};

// A host function that writes `value` to `where` after 50 ms.
void CUDART_CB write_late(void* arg) {
  const Late* late = static_cast<const Late*>(arg);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  *late->where = late->value;
}

TEST(SideStreamGpu, TheSideStreamWaitsForTheForkAndTheMainStreamForTheJoin) {
  CUDP_REQUIRE_GPU();
  const cuda::DeviceGuard device(0);
  const cuda::Stream main = cuda::Stream::create(0);
  Pinned host;
  host.p[0] = host.p[1] = host.p[2] = host.p[3] = 0;
  int* dev = nullptr;
  CUDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), 2 * sizeof(int)));
  CUDP_CUDA_CHECK(cudaMemset(dev, 0, 2 * sizeof(int)));

  // Before the fork, on main: 7 reaches dev[0] after 50 ms.
  Late first{&host.p[0], 7};
  CUDP_CUDA_CHECK(cudaLaunchHostFunc(main, write_late, &first));
  CUDP_CUDA_CHECK(cudaMemcpyAsync(dev, &host.p[0], sizeof(int), cudaMemcpyHostToDevice, main));
  {
    cuda::SideStream side(0, main);
    ASSERT_NE(side.get(), main.get());
    // On the side stream: dev[0] read (7 only if it waited), and 9 to dev[1] after 50 ms.
    CUDP_CUDA_CHECK(
        cudaMemcpyAsync(&host.p[1], dev, sizeof(int), cudaMemcpyDeviceToHost, side.get()));
    Late second{&host.p[2], 9};
    CUDP_CUDA_CHECK(cudaLaunchHostFunc(side.get(), write_late, &second));
    CUDP_CUDA_CHECK(
        cudaMemcpyAsync(dev + 1, &host.p[2], sizeof(int), cudaMemcpyHostToDevice, side.get()));
    side.join();
    // After the join, on main: dev[1] read (9 only if main waited for the side stream).
    CUDP_CUDA_CHECK(
        cudaMemcpyAsync(&host.p[3], dev + 1, sizeof(int), cudaMemcpyDeviceToHost, main));
    main.synchronize();  // main only: the side stream's work is reached through the join
  }
  EXPECT_EQ(host.p[1], 7) << "the side stream did not wait for the main stream's earlier work";
  EXPECT_EQ(host.p[3], 9) << "the main stream did not wait for the side stream's work";
  CUDP_CUDA_CHECK(cudaFree(dev));
}

// In a capture the side stream's copy is a node of the graph (it would otherwise run at once, or
// leave the capture unjoined), and the replayed graph orders it between the two main-stream copies.
TEST(SideStreamGpu, ACapturedSideStreamIsABranchOfTheGraph) {
  CUDP_REQUIRE_GPU();
  const cuda::DeviceGuard device(0);
  const cuda::Stream main = cuda::Stream::create(0);
  int* dev = nullptr;
  CUDP_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dev), 3 * sizeof(int)));
  CUDP_CUDA_CHECK(cudaMemset(dev, 0, 3 * sizeof(int)));
  Pinned host;
  host.p[0] = 5;
  host.p[1] = 0;

  CUDP_CUDA_CHECK(cudaStreamBeginCapture(main, cudaStreamCaptureModeThreadLocal));
  CUDP_CUDA_CHECK(cudaMemcpyAsync(dev, &host.p[0], sizeof(int), cudaMemcpyHostToDevice, main));
  {
    cuda::SideStream side(0, main);
    CUDP_CUDA_CHECK(
        cudaMemcpyAsync(dev + 1, dev, sizeof(int), cudaMemcpyDeviceToDevice, side.get()));
  }  // joined by the destructor
  CUDP_CUDA_CHECK(cudaMemcpyAsync(&host.p[1], dev + 1, sizeof(int), cudaMemcpyDeviceToHost, main));
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(main, &graph), cudaSuccess) << "the side stream left unjoined";
  size_t nodes = 0;
  CUDP_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  EXPECT_EQ(nodes, 3u) << "the side stream's copy is not in the graph";
  // Nothing ran during the capture.
  int before[2] = {-1, -1};
  CUDP_CUDA_CHECK(cudaMemcpy(before, dev, 2 * sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(before[1], 0);

  cudaGraphExec_t exec = nullptr;
  CUDP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int value : {5, 11}) {
    host.p[0] = value;
    host.p[1] = 0;
    CUDP_CUDA_CHECK(cudaGraphLaunch(exec, main));
    main.synchronize();
    EXPECT_EQ(host.p[1], value);
  }
  CUDP_CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDP_CUDA_CHECK(cudaGraphDestroy(graph));
  CUDP_CUDA_CHECK(cudaFree(dev));
}

// One side stream open beside a stream at a time: a second is refused, naming the fix, or with
// if_free not forked (its work stays on the stream); after the join the slot is free again.
TEST(SideStreamGpu, OneSideStreamOpenAtATime) {
  CUDP_REQUIRE_GPU();
  const cuda::Stream main = cuda::Stream::create(0);
  cuda::SideStream first(0, main);
  try {
    cuda::SideStream second(0, main);
    ADD_FAILURE() << "a second side stream was opened";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("join it first"), std::string::npos) << e.what();
  }
  {
    // if_free: none, the work stays on `main`.
    cuda::SideStream none(0, main, cuda::SideStream::if_free);
    EXPECT_FALSE(none.forked());
    EXPECT_EQ(none.get(), main.get());
    none.join();
  }
  first.join();
  const uint64_t forks = cuda::SideStream::forks();
  {
    // Not wanted: none, though the slot is free.
    cuda::SideStream unwanted(0, main, cuda::SideStream::if_free, false);
    EXPECT_FALSE(unwanted.forked());
    EXPECT_EQ(unwanted.get(), main.get());
  }
  EXPECT_EQ(cuda::SideStream::forks(), forks);
  cuda::SideStream again(0, main, cuda::SideStream::if_free);
  EXPECT_TRUE(again.forked());
  EXPECT_EQ(cuda::SideStream::forks(), forks + 1);
  EXPECT_EQ(again.get(), first.get()) << "the side stream is kept for its stream";
  again.join();
  main.synchronize();
}

}  // namespace
}  // namespace cudp
