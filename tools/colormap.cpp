#include "colormap.hpp"

#include <algorithm>
#include <array>
#include <cmath>

namespace mha::tools {

Rgb viridis(double t) {
  // matplotlib's viridis sampled at 11 evenly spaced points; linear interpolation between them
  // stays within a few levels of the full 256-entry table.
  static constexpr std::array<Rgb, 11> kStops = {{{0x44, 0x01, 0x54},
                                                  {0x48, 0x24, 0x75},
                                                  {0x41, 0x44, 0x87},
                                                  {0x35, 0x5f, 0x8d},
                                                  {0x2a, 0x78, 0x8e},
                                                  {0x21, 0x91, 0x8c},
                                                  {0x22, 0xa8, 0x84},
                                                  {0x44, 0xbf, 0x70},
                                                  {0x7a, 0xd1, 0x51},
                                                  {0xbd, 0xdf, 0x26},
                                                  {0xfd, 0xe7, 0x25}}};
  if (!(t >= 0)) t = 0;  // also catches NaN
  t = std::min(t, 1.0);
  const double pos = t * (kStops.size() - 1);
  const size_t i = std::min(static_cast<size_t>(pos), kStops.size() - 2);
  const double f = pos - static_cast<double>(i);
  auto mix = [f](uint8_t a, uint8_t b) { return static_cast<uint8_t>(std::lround(a + (b - a) * f)); };
  return {mix(kStops[i].r, kStops[i + 1].r), mix(kStops[i].g, kStops[i + 1].g), mix(kStops[i].b, kStops[i + 1].b)};
}

}  // namespace mha::tools
