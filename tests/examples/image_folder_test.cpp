// data/image_folder: the ImageFolder reader behind cudp-vgg --data folder. Images are made here at
// test time (tests/examples/image_files.h: PNGs written by hand, JPEGs by libjpeg-turbo's encoder)
// and compared with what they hold: PNG decodes exactly, JPEG within its quantisation error of the
// original, resizing against values worked out by hand (a constant stays constant, a linear ramp
// stays linear, the centre crop keeps the middle). Tests skip, saying which package is missing,
// where the codecs are not installed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/image_folder.h"
#include "engine/core/error.h"
#include "examples/image_files.h"
#include "examples/run_binary.h"

namespace {

using namespace cudp;
using namespace cudp::testing;

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
  o.workers = 3;
  const data::Dataset d = data::load_image_folder(root, o, "mine/train");
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
  try {
    data::load_image_folder(dir / "t", o);
    FAIL() << "a broken PNG was accepted";
  } catch (const IoError& e) {
    EXPECT_NE(e.message().find("broken.png"), std::string::npos) << e.message();
  }
  std::ofstream(dir / "t/a/text.jpg") << "plain text";
  std::filesystem::remove(dir / "t/a/broken.png");
  EXPECT_THROW(data::load_image_folder(dir / "t", o), IoError);
  std::filesystem::create_directories(dir / "empty");
  EXPECT_THROW(data::load_image_folder(dir / "empty", o), ValueError);
  o.classes = {"a", "b"};  // a split without a class folder the training split has
  EXPECT_THROW(data::load_image_folder(dir / "t", o), IoError);
}

}  // namespace
