#include "examples/vgg/run_folder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"

namespace cudp::trainer {
namespace fs = std::filesystem;

namespace {

const char* const kHeader =
    "epoch,train_loss,train_top1,train_top5,test_loss,test_top1,test_top5,lr,img_per_s,seconds";

std::string row_text(const EpochMetrics& m) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "%lld,%.6f,%.4f,%.4f,%.6f,%.4f,%.4f,%.6g,%.1f,%.3f",
                static_cast<long long>(m.epoch), m.train_loss, m.train_top1, m.train_top5,
                m.test_loss, m.test_top1, m.test_top5, m.lr, m.images_per_s, m.seconds);
  return buf;
}

// A row as row_text wrote it, or false.
bool parse_row(const std::string& line, EpochMetrics& m) {
  std::stringstream ss(line);
  std::string field;
  std::vector<double> v;
  while (std::getline(ss, field, ',')) {
    try {
      size_t used = 0;
      v.push_back(std::stod(field, &used));
      if (used != field.size()) return false;
    } catch (const std::exception&) {
      return false;
    }
  }
  if (v.size() != 10 || v[0] < 1) return false;
  m = {static_cast<int64_t>(v[0]), v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]};
  return true;
}

}  // namespace

void write_file_atomically(const std::string& path, const std::string& bytes) {
  // StagedFile checks every write, the flush and the fsync (where a full disk shows), and renames
  // only a complete file over the old one: a failed write keeps the previous file.
  StagedFile file(path, "run folder file");
  file.write(bytes.data(), bytes.size());
  file.publish();
}

void check_output_file(const std::string& path, const std::string& what) {
  const fs::path p(path);
  std::error_code ec;
  const auto status = fs::status(p, ec);
  if (fs::exists(status)) {
    if (fs::is_directory(status)) {
      const char* example = what == "--json" ? "log.jsonl" : "run.safetensors";
      CUDP_THROW(IoError, what, " ", path, " is a folder; give a file name (e.g. ",
                 (p / example).string(), ")");
    }
    if (!fs::is_regular_file(status)) {
      CUDP_THROW(IoError, what, " ", path,
                 " exists and is not a regular file (a FIFO, device or socket); give a file path");
    }
  }
  const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::is_directory(folder, ec)) {
    CUDP_THROW(IoError, what, " ", path, ": the folder ", folder.string(),
               fs::exists(folder, ec) ? " is a file; choose another path"
                                      : " does not exist; create it first or choose another path");
  }
  // Create and remove a file beside it: the only test that covers permissions, read-only file
  // systems and quotas alike.
  const std::string probe = path + ".probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) {
    const int err = errno;
    CUDP_THROW(IoError, what, " ", path, " cannot be written: creating a file in ",
               folder.string(), " failed (", std::strerror(err),
               "); choose a writable folder");
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

RunFolder::RunFolder(const std::string& dir, int64_t start_epoch, const std::string& command_line,
                     const std::string& settings)
    : dir_(dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    CUDP_THROW(IoError, "--output ", dir, " exists and is not a folder; give a folder path");
  }
  fs::create_directories(dir, ec);
  if (ec) {
    CUDP_THROW(IoError, "--output ", dir, ": cannot create the folder (", ec.message(),
               "); choose a writable place");
  }
  check_output_file(dir + "/metrics.csv", "--output");
  if (start_epoch == 0 && fs::exists(dir + "/metrics.csv")) {
    std::printf("note: %s already holds a run; this new run replaces its metrics and checkpoints "
                "(resume it with --resume %s instead)\n",
                dir.c_str(), dir.c_str());
  }
  if (start_epoch > 0) {
    std::ifstream in(dir + "/metrics.csv");
    std::string line;
    std::getline(in, line);  // header
    for (EpochMetrics m; std::getline(in, line);) {
      if (parse_row(line, m) && m.epoch <= start_epoch) rows_.push_back(m);
    }
  }
  std::string commands;
  if (start_epoch > 0) {
    std::ifstream in(dir + "/command.txt");
    std::stringstream ss;
    ss << in.rdbuf();
    commands = ss.str();
  }
  commands += command_line + "\n";
  write_file_atomically(dir + "/command.txt", commands);
  write_file_atomically(dir + "/settings.txt", settings);
  write_metrics(dir_, rows_);
}

RunFolder::~RunFolder() {
  try {
    wait();
  } catch (const Error& e) {
    std::fprintf(stderr, "cudp-vgg: %s\n", e.message().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cudp-vgg: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "cudp-vgg: writing the run folder's metrics failed\n");
  }
}

void RunFolder::wait() {
  if (writer_.joinable()) writer_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void RunFolder::write_metrics(const std::string& dir, const std::vector<EpochMetrics>& rows) {
  std::string csv = std::string(kHeader) + "\n";
  std::vector<CurvePoint> points;
  for (const EpochMetrics& m : rows) {
    csv += row_text(m) + "\n";
    points.push_back({m.epoch, m.train_loss, m.test_loss, m.train_top1, m.test_top1, m.test_top5});
  }
  write_file_atomically(dir + "/metrics.csv", csv);
  if (!points.empty()) {
    const std::vector<uint8_t> png = draw_curves(points);
    write_file_atomically(dir + "/curves.png", std::string(png.begin(), png.end()));
  }
}

void RunFolder::add(const EpochMetrics& m) {
  wait();
  while (!rows_.empty() && rows_.back().epoch >= m.epoch) rows_.pop_back();
  rows_.push_back(m);
  writer_ = std::thread([this, dir = dir_, rows = rows_] {
    try {
      write_metrics(dir, rows);
    } catch (...) {
      error_ = std::current_exception();  // read by wait(), after the join
    }
  });
}

}  // namespace cudp::trainer
