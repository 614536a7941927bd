#include "core/attention_problem.hpp"

#include <cmath>

namespace mha::detail {
namespace {

void check_data(const TensorView& t, const std::string& name) {
  if (t.numel() > 0 && t.data == nullptr) {
    throw Error(name + ": data pointer is null for a tensor of shape " + t.shape_str());
  }
}

std::string dims_str(int64_t a, int64_t b) { return std::to_string(a) + " and " + std::to_string(b); }

}  // namespace

TensorView as_4d(const TensorView& t, const std::string& name) {
  if (t.ndim < 2 || t.ndim > 4) {
    throw Error(name + ": expected 2 to 4 dimensions ([B, H, L, D], [H, L, D] or [L, D]), got shape " +
                t.shape_str());
  }
  TensorView r = t;
  while (r.ndim < 4) r = r.unsqueeze(0);
  return r;
}

MaskTerm make_mask_term(const TensorView& mask, const std::string& name, MaskKind bool_kind,
                        const std::array<int64_t, 4>& target) {
  MaskTerm term;
  if (mask.dtype == DType::boolean) {
    term.kind = bool_kind;
  } else if (mask.dtype == DType::f32 || mask.dtype == DType::bf16 || mask.dtype == DType::f16) {
    term.kind = MaskKind::additive;
  } else {
    throw Error(name + ": expected dtype bool, float32, bfloat16 or float16, got " +
                std::string(dtype_name(mask.dtype)));
  }
  if (mask.ndim > 4) {
    throw Error(name + ": expected at most 4 dimensions, got shape " + mask.shape_str());
  }
  check_data(mask, name);
  std::string target_str = "[";
  for (int d = 0; d < 4; ++d) target_str.append(std::to_string(target[d])).append(d < 3 ? ", " : "]");
  for (int d = 0; d < 4; ++d) {
    const int md = mask.ndim - 4 + d;  // right-aligned, as in PyTorch broadcasting
    if (md < 0) continue;
    const int64_t size = mask.shape[md];
    if (size == target[d]) {
      term.strides[d] = size == 1 ? 0 : mask.strides[md];
    } else if (size == 1) {
      term.strides[d] = 0;
    } else {
      throw Error(name + ": shape " + mask.shape_str() + " cannot be broadcast to " + target_str);
    }
  }
  term.data = mask.data;
  term.dtype = mask.dtype;
  return term;
}

void check_output_view(const TensorView& out, const Shape& expected, DType dtype, const std::string& name) {
  if (out.dtype != dtype) {
    throw Error(name + ": expected dtype " + std::string(dtype_name(dtype)) + ", got " +
                std::string(dtype_name(out.dtype)));
  }
  if (out.sizes() != expected) {
    throw Error(name + ": expected shape " + TensorView(nullptr, dtype, expected).shape_str() + ", got " +
                out.shape_str());
  }
  check_data(out, name);
}

Shape output_shape(const TensorView& q, int64_t rows, int64_t cols) {
  Shape s = q.sizes();
  s[s.size() - 2] = rows;
  s[s.size() - 1] = cols;
  return s;
}

AttentionProblem make_sdpa_problem(const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                                   const SdpaOptions& options, InputDtypes dtypes) {
  const TensorView* inputs[] = {&q_in, &k_in, &v_in};
  const char* names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    const DType t = inputs[i]->dtype;
    const bool ok = dtypes == InputDtypes::any_float      ? t != DType::boolean
                    : dtypes == InputDtypes::low_precision ? (t == DType::f32 || t == DType::bf16 || t == DType::f16)
                                                           : t == DType::f32;
    if (!ok) {
      const char* expected = dtypes == InputDtypes::any_float      ? "float32, float64, bfloat16 or float16"
                             : dtypes == InputDtypes::low_precision ? "float32, bfloat16 or float16"
                                                                    : "float32";
      throw Error(std::string(names[i]) + ": expected dtype " + expected + ", got " + std::string(dtype_name(t)));
    }
    check_data(*inputs[i], names[i]);
  }
  for (int i = 1; i < 3; ++i) {
    if (inputs[i]->device != q_in.device) {
      throw Error(std::string(names[i]) + ": expected the query's device " + q_in.device.str() + ", got " +
                  inputs[i]->device.str());
    }
  }
  if (options.attn_mask && options.attn_mask->device != q_in.device) {
    throw Error("attn_mask: expected the query's device " + q_in.device.str() + ", got " +
                options.attn_mask->device.str());
  }
  if (dtypes == InputDtypes::low_precision && (k_in.dtype != q_in.dtype || v_in.dtype != q_in.dtype)) {
    throw Error("query, key, value: expected one dtype, got " + std::string(dtype_name(q_in.dtype)) + ", " +
                std::string(dtype_name(k_in.dtype)) + ", " + std::string(dtype_name(v_in.dtype)));
  }
  if (q_in.ndim != k_in.ndim || q_in.ndim != v_in.ndim) {
    throw Error("query, key, value: expected the same number of dimensions, got shapes " + q_in.shape_str() + ", " +
                k_in.shape_str() + ", " + v_in.shape_str());
  }
  AttentionProblem p;
  p.q = as_4d(q_in, "query");
  p.k = as_4d(k_in, "key");
  p.v = as_4d(v_in, "value");
  p.batch = p.q.shape[0];
  p.heads_q = p.q.shape[1];
  p.heads_kv = p.k.shape[1];
  p.len_q = p.q.shape[2];
  p.len_k = p.k.shape[2];
  p.dim_qk = p.q.shape[3];
  p.dim_v = p.v.shape[3];

  if (p.k.shape[0] != p.batch || p.v.shape[0] != p.batch) {
    throw Error("key/value: batch size must match query's " + std::to_string(p.batch) + ", got " +
                dims_str(p.k.shape[0], p.v.shape[0]));
  }
  if (p.k.shape[3] != p.dim_qk) {
    throw Error("key: head dimension must equal query's " + std::to_string(p.dim_qk) + ", got " +
                std::to_string(p.k.shape[3]));
  }
  if (p.v.shape[2] != p.len_k) {
    throw Error("value: sequence length must equal key's " + std::to_string(p.len_k) + ", got " +
                std::to_string(p.v.shape[2]));
  }
  if (p.v.shape[1] != p.heads_kv) {
    throw Error("value: head count must equal key's " + std::to_string(p.heads_kv) + ", got " +
                std::to_string(p.v.shape[1]));
  }
  if (p.heads_q != p.heads_kv) {
    if (!options.enable_gqa) {
      throw Error("key/value: head count " + std::to_string(p.heads_kv) + " differs from query's " +
                  std::to_string(p.heads_q) + "; set enable_gqa for grouped-query attention");
    }
    if (p.heads_kv == 0 || p.heads_q % p.heads_kv != 0) {
      throw Error("enable_gqa: query heads (" + std::to_string(p.heads_q) + ") must be a multiple of key/value heads (" +
                  std::to_string(p.heads_kv) + ")");
    }
  }
  if (p.dim_qk == 0 && !options.scale) {
    throw Error("query: head dimension is 0, so the default scale 1/sqrt(0) is undefined; pass scale");
  }
  p.scale = options.scale ? *options.scale : 1.0 / std::sqrt(static_cast<double>(p.dim_qk));
  if (!std::isfinite(p.scale)) throw Error("scale: expected a finite value, got " + std::to_string(p.scale));
  if (!(options.dropout_p >= 0.0 && options.dropout_p <= 1.0)) {
    throw Error("dropout_p: expected a probability in [0, 1], got " + std::to_string(options.dropout_p));
  }
  p.dropout_p = options.dropout_p;
  p.dropout_seed = options.dropout_seed;
  p.causal = options.is_causal;
  p.causal_offset = options.causal_alignment == CausalAlignment::BottomRight ? p.len_k - p.len_q : 0;
  if (options.attn_mask) {
    const std::array<int64_t, 4> target{p.batch, p.heads_q, p.len_q, p.len_k};
    p.add_mask(make_mask_term(*options.attn_mask, "attn_mask", MaskKind::keep_if_true, target));
  }
  p.num_threads = options.num_threads;
  if (p.num_threads < 0) {
    throw Error("num_threads: expected >= 0 (0 for the library setting), got " + std::to_string(p.num_threads));
  }
  return p;
}

void widen_mask_terms(AttentionProblem& p) {
  const std::array<int64_t, 4> target{p.batch, p.heads_q, p.len_q, p.len_k};
  for (int t = 0; t < p.num_masks; ++t) {
    MaskTerm& term = p.masks[t];
    if (term.dtype != DType::bf16 && term.dtype != DType::f16) continue;
    if (!p.on_cpu()) {
      throw Error("attn_mask: a bfloat16 or float16 mask is widened on the host; on " + p.q.device.str() +
                  " pass it as float32 or bool");
    }
    if (p.mask_storage.defined()) throw Error("attn_mask: at most one bfloat16/float16 mask term");
    // Dimensions the term broadcasts along (stride 0) stay of size 1 in the copy, so an expanded
    // mask is not materialised.
    Shape shape(4), strides(4);
    for (int d = 0; d < 4; ++d) {
      shape[d] = term.strides[d] == 0 ? 1 : target[d];
      strides[d] = term.strides[d];
    }
    p.mask_storage = Tensor::copy_of(TensorView(term.data, term.dtype, shape, strides), DType::f32);
    const TensorView& w = p.mask_storage.view();
    term.data = w.data;
    term.dtype = DType::f32;
    for (int d = 0; d < 4; ++d) term.strides[d] = shape[d] == 1 ? 0 : w.strides[d];
  }
}

}  // namespace mha::detail
