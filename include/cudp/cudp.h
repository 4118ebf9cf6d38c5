// cudp's umbrella header: everything a user needs, in one include.
//
// Devices, streams, memory and tensors; the Module base class and every layer; the loss, the
// optimizers, learning-rate schedules and checkpoints; VGG; the data sets, the samplers, the loader
// and the device prefetcher; DataParallel and data_parallel(); the process group, the MPI
// bootstrap, DistributedDataParallel, SyncBatchNorm and the collective watchdog (one process per
// GPU, docs/distributed.md). All of it compiles with a plain C++20 compiler (the CUDA toolkit's
// headers come with CUDA::cudart): a program that links cudp::cudp needs no CUDA language of its
// own. The kernels (kernels/*.h) are an internal layer and are not included; a program that calls
// them includes them by name.
#pragma once

// Devices, streams, memory, tensors, errors.
#include "engine/core/device.h"
#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"

// Modules and layers.
#include "layers/activation.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dropout.h"
#include "layers/flatten.h"
#include "layers/init.h"
#include "layers/linear.h"
#include "layers/module.h"
#include "layers/pooling.h"
#include "layers/precision.h"
#include "layers/sequential.h"
#include "layers/vgg.h"

// Training: loss, optimizers, schedules, the one-device step helpers, checkpoints.
#include "layers/checkpoint.h"
#include "layers/loss.h"
#include "layers/optim.h"
#include "layers/safetensors.h"
#include "layers/schedule.h"
#include "layers/train.h"

// Data: IDX (MNIST, Fashion-MNIST), CIFAR-10, image folders, the synthetic set, the loader, the
// device prefetcher.
#include "data/cifar.h"
#include "data/dataset.h"
#include "data/idx.h"
#include "data/image_folder.h"
#include "data/loader.h"
#include "data/prefetcher.h"
#include "data/sampler.h"
#include "data/synthetic.h"

// Data parallelism: DataParallel, data_parallel(), parallel::Replicated<Opt>; one process per GPU:
// parallel::ProcessGroup, parallel::mpi::Session, DistributedDataParallel, the collective watchdog;
// SyncBatchNorm2d and convert_sync_batchnorm, with the statistics groups of both paths.
#include "engine/parallel/data_parallel.h"
#include "engine/parallel/ddp.h"
#include "engine/parallel/mpi_bootstrap.h"
#include "engine/parallel/process_group.h"
#include "engine/parallel/stats_group.h"
#include "layers/sync_batchnorm.h"
