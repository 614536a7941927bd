// What the x86 kernel files use from outside the kernels, included before their instruction set's
// region opens (cpu/isa_region.hpp) so that it stays baseline code: the standard library, the
// public headers and the library's core. A header missing here is read for the first time inside
// a region and compiled for its instruction set; tests/check_isa_copies.py reports the copies it
// then shares with baseline files.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/dropout.hpp"
#include "core/host_memory.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/amx.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/dispatch.hpp"
#include "mha/dtype.hpp"
#include "mha/error.hpp"
#include "mha/sdpa.hpp"
#include "mha/tensor.hpp"
