# Finds NCCL in the CUDA toolkit tree or the system tree and defines the imported target NCCL::nccl.
include(FindPackageHandleStandardArgs)
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME
  PATHS /usr/include /usr/include/x86_64-linux-gnu /usr/local/include
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME
  PATHS /usr/lib/x86_64-linux-gnu /usr/local/lib
  PATH_SUFFIXES lib lib64)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
