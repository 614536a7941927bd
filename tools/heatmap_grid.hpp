// A figure of labelled heat maps, one row of panels per group, with a colour bar underneath.
// Used by `mha demo` to draw one attention-weight matrix per head.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "png_writer.hpp"

namespace mha::tools {

struct HeatmapPanel {
  std::string title;
  int64_t rows = 0, cols = 0;
  std::vector<double> values;  // rows * cols, row-major
  // Optional, rows * cols: cells excluded by a mask are drawn grey rather than as "small", so that
  // a causal triangle or padded keys are told apart from weights that are merely near zero.
  std::vector<bool> hidden;
};

struct HeatmapRow {
  std::string heading;
  std::vector<HeatmapPanel> panels;
};

struct HeatmapStyle {
  double vmax = 1.0;     // value shown in the brightest colour
  double gamma = 1.0;    // colour = viridis((value / vmax)^gamma); < 1 brings out small values
  int panel_size = 240;  // target length in pixels of a panel's longer side
  std::string colour_bar_label;
  std::vector<std::string> notes;  // lines printed under the colour bar
};

RgbImage render_heatmap_grid(const std::vector<HeatmapRow>& rows, const HeatmapStyle& style);

}  // namespace mha::tools
