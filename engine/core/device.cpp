#include "engine/core/device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "engine/core/error.h"

namespace cudp {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

std::ostream& operator<<(std::ostream& out, const Device& device) { return out << device.str(); }

namespace detail {

std::string cuda_unavailable_reason(int count_status, int count, int driver_version,
                                    int runtime_version, const cuda::VisibleDevices& visible) {
  const auto status = static_cast<cudaError_t>(count_status);
  if (status == cudaSuccess && count > 0) return "";
  if (driver_version == 0) return "";  // no NVIDIA driver: a machine without GPUs
  const auto version = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  };
  if (status == cudaErrorInsufficientDriver) {
    return "the NVIDIA driver supports CUDA " + version(driver_version) + " and cudp needs " +
           version(runtime_version) + ": update the driver";
  }
  // A mask that names GPUs (ids or UUIDs) and leaves none is a mistake; one that names none ("",
  // "-1", a launcher's "NoDevFiles": CUDA stops at the first entry it cannot read) hides them on
  // purpose, as a driver without GPUs (a CPU host with the driver's libraries) simply has none.
  if (visible.set && !visible.entries.empty()) {
    return "CUDA_VISIBLE_DEVICES=\"" + visible.raw +
           "\" leaves no GPU visible: check it against nvidia-smi -L (ids or GPU-... UUIDs), or "
           "unset it";
  }
  if (status == cudaSuccess || status == cudaErrorNoDevice) return "";
  return std::string("CUDA cannot start: ") + cudaGetErrorName(status) + " (" +
         cudaGetErrorString(status) + "): check the driver with nvidia-smi";
}

}  // namespace detail

namespace cuda {
namespace {

std::string visible_description() {
  const VisibleDevices v = visible_devices();
  if (!v.set) return "CUDA_VISIBLE_DEVICES is unset";
  return "CUDA_VISIBLE_DEVICES=\"" + v.raw + "\"";
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

bool is_index(const std::string& s) {
  return !s.empty() && s.size() < 10 && std::all_of(s.begin(), s.end(), [](char c) {
    return c >= '0' && c <= '9';
  });
}

}  // namespace

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the sticky-free error and report zero
    return 0;
  }
  return count;
}

bool is_available() { return device_count() > 0; }

std::string unavailable_reason() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) cudaGetLastError();
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = CUDART_VERSION;
  return cudp::detail::cuda_unavailable_reason(status, count, driver, runtime, visible_devices());
}

// "no CUDA device is visible (CUDA_VISIBLE_DEVICES ...; why)", for device_count() == 0.
std::string no_device_text() {
  const std::string reason = unavailable_reason();
  return "no CUDA device is visible (" + visible_description() +
         (reason.empty() ? "" : "; " + reason) + ")";
}

void check_device(int device) {
  const int count = device_count();
  if (count == 0) CUDP_THROW(ValueError, "invalid device id ", device, ": ", no_device_text());
  if (device < 0 || device >= count) {
    CUDP_THROW(ValueError, "invalid device id ", device, ": valid ids are 0..", count - 1, " (",
               count, " visible; ", visible_description(), ")");
  }
}

void require_available(const char* what) {
  if (device_count() == 0) CUDP_THROW(ValueError, what, ": ", no_device_text());
}

namespace {

// cudaGetDevice. Where it fails, `no_gpu()` throws its error when there is no usable GPU (the
// usual cause: CUDA's own error then reads as if the driver were too old); else CUDA's error.
template <typename NoGpu>
int query_current_device(NoGpu no_gpu) {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) {
    cudaGetLastError();
    no_gpu();
    detail::throw_cuda(status, "cudaGetDevice", __FILE__, __LINE__);
  }
  return device;
}

}  // namespace

int current_device() {
  return query_current_device([] { require_available("cuda::current_device"); });
}

void set_device(int device) {
  check_device(device);
  CUDP_CUDA_CHECK(cudaSetDevice(device));
}

void synchronize(int device) {
  if (device < 0) {
    CUDP_CUDA_CHECK(cudaDeviceSynchronize());
    return;
  }
  DeviceGuard guard(device);
  CUDP_CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceProperties get_device_properties(int device) {
  check_device(device);
  cudaDeviceProp prop{};
  CUDP_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceProperties p;
  p.index = device;
  p.physical = physical_id(device);
  p.name = prop.name;
  p.total_memory = prop.totalGlobalMem;
  p.multiprocessors = prop.multiProcessorCount;
  p.major = prop.major;
  p.minor = prop.minor;
  char bus[32] = {};
  CUDP_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  p.pci_bus_id = bus;
  p.l2_cache = static_cast<size_t>(prop.l2CacheSize);
  p.shared_memory_per_block_optin = prop.sharedMemPerBlockOptin;
  return p;
}

std::string device_name(int device) { return get_device_properties(device).name; }

std::vector<std::vector<bool>> peer_access_matrix() {
  const int count = device_count();
  std::vector<std::vector<bool>> can(count, std::vector<bool>(count, false));
  for (int i = 0; i < count; ++i) {
    for (int j = 0; j < count; ++j) {
      if (i == j) {
        can[i][j] = true;
        continue;
      }
      int ok = 0;
      CUDP_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, i, j));
      can[i][j] = ok != 0;
    }
  }
  return can;
}

void enable_peer_access(int device, int peer) {
  check_device(device);
  check_device(peer);
  if (device == peer) return;
  DeviceGuard guard(device);
  const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return;
  }
  CUDP_CUDA_CHECK(status);
}

VisibleDevices parse_visible_devices(const char* value) {
  VisibleDevices v;
  if (value == nullptr) return v;
  v.set = true;
  v.raw = value;
  std::set<std::string> seen;
  size_t start = 0;
  const std::string s = value;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    const std::string entry = trim(s.substr(start, comma - start));
    const bool uuid = entry.rfind("GPU-", 0) == 0 || entry.rfind("MIG-", 0) == 0;
    std::string key = entry;
    if (is_index(entry)) key = std::to_string(std::stoi(entry));  // "04" and "4" are one GPU
    if (!(is_index(entry) || uuid) || seen.count(key)) break;    // CUDA stops at the first bad entry
    seen.insert(key);
    v.entries.push_back(key);
    start = comma + 1;
  }
  return v;
}

VisibleDevices visible_devices() { return parse_visible_devices(std::getenv("CUDA_VISIBLE_DEVICES")); }

std::string physical_id(int device, const VisibleDevices& visible) {
  if (!visible.set) return std::to_string(device);
  if (device >= 0 && device < static_cast<int>(visible.entries.size())) return visible.entries[device];
  return "?";
}

std::string physical_id(int device) { return physical_id(device, visible_devices()); }

std::optional<std::string> imbalance_warning(const std::vector<DeviceProperties>& devices) {
  if (devices.size() < 2) return std::nullopt;
  auto check = [&](auto value) -> std::optional<std::string> {
    const auto [lo, hi] = std::minmax_element(devices.begin(), devices.end(),
                                              [&](const auto& a, const auto& b) {
                                                return value(a) < value(b);
                                              });
    if (static_cast<double>(value(*lo)) < 0.75 * static_cast<double>(value(*hi))) {
      return detail::str(
          "There is an imbalance between your GPUs. You may want to exclude GPU ", lo->index,
          " which has less than 75% of the memory or cores of GPU ", hi->index,
          ". You can do so by setting the device_ids argument to DataParallel, or by setting the "
          "CUDA_VISIBLE_DEVICES environment variable.");
    }
    return std::nullopt;
  };
  if (auto w = check([](const DeviceProperties& p) { return p.total_memory; })) return w;
  return check([](const DeviceProperties& p) { return static_cast<size_t>(p.multiprocessors); });
}

// Without a usable GPU, the error names the device asked for (check_device's), not the query.
DeviceGuard::DeviceGuard(int device)
    : previous_(query_current_device([device] { check_device(device); })) {
  if (device != previous_) set_device(device);
}

DeviceGuard::~DeviceGuard() {
  // Destructors never throw: restoring a device that was valid before cannot reasonably fail.
  cudaSetDevice(previous_);
}

}  // namespace cuda
}  // namespace cudp
