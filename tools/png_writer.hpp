// An 8-bit RGB image in memory and a PNG writer for it (libpng).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha::tools {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

class RgbImage {
 public:
  RgbImage(int width, int height, Rgb background);

  int width() const { return width_; }
  int height() const { return height_; }
  // Pixels outside the image are ignored, so callers may draw partly off the canvas.
  void set(int x, int y, Rgb c);
  void fill_rect(int x, int y, int w, int h, Rgb c);
  const uint8_t* row(int y) const { return pixels_.data() + static_cast<size_t>(y) * width_ * 3; }

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;  // row-major, 3 bytes per pixel
};

// Writes `image` as a PNG file, creating the parent directory if needed. Throws
// std::runtime_error with the path and the reason on failure.
void write_png(const RgbImage& image, const std::string& path);

}  // namespace mha::tools
