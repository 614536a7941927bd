// A perceptual colour map for heat maps.
#pragma once

#include "png_writer.hpp"

namespace mha::tools {

// Viridis: dark purple (0) through blue and green to yellow (1). Its lightness rises steadily,
// so equal steps in value look like equal steps in colour and it survives greyscale printing
// and the common forms of colour blindness. Values outside [0, 1] are clamped.
Rgb viridis(double t);

}  // namespace mha::tools
