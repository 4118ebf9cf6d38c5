// Devices: which GPUs the program sees, which one is current, and what they are
// (docs/architecture.md §4).
//
// cudp follows CUDA's numbering. With CUDA_VISIBLE_DEVICES=0,4 the program sees two devices, ids 0
// and 1, and id 1 is physical GPU 4; `physical_id(1)` says so. Set CUDA_DEVICE_ORDER=PCI_BUS_ID for
// those physical numbers to match nvidia-smi's. An id outside [0, device_count()) is an error
// naming the valid range and the visible set.
#pragma once

#include <cstddef>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace cudp {

enum class DeviceType { CPU, CUDA };

// Where a tensor or a module lives: the host, or CUDA device `index` (a visible-device id).
struct Device {
  DeviceType type = DeviceType::CPU;
  int index = -1;

  static Device cpu() { return {DeviceType::CPU, -1}; }
  static Device cuda(int index) { return {DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;  // "cpu" or "cuda:1", as PyTorch prints them
  friend bool operator==(const Device&, const Device&) = default;
};

std::ostream& operator<<(std::ostream& out, const Device& device);

namespace cuda {

// Number of visible CUDA devices; 0 (never an exception) where there is no driver or no GPU, or
// where CUDA cannot start (unavailable_reason() then says why), as torch.cuda.device_count().
int device_count();
bool is_available();

// Why device_count() is 0 when that is not simply a machine without GPUs: "" when CUDA sees a
// device, when there are none to see (no NVIDIA driver, or a driver and no GPU), or when
// CUDA_VISIBLE_DEVICES names no device ("", "-1": no GPU is what was asked); otherwise what CUDA
// said and what to do (a driver older than this CUDA runtime, a CUDA_VISIBLE_DEVICES whose ids or
// UUIDs match no GPU, another error). A program that would fall back to the CPU by default
// reports this instead, so that a broken set-up is never a silent CPU run.
std::string unavailable_reason();

// The calling thread's current device (require_available's error without a usable GPU), and
// switching it (validated: see check_device).
int current_device();
void set_device(int device);

// Throws ValueError unless 0 <= device < device_count(), naming the range and CUDA_VISIBLE_DEVICES.
void check_device(int device);

// Throws ValueError "<what>: no CUDA device is visible (CUDA_VISIBLE_DEVICES ...; why)" when
// device_count() is 0: what a call that needs CUDA says on a machine without a usable GPU, instead
// of the CUDA runtime's own error (which, without a driver, reads as if the driver were too old).
void require_available(const char* what);

// Waits for all work on `device` (the current device when -1).
void synchronize(int device = -1);

struct DeviceProperties {
  int index = 0;             // visible id
  std::string physical;      // physical GPU as named by CUDA_VISIBLE_DEVICES ("4", "GPU-<uuid>")
  std::string name;
  size_t total_memory = 0;   // bytes
  int multiprocessors = 0;
  int major = 0, minor = 0;  // compute capability
  std::string pci_bus_id;    // "0000:1B:00.0"
  size_t l2_cache = 0;
  size_t shared_memory_per_block_optin = 0;
};

DeviceProperties get_device_properties(int device);
std::string device_name(int device);

// can_access[i][j]: device i can read device j's memory directly (NVLink/PCIe P2P).
std::vector<std::vector<bool>> peer_access_matrix();
// Enables peer access from `device` to `peer` (idempotent).
void enable_peer_access(int device, int peer);

// CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated entries, each a non-negative index or a
// GPU-/MIG- UUID; the list ends at the first entry that is invalid or repeated. `set` is false when
// the variable is unset (every GPU visible).
struct VisibleDevices {
  bool set = false;
  std::string raw;
  std::vector<std::string> entries;
};
VisibleDevices parse_visible_devices(const char* value);
VisibleDevices visible_devices();  // from the environment

// The physical GPU behind visible id `device`, as CUDA_VISIBLE_DEVICES names it (the id itself when
// the variable is unset).
std::string physical_id(int device);
std::string physical_id(int device, const VisibleDevices& visible);

// PyTorch's DataParallel warning: a GPU with less than 75% of the memory or multiprocessors of the
// strongest. Returns the warning text, or nothing when the devices are balanced.
std::optional<std::string> imbalance_warning(const std::vector<DeviceProperties>& devices);

// Makes `device` current for its lifetime and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

}  // namespace cuda

namespace detail {
// cuda::unavailable_reason()'s decision from what CUDA reported: cudaGetDeviceCount's status (a
// cudaError_t) and count, cudaDriverGetVersion's version (0: no driver installed) and the
// runtime's version.
std::string cuda_unavailable_reason(int count_status, int count, int driver_version,
                                    int runtime_version, const cuda::VisibleDevices& visible);
}  // namespace detail
}  // namespace cudp
