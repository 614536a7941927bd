#include "png_writer.hpp"

#include <png.h>

#include <algorithm>
#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>

namespace mha::tools {

RgbImage::RgbImage(int width, int height, Rgb background)
    : width_(width), height_(height), pixels_(static_cast<size_t>(width) * height * 3) {
  fill_rect(0, 0, width, height, background);
}

void RgbImage::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  uint8_t* p = pixels_.data() + (static_cast<size_t>(y) * width_ + x) * 3;
  p[0] = c.r;
  p[1] = c.g;
  p[2] = c.b;
}

void RgbImage::fill_rect(int x, int y, int w, int h, Rgb c) {
  const int x0 = std::max(x, 0), y0 = std::max(y, 0);
  const int x1 = std::min(x + w, width_), y1 = std::min(y + h, height_);
  for (int yy = y0; yy < y1; ++yy)
    for (int xx = x0; xx < x1; ++xx) set(xx, yy, c);
}

namespace {

// libpng reports errors by longjmp. This function holds only trivially destructible locals, so
// the jump back into it skips no destructor; it returns false when libpng failed.
bool encode(const RgbImage& image, std::FILE* file, char* error_text, size_t error_size) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  if (!png) {
    std::snprintf(error_text, error_size, "out of memory");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (!info || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::snprintf(error_text, error_size, "libpng failed while encoding");
    return false;
  }
  png_init_io(png, file);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width()), static_cast<png_uint_32>(image.height()), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < image.height(); ++y) png_write_row(png, image.row(y));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

}  // namespace

void write_png(const RgbImage& image, const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) throw std::runtime_error("cannot create directory " + parent.string() + ": " + ec.message());
  }
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (!file) throw std::runtime_error("cannot open " + path + " for writing: " + std::strerror(errno));
  char error_text[128] = {};
  const bool encoded = encode(image, file, error_text, sizeof error_text);
  const bool closed = std::fclose(file) == 0;
  if (!encoded) throw std::runtime_error("cannot write " + path + ": " + error_text);
  if (!closed) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
}

}  // namespace mha::tools
