#include "engine/parallel/parallel_apply.h"

#include <cxxabi.h>

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>

#include "engine/core/memory.h"
#include "engine/core/stream.h"

namespace cudp::parallel {

// ---- the persistent worker thread ---------------------------------------------------------------

// The queue lives in a shared_ptr that the thread holds too, so the thread never touches freed
// memory, whichever side finishes last.
struct WorkerQueue {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<std::function<void()>> jobs;
  bool stop = false;
};

namespace {
thread_local const WorkerQueue* t_worker_queue =
    nullptr;  // the queue this thread serves, if a worker
}  // namespace

class Worker {
 public:
  explicit Worker(int device) : queue_(std::make_shared<WorkerQueue>()) {
    thread_ = std::thread([queue = queue_, device] { loop(*queue, device); });
  }

  ~Worker() {
    {
      std::lock_guard lock(queue_->mutex);
      queue_->stop = true;
    }
    queue_->ready.notify_one();
    // The last handle dropped by a job on this very thread cannot join itself; the thread finishes
    // its queue and exits on its own, holding the queue alive.
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }

  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;
  Worker(Worker&&) = delete;
  Worker& operator=(Worker&&) = delete;

  void post(std::function<void()> job) {
    {
      std::lock_guard lock(queue_->mutex);
      queue_->jobs.push_back(std::move(job));
    }
    queue_->ready.notify_one();
  }

  bool is_calling_thread() const { return t_worker_queue == queue_.get(); }

 private:
  static void loop(WorkerQueue& queue, int device) {
    t_worker_queue = &queue;
    // Once per thread; a failure here shows again, with a message, when a job sets the device.
    if (device >= 0 && cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(queue.mutex);
        queue.ready.wait(lock, [&] { return queue.stop || !queue.jobs.empty(); });
        if (queue.jobs.empty()) return;  // stopped, and nothing left to run
        job = std::move(queue.jobs.front());
        queue.jobs.pop_front();
      }
      job();  // never throws: run() wraps every job
    }
  }

  std::shared_ptr<WorkerQueue> queue_;
  std::thread thread_;
};

namespace {

// The dynamic type of `e` without namespaces ("ValueError", "runtime_error"), as PyTorch prints the
// exception class.
std::string type_name_of(const std::exception& e) {
  const char* mangled = typeid(e).name();
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = (status == 0 && demangled) ? demangled : mangled;
  std::free(demangled);
  const size_t colon = name.substr(0, name.find('<')).rfind("::");
  return colon == std::string::npos ? name : name.substr(colon + 2);
}

// Re-raises `error`, a failure of `replica` on `device`, with the "Caught ..." text, keeping its
// cudp type and the location where it was first thrown.
[[noreturn]] void rethrow_wrapped(const std::exception_ptr& error, size_t replica, int device) {
  const auto text = [&](const std::exception& e, const std::string& message) {
    return caught_message(type_name_of(e), replica, device, message);
  };
  try {
    std::rethrow_exception(error);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(e.code(), text(e, e.message()), e.file(), e.line());
  } catch (const CudaError& e) {
    throw CudaError(e.code(), text(e, e.message()), e.file(), e.line());
  } catch (const ValueError& e) {
    throw ValueError(text(e, e.message()), e.file(), e.line());
  } catch (const LibraryError& e) {
    throw LibraryError(text(e, e.message()), e.file(), e.line());
  } catch (const IoError& e) {
    throw IoError(text(e, e.message()), e.file(), e.line());
  } catch (const Error& e) {
    throw Error(text(e, e.message()), e.file(), e.line());
  } catch (const std::exception& e) {
    throw Error(text(e, e.what()), __FILE__, __LINE__);
  } catch (...) {
    throw Error(
        caught_message("Error", replica, device, "an exception that is not a std::exception"),
        __FILE__, __LINE__);
  }
}

}  // namespace

std::string caught_message(const std::string& type, size_t replica, int device,
                           const std::string& message) {
  const std::string where = device < 0 ? std::string("cpu") : std::to_string(device);
  return detail::str("Caught ", type, " in replica ", replica, " on device ", where, ": ", message);
}

// ---- DeviceWorkers ------------------------------------------------------------------------------

DeviceWorkers::DeviceWorkers(const std::vector<int>& devices) : devices_(devices) {
  for (const int device : devices_) {
    CUDP_CHECK(device >= -1, "DeviceWorkers: device ", device,
               " is neither a CUDA device id nor -1 (the host)");
    workers_.push_back(std::make_unique<Worker>(device));
  }
}

DeviceWorkers::~DeviceWorkers() = default;

void DeviceWorkers::run(size_t n, const std::function<void(size_t)>& job) {
  CUDP_CHECK(n <= devices_.size(), "DeviceWorkers::run: ", n, " jobs for ", devices_.size(),
             " devices");
  // The caller's streams, read here (a StreamGuard on this thread applies to the jobs too).
  std::vector<cudaStream_t> streams(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    if (devices_[i] >= 0) streams[i] = cuda::current_stream(devices_[i]);
  }
  // The caller's allocation purpose, which a job on another thread would not see.
  const std::string purpose = cuda::AllocationPurpose::current_what();
  const std::string advice = cuda::AllocationPurpose::current_advice();

  struct Batch {
    std::mutex mutex;
    std::condition_variable done;
    size_t pending = 0;
    std::vector<std::exception_ptr> errors;
  } batch;
  batch.pending = n;
  batch.errors.resize(n);

  const auto finish = [&batch](size_t count) {
    // Notified under the lock: the caller may destroy `batch` as soon as it sees pending == 0.
    std::lock_guard lock(batch.mutex);
    batch.pending -= count;
    if (batch.pending == 0) batch.done.notify_all();
  };
  for (size_t i = 0; i < n; ++i) {
    const int device = devices_[i];
    const bool inline_job = workers_[i]->is_calling_thread();
    auto task = [&batch, &job, &finish, &purpose, &advice, inline_job, i, device,
                 stream = streams[i]] {
      try {
        std::optional<cuda::AllocationPurpose> carried;
        if (!inline_job && (!purpose.empty() || !advice.empty())) carried.emplace(purpose, advice);
        if (device >= 0) {
          cuda::DeviceGuard device_guard(device);
          cuda::StreamGuard stream_guard(device, stream);
          job(i);
        } else {
          job(i);
        }
      } catch (...) {
        batch.errors[i] = std::current_exception();
      }
      finish(1);
    };
    try {
      if (inline_job) {
        task();
      } else {
        workers_[i]->post(std::move(task));
      }
    } catch (...) {
      // Could not queue job i (out of memory): wait for the queued ones, which use `batch`.
      finish(n - i);
      std::unique_lock lock(batch.mutex);
      batch.done.wait(lock, [&] { return batch.pending == 0; });
      throw;
    }
  }
  {
    std::unique_lock lock(batch.mutex);
    batch.done.wait(lock, [&] { return batch.pending == 0; });
  }
  for (size_t i = 0; i < n; ++i) {
    if (batch.errors[i]) rethrow_wrapped(batch.errors[i], i, devices_[i]);
  }
}

// ---- parallel_apply -----------------------------------------------------------------------------

std::vector<TensorList> parallel_apply(const std::vector<std::shared_ptr<Module>>& modules,
                                       const std::vector<TensorList>& inputs,
                                       DeviceWorkers& workers) {
  CUDP_CHECK(modules.size() == inputs.size(), "parallel_apply: ", modules.size(), " modules but ",
             inputs.size(), " inputs");
  CUDP_CHECK(modules.size() <= workers.size(), "parallel_apply: ", modules.size(), " modules but ",
             workers.size(), " devices");
  for (size_t i = 0; i < modules.size(); ++i) {
    CUDP_CHECK(modules[i] != nullptr, "parallel_apply: module ", i, " is null");
  }
  std::vector<TensorList> outputs(modules.size());
  workers.run(modules.size(), [&](size_t i) { outputs[i] = modules[i]->forward_all(inputs[i]); });
  return outputs;
}

std::vector<TensorList> parallel_apply(const std::vector<std::shared_ptr<Module>>& modules,
                                       const std::vector<TensorList>& inputs,
                                       const std::vector<int>& devices) {
  DeviceWorkers workers(devices);
  return parallel_apply(modules, inputs, workers);
}

}  // namespace cudp::parallel
