#include "engine/parallel/process_group.h"

#include <charconv>
#include <cstring>
#include <optional>
#include <utility>

#include "engine/core/device.h"
#include "engine/parallel/mpi_bootstrap.h"

namespace cudp::parallel {
namespace {

struct EnvSet {
  const char* source;
  const char* rank;
  const char* size;
  const char* local_rank;
};

// The order is the header comment's.
constexpr EnvSet kEnvSets[] = {
    {"OMPI_COMM_WORLD_*", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK"},
    {"PMI_*", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {"SLURM_*", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

std::optional<int> read_int(const GetEnv& getenv, const char* name) {
  const char* text = getenv(name);
  if (!text) return std::nullopt;
  int value = -1;
  const char* end = text + std::strlen(text);
  const auto [ptr, ec] = std::from_chars(text, end, value);
  CUDP_CHECK(ec == std::errc() && ptr == end && ptr != text && value >= 0, "the environment has ",
             name, "=\"", text, "\", which is not a whole number >= 0; the launcher sets it, so ",
             "unset it if it is left over from elsewhere");
  return value;
}

}  // namespace

LaunchInfo launch_info_from_env(const GetEnv& getenv) {
  for (const EnvSet& set : kEnvSets) {
    const std::optional<int> rank = read_int(getenv, set.rank);
    const std::optional<int> size = read_int(getenv, set.size);
    const std::optional<int> local = read_int(getenv, set.local_rank);
    if (!rank && !size && !local) continue;
    CUDP_CHECK(rank && size && local, "the environment has only some of ", set.rank, ", ", set.size,
               " and ", set.local_rank, " (", set.rank, rank ? " set" : " unset", ", ", set.size,
               size ? " set" : " unset", ", ", set.local_rank, local ? " set" : " unset",
               "); a launcher sets all three, so unset the others");
    CUDP_CHECK(*size >= 1 && *rank < *size, "the environment says rank ", set.rank, "=", *rank,
               " of ", set.size, "=", *size, ": the rank must be below the size");
    CUDP_CHECK(*local <= *rank, "the environment says local rank ", set.local_rank, "=", *local,
               " above the global rank ", set.rank, "=", *rank,
               ": a machine cannot hold more ranks than the world");
    return LaunchInfo{*rank, *size, *local, set.source};
  }
  return LaunchInfo{};
}

int device_for_local_rank(int local_rank, int visible) {
  CUDP_CHECK(local_rank >= 0, "local rank ", local_rank, " is negative");
  if (visible == 1) return 0;  // the launcher gave this process its GPU
  CUDP_CHECK(local_rank < visible, "local rank ", local_rank, " has no GPU: this machine shows ",
             visible, " CUDA device", visible == 1 ? "" : "s", ", one per process; start at most ",
             visible, " processes per machine (mpirun -np / -H host:", visible,
             ", srun --ntasks-per-node) or make more devices visible (CUDA_VISIBLE_DEVICES)");
  return local_rank;
}

ProcessGroup::ProcessGroup(LaunchInfo info, std::shared_ptr<Communicator> comm)
    : info_(std::move(info)), comm_(std::move(comm)) {}

std::shared_ptr<ProcessGroup> ProcessGroup::local(const std::vector<int>& device_ids,
                                                  ProcessGroupOptions options) {
  auto comm = std::make_shared<Communicator>(device_ids);
  comm->set_timeout(options.timeout);
  LaunchInfo info;
  info.world_size = comm->world_size();
  return std::make_shared<ProcessGroup>(std::move(info), std::move(comm));
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(const LaunchInfo& info, int device,
                                                   const Broadcast& broadcast,
                                                   ProcessGroupOptions options) {
  CUDP_CHECK(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size,
             "ProcessGroup: rank ", info.rank, " is outside a world of ", info.world_size,
             " ranks (from ", info.source, ")");
  // Rank 0's id, with a flag: if rank 0 cannot make one, the others learn it from the broadcast
  // they are already waiting in, instead of waiting forever.
  struct {
    ncclUniqueId id;
    uint8_t ok;
  } message{};
  std::string failure;
  if (info.rank == 0) {
    try {
      message.id = Communicator::unique_id();
      message.ok = 1;
    } catch (const Error& e) {
      failure = e.message();
    }
  }
  broadcast(&message, sizeof message, 0);
  if (!failure.empty()) {
    CUDP_THROW(LibraryError, "ProcessGroup: rank 0 could not get an NCCL unique id: ", failure);
  }
  CUDP_CHECK(message.ok == 1, "ProcessGroup: rank ", info.rank,
             " received no NCCL unique id: rank 0 failed to make one (see its error)");
  auto comm = std::make_shared<Communicator>(device, info.rank, info.world_size, message.id);
  comm->set_timeout(options.timeout);
  return std::make_shared<ProcessGroup>(info, std::move(comm));
}

std::shared_ptr<ProcessGroup> ProcessGroup::from_mpi(const mpi::Session& session,
                                                     ProcessGroupOptions options, int device) {
  const LaunchInfo info = session.info();
  if (device < 0) device = device_for_local_rank(info.local_rank, cuda::device_count());
  return create(
      info, device,
      [&session](void* data, size_t bytes, int root) { session.broadcast(data, bytes, root); },
      options);
}

#if !CUDP_HAVE_MPI
// This build has no MPI (CMakeLists.txt: CUDP_WITH_MPI, and MPI found at configure time).
namespace mpi {
namespace {
[[noreturn]] void unavailable(const char* what) {
  CUDP_THROW(ValueError, "mpi::", what,
             ": this cudp was built without MPI; install Open MPI (Debian: libopenmpi-dev "
             "openmpi-bin) and configure again with -DCUDP_WITH_MPI=ON");
}
}  // namespace

bool available() {
  return false;
}
Session::Session() {
  unavailable("Session");
}
Session::~Session() = default;
LaunchInfo Session::info() const {
  unavailable("Session::info");
}
void Session::broadcast(void*, size_t, int) const {
  unavailable("Session::broadcast");
}
void Session::barrier() const {
  unavailable("Session::barrier");
}
void Session::all_reduce_sum(float*, size_t) const {
  unavailable("Session::all_reduce_sum");
}
int64_t Session::all_reduce_sum(int64_t) const {
  unavailable("Session::all_reduce_sum");
}
void Session::all_gather(const void*, size_t, void*) const {
  unavailable("Session::all_gather");
}
void Session::abort(int) const {
  unavailable("Session::abort");
}
}  // namespace mpi
#endif

}  // namespace cudp::parallel
