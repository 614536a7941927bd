#include "module/module_call.hpp"

#include <cmath>

namespace mha::detail {
namespace {

std::string shape_of(const Shape& s) { return TensorView(nullptr, DType::f32, s).shape_str(); }

void check_input(const TensorView& t, const std::string& name, bool batched, int64_t width, bool any_float,
                 DType module_dtype) {
  if (any_float ? t.dtype == DType::boolean : t.dtype != module_dtype) {
    throw Error(name + ": expected dtype " + std::string(dtype_name(module_dtype)) +
                " (the module's parameters' dtype), got " + std::string(dtype_name(t.dtype)));
  }
  const int want = batched ? 3 : 2;
  if (t.ndim != want) {
    throw Error(name + ": expected " + std::to_string(want) + " dimensions (" +
                (batched ? "batched like query" : "unbatched like query") + "), got shape " + t.shape_str());
  }
  if (t.size(-1) != width) {
    throw Error(name + ": expected " + std::to_string(width) + " features in the last dimension, got shape " +
                t.shape_str());
  }
  if (t.numel() > 0 && t.data == nullptr) throw Error(name + ": data pointer is null");
}

// [L, N, C] (or [N, L, C] with batch_first, or [L, C] unbatched) as [N, L, C].
TensorView batch_major(const TensorView& t, bool batched, bool batch_first) {
  if (!batched) return t.unsqueeze(0);
  return batch_first ? t : t.transpose(0, 1);
}

// Masks are bool, float32, or (a float mask) the module's own dtype; for the reference
// (any_float), float64 too, so that finite differences can perturb them.
void check_mask_dtype(const TensorView& mask, const std::string& name, DType module_dtype, bool any_float) {
  if (mask.dtype != DType::boolean && mask.dtype != DType::f32 && mask.dtype != module_dtype &&
      !(any_float && mask.dtype == DType::f64)) {
    throw Error(name + ": expected dtype bool, float32 or the module's " + std::string(dtype_name(module_dtype)) +
                ", got " + std::string(dtype_name(mask.dtype)));
  }
  if (mask.numel() > 0 && mask.data == nullptr) throw Error(name + ": data pointer is null");
}

// Copies `mask` (last dimension S) into a tensor with `extra` more columns set to "attend".
Tensor pad_columns(const TensorView& mask, int64_t extra) {
  Shape shape = mask.sizes();
  shape.back() += extra;
  Tensor padded = Tensor::zeros(shape, mask.dtype);  // false / 0.0: attend
  copy_into(mask, padded.view().slice(-1, 0, mask.size(-1)));
  return padded;
}

}  // namespace

ModuleCall validate_module_call(const MultiheadAttention& m, const TensorView& query, const TensorView& key,
                                const TensorView& value, const ForwardOptions& options, bool any_float) {
  ModuleCall c;
  // The module runs on the CPU (its GPU path is not part of this build).
  require_cpu(query, "query");
  require_cpu(key, "key");
  require_cpu(value, "value");
  if (options.attn_mask) require_cpu(*options.attn_mask, "attn_mask");
  if (options.key_padding_mask) require_cpu(*options.key_padding_mask, "key_padding_mask");
  if (query.ndim != 2 && query.ndim != 3) {
    throw Error("query: expected 3 dimensions (" +
                std::string(m.options().batch_first ? "[N, L, E]" : "[L, N, E]") +
                ") or 2 for an unbatched input ([L, E]), got shape " + query.shape_str());
  }
  c.batched = query.ndim == 3;
  check_input(query, "query", c.batched, m.embed_dim(), any_float, m.dtype());
  check_input(key, "key", c.batched, m.kdim(), any_float, m.dtype());
  check_input(value, "value", c.batched, m.vdim(), any_float, m.dtype());
  const bool bf = m.options().batch_first;
  c.query = batch_major(query, c.batched, bf);
  c.key = batch_major(key, c.batched, bf);
  c.value = batch_major(value, c.batched, bf);
  c.batch = c.query.shape[0];
  c.len_q = c.query.shape[1];
  c.len_k = c.key.shape[1];
  if (c.key.shape[0] != c.batch || c.value.shape[0] != c.batch) {
    throw Error("key/value: batch size must match query's " + std::to_string(c.batch) + ", got shapes " +
                key.shape_str() + " and " + value.shape_str() + " for query " + query.shape_str());
  }
  if (c.value.shape[1] != c.len_k) {
    throw Error("value: sequence length must match key's " + std::to_string(c.len_k) + ", got shape " +
                value.shape_str() + " for key " + key.shape_str());
  }
  c.extra_keys = (m.options().add_bias_kv ? 1 : 0) + (m.options().add_zero_attn ? 1 : 0);
  const int64_t H = m.num_heads(), N = c.batch, L = c.len_q, S = c.len_k;

  if (options.attn_mask) {
    const TensorView& a = *options.attn_mask;
    check_mask_dtype(a, "attn_mask", m.dtype(), any_float);
    if (a.ndim == 2) {
      if (a.shape[0] != L || a.shape[1] != S) {
        throw Error("attn_mask: expected 2-D shape " + shape_of({L, S}) + " (L, S), got " + a.shape_str());
      }
      c.attn_mask_strides = {0, 0, a.strides[0], a.strides[1]};
    } else if (a.ndim == 3) {
      int64_t batch_heads;  // N * H, which absurd sizes can overflow: then no mask can match
      if (__builtin_mul_overflow(N, H, &batch_heads) || a.shape[0] != batch_heads || a.shape[1] != L ||
          a.shape[2] != S) {
        throw Error("attn_mask: expected 3-D shape (N * num_heads, L, S) = (" + std::to_string(N) + " * " +
                    std::to_string(H) + ", " + std::to_string(L) + ", " + std::to_string(S) + "), got " +
                    a.shape_str());
      }
      // Batch n starts at row n * H; with one batch entry that stride is never used (and H times
      // the row stride may lie beyond the view's extent).
      c.attn_mask_strides = {N > 1 ? H * a.strides[0] : 0, a.strides[0], a.strides[1], a.strides[2]};
    } else {
      throw Error("attn_mask: expected 2 or 3 dimensions, got shape " + a.shape_str());
    }
    c.attn_mask = a;
  }
  if (options.key_padding_mask) {
    const TensorView& k = *options.key_padding_mask;
    check_mask_dtype(k, "key_padding_mask", m.dtype(), any_float);
    if (c.batched) {
      if (k.ndim != 2 || k.shape[0] != N || k.shape[1] != S) {
        throw Error("key_padding_mask: expected shape " + shape_of({N, S}) + " (N, S), got " + k.shape_str());
      }
      c.key_padding_strides = {k.strides[0], 0, 0, k.strides[1]};
    } else {
      if (k.ndim != 1 || k.shape[0] != S) {
        throw Error("key_padding_mask: expected shape " + shape_of({S}) + " (S) for unbatched input, got " +
                    k.shape_str());
      }
      c.key_padding_strides = {0, 0, 0, k.strides[0]};
    }
    c.key_padding_mask = k;
  }
  c.causal = options.is_causal;
  return c;
}

MaskTerms module_mask_terms(const ModuleCall& c, int64_t num_heads) {
  MaskTerms out;
  const std::pair<const std::optional<TensorView>*, const std::array<int64_t, 4>*> masks[] = {
      {&c.attn_mask, &c.attn_mask_strides}, {&c.key_padding_mask, &c.key_padding_strides}};
  for (const auto& entry : masks) {
    const std::optional<TensorView>* mask = entry.first;
    const std::array<int64_t, 4>* strides = entry.second;
    if (!*mask) continue;
    TensorView view = **mask;
    std::array<int64_t, 4> st = *strides;
    // A copy (contiguous) takes the same broadcast pattern as validate_module_call set up.
    auto use_copy = [&](Tensor copy) {
      out.storage.push_back(std::move(copy));
      const TensorView& p = out.storage.back().view();
      if (mask == &c.key_padding_mask) {
        st = p.ndim == 2 ? std::array<int64_t, 4>{p.strides[0], 0, 0, p.strides[1]}
                         : std::array<int64_t, 4>{0, 0, 0, p.strides[0]};
      } else if (p.ndim == 2) {
        st = {0, 0, p.strides[0], p.strides[1]};
      } else {
        st = {num_heads * p.strides[0], p.strides[0], p.strides[1], p.strides[2]};
      }
      view = p;
    };
    // Additive terms are read as float32: a float mask in the module's bfloat16/float16 is widened
    // (a float64 one, which only the reference takes, stays float64).
    if (view.dtype == DType::bf16 || view.dtype == DType::f16) use_copy(Tensor::copy_of(view, DType::f32));
    if (c.extra_keys > 0) use_copy(pad_columns(view, c.extra_keys));
    MaskTerm t;
    t.data = view.data;
    t.dtype = view.dtype;
    t.kind = view.dtype == DType::boolean ? MaskKind::drop_if_true : MaskKind::additive;
    t.strides = st;
    out.terms[out.count++] = t;
  }
  out.causal = c.causal && c.extra_keys == 0;
  if (c.causal && c.extra_keys > 0) {
    const int64_t L = c.len_q, St = c.total_keys();
    Tensor hidden = Tensor::zeros({L, St}, DType::boolean);  // true: masked out
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = i + 1; j < c.len_k; ++j) hidden.data<bool>()[i * St + j] = true;
    out.storage.push_back(hidden);
    MaskTerm t;
    t.data = hidden.data<bool>();
    t.dtype = DType::boolean;
    t.kind = MaskKind::drop_if_true;
    t.strides = {0, 0, St, 1};
    out.terms[out.count++] = t;
  }
  return out;
}

AttentionProblem module_attention_problem(const ModuleCall& c, const MaskTerms& masks, int64_t num_heads,
                                          const TensorView& q, const TensorView& k, const TensorView& v, int threads) {
  const int64_t H = num_heads, hd = q.shape[2] / H;
  AttentionProblem p;
  p.batch = c.batch;
  p.heads_q = p.heads_kv = H;
  p.len_q = c.len_q;
  p.len_k = c.total_keys();
  p.dim_qk = p.dim_v = hd;
  p.q = q.split_dim(2, H).transpose(1, 2);
  p.k = k.split_dim(2, H).transpose(1, 2);
  p.v = v.split_dim(2, H).transpose(1, 2);
  for (int i = 0; i < masks.count; ++i) p.add_mask(masks.terms[i]);
  p.causal = masks.causal;
  p.scale = 1.0 / std::sqrt(static_cast<double>(hd));
  p.num_threads = threads;
  return p;
}

Shape module_output_shape(const ModuleCall& c, const MultiheadAttention& m, bool batch_first) {
  if (!c.batched) return {c.len_q, m.embed_dim()};
  return batch_first ? Shape{c.batch, c.len_q, m.embed_dim()} : Shape{c.len_q, c.batch, m.embed_dim()};
}

Shape module_weights_shape(const ModuleCall& c, int64_t num_heads, bool average) {
  Shape s;
  if (c.batched) s.push_back(c.batch);
  if (!average) s.push_back(num_heads);
  s.push_back(c.len_q);
  s.push_back(c.total_keys());
  return s;
}

}  // namespace mha::detail
