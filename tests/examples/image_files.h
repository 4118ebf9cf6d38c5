// Writes small PNG and JPEG files for the ImageFolder tests and the image fuzz target's seeds
// (fuzz/make_seeds.cpp), independently of the reader under test: PNGs by hand (stored deflate
// blocks, CRC-32 and Adler-32 computed here, no zlib), JPEGs through libjpeg-turbo's encoder loaded
// at run time (write_jpeg returns false where it is not installed).
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace cudp::testing {

inline uint32_t crc32_of(const std::string& bytes) {
  uint32_t c = 0xffffffffu;
  for (char ch : bytes) {
    c ^= static_cast<uint8_t>(ch);
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}

inline void put_u32(std::string& out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>((v >> s) & 0xff));
}

// An 8-bit RGB PNG of width x height pixels (rgb row-major), filter 0, stored (uncompressed)
// deflate blocks.
inline void write_png(const std::string& path, int width, int height,
                      const std::vector<uint8_t>& rgb) {
  std::string raw;
  for (int y = 0; y < height; ++y) {
    raw.push_back(0);
    raw.append(reinterpret_cast<const char*>(rgb.data()) + static_cast<size_t>(y) * width * 3,
               static_cast<size_t>(width) * 3);
  }
  std::string z = "\x78\x01";
  for (size_t at = 0; at < raw.size() || at == 0;) {
    const size_t n = std::min<size_t>(65535, raw.size() - at);
    const bool last = at + n == raw.size();
    z.push_back(last ? 1 : 0);
    z.push_back(static_cast<char>(n & 0xff));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xff));
    z.push_back(static_cast<char>((~n >> 8) & 0xff));
    z.append(raw, at, n);
    at += n;
    if (last) break;
  }
  uint32_t a = 1, b = 0;
  for (char ch : raw) {
    a = (a + static_cast<uint8_t>(ch)) % 65521;
    b = (b + a) % 65521;
  }
  put_u32(z, (b << 16) | a);
  std::string png("\x89PNG\r\n\x1a\n", 8);
  const auto chunk = [&png](const std::string& type, const std::string& data) {
    put_u32(png, static_cast<uint32_t>(data.size()));
    png += type + data;
    put_u32(png, crc32_of(type + data));
  };
  std::string ihdr;
  put_u32(ihdr, static_cast<uint32_t>(width));
  put_u32(ihdr, static_cast<uint32_t>(height));
  ihdr += std::string("\x08\x02\x00\x00\x00", 5);
  chunk("IHDR", ihdr);
  chunk("IDAT", z);
  chunk("IEND", "");
  std::ofstream(path, std::ios::binary) << png;
}

// A baseline JPEG (4:4:4, `quality`) through libturbojpeg.so.0's tjCompress2, or false.
inline bool write_jpeg(const std::string& path, int width, int height,
                       const std::vector<uint8_t>& rgb, int quality = 95) {
  static void* lib = dlopen("libturbojpeg.so.0", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return false;
  using Init = void* (*)();
  using Compress = int (*)(void*, const unsigned char*, int, int, int, int, unsigned char**,
                           unsigned long*, int, int, int);
  using Free = void (*)(unsigned char*);
  using Destroy = int (*)(void*);
  const auto init = reinterpret_cast<Init>(dlsym(lib, "tjInitCompress"));
  const auto compress = reinterpret_cast<Compress>(dlsym(lib, "tjCompress2"));
  const auto free_buffer = reinterpret_cast<Free>(dlsym(lib, "tjFree"));
  const auto destroy = reinterpret_cast<Destroy>(dlsym(lib, "tjDestroy"));
  if (!init || !compress || !free_buffer || !destroy) return false;
  void* h = init();
  unsigned char* out = nullptr;
  unsigned long size = 0;
  // TJPF_RGB = 0, TJSAMP_444 = 0, flags 0.
  const int rc = compress(h, rgb.data(), width, 0, height, 0, &out, &size, 0, quality, 0);
  if (rc == 0) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(out),
                                                static_cast<std::streamsize>(size));
  }
  free_buffer(out);
  destroy(h);
  return rc == 0;
}

}  // namespace cudp::testing
