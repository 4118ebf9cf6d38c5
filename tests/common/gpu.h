// Helpers for GPU tests: skip cleanly where there is no GPU (CI), or too few.
#pragma once

#include <gtest/gtest.h>

#include "engine/core/device.h"
#include "engine/core/error.h"
#include "kernels/matmul.h"

// Skips the test unless at least n CUDA devices are visible. ctest reports a GPU test executable
// in which every test skipped as skipped (common/test_main.cpp's exit status; the MPI GPU tests,
// run under mpirun, by this first message).
#define CUDP_REQUIRE_GPUS(n)                                                                  \
  do {                                                                                        \
    const int cudp_count_ = ::cudp::cuda::device_count();                                     \
    if (cudp_count_ == 0) GTEST_SKIP() << "no CUDA device is visible: GPU test skipped";     \
    if (cudp_count_ < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << cudp_count_ << " visible"; \
  } while (0)

#define CUDP_REQUIRE_GPU() CUDP_REQUIRE_GPUS(1)

// Skips the test unless the current device runs the sm_90 tensor-core kernels.
#define CUDP_REQUIRE_TENSOR_CORES()                                                        \
  do {                                                                                     \
    CUDP_REQUIRE_GPU();                                                                    \
    int cudp_device_ = 0;                                                                  \
    CUDP_CUDA_CHECK(cudaGetDevice(&cudp_device_));                                         \
    if (!::cudp::kernels::tensor_cores_available(cudp_device_))                            \
      GTEST_SKIP() << "the GPU is not sm_90: no wgmma";                                    \
  } while (0)
