# Finds every dependency (docs/architecture.md §6) and enables CUDA. Nothing stops at the first
# missing package: each one is noted with the Debian/Ubuntu package that provides it, and
# configuration then fails once, naming them all, with the one command that installs them
# (scripts/setup-debian.sh installs the same list).

set(CUDP_MISSING "")           # what is missing, for the message
set(CUDP_MISSING_PACKAGES "")  # the Debian/Ubuntu packages that provide it

macro(cudp_require found what package)
  if(NOT ${found})
    list(APPEND CUDP_MISSING "${what}")
    list(APPEND CUDP_MISSING_PACKAGES ${package})
  endif()
endmacro()

# nvcc: a fresh CUDA install leaves /usr/local/cuda/bin off PATH; look there too.
include(CheckLanguage)
if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(CUDP_NVCC nvcc PATHS /usr/local/cuda/bin NO_CACHE)
  if(CUDP_NVCC)
    set(CMAKE_CUDA_COMPILER "${CUDP_NVCC}" CACHE FILEPATH "CUDA compiler")
  endif()
endif()
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  enable_language(CUDA)
endif()
cudp_require(CMAKE_CUDA_COMPILER "the CUDA compiler nvcc (CUDA Toolkit 13)" cuda-toolkit-13-0)

find_package(CUDAToolkit QUIET)
if(CMAKE_CUDA_COMPILER)
  cudp_require(CUDAToolkit_FOUND "the CUDA Toolkit's libraries (cudart)" cuda-toolkit-13-0)
endif()
if(CUDAToolkit_FOUND AND NOT TARGET CUDA::cublas)
  cudp_require(FALSE "cuBLAS" libcublas-dev-13-0)
endif()
find_package(NCCL QUIET)
cudp_require(NCCL_FOUND "NCCL 2 (nccl.h, libnccl)" libnccl-dev)
find_package(CUDNN QUIET)
cudp_require(CUDNN_FOUND "cuDNN 9 (cudnn.h, libcudnn)" libcudnn9-dev-cuda-13)
find_package(ZLIB QUIET)
cudp_require(ZLIB_FOUND "zlib" zlib1g-dev)
find_package(nlohmann_json 3 QUIET)
cudp_require(nlohmann_json_FOUND "nlohmann-json 3" nlohmann-json3-dev)
find_package(Threads REQUIRED)

# Optional: MPI for launching one process per GPU (CUDP_WITH_MPI). Absent, cudp builds without
# the bootstrap and says so here, not as an error.
set(CUDP_MPI OFF)
if(CUDP_WITH_MPI)
  # The C API through the C++ compiler (cudp enables no C); not MPI's old C++ bindings.
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(CUDP_MPI ON)
  else()
    message(STATUS "cudp: MPI not found, building without the MPI launch path (mpirun/srun); "
      "install libopenmpi-dev and openmpi-bin to get it, or pass -DCUDP_WITH_MPI=OFF")
  endif()
endif()

if(CUDP_BUILD_TESTS)
  find_package(GTest QUIET)
  cudp_require(GTest_FOUND "GoogleTest (CUDP_BUILD_TESTS)" libgtest-dev)
endif()
if(CUDP_BUILD_EXAMPLES OR CUDP_BUILD_BENCH)
  find_package(CLI11 QUIET)
  cudp_require(CLI11_FOUND "CLI11 (CUDP_BUILD_EXAMPLES, CUDP_BUILD_BENCH)" libcli11-dev)
endif()

if(CUDP_MISSING)
  list(REMOVE_DUPLICATES CUDP_MISSING_PACKAGES)
  list(JOIN CUDP_MISSING "\n  - " missing)
  list(JOIN CUDP_MISSING_PACKAGES " " packages)
  message(FATAL_ERROR
    "cudp: these dependencies were not found:\n  - ${missing}\n"
    "Install them all at once with\n"
    "  scripts/setup-debian.sh\n"
    "or on Debian/Ubuntu with\n"
    "  sudo apt-get install ${packages}\n"
    "(the CUDA, cuDNN and NCCL packages come from NVIDIA's CUDA repository), or point "
    "CMAKE_PREFIX_PATH (and CMAKE_CUDA_COMPILER for nvcc) at an installation elsewhere.")
endif()
