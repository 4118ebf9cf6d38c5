#include "examples/vgg/plot.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace cudp::trainer {
namespace {

void put32(std::vector<uint8_t>& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<uint8_t>(v >> s));
}

void chunk(std::vector<uint8_t>& out, const char* type, const std::vector<uint8_t>& data) {
  put32(out, static_cast<uint32_t>(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  const uLong crc = crc32(0L, out.data() + start, static_cast<uInt>(out.size() - start));
  put32(out, static_cast<uint32_t>(crc));
}

struct Rgb {
  uint8_t r, g, b;
};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}
  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // A line `thick` pixels wide (Bresenham, thickened by squares).
  void line(int x0, int y0, int x1, int y1, Rgb c, int thick = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    for (int err = dx + dy;;) {
      rect(x0 - thick / 2, y0 - thick / 2, x0 + (thick - 1) / 2, y0 + (thick - 1) / 2, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }
  // Text in the 3x5 font, `scale` pixels per font pixel; returns the width drawn.
  int text(int x, int y, const std::string& s, Rgb c, int scale = 2) {
    int cx = x;
    for (char ch : s) {
      const uint16_t g = glyph(ch);
      for (int row = 0; row < 5; ++row)
        for (int col = 0; col < 3; ++col)
          if (g & (1 << (14 - row * 3 - col)))
            rect(cx + col * scale, y + row * scale, cx + col * scale + scale - 1,
                 y + row * scale + scale - 1, c);
      cx += 4 * scale;
    }
    return cx - x;
  }
  static int text_width(const std::string& s, int scale = 2) {
    return static_cast<int>(s.size()) * 4 * scale;
  }
  const std::vector<uint8_t>& pixels() const { return px_; }

 private:
  // Five rows of three bits, top row in the high bits.
  static uint16_t glyph(char ch) {
    switch (ch) {
      case '0': case 'O': return 0b111'101'101'101'111;
      case '1': return 0b010'110'010'010'111;
      case '2': return 0b111'001'111'100'111;
      case '3': return 0b111'001'111'001'111;
      case '4': return 0b101'101'111'001'001;
      case '5': return 0b111'100'111'001'111;
      case 'S': return 0b011'100'010'001'110;
      case '6': return 0b111'100'111'101'111;
      case '7': return 0b111'001'001'001'001;
      case '8': return 0b111'101'111'101'111;
      case '9': return 0b111'101'111'001'111;
      case '.': return 0b000'000'000'000'010;
      case '-': return 0b000'000'111'000'000;
      case '%': return 0b101'001'010'100'101;
      case '(': return 0b001'010'010'010'001;
      case ')': return 0b100'010'010'010'100;
      case 'A': return 0b010'101'111'101'101;
      case 'C': return 0b111'100'100'100'111;
      case 'E': return 0b111'100'110'100'111;
      case 'H': return 0b101'101'111'101'101;
      case 'I': return 0b111'010'010'010'111;
      case 'L': return 0b100'100'100'100'111;
      case 'N': return 0b110'101'101'101'101;
      case 'P': return 0b111'101'111'100'100;
      case 'R': return 0b110'101'110'101'101;
      case 'T': return 0b111'010'010'010'010;
      case 'U': return 0b101'101'101'101'111;
      case 'Y': return 0b101'101'010'010'010;
      default: return 0;
    }
  }
  int w_, h_;
  std::vector<uint8_t> px_;
};

// Tick values from lo to hi at a step of 1, 2 or 5 times a power of ten (about `n` of them).
std::vector<double> ticks(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / p < 1.5 ? p : raw / p < 3.5 ? 2 * p : raw / p < 7.5 ? 5 * p : 10 * p;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) t.push_back(v);
  return t;
}

std::string label(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (a != 0 && (a < 1e-3 || a >= 1e5)) {
    std::snprintf(buf, sizeof buf, "%.0e", v);
    std::string s = buf;
    for (char& c : s) c = c == 'e' ? 'E' : c;
    return s;
  }
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

struct Series {
  std::string name;
  Rgb color;
  std::vector<double> y;
};

const Rgb kAxis{60, 60, 60}, kGrid{225, 225, 225};

// One panel in [x0, x1] x [y0, y1] (outer box, labels inside its margins).
void panel(Canvas& c, int x0, int y0, int x1, int y1, const std::string& title,
           const std::vector<int64_t>& epochs, const std::vector<Series>& series, bool percent) {
  const int left = x0 + 70, right = x1 - 15, top = y0 + 30, bottom = y1 - 45;
  double lo = INFINITY, hi = -INFINITY;
  for (const Series& s : series)
    for (double v : s.y)
      if (std::isfinite(v)) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (percent) lo = std::max(0.0, lo), hi = std::min(100.0, hi);
  if (hi - lo < 1e-9) lo -= 0.5, hi += 0.5;
  const double pad = (hi - lo) * 0.05;
  lo -= pad;
  hi += pad;
  const int64_t e0 = epochs.front(), e1 = std::max<int64_t>(epochs.back(), e0 + 1);
  const auto px = [&](double e) {
    return left + static_cast<int>(std::lround((e - e0) / double(e1 - e0) * (right - left)));
  };
  const auto py = [&](double v) {
    return bottom - static_cast<int>(std::lround((v - lo) / (hi - lo) * (bottom - top)));
  };
  for (double t : ticks(lo, hi, 5)) {
    const int y = py(t);
    c.line(left, y, right, y, kGrid);
    const std::string s = label(t);
    c.text(left - 8 - Canvas::text_width(s), y - 5, s, kAxis);
  }
  const int64_t estep = std::max<int64_t>(1, (e1 - e0 + 7) / 8);  // at most 9 labels
  for (int64_t e = e0; e <= e1; e += estep) {
    const int x = px(static_cast<double>(e));
    c.line(x, bottom, x, bottom + 5, kAxis);
    const std::string s = std::to_string(e);
    c.text(x - Canvas::text_width(s) / 2, bottom + 10, s, kAxis);
  }
  c.line(left, top, left, bottom, kAxis);
  c.line(left, bottom, right, bottom, kAxis);
  c.text(left, y0 + 8, title, kAxis);
  c.text((left + right - Canvas::text_width("EPOCH")) / 2, bottom + 28, "EPOCH", kAxis);
  int lx = right - 10;
  for (auto it = series.rbegin(); it != series.rend(); ++it) {
    lx -= Canvas::text_width(it->name) + 26;
    c.rect(lx, y0 + 10, lx + 14, y0 + 16, it->color);
    c.text(lx + 19, y0 + 8, it->name, kAxis);
  }
  for (const Series& s : series) {
    for (size_t i = 0; i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      const int x = px(static_cast<double>(epochs[i])), y = py(s.y[i]);
      c.rect(x - 2, y - 2, x + 2, y + 2, s.color);
      if (i > 0 && std::isfinite(s.y[i - 1])) {
        c.line(px(static_cast<double>(epochs[i - 1])), py(s.y[i - 1]), x, y, s.color, 2);
      }
    }
  }
}

}  // namespace

std::vector<uint8_t> encode_png(int width, int height, const std::vector<uint8_t>& rgb) {
  if (width <= 0 || height <= 0 || rgb.size() != static_cast<size_t>(width) * height * 3) {
    throw std::invalid_argument("encode_png: the pixels do not match the size");
  }
  std::vector<uint8_t> raw;  // each row: filter type 0, then its pixels
  raw.reserve(static_cast<size_t>(height) * (1 + width * 3));
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    const auto row = rgb.begin() + static_cast<ptrdiff_t>(y) * width * 3;
    raw.insert(raw.end(), row, row + width * 3);
  }
  uLongf size = compressBound(static_cast<uLong>(raw.size()));
  std::vector<uint8_t> z(size);
  if (compress2(z.data(), &size, raw.data(), static_cast<uLong>(raw.size()), 6) != Z_OK) {
    throw std::runtime_error("encode_png: zlib could not compress the image");
  }
  z.resize(size);
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr;
  put32(ihdr, static_cast<uint32_t>(width));
  put32(ihdr, static_cast<uint32_t>(height));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8 bits, RGB, deflate, filter 0, no interlace
  chunk(png, "IHDR", ihdr);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", {});
  return png;
}

std::vector<uint8_t> draw_curves(const std::vector<CurvePoint>& points, int width, int height) {
  Canvas c(width, height);
  if (!points.empty()) {
    std::vector<int64_t> epochs;
    Series train_loss{"TRAIN", {31, 119, 180}, {}}, test_loss{"TEST", {255, 127, 14}, {}};
    Series train_top1{"TRAIN", {31, 119, 180}, {}}, test_top1{"TEST", {255, 127, 14}, {}},
        test_top5{"TEST TOP5", {44, 160, 44}, {}};
    for (const CurvePoint& p : points) {
      epochs.push_back(p.epoch);
      train_loss.y.push_back(p.train_loss);
      test_loss.y.push_back(p.test_loss);
      train_top1.y.push_back(p.train_top1);
      test_top1.y.push_back(p.test_top1);
      test_top5.y.push_back(p.test_top5);
    }
    panel(c, 0, 0, width / 2 - 1, height - 1, "LOSS", epochs, {train_loss, test_loss}, false);
    panel(c, width / 2, 0, width - 1, height - 1, "ACCURACY (%)", epochs,
          {train_top1, test_top1, test_top5}, true);
  }
  return encode_png(width, height, c.pixels());
}

}  // namespace cudp::trainer
