# Finds cuDNN 9 in the CUDA toolkit tree or the system tree and defines CUDNN::cudnn.
include(FindPackageHandleStandardArgs)
find_path(CUDNN_INCLUDE_DIR cudnn.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV CUDNN_HOME
  PATHS /usr/include /usr/include/x86_64-linux-gnu /usr/local/include
  PATH_SUFFIXES include)
find_library(CUDNN_LIBRARY cudnn
  HINTS ${CUDAToolkit_LIBRARY_DIR} ENV CUDNN_HOME
  PATHS /usr/lib/x86_64-linux-gnu /usr/local/lib
  PATH_SUFFIXES lib lib64)
find_package_handle_standard_args(CUDNN REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR)
if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES
    IMPORTED_LOCATION "${CUDNN_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
endif()
