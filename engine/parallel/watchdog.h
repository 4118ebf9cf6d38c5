// Watchdog: every collective gets a deadline, so that a rank whose peer skipped a collective, hung
// or died ends with an error naming itself instead of waiting forever.
//
// A collective is enqueued on a GPU stream and returns at once; if a peer never joins it, its
// kernel spins and everything queued behind it waits. Nothing in the calling thread can notice
// that, so a thread of the watchdog's own polls, every poll_interval:
//   - each collective in flight, through its `done` probe (the Communicator's: an event recorded
//     after the collective, queried); a completed one is forgotten;
//   - each local rank's asynchronous error (the Communicator's: ncclCommGetAsyncError);
//   - the oldest collective still in flight against the timeout.
// On an error or a timeout it calls `abort` once (ncclCommAbort: the spinning kernels return, so
// streams and host threads waiting on them move on), writes the error to stderr (a thread blocked
// elsewhere still leaves a trace), and keeps it: wait() raises it in the thread that waits for a
// collective, and check() (which every collective calls first) in the next one to use the
// communicator. The error names the rank, its device, the collective, its size in bytes, the time
// it had been in flight, and what to look at.
//
// The logic is plain C++ with everything it asks of NCCL and CUDA behind WatchdogHooks and the
// clock injectable, so that tests drive it on the CPU with fakes and a clock they move by hand
// (Options::thread = false: they call poll() themselves). engine/parallel/comm.cpp holds the real
// adapter.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/error.h"

namespace cudp::parallel {

// A collective failed on some rank or did not complete within its timeout; the communicator it ran
// on has been aborted and cannot be used again.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

// The default deadline of a collective: 10 minutes, as PyTorch's NCCL process group.
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout = std::chrono::minutes(10);

// What the watchdog asks of the communication library. `async_error(i)` is local rank i's
// asynchronous error, empty when there is none; `abort()` ends every collective of the
// communicator. A probe that throws counts as a failure with the exception's message.
struct WatchdogHooks {
  std::function<std::string(int local_rank)> async_error;
  std::function<void()> abort;
};

class Watchdog {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  struct Rank {
    int rank;    // global
    int device;  // CUDA device id
  };
  struct Options {
    std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
    std::chrono::milliseconds poll_interval = std::chrono::milliseconds(100);
    bool thread = true;  // false: nothing polls unless the owner calls poll()
    bool report = true;  // write a failure to stderr when it is found
    Clock clock = [] { return std::chrono::steady_clock::now(); };
  };

  // `ranks[i]` is local rank i of the communicator watched.
  Watchdog(std::vector<Rank> ranks, WatchdogHooks hooks, Options options);
  ~Watchdog();  // stops the thread; never aborts
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // A collective `name` moving `bytes` (per rank) was enqueued for local rank `local_rank`; `done`
  // tells whether it has completed. Returns its ticket for wait(). Throws the failure, if any.
  uint64_t watch(int local_rank, std::string name, int64_t bytes, std::function<bool()> done);
  // One round of checks at clock(); the thread calls it every poll_interval.
  void poll();
  // Blocks until collective `ticket` has completed; throws CollectiveError if the watchdog failed
  // first (after the abort has returned).
  void wait(uint64_t ticket);
  void wait_all();  // every collective watched so far
  // Throws the failure, if any.
  void check() const;
  bool failed() const;

  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;

 private:
  struct Collective {
    uint64_t ticket;
    int local_rank;
    std::string name;
    int64_t bytes;
    std::chrono::steady_clock::time_point start;
    std::function<bool()> done;
  };
  // With the lock held: records the failure of `c` (null: no collective in flight) and aborts.
  void fail(std::unique_lock<std::mutex>& lock, const Collective* c, const std::string& what,
            std::chrono::steady_clock::time_point now);
  std::string describe(const Collective& c) const;
  [[noreturn]] void raise() const;  // with the lock held and error_ set
  void run();

  const std::vector<Rank> ranks_;
  const WatchdogHooks hooks_;
  Options options_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;       // a collective completed, the watchdog failed, or stop
  std::list<Collective> in_flight_;  // in ticket order
  uint64_t next_ticket_ = 0;
  std::optional<std::string> error_;  // set once
  bool aborted_ = false;              // the abort hook has returned
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cudp::parallel
