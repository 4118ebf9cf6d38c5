// data/image_folder: the ImageFolder source behind cudp-vgg --data folder. Images are made here at
// test time (tests/examples/image_files.h: PNGs written by hand, JPEGs by libjpeg-turbo's encoder)
// and compared with what they hold: PNG decodes exactly, JPEG within its quantisation error of the
// original, resizing against values worked out by hand (a constant stays constant, a linear ramp
// stays linear, the centre crop keeps the middle). Through the loader: samples decoded on the
// workers are those of decode_image + the transform done here sample by sample, whatever the number
// of workers, and a file is read again at every epoch. A FIFO named like an image and a file above
// 256 MiB are refused by name, without waiting or reading. (The transforms themselves are checked
// against a reference in tests/data/image_transform_test.cpp.) Tests skip, saying which package is
// missing, where the codecs are not installed.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/data_test_util.h"
#include "data/image_folder.h"
#include "data/loader.h"
#include "engine/core/error.h"
#include "examples/image_files.h"
#include "examples/run_binary.h"

namespace {

using namespace cudp;
using namespace cudp::testing;
using cudp::testing::HostBatch;
using cudp::testing::run_epoch;

#define REQUIRE_PNG()                                           \
  do {                                                          \
    std::string why;                                            \
    if (!data::png_available(&why)) GTEST_SKIP() << why;        \
  } while (0)

std::vector<uint8_t> random_rgb(int w, int h, uint32_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(w) * h * 3);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<uint8_t>(seed >> 24);
  }
  return v;
}

std::vector<uint8_t> constant_rgb(int w, int h, uint8_t r, uint8_t g, uint8_t b) {
  std::vector<uint8_t> v;
  for (int i = 0; i < w * h; ++i) v.insert(v.end(), {r, g, b});
  return v;
}

TEST(ImageFolder, PngDecodesExactly) {
  REQUIRE_PNG();
  TempDir dir;
  const auto rgb = random_rgb(40, 30, 7);
  write_png(dir / "a.png", 40, 30, rgb);
  const data::Image img = data::decode_image(dir / "a.png");
  EXPECT_EQ(img.width, 40);
  EXPECT_EQ(img.height, 30);
  EXPECT_EQ(img.rgb, rgb);
}

TEST(ImageFolder, JpegDecodesWithinItsQuantisationError) {
  std::string why;
  if (!data::jpeg_available(&why)) GTEST_SKIP() << why;
  TempDir dir;
  std::vector<uint8_t> rgb;  // smooth: JPEG's error stays small
  for (int y = 0; y < 48; ++y)
    for (int x = 0; x < 64; ++x) rgb.insert(rgb.end(), {uint8_t(4 * x), uint8_t(5 * y), uint8_t(128)});
  ASSERT_TRUE(write_jpeg(dir / "a.jpg", 64, 48, rgb, 95));
  const data::Image img = data::decode_image(dir / "a.jpg");
  ASSERT_EQ(img.width, 64);
  ASSERT_EQ(img.height, 48);
  double sum = 0;
  int worst = 0;
  for (size_t i = 0; i < rgb.size(); ++i) {
    const int d = std::abs(int(img.rgb[i]) - int(rgb[i]));
    sum += d;
    worst = std::max(worst, d);
  }
  EXPECT_LT(sum / rgb.size(), 2.0);
  EXPECT_LT(worst, 24);
}

TEST(ImageFolder, ResizeAndCentreCrop) {
  // Identity when nothing changes size.
  data::Image img{32, 32, random_rgb(32, 32, 3)};
  EXPECT_EQ(data::resize_center_crop(img, 32, 32).rgb, img.rgb);
  // A constant stays constant through any averaging filter.
  img = {50, 70, constant_rgb(50, 70, 10, 200, 90)};
  EXPECT_EQ(data::resize_center_crop(img, 20, 16).rgb, constant_rgb(16, 16, 10, 200, 90));
  // A horizontal ramp 4x halved: target i covers source 2i and 2i+1 with a symmetric filter, so
  // away from the borders it is the ramp at 2i + 0.5.
  img = {64, 64, {}};
  for (int y = 0; y < 64; ++y)
    for (int x = 0; x < 64; ++x) img.rgb.insert(img.rgb.end(), {uint8_t(4 * x), 0, 0});
  const data::Image half = data::resize_center_crop(img, 32, 32);
  for (int x = 2; x < 30; ++x) EXPECT_EQ(int(half.rgb[(16 * 32 + x) * 3]), 8 * x + 2) << x;
  // Aspect ratio kept, then the middle: 64x32 with a red left half and a blue right half becomes
  // 32x16, cropped to its middle 16x16 (source columns 16..47): red left, blue right.
  img = {64, 32, {}};
  for (int y = 0; y < 32; ++y)
    for (int x = 0; x < 64; ++x)
      img.rgb.insert(img.rgb.end(), x < 32 ? std::initializer_list<uint8_t>{255, 0, 0}
                                           : std::initializer_list<uint8_t>{0, 0, 255});
  const data::Image crop = data::resize_center_crop(img, 16, 16);
  ASSERT_EQ(crop.width, 16);
  for (int x = 0; x < 7; ++x) EXPECT_EQ(int(crop.rgb[(8 * 16 + x) * 3]), 255) << x;
  for (int x = 9; x < 16; ++x) EXPECT_EQ(int(crop.rgb[(8 * 16 + x) * 3 + 2]), 255) << x;
}

TEST(ImageFolder, ReadsATreeWithClassesSortedByName) {
  REQUIRE_PNG();
  TempDir dir;
  const std::string root = dir / "train";
  const std::vector<std::string> classes = {"zebra", "ant", "cat"};  // labels: ant 0, cat 1, zebra 2
  const uint8_t colour[3][3] = {{200, 10, 10}, {10, 200, 10}, {10, 10, 200}};
  for (size_t c = 0; c < classes.size(); ++c) {
    std::filesystem::create_directories(root + "/" + classes[c]);
    for (int i = 0; i < 2; ++i) {
      const std::string name = root + "/" + classes[c] + "/" + std::to_string(i);
      const auto rgb = constant_rgb(37, 40, colour[c][0], colour[c][1], colour[c][2]);
      if (i == 1 && write_jpeg(name + ".JPG", 37, 40, rgb)) continue;
      write_png(name + ".png", 37, 40, rgb);
    }
  }
  std::ofstream(root + "/ant/notes.txt") << "not an image";
  data::ImageFolderOptions o;
  o.size = 32;
  const data::ImageFolder folder(root, o, "mine/train");
  EXPECT_EQ(folder.size(), 6);
  EXPECT_EQ(folder.classes(), (std::vector<std::string>{"ant", "cat", "zebra"}));
  const data::Dataset d = data::materialize(folder, 0, 0, 3);
  EXPECT_EQ(d.size(), 6);
  EXPECT_EQ(d.num_classes, 3);
  EXPECT_EQ(d.height, 32);
  EXPECT_EQ(d.channels, 3);
  EXPECT_EQ(data::image_folder_classes(root), (std::vector<std::string>{"ant", "cat", "zebra"}));
  const int expected_label[6] = {0, 0, 1, 1, 2, 2};
  for (int64_t i = 0; i < d.size(); ++i) {
    const int label = d.labels[static_cast<size_t>(i)];
    EXPECT_EQ(label, expected_label[i]);
    const int source = label == 0 ? 1 : label == 1 ? 2 : 0;  // "ant" was written with colour 1
    const uint8_t* px = d.image(i) + (16 * 32 + 16) * 3;
    for (int ch = 0; ch < 3; ++ch) {
      EXPECT_NEAR(int(px[ch]), int(colour[source][ch]), 3) << "image " << i << " channel " << ch;
    }
  }
}

TEST(ImageFolder, ErrorsNameTheFile) {
  REQUIRE_PNG();
  TempDir dir;
  std::filesystem::create_directories(dir / "t/a");
  std::ofstream(dir / "t/a/broken.png") << "\x89PNG\r\n\x1a\n but then nothing";
  data::ImageFolderOptions o;
  o.size = 32;
  // Files are read when a sample is asked for, so a broken one is reported then, by name.
  try {
    data::materialize(data::ImageFolder(dir / "t", o));
    FAIL() << "a broken PNG was accepted";
  } catch (const IoError& e) {
    EXPECT_NE(e.message().find("broken.png"), std::string::npos) << e.message();
  }
  std::ofstream(dir / "t/a/text.jpg") << "plain text";
  std::filesystem::remove(dir / "t/a/broken.png");
  EXPECT_THROW(data::materialize(data::ImageFolder(dir / "t", o)), IoError);
  std::filesystem::create_directories(dir / "empty");
  EXPECT_THROW(data::ImageFolder(dir / "empty", o), ValueError);
  o.classes = {"a", "b"};  // a split without a class folder the training split has
  EXPECT_THROW(data::ImageFolder(dir / "t", o), IoError);
}

// A split given the training split's classes (cudp-vgg's val/ or test/) must have exactly those
// class folders. One missing was an error; one more was dropped without a word, its images
// unused, where torchvision's ImageFolder would number the classes of the two splits differently.
TEST(ImageFolder, ASplitNeedsTheTrainingSplitsClassFolders) {
  REQUIRE_PNG();
  TempDir dir;
  const auto make_split = [&](const std::string& split, const std::vector<std::string>& classes) {
    std::filesystem::remove_all(dir / split);
    for (const std::string& c : classes) {
      std::filesystem::create_directories(dir / (split + "/" + c));
      write_png(dir / (split + "/" + c + "/0.png"), 8, 8, constant_rgb(8, 8, 1, 2, 3));
    }
    return dir / split;
  };
  data::ImageFolderOptions o;
  o.size = 8;
  const data::ImageFolder train(make_split("train", {"cat", "dog"}), o);
  o.classes = train.classes();
  const auto refused = [&](const std::string& root) {
    try {
      data::ImageFolder split(root, o);
      ADD_FAILURE() << root << " was accepted with the classes " << split.classes().size();
    } catch (const IoError& e) {
      return e.message();
    }
    return std::string();
  };
  EXPECT_EQ(data::ImageFolder(make_split("val", {"cat", "dog"}), o).size(), 2);

  // Class folders that the training split has not: each is named.
  std::string e = refused(make_split("val", {"ant", "cat", "dog", "fox"}));
  EXPECT_NE(e.find(dir / "val"), std::string::npos) << e;
  EXPECT_NE(e.find("'ant', 'fox'"), std::string::npos) << e;
  EXPECT_NE(e.find("not in the training split"), std::string::npos) << e;
  EXPECT_NE(e.find("every split needs the same class folders"), std::string::npos) << e;
  EXPECT_NE(e.find("'cat', 'dog'"), std::string::npos) << e;  // what the training split has

  // One missing, as before, and both at once in one message.
  e = refused(make_split("val", {"cat"}));
  EXPECT_NE(e.find("'dog'"), std::string::npos) << e;
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  EXPECT_NE(e.find("every split needs the same class folders"), std::string::npos) << e;
  e = refused(make_split("val", {"cat", "fox"}));
  EXPECT_NE(e.find("'dog'"), std::string::npos) << e;
  EXPECT_NE(e.find("'fox'"), std::string::npos) << e;
}

// read(index) throws IoError whose message holds every one of `parts`.
void expect_read_error(const data::ImageFolder& folder, int64_t index,
                       const std::vector<std::string>& parts) {
  std::vector<uint8_t> out(static_cast<size_t>(folder.height() * folder.width() * 3));
  try {
    folder.read(index, 1, 0, out.data());
    ADD_FAILURE() << folder.file(index) << " was read";
  } catch (const IoError& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(e.message().find(part), std::string::npos) << e.message();
    }
  }
}

// A class folder is outside input. A FIFO named like an image, there when the folder is listed or
// put in a file's place later, is refused by name when read: opening it for reading would wait for
// a writer forever. A file above 256 MiB is refused by its size before it is read (a sparse file
// here, whose PNG header and image are valid: the old reader decoded it).
TEST(ImageFolder, RefusesFifosAndHugeFilesByName) {
  REQUIRE_PNG();
  TempDir dir;
  const std::string a = dir / "t/a";
  std::filesystem::create_directories(a);
  write_png(a + "/0.png", 8, 8, random_rgb(8, 8, 1));
  write_png(a + "/1.png", 8, 8, random_rgb(8, 8, 2));
  ASSERT_EQ(::mkfifo((a + "/2.png").c_str(), 0600), 0);
  data::ImageFolderOptions o;
  o.size = 8;
  const data::ImageFolder folder(dir / "t", o);
  ASSERT_EQ(folder.size(), 3);
  expect_read_error(folder, 2, {"2.png", "FIFO"});

  std::filesystem::remove(a + "/0.png");
  ASSERT_EQ(::mkfifo((a + "/0.png").c_str(), 0600), 0);
  expect_read_error(folder, 0, {"0.png", "FIFO"});

  const data::Image before = data::decode_image(a + "/1.png");
  EXPECT_EQ(before.rgb, random_rgb(8, 8, 2));
  std::filesystem::resize_file(a + "/1.png", (uint64_t{256} << 20) + 1);
  expect_read_error(folder, 1, {"1.png", "268435457 bytes", "256 MiB"});
}

// A small tree of PNGs (and JPEGs where the encoder is there) of several sizes and aspect ratios:
// 3 classes x 5 images.
std::string make_tree(const TempDir& dir) {
  const std::string root = dir / "tree";
  const int sizes[5][2] = {{40, 30}, {33, 47}, {64, 64}, {90, 20}, {25, 25}};
  for (int c = 0; c < 3; ++c) {
    const std::string folder = root + "/class" + std::to_string(c);
    std::filesystem::create_directories(folder);
    for (int i = 0; i < 5; ++i) {
      const int w = sizes[i][0], h = sizes[i][1];
      const auto rgb = random_rgb(w, h, static_cast<uint32_t>(10 * c + i + 1));
      const std::string name = folder + "/" + std::to_string(i);
      if (i % 2 == 1 && write_jpeg(name + ".jpg", w, h, rgb)) continue;
      write_png(name + ".png", w, h, rgb);
    }
  }
  return root;
}

// The loader's sample, made here the plain way: decode, transform, normalise.
std::vector<float> expected_sample(const data::ImageFolder& folder, int64_t sample, uint64_t seed,
                                   int epoch, const data::Normalization& norm) {
  const data::Image decoded = data::decode_image(folder.file(sample));
  const int64_t size = folder.options().size;
  const data::Image img = folder.options().transform == data::ImageTransform::Train
                              ? data::train_transform(decoded, size, seed, epoch, sample)
                              : data::eval_transform(decoded, size);
  std::vector<float> out;
  for (size_t i = 0; i < img.rgb.size(); ++i) {
    out.push_back((static_cast<float>(img.rgb[i]) / 255.0f - norm.mean[i % 3]) / norm.std[i % 3]);
  }
  return out;
}

// Decoding on the loader's workers: every batch is the same with 1 worker and with 3 (which split
// batches between them), and every sample is decode + RandomResizedCrop + flip of its file with the
// draws of (seed, epoch, sample index); another epoch gives other crops.
TEST(ImageFolder, LoaderDecodesOnItsWorkersTheSameWhateverTheirNumber) {
  REQUIRE_PNG();
  TempDir dir;
  data::ImageFolderOptions fo;
  fo.size = 24;
  fo.transform = data::ImageTransform::Train;
  const data::ImageFolder folder(make_tree(dir), fo);
  data::LoaderOptions lo;
  lo.batch_size = 4;
  lo.seed = 21;
  lo.normalization = data::imagenet_normalization();
  lo.workers = 1;
  lo.prefetch = 1;
  data::Loader one(folder, lo);
  lo.workers = 3;
  lo.prefetch = 2;
  data::Loader three(folder, lo);
  ASSERT_EQ(one.image_shape(), (Shape{24, 24, 3}));
  for (int epoch : {0, 1}) {
    const auto batches = run_epoch(one, epoch);
    EXPECT_EQ(run_epoch(three, epoch), batches) << "epoch " << epoch;
    const std::vector<int64_t> order = one.epoch_order(epoch);
    ASSERT_EQ(batches.size(), 4u);
    size_t row = 0;
    const size_t floats = 24 * 24 * 3;
    for (const HostBatch& b : batches) {
      for (size_t r = 0; r < b.labels.size(); ++r, ++row) {
        const int64_t sample = order[row];
        EXPECT_EQ(b.labels[r], folder.label(sample));
        const std::vector<float> want = expected_sample(folder, sample, 21, epoch, lo.normalization);
        const std::vector<float> got(b.images.begin() + static_cast<long>(r * floats),
                                     b.images.begin() + static_cast<long>((r + 1) * floats));
        ASSERT_EQ(got, want) << "epoch " << epoch << ", sample " << sample;
      }
    }
    ASSERT_EQ(row, 15u);
  }
  EXPECT_NE(run_epoch(one, 0), run_epoch(one, 1)) << "two epochs gave the same crops";
  const auto whole = run_epoch(three, 1);
  EXPECT_EQ(run_epoch(one, 1, 2), std::vector<HostBatch>(whole.begin() + 2, whole.end()))
      << "a resumed epoch differs";
}

// Files are read at every epoch, not held decoded: an image rewritten between two epochs is seen
// as it is now; one that stopped decoding is an error naming it; keep_first keeps the first files.
TEST(ImageFolder, ReadsItsFilesAtEveryEpoch) {
  REQUIRE_PNG();
  TempDir dir;
  const std::string root = make_tree(dir);
  data::ImageFolderOptions fo;
  fo.size = 16;
  data::ImageFolder folder(root, fo);
  data::LoaderOptions lo;
  lo.batch_size = 15;
  lo.shuffle = false;
  lo.normalization = data::imagenet_normalization();
  data::Loader loader(folder, lo);
  const auto before = run_epoch(loader, 0);
  ASSERT_EQ(before.size(), 1u);
  write_png(folder.file(0), 20, 20, constant_rgb(20, 20, 255, 0, 0));  // now all red
  const auto after = run_epoch(loader, 1);
  EXPECT_NE(after, before);
  const float red = (1.0f - 0.485f) / 0.229f;
  EXPECT_NEAR(after[0].images[0], red, 1e-5);
  EXPECT_EQ(std::vector<float>(after[0].images.begin() + 16 * 16 * 3, after[0].images.end()),
            std::vector<float>(before[0].images.begin() + 16 * 16 * 3, before[0].images.end()));
  std::ofstream(folder.file(2), std::ios::trunc) << "no longer an image";
  try {
    run_epoch(loader, 2);
    FAIL() << "a broken file was read without an error";
  } catch (const IoError& e) {
    EXPECT_NE(e.message().find(folder.file(2)), std::string::npos) << e.message();
  }
  data::ImageFolder first_two(root, fo);
  first_two.keep_first(2);
  EXPECT_EQ(first_two.size(), 2);
  EXPECT_EQ(data::materialize(first_two).labels, (std::vector<int32_t>{0, 0}));
}

}  // namespace
