#include "data/file_io.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "engine/core/error.h"

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

std::vector<uint8_t> read_raw(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  File f = open(path, "rb");
  if (ec) CUDP_THROW(IoError, "cannot get the size of ", path, ": ", ec.message());
  std::vector<uint8_t> bytes(size);
  if (size > 0 && std::fread(bytes.data(), 1, size, f.get()) != size) {
    CUDP_THROW(IoError, "cannot read the ", size, " bytes of ", path, ": ", std::strerror(errno));
  }
  return bytes;
}

// The gzip trailer's ISIZE (uncompressed size mod 2^32) of the last member: a good first guess for
// the output buffer, which grows if it is wrong. A truncated file's "trailer" is arbitrary bytes, so
// the guess is trusted only up to deflate's largest possible ratio (1032:1).
size_t size_hint(std::span<const uint8_t> gz) {
  const size_t fallback = std::max<size_t>(4 * gz.size(), 1024);
  if (gz.size() < 18) return fallback;
  const uint8_t* t = gz.data() + gz.size() - 4;
  const size_t isize = t[0] | (t[1] << 8) | (t[2] << 16) | (size_t{t[3]} << 24);
  return isize > 0 && isize <= 1032 * gz.size() ? isize : fallback;
}

}  // namespace

bool is_gzip(std::span<const uint8_t> bytes) {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

std::vector<uint8_t> gunzip(std::span<const uint8_t> compressed, const std::string& path) {
  z_stream z{};
  if (inflateInit2(&z, 15 + 16) != Z_OK) {  // 15-bit window, gzip wrapper only
    CUDP_THROW(IoError, "cannot decompress ", path, ": zlib's inflateInit2 failed");
  }
  const std::unique_ptr<z_stream, int (*)(z_stream*)> end_guard(&z, inflateEnd);

  const uint8_t* const end = compressed.data() + compressed.size();
  z.next_in = const_cast<Bytef*>(compressed.data());
  std::vector<uint8_t> out(size_hint(compressed));
  size_t produced = 0;
  for (;;) {
    if (z.avail_in == 0) z.avail_in = static_cast<uInt>(std::min<size_t>(end - z.next_in, kZlibChunk));
    if (produced == out.size()) out.resize(out.size() * 2);
    z.next_out = out.data() + produced;
    z.avail_out = static_cast<uInt>(std::min(out.size() - produced, kZlibChunk));
    const uInt space = z.avail_out;
    const int status = inflate(&z, Z_NO_FLUSH);
    produced += space - z.avail_out;
    if (status == Z_STREAM_END) {
      const std::span<const uint8_t> rest(z.next_in, end);
      if (rest.empty()) break;
      if (!is_gzip(rest)) {
        CUDP_THROW(IoError, "corrupt gzip file ", path, ": ", rest.size(),
                   " bytes of trailing data after the compressed stream");
      }
      inflateReset(&z);  // a further gzip member (as `cat a.gz b.gz` makes)
      z.avail_in = 0;
      continue;
    }
    if (status == Z_BUF_ERROR && z.next_in == end) {
      CUDP_THROW(IoError, "corrupt gzip file ", path, ": the compressed stream ends early after ",
                 compressed.size(), " bytes (truncated download?)");
    }
    if (status != Z_OK && status != Z_BUF_ERROR) {
      CUDP_THROW(IoError, "corrupt gzip file ", path, ": ", z.msg ? z.msg : zError(status),
                 " at compressed byte ", z.next_in - compressed.data());
    }
  }
  out.resize(produced);
  return out;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::vector<uint8_t> bytes = read_raw(path);
  return is_gzip(bytes) ? gunzip(bytes, path) : bytes;
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
