#include "data/file_io.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "engine/core/error.h"
#include "engine/core/file.h"

namespace cudp::data {
namespace {

// zlib counts in 32-bit uInt; feed it at most this much at a time.
constexpr size_t kZlibChunk = size_t{1} << 30;

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File open(const std::string& path, const char* mode) {
  File f(std::fopen(path.c_str(), mode));
  if (!f) CUDP_THROW(IoError, "cannot open ", path, ": ", std::strerror(errno));
  return f;
}

}  // namespace

bool is_gzip(std::span<const uint8_t> bytes) {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

void Gunzip::End::operator()(z_stream_s* z) const {
  inflateEnd(z);
  delete z;
}

Gunzip::Gunzip(std::span<const uint8_t> compressed, std::string path)
    : in_(compressed), path_(std::move(path)) {
  auto z = std::make_unique<z_stream>();
  if (inflateInit2(z.get(), 15 + 16) != Z_OK) {  // 15-bit window, gzip wrapper only
    CUDP_THROW(IoError, "cannot decompress ", path_, ": zlib's inflateInit2 failed");
  }
  z_.reset(z.release());
  z_->next_in = const_cast<Bytef*>(in_.data());
}

size_t Gunzip::read(std::vector<uint8_t>& out, size_t bytes) {
  const uint8_t* const end = in_.data() + in_.size();
  // Grow as data arrives, never by more than a chunk ahead: `bytes` may be a corrupt header's
  // promise of gigabytes that the stream does not hold.
  constexpr size_t kGrow = size_t{1} << 20;
  size_t produced = 0;
  while (produced < bytes && !done_) {
    if (z_->avail_in == 0) {
      z_->avail_in = static_cast<uInt>(std::min<size_t>(end - z_->next_in, kZlibChunk));
    }
    const size_t want = std::min({bytes - produced, kGrow, kZlibChunk});
    const size_t base = out.size();
    out.resize(base + want);
    z_->next_out = out.data() + base;
    z_->avail_out = static_cast<uInt>(want);
    const int status = inflate(z_.get(), Z_NO_FLUSH);
    const size_t got = want - z_->avail_out;
    out.resize(base + got);
    produced += got;
    total_ += got;
    if (status == Z_STREAM_END) {
      const std::span<const uint8_t> rest(z_->next_in, end);
      if (rest.empty()) {
        done_ = true;
        break;
      }
      if (!is_gzip(rest)) {
        CUDP_THROW(IoError, "corrupt gzip file ", path_, ": ", rest.size(),
                   " bytes of trailing data after the compressed stream");
      }
      inflateReset(z_.get());  // a further gzip member (as `cat a.gz b.gz` makes)
      z_->avail_in = 0;
      continue;
    }
    if (status == Z_BUF_ERROR && z_->next_in == end && z_->avail_out > 0) {
      CUDP_THROW(IoError, "corrupt gzip file ", path_, ": the compressed stream ends early after ",
                 in_.size(), " bytes (truncated download?)");
    }
    if (status != Z_OK && status != Z_BUF_ERROR) {
      CUDP_THROW(IoError, "corrupt gzip file ", path_, ": ", z_->msg ? z_->msg : zError(status),
                 " at compressed byte ", z_->next_in - in_.data());
    }
  }
  return produced;
}

std::vector<uint8_t> gunzip(std::span<const uint8_t> compressed, const std::string& path,
                            size_t max_bytes) {
  Gunzip z(compressed, path);
  std::vector<uint8_t> out;
  // One byte more than allowed tells "exactly the limit" from "more".
  z.read(out, max_bytes == SIZE_MAX ? max_bytes : max_bytes + 1);
  if (out.size() > max_bytes) {
    CUDP_THROW(IoError, path, " decompresses to more than ", max_bytes,
               " bytes, more than a file of its kind can hold (a corrupt file or a gzip bomb?)");
  }
  return out;
}

std::vector<uint8_t> read_file(const std::string& path, size_t max_bytes) {
  InputFile file(path, "data file");
  // gzip never grows incompressible data by more than a small fraction: a file bigger than this
  // cannot hold max_bytes of content, compressed or not, and is refused before it is read.
  const uint64_t slack = max_bytes / 64 + 4096;
  if (file.size() > max_bytes && file.size() - max_bytes > slack) {
    CUDP_THROW(IoError, path, " is ", file.size(), " bytes, more than the ", max_bytes,
               " bytes a file of its kind can hold");
  }
  std::vector<uint8_t> bytes(file.size());
  file.read_exact(bytes.data(), bytes.size(), "its bytes");
  if (is_gzip(bytes)) return gunzip(bytes, path, max_bytes);
  if (bytes.size() > max_bytes) {
    CUDP_THROW(IoError, path, " is ", bytes.size(), " bytes, more than the ", max_bytes,
               " bytes a file of its kind can hold");
  }
  return bytes;
}

std::vector<uint8_t> read_compressed(const std::string& path) {
  InputFile file(path, "data file");
  std::vector<uint8_t> bytes(file.size());
  file.read_exact(bytes.data(), bytes.size(), "its bytes");
  return bytes;
}

void write_file(const std::string& path, std::span<const uint8_t> bytes, bool gzip) {
  std::vector<uint8_t> packed;
  if (gzip) {
    z_stream z{};
    if (deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK) {
      CUDP_THROW(IoError, "cannot compress ", path, ": zlib's deflateInit2 failed");
    }
    const std::unique_ptr<z_stream, int (*)(z_stream*)> end_guard(&z, deflateEnd);
    CUDP_CHECK(bytes.size() < kZlibChunk, "write_file: ", bytes.size(), " bytes is too much to gzip");
    packed.resize(deflateBound(&z, static_cast<uLong>(bytes.size())));
    z.next_in = const_cast<Bytef*>(bytes.data());
    z.avail_in = static_cast<uInt>(bytes.size());
    z.next_out = packed.data();
    z.avail_out = static_cast<uInt>(packed.size());
    if (deflate(&z, Z_FINISH) != Z_STREAM_END) {
      CUDP_THROW(IoError, "cannot compress ", path, ": ", z.msg ? z.msg : "deflate failed");
    }
    packed.resize(z.total_out);
    bytes = packed;
  }
  File f = open(path, "wb");
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    CUDP_THROW(IoError, "cannot write ", bytes.size(), " bytes to ", path, ": ", std::strerror(errno));
  }
  if (std::fclose(f.release()) != 0) {
    CUDP_THROW(IoError, "cannot write ", path, ": ", std::strerror(errno));
  }
}

bool file_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec);
}

}  // namespace cudp::data
