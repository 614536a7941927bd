#include "heatmap_grid.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "bitmap_font.hpp"
#include "colormap.hpp"

namespace mha::tools {
namespace {

constexpr Rgb kBackground{255, 255, 255};
constexpr Rgb kInk{30, 30, 30};
constexpr Rgb kHiddenCell{200, 200, 200};
constexpr int kTextScale = 2;
constexpr int kLineHeight = (kGlyphHeight + 4) * kTextScale;
constexpr int kMargin = 20;
constexpr int kGap = 24;
constexpr int kColourBarHeight = 18;

// Whole pixels per matrix cell, so every cell is a crisp square of the same size.
int cell_pixels(const HeatmapPanel& p, int panel_size) {
  const int64_t longer = std::max<int64_t>({p.rows, p.cols, 1});
  return std::max(1, static_cast<int>(panel_size / longer));
}

Rgb colour_of(double value, const HeatmapStyle& style) {
  const double t = std::clamp(value / style.vmax, 0.0, 1.0);
  return viridis(std::pow(t, style.gamma));
}

void draw_panel(RgbImage& img, int x, int y, const HeatmapPanel& p, int cell, const HeatmapStyle& style) {
  draw_text(img, x, y, p.title, kInk, kTextScale);
  y += kLineHeight;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) {
      const size_t i = static_cast<size_t>(r * p.cols + c);
      const bool hidden = !p.hidden.empty() && p.hidden[i];
      img.fill_rect(x + static_cast<int>(c) * cell, y + static_cast<int>(r) * cell, cell, cell,
                    hidden ? kHiddenCell : colour_of(p.values[i], style));
    }
  }
}

std::string format_value(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

RgbImage render_heatmap_grid(const std::vector<HeatmapRow>& rows, const HeatmapStyle& style) {
  // Measure: each figure row is a heading line, then panels (title line + matrix) side by side.
  int width = 0, height = kMargin;
  std::vector<int> row_heights;
  for (const HeatmapRow& row : rows) {
    int row_width = 0, tallest = 0;
    for (const HeatmapPanel& p : row.panels) {
      const int cell = cell_pixels(p, style.panel_size);
      const int panel_width = std::max(static_cast<int>(p.cols) * cell, text_width(p.title, kTextScale));
      row_width += panel_width + kGap;
      tallest = std::max(tallest, kLineHeight + static_cast<int>(p.rows) * cell);
    }
    row_width = std::max(row_width - kGap, text_width(row.heading, kTextScale));
    width = std::max(width, row_width);
    row_heights.push_back(kLineHeight + tallest);
    height += row_heights.back() + kGap;
  }
  const int bar_width = std::min(width, 2 * style.panel_size);
  for (const std::string& note : style.notes) width = std::max(width, text_width(note, kTextScale));
  height += kLineHeight + kColourBarHeight + kLineHeight + static_cast<int>(style.notes.size()) * kLineHeight;
  width += 2 * kMargin;
  height += kMargin;

  RgbImage img(width, height, kBackground);
  int y = kMargin;
  for (size_t r = 0; r < rows.size(); ++r) {
    draw_text(img, kMargin, y, rows[r].heading, kInk, kTextScale);
    int x = kMargin;
    for (const HeatmapPanel& p : rows[r].panels) {
      const int cell = cell_pixels(p, style.panel_size);
      draw_panel(img, x, y + kLineHeight, p, cell, style);
      x += std::max(static_cast<int>(p.cols) * cell, text_width(p.title, kTextScale)) + kGap;
    }
    y += row_heights[r] + kGap;
  }

  // Colour bar: label, gradient from 0 to vmax, the two end values.
  draw_text(img, kMargin, y, style.colour_bar_label, kInk, kTextScale);
  y += kLineHeight;
  for (int i = 0; i < bar_width; ++i) {
    const double value = style.vmax * i / std::max(1, bar_width - 1);
    img.fill_rect(kMargin + i, y, 1, kColourBarHeight, colour_of(value, style));
  }
  y += kColourBarHeight + 4;
  draw_text(img, kMargin, y, "0", kInk, kTextScale);
  const std::string middle = format_value(style.vmax / 2), top = format_value(style.vmax);
  draw_text(img, kMargin + (bar_width - text_width(middle, kTextScale)) / 2, y, middle, kInk, kTextScale);
  draw_text(img, kMargin + bar_width - text_width(top, kTextScale), y, top, kInk, kTextScale);
  y += kLineHeight;
  for (const std::string& note : style.notes) {
    draw_text(img, kMargin, y, note, kInk, kTextScale);
    y += kLineHeight;
  }
  return img;
}

}  // namespace mha::tools
