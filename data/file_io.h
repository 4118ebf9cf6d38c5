// Whole-file reads and writes for the data readers, gzip-aware.
//
// Data sets are small enough (tens of MB) to read whole, which lets a reader check sizes against
// its header before it trusts any of them. MNIST-style files are often shipped gzipped; a file
// whose first two bytes are gzip's magic (1f 8b) is decompressed with zlib, anything else is taken
// as is, so one code path serves `train-images-idx3-ubyte` and `train-images-idx3-ubyte.gz`. A gzip
// file that ends early or fails its checksum is an IoError naming the file, never silent garbage.
//
// Why the limits: a few kilobytes of gzip can inflate to gigabytes. Decompression stops at what the
// reader can accept (the size an IDX header promises, the most a CIFAR batch can hold), and output
// grows only as data arrives (past the room an IDX reader makes for it, at most 8 times the file's
// size), so neither a bomb nor a header's false promise allocates more than the file really holds
// up to that bound. Only regular files are read (engine/core/file.h): a FIFO in place of a data
// file is an error, not a hang.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

struct z_stream_s;  // zlib's stream state: zlib stays out of this public header

namespace cudp::data {

// True when `bytes` starts with the gzip magic 1f 8b.
bool is_gzip(std::span<const uint8_t> bytes);

// The file's bytes, gunzipped when it is gzip. Throws IoError naming `path` when it is not a regular
// file, cannot be read, holds (or decompresses to) more than `max_bytes`, or when its gzip stream is
// corrupt or truncated.
std::vector<uint8_t> read_file(const std::string& path, size_t max_bytes = SIZE_MAX);

// The file's bytes as they are on disk (regular files only).
std::vector<uint8_t> read_compressed(const std::string& path);

// Incremental decompression of a complete gzip stream (one or more members) held in memory, which
// must outlive it; `path` only names it in errors. A reader takes a header first and then exactly
// what the header promises.
class Gunzip {
 public:
  Gunzip(std::span<const uint8_t> compressed, std::string path);
  Gunzip(const Gunzip&) = delete;
  Gunzip& operator=(const Gunzip&) = delete;

  // Appends up to `bytes` more decompressed bytes to `out`; fewer only at the end of the stream.
  // Returns how many. Throws IoError for a corrupt or truncated stream.
  size_t read(std::vector<uint8_t>& out, size_t bytes);
  // Decompressed bytes produced so far.
  uint64_t total() const { return total_; }

 private:
  struct End {
    void operator()(z_stream_s* z) const;  // inflateEnd, then delete
  };
  std::unique_ptr<z_stream_s, End> z_;
  std::span<const uint8_t> in_;
  std::string path_;
  uint64_t total_ = 0;
  bool done_ = false;
};

// Decompresses a complete gzip stream; more than `max_bytes` of output is an IoError.
std::vector<uint8_t> gunzip(std::span<const uint8_t> compressed, const std::string& path,
                            size_t max_bytes = SIZE_MAX);

// Writes `bytes` to `path`, gzip-compressed when asked (tests make their data files with it).
void write_file(const std::string& path, std::span<const uint8_t> bytes, bool gzip = false);

// Whether a regular file exists at `path`.
bool file_exists(const std::string& path);

}  // namespace cudp::data
