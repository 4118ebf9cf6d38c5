#include "engine/parallel/watchdog.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <sstream>
#include <utility>

namespace cudp::parallel {
namespace {

std::string seconds(std::chrono::steady_clock::duration d) {
  std::ostringstream out;
  out.precision(3);
  out << std::chrono::duration<double>(d).count() << " s";
  return out.str();
}

constexpr const char* kAdvice =
    " The NCCL communicator has been aborted and cannot be used again. A peer rank probably skipped"
    " this collective, called a different one, or failed or hung: look at the other ranks' errors."
    " If collectives legitimately take this long, raise the timeout (cudp-vgg --collective-timeout"
    " SECONDS, ProcessGroupOptions::timeout, Communicator::set_timeout).";

}  // namespace

Watchdog::Watchdog(std::vector<Rank> ranks, WatchdogHooks hooks, Options options)
    : ranks_(std::move(ranks)), hooks_(std::move(hooks)), options_(std::move(options)) {
  CUDP_CHECK(options_.timeout.count() > 0, "the collective timeout must be positive, got ",
             options_.timeout.count(), " ms");
  CUDP_CHECK(options_.poll_interval.count() > 0, "the watchdog's poll interval must be positive");
  if (options_.thread) thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::run() {
  // The polls' runtime calls (event queries) on a device this process uses: on the thread's
  // default device 0 they would make a CUDA context there, on a GPU another rank may own. (With no
  // GPU, as in the host tests, this fails and is ignored.)
  if (!ranks_.empty() && cudaSetDevice(ranks_.front().device) != cudaSuccess) cudaGetLastError();
  std::unique_lock lock(mutex_);
  while (!stop_) {
    cv_.wait_for(lock, options_.poll_interval, [this] { return stop_; });
    if (stop_ || error_) continue;
    lock.unlock();
    poll();
    lock.lock();
  }
}

void Watchdog::set_timeout(std::chrono::milliseconds timeout) {
  CUDP_CHECK(timeout.count() > 0, "the collective timeout must be positive, got ", timeout.count(),
             " ms");
  std::lock_guard lock(mutex_);
  options_.timeout = timeout;
}

std::chrono::milliseconds Watchdog::timeout() const {
  std::lock_guard lock(mutex_);
  return options_.timeout;
}

uint64_t Watchdog::watch(int local_rank, std::string name, int64_t bytes,
                         std::function<bool()> done) {
  CUDP_CHECK(local_rank >= 0 && local_rank < static_cast<int>(ranks_.size()),
             "Watchdog::watch: local rank ", local_rank, " is outside [0, ", ranks_.size(), ")");
  std::lock_guard lock(mutex_);
  if (error_) raise();
  const uint64_t ticket = next_ticket_++;
  in_flight_.push_back(
      Collective{ticket, local_rank, std::move(name), bytes, options_.clock(), std::move(done)});
  return ticket;
}

std::string Watchdog::describe(const Collective& c) const {
  const Rank& r = ranks_[static_cast<size_t>(c.local_rank)];
  return detail::str("rank ", r.rank, " on cuda:", r.device, ": ", c.name, " of ", c.bytes,
                     " bytes");
}

void Watchdog::poll() {
  std::unique_lock lock(mutex_);
  if (error_) return;
  const auto now = options_.clock();
  // Completed collectives are forgotten; a probe that throws is a failure.
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    bool done = false;
    try {
      done = it->done();
    } catch (const std::exception& e) {
      return fail(lock, &*it, detail::str("its completion could not be queried: ", e.what()), now);
    }
    it = done ? in_flight_.erase(it) : std::next(it);
  }
  cv_.notify_all();
  for (size_t i = 0; i < ranks_.size(); ++i) {
    std::string error;
    try {
      error = hooks_.async_error(static_cast<int>(i));
    } catch (const std::exception& e) {
      error = detail::str("its asynchronous error could not be queried: ", e.what());
    }
    if (error.empty()) continue;
    const auto mine = std::find_if(in_flight_.begin(), in_flight_.end(),
                                   [&](const Collective& c) { return c.local_rank == int(i); });
    if (mine != in_flight_.end()) {
      return fail(lock, &*mine, detail::str("failed: NCCL reported an asynchronous error: ", error),
                  now);
    }
    const Rank& r = ranks_[i];
    return fail(lock, nullptr,
                detail::str("rank ", r.rank, " on cuda:", r.device,
                            ": NCCL reported an asynchronous error with no collective in flight: ",
                            error, "."),
                now);
  }
  if (!in_flight_.empty()) {
    const Collective& oldest = in_flight_.front();
    if (now - oldest.start >= options_.timeout) {
      return fail(lock, &oldest,
                  detail::str("did not complete within the collective timeout of ",
                              seconds(options_.timeout)),
                  now);
    }
  }
}

void Watchdog::fail(std::unique_lock<std::mutex>& lock, const Collective* c,
                    const std::string& what, std::chrono::steady_clock::time_point now) {
  std::string message =
      c ? detail::str(describe(*c), " ", what, " (in flight for ", seconds(now - c->start), ", ",
                      in_flight_.size(), " collective", in_flight_.size() == 1 ? "" : "s",
                      " in flight on this process).", kAdvice)
        : what + kAdvice;
  error_ = message;
  if (options_.report) std::fprintf(stderr, "cudp: collective watchdog: %s\n", message.c_str());
  // The abort runs without the lock: it may take a while, and wait() and check() must see the
  // error meanwhile.
  lock.unlock();
  std::string abort_error;
  try {
    if (hooks_.abort) hooks_.abort();
  } catch (const std::exception& e) {
    abort_error = e.what();
  }
  lock.lock();
  if (!abort_error.empty()) *error_ += " Aborting the communicator failed too: " + abort_error;
  aborted_ = true;
  in_flight_.clear();
  cv_.notify_all();
}

void Watchdog::raise() const {
  throw CollectiveError(*error_, __FILE__, __LINE__);
}

void Watchdog::check() const {
  std::lock_guard lock(mutex_);
  if (error_) raise();
}

bool Watchdog::failed() const {
  std::lock_guard lock(mutex_);
  return error_.has_value();
}

void Watchdog::wait(uint64_t ticket) {
  // The waiting thread queries completion itself (every millisecond at most), so a wait does not
  // cost up to a poll interval; timeouts and errors remain the watchdog's to find.
  const auto step =
      std::min<std::chrono::milliseconds>(options_.poll_interval, std::chrono::milliseconds(1));
  std::unique_lock lock(mutex_);
  for (;;) {
    if (error_) {
      cv_.wait(lock, [this] { return aborted_; });
      raise();
    }
    bool pending = false;
    for (auto it = in_flight_.begin(); it != in_flight_.end() && it->ticket <= ticket;) {
      bool done = false;
      try {
        done = it->done();
      } catch (const std::exception&) {
        // poll() reports it
      }
      if (done) {
        it = in_flight_.erase(it);
      } else {
        pending = pending || it->ticket == ticket;
        ++it;
      }
    }
    if (!pending) return;
    cv_.wait_for(lock, step);
  }
}

void Watchdog::wait_all() {
  uint64_t last;
  {
    std::lock_guard lock(mutex_);
    if (next_ticket_ == 0) {
      if (error_) raise();
      return;
    }
    last = next_ticket_ - 1;
  }
  // Collectives of different local ranks complete in any order: wait for each one still listed.
  for (;;) {
    std::optional<uint64_t> pending;
    {
      std::lock_guard lock(mutex_);
      if (error_) break;
      for (const Collective& c : in_flight_) {
        if (c.ticket <= last) {
          pending = c.ticket;
          break;
        }
      }
    }
    if (!pending) return;
    wait(*pending);
  }
  wait(last);  // raises the error
}

}  // namespace cudp::parallel
