// bench_comm: all-reduce bus bandwidth through cudp's Communicator (engine/parallel/comm.h) against
// raw NCCL, in the same run, on the same GPUs: fp32 sum, in place, sizes from --min to --max by
// powers of 2 (1 MiB to 1 GiB by default), plus VGG-16's fp32 gradients (138,357,544 floats,
// 553,430,176 bytes), the all-reduce of one data-parallel step.
//
//   cudp: Communicator::all_reduce over one tensor per device: events from each compute stream to
//         its comm stream, one ncclGroupStart/End over every rank, events back (NOTE [Comm stream
//         ordering and memory lifetime]).
//   NCCL: its own communicators (ncclCommInitAll), one stream per device, ncclAllReduce for every
//         rank inside one group.
//
// Both are timed alike: per repetition, an event on every device's stream before the call and one
// after it, then a wait for all; the repetition's time is the slowest device's. So host-side
// overhead before the kernels start (cudp's checks, events, lock) counts, as it does in a training
// step. Warm-up first, then the median of --reps repetitions, cudp and NCCL alternating so that
// clock drift hits both alike (each call waited for: the two never overlap). Bus bandwidth =
// bytes / time x 2(n-1)/n (NCCL's convention: the bytes each link moves in a ring, comparable
// across GPU counts).
//
// Before timing, each size is validated once for both paths: rank r holds (r+1) x p(j) at element j
// (p a short positional pattern), so the sum is n(n+1)/2 x p(j), exact in fp32; the first and last
// 4096 elements and 256 spread elements of every rank are checked on the host. A mismatch marks the
// row INVALID and the exit status 1. The options are checked first (a usage error, exit 2, as in
// the other bench programs), --json opened before anything is measured. --gpus N asks for N GPUs:
// with fewer visible it is an error (exit 2). Fewer than 2 GPUs, all that are visible or --gpus 1
// (scripts/bench-report.sh passes the machine's count), leave nothing to measure: it says so and
// exits 0, the --json file empty.
#include <cuda_runtime.h>
#include <nccl.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common/cli.h"
#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"
#include "engine/core/vendor_check.h"
#include "engine/parallel/comm.h"

namespace {

using namespace cudp;

constexpr uint64_t kVgg16GradBytes = 553'430'176;  // 138,357,544 fp32 gradients
constexpr int64_t kPatternPeriod = 4096;           // elements
constexpr int64_t kCheckEdge = 4096;               // elements checked at each end
constexpr int kCheckSpread = 256;                  // elements checked in between

// p(j): a positional pattern (period kPatternPeriod) of small integers, so that sums are exact.
float pattern(int64_t j) {
  return static_cast<float>((j % kPatternPeriod) * 7 % 13 + 1);
}

// Fills data[0, count) on `stream` with (rank+1) x p(j): one tile uploaded, then doubled in place
// with device-to-device copies (the tile length divides every prefix copied, so the pattern holds).
void fill(float* data, int64_t count, int rank, cudaStream_t stream) {
  std::vector<float> tile(static_cast<size_t>(std::min(count, kPatternPeriod)));
  for (size_t j = 0; j < tile.size(); ++j) {
    tile[j] = static_cast<float>(rank + 1) * pattern(static_cast<int64_t>(j));
  }
  CUDP_CUDA_CHECK(cudaMemcpyAsync(data, tile.data(), tile.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));
  for (int64_t done = static_cast<int64_t>(tile.size()); done < count;) {
    const int64_t n = std::min(done, count - done);
    CUDP_CUDA_CHECK(cudaMemcpyAsync(data + done, data, static_cast<size_t>(n) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream));
    done += n;
  }
  CUDP_CUDA_CHECK(cudaStreamSynchronize(stream));  // the tile is pageable host memory
}

// Checks the sampled elements of data[0, count) on `device` against n(n+1)/2 x p(j). Returns the
// first mismatch as text, or "" when all agree.
std::string check(const float* data, int64_t count, int device, int gpus) {
  cuda::DeviceGuard guard(device);
  const float ranks_sum = static_cast<float>(gpus * (gpus + 1) / 2);
  std::vector<int64_t> where;
  for (int64_t j = 0; j < std::min(count, kCheckEdge); ++j) where.push_back(j);
  for (int64_t j = std::max<int64_t>(0, count - kCheckEdge); j < count; ++j) where.push_back(j);
  for (int i = 0; i < kCheckSpread; ++i) where.push_back((count - 1) * i / (kCheckSpread - 1));
  std::vector<float> head(static_cast<size_t>(std::min(count, kCheckEdge)));
  std::vector<float> tail(head.size());
  CUDP_CUDA_CHECK(
      cudaMemcpy(head.data(), data, head.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CUDP_CUDA_CHECK(cudaMemcpy(tail.data(), data + (count - static_cast<int64_t>(tail.size())),
                             tail.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (const int64_t j : where) {
    float got = 0;
    if (j < static_cast<int64_t>(head.size())) {
      got = head[static_cast<size_t>(j)];
    } else if (j >= count - static_cast<int64_t>(tail.size())) {
      got = tail[static_cast<size_t>(j - (count - static_cast<int64_t>(tail.size())))];
    } else {
      CUDP_CUDA_CHECK(cudaMemcpy(&got, data + j, sizeof(float), cudaMemcpyDeviceToHost));
    }
    const float want = ranks_sum * pattern(j);
    if (got != want) {
      return detail::str("device ", device, " element ", j, ": got ", got, ", expected ", want);
    }
  }
  return "";
}

// Times fn() `reps` times after `warmup` calls: events on every device's stream around each call;
// a repetition lasts as long as its slowest device. Returns the median in ms.
struct Timer {
  std::vector<int> devices;
  std::vector<cudaStream_t> streams;  // one per device, where the events go
  std::vector<cuda::Event> start, stop;

  Timer(const std::vector<int>& ids, std::vector<cudaStream_t> s)
      : devices(ids), streams(std::move(s)) {
    for (const int d : devices) {
      start.push_back(cuda::Event::create(d, true));
      stop.push_back(cuda::Event::create(d, true));
    }
  }

  void sync() const {
    for (size_t i = 0; i < devices.size(); ++i) {
      cuda::DeviceGuard guard(devices[i]);
      CUDP_CUDA_CHECK(cudaStreamSynchronize(streams[i]));
    }
  }

  template <typename F>
  double once(const F& fn) const {
    for (size_t i = 0; i < devices.size(); ++i) {
      cuda::DeviceGuard guard(devices[i]);
      start[i].record(streams[i]);
    }
    fn();
    for (size_t i = 0; i < devices.size(); ++i) {
      cuda::DeviceGuard guard(devices[i]);
      stop[i].record(streams[i]);
    }
    double slowest = 0;
    for (size_t i = 0; i < devices.size(); ++i) {
      stop[i].synchronize();
      slowest = std::max(slowest, static_cast<double>(cuda::Event::elapsed_ms(start[i], stop[i])));
    }
    return slowest;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::string size_text(uint64_t bytes) {
  if (bytes == kVgg16GradBytes) return "553,430,176 B (VGG-16 grads)";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char text[32];
  std::snprintf(text, sizeof text, "%g %s", v, units[u]);
  return text;
}

struct Row {
  uint64_t bytes = 0;
  double cudp_ms = 0, nccl_ms = 0, cudp_busbw = 0, nccl_busbw = 0;
  bool valid = true;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_comm: all-reduce bus bandwidth, cudp's Communicator vs raw NCCL (fp32 sum)"};
  uint64_t min_bytes = uint64_t(1) << 20, max_bytes = uint64_t(1) << 30;
  int gpus = 0, warmup = 5, reps = 30;
  bool no_vgg = false;
  std::string json;
  app.add_option("--min", min_bytes,
                 "smallest size (bytes; units like 4M or 1GiB are powers of 1024)")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--max", max_bytes, "largest size; sizes are --min x 2^k up to this")
      ->transform(CLI::AsSizeValue(false))
      ->capture_default_str();
  app.add_option("--gpus", gpus,
                 "GPUs to use, devices 0..N-1; an all-reduce needs at least 2 (default: all "
                 "visible)")
      ->check(bench::whole_number(1));
  app.add_option("--warmup", warmup, "untimed calls per size and path")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  app.add_option("--reps", reps, "timed calls per size and path (median reported)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_flag("--no-vgg16", no_vgg, "leave out the 553,430,176-byte size (VGG-16's gradients)");
  app.add_option("--json", json, "write one JSON object per size (JSON lines) to this file");
  if (const auto status = bench::parse_command_line(app, "bench_comm", argc, argv)) return *status;

  try {
    if (min_bytes < 4) {
      throw bench::UsageError("--min " + size_text(min_bytes) +
                              ": give at least 4 bytes (one float)");
    }
    if (min_bytes > max_bytes) {
      throw bench::UsageError("--min " + size_text(min_bytes) + " is larger than --max " +
                              size_text(max_bytes) + "; give --min <= --max");
    }
    const int visible = cuda::device_count();
    // CUDA's reason when it finds no device at all (a driver missing or too old, say).
    const std::string why =
        visible == 0 ? detail::str(" (CUDA says: ", bench::cuda_device_problem(), ")") : "";
    if (gpus > visible) {
      throw bench::UsageError(detail::str(
          "--gpus ", gpus, ": ", visible, visible == 1 ? " GPU is" : " GPUs are", " visible", why,
          "; give at most as many as are visible, or leave --gpus out"));
    }
    // After the checks above, so that a refused command line leaves an earlier result in place.
    std::FILE* out = json.empty() ? nullptr : bench::open_json(json);
    const bool one_asked = gpus == 1;
    if (gpus == 0) gpus = visible;
    if (gpus < 2) {
      const std::string used =
          one_asked ? std::string("--gpus 1 asks for 1") : detail::str(visible, " visible", why);
      std::printf("bench_comm: nothing to measure: an all-reduce needs at least 2 GPUs; %s\n",
                  used.c_str());
      if (out) std::fclose(out);
      return 0;
    }

    // The sizes: powers of 2 times --min (rounded to whole floats), and VGG-16's gradients.
    std::vector<uint64_t> sizes;
    for (uint64_t b = min_bytes; b <= max_bytes; b *= 2) {
      sizes.push_back((b + 3) / 4 * 4);
      if (b > max_bytes / 2) break;
    }
    if (!no_vgg) sizes.push_back(kVgg16GradBytes);
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    const uint64_t largest = sizes.back();
    const auto max_count = static_cast<int64_t>(largest / sizeof(float));

    std::vector<int> ids;
    for (int i = 0; i < gpus; ++i) ids.push_back(i);
    int nccl_version = 0;
    CUDP_NCCL_CHECK(ncclGetVersion(&nccl_version));
    std::printf("bench_comm: %d x %s, NCCL %d, fp32 sum in place, warm-up %d, median of %d\n", gpus,
                cuda::device_name(0).c_str(), nccl_version, warmup, reps);

    // cudp: the Communicator and one tensor per device, on the devices' compute streams.
    parallel::Communicator comm(ids);
    std::vector<Tensor> cudp_buffers;
    std::vector<cudaStream_t> compute;
    for (const int d : ids) {
      cudp_buffers.push_back(Tensor::empty({max_count}, DType::f32, Device::cuda(d)));
      compute.push_back(cuda::current_stream(d));
    }

    // Raw NCCL: its own communicators, streams and buffers.
    std::vector<ncclComm_t> comms(ids.size(), nullptr);
    CUDP_NCCL_CHECK(ncclCommInitAll(comms.data(), gpus, ids.data()));
    std::vector<cudaStream_t> streams(ids.size(), nullptr);
    std::vector<float*> nccl_buffers(ids.size(), nullptr);
    for (size_t i = 0; i < ids.size(); ++i) {
      cuda::DeviceGuard guard(ids[i]);
      CUDP_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
      CUDP_CUDA_CHECK(cudaMalloc(&nccl_buffers[i], largest));
    }

    const Timer cudp_timer(ids, compute);
    const Timer nccl_timer(ids, streams);
    const double bus_factor = 2.0 * (gpus - 1) / gpus;

    std::vector<Row> rows;
    bool all_valid = true;
    for (const uint64_t bytes : sizes) {
      const auto count = static_cast<int64_t>(bytes / sizeof(float));
      TensorList tensors;
      for (const Tensor& t : cudp_buffers) tensors.push_back(t.slice(0, count));
      const auto cudp_call = [&] { comm.all_reduce(tensors, parallel::ReduceOp::Sum); };
      const auto nccl_call = [&] {
        CUDP_NCCL_CHECK(ncclGroupStart());
        for (size_t i = 0; i < ids.size(); ++i) {
          CUDP_NCCL_CHECK(ncclAllReduce(nccl_buffers[i], nccl_buffers[i],
                                        static_cast<size_t>(count), ncclFloat32, ncclSum, comms[i],
                                        streams[i]));
        }
        CUDP_NCCL_CHECK(ncclGroupEnd());
      };

      // Validate both paths once from freshly filled buffers.
      Row row;
      row.bytes = bytes;
      for (size_t i = 0; i < ids.size(); ++i) {
        cuda::DeviceGuard guard(ids[i]);
        fill(tensors[i].data<float>(), count, static_cast<int>(i), compute[i]);
        fill(nccl_buffers[i], count, static_cast<int>(i), streams[i]);
      }
      // The two sets of communicators never run at once: concurrent collectives of different
      // communicators on the same GPUs may wait on each other (NCCL's documentation).
      cudp_call();
      cudp_timer.sync();
      nccl_call();
      nccl_timer.sync();
      for (size_t i = 0; i < ids.size(); ++i) {
        for (const auto& [what, data] :
             {std::pair{"cudp", static_cast<const float*>(tensors[i].data<float>())},
              std::pair{"NCCL", static_cast<const float*>(nccl_buffers[i])}}) {
          const std::string error = check(data, count, ids[i], gpus);
          if (!error.empty() && row.valid) {
            std::fprintf(stderr, "bench_comm: %s all-reduce of %s is wrong: %s\n", what,
                         size_text(bytes).c_str(), error.c_str());
            row.valid = false;
          }
        }
      }
      all_valid &= row.valid;

      // Time them, alternating. The buffers keep being summed in place: the values grow (to inf
      // at worst), which changes nothing in the time of a sum.
      for (int i = 0; i < warmup; ++i) {
        cudp_call();
        cudp_timer.sync();
        nccl_call();
        nccl_timer.sync();
      }
      std::vector<double> cudp_ms, nccl_ms;
      for (int i = 0; i < reps; ++i) {
        cudp_ms.push_back(cudp_timer.once(cudp_call));
        nccl_ms.push_back(nccl_timer.once(nccl_call));
      }
      row.cudp_ms = median(cudp_ms);
      row.nccl_ms = median(nccl_ms);
      row.cudp_busbw = static_cast<double>(bytes) / (row.cudp_ms * 1e-3) / 1e9 * bus_factor;
      row.nccl_busbw = static_cast<double>(bytes) / (row.nccl_ms * 1e-3) / 1e9 * bus_factor;
      rows.push_back(row);
      std::fprintf(stderr, "  %s: cudp %.3f ms, NCCL %.3f ms\n", size_text(bytes).c_str(),
                   row.cudp_ms, row.nccl_ms);
    }

    for (size_t i = 0; i < ids.size(); ++i) {
      cuda::DeviceGuard guard(ids[i]);
      CUDP_CUDA_CHECK(cudaFree(nccl_buffers[i]));
      CUDP_CUDA_CHECK(cudaStreamDestroy(streams[i]));
    }
    CUDP_NCCL_CHECK(ncclGroupStart());
    for (ncclComm_t c : comms) CUDP_NCCL_CHECK(ncclCommFinalize(c));
    CUDP_NCCL_CHECK(ncclGroupEnd());
    for (ncclComm_t c : comms) ncclCommDestroy(c);

    std::printf("\nall-reduce, %d GPUs, bus bandwidth = bytes / time x 2(n-1)/n\n\n", gpus);
    std::printf(
        "| size | bytes | cudp ms | NCCL ms | cudp GB/s | NCCL GB/s | cudp/NCCL |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n");
    for (const Row& r : rows) {
      std::printf("| %s%s | %llu | %.3f | %.3f | %.1f | %.1f | %.3f |\n",
                  size_text(r.bytes).c_str(), r.valid ? "" : " (INVALID)",
                  static_cast<unsigned long long>(r.bytes), r.cudp_ms, r.nccl_ms, r.cudp_busbw,
                  r.nccl_busbw, r.nccl_busbw > 0 ? r.cudp_busbw / r.nccl_busbw : 0.0);
    }
    if (out) {
      for (const Row& r : rows) {
        std::fprintf(out,
                     "{\"op\": \"allreduce\", \"bytes\": %llu, \"gpus\": %d, \"dtype\": \"f32\", "
                     "\"cudp_busbw_gbs\": %.3f, \"nccl_busbw_gbs\": %.3f, \"cudp_ms\": %.6f, "
                     "\"nccl_ms\": %.6f, \"vgg16_grads\": %s, \"valid\": %s}\n",
                     static_cast<unsigned long long>(r.bytes), gpus, r.cudp_busbw, r.nccl_busbw,
                     r.cudp_ms, r.nccl_ms, r.bytes == kVgg16GradBytes ? "true" : "false",
                     r.valid ? "true" : "false");
      }
      std::fclose(out);
    }
    return all_valid ? 0 : 1;
  } catch (const std::exception& e) {
    // A usage error (bench::UsageError) and a failed run alike: 2, as bench::kExitUsage; 1 means
    // a wrong sum.
    bench::print_error("bench_comm", e);
    return bench::kExitUsage;
  }
}
