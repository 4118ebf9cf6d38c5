#include "engine/core/device.h"
#include <cuda_runtime_api.h>
namespace cudp::cuda { int device_count() { int n = 0; if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; } return n; } }
