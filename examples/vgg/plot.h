// The run folder's curves.png: loss and accuracy per epoch, drawn by the trainer itself at the end
// of every epoch.
//
// Why our own: the trainer must draw on a machine that has nothing but the build's dependencies (no
// Python, no matplotlib, no GUI libraries), and the picture is simple: two panels of line plots with
// axes, ticks and a legend. Pixels go into an RGB raster (a 3x5 bitmap font for the labels) and out
// through a minimal PNG writer (zlib, which cudp links already): one IHDR, one IDAT, one IEND,
// filter type 0 on every row.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cudp::trainer {

// An 8-bit RGB image as PNG bytes.
std::vector<uint8_t> encode_png(int width, int height, const std::vector<uint8_t>& rgb);

struct CurvePoint {
  int64_t epoch;  // from 1
  double train_loss, test_loss;
  double train_top1, test_top1, test_top5;  // percent
};

// The two panels (loss; accuracy in percent) as PNG bytes, width x height pixels.
std::vector<uint8_t> draw_curves(const std::vector<CurvePoint>& points, int width = 960,
                                 int height = 400);

}  // namespace cudp::trainer
