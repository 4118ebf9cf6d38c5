// Helpers shared by the data tests: a scratch directory for generated files, checks on the text of
// an expected exception (readers must say which file and what is wrong with it), a loader's
// batches copied out (it reuses its buffers), a Dataset served through read(), and gates and
// delayed actions for the tests of a loader's waits.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/loader.h"
#include "engine/core/error.h"

namespace cudp::testing {

// A fresh directory under the system's temp directory, removed with everything in it at the end.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "cudp-data-XXXXXX").string();
    if (!::mkdtemp(pattern.data())) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The file's bytes as they are on disk (the library's read_file would gunzip them).
inline std::vector<uint8_t> read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Succeeds when `f()` throws E and its message contains every one of `parts`.
template <typename E, typename F>
::testing::AssertionResult throws_with(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    for (const std::string& part : parts) {
      if (what.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message lacks \"" << part << "\": " << what;
      }
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw another exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

struct HostBatch {
  std::vector<float> images;
  std::vector<int32_t> labels;
  int64_t index;
  bool operator==(const HostBatch&) const = default;
};

// Every remaining batch of `epoch` from `first`, copied out.
inline std::vector<HostBatch> run_epoch(data::Loader& loader, int epoch, int64_t first = 0) {
  loader.start_epoch(epoch, first);
  std::vector<HostBatch> out;
  data::Batch b;
  while (loader.next(b)) {
    out.push_back({b.images.to_vector<float>(), b.labels.to_vector<int32_t>(), b.index});
  }
  return out;
}

// A Dataset served through read(), as an image folder is, rather than as resident arrays: each
// sample is copied out of the Dataset after before_read(index), which a test overrides to slow the
// reads down, count them or make one fail.
class DatasetSource : public data::SampleSource {
 public:
  explicit DatasetSource(const data::Dataset& d) : d_(d) {}
  const std::string& name() const override { return d_.name; }
  int64_t size() const override { return d_.size(); }
  int64_t height() const override { return d_.height; }
  int64_t width() const override { return d_.width; }
  int64_t channels() const override { return d_.channels; }
  int num_classes() const override { return d_.num_classes; }
  int32_t label(int64_t index) const override { return d_.labels[static_cast<size_t>(index)]; }
  void read(int64_t index, uint64_t, int, uint8_t* out) const override {
    before_read(index);
    std::copy_n(d_.image(index), d_.image_bytes(), out);
  }

 protected:
  virtual void before_read(int64_t /*index*/) const {}

 private:
  const data::Dataset& d_;
};

// A gate for threads: pass() lets the first `open`ed arrivals through and holds the others until
// open() lets more through, or open_for_good() all.
class Gate {
 public:
  void pass() {
    std::unique_lock lock(mutex_);
    const int64_t ticket = arrivals_++;
    cv_.wait_until(lock, deadline_, [&] { return for_good_ || ticket < opened_; });
  }
  void open(int64_t count) {
    {
      std::lock_guard lock(mutex_);
      opened_ += count;
    }
    cv_.notify_all();
  }
  void open_for_good() {
    {
      std::lock_guard lock(mutex_);
      for_good_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t arrivals_ = 0, opened_ = 0;
  bool for_good_ = false;
  // Open for good after a minute whatever happens: a test whose hook never opens it fails, and
  // does not hang.
  const std::chrono::steady_clock::time_point deadline_ =
      std::chrono::steady_clock::now() + std::chrono::minutes(1);
};

// Opens a gate for good when it goes: declared after a loader, it lets a worker held at the gate
// finish before the loader's destructor waits for it (a failed ASSERT included).
struct OpenAtExit {
  Gate& gate;
  ~OpenAtExit() { gate.open_for_good(); }
};

// Runs actions on threads of their own after a delay (a test releasing what a loader waits for,
// from another thread, after a delay it knows); joins them when it goes.
class Later {
 public:
  void run(std::chrono::milliseconds delay, std::function<void()> action) {
    std::lock_guard lock(mutex_);
    threads_.emplace_back([delay, action = std::move(action)] {
      std::this_thread::sleep_for(delay);
      action();
    });
  }

 private:
  std::mutex mutex_;
  std::vector<std::jthread> threads_;
};

// A Dataset served through read(): each read is held at `gate` until the test lets it through,
// then takes `delay` (a source that takes a while to decode; 0: none).
class GatedSource final : public DatasetSource {
 public:
  explicit GatedSource(const data::Dataset& d,
                       std::chrono::microseconds delay = std::chrono::microseconds(0))
      : DatasetSource(d), delay_(delay) {}
  mutable Gate gate;

 private:
  void before_read(int64_t) const override {
    gate.pass();
    std::this_thread::sleep_for(delay_);
  }
  std::chrono::microseconds delay_;
};

}  // namespace cudp::testing
