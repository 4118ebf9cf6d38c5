# Finds every dependency (DESIGN.md §6). A missing one stops configuration with a message naming it
# and the Debian/Ubuntu package that provides it.

macro(cudp_require found what package)
  if(NOT ${found})
    message(FATAL_ERROR
      "cudp: ${what} was not found. Install it (Debian/Ubuntu: apt-get install ${package}) "
      "or point CMAKE_PREFIX_PATH at it.")
  endif()
endmacro()

find_package(CUDAToolkit QUIET)
cudp_require(CUDAToolkit_FOUND "the CUDA Toolkit (nvcc, cudart, cuBLAS)"
  "nvidia-cuda-toolkit, or NVIDIA's cuda-toolkit-13-0")
if(NOT TARGET CUDA::cublas)
  cudp_require(FALSE "cuBLAS" "libcublas-dev (NVIDIA's libcublas-dev-13-0)")
endif()

find_package(NCCL QUIET)
cudp_require(NCCL_FOUND "NCCL (nccl.h, libnccl)" "libnccl-dev")
find_package(CUDNN QUIET)
cudp_require(CUDNN_FOUND "cuDNN 9 (cudnn.h, libcudnn)" "libcudnn9-dev-cuda-13")
find_package(ZLIB QUIET)
cudp_require(ZLIB_FOUND "zlib" "zlib1g-dev")
find_package(nlohmann_json 3 QUIET)
cudp_require(nlohmann_json_FOUND "nlohmann-json" "nlohmann-json3-dev")
find_package(Threads REQUIRED)

if(CUDP_BUILD_TESTS)
  find_package(GTest QUIET)
  cudp_require(GTest_FOUND "GoogleTest" "libgtest-dev")
endif()
if(CUDP_BUILD_EXAMPLES OR CUDP_BUILD_BENCH)
  find_package(CLI11 QUIET)
  cudp_require(CLI11_FOUND "CLI11" "libcli11-dev")
endif()
if(CUDP_BUILD_BENCH)
  find_package(benchmark QUIET)
  cudp_require(benchmark_FOUND "Google Benchmark" "libbenchmark-dev")
endif()
