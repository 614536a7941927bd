// The demo's timing table: the fused float32 kernel against the naive float64 reference.
#pragma once

#include <cstdint>

namespace mha::tools {

// Prints one row per sequence length as soon as it is measured, so the table is its own progress
// display. The reference is skipped where it would take more than a few seconds.
void print_timing_table(uint64_t seed);

}  // namespace mha::tools
