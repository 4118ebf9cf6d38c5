#include "layers/safetensors.h"

#include <algorithm>
#include <bit>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "engine/core/file.h"

namespace cudp {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; cudp writes host memory as is");

// The reference implementation refuses headers above 100 MB; so do we (a corrupt length field
// would otherwise ask for gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypes[] = {{DType::f32, "F32"}, {DType::bf16, "BF16"}, {DType::f16, "F16"},
                                 {DType::i32, "I32"}, {DType::i64, "I64"},   {DType::u8, "U8"}};
// Valid safetensors dtypes that cudp has no tensor type for: named as unsupported, not unknown.
constexpr const char* kUnsupported[] = {"F64",     "I8",      "I16",     "U16",     "U32",
                                        "U64",     "BOOL",    "F8_E4M3", "F8_E5M2", "F8_E8M0",
                                        "F6_E2M3", "F6_E3M2", "F4",      "C64"};

template <typename... Args>
[[noreturn]] void fail_as(SafetensorsDamage damage, const std::string& path, const Args&... what) {
  throw SafetensorsError(damage, detail::str("safetensors file '", path, "': ", what...), __FILE__,
                         __LINE__);
}
template <typename... Args>
[[noreturn]] void fail(const std::string& path, const Args&... what) {
  fail_as(SafetensorsDamage::invalid, path, what...);
}

// A JSON value for an error message, bounded: a corrupt header may hold megabytes or deep nesting.
std::string preview(const nlohmann::json& value) {
  std::string text;
  if (value.is_primitive() ||
      (value.is_array() && value.size() <= 8 &&
       std::none_of(value.begin(), value.end(), [](const auto& v) { return v.is_structured(); }))) {
    text = value.dump();
  } else {
    return detail::str("(a JSON ", value.type_name(), " of ", value.size(), " entries)");
  }
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

}  // namespace

const char* safetensors_dtype(DType dtype) {
  for (const auto& [d, name] : kDTypes) {
    if (d == dtype) {
      return name;
    }
  }
  CUDP_THROW(ValueError, "no safetensors name for dtype ", dtype_name(dtype));
}

std::unique_ptr<StagedFile> stage_safetensors(const std::string& path, const TensorMap& tensors,
                                              const Metadata& metadata) {
  // Data order: larger elements first, then by name, so each tensor is aligned to its element size.
  std::vector<const std::pair<const std::string, Tensor>*> order;
  for (const auto& entry : tensors) {
    CUDP_CHECK(!entry.first.empty(), "save_safetensors('", path, "'): empty tensor name");
    CUDP_CHECK(entry.first != "__metadata__", "save_safetensors('", path,
               "'): '__metadata__' is reserved and cannot name a tensor");
    CUDP_CHECK(entry.second.defined(), "save_safetensors('", path, "'): tensor '", entry.first,
               "' is undefined");
    order.push_back(&entry);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return element_size(a->second.dtype()) > element_size(b->second.dtype());
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    header["__metadata__"] = metadata;
  }
  uint64_t offset = 0;
  for (const auto* entry : order) {
    const Tensor& t = entry->second;
    header[entry->first] = {{"dtype", safetensors_dtype(t.dtype())},
                            {"shape", t.shape()},
                            {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or value that is not valid UTF-8
    CUDP_THROW(ValueError, "save_safetensors('", path, "'): cannot encode the header: ", e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t header_bytes = text.size();

  remove_stale_temporaries(path);
  auto file = std::make_unique<StagedFile>(path, "safetensors file");
  file->write(&header_bytes, sizeof header_bytes);
  file->write(text.data(), text.size());
  for (const auto* entry : order) {
    const Tensor host = entry->second.cpu();
    file->write(host.data_ptr(), host.nbytes());
  }
  file->finish();
  return file;
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  stage_safetensors(path, tensors, metadata)->publish();
}

namespace {

// One header entry, validated on its own; the byte ranges are checked together afterwards.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

DType parse_dtype(const std::string& path, const std::string& name, const nlohmann::json& value) {
  if (!value.is_string()) {
    fail(path, "tensor '", name, "': \"dtype\" is not a string");
  }
  const std::string text = value.get<std::string>();
  for (const auto& [d, known] : kDTypes) {
    if (text == known) {
      return d;
    }
  }
  for (const char* unsupported : kUnsupported) {
    if (text == unsupported) {
      fail(path, "tensor '", name, "': dtype ", text,
           " is not supported (cudp reads F32, BF16, F16, I32, I64 and U8)");
    }
  }
  fail(path, "tensor '", name, "': unknown dtype \"", text, "\"");
}

Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& value,
                  uint64_t data_bytes) {
  if (!value.is_object()) {
    fail(path, "tensor '", name, "': header entry is not a JSON object");
  }
  for (const auto& [key, _] : value.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      fail(path, "tensor '", name, "': unexpected field \"", key, "\"");
    }
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(key)) {
      fail(path, "tensor '", name, "': missing field \"", key, "\"");
    }
  }
  Entry e{name, parse_dtype(path, name, value["dtype"]), {}, 0, 0};

  const auto& shape = value["shape"];
  if (!shape.is_array()) {
    fail(path, "tensor '", name, "': \"shape\" is not an array");
  }
  uint64_t numel = 1;
  bool overflow = false;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned()) {
      fail(path, "tensor '", name, "': shape ", preview(shape),
           " has an entry that is not a non-negative integer");
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(INT64_MAX)) {
      overflow = true;
    }
    overflow |= __builtin_mul_overflow(numel, dim, &numel);
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  uint64_t bytes = 0;
  overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(element_size(e.dtype)), &bytes);
  if (overflow) {
    fail(path, "tensor '", name, "': shape ", preview(shape), " is too large");
  }

  const auto& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(path, "tensor '", name, "': \"data_offsets\" ", preview(offsets),
         " is not a pair of non-negative integers");
  }
  e.begin = offsets[0].get<uint64_t>();
  e.end = offsets[1].get<uint64_t>();
  if (e.begin > e.end) {
    fail(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
         "] end before they begin");
  }
  if (e.end > data_bytes) {
    fail_as(SafetensorsDamage::cut_short, path, "tensor '", name, "': data_offsets [", e.begin,
            ", ", e.end, "] run past the end of the data section (", data_bytes, " bytes)");
  }
  if (e.end - e.begin != bytes) {
    fail(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] hold ",
         e.end - e.begin, " bytes but shape ", shape_str(e.shape), " of ",
         safetensors_dtype(e.dtype), " needs ", bytes);
  }
  return e;
}

// Every byte of the data section belongs to exactly one tensor, in order.
void check_coverage(const std::string& path, std::vector<Entry>& entries, uint64_t data_bytes) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : entries) {
    if (e.begin < covered) {
      fail(path, "tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
           "] overlap those of tensor '", previous->name, "' [", previous->begin, ", ",
           previous->end, "]");
    }
    if (e.begin > covered) {
      fail(path, "tensor '", e.name, "': bytes [", covered, ", ", e.begin,
           ") of the data section before it belong to no tensor");
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_bytes) {
    fail(path, data_bytes - covered,
         " bytes of trailing data after the last tensor (the data section is ", data_bytes,
         " bytes, the tensors cover ", covered, ")");
  }
}

}  // namespace

namespace {

// The validated header of an open file, positioned at the start of the data section.
struct Header {
  Metadata metadata;
  std::vector<Entry> entries;  // in data order, tiling the data section
};

Header read_header(InputFile& file) {
  const std::string& path = file.path();
  const uint64_t file_bytes = file.size();
  using enum SafetensorsDamage;
  if (file_bytes < 8) {
    fail_as(not_safetensors, path, "not a safetensors file: it is ", file_bytes,
            " bytes, shorter than the 8-byte header length");
  }
  uint64_t header_bytes = 0;
  file.read_exact(&header_bytes, 8, "the header length");
  if (header_bytes > kMaxHeaderBytes) {
    fail_as(not_safetensors, path,
            "not a safetensors file: its first 8 bytes, read as the header length, give ",
            header_bytes, ", above the limit of ", kMaxHeaderBytes, " bytes");
  }
  // What there is of the header: a JSON object, '{' first (JSON allows whitespace before it).
  std::string text(std::min(header_bytes, file_bytes - 8), '\0');
  file.read_exact(text.data(), text.size(), "the header");
  const size_t first = text.find_first_not_of(" \t\n\r");
  const bool begins_as_json_object = first != std::string::npos && text[first] == '{';
  if (header_bytes > file_bytes - 8) {
    if (!begins_as_json_object) {
      fail_as(not_safetensors, path,
              "not a safetensors file: its first 8 bytes, read as the header length, give ",
              header_bytes, ", more than the file's ", file_bytes, " bytes");
    }
    fail_as(cut_short, path, "header length ", header_bytes, " runs past the end of the file (",
            file_bytes, " bytes)");
  }
  if (!begins_as_json_object)
    fail_as(not_safetensors, path, "not a safetensors file: the header is not a JSON object");
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;

  // JSON allows a name twice in one object; a tensor table or an entry must not have it (which one
  // would count?). Parsing records the first repeat at any depth.
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::pair<std::string, size_t>> duplicate;  // the name and its depth
  const nlohmann::json::parser_callback_t find_duplicates =
      [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        using Event = nlohmann::json::parse_event_t;
        if (event == Event::object_start) {
          open_objects.emplace_back();
        } else if (event == Event::object_end && !open_objects.empty()) {
          open_objects.pop_back();
        } else if (event == Event::key && !open_objects.empty() && !duplicate) {
          auto name = parsed.get<std::string>();
          if (!open_objects.back().insert(name).second) {
            duplicate.emplace(std::move(name), static_cast<size_t>(depth));
          }
        }
        return true;
      };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, find_duplicates);
  } catch (const nlohmann::json::exception& e) {
    fail_as(not_safetensors, path, "not a safetensors file: invalid JSON header: ", e.what());
  }
  if (!header.is_object()) {
    fail_as(not_safetensors, path, "not a safetensors file: the header is not a JSON object");
  }
  if (duplicate) {
    if (duplicate->second == 1) {
      fail(path, "tensor '", duplicate->first, "' appears more than once in the header");
    }
    fail(path, "the name '", duplicate->first, "' appears more than once in one object of the header");
  }

  Header out;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) {
        fail(path, "\"__metadata__\" is not a JSON object");
      }
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) {
          fail(path, "__metadata__ entry '", key, "' is not a string");
        }
        out.metadata[key] = v.get<std::string>();
      }
      continue;
    }
    if (name.empty()) {
      fail(path, "a tensor has an empty name");
    }
    out.entries.push_back(parse_entry(path, name, value, data_bytes));
  }
  check_coverage(path, out.entries, data_bytes);
  return out;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path) {
  InputFile file(path, "safetensors file");
  Header header = read_header(file);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  // The ranges tile the data section in order, so one sequential pass reads it.
  for (const Entry& e : header.entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    file.read_exact(t.data_ptr(), e.end - e.begin, "tensor '" + e.name + "'");
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

Metadata load_safetensors_metadata(const std::string& path) {
  InputFile file(path, "safetensors file");
  return read_header(file).metadata;
}

}  // namespace cudp
