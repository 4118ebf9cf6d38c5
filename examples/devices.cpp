// cudp-devices: the seed program's first half. Lists the GPUs this process sees, shows the current
// device, switches it with set_device, explains the CUDA_VISIBLE_DEVICES mapping, prints the
// peer-access matrix, and warns (as PyTorch's DataParallel does) when the GPUs are imbalanced.
//
//   cudp-devices
//   CUDA_VISIBLE_DEVICES=1 cudp-devices      # one device: id 0 is physical GPU 1
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <cudp/cudp.h>

using namespace cudp;

namespace {

void print_devices(const std::vector<cuda::DeviceProperties>& devices) {
  std::printf("%-4s %-9s %-28s %10s %5s %4s  %s\n", "id", "physical", "name", "memory", "SMs", "cc",
              "PCI bus id");
  for (const auto& d : devices) {
    std::printf("%-4d %-9s %-28s %6.1f GiB %5d %d.%d  %s\n", d.index, d.physical.c_str(),
                d.name.c_str(), static_cast<double>(d.total_memory) / (1 << 30), d.multiprocessors,
                d.major, d.minor, d.pci_bus_id.c_str());
  }
}

void print_visible_mapping(int count) {
  const cuda::VisibleDevices visible = cuda::visible_devices();
  if (!visible.set) {
    std::printf("CUDA_VISIBLE_DEVICES is unset: every GPU is visible under its own number.\n");
    return;
  }
  std::printf("CUDA_VISIBLE_DEVICES=\"%s\": the program sees %d device(s)", visible.raw.c_str(), count);
  for (int i = 0; i < count; ++i) {
    std::printf("%s id %d is physical GPU %s", i ? "," : ":", i, cuda::physical_id(i).c_str());
  }
  std::printf(".\n");
  const char* order = std::getenv("CUDA_DEVICE_ORDER");
  if (!order || std::string(order) != "PCI_BUS_ID") {
    std::printf("Set CUDA_DEVICE_ORDER=PCI_BUS_ID for these physical numbers to match nvidia-smi.\n");
  }
}

void print_peer_matrix(int count) {
  const auto can = cuda::peer_access_matrix();
  std::printf("peer access (row reads column):\n     ");
  for (int j = 0; j < count; ++j) std::printf(" %4d", j);
  std::printf("\n");
  for (int i = 0; i < count; ++i) {
    std::printf("  %2d ", i);
    for (int j = 0; j < count; ++j) std::printf(" %4s", i == j ? "-" : (can[i][j] ? "yes" : "no"));
    std::printf("\n");
  }
}

const char* const kUsage =
    "Usage: cudp-devices [-h|--help]\n"
    "Lists the CUDA devices this process sees (id, physical GPU, name, memory, SMs, compute\n"
    "capability, PCI bus id), the CUDA_VISIBLE_DEVICES mapping and the peer-access matrix, switches\n"
    "the current device once to show set_device, and warns when the GPUs are imbalanced.\n"
    "  CUDA_VISIBLE_DEVICES=1 cudp-devices    # one device: id 0 is physical GPU 1\n"
    "Exit status: 0 success; 1 a CUDA error; 2 the command line is wrong.\n";

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::fprintf(stderr, "cudp-devices: unexpected argument \"%s\"\n%s", arg.c_str(), kUsage);
    return 2;
  }
  try {
    const int count = cuda::device_count();
    std::printf("cudp sees %d CUDA device(s); CUDA available: %s\n", count,
                cuda::is_available() ? "yes" : "no");
    print_visible_mapping(count);
    if (count == 0) {
      // A machine without GPUs is not an error; an old driver or a mask that hides every GPU is.
      const std::string reason = cuda::unavailable_reason();
      if (reason.empty()) return 0;
      std::fprintf(stderr, "cudp-devices: %s\n", reason.c_str());
      return 1;
    }

    std::vector<cuda::DeviceProperties> devices;
    for (int i = 0; i < count; ++i) devices.push_back(cuda::get_device_properties(i));
    print_devices(devices);

    std::printf("current device: %d\n", cuda::current_device());
    const int last = count - 1;
    cuda::set_device(last);
    std::printf("after set_device(%d): current device: %d (%s)\n", last, cuda::current_device(),
                cuda::device_name(last).c_str());
    cuda::set_device(0);

    print_peer_matrix(count);
    if (auto warning = cuda::imbalance_warning(devices)) std::printf("warning: %s\n", warning->c_str());
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "cudp-devices: %s\n", e.message().c_str());
    return 1;
  }
}
