#include "examples/vgg/options.h"

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>

#include "engine/core/error.h"

namespace cudp::trainer {
namespace {

// The shortest text that reads back as the same double.
std::string text(double v) {
  char buf[64];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  return std::string(buf, end);
}

bool parse_real(const std::string& s, double& out) {
  const char* end = s.data() + s.size();
  const auto r = std::from_chars(s.data(), end, out);
  return r.ec == std::errc() && r.ptr == end && std::isfinite(out);
}

bool parse_unsigned(const std::string& s, uint64_t& out) {
  const char* end = s.data() + s.size();
  const auto r = std::from_chars(s.data(), end, out);
  return !s.empty() && s[0] != '-' && s[0] != '+' && r.ec == std::errc() && r.ptr == end;
}

// One setting: how it is named, saved, shown and parsed. parse() returns "" or what is wrong with
// the value, in words ("must be a number greater than 0").
struct Setting {
  std::string names;   // CLI11's name list: "-j,--workers"
  std::string option;  // the long name: "--workers"
  const char* key;     // metadata key, or nullptr when a checkpoint does not record it
  bool strict;         // another value makes it another run: refused on resume
  bool flag;           // a flag on the command line (its parser reads "1"/"0" from metadata)
  std::string help;
  std::function<std::string(const Options&)> get;
  std::function<std::string(Options&, const std::string&)> parse;
};

using Parse = std::function<std::string(Options&, const std::string&)>;

Parse choice(std::string Options::*m, std::vector<std::string> values) {
  return [m, values](Options& o, const std::string& v) -> std::string {
    for (const auto& x : values) {
      if (v == x) {
        o.*m = v;
        return "";
      }
    }
    std::string list;
    for (const auto& x : values) list += (list.empty() ? "" : ", ") + x;
    return "must be one of " + list + " (got \"" + v + "\")";
  };
}

Parse integer(int64_t Options::*m, int64_t lo, int64_t hi = std::numeric_limits<int>::max()) {
  return [m, lo, hi](Options& o, const std::string& v) -> std::string {
    int64_t x = 0;
    if (!parse_integer(v, lo, hi, x)) {
      return detail::str("must be a whole number from ", lo, " to ", hi, " (got \"", v, "\")");
    }
    o.*m = x;
    return "";
  };
}

// A finite number in [lo, hi], or (lo, hi] when lo_open.
Parse real(double Options::*m, double lo, bool lo_open,
           double hi = std::numeric_limits<double>::max()) {
  return [=](Options& o, const std::string& v) -> std::string {
    double x = 0;
    const bool ok = parse_real(v, x) && (lo_open ? x > lo : x >= lo) && x <= hi;
    if (ok) {
      o.*m = x;
      return "";
    }
    std::string range = lo_open ? "greater than " + text(lo) : "at least " + text(lo);
    if (hi < std::numeric_limits<double>::max()) {
      range = lo_open ? "greater than " + text(lo) + " and at most " + text(hi)
                      : "from " + text(lo) + " to " + text(hi);
    }
    return "must be a number " + range + " (got \"" + v + "\")";
  };
}

Parse any_text(std::string Options::*m) {
  return [m](Options& o, const std::string& v) -> std::string {
    o.*m = v;
    return "";
  };
}

Parse boolean(bool Options::*m) {
  return [m](Options& o, const std::string& v) -> std::string {
    if (v != "0" && v != "1") return "must be 0 or 1 (got \"" + v + "\")";
    o.*m = v == "1";
    return "";
  };
}

template <class T>
std::function<std::string(const Options&)> show(T Options::*m) {
  return [m](const Options& o) {
    if constexpr (std::is_same_v<T, std::string>) {
      return o.*m;
    } else if constexpr (std::is_same_v<T, bool>) {
      return std::string(o.*m ? "1" : "0");
    } else if constexpr (std::is_same_v<T, double>) {
      return text(o.*m);
    } else {
      return std::to_string(o.*m);
    }
  };
}

// Every setting that has a value. Flags without one (--eval-only, --print-checksum, --verbose) and
// --gpus (a list, validated against the devices) are added to the command line separately.
const std::vector<Setting>& settings() {
  static const std::vector<Setting> table = [] {
    std::vector<Setting> t;
    const auto add = [&t](std::string names, const char* key, bool strict, std::string help,
                          auto member, Parse parse, bool flag = false) {
      std::string option = names.substr(names.rfind(',') + 1);
      t.push_back({names, option, key, strict, flag, std::move(help), show(member),
                   std::move(parse)});
    };
    add("--data", "data", true,
        "data set: fashion-mnist, mnist, cifar10, folder (your images: --data-dir DIR with "
        "DIR/train/<class>/*.jpg|png and DIR/val/<class>/...) or synthetic (generated)",
        &Options::data,
        choice(&Options::data, {"fashion-mnist", "mnist", "cifar10", "folder", "synthetic"}));
    add("--data-dir", "data_dir", false,
        "folder of the data set's files (fashion-mnist default: /usr/share/datasets/fashion-mnist)",
        &Options::data_dir, any_text(&Options::data_dir));
    add("--arch", "arch", true, "network: vgg11, vgg13, vgg16 or vgg19", &Options::arch,
        choice(&Options::arch, {"vgg11", "vgg13", "vgg16", "vgg19"}));
    add("--bn", "bn", true, "", &Options::bn, boolean(&Options::bn), true);
    add("--sync-bn", "sync_bn", false,
        "synchronised BatchNorm (PyTorch's SyncBatchNorm): training normalises with the mean "
        "and variance of the whole batch over all GPUs (and all processes under mpirun), not of "
        "each GPU's or process's share (the same on one device); needs BatchNorm (not with "
        "--no-bn) and batches of at least one row per GPU",
        &Options::sync_bn, boolean(&Options::sync_bn), true);
    add("--head", "head", true,
        "classifier: compact (512-512-N, 32x32 inputs only), torchvision (4096-4096-N, loads into "
        "torchvision.models.vgg*_bn) or auto (compact at 32x32, torchvision above)",
        &Options::head, choice(&Options::head, {"auto", "compact", "torchvision"}));
    add("--dropout", "dropout", true,
        "probability of the classifier's two Dropout layers (torchvision's default 0.5; 0 turns "
        "them off)",
        &Options::dropout, real(&Options::dropout, 0, false, 0.999));
    add("--image-size", "image_size", true,
        "input side in pixels, a multiple of 32 (folder and synthetic data; the other sets are "
        "32x32)",
        &Options::image_size, integer(&Options::image_size, 32, 4096));
    add("--opt", "opt", true, "optimizer: sgd (momentum) or adamw", &Options::opt,
        choice(&Options::opt, {"sgd", "adamw"}));
    add("--lr", "lr", false,
        "learning rate (the peak rate for onecycle); default 0.05 for sgd, 0.001 for adamw",
        &Options::lr, real(&Options::lr, 0, true));
    add("--momentum", "momentum", false, "SGD momentum, or AdamW's beta1", &Options::momentum,
        real(&Options::momentum, 0, false, 0.999));
    add("--weight-decay", "weight_decay", false, "weight decay; default 5e-4 for sgd, 0.05 for adamw",
        &Options::weight_decay, real(&Options::weight_decay, 0, false));
    add("--schedule", "schedule", false, "learning-rate schedule: onecycle, cosine, step or constant",
        &Options::schedule, choice(&Options::schedule, {"onecycle", "cosine", "step", "constant"}));
    add("--warmup-epochs", "warmup_epochs", false,
        "epochs of linear warm-up before the schedule (cosine, step, constant; onecycle has its own)",
        &Options::warmup_epochs, integer(&Options::warmup_epochs, 0));
    add("--clip-grad", "clip_grad", false, "clip the gradients' global 2-norm to this (0: off)",
        &Options::clip_grad, real(&Options::clip_grad, 0, false));
    add("--label-smoothing", "label_smoothing", false,
        "train on targets 1 - e on the label and e / classes spread over all (PyTorch's "
        "label_smoothing); the test loss stays plain cross-entropy",
        &Options::label_smoothing, real(&Options::label_smoothing, 0, false, 1));
    add("--batch-size", "batch_size", true,
        "images per step (split over the GPUs); under mpirun per process, as with torchrun and "
        "DDP: the global batch is the number of processes times it",
        &Options::batch_size, integer(&Options::batch_size, 1, 1 << 20));
    add("--accumulate", "accumulate", false,
        "gradient accumulation: run each batch of --batch-size as this many micro-batches "
        "(forward and backward each, gradients added up on every GPU or process, then one "
        "all-reduce and one optimizer step), so activations need 1/N of the memory; the gradient "
        "is the whole batch's (BatchNorm normalises each micro-batch by its own statistics)",
        &Options::accumulate, integer(&Options::accumulate, 1, 1 << 20));
    add("--epochs", "epochs", false, "epochs (the schedule spans them)", &Options::epochs,
        integer(&Options::epochs, 1, 1000000));
    add("--precision", "precision", false,
        "how the convolutions and linear layers compute: fp32, bf16 (bf16 operands on tensor "
        "cores, fp32 accumulation and master weights) or tf32 (fp32 tensors, TF32 operands on "
        "tensor cores, fp32 accumulation); bf16 and tf32 need an sm_90 GPU (on the CPU both are "
        "emulated)",
        &Options::precision, choice(&Options::precision, {"fp32", "tf32", "bf16"}));
    add("--seed", "seed", true, "seed of weights, data order and dropout, 0 to 2^64-1",
        &Options::seed, [](Options& o, const std::string& v) -> std::string {
          if (!parse_unsigned(v, o.seed)) {
            return "must be a whole number from 0 to 18446744073709551615 (got \"" + v + "\")";
          }
          return "";
        });
    add("--augment", "augment", false,
        "training augmentation: random crop (and flip for CIFAR-10); for --data folder, "
        "torchvision's RandomResizedCrop and horizontal flip",
        &Options::augment,
        boolean(&Options::augment), true);
    add("--on-nan", "on_nan", false,
        "when the loss or gradient norm is not finite: stop (the default; names the step and the "
        "last good checkpoint) or skip-step (the update is skipped on the device, with no host "
        "read per step; skipped steps are named at the next progress line)",
        &Options::on_nan, choice(&Options::on_nan, {"stop", "skip-step"}));
    add("--graphs", nullptr, false,
        "on: capture a training step in a CUDA graph after two warm-up steps and replay it for "
        "every full batch (a last, partial batch runs without), with the same results bit for "
        "bit; off: launch every kernel of every step. GPU only (on the CPU steps run without, and "
        "an explicit --graphs on is refused)",
        &Options::graphs, choice(&Options::graphs, {"on", "off"}));
    add("--overlap-update", nullptr, false,
        "on: update each gradient bucket's parameters on a stream of their own as soon as the "
        "backward has completed (and all-reduced) the bucket, beside the rest of the backward, "
        "with the same results bit for bit; off: one update after the whole backward. GPUs only, "
        "and not with --clip-grad or --on-nan skip-step (both need the whole backward's gradients "
        "before any update)",
        &Options::overlap_update, choice(&Options::overlap_update, {"on", "off"}));
    add("--fused-grad-norm", nullptr, false,
        "on: the gradient norm the run logs and checks for divergence is computed by the "
        "optimizer's update as it reads the gradients, one pass over them instead of two, where "
        "the update is one launch over the flat parameters (GPUs, without --overlap-update on; "
        "elsewhere a pass of its own after the update; the run's last lines say which ran); off: "
        "a pass of its own before the update. The same norm and weights bit for bit; with "
        "--clip-grad or --on-nan skip-step the norm is needed before the update and always takes "
        "its own pass",
        &Options::fused_grad_norm, choice(&Options::fused_grad_norm, {"on", "off"}));
    add("--checkpoint", "checkpoint", false,
        "write a checkpoint here after every epoch (kept on --resume)", &Options::checkpoint,
        any_text(&Options::checkpoint));
    add("--output", "output", false,
        "run folder: settings, metrics.csv, curves.png, last and best checkpoints (kept on --resume)",
        &Options::output, any_text(&Options::output));
    add("--json", "json", false, "append one JSON object per progress line and epoch (kept on --resume)",
        &Options::json, any_text(&Options::json));
    add("--save-test-set", nullptr, false,
        "write the test images as the model sees them (uint8 NHWC, labels, normalisation) to this "
        "safetensors file, to check a checkpoint elsewhere (scripts/imagefolder-check.sh)",
        &Options::save_test_set, any_text(&Options::save_test_set));
    add("--resume", nullptr, false,
        "continue from this checkpoint (or run folder); settings left out come from it",
        &Options::resume, any_text(&Options::resume));
    add("-j,--workers", nullptr, false, "host threads preparing batches", &Options::workers,
        integer(&Options::workers, 1, 256));
    add("--collective-timeout", nullptr, false,
        "seconds an NCCL collective may take before the run ends with an error naming the rank, "
        "its GPU and the collective",
        &Options::collective_timeout, real(&Options::collective_timeout, 0, true, 7 * 86400));
    add("--print-freq", nullptr, false,
        "steps between progress lines (default: 10 on a terminal, a fifth of an epoch otherwise)",
        &Options::print_freq, integer(&Options::print_freq, 1));
    add("--limit-train", "limit_train", true, "use only the first N training images (0: all)",
        &Options::limit_train, integer(&Options::limit_train, 0, std::numeric_limits<int64_t>::max()));
    add("--limit-test", "limit_test", false, "use only the first N test images (0: all)",
        &Options::limit_test, integer(&Options::limit_test, 0, std::numeric_limits<int64_t>::max()));
    add("--stop-after", nullptr, false,
        "stop after this epoch, as if interrupted (at most --epochs; the schedule still spans "
        "--epochs; --resume continues)",
        &Options::stop_after, integer(&Options::stop_after, 0, 1000000));
    return t;
  }();
  return table;
}

const char* const kExitCodes =
    "Exit status: 0 success; 1 the run failed (data or checkpoint absent or damaged, an output "
    "that cannot be written, a diverged run, a device error); 2 the command line is wrong (an "
    "unknown option, a value out of range, a setting that contradicts the checkpoint being "
    "resumed).\nErrors print without source locations; --verbose (or CUDP_VERBOSE=1) adds them.";

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_.,/=:+@%") == std::string::npos) {
    return s;
  }
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

}  // namespace

bool parse_integer(const std::string& s, int64_t lo, int64_t hi, int64_t& out) {
  const char* end = s.data() + s.size();
  int64_t x = 0;
  const auto r = std::from_chars(s.data(), end, x);
  if (s.empty() || s[0] == '+' || r.ec != std::errc() || r.ptr != end || x < lo || x > hi) {
    return false;
  }
  out = x;
  return true;
}

int parse_command_line(int argc, char** argv, Options& o) {
  CLI::App app{
      "cudp-vgg: train a VGG on Fashion-MNIST, MNIST, CIFAR-10, your own image folders "
      "(--data folder) or generated data with data parallelism over the visible GPUs (the "
      "CPU when there is none)"};
  app.footer(kExitCodes);
  const Options defaults;
  for (const Setting& s : settings()) {
    if (s.option == "--bn") {
      app.add_flag_callback("--bn", [&o] { o.bn = true; },
                            "BatchNorm after every convolution (the default)");
      app.add_flag_callback("--no-bn", [&o] { o.bn = false; }, "no BatchNorm");
      continue;
    }
    if (s.flag) {
      app.add_flag_callback(s.names, [&o, &s] { s.parse(o, "1"); }, s.help);
      continue;
    }
    const bool path = s.option == "--data-dir" || s.option == "--checkpoint" ||
                      s.option == "--save-test-set" || s.option == "--output" ||
                      s.option == "--json" || s.option == "--resume";
    auto* option = app.add_option_function<std::string>(
        s.names,
        [&o, &s, path](const std::string& v) {
          // An empty path is an unset shell variable more often than a choice: taken as "not
          // given", it would quietly drop the run's outputs or read the default data.
          if (path && v.empty()) {
            throw CLI::ValidationError(s.option,
                                       "is empty; give a path, or leave " + s.option + " out");
          }
          const std::string problem = s.parse(o, v);
          if (!problem.empty()) throw CLI::ValidationError(s.option, problem);
        },
        s.help);
    // Given twice, the last value counts (argparse's rule, which PyTorch scripts follow).
    option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    // The default beside the option, except where it is worked out later (lr and weight decay
    // depend on --opt, the progress interval on the terminal).
    const std::string shown = s.get(defaults);
    if (!shown.empty() && s.option != "--lr" && s.option != "--weight-decay" &&
        s.option != "--print-freq") {
      option->default_str(shown);
    }
    option->type_name(path ? "PATH" : "VALUE");
  }
  std::string gpus;
  app.add_option("--gpus", gpus,
                 "comma-separated device ids, or none for the CPU (default: all visible, or the "
                 "CPU on a machine without GPUs; under mpirun one per process, picked by its "
                 "local rank)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_flag("-e,--evaluate,--eval-only", o.eval_only,
               "evaluate the --resume checkpoint and stop; a file of weights alone (a state dict "
               "as PyTorch saves it, no training-state file beside it) is evaluated with the "
               "command line's settings (--arch, --bn/--no-bn, --head, --image-size, --data)");
  app.add_flag("--print-checksum", o.print_checksum,
               "print a checksum of the model's parameters and buffers at the end (compares runs)");
  app.add_flag("--verbose", o.verbose, "error messages with their source locations");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "cudp-vgg: %s\nRun cudp-vgg --help for the options.\n", e.what());
    return kExitUsage;
  }
  for (const CLI::Option* option : app.get_options()) {
    if (option->count() == 0) continue;
    for (const std::string& name : option->get_lnames()) o.given.insert("--" + name);
  }
  if (o.was_given("--bn") && o.was_given("--no-bn")) {
    std::fprintf(stderr, "cudp-vgg: --bn and --no-bn contradict each other; give one\n");
    return kExitUsage;
  }
  if (o.was_given("--sync-bn") && o.was_given("--no-bn")) {
    std::fprintf(stderr,
                 "cudp-vgg: --sync-bn synchronises the BatchNorm layers and --no-bn leaves none; "
                 "give one\n");
    return kExitUsage;
  }
  if (o.was_given("--gpus") && gpus.empty()) {
    std::fprintf(stderr,
                 "cudp-vgg: --gpus is empty; give device ids (e.g. --gpus 0,1), none for the CPU, "
                 "or leave it out for every visible GPU\n");
    return kExitUsage;
  }
  o.no_gpus = gpus == "none";
  std::stringstream ss(o.no_gpus ? std::string() : gpus);
  for (std::string id; std::getline(ss, id, ',');) {
    int64_t v = 0;
    if (!parse_integer(id, 0, 1 << 20, v)) {
      std::fprintf(stderr, "cudp-vgg: --gpus: \"%s\" is not a device id (a whole number >= 0)\n",
                   id.c_str());
      return kExitUsage;
    }
    o.gpus.push_back(static_cast<int>(v));
  }
  for (int i = 0; i < argc; ++i) o.command_line += (i ? " " : "") + shell_quote(argv[i]);
  return -1;
}

void resolve_and_check(Options& o) {
  if (o.lr == 0) o.lr = o.opt == "adamw" ? 1e-3 : 0.05;
  if (o.weight_decay < 0) o.weight_decay = o.opt == "adamw" ? 0.05 : 5e-4;
  if (o.eval_only && o.resume.empty()) {
    throw UsageError("--eval-only needs --resume CHECKPOINT (the checkpoint to evaluate)");
  }
  if (o.image_size % 32 != 0) {
    throw UsageError(detail::str("--image-size ", o.image_size,
                                 " is not a multiple of 32 (VGG halves it five times)"));
  }
  if (o.data == "folder" && o.data_dir.empty()) {
    throw UsageError("--data folder needs --data-dir DIR, with DIR/train/<class>/<image> and "
                     "DIR/val/<class>/<image> (JPEG or PNG)");
  }
  if (o.data != "synthetic" && o.data != "folder" && o.image_size != 32) {
    throw UsageError(detail::str("--image-size ", o.image_size, ": --data ", o.data,
                                 " trains at 32x32 (resizing is not implemented for it); leave "
                                 "--image-size out, or use --data folder or synthetic"));
  }
  if (o.head == "auto") o.head = o.image_size == 32 ? "compact" : "torchvision";
  if (o.head == "compact" && o.image_size != 32) {
    throw UsageError(detail::str("--head compact needs 32x32 inputs, not --image-size ",
                                 o.image_size, "; use --head torchvision"));
  }
  if (o.warmup_epochs > 0 && o.schedule == "onecycle") {
    throw UsageError("--warmup-epochs with --schedule onecycle: onecycle warms up by itself (its "
                     "first 30%); use --schedule cosine, step or constant with --warmup-epochs");
  }
  if (o.warmup_epochs >= o.epochs && o.warmup_epochs > 0) {
    throw UsageError(detail::str("--warmup-epochs ", o.warmup_epochs, " must be less than --epochs ",
                                 o.epochs));
  }
  if (o.accumulate > o.batch_size) {
    throw UsageError(detail::str("--accumulate ", o.accumulate,
                                 " splits each batch of --batch-size ", o.batch_size,
                                 " into that many micro-batches of at least one "
                                 "image; give at most ",
                                 o.batch_size));
  }
  if (o.stop_after > o.epochs) {
    throw UsageError(detail::str("--stop-after ", o.stop_after, " is more than --epochs ", o.epochs,
                                 ": the run would stop at --epochs anyway; give --stop-after <= "
                                 "--epochs"));
  }
}

namespace {

// A setting as a user writes it: "--lr 0.1", and a flag as itself or its absence ("--no-bn",
// "no --augment").
std::string as_written(const Setting& s, const std::string& value) {
  if (!s.flag) return s.option + " " + value;
  if (value == "1") return s.option;
  return s.option == "--bn" ? std::string("--no-bn") : "no " + s.option;
}

// Where a run writes (its run folder, checkpoint and log), not how it trains.
bool is_output(const Setting& s) {
  return s.option == "--output" || s.option == "--checkpoint" || s.option == "--json";
}

}  // namespace

Metadata settings_metadata(const Options& o) {
  Metadata meta;
  for (const Setting& s : settings()) {
    if (!s.key) continue;
    meta[s.key] = s.get(o);
    // Where the run writes, as absolute paths: a resume from another folder writes to the same
    // places, not to new ones below the folder it was started from.
    if (is_output(s) && !meta[s.key].empty()) {
      meta[s.key] = std::filesystem::absolute(meta[s.key]).lexically_normal().string();
    }
  }
  return meta;
}

void adopt_settings(Options& o, const Metadata& meta, const std::string& file) {
  // Notes are printed once every setting has been checked: a refused resume prints none.
  std::vector<std::string> notes;
  for (const Setting& s : settings()) {
    if (!s.key) continue;
    const auto it = meta.find(s.key);
    if (it == meta.end()) continue;  // an older checkpoint: the command line's value stands
    // Parse the saved value first: a damaged file must not pass for a setting.
    Options saved = o;
    const std::string problem = s.parse(saved, it->second);
    if (!problem.empty()) {
      throw IoError(detail::str(file, ": the saved setting \"", s.key, "\" (", s.option, ") ",
                                problem, "; the file is damaged or was not written by cudp-vgg"),
                    __FILE__, __LINE__);
    }
    const std::string mine = s.get(o);
    if (s.get(saved) == mine) continue;
    const bool given = o.was_given(s.option) || (s.option == "--bn" && o.was_given("--no-bn"));
    if (!given) {
      s.parse(o, it->second);
      continue;
    }
    if (s.strict) {
      const std::string leave = s.option == "--bn" ? "--bn/--no-bn" : s.option;
      throw UsageError(detail::str("--resume ", o.resume, ": the checkpoint was written with ",
                                   as_written(s, it->second), ", this run has ",
                                   as_written(s, mine), "; resuming needs the same value (leave ",
                                   leave, " out to take the checkpoint's)"));
    }
    if (s.option == "--epochs") {
      if (o.schedule != "constant") {
        notes.push_back(detail::str("the checkpointed run planned ", it->second, " epochs; the ",
                                    o.schedule, " schedule now spans ", o.epochs,
                                    ", so the rates from here on are those of a ", o.epochs,
                                    "-epoch run"));
      }
      continue;
    }
    if (is_output(s)) {
      notes.push_back(detail::str(s.option, " ", mine,
                                  ": this run writes there, not to the "
                                  "checkpoint's ",
                                  it->second));
      continue;
    }
    notes.push_back(detail::str(as_written(s, mine), " differs from the checkpoint's ",
                                as_written(s, it->second),
                                ": training continues with it, not as "
                                "the checkpointed run would have"));
  }
  for (const std::string& note : notes) std::printf("note: %s\n", note.c_str());
}

std::string settings_text(const Options& o) {
  std::string out;
  for (const Setting& s : settings()) {
    const std::string value = s.get(o);
    if (s.option == "--resume" && o.resume.empty()) continue;
    if (s.option == "--print-freq" && value == "0") continue;  // unset: chosen at run time
    if (s.flag) {
      // As a command line has it: the flag, or --no-bn; an unset flag is left out.
      if (value == "1" || s.option == "--bn") out += as_written(s, value) + "\n";
      continue;
    }
    out += s.option + " " + shell_quote(value) + "\n";
  }
  std::string gpus;
  for (int g : o.gpus) gpus += (gpus.empty() ? "" : ",") + std::to_string(g);
  out += "--gpus " +
         (o.no_gpus      ? std::string("none")
          : gpus.empty() ? std::string("all")
                         : gpus) +
         "\n";
  return out;
}

}  // namespace cudp::trainer
