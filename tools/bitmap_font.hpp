// A tiny built-in 5x7 pixel font for labels in generated images, so that pictures need no font
// files. Upper-case letters, digits and a little punctuation; lower case is drawn as upper case
// and anything else as a hollow box.
#pragma once

#include <string_view>

#include "png_writer.hpp"

namespace mha::tools {

inline constexpr int kGlyphWidth = 5;
inline constexpr int kGlyphHeight = 7;
inline constexpr int kGlyphAdvance = 6;  // one blank column between characters

// Draws `text` with its top-left corner at (x, y); every font pixel becomes a scale x scale square.
void draw_text(RgbImage& image, int x, int y, std::string_view text, Rgb colour, int scale = 1);

// Width in pixels of `text` drawn at `scale`.
int text_width(std::string_view text, int scale = 1);

}  // namespace mha::tools
