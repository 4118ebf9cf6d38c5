// custom_model: the seed program (a small CNN on Fashion-MNIST, trained data-parallel on every GPU)
// written against an installed cudp, as a project of your own would be. It uses nothing but
// find_package(cudp) and `#include <cudp/cudp.h>`; the model is seed_cnn.h.
//
//   custom_model                                   # Fashion-MNIST, all visible GPUs, 1 epoch
//   custom_model --data synthetic --epochs 1       # no files needed; runs on the CPU without a GPU
//   custom_model --data synthetic --gpus none      # the CPU, GPUs or not
//   custom_model --gpus 0 --steps 50 --print-checksum
//   custom_model --gpus 0,1 --steps 50 --print-checksum   # same checksum to fp32 rounding
//   CUDA_VISIBLE_DEVICES=1 custom_model --save cnn.safetensors
//
// What happens, in the seed's order: device calls (count, current, set_device, what
// CUDA_VISIBLE_DEVICES did), data, model, DataParallel over the GPUs, SGD on every replica, then
// training with the test accuracy computed the seed's way: argmax of the logits, moved to the host
// with .cpu(), compared with the labels there.
#include <cudp/cudp.h>
#include <unistd.h>  // getpid, for the --save check's probe file

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "seed_cnn.h"

using namespace cudp;

namespace {

struct Options {
  std::string data = "fashion-mnist";  // or "synthetic"
  std::string data_dir;                // empty: data::kFashionMnistSystemDir
  std::vector<int> gpus;               // empty: every visible GPU
  bool cpu = false;                    // --gpus none: the CPU, GPUs or not
  int epochs = 1;
  int64_t steps = 0;  // > 0: stop after this many steps
  int64_t batch_size = 64;
  int64_t synthetic_size = 2048;  // training images of the synthetic set
  double lr = 0.05, momentum = 0.9;
  uint64_t seed = 0;
  std::string save;
  std::string precision = "fp32";  // or "bf16" or "tf32" (tensor cores, sm_90)
  bool print_checksum = false;
};

const char* kUsage =
    "usage: custom_model [--data fashion-mnist|synthetic] [--data-dir DIR] [--gpus 0,1,...|none]\n"
    "                    [--epochs N] [--steps N] [--batch-size N] [--lr X] [--momentum X]\n"
    "                    [--seed N] [--synthetic-size N] [--save PATH] [--print-checksum]\n"
    "                    [--precision fp32|bf16|tf32]\n"
    "Exit status: 0 success; 1 the run failed; 2 the command line is wrong.\n"
    "Errors print without cudp's source locations; CUDP_VERBOSE=1 adds them.\n";

// A wrong command line (exit 2), told apart from a run that failed (exit 1).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Strict values, as cudp-vgg reads them: the whole text is the value and the value is in range,
// or the message names the option, what it takes and what it got. (std::stoll reads "10abc" as
// 10, std::stoull reads "-1" as 2^64-1, and std::stod takes "nan".)
[[noreturn]] void bad_value(const std::string& option, const std::string& takes,
                            const std::string& v) {
  throw UsageError(option + ": must be " + takes + " (got \"" + v + "\")");
}

// A whole number: digits, with a minus sign for a signed T only (no "+", no spaces).
template <typename T>
bool read_whole(const std::string& v, T& x) {
  const auto [end, error] = std::from_chars(v.data(), v.data() + v.size(), x);
  return error == std::errc() && end == v.data() + v.size();
}

template <typename T>
T whole(const std::string& option, const std::string& v, T lo, T hi) {
  T x = 0;
  if (!read_whole(v, x) || x < lo || x > hi) {
    bad_value(option, "a whole number from " + std::to_string(lo) + " to " + std::to_string(hi), v);
  }
  return x;
}

// A finite number in [lo, hi], or one greater than lo when hi is infinity ("1e-3", not "0.1x",
// "nan" or "inf").
double real(const std::string& option, const std::string& v, double lo, double hi) {
  const auto text = [](double d) {
    char buf[32];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, d).ptr);
  };
  double x = 0;
  const auto [end, error] = std::from_chars(v.data(), v.data() + v.size(), x);
  const bool number = error == std::errc() && end == v.data() + v.size() && std::isfinite(x);
  if (std::isinf(hi)) {
    if (!number || x <= lo) bad_value(option, "a number greater than " + text(lo), v);
  } else if (!number || x < lo || x > hi) {
    bad_value(option, "a number from " + text(lo) + " to " + text(hi), v);
  }
  return x;
}

std::string one_of(const std::string& option, const std::string& v,
                   const std::vector<std::string>& values) {
  std::string list;
  for (const std::string& x : values) {
    if (v == x) return v;
    list += (list.empty() ? "" : ", ") + x;
  }
  bad_value(option, "one of " + list, v);
}

// A hand-written parser (the installed cudp does not bring CLI11 along): `--name value` or
// `--name=value`, every value checked here, before anything runs. The ranges are cudp-vgg's.
Options parse(int argc, char** argv) {
  Options o;
  constexpr double kNoMax = std::numeric_limits<double>::infinity();
  using Set = std::function<void(const std::string&)>;
  const std::map<std::string, Set> takes_value = {
      {"--data",
       [&](const std::string& v) {
         o.data = one_of("--data", v, {"fashion-mnist", "synthetic"});
       }},
      {"--data-dir", [&](const std::string& v) { o.data_dir = v; }},
      {"--epochs", [&](const std::string& v) { o.epochs = whole("--epochs", v, 1, 1000000); }},
      {"--steps",
       [&](const std::string& v) {
         o.steps = whole<int64_t>("--steps", v, 0, std::numeric_limits<int>::max());
       }},
      {"--batch-size",
       [&](const std::string& v) { o.batch_size = whole<int64_t>("--batch-size", v, 1, 1 << 20); }},
      {"--synthetic-size",
       [&](const std::string& v) {
         o.synthetic_size = whole<int64_t>("--synthetic-size", v, 1, 1 << 20);
       }},
      {"--lr", [&](const std::string& v) { o.lr = real("--lr", v, 0, kNoMax); }},
      {"--momentum", [&](const std::string& v) { o.momentum = real("--momentum", v, 0, 0.999); }},
      {"--seed",
       [&](const std::string& v) {
         o.seed = whole<uint64_t>("--seed", v, 0, std::numeric_limits<uint64_t>::max());
       }},
      {"--save", [&](const std::string& v) { o.save = v; }},
      {"--precision",
       [&](const std::string& v) {
         o.precision = one_of("--precision", v, {"fp32", "bf16", "tf32"});
       }},
      {"--gpus",
       [&](const std::string& v) {
         o.gpus.clear();
         o.cpu = v == "none";
         std::stringstream list(o.cpu ? std::string() : v);
         for (std::string id; std::getline(list, id, ',');) {
           int x = 0;
           if (!read_whole(id, x) || x < 0) {
             throw UsageError("--gpus: \"" + id +
                              "\" is not a device id (a whole number >= 0, or none)");
           }
           o.gpus.push_back(x);
         }
       }},
  };
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;  // --name=value
    if (const size_t eq = arg.find('='); arg.starts_with("--") && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
      has_value = true;
    }
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (arg == "--print-checksum") {
      if (has_value) throw UsageError(arg + " takes no value");
      o.print_checksum = true;
    } else if (const auto it = takes_value.find(arg); it != takes_value.end()) {
      if (!has_value && i + 1 == argc) throw UsageError(arg + " needs a value");
      it->second(has_value ? value : std::string(argv[++i]));
    } else {
      throw UsageError("unknown option " + std::string(argv[i]));
    }
  }
  return o;
}

// --save is checked before anything trains, as cudp-vgg checks --checkpoint: a path that cannot
// be written should not cost a run (and leave half of a checkpoint behind).
void check_output_file(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  const fs::file_status status = fs::status(p, ec);
  if (fs::is_directory(status)) {
    throw std::runtime_error("--save " + path + " is a folder; give a file name (e.g. " +
                             (p / "cnn.safetensors").string() + ")");
  }
  if (fs::exists(status) && !fs::is_regular_file(status)) {
    throw std::runtime_error("--save " + path +
                             " exists and is not a regular file (a FIFO, device or socket); give "
                             "a file path");
  }
  const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(folder, ec)) {
    throw std::runtime_error("--save " + path + ": the folder " + folder.string() +
                             " does not exist; create it first or choose another path");
  }
  // Create and remove a file beside it: the one test that covers permissions, read-only file
  // systems and quotas alike.
  const std::string probe = path + ".probe-" + std::to_string(::getpid());
  std::FILE* f = std::fopen(probe.c_str(), "wx");
  if (f == nullptr) {
    const int err = errno;
    throw std::runtime_error("--save " + path + " cannot be written: creating a file in " +
                             folder.string() + " failed (" + std::strerror(err) +
                             "); choose a writable folder");
  }
  std::fclose(f);
  std::remove(probe.c_str());
}

// The seed's device calls: torch.cuda.device_count(), current_device(), set_device(), and what
// CUDA_VISIBLE_DEVICES did to the numbering.
void show_devices() {
  const int n = cuda::device_count();  // 0 without a GPU, never an exception
  const cuda::VisibleDevices visible = cuda::visible_devices();
  std::printf("devices: %d visible", n);
  if (visible.set) std::printf(" (CUDA_VISIBLE_DEVICES=\"%s\")", visible.raw.c_str());
  std::printf("\n");
  for (int i = 0; i < n; ++i) {
    // With CUDA_VISIBLE_DEVICES=0,4, visible id 1 is physical GPU 4.
    std::printf("  cuda:%d = physical GPU %s, %s\n", i, cuda::physical_id(i).c_str(),
                cuda::device_name(i).c_str());
  }
  if (n == 0) {
    std::printf("  no GPU: the model trains on the CPU (slowly)\n");
    return;
  }
  std::printf("current device: %d\n", cuda::current_device());
  cuda::set_device(n - 1);
  std::printf("after set_device(%d): current device %d\n", n - 1, cuda::current_device());
  cuda::set_device(0);
}

struct Data {
  data::Dataset train, test;
};

// Fashion-MNIST (gzip or raw IDX files) from --data-dir or where Debian/Ubuntu's package puts it,
// or the synthetic set: asked for, or because the package's files are not there. A --data-dir that
// does not hold the files is an error that names the missing file.
Data load_data(const Options& o) {
  const std::string dir = o.data_dir.empty() ? data::kFashionMnistSystemDir : o.data_dir;
  if (o.data == "fashion-mnist" && (!o.data_dir.empty() || std::filesystem::exists(dir))) {
    std::printf("data: Fashion-MNIST from %s\n", dir.c_str());
    return {data::load_mnist_like(dir, true), data::load_mnist_like(dir, false)};
  }
  if (o.data == "fashion-mnist") {
    std::printf(
        "data: %s is absent (install dataset-fashion-mnist or pass --data-dir): "
        "using the synthetic set\n",
        dir.c_str());
  }
  data::SyntheticOptions s;  // 28x28x1, 10 classes, like Fashion-MNIST
  s.n_train = o.synthetic_size;
  s.n_test = 2000;
  s.seed = o.seed;
  std::printf("data: synthetic, %lld training images\n", static_cast<long long>(s.n_train));
  return {data::make_synthetic(s, true), data::make_synthetic(s, false)};
}

// The seed's accuracy on the first 2000 test images: forward, argmax of the logits, .cpu(), and
// a comparison with the labels on the host (torch.max(test_output, 1)[1].data.cpu() == test_y).
double test_accuracy(Module& model, data::Loader& test, Device device) {
  model.eval();
  int64_t correct = 0, seen = 0;
  test.start_epoch(0);
  data::Batch b;
  while (seen < 2000 && test.next(b)) {
    const Tensor images = b.images.to(device);               // an explicit copy (none on the CPU)
    const TensorList outputs = model.forward_all({images});  // {logits, features}
    const std::vector<int32_t> predicted = argmax(outputs[0], 1).cpu().to_vector<int32_t>();
    const std::vector<int32_t> labels = b.labels.to_vector<int32_t>();  // host labels
    for (size_t i = 0; i < labels.size(); ++i) correct += predicted[i] == labels[i];
    seen += static_cast<int64_t>(labels.size());
  }
  model.train();
  return static_cast<double>(correct) / static_cast<double>(seen);
}

// sum and sum of squares of every parameter, in double (a 1-GPU and a 2-GPU run agree to fp32
// rounding: the order of the gradient sums is all that differs).
void print_checksum(Module& net) {
  double sum = 0, sum_sq = 0;
  for (Parameter* p : net.parameters()) {
    for (const float v : p->data.cpu().to_vector<float>()) {
      sum += v;
      sum_sq += static_cast<double>(v) * v;
    }
  }
  std::printf("checksum: sum %.17g sum_sq %.17g\n", sum, sum_sq);
}

int run(const Options& o) {
  show_devices();

  // The GPUs to use: --gpus, or all of them; none at all with --gpus none or without a GPU.
  std::vector<int> gpus = o.gpus;
  if (gpus.empty() && !o.cpu) {
    for (int i = 0; i < cuda::device_count(); ++i) gpus.push_back(i);
  }
  if (o.cpu) std::printf("--gpus none: the model trains on the CPU\n");
  for (int g : gpus) {
    try {
      cuda::check_device(g);
    } catch (const ValueError& e) {  // an invalid id: the message names the valid ones
      throw UsageError("--gpus: " + e.message());
    }
  }
  const Device device = gpus.empty() ? Device::cpu() : Device::cuda(gpus[0]);

  // The output files, before anything is loaded or trained: the model and the optimizer state.
  if (!o.save.empty()) {
    check_output_file(o.save);
    check_output_file(optimizer_state_path(o.save));
  }

  const Data d = load_data(o);
  data::LoaderOptions lo;
  lo.batch_size = o.batch_size;
  lo.seed = o.seed;
  lo.normalization = data::compute_normalization(d.train);  // per-channel mean/std of train
  data::Loader train_loader(d.train, lo);
  data::LoaderOptions test_options = lo;
  test_options.shuffle = false;
  test_options.batch_size = 500;
  data::Loader test_loader(d.test, test_options);

  // The model, built on the CPU and moved to the first GPU: DataParallel wants the parameters on
  // device_ids[0] (as PyTorch does) and copies them once to the other GPUs.
  auto net = std::make_shared<seed::SeedCnn>(
      seed::SeedCnnOptions{.in_channels = static_cast<int>(d.train.channels),
                           .n_classes = d.train.num_classes,
                           .image_size = static_cast<int>(d.train.height),
                           .seed = o.seed});
  // bf16: every convolution and linear product on bf16 tensor cores (fp32 accumulation, fp32
  // weights); on the CPU the operands are rounded the same way (layers/precision.h). tf32: the
  // same products on TF32 tensor cores with fp32 tensors; on the CPU their operands are truncated
  // to TF32 and the products computed in fp32.
  net->set_precision(parse_precision(o.precision));
  net->to(device);
  // (Conv2d keeps its weights as [out, kh, kw, in] for the NHWC kernels; state_dict() and the
  // checkpoints export PyTorch's [out, in, kh, kw].)
  std::printf("model: SeedCnn, %s products, %lld parameters:", o.precision.c_str(),
              static_cast<long long>(net->num_parameters()));
  for (const auto& [name, p] : net->named_parameters()) {
    std::printf(" %s%s", name.c_str(), shape_str(p->data.shape()).c_str());
  }
  std::printf("\n");

  // Every GPU in `gpus` gets a replica. On the CPU the model runs as it is: a DataParallel given no
  // device list would take every visible GPU, as PyTorch's does.
  std::unique_ptr<DataParallel> wrapped;
  if (!gpus.empty()) wrapped = std::make_unique<DataParallel>(net, gpus);
  Module& model = wrapped ? static_cast<Module&>(*wrapped) : *net;
  if (wrapped) {
    std::printf("DataParallel over %zu replica(s) on %s\n", wrapped->num_replicas(),
                device.str().c_str());
  }

  // One SGD per replica, stepped together: every replica applies the same summed gradient, so they
  // stay identical without re-broadcasting weights.
  parallel::Replicated<SGD> opt(model, {.lr = o.lr, .momentum = o.momentum});
  CrossEntropyLoss criterion;

  int64_t step = 0;
  bool done = false;
  for (int epoch = 0; epoch < o.epochs && !done; ++epoch) {
    // On a GPU the prefetcher copies the next pinned batch to the first GPU while this one trains;
    // DataParallel then scatters it to the replicas. On the CPU the loader's batches are used as
    // is.
    std::unique_ptr<data::DevicePrefetcher> prefetch;
    if (device.is_cuda()) {
      prefetch = std::make_unique<data::DevicePrefetcher>(train_loader, std::vector<int>{gpus[0]});
      prefetch->start_epoch(epoch);
    } else {
      train_loader.start_epoch(epoch);
    }
    for (;;) {
      Tensor images, labels;
      if (prefetch) {
        data::DeviceBatch db;
        if (!prefetch->next(db)) break;
        images = db.images[0];
        labels = db.labels[0];
      } else {
        data::Batch b;
        if (!train_loader.next(b)) break;
        images = b.images;
        labels = b.labels;
      }
      // Two outputs come back, gathered on the first GPU: the logits and the features.
      const TensorList outputs = model.forward_all({images});
      const Tensor& logits = outputs[0];
      if (step == 0) {
        std::printf("outputs: logits %s, features %s\n", shape_str(logits.shape()).c_str(),
                    shape_str(outputs[1].shape()).c_str());
      }
      criterion.forward(logits, labels);
      opt.zero_grad();
      // The features are not used by the loss: their gradient is an undefined Tensor (zero).
      model.backward_all({criterion.backward(), Tensor()});
      opt.step();
      ++step;
      if (step % 10 == 0) {
        std::printf("epoch %d step %lld: loss %.4f\n", epoch + 1, static_cast<long long>(step),
                    criterion.item());  // reading the loss is the one wait for the GPUs
      }
      if (o.steps > 0 && step >= o.steps) {
        done = true;
        break;
      }
    }
    std::printf("epoch %d: %lld steps, last loss %.4f, test accuracy %.2f%%\n", epoch + 1,
                static_cast<long long>(step), criterion.item(),
                100 * test_accuracy(model, test_loader, device));
  }

  if (!o.save.empty()) {
    // The model file holds exactly net->state_dict() with PyTorch's names (conv1.0.weight, ...):
    // safetensors.torch.load_file() + load_state_dict() read it. The optimizer state goes beside
    // it.
    save_checkpoint(o.save, *net, &opt.primary(), {{"step", std::to_string(step)}});
    std::printf("saved %s and %s\n", o.save.c_str(), optimizer_state_path(o.save).c_str());
  }
  if (o.print_checksum) print_checksum(*net);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // cudp's exceptions are cudp::Error: what() ends with the library's file and line, message()
  // is what went wrong, which is what a user needs. CUDP_VERBOSE=1 prints the location too.
  const char* env = std::getenv("CUDP_VERBOSE");
  const bool verbose = env != nullptr && std::string(env) == "1";
  try {
    return run(parse(argc, argv));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "custom_model: %s\nRun custom_model --help for the options.\n", e.what());
    return 2;
  } catch (const cudp::Error& e) {
    std::fprintf(stderr, "custom_model: %s\n", verbose ? e.what() : e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom_model: %s\n", e.what());
    return 1;
  }
}
