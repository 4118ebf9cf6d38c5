// Files from outside and files that must survive a crash.
//
// Reading: files that come from outside (checkpoints, data sets) are read without hanging on what
// is not a file. Why: open(2) of a FIFO for reading blocks until a writer appears, and /dev/zero
// never ends; a path mistyped or planted where a checkpoint or a data file is expected must give an
// error, not a hung trainer. InputFile opens with O_NONBLOCK (so the open itself cannot block),
// refuses anything that fstat does not call a regular file, and only then reads, blocking as usual.
// Errors are IoError naming the path and what the file was expected to be.
//
// Writing: a StagedFile is written under a temporary name beside its destination, made durable
// (fsync), and only then renamed over the destination (and the directory fsync'ed), so a crash or a
// full disk leaves the old file or the new one, never a torn one. Staging and publishing are
// separate steps so that a checkpoint can make both of its files durable before it replaces either.
// The temporary is ".<name>.tmp-<pid>-<n>": a process killed mid-write leaves one, and the next
// save of the same file removes those whose process is gone (remove_stale_temporaries).
//
// A StagedFile can also be a hard link to a file that is already durable (StagedFile::link): the
// same bytes published under a second name with nothing written, for one save to several places.
// Files are never modified in place (a save writes a new file and renames it over the old name), so
// two names of one inode always hold the same, complete bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace cudp {

class InputFile {
 public:
  // `what` names the expected kind in errors ("safetensors file", "IDX file").
  InputFile(const std::string& path, std::string_view what);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  // The size fstat reported when the file was opened.
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Reads up to `bytes` at the current position; fewer only at the end of the file. Retries EINTR.
  size_t read_some(void* out, size_t bytes);
  // Reads exactly `bytes` or throws IoError ("... ends after N bytes" / the system's error), naming
  // the file and `what` ("the header", "tensor 'w'").
  void read_exact(void* out, size_t bytes, std::string_view what);

 private:
  std::string path_, kind_;
  int fd_ = -1;
  uint64_t size_ = 0;
  uint64_t position_ = 0;
};

class StagedFile {
 public:
  // Creates the temporary beside `path` (O_EXCL, mode 0666 less the umask: the permissions of an
  // ordinary new file). `what` names the file in errors ("safetensors file").
  StagedFile(const std::string& path, std::string_view what);
  // Removes the temporary unless it was published.
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  // Appends (on Linux starting the writeback of every 8 MB as it goes, so that finish()'s fsync
  // has less left to do); throws IoError naming the destination, the temporary and the system's
  // error (a full disk, a file-size limit) after removing nothing: the destructor does.
  void write(const void* data, size_t bytes);
  // Flushes, fsyncs and closes the temporary: complete and durable, not yet visible at path().
  void finish();
  // finish() if needed, renames the temporary over path(), fsyncs the directory.
  void publish();

  // A temporary beside `path` that is a hard link to `source`, an existing file whose data is
  // already durable (fsync'ed when it was written), returned finished (its inode fsync'ed): the
  // same file under a second name, which publish() renames over `path`. Returns null, leaving
  // nothing behind, when the file system cannot link `source` there (EXDEV: another file system;
  // EPERM, EOPNOTSUPP, ENOSYS: no hard links on it; EMLINK: `source` has too many links), so that
  // the caller writes a copy instead; throws IoError naming both paths for any other failure.
  static std::unique_ptr<StagedFile> link(const std::string& source, const std::string& path,
                                          std::string_view what);

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return tmp_; }

 private:
  StagedFile(std::string path, std::string_view what, std::string tmp);  // link()'s
  [[noreturn]] void fail(std::string_view step, int error);
  std::string path_, kind_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

// Renames `from` over `to` and fsyncs their directory (both must be in the same one), so the new
// name survives a crash. Throws IoError naming `what` and both paths.
void rename_durably(const std::string& from, const std::string& to, std::string_view what);
// fsyncs the directory holding `path` (file systems that cannot fsync a directory are accepted).
void sync_directory_of(const std::string& path);
// Renames `path` to a fresh name beside it, ".<name>.old-<pid>-<n>", to be removed later: a save
// that is about to replace a file it no longer needs moves it aside first, so that the freeing of
// its blocks (~12 ms for 61 MB on ext4, paid by whichever rename or unlink drops its last name)
// leaves the save's critical path. Not fsync'ed: the caller's next durable rename in the directory
// makes it durable, and until then the file is at one of its two names. Returns the new name, or ""
// when `path` could not be moved (it stays where it was).
std::string move_aside(const std::string& path);
// Removes the temporaries StagedFile(path) and the files move_aside(path) left behind in processes
// that no longer run. Returns how many it removed.
int remove_stale_temporaries(const std::string& path);

namespace detail {
// Test hook: asked before each fsync, rename and link that makes a file durable
// (StagedFile::finish's "fsync", sync_directory_of's "fsync directory", rename_durably's "rename",
// StagedFile::link's "link") with the path it applies to (the file, the directory, the rename's
// source, the link's new temporary name); a nonzero return is taken as the errno of that call,
// which then fails as if the system had failed it, without being made. Lets tests check that a save
// survives a failing fsync or rename (a disk error, a full disk on a file system that reports it
// late). Null, the default, asks nothing; set it back to null at the end of a test.
using FileFaultHook = int (*)(const char* operation, const std::string& path);
void set_file_fault_hook(FileFaultHook hook);
}  // namespace detail

}  // namespace cudp
