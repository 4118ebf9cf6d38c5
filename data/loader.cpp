#include "data/loader.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "engine/core/checked.h"
#include "engine/core/device.h"
#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "kernels/philox.h"

namespace cudp::data {

// Philox's high counter word: the epoch above 8 bits of purpose, so the streams never overlap
// (data/sampler.cpp shuffles with 0x10, data/synthetic.cpp uses purposes 1-3, data/image_folder.cpp
// 0x12).
namespace {
enum Purpose : uint64_t { kAugment = 0x11 };

uint64_t counter_hi(int epoch, Purpose purpose) {
  return (static_cast<uint64_t>(epoch) << 8) | purpose;
}
}  // namespace

namespace detail {

// One batch worth of memory, reused batch after batch, and the CUDA events of the work that reads it.
struct BatchBuffer {
  Tensor images, labels;  // full batch_size rows
  std::mutex mutex;       // guards what follows (record_reader runs on the consumer's thread)
  uint64_t lease = 0;     // counts the times a worker took the buffer
  std::vector<cuda::Event> readers;  // one per device, created on first use
  std::vector<bool> pending;
  // When the last take() began and returned, and whether the device was still reading the buffer
  // then, so that it waited (set under the loader's lock; NOTE [What the consumer waited for]).
  std::chrono::steady_clock::time_point take_began{}, taken{};
  bool device_held = false;

  // The memory goes back when the last batch using it goes, possibly while a copy still reads it.
  ~BatchBuffer() {
    for (size_t d = 0; d < readers.size(); ++d) {
      if (pending[d]) cudaEventSynchronize(readers[d].get());  // no throwing from a destructor
    }
  }

  // A worker takes the buffer to refill it: batches handed out before can no longer announce
  // readers, and those they announced are waited for. True when one of them had not completed.
  // `hook` (a test's, Loader::set_wait_hook_for_testing; empty otherwise) hears of that wait.
  bool take(const Loader::WaitHook& hook, int64_t batch) {
    std::lock_guard lock(mutex);
    ++lease;
    bool waited = false;
    for (size_t d = 0; d < readers.size(); ++d) {
      if (pending[d] && !readers[d].query()) {
        if (!waited && hook) hook(Loader::WaitPoint::Device, batch);
        waited = true;
        readers[d].synchronize();
      }
      pending[d] = false;
    }
    return waited;
  }
};

}  // namespace detail

void Batch::record_reader(cudaStream_t stream, int device) const {
  CUDP_CHECK(buffer != nullptr, "record_reader on a batch that did not come from a Loader");
  CUDP_CHECK(device >= 0, "record_reader: invalid device ", device);
  detail::BatchBuffer& b = *buffer;
  std::lock_guard lock(b.mutex);
  CUDP_CHECK(b.lease == lease, "record_reader on batch ", index, " of epoch ", epoch,
             " after the loader took its memory back: call it before the next next()");
  const size_t d = static_cast<size_t>(device);
  if (b.readers.size() <= d) {
    b.readers.resize(d + 1);
    b.pending.resize(d + 1, false);
  }
  if (b.readers[d].get() == nullptr) b.readers[d] = cuda::Event::create(device);
  b.readers[d].record(stream);
  b.pending[d] = true;
}

namespace {

// Adds the bytes p[0], p[stride], ... (`count` of them) to `sum` and their squares to `sum_sq`,
// exactly. Partial sums of blocks of 2^16 values fit in 32 bits (255^2 * 2^16 < 2^32) and a byte's
// square in 16, which lets the compiler vectorise the loop where the stride is known: the 47 MB of
// Fashion-MNIST's train set take 6 ms at start-up, against 90 ms summed one pixel at a time in 64
// bits with a division per pixel.
template <size_t kStride>  // 0: `stride` at run time
void add_channel_sums(const uint8_t* p, size_t count, size_t stride, uint64_t& sum,
                      uint64_t& sum_sq) {
  if constexpr (kStride > 0) stride = kStride;
  constexpr size_t kBlock = size_t{1} << 16;
  for (size_t begin = 0; begin < count; begin += kBlock) {
    const size_t end = std::min(count, begin + kBlock);
    uint32_t s = 0, s_sq = 0;
    for (size_t i = begin; i < end; ++i) {
      const uint16_t v = p[i * stride];
      s += v;
      s_sq += static_cast<uint16_t>(v * v);
    }
    sum += s;
    sum_sq += s_sq;
  }
}

}  // namespace

Normalization compute_normalization(const Dataset& train) {
  train.validate();
  CUDP_CHECK(train.size() > 0, "compute_normalization: ", train.name, " is empty");
  const size_t channels = static_cast<size_t>(train.channels);
  const size_t pixels = train.images.size() / channels;
  std::vector<uint64_t> sum(channels, 0), sum_sq(channels, 0);  // exact: integer pixels
  for (size_t c = 0; c < channels; ++c) {
    if (channels == 1) {
      add_channel_sums<1>(train.images.data(), pixels, 1, sum[c], sum_sq[c]);
    } else {
      add_channel_sums<0>(train.images.data() + c, pixels, channels, sum[c], sum_sq[c]);
    }
  }
  const double count = static_cast<double>(pixels);
  Normalization n;
  for (size_t c = 0; c < channels; ++c) {
    const double mean = static_cast<double>(sum[c]) / count / 255.0;
    const double mean_sq = static_cast<double>(sum_sq[c]) / count / (255.0 * 255.0);
    n.mean.push_back(static_cast<float>(mean));
    n.std.push_back(static_cast<float>(std::sqrt(std::max(mean_sq - mean * mean, 0.0))));
  }
  return n;
}

class Loader::Impl {
 public:
  Impl(const SampleSource& source, LoaderOptions options, std::unique_ptr<SampleSource> owned);
  ~Impl();

  void start_epoch(int epoch, int64_t first_batch);
  bool next(Batch& batch);
  double wait_seconds() const;
  double device_wait_seconds() const;
  LoaderPosition position() const;
  std::vector<int64_t> epoch_order(int epoch) const;
  void set_wait_hook(WaitHook hook);

  const std::unique_ptr<SampleSource> owned;  // the DatasetSource of Loader(const Dataset&, ...)
  const SampleSource& source;
  const LoaderOptions options;
  // options.sampler, or the loader's own order (every sample once, options.shuffle and seed).
  const std::shared_ptr<const Sampler> sampler;
  const int64_t out_h, out_w, channels;
  const int64_t samples;  // per epoch: sampler->size()
  const int64_t batches;

 private:
  const int64_t rows_;   // the rows of a batch buffer
  const int64_t chunk_;  // the rows a worker claims at a time
  using BufferPtr = std::shared_ptr<detail::BatchBuffer>;
  // A batch being filled, by as many workers as claim its rows. Only the fields below `rows` change
  // after it is made, and only with the lock held.
  struct Job {
    BufferPtr buffer;
    int64_t index;
    uint64_t generation;
    int epoch;
    std::shared_ptr<const std::vector<int64_t>> order;
    int64_t rows;          // rows of this batch (a last batch may be short)
    int64_t next_row = 0;  // the first row no worker has claimed yet
    int busy = 1;          // workers taking the buffer or filling rows of it
    bool open = false;     // the buffer has been taken (its readers waited for): rows may be filled
    bool failed = false;
  };
  using JobPtr = std::list<Job>::iterator;

  void work();
  bool claimable(JobPtr* job);  // with the lock held: the earliest job with rows left to claim
  bool can_schedule() const;
  void fail(Job& job, std::exception_ptr error);  // with the lock held
  void retire(JobPtr job);                         // with the lock held
  void release_held();                             // with the lock held
  void fill(const Job& job, int64_t begin, int64_t end, std::vector<uint8_t>& scratch) const;
  void transform(const uint8_t* pixels, int64_t sample, int epoch, float* out) const;

  std::vector<float> table_;  // [channel][pixel value] -> normalised value
  std::vector<float> fill_;   // per channel: the border's value

  mutable std::mutex mutex_;
  std::condition_variable work_cv_, ready_cv_;
  bool stop_ = false;
  uint64_t generation_ = 0;   // bumped by start_epoch: older jobs' results are dropped
  int epoch_ = -1;
  std::shared_ptr<const std::vector<int64_t>> order_;
  int64_t next_schedule_ = 0, next_deliver_ = 0;
  std::deque<BufferPtr> free_;
  std::list<Job> jobs_;       // batches being filled, in the order they were started
  std::map<int64_t, BufferPtr> ready_;
  BufferPtr held_;            // the buffer behind the batch the consumer has
  std::exception_ptr error_;
  double waited_ = 0;  // NOTE [What the consumer waited for]
  double device_waited_ = 0;
  WaitHook wait_hook_;  // test-only; set before the first epoch, read-only after
  std::vector<std::thread> threads_;
};

namespace {

// Bounds that keep a typo from starting a million threads or allocating a million buffers.
constexpr int kMaxWorkers = 1024;
constexpr int kMaxPrefetch = 1024;

// Checks the options before anything is computed from them (the sizes below multiply them).
const LoaderOptions& checked(const SampleSource& source, const LoaderOptions& options) {
  CUDP_CHECK(source.height() > 0 && source.width() > 0 && source.channels() > 0 &&
                 source.num_classes() > 0 && source.size() >= 0,
             source.name(), ": invalid data set (", source.size(), " images of ", source.height(),
             "x", source.width(), "x", source.channels(), ", ", source.num_classes(), " classes)");
  CUDP_CHECK(options.batch_size > 0, "batch_size must be positive, got ", options.batch_size);
  CUDP_CHECK(options.pad >= 0 && options.random_crop >= 0, "pad and random_crop must not be negative");
  CUDP_CHECK(!options.sampler || options.sampler->dataset_size() == source.size(),
             "LoaderOptions::sampler draws from a data set of ",
             options.sampler ? options.sampler->dataset_size() : 0, " samples, but ", source.name(),
             " has ", source.size(), "; make the sampler with the loader's data set size");
  return options;
}

std::shared_ptr<const Sampler> sampler_of(const SampleSource& source,
                                          const LoaderOptions& options) {
  if (options.sampler) return options.sampler;
  return std::make_shared<const DistributedSampler>(
      source.size(), DistributedSamplerOptions{.shuffle = options.shuffle, .seed = options.seed});
}

int64_t padded(int64_t side, int pad) {
  return checked_add(side, checked_mul(2, pad, "loader: 2 x pad"), "loader: image side + 2 x pad");
}

}  // namespace

Loader::Impl::Impl(const SampleSource& data, LoaderOptions opts, std::unique_ptr<SampleSource> own)
    : owned(std::move(own)),
      source(data),
      options(checked(data, opts)),
      sampler(sampler_of(data, options)),
      out_h(padded(data.height(), options.pad)),
      out_w(padded(data.width(), options.pad)),
      channels(data.channels()),
      samples(sampler->size()),
      // Written so that no intermediate overflows, whatever batch_size is.
      batches(options.drop_last
                  ? samples / options.batch_size
                  : samples / options.batch_size + (samples % options.batch_size != 0)),
      // A batch never holds more rows than an epoch: a batch size beyond it costs no memory.
      rows_(std::max<int64_t>(std::min(options.batch_size, samples), 1)),
      chunk_((rows_ + std::clamp(options.workers, 1, kMaxWorkers) - 1) /
             std::clamp(options.workers, 1, kMaxWorkers)) {
  const Normalization& norm = options.normalization;
  CUDP_CHECK(options.workers >= 1 && options.workers <= kMaxWorkers, "workers must be in [1, ",
             kMaxWorkers, "], got ", options.workers);
  CUDP_CHECK(options.prefetch >= 1 && options.prefetch <= kMaxPrefetch, "prefetch must be in [1, ",
             kMaxPrefetch, "], got ", options.prefetch);
  CUDP_CHECK(norm.mean.size() == norm.std.size(), "normalization: ", norm.mean.size(), " means but ",
             norm.std.size(), " standard deviations");
  CUDP_CHECK(norm.mean.size() <= 1 || static_cast<int64_t>(norm.mean.size()) == channels,
             "normalization has ", norm.mean.size(), " channels, ", source.name(), " has ", channels);

  for (int64_t c = 0; c < channels; ++c) {
    const size_t k = norm.mean.size() == 1 ? 0 : static_cast<size_t>(c);
    const float mean = norm.mean.empty() ? 0.0f : norm.mean[k];
    const float std = norm.std.empty() ? 1.0f : norm.std[k];
    CUDP_CHECK(std > 0, "normalization: std of channel ", c, " must be positive, got ", std);
    for (int v = 0; v < 256; ++v) table_.push_back((static_cast<float>(v) / 255.0f - mean) / std);
    fill_.push_back(options.pad_fill == PadFill::Zero ? 0.0f : table_[c * 256 + options.pad_pixel]);
  }

  // prefetch buffers being filled or ready, plus the consumer's.
  const bool pinned = options.pin_memory && cuda::is_available();
  const Shape image_shape{rows_, out_h, out_w, channels};
  const int64_t buffer_bytes = checked_mul(
      checked_add(static_cast<int64_t>(shape_nbytes(image_shape, DType::f32)),
                  checked_mul(rows_, 4, "loader: label bytes"), "loader: batch buffer bytes"),
      int64_t{options.prefetch} + 1, "loader: batch buffer bytes");
  cuda::AllocationPurpose purpose(
      cudp::detail::str("the data loader's ", int64_t{options.prefetch} + 1, " batch buffers (prefetch ",
                  options.prefetch, " + 1) of ", rows_, " images of ", out_h, "x", out_w, "x",
                  channels, " f32, ", buffer_bytes, " bytes in all"),
      cudp::detail::str("Reduce the batch size (--batch-size, now ", options.batch_size,
                  ") or the loader's prefetch depth (now ", options.prefetch, ")",
                  pinned ? ", or turn pin_memory off" : ""));
  for (int i = 0; i <= options.prefetch; ++i) {
    auto buffer = std::make_shared<detail::BatchBuffer>();
    buffer->images = Tensor::empty(image_shape, DType::f32, Device::cpu(), pinned);
    buffer->labels = Tensor::empty({rows_}, DType::i32, Device::cpu(), pinned);
    free_.push_back(std::move(buffer));
  }
  for (int i = 0; i < options.workers; ++i) threads_.emplace_back([this] { work(); });
}

Loader::Impl::~Impl() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

std::vector<int64_t> Loader::Impl::epoch_order(int epoch) const {
  CUDP_CHECK(epoch >= 0, "epoch must not be negative, got ", epoch);
  std::vector<int64_t> order = sampler->indices(epoch);
  CUDP_CHECK(static_cast<int64_t>(order.size()) == samples, "the loader's sampler gave ",
             order.size(), " indices for epoch ", epoch, " but its size() is ", samples);
  for (const int64_t i : order) {
    CUDP_CHECK(i >= 0 && i < source.size(), "the loader's sampler gave index ", i, " for epoch ",
               epoch, ", outside ", source.name(), "'s [0, ", source.size(), ")");
  }
  return order;
}

void Loader::Impl::start_epoch(int epoch, int64_t first_batch) {
  CUDP_CHECK(first_batch >= 0 && first_batch <= batches, "start_epoch: first_batch ", first_batch,
             " is outside [0, ", batches, "]");
  {
    std::unique_lock lock(mutex_);
    if (epoch_ >= 0 && epoch_ == epoch && next_deliver_ == first_batch && !error_) {
      // Started early: what is prepared is this very epoch's, from this batch on (a failed one
      // starts again below).
      release_held();
      waited_ = 0;
      device_waited_ = 0;
      lock.unlock();
      work_cv_.notify_all();  // the held buffer is free
      return;
    }
  }
  auto order = std::make_shared<const std::vector<int64_t>>(epoch_order(epoch));
  {
    std::lock_guard lock(mutex_);
    ++generation_;
    epoch_ = epoch;
    order_ = std::move(order);
    for (auto& [index, buffer] : ready_) free_.push_back(std::move(buffer));
    ready_.clear();
    // Batches of the old epoch being filled: no more rows are claimed, and a buffer nobody is
    // writing goes back now (the others when their last worker finishes).
    for (auto job = jobs_.begin(); job != jobs_.end();) {
      const auto this_job = job++;
      this_job->next_row = this_job->rows;
      if (this_job->busy == 0) retire(this_job);
    }
    release_held();
    next_schedule_ = next_deliver_ = first_batch;
    error_ = nullptr;
    waited_ = 0;
    device_waited_ = 0;
  }
  work_cv_.notify_all();
}

bool Loader::Impl::can_schedule() const {
  return epoch_ >= 0 && next_schedule_ < batches && next_schedule_ < next_deliver_ + options.prefetch &&
         !free_.empty();
}

void Loader::Impl::release_held() {
  if (held_) free_.push_back(std::move(held_));
  held_ = nullptr;
}

bool Loader::Impl::claimable(JobPtr* job) {
  for (auto j = jobs_.begin(); j != jobs_.end(); ++j) {
    if (j->open && j->generation == generation_ && j->next_row < j->rows) {
      *job = j;
      return true;
    }
  }
  return false;
}

void Loader::Impl::fail(Job& job, std::exception_ptr error) {
  job.failed = true;
  job.next_row = job.rows;  // nobody claims more of it
  if (job.generation == generation_ && !error_) error_ = std::move(error);
  ready_cv_.notify_all();
}

void Loader::Impl::retire(JobPtr job) {
  if (!job->failed && job->generation == generation_) {
    ready_.emplace(job->index, std::move(job->buffer));
    ready_cv_.notify_all();
  } else {
    free_.push_back(std::move(job->buffer));
    work_cv_.notify_all();
  }
  jobs_.erase(job);
}

void Loader::Impl::work() {
  std::vector<uint8_t> scratch;  // one sample's pixels, for a source that produces them
  std::unique_lock lock(mutex_);
  for (;;) {
    JobPtr job;
    work_cv_.wait(lock, [&] { return stop_ || claimable(&job) || can_schedule(); });
    if (stop_) return;
    std::exception_ptr failure;
    if (!claimable(&job)) {
      // Start the next batch. Its buffer is taken (the reads of the batch it held last are waited
      // for) before anyone writes to it, so the job opens only after that.
      const int64_t index = next_schedule_++;
      jobs_.push_back(Job{std::move(free_.front()), index, generation_, epoch_, order_,
                          std::min(options.batch_size, samples - index * options.batch_size)});
      free_.pop_front();
      job = std::prev(jobs_.end());
      job->buffer->take_began = std::chrono::steady_clock::now();
      lock.unlock();
      bool device_held = false;
      try {
        device_held = job->buffer->take(wait_hook_, index);
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      job->buffer->taken = std::chrono::steady_clock::now();
      job->buffer->device_held = device_held;
      job->open = true;
    } else {
      const int64_t begin = job->next_row, end = std::min(job->rows, begin + chunk_);
      job->next_row = end;
      ++job->busy;
      lock.unlock();
      try {
        fill(*job, begin, end, scratch);
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
    }
    --job->busy;
    if (failure) fail(*job, std::move(failure));
    if (job->next_row == job->rows && job->busy == 0) retire(job);
    work_cv_.notify_all();  // rows to claim, or a buffer or a window slot freed
  }
}

bool Loader::Impl::next(Batch& batch) {
  std::unique_lock lock(mutex_);
  CUDP_CHECK(epoch_ >= 0, "Loader::next: call start_epoch(epoch) first");
  release_held();
  work_cv_.notify_all();
  if (next_deliver_ >= batches) return false;
  if (!error_ && !ready_.contains(next_deliver_)) {
    // NOTE [What the consumer waited for]
    // A wait here is the input pipeline's except where the batch's buffer was still the device's:
    // take() waits for the copies that read it, and a copy queued behind the previous steps runs
    // only when the device gets to it, so a device-bound run (the host ahead by the prefetch depth)
    // waits here too. Such a wait is counted apart, so that "input wait" does not send a user
    // adding workers to a run that the GPU bounds: where the take() found a copy still to run and
    // returned during the wait, from when it began (or the wait did) to the end of the wait, the
    // batch's filling after the take() included. That filling could not start before the device
    // let the buffer go, and the device meanwhile runs the steps queued since that copy (the
    // prefetch depth of them). Counted as input wait, it made a device-bound run look input-bound:
    // cudp-vgg on Fashion-MNIST (VGG-16-BN, batch 256, one H200) printed 0.15 s of input wait in
    // every 0.64 s epoch, about one 256-image fill per step, from a loader that fills batches
    // several times faster than the GPU takes them.
    const auto start = std::chrono::steady_clock::now();
    if (wait_hook_) wait_hook_(WaitPoint::Batch, next_deliver_);
    ready_cv_.wait(lock, [this] { return error_ || ready_.contains(next_deliver_); });
    const auto end = std::chrono::steady_clock::now();
    const auto seconds = [](auto d) { return std::chrono::duration<double>(d).count(); };
    double device = 0;
    if (!error_) {
      const detail::BatchBuffer& b = *ready_.at(next_deliver_);
      if (b.device_held && b.taken > start) device = seconds(end - std::max(start, b.take_began));
    }
    device_waited_ += device;
    waited_ += seconds(end - start) - device;
  }
  if (error_) std::rethrow_exception(error_);
  const int64_t index = next_deliver_++;
  auto node = ready_.extract(index);
  held_ = std::move(node.mapped());
  work_cv_.notify_all();  // the window moved on

  const int64_t rows = std::min(options.batch_size, samples - index * options.batch_size);
  batch.images = held_->images.slice(0, rows);
  batch.labels = held_->labels.slice(0, rows);
  batch.epoch = epoch_;
  batch.index = index;
  batch.buffer = held_;
  std::lock_guard buffer_lock(held_->mutex);
  batch.lease = held_->lease;
  return true;
}

double Loader::Impl::wait_seconds() const {
  std::lock_guard lock(mutex_);
  return waited_;
}

double Loader::Impl::device_wait_seconds() const {
  std::lock_guard lock(mutex_);
  return device_waited_;
}

void Loader::Impl::set_wait_hook(WaitHook hook) {
  std::lock_guard lock(mutex_);
  // The workers read it without the lock; they start reading only after start_epoch() (whose lock
  // orders this write before them).
  CUDP_CHECK(epoch_ < 0,
             "Loader::set_wait_hook_for_testing: set it before the first start_epoch()");
  wait_hook_ = std::move(hook);
}

LoaderPosition Loader::Impl::position() const {
  std::lock_guard lock(mutex_);
  return {std::max(epoch_, 0), next_deliver_};
}

void Loader::Impl::fill(const Job& job, int64_t begin, int64_t end,
                        std::vector<uint8_t>& scratch) const {
  const int64_t first = job.index * options.batch_size;
  const int64_t image_floats = out_h * out_w * channels;
  float* images = job.buffer->images.data<float>();
  int32_t* labels = job.buffer->labels.data<int32_t>();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t sample = (*job.order)[static_cast<size_t>(first + r)];
    labels[r] = source.label(sample);
    const uint8_t* pixels = source.pixels(sample);
    if (pixels == nullptr) {
      scratch.resize(static_cast<size_t>(source.image_bytes()));
      source.read(sample, options.seed, job.epoch, scratch.data());
      pixels = scratch.data();
    }
    transform(pixels, sample, job.epoch, images + r * image_floats);
  }
}

// Output pixel (oy, ox) shows source pixel (oy + dy - pad, fx + dx - pad), fx = ox or its mirror:
// torchvision's RandomCrop(padding) then RandomHorizontalFlip, with the frame's padding folded in.
void Loader::Impl::transform(const uint8_t* pixels, int64_t sample, int epoch, float* out) const {
  int dy = 0, dx = 0;
  bool flip = false;
  if (options.random_crop > 0 || options.horizontal_flip) {
    const kernels::Philox4 r =
        kernels::philox(options.seed, static_cast<uint64_t>(sample), counter_hi(epoch, kAugment));
    const uint32_t choices = 2 * static_cast<uint32_t>(options.random_crop) + 1;
    dy = static_cast<int>(r.v[0] % choices) - options.random_crop;
    dx = static_cast<int>(r.v[1] % choices) - options.random_crop;
    flip = options.horizontal_flip && (r.v[2] & 1u);
  }
  const int64_t h = source.height(), w = source.width(), c = channels;
  const auto fill_pixels = [&](float* first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) std::copy(fill_.begin(), fill_.end(), first + i * c);
  };
  // Output columns [lo, hi) show image pixels; the rest of each row is border.
  const int64_t fx_lo = std::clamp<int64_t>(options.pad - dx, 0, out_w);
  const int64_t fx_hi = std::clamp<int64_t>(options.pad - dx + w, fx_lo, out_w);
  const int64_t lo = flip ? out_w - fx_hi : fx_lo, hi = flip ? out_w - fx_lo : fx_hi;
  for (int64_t oy = 0; oy < out_h; ++oy) {
    float* row = out + oy * out_w * c;
    const int64_t sy = oy + dy - options.pad;
    if (sy < 0 || sy >= h) {
      fill_pixels(row, out_w);
      continue;
    }
    fill_pixels(row, lo);
    fill_pixels(row + hi * c, out_w - hi);
    const uint8_t* in = pixels + sy * w * c;
    for (int64_t ox = lo; ox < hi; ++ox) {
      const int64_t sx = (flip ? out_w - 1 - ox : ox) + dx - options.pad;
      for (int64_t ch = 0; ch < c; ++ch) row[ox * c + ch] = table_[ch * 256 + in[sx * c + ch]];
    }
  }
}

Loader::Loader(const SampleSource& source, LoaderOptions options)
    : impl_(std::make_unique<Impl>(source, std::move(options), nullptr)) {}

namespace {
// The Dataset behind a DatasetSource that does not own it (the caller keeps it alive).
std::unique_ptr<SampleSource> view_of(const Dataset& dataset) {
  return std::make_unique<DatasetSource>(std::shared_ptr<const Dataset>(std::shared_ptr<void>(), &dataset));
}
}  // namespace

Loader::Loader(const Dataset& dataset, LoaderOptions options) {
  std::unique_ptr<SampleSource> view = view_of(dataset);
  const SampleSource& source = *view;
  impl_ = std::make_unique<Impl>(source, std::move(options), std::move(view));
}
Loader::~Loader() = default;

void Loader::start_epoch(int epoch, int64_t first_batch) { impl_->start_epoch(epoch, first_batch); }
bool Loader::next(Batch& batch) { return impl_->next(batch); }
int64_t Loader::batches_per_epoch() const { return impl_->batches; }
LoaderPosition Loader::position() const { return impl_->position(); }
double Loader::wait_seconds() const { return impl_->wait_seconds(); }
double Loader::device_wait_seconds() const {
  return impl_->device_wait_seconds();
}
std::vector<int64_t> Loader::epoch_order(int epoch) const { return impl_->epoch_order(epoch); }
void Loader::set_wait_hook_for_testing(WaitHook hook) {
  impl_->set_wait_hook(std::move(hook));
}
Shape Loader::image_shape() const { return {impl_->out_h, impl_->out_w, impl_->channels}; }
const SampleSource& Loader::source() const { return impl_->source; }
const LoaderOptions& Loader::options() const { return impl_->options; }

}  // namespace cudp::data
