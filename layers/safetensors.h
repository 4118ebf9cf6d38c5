// safetensors files: the checkpoint format (docs/architecture.md §5), readable by
// `safetensors.torch.load_file`.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON, then the raw little-endian
// data. The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets into the data section) and may hold "__metadata__", a map of strings to strings.
//
// Writing follows the reference implementation's choices: tensors are laid out by decreasing
// element size, then by name, so that every tensor's data is aligned to its element size; the
// header is padded with spaces to a multiple of 8 bytes (so the data section starts 8-byte
// aligned), and "__metadata__" comes first. The write is atomic (engine/core/file.h's StagedFile):
// a temporary file in the same directory is written and fsync'ed, then renamed over the
// destination, and the directory is fsync'ed, so a crash leaves either the old file or the new one,
// never a torn one; temporaries of killed writers are removed by the next save of the same file.
//
// Reading trusts nothing: anything but a regular file (a FIFO would hang), a short file, a header
// length past the end, invalid JSON, a name repeated in any object, an empty tensor name, an
// unknown dtype, a shape that overflows or does not match its byte range, ranges that overlap,
// leave gaps or leave bytes after the last tensor all throw cudp::IoError naming the file, the
// tensor and the problem. Every byte of the data section must belong to exactly one tensor, as the
// reference implementation requires. A file that was read and failed these checks throws
// SafetensorsError, which says what kind of damage it is; a file that cannot be opened or read, a
// plain IoError.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "engine/core/file.h"
#include "engine/core/tensor.h"

namespace cudp {

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

// How a file failed to read as safetensors, for callers that word their own errors (a checkpoint
// asks "was a save interrupted?" only of a file cut short).
enum class SafetensorsDamage {
  not_safetensors,  // its first bytes are no safetensors header (a length, then a JSON object)
  cut_short,        // it begins as one, but ends before its header or its tensors' data does
  invalid,          // a whole header that breaks the format's rules, or bytes after the last tensor
};

class SafetensorsError : public IoError {
 public:
  SafetensorsError(SafetensorsDamage damage, const std::string& message, const char* file, int line)
      : IoError(message, file, line), damage_(damage) {}
  SafetensorsDamage damage() const { return damage_; }

 private:
  SafetensorsDamage damage_;
};

struct SafetensorsFile {
  TensorMap tensors;  // CPU tensors
  Metadata metadata;  // "__metadata__" (empty when the file has none)
};

// Writes `tensors` (any device; CUDA tensors are copied to the host one at a time) and `metadata`.
// Throws ValueError for an undefined tensor or an empty name, IoError when the file system fails.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata = {});

// The same file, complete and durable under a temporary name but not yet at `path`: publish() puts
// it there. Checkpoints stage both of their files before either replaces anything.
std::unique_ptr<StagedFile> stage_safetensors(const std::string& path, const TensorMap& tensors,
                                              const Metadata& metadata = {});

// Reads and validates a whole file into CPU tensors.
SafetensorsFile load_safetensors(const std::string& path);
// Reads and validates the header only (every check above, without reading the tensors' bytes) and
// returns its "__metadata__".
Metadata load_safetensors_metadata(const std::string& path);

// The safetensors dtype string ("F32", "BF16", "F16", "I32", "I64", "U8").
const char* safetensors_dtype(DType dtype);

}  // namespace cudp
