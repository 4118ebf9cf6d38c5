// cudp-vgg's settings: one table that the command line, the checkpoint's metadata and the run
// folder all go through.
//
// Why one table: a setting must read the same way whether it comes from the command line or from a
// checkpoint being resumed (issue 16: a checkpoint holding "schedule": "banana" used to change the
// run silently), and every setting a checkpoint records must come back on --resume (issue 17: the
// checkpoint path and --limit-test used to be lost). Each entry knows its option, its metadata key,
// whether another value makes it another run (strict), and one parser that validates and says in
// words what is wrong.
//
// Exit codes (printed by --help): 0 success, 1 the run failed (files absent or damaged, an output
// that cannot be written, a diverged run, a device error), 2 the command line is wrong (an unknown
// option, a value out of range, a setting that contradicts the checkpoint being resumed).
#pragma once

#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "layers/safetensors.h"

namespace cudp::trainer {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// The command line is wrong: main prints the message and exits with kExitUsage.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  // Data and model.
  std::string data = "fashion-mnist";
  std::string data_dir;
  std::string arch = "vgg16";
  bool bn = true;
  bool sync_bn = false;       // SyncBatchNorm: batch statistics over all GPUs' rows
  std::string head = "auto";  // auto: compact at 32x32, torchvision above
  int64_t image_size = 32;
  double dropout = 0.5;  // the classifier's Dropout probability
  // Optimisation. lr and weight_decay of 0 mean "the optimizer's default" until resolve_defaults.
  std::string opt = "sgd";
  double lr = 0;
  double momentum = 0.9;
  double weight_decay = -1;
  std::string schedule = "onecycle";
  int64_t warmup_epochs = 0;
  double clip_grad = 0;  // 0: off
  double label_smoothing = 0;
  int64_t batch_size = 256;
  int64_t accumulate = 1;  // micro-batches per batch (gradient accumulation); 1: none
  int64_t epochs = 10;
  std::string precision = "fp32";
  uint64_t seed = 0;
  bool augment = false;
  std::string on_nan = "stop";
  std::string graphs = "on";  // on: replay training steps from a CUDA graph (GPU, full batches)
  // on: each gradient bucket's update beside the rest of the backward (Replicated::
  // set_update_overlap; GPUs only, without --clip-grad and --on-nan skip-step)
  std::string overlap_update = "off";
  // on: the optimizer's update computes the gradient norm as it reads the gradients (when nothing
  // needs the norm before the update); off: a pass of its own before it. The same bits.
  std::string fused_grad_norm = "on";
  // Where things go.
  std::string checkpoint, resume, json, output;
  std::string save_test_set;
  bool eval_only = false;
  std::vector<int> gpus;  // empty: all visible (one per process, by local rank, under mpirun)
  bool no_gpus = false;   // --gpus none: the CPU
  int64_t workers = 4;
  double collective_timeout = 600;  // seconds an NCCL collective may take
  int64_t print_freq = 0;  // 0: 10 steps on a terminal, a fifth of an epoch otherwise
  int64_t limit_train = 0, limit_test = 0;  // the first N images (0: all)
  int64_t stop_after = 0;                   // stop after this epoch (0: run to --epochs)
  bool print_checksum = false;
  bool verbose = false;
  std::string command_line;                 // as typed, for the run folder
  std::set<std::string> given;              // options given on the command line ("--seed", ...)

  bool was_given(const std::string& option) const { return given.count(option) > 0; }
};

// Parses argv into `o`. Returns an exit code when the program should stop now (0 after --help; 2
// after a usage error, already printed), or -1 to go on.
int parse_command_line(int argc, char** argv, Options& o);

// Checks the settings together (after parsing and after adopting a checkpoint's): throws
// UsageError naming the options. Fills in what depends on others (lr, weight decay, head).
void resolve_and_check(Options& o);

// The settings a checkpoint records, as exact strings (their metadata).
Metadata settings_metadata(const Options& o);

// On --resume: settings left off the command line take the checkpoint's values (each parsed and
// validated; a bad value throws IoError naming the key and `file`); strict ones given with another
// value throw UsageError; others are kept with a note printed.
void adopt_settings(Options& o, const Metadata& meta, const std::string& file);

// The resolved settings as "option value" lines (the run folder's settings.txt) and as JSON text.
std::string settings_text(const Options& o);

// Parses a whole number in [lo, hi] from all of `text`; returns false when it is not one.
bool parse_integer(const std::string& text, int64_t lo, int64_t hi, int64_t& out);

}  // namespace cudp::trainer
