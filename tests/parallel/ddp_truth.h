// What the DistributedDataParallel tests under mpirun (mpi_ddp_test.cpp on the host,
// mpi_ddp_gpu_test.cpp on GPUs) compare against: a small conv/BatchNorm/linear model, a synthetic
// batch, each rank's shard of it, and the truth computed without DDP and without MPI (one process,
// the whole global batch). Without SyncBatchNorm each rank's BatchNorm normalises its own shard by
// the shard's statistics (as PyTorch's DDP and our DataParallel do), so the one-process run feeds
// the global batch as the ranks' shards in turn, each shard's mean loss weighted by n_r / B,
// gradients accumulating (exactly what DataParallel on W devices computes), then one SGD step. Its
// running statistics are rank 0's shard's alone, which is what DDP's broadcast of rank 0's buffers
// before each forward leaves on every rank.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/mpi_environment.h"
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/flatten.h"
#include "layers/linear.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/pooling.h"
#include "layers/sequential.h"

namespace cudp::testing::ddp {

// Two classes of 8x8 one-channel images (a horizontal or a vertical bar over noise), NHWC.
struct Batch {
  Tensor images, labels;
};

inline Batch make_batch(int n, uint64_t seed, Device device = Device::cpu()) {
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> noise(0.f, 0.3f);
  std::uniform_int_distribution<int> position(0, 7), label(0, 1);
  std::vector<float> pixels(static_cast<size_t>(n) * 64);
  std::vector<int32_t> labels(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    labels[i] = label(gen);
    const int at = position(gen);
    for (int y = 0; y < 8; ++y) {
      for (int x = 0; x < 8; ++x) {
        const bool on_bar = labels[i] == 0 ? y == at : x == at;
        pixels[i * 64 + y * 8 + x] = noise(gen) + (on_bar ? 1.f : 0.f);
      }
    }
  }
  return {Tensor::from_vector(pixels, {n, 8, 8, 1}).to(device),
          Tensor::from_vector(labels, {n}).to(device)};
}

inline std::shared_ptr<Sequential> tiny_net(uint64_t seed = 0) {
  return std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 8, 3, 1, 1, true, 11 + seed), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2),
      std::make_shared<Conv2d>(8, 8, 3, 1, 1, true, 12 + seed), std::make_shared<BatchNorm2d>(8),
      std::make_shared<ReLU>(true), std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Linear>(8 * 2 * 2, 2, true, 13 + seed)});
}

// Rank r's rows of a global batch of b: [b r / w, b (r + 1) / w). With b = 7 the shards are
// uneven (3 + 4 on two ranks, 2 + 2 + 3 on three), so the n_r / B weights are not 1 / w.
inline int64_t shard_begin(int r, int w, int64_t b) {
  return b * r / w;
}
inline Batch shard(const Batch& batch, int r, int w) {
  const int64_t b = batch.images.size(0);
  const int64_t begin = shard_begin(r, w, b), end = shard_begin(r + 1, w, b);
  return {batch.images.slice(begin, end), batch.labels.slice(begin, end)};
}

inline std::vector<Tensor> copies(const std::vector<std::pair<std::string, Tensor*>>& named) {
  std::vector<Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t->clone());
  return out;
}
inline void restore(const std::vector<std::pair<std::string, Tensor*>>& named,
                    const std::vector<Tensor>& values) {
  for (size_t i = 0; i < named.size(); ++i) named[i].second->copy_from(values[i]);
}

// The number of this rank's elements that differ in bits from rank 0's (rank 0's bytes reach
// every rank by MPI_Bcast).
inline size_t differs_from_rank0(const Tensor& t) {
  const Tensor host = t.to(Device::cpu());
  std::vector<uint8_t> mine(host.nbytes()), theirs(host.nbytes());
  std::memcpy(mine.data(), host.data_ptr(), host.nbytes());
  theirs = mine;
  testing::mpi_session()->broadcast(theirs.data(), theirs.size(), 0);
  const size_t element = t.nbytes() / static_cast<size_t>(std::max<int64_t>(t.numel(), 1));
  size_t wrong = 0;
  for (size_t i = 0; i < mine.size(); i += element) {
    if (std::memcmp(&mine[i], &theirs[i], element) != 0) ++wrong;
  }
  return wrong;
}

inline constexpr int kGlobalBatch = 7;
inline constexpr int kSteps = 4;
inline constexpr SGDOptions kSgd{.lr = 0.1, .momentum = 0.9};

// The truth: one process, the global batch as W shards in turn (see the top of this file). Returns
// the model after kSteps steps; `last_buffers[r]` gets the buffers as rank r holds them after the
// last step's forward: rank 0's running statistics up to the step before, updated by shard r.
inline std::shared_ptr<Sequential> one_process(Device device, int world,
                                               double (*weight)(int64_t, int64_t),
                                               std::vector<std::vector<Tensor>>* last_buffers) {
  auto model = tiny_net();
  model->to(device);
  model->flatten_parameters();
  SGD sgd(model->parameters(), kSgd);
  CrossEntropyLoss criterion;
  const auto buffers = model->named_buffers();
  if (last_buffers) last_buffers->assign(static_cast<size_t>(world), {});
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = make_batch(kGlobalBatch, 500 + step, device);
    sgd.zero_grad();
    const std::vector<Tensor> before = copies(buffers);
    std::vector<Tensor> after_rank0;
    for (int r = 0; r < world; ++r) {
      if (r > 0) restore(buffers, before);
      const Batch s = shard(batch, r, world);
      const Tensor out = model->forward(s.images);
      criterion.forward(out, s.labels, weight(s.images.size(0), kGlobalBatch));
      model->backward(criterion.backward());
      if (r == 0) after_rank0 = copies(buffers);
      if (last_buffers && step == kSteps - 1) (*last_buffers)[r] = copies(buffers);
    }
    restore(buffers, after_rank0);
    sgd.step();
  }
  return model;
}

inline double share_of_batch(int64_t n, int64_t b) {
  return CrossEntropyLoss::chunk_weight(n, b);
}
}  // namespace cudp::testing::ddp
