// Compiled only when cudp is built with MPI (CMakeLists.txt: the cudp_mpi object library); the
// stand-ins of a build without it are in process_group.cpp.
#include "engine/parallel/mpi_bootstrap.h"

#include <mpi.h>

#include <climits>
#include <cstdlib>

namespace cudp::parallel::mpi {
namespace {

void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  CUDP_THROW(LibraryError, call, " failed: ", std::string(text, static_cast<size_t>(length)));
}

}  // namespace

bool available() {
  return true;
}

Session::Session() {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    owns_ = true;
    if (provided < MPI_THREAD_SERIALIZED) {
      MPI_Finalize();
      CUDP_THROW(LibraryError, "MPI_Init_thread: this MPI provides thread level ", provided,
                 ", below MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED,
                 "), which cudp needs (it may call MPI from a thread other than main); use an MPI "
                 "built with thread support (Debian's Open MPI is)");
    }
  }
  check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
}

Session::~Session() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

LaunchInfo Session::info() const {
  LaunchInfo info;
  info.source = "MPI";
  check(MPI_Comm_rank(MPI_COMM_WORLD, &info.rank), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &info.world_size), "MPI_Comm_size");
  MPI_Comm node = MPI_COMM_NULL;
  check(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info.rank, MPI_INFO_NULL, &node),
        "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
  const int status = MPI_Comm_rank(node, &info.local_rank);
  MPI_Comm_free(&node);
  check(status, "MPI_Comm_rank of this machine's ranks");
  return info;
}

void Session::broadcast(void* data, size_t bytes, int root) const {
  CUDP_CHECK(bytes <= static_cast<size_t>(INT_MAX), "mpi::Session::broadcast: ", bytes,
             " bytes is more than one MPI_Bcast of MPI_BYTE carries (", INT_MAX, ")");
  check(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
}

void Session::all_reduce_sum(float* data, size_t count) const {
  CUDP_CHECK(count <= static_cast<size_t>(INT_MAX), "mpi::Session::all_reduce_sum: ", count,
             " floats is more than one MPI_Allreduce carries (", INT_MAX, "); split it");
  check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD),
        "MPI_Allreduce");
}

int64_t Session::all_reduce_sum(int64_t value) const {
  int64_t sum = 0;
  check(MPI_Allreduce(&value, &sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
  return sum;
}

void Session::all_gather(const void* data, size_t bytes, void* out) const {
  CUDP_CHECK(bytes <= static_cast<size_t>(INT_MAX), "mpi::Session::all_gather: ", bytes,
             " bytes is more than one MPI_Allgather of MPI_BYTE carries (", INT_MAX, "); split it");
  check(MPI_Allgather(data, static_cast<int>(bytes), MPI_BYTE, out, static_cast<int>(bytes),
                      MPI_BYTE, MPI_COMM_WORLD),
        "MPI_Allgather");
}

void Session::barrier() const {
  check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

void Session::abort(int code) const {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; should an implementation's do, end anyway
}

}  // namespace cudp::parallel::mpi
