#include "module/linear.hpp"

#include "core/parallel_copy.hpp"
#include "core/scratch.hpp"
#include "core/thread_pool.hpp"
#include "cpu/few_rows_gemm.hpp"
#include "module/onednn_matmul.hpp"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace mha::detail {
namespace {

enum class RowOrder { batch_major, seq_major, neither };

// How the [N, L, C] view's rows sit in memory: r = n * L + l, r = l * N + n, or neither.
RowOrder row_order(const TensorView& t, int64_t* row_stride) {
  const int64_t N = t.shape[0], L = t.shape[1];
  if (L == 1 || t.strides[0] == L * t.strides[1]) {
    *row_stride = L == 1 ? t.strides[0] : t.strides[1];
    return RowOrder::batch_major;
  }
  if (N == 1 || t.strides[1] == N * t.strides[0]) {
    *row_stride = N == 1 ? t.strides[1] : t.strides[0];
    return RowOrder::seq_major;
  }
  return RowOrder::neither;
}

// The blocks gemm splits C into. They depend on the shape alone, never on the thread count, and
// each is one single-threaded sgemm: so every element of C is computed by the same code in the
// same order however many threads run, and results are bit-identical across thread counts.
// (OpenBLAS's own threading splits a call by its thread count, and on some CPUs its edge kernels
// round differently, so a multi-threaded call is not reproducible across counts.) 256 rows or
// columns keep the repeated packing of the other operand near 1/64 byte per flop.
constexpr int64_t kGemmBlock = 256;

// Rows are split into blocks of 256; while that gives fewer than this many blocks, the columns are
// split too (into parts of at least 256), so that up to 8 threads share a 512-row projection (2
// before) and a weight gradient at E = 1024 (4 before). Each part repacks its row block: on 2
// threads 8 blocks were level with the old split and 16 cost 2-4% (E = 1024 module, L = 512).
constexpr int64_t kMinGemmBlocks = 8;

// Up to this many rows of C, one matrix-vector product per row instead of a GEMM: sgemm packs its
// B operand (the weight) before it computes, which at one row triples the memory traffic of what
// is a pass over the weight (a 3072 x 1024 weight on 2 threads: 0.22 ms against 0.9-1.1 ms at one
// row, 0.56-0.61 against 0.76-0.87 at four, and slower past that).
constexpr int64_t kGemvRows = 4;

// Up to this many rows against a bfloat16/float16 weight, few_rows_gemm on the weight as it is
// rather than sgemm on a widened copy: the bfloat16 module at E = 1024 with one query and one key
// per batch entry took 1.2 against 4.0 ms at 5 rows, 2.6 against 4.5 at 16, 6.6 against 8.4 at 64,
// and 12.4 against 11.8 at 96 (best of 30 calls on 2 threads).
constexpr int64_t kFewRows16 = 64;

// From this many rows (of x and y) a float32 projection runs oneDNN's matmul on the weight packed
// once per call, about 0.35 ms per 1024 x 1024 on one thread, which its 15% over sgemm repaid from
// about 256 rows on Sapphire Rapids; at 16 rows the packing was half of an E = 1024 module's call
// (2.7 ms against 1.2 on sgemm). Below it, gemm()'s blocks, each reading the weight as it is.
constexpr int64_t kOneDnnF32Rows = 512;

// few_rows_gemm's tasks take this many weight rows (columns of y) each: 16 tasks for a 1024-wide
// projection, so that more threads than 4 share a decoding step's.
constexpr int64_t kFewRowsColumns = 64;

// The BLAS routines of each precision, so that one template serves float32 and float64.
void blas_gemv(bool transpose, int64_t m, int64_t n, float alpha, const float* a, int64_t lda, const float* x,
               int64_t incx, float beta, float* y) {
  cblas_sgemv(CblasRowMajor, transpose ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              alpha, a, static_cast<blasint>(lda), x, static_cast<blasint>(incx), beta, y, 1);
}
void blas_gemv(bool transpose, int64_t m, int64_t n, double alpha, const double* a, int64_t lda, const double* x,
               int64_t incx, double beta, double* y) {
  cblas_dgemv(CblasRowMajor, transpose ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              alpha, a, static_cast<blasint>(lda), x, static_cast<blasint>(incx), beta, y, 1);
}
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda, const double* b,
               int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

// A block of C (rows x cols) = op(A) op(B) + beta C, as one gemv per row; a, b and c point at
// the block's first row of op(A), first column of op(B) and first element of C.
template <typename T>
void gemv_rows(bool transpose_a, bool transpose_b, int64_t rows, int64_t cols, int64_t k, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* a_row = transpose_a ? a + i : a + i * lda;  // row i of op(A)
    const int64_t a_step = transpose_a ? lda : 1;
    if (transpose_b) {  // B is [n, k]: the block's rows of B, times a_row
      blas_gemv(false, cols, k, T(1), b, ldb, a_row, a_step, beta, c + i * ldc);
    } else {  // B is [k, n]: the block's columns of B, transposed, times a_row
      blas_gemv(true, k, cols, T(1), b, ldb, a_row, a_step, beta, c + i * ldc);
    }
  }
}

// BLAS requires a leading dimension of at least the row length (and 1), even of a matrix with
// one row, where it is never used: such a one gets the row length. Matrices of several rows must
// already have it (linear() copies rows that repeat or overlap).
int64_t leading_dim(int64_t ld, int64_t rows, int64_t row_length) {
  const int64_t least = std::max<int64_t>(row_length, 1);
  if (rows <= 1) return std::max(ld, least);
  if (ld < least) throw Error("internal error: gemm given a leading dimension of " + std::to_string(ld) +
                              " for rows of " + std::to_string(row_length));
  return ld;
}

// How C (m x n) is split into blocks: by the shape alone.
struct GemmBlocks {
  int64_t row_block, row_blocks, col_block, col_blocks;
  explicit GemmBlocks(int64_t m, int64_t n) {
    row_block = kGemmBlock, row_blocks = (m + row_block - 1) / row_block;
    const int64_t col_parts = std::clamp<int64_t>((kMinGemmBlocks + row_blocks - 1) / row_blocks, 1,
                                                  (n + kGemmBlock - 1) / kGemmBlock);
    col_block = (n + col_parts - 1) / col_parts, col_blocks = (n + col_block - 1) / col_block;
  }
};

// C += A B^T with A [m, k] and B [n, k] bfloat16 and C float32, in gemm's blocks, each one
// single-threaded oneDNN matmul (at most four block shapes, each primitive made once per call).
void bf16_gemm(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
               float* c, int64_t ldc, int threads) {
  if (m == 0 || n == 0) return;
  const GemmBlocks g(m, n);
  std::vector<MatmulBlock> shapes;  // [full rows, last rows] x [full columns, last columns]
  for (const int64_t rows : {g.row_block, m - (g.row_blocks - 1) * g.row_block})
    for (const int64_t cols : {g.col_block, n - (g.col_blocks - 1) * g.col_block})
      shapes.emplace_back(std::min(rows, m), std::min(cols, n), k, lda, ldb, ldc, MatmulOutput::accumulate_f32);
  parallel_for(g.row_blocks * g.col_blocks, threads, [&](int64_t block, int) {
    const int64_t bi = block / g.col_blocks, bj = block % g.col_blocks;
    const int64_t i0 = bi * g.row_block, j0 = bj * g.col_block;
    shapes[(bi + 1 == g.row_blocks ? 2 : 0) + (bj + 1 == g.col_blocks ? 1 : 0)].run(a + i0 * lda, b + j0 * ldb,
                                                                                  c + i0 * ldc + j0);
  });
}

// One product C = A B^T + bias: A [m, k], B [n, k], C [m, n], all bfloat16 (the float32 sum
// rounded once) or all float32, rows lda, ldb and ldc elements apart; bias n floats or null.
struct BiasedProduct {
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  const float* bias;
  void* c;
  int64_t ldc;
};

// The products (a call's projections), all of one kind (bf16_plus_bias or f32_plus_bias), in blocks of gemm's 256 rows and of at most kColumnPart
// columns (both fixed by the shapes), each one single-threaded oneDNN matmul, all in one
// pass of the threads. B is repacked for the tile kernel once per column part, not by every
// block: on 2 cores each block's own repacking of a 3072 x 1024 weight held the in-projection of
// an E = 1024 module to a third of the kernel's rate. Column parts keep a part's packed weight
// (2 MiB at 1024 x 1024) within L2 as the kernel streams it for every 32 rows of its block.
//
// Neighbouring tasks take different parts: two cores on blocks of one bfloat16 packed weight at
// once ran them at 0.7-0.85 ms against 0.42 on different weights (256 x 1024 x 1024 each), so a
// bfloat16 product alone in its call is cut into two parts from 512 columns. float32 blocks showed
// no such loss (3.1-3.3 ms on one weight, 3.2-3.5 on three), and there the cut's copy cost more
// than it saved (an E = 1024 out-projection, 2048 rows: about 12.8 ms whole against 12.3 in
// halves plus 1.5 copying): a float32 product is cut only where it has fewer than 4 row blocks
// (a rule of the shape, not of the thread count, so that the bits do not depend on it).
//
// Where a product has several parts, a block writes a dense buffer of its own that is then copied
// into C, as oneDNN 2.6 runs its AMX kernel only for a dense destination (on a column block of a
// wider C it falls back to a gemm at about two thirds of the rate).
constexpr int64_t kColumnPart = 1024;
void biased_gemm(const std::vector<BiasedProduct>& products, MatmulOutput kind, int threads) {
  const int64_t size = kind == MatmulOutput::bf16_plus_bias ? 2 : 4;  // bytes per element
  auto at = [size](const void* p, int64_t elements) { return static_cast<const char*>(p) + elements * size; };
  auto at_out = [size](void* p, int64_t elements) { return static_cast<char*>(p) + elements * size; };
  struct Part {
    const BiasedProduct* product;
    int64_t j0, cols, row_blocks, last_rows;
    bool direct;                          // C itself is the block's destination
    std::vector<MatmulBlock> shapes;  // full blocks, the last
    std::vector<Tensor> packed;
    bool one_packing;
  };
  struct Slice {
    const MatmulBlock* shape;
    const void* b;
    void* packed;
    int64_t index;
  };
  // (Made on this thread, and packed on it where oneDNN's reorder packs: oneDNN's primitive
  // creation from several threads at once trips ThreadSanitizer, which cannot see inside the
  // library's own locking.)
  std::vector<Part> parts;
  parts.reserve(products.size() * 4);
  std::vector<Slice> slices;  // the packings written by our own code, shared by the threads below
  int64_t most_row_blocks = 0;
  for (const BiasedProduct& product : products) {
    const int64_t m = product.m, n = product.n, k = product.k;
    if (m == 0 || n == 0) continue;
    const int64_t row_blocks = (m + kGemmBlock - 1) / kGemmBlock;
    const bool split_alone = products.size() == 1 && n >= 512 &&
                             (kind == MatmulOutput::bf16_plus_bias || row_blocks < 4);
    const int64_t count = std::max<int64_t>((n + kColumnPart - 1) / kColumnPart, split_alone ? 2 : 1);
    const int64_t part_cols = (n + count - 1) / count;
    most_row_blocks = std::max(most_row_blocks, row_blocks);
    for (int64_t j0 = 0; j0 < n; j0 += part_cols) {
      Part& part = parts.emplace_back();
      part.product = &product, part.j0 = j0, part.cols = std::min(part_cols, n - j0);
      part.row_blocks = row_blocks, part.last_rows = m - (row_blocks - 1) * kGemmBlock;
      part.direct = count == 1;
      const int64_t ld = part.direct ? product.ldc : part.cols;  // (a dense buffer of the block's own, below)
      for (const int64_t rows : {std::min(kGemmBlock, m), part.last_rows})
        part.shapes.emplace_back(rows, part.cols, k, product.lda, product.ldb, ld, kind);
      part.one_packing = part.shapes[0].same_packing(part.shapes[1]);
      const void* b = at(product.b, j0 * product.ldb);
      for (size_t p = 0; p < (part.one_packing ? 1u : 2u); ++p) {
        const MatmulBlock& shape = part.shapes[p];
        part.packed.push_back(Tensor::empty({static_cast<int64_t>((shape.packed_bytes() + 1) / 2)}, DType::bf16));
        void* packed = part.packed.back().view().data;
        if (shape.pack_slices() == 0) shape.pack(b, packed);
        for (int64_t i = 0; i < shape.pack_slices(); ++i) slices.push_back({&shape, b, packed, i});
      }
    }
  }
  // Packed by our code on all threads: a 1024 x 1024 weight took about 0.7 ms on one thread
  // through oneDNN's reorder, a sixth of an E = 1024 module's call in its four projections.
  parallel_for(static_cast<int64_t>(slices.size()), threads, [&](int64_t i, int) {
    const Slice& slice = slices[static_cast<size_t>(i)];
    slice.shape->pack_slice(slice.b, slice.packed, slice.index);
  });
  std::vector<std::pair<const Part*, int64_t>> tasks;  // (part, row block): each block across the parts in turn
  for (int64_t block = 0; block < most_row_blocks; ++block)
    for (const Part& part : parts)
      if (block < part.row_blocks) tasks.emplace_back(&part, block);
  parallel_for(static_cast<int64_t>(tasks.size()), threads, [&](int64_t t, int) {
    const Part& part = *tasks[static_cast<size_t>(t)].first;
    const BiasedProduct& product = *part.product;
    const int64_t block = tasks[static_cast<size_t>(t)].second;
    const bool last = block + 1 == part.row_blocks;
    const Tensor& weights = part.packed[last && !part.one_packing ? 1 : 0];
    const int64_t i0 = block * kGemmBlock, rows = last ? part.last_rows : kGemmBlock;
    const void* a = at(product.a, i0 * product.lda);
    const float* bias = product.bias ? product.bias + part.j0 : nullptr;
    if (part.direct) {
      part.shapes[last ? 1 : 0].run(a, weights.view().data, at_out(product.c, i0 * product.ldc), bias);
      return;
    }
    void* dense = thread_scratch(static_cast<size_t>(rows * part.cols * size));
    part.shapes[last ? 1 : 0].run(a, weights.view().data, dense, bias);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(at_out(product.c, (i0 + r) * product.ldc + part.j0), at(dense, r * part.cols),
                  static_cast<size_t>(part.cols * size));
  });
}

// dst (bfloat16) = x (float32, [N, L, C]) if every value of x is a bfloat16, whose low 16 bits
// are zero; false otherwise (dst then holds part of the rows).
bool narrow_exactly(const TensorView& x, const TensorView& dst, int threads) {
  const int64_t N = x.shape[0], L = x.shape[1], C = x.shape[2];
  std::atomic<bool> exact{true};
  constexpr int64_t kRowsPerTask = 64;
  parallel_for((N * L + kRowsPerTask - 1) / kRowsPerTask, threads, [&](int64_t task, int) {
    uint32_t low = 0;
    for (int64_t r = task * kRowsPerTask; r < std::min(N * L, (task + 1) * kRowsPerTask) && low == 0; ++r) {
      const int64_t n = r / L, l = r % L;
      const auto* src = reinterpret_cast<const uint32_t*>(x.data_as<float>() + n * x.strides[0] + l * x.strides[1]);
      uint16_t* row = static_cast<uint16_t*>(dst.data) + n * dst.strides[0] + l * dst.strides[1];
      for (int64_t c = 0; c < C; ++c) {
        const uint32_t bits = src[c * x.strides[2]];
        low |= bits & 0xffffu;
        row[c] = static_cast<uint16_t>(bits >> 16);
      }
    }
    if (low != 0) exact.store(false, std::memory_order_relaxed);
  });
  return exact.load();
}

}  // namespace

namespace {

// beta's type: T's, float for bfloat16.
template <typename T>
using Scalar = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;

template <typename T>
void gemm_blocks(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda,
                 const T* b, int64_t ldb, Scalar<T> beta, T* c, int64_t ldc, int threads) {
  constexpr bool bf16 = std::is_same_v<T, bfloat16>;
  if (m == 0 || n == 0) return;
  if constexpr (!bf16) openblas_set_num_threads(1);  // the blocks below are the parallelism
  const GemmBlocks g(m, n);
  const int64_t row_block = g.row_block, row_blocks = g.row_blocks, col_block = g.col_block, col_blocks = g.col_blocks;
  lda = leading_dim(lda, transpose_a ? k : m, transpose_a ? m : k);
  ldb = leading_dim(ldb, transpose_b ? n : k, transpose_b ? k : n);
  ldc = leading_dim(ldc, m, n);
  // bfloat16 blocks, and float32 blocks of more rows than a gemv's where it is available, run
  // oneDNN's matmul (onednn_matmul.hpp): [full rows, last rows] x [full columns, last columns],
  // made here, on one thread (see biased_gemm).
  std::vector<MatmulBlock> shapes;
  if constexpr (bf16) {
    if (!bf16_matmul_available()) throw Error("internal error: a bfloat16 gemm where the CPU has no bf16 matmul");
    if (beta != 0.0f) throw Error("internal error: a bfloat16 gemm accumulates into nothing");
  }
  if (k > 0 && (bf16 || (std::is_same_v<T, float> && m > kGemvRows && f32_matmul_available()))) {
    for (const int64_t rows : {row_block, m - (row_blocks - 1) * row_block})
      for (const int64_t cols : {col_block, n - (col_blocks - 1) * col_block})
        shapes.emplace_back(std::min(rows, m), std::min(cols, n), k, transpose_a, lda, transpose_b, ldb, ldc,
                            static_cast<float>(beta), bf16);
  }
  parallel_for(row_blocks * col_blocks, threads, [&](int64_t block, int) {
    const int64_t bi = block / col_blocks, bj = block % col_blocks;
    const int64_t i0 = bi * row_block, j0 = bj * col_block;
    const int64_t rows = std::min(row_block, m - i0), cols = std::min(col_block, n - j0);
    const T* a_block = transpose_a ? a + i0 : a + i0 * lda;
    const T* b_block = transpose_b ? b + j0 * ldb : b + j0;
    if (!shapes.empty()) {
      shapes[(bi + 1 == row_blocks ? 2 : 0) + (bj + 1 == col_blocks ? 1 : 0)].run(a_block, b_block, c + i0 * ldc + j0);
      return;
    }
    if constexpr (bf16) {  // k = 0: C = 0 (beta is 0)
      for (int64_t r = 0; r < rows; ++r) std::fill_n(c + (i0 + r) * ldc + j0, cols, T());
    } else {
      if (m <= kGemvRows && k > 0) {  // (k = 0 goes to gemm, which scales C by beta where gemv returns)
        gemv_rows(transpose_a, transpose_b, rows, cols, k, a_block, lda, b_block, ldb, beta, c + i0 * ldc + j0, ldc);
        return;
      }
      blas_gemm(transpose_a, transpose_b, rows, cols, k, a_block, lda, b_block, ldb, beta, c + i0 * ldc + j0, ldc);
    }
  });
}

}  // namespace

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc, int threads) {
  gemm_blocks(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc, threads);
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc, int threads) {
  gemm_blocks(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc, threads);
}

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const bfloat16* a, int64_t lda,
          const bfloat16* b, int64_t ldb, float beta, bfloat16* c, int64_t ldc, int threads) {
  gemm_blocks(transpose_a, transpose_b, m, n, k, a, lda, b, ldb, beta, c, ldc, threads);
}

RowBuffer rows_like(const TensorView& like, int64_t rows, int64_t cols, DType dtype) {
  RowBuffer b;
  const int64_t N = like.shape[0];
  const bool seq_major = N > 1 && like.strides[0] < like.strides[1];
  if (seq_major) {
    b.storage = Tensor::empty({rows, N, cols}, dtype);
    b.view = b.storage.view().transpose(0, 1);
  } else {
    b.storage = Tensor::empty({N, rows, cols}, dtype);
    b.view = b.storage.view();
  }
  return b;
}

namespace {

// y's rows set to the bias (or zero), over the pool (the in-projection's rows are tens of MiB at
// E = 1024); the GEMM then adds x W^T (beta = 1).
template <typename T>
void fill_with_bias(const TensorView& y, const T* bias, int threads) {
  const int64_t N = y.shape[0], L = y.shape[1], out = y.shape[2];
  constexpr int64_t kRowsPerTask = 64;
  parallel_for((N * L + kRowsPerTask - 1) / kRowsPerTask, threads, [&](int64_t task, int) {
    for (int64_t r = task * kRowsPerTask; r < std::min(N * L, (task + 1) * kRowsPerTask); ++r) {
      T* row = y.data_as<T>() + r / L * y.strides[0] + r % L * y.strides[1];
      if (bias) std::memcpy(row, bias, sizeof(T) * out);
      else std::memset(row, 0, sizeof(T) * out);
    }
  });
}

// BLAS reads rows of unit-stride features, a fixed leading dimension apart, and that dimension
// must be at least the row length: all N * L rows at one stride when x and y order them alike
// (then the leading dimensions are set), else the L rows of each batch entry at strides[1]. Rows
// that repeat (a stride of 0, as from expand()) or overlap fit neither, and are copied first.
bool one_call(const TensorView& x, const TensorView& y, int64_t* ldx, int64_t* ldy) {
  const RowOrder oy = row_order(y, ldy);
  return row_order(x, ldx) == oy && oy != RowOrder::neither && (x.shape[0] * x.shape[1] == 1 || *ldx >= x.shape[2]);
}
bool per_entry(const TensorView& x) { return x.shape[1] == 1 || x.strides[1] >= x.shape[2]; }

// The projections through biased_gemm, as one pass of the threads: each one product when x and
// y order their rows alike, one per batch entry otherwise (on a contiguous copy of x where
// neither does). x, w and y all bfloat16 (bf16_plus_bias) or all float32 (f32_plus_bias).
void biased_linears(const std::vector<Projection>& projections, MatmulOutput kind, int threads) {
  const DType dtype = kind == MatmulOutput::bf16_plus_bias ? DType::bf16 : DType::f32;
  const int64_t size = dtype_size(dtype);
  std::vector<Tensor> contiguous;
  std::vector<BiasedProduct> products;
  for (const Projection& l : projections) {
    const TensorView &w = l.w, &y = l.y;
    const int64_t N = l.x.shape[0], L = l.x.shape[1], out = w.shape[0], in = w.shape[1];
    if (N == 0 || L == 0 || out == 0) continue;
    if (l.x.dtype != dtype || w.dtype != dtype || y.dtype != dtype || (w.strides[1] != 1 && in > 1) ||
        (y.strides[2] != 1 && out > 1)) {
      throw Error("internal error: a " + std::string(dtype_name(dtype)) + " projection given " +
                  std::string(dtype_name(l.x.dtype)) + " x, " + std::string(dtype_name(w.dtype)) + " w, " +
                  std::string(dtype_name(y.dtype)) + " y");
    }
    int64_t ldx = 0, ldy = 0;
    TensorView x = l.x;
    if ((x.strides[2] != 1 && in > 1) || (!one_call(x, y, &ldx, &ldy) && !per_entry(x))) {
      contiguous.push_back(Tensor::copy_of(x));
      x = contiguous.back().view();
    }
    if (one_call(x, y, &ldx, &ldy)) {
      products.push_back({N * L, out, in, x.data, ldx, w.data, w.strides[0], l.bias, y.data, ldy});
      continue;
    }
    for (int64_t n = 0; n < N; ++n)
      products.push_back({L, out, in, static_cast<const char*>(x.data) + n * x.strides[0] * size, x.strides[1], w.data,
                          w.strides[0], l.bias, static_cast<char*>(y.data) + n * y.strides[0] * size, y.strides[1]});
  }
  biased_gemm(products, kind, threads);
}


// y += x W^T with x, w and y all of T (w contiguous rows), through gemm: one call when the rows
// allow, one per batch entry otherwise, on a contiguous copy of x where neither does.
template <typename T>
void blas_linear(const TensorView& x_in, const TensorView& w, const TensorView& y, int threads) {
  const int64_t N = x_in.shape[0], L = x_in.shape[1], out = w.shape[0], in = w.shape[1];
  int64_t ldx = 0, ldy = 0;
  Tensor contiguous;
  TensorView x = x_in;
  if ((x.strides[2] != 1 && in > 1) || (!one_call(x, y, &ldx, &ldy) && !per_entry(x))) {
    contiguous = Tensor::copy_of(x, dtype_of<T>());
    x = contiguous.view();
  }
  if (one_call(x, y, &ldx, &ldy)) {
    gemm(false, true, N * L, out, in, x.data_as<T>(), ldx, w.data_as<T>(), w.strides[0], T(1), y.data_as<T>(), ldy,
         threads);
    return;
  }
  for (int64_t n = 0; n < N; ++n) {
    gemm(false, true, L, out, in, x.data_as<T>() + n * x.strides[0], x.strides[1], w.data_as<T>(), w.strides[0], T(1),
         y.data_as<T>() + n * y.strides[0], y.strides[1], threads);
  }
}

}  // namespace

void linear(const TensorView& x_in, const TensorView& w_in, const float* bias, const TensorView& y, int threads) {
  const int64_t N = x_in.shape[0], L = x_in.shape[1], out = w_in.shape[0], in = w_in.shape[1];
  if (N == 0 || L == 0 || out == 0) return;  // no rows (their buffers may have no storage at all)
  // Up to kFewRows16 rows against a bfloat16/float16 weight read it as it is (few_rows_gemm);
  // more rows widen it once and go through sgemm.
  const bool few_rows = w_in.dtype != DType::f32 && N * L <= kFewRows16 && in > 0;
  // More rows against a bfloat16 weight, where the CPU has bf16 dot products and every value of x
  // is a bfloat16 (the bf16 module's widened inputs; not its attention output): x narrowed, which
  // is exact, and oneDNN's bf16 matmul on the weight as it is. The products are exact and summed
  // in float32, as sgemm sums them on widened copies, in another order.
  RowBuffer narrowed;
  bool bf16_rows = w_in.dtype == DType::bf16 && x_in.dtype == DType::f32 && !few_rows && in > 0 && bf16_matmul_available();
  if (bf16_rows) {
    narrowed = rows_like(y, L, in, DType::bf16);  // rows in y's order: the product is one call
    bf16_rows = narrow_exactly(x_in, narrowed.view, threads);
  }
  Tensor widened;
  TensorView w = w_in;
  if (w.dtype != DType::f32 && !few_rows && !bf16_rows) {
    widened = parallel_copy_of(w, DType::f32, threads);
    w = widened.view();
  }
  if (!few_rows && !bf16_rows && N * L >= kOneDnnF32Rows && in > 0 && f32_matmul_available()) {
    biased_linears({Projection{x_in, w, bias, y}}, MatmulOutput::f32_plus_bias, threads);
    return;
  }
  fill_with_bias(y, bias, threads);
  if (few_rows) {
    Tensor contiguous;
    TensorView x = x_in;
    if (x.strides[2] != 1 && in > 1) {
      contiguous = Tensor::copy_of(x, DType::f32);
      x = contiguous.view();
    }
    std::vector<const float*> x_rows(static_cast<size_t>(N * L));
    std::vector<float*> y_rows(static_cast<size_t>(N * L));
    for (int64_t r = 0; r < N * L; ++r) {
      x_rows[r] = x.data_as<float>() + r / L * x.strides[0] + r % L * x.strides[1];
      y_rows[r] = y.data_as<float>() + r / L * y.strides[0] + r % L * y.strides[1];
    }
    FewRowsGemm g;
    g.rows = N * L;
    g.x = x_rows.data();
    g.y = y_rows.data();
    g.w = static_cast<const uint16_t*>(w.data);
    g.w_row_stride = w.strides[0];
    g.w_dtype = w.dtype;
    g.k = in;
    const Isa isa = active_isa();
    parallel_for((out + kFewRowsColumns - 1) / kFewRowsColumns, threads, [&](int64_t block, int) {
      few_rows_gemm(isa, g, block * kFewRowsColumns, std::min(out, (block + 1) * kFewRowsColumns));
    });
    return;
  }
  if (bf16_rows) {
    const TensorView& x = narrowed.view;
    const auto* xb = static_cast<const uint16_t*>(x.data);
    const auto* wb = static_cast<const uint16_t*>(w.data);
    int64_t ldx = 0, ldy = 0;
    if (one_call(x, y, &ldx, &ldy)) {
      bf16_gemm(N * L, out, in, xb, ldx, wb, w.strides[0], y.data_as<float>(), ldy, threads);
    } else {
      for (int64_t n = 0; n < N; ++n)
        bf16_gemm(L, out, in, xb + n * x.strides[0], x.strides[1], wb, w.strides[0],
                  y.data_as<float>() + n * y.strides[0], y.strides[1], threads);
    }
    return;
  }
  blas_linear<float>(x_in, w, y, threads);
}

void linear_bf16(const std::vector<Projection>& projections, int threads) {
  biased_linears(projections, MatmulOutput::bf16_plus_bias, threads);
}

void linear_bf16(const TensorView& x, const TensorView& w, const float* bias, const TensorView& y, int threads) {
  linear_bf16({Projection{x, w, bias, y}}, threads);
}

void linear(const std::vector<Projection>& projections, int threads) {
  bool joint = f32_matmul_available();
  for (const Projection& l : projections)
    joint = joint && l.x.dtype == DType::f32 && l.w.dtype == DType::f32 && l.y.dtype == DType::f32 &&
            l.x.shape[0] * l.x.shape[1] >= kOneDnnF32Rows && l.w.shape[1] > 0;
  if (joint) {
    biased_linears(projections, MatmulOutput::f32_plus_bias, threads);
    return;
  }
  for (const Projection& l : projections) linear(l.x, l.w, l.bias, l.y, threads);
}

void linear(const TensorView& x, const TensorView& w, const double* bias, const TensorView& y, int threads) {
  const int64_t N = x.shape[0], L = x.shape[1], out = w.shape[0];
  if (N == 0 || L == 0 || out == 0) return;  // no rows (their buffers may have no storage at all)
  if (x.dtype != DType::f64 || w.dtype != DType::f64 || y.dtype != DType::f64) {
    throw Error("internal error: the float64 linear given " + std::string(dtype_name(x.dtype)) + " x, " +
                std::string(dtype_name(w.dtype)) + " w, " + std::string(dtype_name(y.dtype)) + " y");
  }
  fill_with_bias(y, bias, threads);
  blas_linear<double>(x, w, y, threads);
}

}  // namespace mha::detail
