// The run folder (--output DIR), as timm's output folder: everything a run leaves, in one place.
//
//   command.txt       every command line that ran in the folder (a resume adds its line)
//   settings.txt      the resolved settings, one "--option value" per line (rewritten on resume)
//   metrics.csv       one row per epoch, epoch from 1: mean train loss, train and test top-1 and
//                     top-5 accuracy (percent), test loss, learning rate, img/s, seconds
//   curves.png        loss and accuracy per epoch, redrawn after every epoch (examples/vgg/plot.h)
//   last.safetensors  the checkpoint after the last epoch (with last.train.safetensors)
//   best.safetensors  the checkpoint with the best test top-1 so far
//
// Resuming in the folder keeps the rows up to the checkpoint's epoch and drops any later ones (a
// run killed after writing a row but before its checkpoint), so metrics.csv always matches the
// checkpoint it continues from. Files other than the checkpoints are replaced atomically (written
// beside, then renamed), so a reader never sees half a picture. An epoch's metrics.csv and
// curves.png are written on the folder's own thread while the next epoch trains (drawing the curves
// takes ~10 ms with the GPU otherwise idle), one write at a time, in epoch order.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "examples/vgg/plot.h"

namespace cudp::trainer {

struct EpochMetrics {
  int64_t epoch = 0;  // from 1
  double train_loss = 0, train_top1 = 0, train_top5 = 0;
  double test_loss = 0, test_top1 = 0, test_top5 = 0;  // accuracies in percent
  double lr = 0, images_per_s = 0, seconds = 0;
};

class RunFolder {
 public:
  // Creates (or reopens, when resuming at `start_epoch` > 0) the folder and checks that it can be
  // written; throws IoError naming the folder otherwise.
  RunFolder(const std::string& dir, int64_t start_epoch, const std::string& command_line,
            const std::string& settings);

  // Waits for the write in flight. Its error, if nobody collected it with wait(), goes to stderr: a
  // destructor cannot throw, and it runs when something else already failed.
  ~RunFolder();
  RunFolder(const RunFolder&) = delete;
  RunFolder& operator=(const RunFolder&) = delete;

  // Waits for the previous write (rethrowing its error), then appends the epoch's row and rewrites
  // metrics.csv and curves.png on the folder's thread.
  void add(const EpochMetrics& m);
  // Waits for the write in flight, if any; rethrows its error (once).
  void wait();

  std::string last_checkpoint() const { return dir_ + "/last.safetensors"; }
  std::string best_checkpoint() const { return dir_ + "/best.safetensors"; }
  const std::string& dir() const { return dir_; }

 private:
  static void write_metrics(const std::string& dir, const std::vector<EpochMetrics>& rows);

  std::string dir_;
  std::vector<EpochMetrics> rows_;
  std::thread writer_;
  std::exception_ptr error_;
};

// Throws IoError (what the file is for, the path, what to do) unless `path` can be created or
// replaced as a regular file: its folder exists and takes a new file, and the path is not a folder
// or a special file (a FIFO would block). Nothing is left behind.
void check_output_file(const std::string& path, const std::string& what);

// Writes `bytes` to `path` through a temporary file made durable and renamed over it (StagedFile):
// a failed write (a full disk) throws IoError and leaves the previous file as it was.
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace cudp::trainer
