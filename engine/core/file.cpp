#include "engine/core/file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "engine/core/error.h"

namespace cudp {
namespace {

namespace fs = std::filesystem;

std::string directory_of(const std::string& path) {
  const fs::path p(path);
  return p.has_parent_path() ? p.parent_path().string() : ".";
}

// ".<name>.tmp-": the temporaries of `path` start with this; the pid and a counter follow. Files
// move_aside set aside start with ".<name>.old-".
std::string temp_prefix(const std::string& path, const char* kind = ".tmp-") {
  std::string prefix(1, '.');  // built by append: g++ 12 misreports "." + s as overlapping
  prefix.append(fs::path(path).filename().string()).append(kind);
  return prefix;
}

// A fresh name for a temporary (or, with kind ".old-", a file set aside) of `path`, beside it.
std::string temp_name(const std::string& path, const char* kind = ".tmp-") {
  static std::atomic<uint64_t> counter{0};
  return (fs::path(directory_of(path)) /
          detail::str(temp_prefix(path, kind), ::getpid(), '-', counter++))
      .string();
}

std::atomic<detail::FileFaultHook> fault_hook{nullptr};

// The errno the test hook (file.h) makes `operation` on `path` fail with; 0: none, make the call.
int injected_error(const char* operation, const std::string& path) {
  const detail::FileFaultHook hook = fault_hook.load(std::memory_order_relaxed);
  return hook != nullptr ? hook(operation, path) : 0;
}

const char* file_type(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

InputFile::InputFile(const std::string& path, std::string_view what) : path_(path), kind_(what) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd_ < 0) {
    CUDP_THROW(IoError, "cannot open ", kind_, " '", path_, "': ", std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int error = errno;
    ::close(fd_);
    CUDP_THROW(IoError, "cannot inspect ", kind_, " '", path_, "': ", std::strerror(error));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    CUDP_THROW(IoError, "'", path_, "' is ", file_type(st.st_mode), ", not a ", kind_,
               "; give the path of a regular file");
  }
  // A regular file never blocks; reads go back to the ordinary blocking mode.
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int error = errno;
    ::close(fd_);
    CUDP_THROW(IoError, "cannot read ", kind_, " '", path_, "': fcntl: ", std::strerror(error));
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

size_t InputFile::read_some(void* out, size_t bytes) {
  size_t done = 0;
  auto* p = static_cast<char*>(out);
  while (done < bytes) {
    const ssize_t n = ::read(fd_, p + done, bytes - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      CUDP_THROW(IoError, "cannot read ", kind_, " '", path_, "' at byte ", position_ + done, ": ",
                 std::strerror(errno));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  position_ += done;
  return done;
}

void InputFile::read_exact(void* out, size_t bytes, std::string_view what) {
  const uint64_t start = position_;
  const size_t got = read_some(out, bytes);
  if (got != bytes) {
    CUDP_THROW(IoError, kind_, " '", path_, "': cannot read ", what, " (", bytes, " bytes at byte ",
               start, "): the file ends after ", start + got,
               " bytes (was it truncated while being read?)");
  }
}

StagedFile::StagedFile(const std::string& path, std::string_view what) : path_(path), kind_(what) {
  for (int attempt = 0;; ++attempt) {
    tmp_ = temp_name(path);
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0) return;
    if (errno != EEXIST || attempt > 100) {
      const int error = errno;
      const std::string tmp = tmp_;
      tmp_.clear();
      // The usual causes say so in the user's own terms: the name they gave, not the temporary.
      const std::string parent = std::filesystem::path(path_).parent_path().string();
      const std::string dir = parent.empty() ? std::string(".") : parent;
      if (error == ENOENT) {
        CUDP_THROW(IoError, kind_, " '", path_, "': cannot write it: the directory '", dir,
                   "' does not exist; create it first");
      }
      if (error == ENOTDIR) {
        CUDP_THROW(IoError, kind_, " '", path_, "': cannot write it: a part of '", dir,
                   "' is a file, not a directory");
      }
      if (error == EACCES || error == EROFS) {
        CUDP_THROW(IoError, kind_, " '", path_, "': cannot write it: ", std::strerror(error),
                   " in the directory '", dir, "'");
      }
      CUDP_THROW(IoError, kind_, " '", path_, "': cannot create the temporary file '", tmp,
                 "': ", std::strerror(error));
    }
  }
}

StagedFile::StagedFile(std::string path, std::string_view what, std::string tmp)
    : path_(std::move(path)), kind_(what), tmp_(std::move(tmp)) {}

std::unique_ptr<StagedFile> StagedFile::link(const std::string& source, const std::string& path,
                                             std::string_view what) {
  for (int attempt = 0;; ++attempt) {
    std::string tmp = temp_name(path);
    const int injected = injected_error("link", tmp);
    if (injected == 0 && ::link(source.c_str(), tmp.c_str()) == 0) {
      std::unique_ptr<StagedFile> file(new StagedFile(path, what, std::move(tmp)));
      // finish() fsyncs the inode (its new link count; the data already was), as it does a written
      // temporary's; opened read-only, so that nothing writes to the file `source` also names.
      file->fd_ = ::open(file->tmp_.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
      if (file->fd_ < 0) file->fail("open", errno);  // the destructor removes the link
      file->finish();
      return file;
    }
    const int error = injected != 0 ? injected : errno;
    if (error == EEXIST && attempt <= 100) continue;
    if (error == EXDEV || error == EPERM || error == EOPNOTSUPP || error == ENOTSUP ||
        error == ENOSYS || error == EMLINK) {
      return nullptr;  // this file system cannot link it here: the caller writes a copy
    }
    CUDP_THROW(IoError, what, " '", path, "': cannot link the temporary file '", tmp, "' to '",
               source, "': ", std::strerror(error));
  }
}

StagedFile::~StagedFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void StagedFile::fail(std::string_view step, int error) {
  CUDP_THROW(IoError, kind_, " '", path_, "': ", step, " of the temporary file '", tmp_,
             "' failed after ", written_, " bytes: ", std::strerror(error),
             error == ENOSPC || error == EDQUOT ? " (free some space and save again)"
             : error == EFBIG                   ? " (a file-size limit: see ulimit -f)"
                                                : "");
}

void StagedFile::write(const void* data, size_t bytes) {
  CUDP_CHECK(fd_ >= 0, kind_, " '", path_, "': write after finish()");
  const auto* p = static_cast<const char*>(data);
  [[maybe_unused]] const uint64_t before = written_;  // for the writeback hint below
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write", errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
#if defined(__linux__) && defined(SYNC_FILE_RANGE_WRITE)
  // Each time the file passes a multiple of 8 MB, the writeback of what was written since the last
  // one is started, not waited for: the disk works while the rest is written, and finish()'s fsync
  // (which still makes the file durable) has less left to do. A VGG-16 checkpoint (122 MB) was made
  // durable in 0.083 s instead of 0.100 s. Only a hint: its errors show in the fsync.
  constexpr uint64_t kChunk = uint64_t(8) << 20;
  if (written_ / kChunk != before / kChunk) {
    const uint64_t from = before / kChunk * kChunk;
    ::sync_file_range(fd_, static_cast<int64_t>(from), static_cast<int64_t>(written_ - from),
                      SYNC_FILE_RANGE_WRITE);
  }
#endif
}

void StagedFile::finish() {
  if (fd_ < 0) return;
  if (const int injected = injected_error("fsync", tmp_); injected != 0) fail("fsync", injected);
  if (::fsync(fd_) != 0) fail("fsync", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close", errno);
}

void StagedFile::publish() {
  CUDP_CHECK(!tmp_.empty(), kind_, " '", path_, "': published twice");
  finish();
  rename_durably(tmp_, path_, kind_);
  tmp_.clear();
}

void sync_directory_of(const std::string& path) {
  const std::string dir = directory_of(path);
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) CUDP_THROW(IoError, "cannot open directory '", dir, "': ", std::strerror(errno));
  const int injected = injected_error("fsync directory", dir);
  const int status = injected != 0 ? -1 : ::fsync(fd);
  const int error = injected != 0 ? injected : errno;
  ::close(fd);
  // Some file systems cannot fsync a directory (EINVAL); there a rename is as durable as they make it.
  if (status != 0 && error != EINVAL) {
    CUDP_THROW(IoError, "fsync of directory '", dir, "' failed: ", std::strerror(error));
  }
}

void rename_durably(const std::string& from, const std::string& to, std::string_view what) {
  const int injected = injected_error("rename", from);
  if (injected != 0 || std::rename(from.c_str(), to.c_str()) != 0) {
    CUDP_THROW(IoError, what, " '", to, "': rename from '", from,
               "' failed: ", std::strerror(injected != 0 ? injected : errno));
  }
  sync_directory_of(to);
}

std::string move_aside(const std::string& path) {
  std::string aside = temp_name(path, ".old-");
  // The name is this process's own (its pid and a counter): the rename replaces nothing, or at
  // worst a file set aside by a dead process of the same pid.
  if (::rename(path.c_str(), aside.c_str()) != 0) return "";
  return aside;
}

int remove_stale_temporaries(const std::string& path) {
  const std::string temporary = temp_prefix(path), aside = temp_prefix(path, ".old-");
  std::error_code ec;
  int removed = 0;
  for (const auto& entry : fs::directory_iterator(directory_of(path), ec)) {
    const std::string name = entry.path().filename().string();
    const std::string& prefix = name.compare(0, aside.size(), aside) == 0 ? aside : temporary;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // ".<name>.tmp-<pid>-<n>": stale when no process <pid> runs (kill(pid, 0) fails with ESRCH).
    long pid = 0;
    const char* first = name.data() + prefix.size();
    const char* last = name.data() + name.size();
    const auto [end, parsed] = std::from_chars(first, last, pid);
    if (parsed != std::errc() || end == first || end == last || *end != '-' || pid <= 0) continue;
    if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (::unlink(entry.path().c_str()) == 0) ++removed;
  }
  return removed;
}

namespace detail {
void set_file_fault_hook(FileFaultHook hook) {
  fault_hook.store(hook, std::memory_order_relaxed);
}
}  // namespace detail

}  // namespace cudp
