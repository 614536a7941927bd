#include "cpu/attention_f64.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/dropout.hpp"
#include "core/thread_pool.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/vector_exp_f64.hpp"

namespace mha::detail {
namespace {

constexpr int64_t kBlockRows = 32;  // queries per task: scores of 32 x Lk doubles per buffer
constexpr double kInf = std::numeric_limits<double>::infinity();

// Whether BLAS can read the rows of t ([B, H, L, D] view) in place: unit stride along D and a row
// stride of at least D (BLAS's leading dimension).
bool blas_rows(const TensorView& t) {
  return (t.shape[3] <= 1 || t.strides[3] == 1) && (t.shape[2] <= 1 || t.strides[2] >= std::max<int64_t>(t.shape[3], 1));
}

// The leading dimension BLAS is given for t's rows (at least 1 and D, as BLAS checks, where the
// stride itself does not matter: one row, or D = 0).
int64_t leading(const TensorView& t) {
  const int64_t least = std::max<int64_t>(t.shape[3], 1);
  return t.shape[2] <= 1 ? least : std::max(t.strides[2], least);
}

// A float64 view of data with strides, as BLAS reads it (a contiguous copy in `storage` where the
// strides do not allow).
TensorView blas_view(const TensorView& t, Tensor& storage) {
  if (blas_rows(t)) return t;
  storage = Tensor::copy_of(t);
  return storage.view();
}

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // an empty sum: C = beta C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0.0 : beta * c[i * ldc + j];
    return;
  }
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

// A row's scores [0, end) replaced by exp(s - max) in place; its max and the sum of those. A row
// that sees no key (max = -inf) gets zeros: exp(-inf - 0).
struct RowSums {
  double max, sum;
};
RowSums exponentiate(double* row, int64_t end) {
  double max = -kInf;
  for (int64_t j = 0; j < end; ++j) max = std::max(max, row[j]);
  const double shift = max == -kInf ? 0.0 : max;
  for (int64_t j = 0; j < end; ++j) row[j] -= shift;
  vector_exp_f64(active_isa(), row, end);  // the largest term is exactly 1
  double sum = 0;
  for (int64_t j = 0; j < end; ++j) sum += row[j];
  return {max, sum};
}

const double* rows_of(const TensorView& t, int64_t b, int64_t h, int64_t i0) {
  return t.data_as<const double>() + b * t.strides[0] + h * t.strides[1] + i0 * t.strides[2];
}

// The inputs as BLAS reads them, and the rules every task applies to a row of scores.
struct Float64Problem {
  const AttentionProblem& p;
  TensorView q, k, v;
  Tensor storage[3];

  explicit Float64Problem(const AttentionProblem& problem) : p(problem) {
    q = blas_view(p.q, storage[0]);
    k = blas_view(p.k, storage[1]);
    v = blas_view(p.v, storage[2]);
  }

  // Scores of query rows [i0, i0 + rows) against keys [0, end) of (b, h): scale q k^T, into s
  // (rows x ld).
  void scores(int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t end, double* s, int64_t ld) const {
    const int64_t hk = h / p.group();
    gemm(false, true, rows, end, p.dim_qk, p.scale, rows_of(q, b, h, i0), leading(q), rows_of(k, b, hk, 0), leading(k),
         0.0, s, ld);
  }

  // Logit soft-capping of the scores of `rows` rows [0, end): s = c tanh(s / c) in place, and where
  // `slope` is not null the derivative 1 - tanh^2(s / c) of each (the backward's chain rule).
  void cap_scores(int64_t rows, int64_t end, double* s, int64_t ld, double* slope = nullptr) const {
    if (p.softcap <= 0) return;
    const double c = p.softcap;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < end; ++j) {
        const double t = std::tanh(s[r * ld + j] / c);
        s[r * ld + j] = c * t;
        if (slope) slope[r * ld + j] = 1 - t * t;
      }
  }

  // Row i's scores [0, end) with the masks added and the keys past its causal limit at -inf.
  void mask_row(int64_t b, int64_t h, int64_t i, int64_t end, double* s) const {
    const int64_t visible = std::min(p.causal_end(i), end);
    for (int t = 0; t < p.num_masks; ++t)
      for (int64_t j = 0; j < visible; ++j) s[j] += p.masks[t].bias_f64(b, h, i, j);
    for (int64_t j = visible; j < end; ++j) s[j] = -kInf;
  }

  // The dropout factor of each key of row i: 1 / (1 - p) where kept, 0 where dropped.
  void dropout_row(int64_t b, int64_t h, int64_t i, int64_t end, double* z) const {
    const DropoutRowKey key = dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
    const uint32_t threshold = dropout_threshold(p.dropout_p);
    const double keep = p.dropout_p < 1 ? 1.0 / (1.0 - p.dropout_p) : 0.0;
    for (int64_t j = 0; j < end; ++j)
      z[j] = p.dropout_p < 1 && dropout_bits(key, static_cast<uint32_t>(j)) >= threshold ? keep : 0.0;
  }
};

}  // namespace

void attention_forward_f64(const AttentionProblem& p, const Float64Outputs& o) {
  const Float64Problem f(p);
  const int64_t blocks = (p.len_q + kBlockRows - 1) / kBlockRows;
  openblas_set_num_threads(1);  // the tasks are the parallelism
  parallel_for(p.batch * p.heads_q * blocks, resolve_threads(p.num_threads), [&](int64_t task, int) {
    const int64_t b = task / (p.heads_q * blocks), h = task / blocks % p.heads_q, i0 = task % blocks * kBlockRows;
    const int64_t rows = std::min(kBlockRows, p.len_q - i0), hk = h / p.group();
    const int64_t end = p.causal_end(i0 + rows - 1);  // keys any row of the block sees
    const int64_t ld = std::max<int64_t>(end, 1);
    std::vector<double> s(static_cast<size_t>(rows * ld)), z(static_cast<size_t>(ld)),
        out(static_cast<size_t>(rows * std::max<int64_t>(p.dim_v, 1)));
    f.scores(b, h, i0, rows, end, s.data(), ld);
    f.cap_scores(rows, end, s.data(), ld);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      double* row = s.data() + r * ld;
      f.mask_row(b, h, i, end, row);
      const RowSums e = exponentiate(row, end);
      // A row with no visible key: zeros, and lse = +inf (exp(score - lse) = 0 for every key).
      if (o.lse) o.lse[(b * p.heads_q + h) * p.len_q + i] = e.sum > 0 ? e.max + std::log(e.sum) : kInf;
      const double inv = e.sum > 0 ? 1.0 / e.sum : 0.0;
      if (p.dropout_p > 0) f.dropout_row(b, h, i, end, z.data());
      for (int64_t j = 0; j < end; ++j) row[j] = p.dropout_p > 0 ? row[j] * inv * z[j] : row[j] * inv;
      if (o.weights) {
        double* w = o.weights + b * o.weights_strides[0] + h * o.weights_strides[1] + i * o.weights_strides[2];
        for (int64_t j = 0; j < p.len_k; ++j) w[j * o.weights_strides[3]] = j < end ? row[j] : 0.0;
      }
    }
    const int64_t ldo = std::max<int64_t>(p.dim_v, 1);
    gemm(false, false, rows, p.dim_v, end, 1.0, s.data(), ld, rows_of(f.v, b, hk, 0), leading(f.v), 0.0, out.data(), ldo);
    for (int64_t r = 0; r < rows; ++r) {
      double* dst = o.out + b * o.out_strides[0] + h * o.out_strides[1] + (i0 + r) * o.out_strides[2];
      for (int64_t d = 0; d < p.dim_v; ++d) dst[d * o.out_strides[3]] = end > 0 ? out[r * ldo + d] : 0.0;
    }
  });
}

void attention_backward_f64(const AttentionProblem& p, const Float64Backward& g) {
  const Float64Problem f(p);
  // The output's gradient, as BLAS reads it (the saved output is read element by element).
  const TensorView grad_view(g.grad_out, {p.batch, p.heads_q, p.len_q, p.dim_v},
                             {g.grad_out_strides[0], g.grad_out_strides[1], g.grad_out_strides[2], g.grad_out_strides[3]});
  Tensor grad_storage;
  const TensorView dout = blas_view(grad_view, grad_storage);
  const int64_t group = p.group();
  openblas_set_num_threads(1);
  // One task per (batch, key/value head): it owns that head's dK and dV, summed over its query
  // heads and query blocks.
  parallel_for(p.batch * p.heads_kv, resolve_threads(p.num_threads), [&](int64_t task, int) {
    const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
    const int64_t lk = p.len_k, dk = p.dim_qk, dv = p.dim_v, ld = std::max<int64_t>(lk, 1);
    const int64_t ldk = std::max<int64_t>(dk, 1), ldv = std::max<int64_t>(dv, 1);
    std::vector<double> s(static_cast<size_t>(kBlockRows * ld)), dp(s.size()), z(static_cast<size_t>(ld)),
        slope(p.softcap > 0 ? s.size() : 0),
        dq(static_cast<size_t>(kBlockRows * ldk)), dk_sum(static_cast<size_t>(lk * ldk)), dv_sum(static_cast<size_t>(lk * ldv));
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      for (int64_t i0 = 0; i0 < p.len_q; i0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, p.len_q - i0), end = p.causal_end(i0 + rows - 1);
        if (end == 0) {  // no row of the block sees a key: zero gradients
          if (g.dq)
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t d = 0; d < dk; ++d)
                g.dq[b * g.dq_strides[0] + h * g.dq_strides[1] + (i0 + r) * g.dq_strides[2] + d * g.dq_strides[3]] = 0.0;
          if (g.dscores)
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t j = 0; j < lk; ++j)
                g.dscores[b * g.dscores_strides[0] + h * g.dscores_strides[1] + (i0 + r) * g.dscores_strides[2] +
                          j * g.dscores_strides[3]] = 0.0;
          continue;
        }
        // P = exp(s - lse), dP = dO V^T (with the dropout factor), dS = P (dP - D), D = rowsum(dO O).
        f.scores(b, h, i0, rows, end, s.data(), ld);
        f.cap_scores(rows, end, s.data(), ld, slope.data());
        const double* dout_rows = rows_of(dout, b, h, i0);
        gemm(false, true, rows, end, dv, 1.0, dout_rows, leading(dout), rows_of(f.v, b, hk, 0), leading(f.v), 0.0,
             dp.data(), ld);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          double* sr = s.data() + r * ld;
          double* dpr = dp.data() + r * ld;
          f.mask_row(b, h, i, end, sr);
          double delta = 0;
          for (int64_t d = 0; d < dv; ++d) {
            const int64_t at = b * g.out_strides[0] + h * g.out_strides[1] + i * g.out_strides[2] + d * g.out_strides[3];
            const int64_t gat = b * g.grad_out_strides[0] + h * g.grad_out_strides[1] + i * g.grad_out_strides[2] +
                                d * g.grad_out_strides[3];
            delta += g.grad_out[gat] * g.out[at];
          }
          if (p.dropout_p > 0) f.dropout_row(b, h, i, end, z.data());
          // P as the forward formed it, from the row's own max and sum: not exp(s - lse), which is 1
          // per key, not 1 / n, for a row whose every score is one huge mask value (-3.4e38 + log n
          // rounds to -3.4e38 in float64 too).
          // A sink adds exp(sink - max) to the sum (overflowing to a share of 0 where it dwarfs them).
          const RowSums e = exponentiate(sr, end);
          const double sum = e.sum + (p.sinks && e.max != -kInf ? std::exp(p.sink(h) - e.max) : 0.0);
          const double inv = sum > 0 ? 1.0 / sum : 0.0;
          // A gradient of the returned weights W = Z P joins dP (as Z dW) and D (as rowsum(W dW)).
          const double* gw = nullptr;
          if (g.grad_weights) {
            gw = g.grad_weights + b * g.grad_weights_strides[0] + h * g.grad_weights_strides[1] +
                 i * g.grad_weights_strides[2];
            for (int64_t j = 0; j < end; ++j) {
              const double extra = g.grad_weights_scale * gw[j * g.grad_weights_strides[3]];
              dpr[j] += extra;
              delta += sr[j] * inv * (p.dropout_p > 0 ? z[j] : 1.0) * extra;
            }
          }
          for (int64_t j = 0; j < end; ++j) {
            const double prob = sr[j] * inv;
            const double zj = p.dropout_p > 0 ? z[j] : 1.0;
            const double ds = prob * (dpr[j] * zj - delta);
            sr[j] = ds;             // dS, for dQ and dK
            dpr[j] = prob * zj;     // the weights after dropout, for dV
          }
          if (g.dscores) {
            double* dst = g.dscores + b * g.dscores_strides[0] + h * g.dscores_strides[1] + i * g.dscores_strides[2];
            for (int64_t j = 0; j < lk; ++j) dst[j * g.dscores_strides[3]] = j < end ? sr[j] : 0.0;
          }
          // q.k's share of dS passes through the cap (the masks' share, above, does not).
          if (p.softcap > 0)
            for (int64_t j = 0; j < end; ++j) sr[j] *= slope[r * ld + j];
        }
        const double* q_rows = rows_of(f.q, b, h, i0);
        if (g.dq) {
          gemm(false, false, rows, dk, end, p.scale, s.data(), ld, rows_of(f.k, b, hk, 0), leading(f.k), 0.0, dq.data(), ldk);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t d = 0; d < dk; ++d)
              g.dq[b * g.dq_strides[0] + h * g.dq_strides[1] + (i0 + r) * g.dq_strides[2] + d * g.dq_strides[3]] =
                  dq[r * ldk + d];
        }
        if (g.dk) gemm(true, false, end, dk, rows, p.scale, s.data(), ld, q_rows, leading(f.q), 1.0, dk_sum.data(), ldk);
        if (g.dv) gemm(true, false, end, dv, rows, 1.0, dp.data(), ld, dout_rows, leading(dout), 1.0, dv_sum.data(), ldv);
      }
    }
    for (int64_t j = 0; j < lk; ++j) {
      if (g.dk)
        for (int64_t d = 0; d < dk; ++d)
          g.dk[b * g.dk_strides[0] + hk * g.dk_strides[1] + j * g.dk_strides[2] + d * g.dk_strides[3]] = dk_sum[j * ldk + d];
      if (g.dv)
        for (int64_t d = 0; d < dv; ++d)
          g.dv[b * g.dv_strides[0] + hk * g.dv_strides[1] + j * g.dv_strides[2] + d * g.dv_strides[3]] = dv_sum[j * ldv + d];
    }
  });
}

}  // namespace mha::detail
