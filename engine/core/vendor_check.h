// Check macros for the vendor libraries. cuBLAS and cuDNN are oracles and benchmarks only (docs/architecture.md
// §2.6), so only tests and bench/ include this header with them; NCCL is the engine's transport.
#pragma once

#include "engine/core/error.h"

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define CUDP_CUBLAS_CHECK(call)                                                               \
  do {                                                                                        \
    const cublasStatus_t cudp_status_ = (call);                                               \
    if (cudp_status_ != CUBLAS_STATUS_SUCCESS) {                                              \
      CUDP_THROW(::cudp::LibraryError, #call " failed: ", cublasGetStatusName(cudp_status_), " (", \
                 cublasGetStatusString(cudp_status_), ")");                                   \
    }                                                                                         \
  } while (0)
#endif

#if __has_include(<cudnn.h>)
#include <cudnn.h>
#define CUDP_CUDNN_CHECK(call)                                                            \
  do {                                                                                    \
    const cudnnStatus_t cudp_status_ = (call);                                            \
    if (cudp_status_ != CUDNN_STATUS_SUCCESS) {                                           \
      CUDP_THROW(::cudp::LibraryError, #call " failed: ", cudnnGetErrorString(cudp_status_)); \
    }                                                                                     \
  } while (0)
#endif

#if __has_include(<nccl.h>)
#include <nccl.h>
#define CUDP_NCCL_CHECK(call)                                                             \
  do {                                                                                    \
    const ncclResult_t cudp_status_ = (call);                                             \
    if (cudp_status_ != ncclSuccess) {                                                    \
      CUDP_THROW(::cudp::LibraryError, #call " failed: ", ncclGetErrorString(cudp_status_), \
                 " (", ncclGetLastError(nullptr), ")");                                   \
    }                                                                                     \
  } while (0)
#endif
