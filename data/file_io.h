// Whole-file reads and writes for the data readers, gzip-aware.
//
// Data sets are small enough (tens of MB) to read whole, which lets a reader check sizes against its
// header before it trusts any of them. MNIST-style files are often shipped gzipped; a file whose
// first two bytes are gzip's magic (1f 8b) is decompressed with zlib, anything else is taken as is,
// so one code path serves `train-images-idx3-ubyte` and `train-images-idx3-ubyte.gz`. A gzip file
// that ends early or fails its checksum is an IoError naming the file, never silent garbage.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cudp::data {

// True when `bytes` starts with the gzip magic 1f 8b.
bool is_gzip(std::span<const uint8_t> bytes);

// The file's bytes, gunzipped when it is gzip. Throws IoError naming `path` when it cannot be opened
// or read, or when its gzip stream is corrupt or truncated.
std::vector<uint8_t> read_file(const std::string& path);

// Decompresses a complete gzip stream (one or more members); `path` only names it in errors.
std::vector<uint8_t> gunzip(std::span<const uint8_t> compressed, const std::string& path);

// Writes `bytes` to `path`, gzip-compressed when asked (tests make their data files with it).
void write_file(const std::string& path, std::span<const uint8_t> bytes, bool gzip = false);

// Whether a regular file exists at `path`.
bool file_exists(const std::string& path);

}  // namespace cudp::data
