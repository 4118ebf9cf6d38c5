// Host tests of safetensors files: round trips of every dtype, the exact bytes written, every kind
// of corrupt file (built by hand here), and the atomic write.
#include "layers/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "layers/temp_dir.h"

namespace cudp {
namespace {

using testing::TempDir;

// A tensor whose bytes follow a fixed pattern (any dtype: the file format only moves bytes).
Tensor patterned(const Shape& shape, DType dtype, int salt) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* bytes = static_cast<uint8_t*>(t.data_ptr());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + salt * 11 + 5);
  return t;
}

std::string bytes_of(const Tensor& t) {
  return {static_cast<const char*>(t.data_ptr()), t.nbytes()};
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Writes a file as the format lays it out: length (or `length` when given), header, data.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               std::optional<uint64_t> length = std::nullopt) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = length.value_or(header.size());
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
}

TEST(Safetensors, RoundTripsEveryDtypeShapeAndMetadata) {
  TempDir dir;
  const TensorMap tensors = {
      {"f32", patterned({2, 3}, DType::f32, 1)},    {"bf16", patterned({5}, DType::bf16, 2)},
      {"f16", patterned({1, 3, 1}, DType::f16, 3)}, {"i32", patterned({4}, DType::i32, 4)},
      {"i64", patterned({2}, DType::i64, 5)},       {"u8", patterned({7}, DType::u8, 6)},
      {"scalar", patterned({}, DType::f32, 7)},     {"empty", patterned({0, 4}, DType::f32, 8)},
  };
  const Metadata metadata = {{"step", "12"}, {"note", "quotes \" and unicode \xc3\xa9"}};
  const std::string path = dir.file("t.safetensors");
  save_safetensors(path, tensors, metadata);

  const SafetensorsFile file = load_safetensors(path);
  EXPECT_EQ(file.metadata, metadata);
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    SCOPED_TRACE(name);
    const Tensor& back = file.tensors.at(name);
    EXPECT_EQ(back.dtype(), t.dtype());
    EXPECT_EQ(back.shape(), t.shape());
    EXPECT_TRUE(back.is_cpu());
    EXPECT_EQ(bytes_of(back), bytes_of(t));
  }
}

TEST(Safetensors, WritesTheReferenceLayout) {
  TempDir dir;
  const std::string path = dir.file("ref.safetensors");
  save_safetensors(path, {{"a", Tensor::from_vector<float>({1.f, 2.f}, {2})}});
  // The header as the reference implementation writes it, padded with spaces to 8 bytes.
  std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const float data[2] = {1.f, 2.f};
  std::string expected(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(expected.data(), &n, 8);
  expected += header + std::string(reinterpret_cast<const char*>(data), sizeof data);
  EXPECT_EQ(read_file(path), expected);
}

TEST(Safetensors, OrdersDataByElementSizeThenNameWithMetadataFirst) {
  TempDir dir;
  const std::string path = dir.file("order.safetensors");
  save_safetensors(path,
                   {{"b", patterned({3}, DType::u8, 1)},
                    {"a", patterned({1}, DType::f16, 2)},
                    {"c", patterned({1}, DType::i64, 3)},
                    {"d", patterned({1}, DType::f32, 4)}},
                   {{"k", "v"}});
  const std::string raw = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = raw.substr(8, n);
  EXPECT_EQ(header.rfind(R"({"__metadata__":{"k":"v"},"c":{"dtype":"I64")", 0), 0u) << header;
  EXPECT_NE(header.find(R"("c":{"dtype":"I64","shape":[1],"data_offsets":[0,8]})"),
            std::string::npos);
  EXPECT_NE(header.find(R"("d":{"dtype":"F32","shape":[1],"data_offsets":[8,12]})"),
            std::string::npos);
  EXPECT_NE(header.find(R"("a":{"dtype":"F16","shape":[1],"data_offsets":[12,14]})"),
            std::string::npos);
  EXPECT_NE(header.find(R"("b":{"dtype":"U8","shape":[3],"data_offsets":[14,17]})"),
            std::string::npos);
  EXPECT_EQ(raw.size(), 8 + n + 17);
}

TEST(Safetensors, RejectsBadArgumentsBeforeTouchingTheFile) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  EXPECT_THROW(save_safetensors(path, {{"a", Tensor()}}), ValueError);
  EXPECT_THROW(save_safetensors(path, {{"", Tensor::zeros({1})}}), ValueError);
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", Tensor::zeros({1})}}), ValueError);
  EXPECT_TRUE(dir.entries().empty());
}

TEST(Safetensors, AtomicWriteLeavesOnlyTheFinalFile) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  save_safetensors(path, {{"w", patterned({4}, DType::f32, 1)}});
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  // Overwriting replaces the content and still leaves nothing else behind.
  save_safetensors(path, {{"v", patterned({2}, DType::i64, 2)}});
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  EXPECT_EQ(load_safetensors(path).tensors.count("v"), 1u);
}

TEST(Safetensors, WriteIntoAMissingDirectoryNamesThePath) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/x.safetensors");
  try {
    save_safetensors(path, {{"w", Tensor::zeros({1})}});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_TRUE(dir.entries().empty());
}

// ---- corrupt files ----------------------------------------------------------------------------

// Loading `path` throws IoError whose message names the file and contains every one of `parts`.
void expect_io_error(const std::string& path, const std::vector<std::string>& parts) {
  try {
    load_safetensors(path);
    ADD_FAILURE() << "expected IoError for " << path;
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'" + path + "'"), std::string::npos) << what;
    for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << what;
  }
}

class CorruptSafetensors : public ::testing::Test {
 protected:
  // Writes `header` (and `data`) and expects the load to fail naming `parts`.
  void expect_rejected(const std::string& header, const std::string& data,
                       const std::vector<std::string>& parts) {
    write_raw(path_, header, data);
    expect_io_error(path_, parts);
  }

  TempDir dir_;
  const std::string path_ = dir_.file("bad.safetensors");
  const std::string eight_ = std::string(8, 'x');
};

TEST_F(CorruptSafetensors, MissingFile) {
  expect_io_error(dir_.file("absent"), {"cannot open"});
}

TEST_F(CorruptSafetensors, ShorterThanTheLengthField) {
  std::ofstream(path_, std::ios::binary) << "abcde";
  expect_io_error(path_, {"5 bytes", "shorter than the 8-byte header length"});
}

TEST_F(CorruptSafetensors, HeaderLengthPastTheEnd) {
  write_raw(path_, "{}", "", 1000);
  expect_io_error(path_, {"header length 1000", "past the end of the file (10 bytes)"});
}

TEST_F(CorruptSafetensors, InvalidJson) {
  expect_rejected(R"({"a": {"dtype": "F32",)", "", {"invalid JSON header"});
}

TEST_F(CorruptSafetensors, HeaderNotAnObject) {
  expect_rejected("[1, 2]", "", {"not a JSON object"});
}

TEST_F(CorruptSafetensors, UnknownDtype) {
  expect_rejected(R"({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", eight_,
                  {"tensor 'w'", "unknown dtype \"F33\""});
}

TEST_F(CorruptSafetensors, UnsupportedDtype) {
  expect_rejected(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", eight_,
                  {"tensor 'w'", "dtype F64 is not supported"});
}

TEST_F(CorruptSafetensors, MissingField) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [2]}})", eight_,
                  {"tensor 'w'", "missing field \"data_offsets\""});
}

TEST_F(CorruptSafetensors, UnexpectedField) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}})",
                  eight_, {"tensor 'w'", "unexpected field \"x\""});
}

TEST_F(CorruptSafetensors, NegativeDimension) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight_,
                  {"tensor 'w'", "not a non-negative integer"});
}

TEST_F(CorruptSafetensors, OffsetsDoNotMatchTheShape) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight_,
                  {"tensor 'w'", "hold 8 bytes but shape [3] of F32 needs 12"});
}

TEST_F(CorruptSafetensors, OffsetsPastTheData) {
  expect_rejected(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", eight_,
                  {"tensor 'w'", "[0, 16] run past the end of the data section (8 bytes)"});
}

TEST_F(CorruptSafetensors, OffsetsReversed) {
  expect_rejected(R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 0]}})", eight_,
                  {"tensor 'w'", "end before they begin"});
}

TEST_F(CorruptSafetensors, OverlappingTensors) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                  eight_, {"tensor 'b'", "overlap those of tensor 'a' [0, 8]"});
}

TEST_F(CorruptSafetensors, GapBetweenTensors) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "b": {"dtype": "U8", "shape": [2], "data_offsets": [6, 8]}})",
                  eight_, {"tensor 'b'", "bytes [4, 6)", "belong to no tensor"});
}

TEST_F(CorruptSafetensors, TrailingGarbage) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", eight_,
                  {"4 bytes of trailing data after the last tensor"});
}

TEST_F(CorruptSafetensors, DuplicateName) {
  expect_rejected(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                  eight_, {"tensor 'a' appears more than once"});
}

TEST_F(CorruptSafetensors, MetadataValueNotAString) {
  expect_rejected(R"({"__metadata__": {"step": 3}})", "", {"__metadata__ entry 'step'"});
}

TEST_F(CorruptSafetensors, TruncatedData) {
  // A valid file cut short: the last tensor now runs past the end of the data.
  save_safetensors(path_, {{"w", patterned({4}, DType::f32, 1)}});
  const std::string raw = read_file(path_);
  std::ofstream(path_, std::ios::binary | std::ios::trunc) << raw.substr(0, raw.size() - 3);
  expect_io_error(path_, {"tensor 'w'", "run past the end of the data section"});
}

// Each failure says its kind of damage (SafetensorsError::damage): a checkpoint words its errors by
// it. A file that cannot be opened is a plain IoError.
TEST_F(CorruptSafetensors, ErrorsSayTheKindOfDamage) {
  const auto damage = [&]() -> std::optional<SafetensorsDamage> {
    try {
      load_safetensors_metadata(path_);
    } catch (const SafetensorsError& e) {
      return e.damage();
    } catch (const IoError&) {
      return std::nullopt;
    }
    ADD_FAILURE() << "no error for " << read_file(path_);
    return std::nullopt;
  };
  using enum SafetensorsDamage;
  std::ofstream(path_, std::ios::binary) << "abc";
  EXPECT_EQ(damage(), not_safetensors);
  std::ofstream(path_, std::ios::binary) << "this is not a safetensors file";
  EXPECT_EQ(damage(), not_safetensors);
  write_raw(path_, "hello", "");
  EXPECT_EQ(damage(), not_safetensors);
  write_raw(path_, R"({"a": )", "");
  EXPECT_EQ(damage(), not_safetensors);  // a whole header that is not JSON
  write_raw(path_, "{}", "", 1000);
  EXPECT_EQ(damage(), cut_short);  // a header that begins as one, cut off
  write_raw(path_, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "1234");
  EXPECT_EQ(damage(), cut_short);  // its data cut off
  write_raw(path_, R"({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", eight_);
  EXPECT_EQ(damage(), invalid);
  write_raw(path_, R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", "abcd");
  EXPECT_EQ(damage(), invalid);  // trailing data
  std::filesystem::remove(path_);
  EXPECT_EQ(damage(), std::nullopt);
}

// ---- hostile files (issue: nothing silently accepted, nothing hung) ----------------------------

TEST_F(CorruptSafetensors, EmptyTensorName) {
  expect_rejected(R"({"": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", "ab",
                  {"a tensor has an empty name"});
}

TEST_F(CorruptSafetensors, DuplicateFieldInsideAnEntry) {
  expect_rejected(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [2], "data_offsets": [0, 2]}})",
                  "ab", {"'dtype' appears more than once"});
}

TEST_F(CorruptSafetensors, DuplicateMetadataKey) {
  expect_rejected(R"({"__metadata__": {"step": "1", "step": "2"}})", "",
                  {"'step' appears more than once"});
}

TEST_F(CorruptSafetensors, ShapeWhoseProductOverflows) {
  // 2^32 x 2^32 x 0 holds no element, but only after a product that wraps: refused, not wrapped.
  expect_rejected(
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}})",
      "", {"tensor 'w'", "is too large"});
  expect_rejected(
      R"({"w": {"dtype": "F32", "shape": [9223372036854775808], "data_offsets": [0, 0]}})", "",
      {"tensor 'w'", "is too large"});
}

TEST_F(CorruptSafetensors, DeeplyNestedValuesAreNotEchoedWhole) {
  const std::string nested = std::string(5000, '[') + std::string(5000, ']');
  write_raw(path_, R"({"w": {"dtype": "F32", "shape": )" + nested + R"(, "data_offsets": [0, 0]}})",
            "");
  try {
    load_safetensors(path_);
    ADD_FAILURE() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_LT(std::string(e.what()).size(), 1000u) << e.what();
  }
}

TEST_F(CorruptSafetensors, AFifoIsRefusedNotWaitedOn) {
  const std::string fifo = dir_.file("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ::alarm(30);  // a reader that blocks would otherwise hang until ctest's timeout
  expect_io_error(fifo, {"a FIFO", "not a safetensors file"});
  try {
    load_safetensors_metadata(fifo);
    ADD_FAILURE() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("FIFO"), std::string::npos) << e.what();
  }
  ::alarm(0);
}

TEST_F(CorruptSafetensors, ADirectoryIsNotAFile) {
  expect_io_error(dir_.path(), {"a directory"});
}

TEST(SafetensorsHeader, MetadataAloneMatchesTheFullLoad) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  save_safetensors(path, {{"w", patterned({3}, DType::f32, 1)}}, {{"k", "v"}});
  EXPECT_EQ(load_safetensors_metadata(path), load_safetensors(path).metadata);
}

TEST(SafetensorsStaged, NothingAppearsAtThePathUntilPublished) {
  TempDir dir;
  const std::string path = dir.file("s.safetensors");
  {
    auto staged = stage_safetensors(path, {{"w", patterned({3}, DType::f32, 1)}});
    EXPECT_FALSE(std::filesystem::exists(path));
    EXPECT_TRUE(std::filesystem::exists(staged->temp_path()));
  }  // dropped unpublished: the temporary goes too
  EXPECT_TRUE(dir.entries().empty());
  auto staged = stage_safetensors(path, {{"w", patterned({3}, DType::f32, 1)}});
  staged->publish();
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"s.safetensors"}));
  EXPECT_EQ(bytes_of(load_safetensors(path).tensors.at("w")),
            bytes_of(patterned({3}, DType::f32, 1)));
}

}  // namespace
}  // namespace cudp
