// The whole public API.
#pragma once

#include "mha/dtype.hpp"
#include "mha/cuda.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"
#include "mha/multihead_attention.hpp"
#include "mha/paged_attention.hpp"
#include "mha/reference.hpp"
#include "mha/sdpa.hpp"
#include "mha/tensor.hpp"
#include "mha/threading.hpp"
#include "mha/varlen.hpp"
