// The float64 reference. Each step is the seed formula written out with plain loops:
//   scores = cap(q k^T * scale) + masks;  weights = softmax(scores);  weights = dropout(weights);
//   out = weights v
// (cap: softcap * tanh(s / softcap) with soft-capping, s without.)
// No tiling, no online softmax, no tricks: it exists to be obviously right.
#include "mha/reference.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/batch_dims.hpp"
#include "core/dropout.hpp"
#include "module/module_call.hpp"

namespace mha::reference {
namespace {

using detail::AttentionProblem;

double element(const TensorView& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  const int64_t off = a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3];
  switch (t.dtype) {
    case DType::f32: return t.data_as<float>()[off];
    case DType::f64: return t.data_as<double>()[off];
    case DType::bf16: return static_cast<float>(t.data_as<bfloat16>()[off]);
    case DType::f16: return static_cast<float>(t.data_as<float16>()[off]);
    case DType::f8e4m3: return static_cast<float>(t.data_as<float8_e4m3>()[off]);
    case DType::f8e5m2: return static_cast<float>(t.data_as<float8_e5m2>()[off]);
    case DType::boolean: break;
  }
  throw Error("reference: unexpected dtype");
}

// The scaled score q.k * scale, soft-capped (softcap * tanh(s / softcap)) where asked.
double capped(const AttentionProblem& p, double s) { return p.softcap > 0 ? p.softcap * std::tanh(s / p.softcap) : s; }

// ALiBi from its definition (not from the kernels' term): -slope |i + diagonal - j|.
double alibi_bias(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, int64_t j) {
  return -p.alibi_slope(b, h) * std::abs(static_cast<double>(i + p.alibi_diagonal - j));
}

// out: [B, Hq, Lq, Dv] and weights: [B, Hq, Lq, Lk], both contiguous float64.
void attention(const AttentionProblem& p, double* out, double* weights) {
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> scores(static_cast<size_t>(p.len_k));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t hk = h / p.group();  // the key/value head this query head reads
      // float8 keys and values are k * k_descale and v * v_descale (1 without them)
      const double kd = p.key_descale(b, hk), vd = p.value_descale(b, hk);
      for (int64_t i = 0; i < p.len_q; ++i) {
        // scores = q k^T * scale + masks, with keys outside causality or the window at -inf
        for (int64_t j = 0; j < p.len_k; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < p.dim_qk; ++d) dot += element(p.q, b, h, i, d) * (element(p.k, b, hk, j, d) * kd);
          double s = capped(p, dot * p.scale);
          for (int m = 0; m < p.num_masks; ++m) s += m == p.alibi_term ? alibi_bias(p, b, h, i, j) : p.masks[m].bias_f64(b, h, i, j);
          if (!p.visible(i, j)) s = neg_inf;
          scores[j] = s;
        }
        // softmax; a row with no visible key gets all-zero weights (documented in sdpa.hpp). A
        // sink is one more score in the denominator, of no value.
        double max = p.sinks ? p.sink(h) : neg_inf;
        for (double s : scores) max = std::max(max, s);
        double sum = p.sinks ? std::exp(p.sink(h) - max) : 0.0;
        for (double& s : scores) {
          s = max == neg_inf ? 0.0 : std::exp(s - max);
          sum += s;
        }
        double* w = weights + ((b * p.heads_q + h) * p.len_q + i) * p.len_k;
        for (int64_t j = 0; j < p.len_k; ++j) w[j] = sum > 0 ? scores[j] / sum : 0.0;
        // dropout on the weights, rescaled by 1/(1-p)
        if (p.dropout_p > 0) {
          const auto key = detail::dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
          const uint32_t threshold = detail::dropout_threshold(p.dropout_p);
          for (int64_t j = 0; j < p.len_k; ++j) {
            const bool keep = p.dropout_p < 1 && detail::dropout_bits(key, static_cast<uint32_t>(j)) >= threshold;
            w[j] = keep ? w[j] / (1.0 - p.dropout_p) : 0.0;
          }
        }
        // out = weights v
        double* o = out + ((b * p.heads_q + h) * p.len_q + i) * p.dim_v;
        for (int64_t d = 0; d < p.dim_v; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < p.len_k; ++j) acc += w[j] * (element(p.v, b, hk, j, d) * vd);
          o[d] = acc;
        }
      }
    }
  }
}

// y[n, l, :] = x[n, l, :] W^T + bias, in float64; or, as a `magnitude`, |x[n, l, :]| |W|^T + |bias|:
// the size of the terms each output sums.
Tensor linear(const TensorView& x, const TensorView& w, const Tensor* bias, bool magnitude = false) {
  const int64_t N = x.shape[0], L = x.shape[1], in = x.shape[2], outf = w.shape[0];
  Tensor y = Tensor::empty({N, L, outf}, DType::f64);
  double* py = y.data<double>();
  auto term = [&](double t) { return magnitude ? std::abs(t) : t; };
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t o = 0; o < outf; ++o) {
        double acc = bias ? term(bias->at({o})) : 0.0;
        for (int64_t c = 0; c < in; ++c) acc += term(x.at({n, l, c}) * w.at({o, c}));
        py[(n * L + l) * outf + o] = acc;
      }
  return y;
}

}  // namespace

Result scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const SdpaOptions& options) {
  require_cpu(q, "query");
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::any_float);
  detail::materialise_inputs(p);
  Result r;
  r.output = Tensor::empty(detail::output_shape(p, p.len_q, p.dim_v), DType::f64);  // [B, Hq, Lq, Dv] in memory
  r.weights = Tensor::empty(detail::output_shape(p, p.len_q, p.len_k), DType::f64);
  attention(p, r.output.data<double>(), r.weights.data<double>());
  return r;
}

Gradients scaled_dot_product_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                                const TensorView& grad_output, const SdpaOptions& options) {
  require_cpu(q, "query");
  if (options.k_descale || options.v_descale) {
    throw Error(std::string(options.k_descale ? "k_descale" : "v_descale") +
                ": float8 keys and values with scales are for inference; the reference's backward takes no scales");
  }
  AttentionProblem p = detail::make_sdpa_problem(q, k, v, options, detail::InputDtypes::any_float);
  detail::materialise_inputs(p);
  Tensor grad_copy;
  const TensorView g = detail::fold_batch_or_copy(grad_output, p.batch_shape, grad_copy, "grad_output");
  // Gradients over the full batch shape, summed at the end over what each input broadcasts along.
  auto full = [&](int64_t heads, int64_t rows, int64_t cols) {
    Shape s = p.batch_shape_with_heads(heads);
    s.push_back(rows);
    s.push_back(cols);
    return Tensor::zeros(s, DType::f64);
  };
  const Tensor dq_full = full(p.heads_q, p.len_q, p.dim_qk), dk_full = full(p.heads_kv, p.len_k, p.dim_qk),
               dv_full = full(p.heads_kv, p.len_k, p.dim_v);
  Tensor dmask_full = Tensor::zeros({p.batch, p.heads_q, p.len_q, p.len_k}, DType::f64);
  const TensorView dq = detail::folded(p, dq_full, p.heads_q, "query"), dk = detail::folded(p, dk_full, p.heads_kv, "key"),
                   dv = detail::folded(p, dv_full, p.heads_kv, "value");
  auto at = [](const TensorView& t, int64_t a, int64_t b, int64_t c, int64_t d) -> double& {
    return t.data_as<double>()[a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3]];
  };
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const double keep_scale = p.dropout_p < 1 ? 1.0 / (1.0 - p.dropout_p) : 0.0;
  std::vector<double> prob(static_cast<size_t>(p.len_k)), zscale(static_cast<size_t>(p.len_k)),
      dprob(static_cast<size_t>(p.len_k));
  Tensor dsinks = Tensor::zeros({p.heads_q}, DType::f64);
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h) {
      const int64_t hk = h / p.group();
      for (int64_t i = 0; i < p.len_q; ++i) {
        // P = softmax(scale q k^T + masks), zero for a row with no visible key
        double max = neg_inf;
        for (int64_t j = 0; j < p.len_k; ++j) {
          double s = 0;
          for (int64_t d = 0; d < p.dim_qk; ++d) s += element(p.q, b, h, i, d) * element(p.k, b, hk, j, d);
          s = capped(p, s * p.scale);
          for (int m = 0; m < p.num_masks; ++m) s += m == p.alibi_term ? alibi_bias(p, b, h, i, j) : p.masks[m].bias_f64(b, h, i, j);
          if (!p.visible(i, j)) s = neg_inf;
          prob[j] = s;
          max = std::max(max, s);
        }
        // (a sink: one more score in the denominator, of no value)
        if (p.sinks) max = std::max(max, p.sink(h));
        double sum = p.sinks ? std::exp(p.sink(h) - max) : 0.0;
        for (double& x : prob) sum += (x = max == neg_inf ? 0.0 : std::exp(x - max));
        for (double& x : prob) x = sum > 0 ? x / sum : 0.0;
        // Z / (1 - p): the dropout mask, rescaled
        const auto key = detail::dropout_row_key(p.dropout_seed, static_cast<uint64_t>((b * p.heads_q + h) * p.len_q + i));
        const uint32_t threshold = detail::dropout_threshold(p.dropout_p);
        for (int64_t j = 0; j < p.len_k; ++j) {
          const bool keep = p.dropout_p == 0 || (p.dropout_p < 1 && detail::dropout_bits(key, static_cast<uint32_t>(j)) >= threshold);
          zscale[j] = keep ? keep_scale : 0.0;
        }
        // dP = (dO V^T) Z / (1 - p);  D = sum_j P dP;  dS = P (dP - D)
        double D = 0;
        for (int64_t j = 0; j < p.len_k; ++j) {
          double dpd = 0;
          for (int64_t d = 0; d < p.dim_v; ++d) dpd += element(g, b, h, i, d) * element(p.v, b, hk, j, d);
          dprob[j] = dpd * zscale[j];
          D += prob[j] * dprob[j];
        }
        // The sink's score: its dP is 0 (no value), so dS = P_sink (0 - D).
        if (p.sinks) dsinks.data<double>()[h] -= std::exp(p.sink(h) - max) / sum * D;
        for (int64_t j = 0; j < p.len_k; ++j) {
          double ds = prob[j] * (dprob[j] - D);
          dmask_full.data<double>()[((b * p.heads_q + h) * p.len_q + i) * p.len_k + j] = ds;
          if (p.softcap > 0 && ds != 0) {  // through the cap: d/ds [c tanh(s / c)] = 1 - tanh^2(s / c)
            double dot = 0;
            for (int64_t d = 0; d < p.dim_qk; ++d) dot += element(p.q, b, h, i, d) * element(p.k, b, hk, j, d);
            const double t = std::tanh(dot * p.scale / p.softcap);
            ds *= 1 - t * t;
          }
          for (int64_t d = 0; d < p.dim_qk; ++d) {
            at(dq, b, h, i, d) += p.scale * ds * element(p.k, b, hk, j, d);
            at(dk, b, hk, j, d) += p.scale * ds * element(p.q, b, h, i, d);
          }
          for (int64_t d = 0; d < p.dim_v; ++d) at(dv, b, hk, j, d) += prob[j] * zscale[j] * element(g, b, h, i, d);
        }
      }
    }
  Gradients r;
  r.query = detail::sum_to_input(dq_full, q.sizes(), DType::f64);
  r.key = detail::sum_to_input(dk_full, k.sizes(), DType::f64);
  r.value = detail::sum_to_input(dv_full, v.sizes(), DType::f64);
  if (options.attn_mask) {  // summed over the dimensions the mask broadcasts along
    const TensorView weights_shaped(dmask_full.data<double>(), detail::output_shape(p, p.len_q, p.len_k));
    r.attn_mask = detail::sum_to_shape(weights_shaped, options.attn_mask->sizes(), DType::f64);
  }
  if (options.sinks) r.sinks = dsinks;
  return r;
}

ForwardResult multihead_attention(const MultiheadAttention& m, const TensorView& query, const TensorView& key,
                                  const TensorView& value, const ForwardOptions& options, bool training,
                                  const std::unordered_map<std::string, TensorView>& parameters,
                                  Tensor* output_magnitude) {
  const detail::ModuleCall c = detail::validate_module_call(m, query, key, value, options, /*any_float=*/true);
  auto param = [&](const std::string& name) -> Tensor {
    auto it = parameters.find(name);
    if (it == parameters.end()) return Tensor::copy_of(m.parameter(name), DType::f64);
    for (const auto& [n, shape] : m.parameter_shapes()) {
      if (n == name && it->second.sizes() != shape) {
        throw Error("reference::multihead_attention: parameter '" + name + "' expected shape " +
                    TensorView(nullptr, DType::f64, shape).shape_str() + ", got " + it->second.shape_str());
      }
    }
    return Tensor::copy_of(it->second, DType::f64);
  };
  const int64_t E = m.embed_dim(), H = m.num_heads(), hd = m.head_dim();
  const int64_t N = c.batch, L = c.len_q, S = c.len_k, St = c.total_keys();
  const bool bias = m.options().bias;

  // 1. Projections, with W_q, W_k, W_v the row blocks of in_proj_weight when packed.
  Tensor wq, wk, wv;
  if (m.qkv_same_embed_dim()) {
    const Tensor w = param("in_proj_weight");
    wq = Tensor::copy_of(w.view().slice(0, 0, E));
    wk = Tensor::copy_of(w.view().slice(0, E, 2 * E));
    wv = Tensor::copy_of(w.view().slice(0, 2 * E, 3 * E));
  } else {
    wq = param("q_proj_weight");
    wk = param("k_proj_weight");
    wv = param("v_proj_weight");
  }
  Tensor bq, bk, bv;
  if (bias) {
    const Tensor b = param("in_proj_bias");
    bq = Tensor::copy_of(b.view().slice(0, 0, E));
    bk = Tensor::copy_of(b.view().slice(0, E, 2 * E));
    bv = Tensor::copy_of(b.view().slice(0, 2 * E, 3 * E));
  }
  const Tensor q = linear(c.query, wq, bias ? &bq : nullptr);  // [N, L, E]
  const Tensor k = linear(c.key, wk, bias ? &bk : nullptr);    // [N, S, E]
  const Tensor v = linear(c.value, wv, bias ? &bv : nullptr);

  // 2. Append bias_k / bias_v, then a zero key/value, along the sequence.
  Tensor k_all = Tensor::zeros({N, St, E}, DType::f64), v_all = Tensor::zeros({N, St, E}, DType::f64);
  copy_into(k, k_all.view().slice(1, 0, S));
  copy_into(v, v_all.view().slice(1, 0, S));
  if (m.options().add_bias_kv) {
    const Tensor bk_row = param("bias_k"), bv_row = param("bias_v");
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        k_all.data<double>()[(n * St + S) * E + e] = bk_row.at({0, 0, e});
        v_all.data<double>()[(n * St + S) * E + e] = bv_row.at({0, 0, e});
      }
  }  // the zero_attn column stays zero

  // 3. Split into heads: [N, L, E] -> [N, H, L, hd], and attend per head with the module's masks.
  AttentionProblem p;
  p.batch = N;
  p.heads_q = p.heads_kv = H;
  p.len_q = L;
  p.len_k = St;
  p.dim_qk = p.dim_v = hd;
  p.q = q.view().split_dim(2, H).transpose(1, 2);
  p.k = k_all.view().split_dim(2, H).transpose(1, 2);
  p.v = v_all.view().split_dim(2, H).transpose(1, 2);
  detail::MaskTerms masks = detail::module_mask_terms(c, H);
  for (int i = 0; i < masks.count; ++i) p.add_mask(masks.terms[i]);
  p.causal = masks.causal;
  p.scale = 1.0 / std::sqrt(static_cast<double>(hd));
  p.dropout_p = training ? m.options().dropout : 0.0;
  if (p.dropout_p > 0) {
    if (!options.dropout_seed) throw Error("reference::multihead_attention: dropout needs options.dropout_seed");
    p.dropout_seed = *options.dropout_seed;
  }
  Tensor heads = Tensor::empty({N, H, L, hd}, DType::f64);
  Tensor weights = Tensor::empty({N, H, L, St}, DType::f64);
  attention(p, heads.data<double>(), weights.data<double>());

  // 4. Concatenate heads and project: out = concat(heads) W_o^T + b_o.
  Tensor merged = Tensor::empty({N, L, E}, DType::f64);
  copy_into(heads.view().transpose(1, 2), merged.view().split_dim(2, H));
  const Tensor wo = param("out_proj.weight");
  Tensor bo;
  if (bias) bo = param("out_proj.bias");
  const Tensor out = linear(merged, wo, bias ? &bo : nullptr);  // [N, L, E]

  ForwardResult r;
  const Shape out_shape = detail::module_output_shape(c, m, m.options().batch_first);
  auto in_caller_layout = [&](const Tensor& nle) {
    Tensor t = Tensor::empty(out_shape, DType::f64);
    TensorView t_nle = t.view();
    if (!c.batched) t_nle = t_nle.unsqueeze(0);
    else if (!m.options().batch_first) t_nle = t_nle.transpose(0, 1);
    copy_into(nle, t_nle);
    return t;
  };
  r.output = in_caller_layout(out);

  // 5. The magnitude: steps 1-4 after the weights again, on absolute values (the weights are
  //    nonnegative already).
  if (output_magnitude != nullptr) {
    Tensor v_abs = Tensor::zeros({N, St, E}, DType::f64);
    copy_into(linear(c.value, wv, bias ? &bv : nullptr, /*magnitude=*/true), v_abs.view().slice(1, 0, S));
    if (m.options().add_bias_kv) {
      const Tensor bv_row = param("bias_v");
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < E; ++e) v_abs.data<double>()[(n * St + S) * E + e] = std::abs(bv_row.at({0, 0, e}));
    }
    Tensor merged_abs = Tensor::zeros({N, L, E}, DType::f64);
    const double* pw = weights.data<double>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < St; ++j)
            for (int64_t d = 0; d < hd; ++d)
              merged_abs.data<double>()[(n * L + i) * E + h * hd + d] +=
                  pw[((n * H + h) * L + i) * St + j] * v_abs.data<double>()[(n * St + j) * E + h * hd + d];
    *output_magnitude = in_caller_layout(linear(merged_abs, wo, bias ? &bo : nullptr, /*magnitude=*/true));
  }

  if (options.need_weights) {
    Tensor w = Tensor::empty(detail::module_weights_shape(c, H, options.average_attn_weights), DType::f64);
    double* pw = w.data<double>();
    const double* pa = weights.data<double>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t j = 0; j < St; ++j) {
            const double a = pa[((n * H + h) * L + i) * St + j];
            if (options.average_attn_weights) {
              double& dst = pw[(n * L + i) * St + j];
              dst = (h == 0 ? 0.0 : dst) + a / static_cast<double>(H);
            } else {
              pw[((n * H + h) * L + i) * St + j] = a;
            }
          }
    r.weights = w;
  }
  return r;
}

}  // namespace mha::reference
