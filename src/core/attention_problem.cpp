#include "core/attention_problem.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <utility>

#include "core/batch_dims.hpp"
#include "core/thread_pool.hpp"

namespace mha::detail {
namespace {

void check_data(const TensorView& t, const std::string& name) {
  if (t.numel() > 0 && t.data == nullptr) {
    throw Error(name + ": data pointer is null for a tensor of shape " + t.shape_str());
  }
}

}  // namespace

MaskTerm make_mask_term(const TensorView& mask, const std::string& name, MaskKind bool_kind,
                        const std::array<int64_t, 4>& target, bool float64_call) {
  MaskTerm term;
  if (mask.dtype == DType::boolean) {
    term.kind = bool_kind;
  } else if (mask.dtype == DType::f32 || mask.dtype == DType::bf16 || mask.dtype == DType::f16 ||
             (float64_call && mask.dtype == DType::f64)) {
    term.kind = MaskKind::additive;
  } else {
    throw Error(name + ": expected dtype bool, float32, bfloat16 or float16" +
                std::string(float64_call ? " or float64" : " (float64 with float64 inputs)") + ", got " +
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

Shape output_shape(const AttentionProblem& p, int64_t rows, int64_t cols) {
  Shape s = p.batch_shape;
  s.push_back(rows);
  if (cols >= 0) s.push_back(cols);
  return s;
}

namespace {

// t folded to [B, H, rows, cols] (fold_batch), or, where its strides do not fold, a stand-in kept
// for materialise_inputs to replace.
TensorView fold_or_defer(AttentionProblem& p, const TensorView& t, const Shape& batch, int slot, const std::string& name) {
  if (auto f = fold_batch(t, batch)) return *f;
  if (!t.device.is_cpu()) {
    throw Error(name + ": on " + t.device.str() + " its batch dimensions must fold into one stride (a contiguous " +
                "tensor, or one expanded along whole leading dimensions); got shape " + t.shape_str());
  }
  p.unfolded[slot] = t;
  // A stand-in with the folded shape and t's dtype and device, never read: materialise_inputs
  // replaces it with the fold of a copy.
  TensorView r = t;
  r.ndim = 4;
  r.shape = {};
  r.strides = {};
  r.shape[0] = p.batch, r.shape[1] = batch.empty() ? 1 : batch.back(), r.shape[2] = t.size(-2), r.shape[3] = t.size(-1);
  return r;
}

// t ([..., h, rows, cols], on the host) with each head repeated to / h times, as
// repeat_interleave along the heads gives it, copied into `storage`: keys or values read by
// grouped attention with a head count of their own (materialise_inputs; host only).
TensorView repeat_heads(const TensorView& t, int64_t to, Tensor& storage) {
  Shape repeated = t.sizes();
  repeated[t.ndim - 3] = to;
  storage = Tensor::empty(repeated, t.dtype);  // (its size checked against overflow and memory)
  const int64_t count = storage.view().numel();
  if (count == 0) return TensorView(storage.view().data, t.dtype, repeated);
  const Tensor dense = Tensor::copy_of(t);  // [..., h, rows, cols], contiguous
  const int64_t h = t.size(-3), repeats = to / h, per_head = t.size(-2) * t.size(-1);
  const int64_t slab = per_head * static_cast<int64_t>(dtype_size(t.dtype));  // one head's bytes
  const int64_t outer = count / (to * per_head);
  const auto* src = static_cast<const std::byte*>(dense.view().data);
  auto* dst = static_cast<std::byte*>(storage.view().data);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < to; ++i) std::memcpy(dst + (o * to + i) * slab, src + (o * h + i / repeats) * slab, slab);
  return TensorView(storage.view().data, t.dtype, repeated);
}

}  // namespace

TensorView folded(const AttentionProblem& p, const TensorView& t, int64_t heads, const std::string& name) {
  if (auto f = fold_batch(t, p.batch_shape_with_heads(heads))) return *f;
  throw Error(name + ": its batch dimensions must fold into one stride, got shape " + t.shape_str());
}

// Attention sinks: [Hq], float32 (float64 with float64 inputs), on the host, finite.
static void check_sinks(const TensorView& sinks, const AttentionProblem& p, const TensorView& q_in) {
  const bool float64_call = q_in.dtype == DType::f64;
  if (sinks.dtype != DType::f32 && !(float64_call && sinks.dtype == DType::f64)) {
    throw Error("sinks: expected dtype float32" + std::string(float64_call ? " or float64" : "") + ", got " +
                std::string(dtype_name(sinks.dtype)));
  }
  if (!sinks.device.is_cpu() || !q_in.device.is_cpu()) {
    throw Error("sinks: attention sinks are applied on the host; got " +
                std::string(sinks.device.is_cpu() ? "inputs" : "sinks") + " on " +
                (sinks.device.is_cpu() ? q_in.device.str() : sinks.device.str()));
  }
  if (sinks.ndim != 1 || sinks.shape[0] != p.heads_q) {
    throw Error("sinks: expected shape [Hq] = [" + std::to_string(p.heads_q) + "] (one per query head), got " +
                sinks.shape_str());
  }
  check_data(sinks, "sinks");
  for (int64_t h = 0; h < p.heads_q; ++h) {
    const double x = sink_value(sinks, h);
    if (!std::isfinite(x)) throw Error("sinks: expected finite values, got sinks[" + std::to_string(h) + "] = " + std::to_string(x));
  }
}

namespace {

// q, k and v share a dtype, or k and v are of one float8 format (a quantized cache, widened
// exactly as the kernels read it) under a float32, bfloat16 or float16 query, on the host.
void check_input_dtypes(const TensorView& q_in, const TensorView& k_in, const TensorView& v_in, InputDtypes dtypes) {
  if (is_float8(q_in.dtype)) {
    throw Error("query: expected float32, float64, bfloat16 or float16 (float8 is taken for key and value only), got " +
                std::string(dtype_name(q_in.dtype)));
  }
  const bool eight_bit = is_float8(k_in.dtype) || is_float8(v_in.dtype);
  if (eight_bit && (k_in.dtype != v_in.dtype || q_in.dtype == DType::f64)) {
    throw Error("key, value: float8 keys and values (float8_e4m3fn or float8_e5m2) go together, in one format, under "
                "a float32, bfloat16 or float16 query; got query " + std::string(dtype_name(q_in.dtype)) + ", key " +
                std::string(dtype_name(k_in.dtype)) + ", value " + std::string(dtype_name(v_in.dtype)));
  }
  if (eight_bit && !q_in.device.is_cpu()) {
    throw Error("key: float8 keys and values are read by the host kernels; got inputs on " + q_in.device.str());
  }
  if (dtypes == InputDtypes::fused && !eight_bit && (k_in.dtype != q_in.dtype || v_in.dtype != q_in.dtype)) {
    throw Error("query, key, value: expected one dtype (or float8 key and value), got " +
                std::string(dtype_name(q_in.dtype)) + ", " + std::string(dtype_name(k_in.dtype)) + ", " +
                std::string(dtype_name(v_in.dtype)));
  }
}

// A dequantisation scale of float8 keys or values (SdpaOptions::k_descale, v_descale), beside
// float8 keys and values; its values are read (finite, > 0) by materialise_inputs.
void check_descale(const TensorView& descale, const std::string& name, const AttentionProblem& p, DType key_dtype) {
  if (!is_float8(key_dtype)) {
    throw Error(name + ": dequantisation scales are taken with float8 keys and values (float8_e4m3fn or "
                "float8_e5m2), got keys of dtype " + std::string(dtype_name(key_dtype)));
  }
  check_scales(descale, p.batch_shape_with_heads(p.heads_kv), name);
}

}  // namespace

AttentionProblem make_sdpa_problem(const TensorView& q_in, const TensorView& k_in, const TensorView& v_in,
                                   const SdpaOptions& options, InputDtypes dtypes) {
  const TensorView* inputs[] = {&q_in, &k_in, &v_in};
  const char* names[] = {"query", "key", "value"};
  for (int i = 0; i < 3; ++i) {
    const DType t = inputs[i]->dtype;
    if (t == DType::boolean) {
      throw Error(std::string(names[i]) + ": expected dtype float32, float64, bfloat16 or float16, got " +
                  std::string(dtype_name(t)));
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
  if (dtypes == InputDtypes::fused && q_in.dtype == DType::f64 && !q_in.device.is_cpu()) {
    throw Error("query: float64 runs on the host only, got a float64 tensor on " + q_in.device.str());
  }
  check_input_dtypes(q_in, k_in, v_in, dtypes);
  for (int i = 0; i < 3; ++i) {
    if (inputs[i]->ndim < 2) {
      throw Error(std::string(names[i]) + ": expected at least 2 dimensions ([..., L, E]), got shape " +
                  inputs[i]->shape_str());
    }
  }
  AttentionProblem p;
  p.len_q = q_in.size(-2);
  p.len_k = k_in.size(-2);
  p.dim_qk = q_in.size(-1);
  p.dim_v = v_in.size(-1);
  if (k_in.size(-1) != p.dim_qk) {
    throw Error("key: head dimension must equal query's " + std::to_string(p.dim_qk) + ", got " +
                std::to_string(k_in.size(-1)));
  }
  if (v_in.size(-2) != p.len_k) {
    throw Error("value: sequence length must equal key's " + std::to_string(p.len_k) + ", got " +
                std::to_string(v_in.size(-2)));
  }
  // Batch dimensions, as PyTorch broadcasts them: the heads (dimension -3) by the rule below, the
  // dimensions before them as torch.matmul does.
  auto heads_of = [](const TensorView& t) -> int64_t { return t.ndim >= 3 ? t.size(-3) : 1; };
  auto leading_of = [](const TensorView& t) {
    Shape s = t.sizes();
    s.resize(s.size() >= 3 ? s.size() - 3 : 0);
    return s;
  };
  const Shape leading = broadcast_shapes({leading_of(q_in), leading_of(k_in), leading_of(v_in)}, "query, key, value");
  const int64_t hq = heads_of(q_in), hk = heads_of(k_in), hv = heads_of(v_in);
  if (options.enable_gqa && (hk != hq || hv != hq)) {
    // PyTorch repeats each key and value head Hq / Hkv times (repeat_interleave): query head h
    // reads key/value head h / (Hq / Hkv), the grouped kernels' rule.
    for (auto [name, h] : {std::pair{"key", hk}, std::pair{"value", hv}}) {
      if (h == 0 || hq % h != 0) {
        throw Error("enable_gqa: query heads (" + std::to_string(hq) + ") must be a multiple of " + name + " heads (" +
                    std::to_string(h) + ")");
      }
    }
    p.heads_q = hq;
    // PyTorch repeats the key heads Hq / Hk times and the value heads Hq / Hv times, so the two
    // counts may differ. The kernels read one count for both, lcm(Hk, Hv) (a divisor of Hq): a
    // side with fewer heads is read through a copy with each head repeated (below), and its
    // gradient is summed back over the repeats (sum_to_input).
    p.heads_kv = std::lcm(hk, hv);
  } else {
    // Broadcast: each head count is the largest or 1. Keys and values of one head both serve every
    // query head as one group (no copy); otherwise one of them is read with head stride 0.
    p.heads_q = std::max({hq, hk, hv});
    for (auto [name, h] : {std::pair{"key", hk}, std::pair{"value", hv}}) {
      if (h != p.heads_q && h != 1) {
        throw Error(std::string(name) + ": head count " + std::to_string(h) + " differs from query's " +
                    std::to_string(hq) + " and is not 1; set enable_gqa for grouped-query attention");
      }
    }
    if (hq != p.heads_q && hq != 1) {
      throw Error("query: head count " + std::to_string(hq) + " differs from the key's and value's " +
                  std::to_string(p.heads_q) + " and is not 1");
    }
    p.heads_kv = hk == 1 && hv == 1 ? 1 : p.heads_q;
  }
  const int max_ndim = std::max({q_in.ndim, k_in.ndim, v_in.ndim});
  if (max_ndim >= 3) {
    p.batch_shape = leading;
    p.batch_shape.push_back(p.heads_q);
  }
  p.batch = checked_numel(leading, "query, key, value: batch dimensions");
  p.q = fold_or_defer(p, q_in, p.batch_shape, 0, "query");
  // (A head count of 1 needs no copy: it broadcasts, which is what repeating it does.)
  // Keys or values with a head count of their own are repeated to heads_kv by materialise_inputs
  // (a copy: it reads data); until then their slot holds a stand-in of the repeated shape.
  const TensorView* kv_in[] = {&k_in, &v_in};
  const int64_t kv_heads[] = {hk, hv};
  const char* kv_names[] = {"key", "value"};
  TensorView* kv_slots[] = {&p.k, &p.v};
  for (int i = 0; i < 2; ++i) {
    const TensorView& t = *kv_in[i];
    if (kv_heads[i] > 1 && kv_heads[i] != p.heads_kv) {
      if (!t.device.is_cpu()) {
        throw Error(std::string(kv_names[i]) + ": grouped attention with key and value head counts that differ "
                    "copies the repeated heads on the host; on " + t.device.str() +
                    " give key and value the same head count");
      }
      Shape repeated = t.sizes();
      repeated[t.ndim - 3] = p.heads_kv;
      (void)checked_numel(repeated, kv_names[i]);
      *kv_slots[i] = fold_or_defer(p, TensorView(t.data, t.dtype, repeated).on(t.device),
                                   p.batch_shape_with_heads(p.heads_kv), i + 1, kv_names[i]);
      p.unfolded[i + 1] = t;
      p.repeat_heads_to[i + 1] = p.heads_kv;
    } else {
      *kv_slots[i] = fold_or_defer(p, t, p.batch_shape_with_heads(p.heads_kv), i + 1, kv_names[i]);
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
  const int64_t diagonal = options.causal_alignment == CausalAlignment::BottomRight ? p.len_k - p.len_q : 0;
  p.causal_offset = diagonal;
  if (options.window_left < -1 || options.window_right < -1) {
    throw Error("window_left, window_right: expected -1 (unbounded) or a key count >= 0, got (" +
                std::to_string(options.window_left) + ", " + std::to_string(options.window_right) + ")");
  }
  // A side of max(Lq, Lk) keys or more reaches past every key from every diagonal: it bounds
  // nothing, and is dropped. The offsets saturate: the validators see sizes near the int64 limit.
  const int64_t longest = std::max(p.len_q, p.len_k);
  const int64_t window_left = options.window_left >= longest ? -1 : options.window_left;
  const int64_t window_right = options.window_right >= longest ? -1 : options.window_right;
  auto saturated_add = [](int64_t a, int64_t b) {
    int64_t r = 0;
    return __builtin_add_overflow(a, b, &r) ? (b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min()) : r;
  };
  if (window_right >= 0 && !(p.causal && p.causal_offset <= saturated_add(diagonal, window_right))) {
    p.causal = true;  // the window's right end is a diagonal further right (or the causal one)
    p.causal_offset = saturated_add(diagonal, window_right);
  }
  if (window_left >= 0) {
    p.windowed = true;
    p.window_offset = saturated_add(diagonal, -window_left);
  }
  if (options.attn_mask) {
    const TensorView& mask = *options.attn_mask;
    // It broadcasts to the weights' shape, batch_shape + [Lq, Lk], without growing it (leading
    // dimensions beyond it must be 1, as PyTorch's in-place add of the mask requires).
    const Shape weights = output_shape(p, p.len_q, p.len_k);
    const std::string target_str = TensorView(nullptr, DType::f32, weights).shape_str();
    bool fits = true;
    for (int d = 0; fits && d < mask.ndim; ++d) {
      const int64_t wd = static_cast<int64_t>(weights.size()) - mask.ndim + d;
      fits = mask.shape[d] == 1 || (wd >= 0 && mask.shape[d] == weights[wd]);
    }
    if (!fits) throw Error("attn_mask: shape " + mask.shape_str() + " cannot be broadcast to " + target_str);
    const TensorView mask4 = mask.ndim >= 2 ? fold_or_defer(p, mask, p.batch_shape, 3, "attn_mask") : mask;
    const std::array<int64_t, 4> target{p.batch, p.heads_q, p.len_q, p.len_k};
    p.add_mask(make_mask_term(mask4, "attn_mask", MaskKind::keep_if_true, target, q_in.dtype == DType::f64));
  }
  if (options.alibi_slopes) {
    const TensorView& slopes = *options.alibi_slopes;
    const bool float64_call = q_in.dtype == DType::f64;
    if (slopes.dtype != DType::f32 && !(float64_call && slopes.dtype == DType::f64)) {
      throw Error("alibi_slopes: expected dtype float32" + std::string(float64_call ? " or float64" : "") + ", got " +
                  std::string(dtype_name(slopes.dtype)));
    }
    if (!slopes.device.is_cpu()) {
      throw Error("alibi_slopes: expected a host tensor (the biases are built on the host), got one on " +
                  slopes.device.str());
    }
    check_data(slopes, "alibi_slopes");
    if (slopes.ndim > 4) {
      throw Error("alibi_slopes: expected at most 4 dimensions (the batch dimensions and heads), got shape " +
                  slopes.shape_str());
    }
    // One slope per query head, per batch entry too where given: broadcastable to the batch
    // dimensions and heads without growing them.
    bool fits = true;
    for (int d = 0; fits && d < slopes.ndim; ++d) {
      const int64_t td = static_cast<int64_t>(p.batch_shape.size()) - slopes.ndim + d;
      fits = slopes.shape[d] == 1 || (td >= 0 && slopes.shape[d] == p.batch_shape[td]);
    }
    if (!fits) {
      throw Error("alibi_slopes: shape " + slopes.shape_str() + " cannot be broadcast to the batch dimensions and heads " +
                  TensorView(nullptr, DType::f32, p.batch_shape).shape_str());
    }
    p.alibi_input = slopes;
    p.alibi_diagonal = diagonal;
  }
  if (options.sinks) check_sinks(*options.sinks, p, q_in);
  if (options.k_descale) check_descale(*options.k_descale, "k_descale", p, k_in.dtype);
  if (options.v_descale) check_descale(*options.v_descale, "v_descale", p, v_in.dtype);
  p.descale_input = {options.k_descale, options.v_descale};
  p.sinks = options.sinks;
  // (The float32 kernels hold the cap and its inverse as normal floats: [1e-30, 1e30] keeps both.)
  if (options.softcap != 0 && !(options.softcap >= 1e-30 && options.softcap <= 1e30)) {
    std::ostringstream got;
    got << options.softcap;
    throw Error("softcap: expected 0 (no soft-capping) or a value in [1e-30, 1e30], got " + got.str());
  }
  if (options.softcap > 0 && !q_in.device.is_cpu()) {
    throw Error("softcap: logit soft-capping runs in the host kernels; got inputs on " + q_in.device.str());
  }
  p.softcap = options.softcap;
  p.num_threads = options.num_threads;
  if (p.num_threads < 0) {
    throw Error("num_threads: expected >= 0 (0 for the library setting), got " + std::to_string(p.num_threads));
  }
  return p;
}

void materialise_inputs(AttentionProblem& p) {
  const std::array<int64_t, 4> target{p.batch, p.heads_q, p.len_q, p.len_k};
  TensorView* slots[] = {&p.q, &p.k, &p.v};
  for (int i = 0; i < 4; ++i) {
    if (!p.unfolded[i]) continue;
    const Shape batch = i == 1 || i == 2 ? p.batch_shape_with_heads(p.heads_kv) : p.batch_shape;
    const TensorView t = p.repeat_heads_to[i] > 0
                             ? repeat_heads(*p.unfolded[i], p.repeat_heads_to[i], p.input_storage[i])
                             : *p.unfolded[i];
    const TensorView folded = fold_batch_or_copy(t, batch, p.input_storage[i], "");
    if (i < 3) {
      *slots[i] = folded;
    } else {  // the attn_mask: SDPA's only term
      p.masks[0] = make_mask_term(folded, "attn_mask", p.masks[0].kind, target, p.q.dtype == DType::f64);
    }
    p.unfolded[i].reset();
  }
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
  if (p.windowed && !p.on_cpu()) {
    throw Error("window_left: a sliding window's left end is applied on the host; on " + p.q.device.str() +
                " pass window_left = -1 (window_right and is_causal run there)");
  }
  if (p.alibi_input) add_alibi_term(p);
  for (int i = 0; i < 2; ++i)
    if (p.descale_input[i]) check_scale_values(*p.descale_input[i], i == 0 ? "k_descale" : "v_descale");
  // The kernels' table, [B * Hkv] each, b major: for calls that read a key or value element (so
  // that B * Hkv is bounded by their storage; the others read no scale).
  if ((p.descale_input[0] || p.descale_input[1]) && (p.k.numel() > 0 || p.v.numel() > 0)) {
    const int64_t n = p.batch * p.heads_kv;
    p.descale_storage = Tensor::empty({2, n});
    float* scales = p.descale_storage.data<float>();
    for (int i = 0; i < 2; ++i) {
      if (!p.descale_input[i]) continue;
      const std::vector<float> read =
          read_scales(*p.descale_input[i], p.batch_shape_with_heads(p.heads_kv), i == 0 ? "k_descale" : "v_descale");
      std::copy(read.begin(), read.end(), scales + i * n);
    }
    p.k_descales = p.descale_input[0] ? scales : nullptr;
    p.v_descales = p.descale_input[1] ? scales + n : nullptr;
  }
}

void check_scales(const TensorView& scales, const Shape& target, const std::string& name) {
  if (scales.dtype != DType::f32) throw Error(name + ": expected dtype float32, got " + std::string(dtype_name(scales.dtype)));
  if (!scales.device.is_cpu()) throw Error(name + ": expected a host tensor, got one on " + scales.device.str());
  check_data(scales, name);
  bool fits = true;  // (extra leading dimensions of size 1 too, as a mask may have)
  for (int d = 0; fits && d < scales.ndim; ++d) {
    const int64_t td = static_cast<int64_t>(target.size()) - scales.ndim + d;
    fits = scales.shape[d] == 1 || (td >= 0 && scales.shape[d] == target[td]);
  }
  if (!fits) {
    throw Error(name + ": expected one scale per key/value head, shape [], [Hkv] or broadcastable to the batch "
                "dimensions and key/value heads " + TensorView(nullptr, DType::f32, target).shape_str() + ", got " +
                scales.shape_str());
  }
}

void check_scale_values(const TensorView& scales, const std::string& name) {
  // Each distinct element once: a dimension of stride 0 holds one element (so the walk is bounded
  // by the storage, whatever the shape).
  std::array<int64_t, kMaxDims> extent{}, index{};
  for (int d = 0; d < scales.ndim; ++d) {
    if (scales.shape[d] == 0) return;  // no element
    extent[d] = scales.strides[d] == 0 ? 1 : scales.shape[d];
  }
  for (;;) {
    int64_t offset = 0;
    for (int d = 0; d < scales.ndim; ++d) offset += index[d] * scales.strides[d];
    const float x = scales.data_as<float>()[offset];
    if (!(std::isfinite(x) && x > 0)) {
      std::ostringstream got;
      got << x << " at index [";
      for (int d = 0; d < scales.ndim; ++d) got << (d ? ", " : "") << index[d];
      throw Error(name + ": expected finite scales > 0, got " + got.str() + "]");
    }
    int d = scales.ndim - 1;  // odometer
    for (; d >= 0 && ++index[d] == extent[d]; --d) index[d] = 0;
    if (d < 0) return;
  }
}

std::vector<float> read_scales(const TensorView& scales, const Shape& target, const std::string& name) {
  check_scales(scales, target, name);
  check_scale_values(scales, name);
  int64_t n = 1;
  for (int64_t t : target) n *= t;
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    int64_t rest = t, offset = 0;  // target index t, right-aligned onto the scales' dimensions
    for (int d = static_cast<int>(target.size()) - 1; d >= 0; --d) {
      const int64_t i = rest % target[d];
      rest /= target[d];
      const int sd = scales.ndim - static_cast<int>(target.size()) + d;
      if (sd >= 0 && scales.shape[sd] != 1) offset += i * scales.strides[sd];
    }
    out[static_cast<size_t>(t)] = scales.data_as<float>()[offset];
  }
  return out;
}

void check_per_sequence_option(const TensorView& t, const std::string& name, const std::string& heads,
                               const std::string& sequences_name, int64_t sequences, bool scalar_ok) {
  if ((t.ndim == 0 && !scalar_ok) || t.ndim > 2 || (t.ndim == 2 && t.shape[0] != 1 && t.shape[0] != sequences)) {
    const std::string per = heads.substr(1, heads.size() - 2);  // "Hq" of "[Hq]"
    const std::string count = sequences_name == "B" ? "B = " + std::to_string(sequences)
                                                    : std::to_string(sequences) + " " + sequences_name;
    throw Error(name + ": expected shape " + (scalar_ok ? "[], " : "") + heads + " or [" + sequences_name + ", " +
                per + "] (" + count + "), got " + t.shape_str());
  }
}

std::optional<TensorView> sequence_option(const std::optional<TensorView>& t, int64_t s) {
  if (t && t->ndim == 2 && t->shape[0] > 1) return t->slice(0, s, s + 1);
  return t;
}

std::optional<TensorView> first_sequence_option(const std::optional<TensorView>& t) {
  if (t && t->ndim == 2) return t->select(0, 0);
  return t;
}

void add_alibi_term(AttentionProblem& p) {
  if (!p.on_cpu()) {
    throw Error("alibi_slopes: ALiBi's biases are applied by the host kernels; on " + p.q.device.str() +
                " it is not available (pass the biases as attn_mask)");
  }
  // The slopes as [..., H, 1, 1], so that they fold over the batch and heads as a mask does.
  const TensorView& given = *p.alibi_input;
  Shape shape = given.sizes(), strides(given.strides.begin(), given.strides.begin() + given.ndim);
  shape.insert(shape.end(), {1, 1});
  strides.insert(strides.end(), {0, 0});
  const TensorView folded =
      fold_batch_or_copy(TensorView(given.data, given.dtype, shape, strides), p.batch_shape, p.alibi_storage, "alibi_slopes");
  p.alibi_slopes = folded;
  // A call without batch entries or heads reads no slope (and empty slopes may have no storage).
  if (p.batch == 0 || p.heads_q == 0) return;
  const int64_t batches = folded.strides[0] != 0 ? p.batch : 1, heads = folded.strides[1] != 0 ? p.heads_q : 1;
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t h = 0; h < heads; ++h)
      if (!std::isfinite(p.alibi_slope(b, h))) {
        throw Error("alibi_slopes: expected finite slopes, got " + std::to_string(p.alibi_slope(b, h)) + " at batch entry " +
                    std::to_string(b) + ", head " + std::to_string(h));
      }
  if (p.len_q == 0 || p.len_k == 0) return;  // no scores
  // Bias t of a slice is that of every (i, j) with j - i = t - (Lq - 1): Lq + Lk - 1 of them.
  const int64_t n = p.len_q + p.len_k - 1;
  const bool f64 = p.q.dtype == DType::f64;
  p.alibi_biases = Tensor::empty({batches * heads, n}, f64 ? DType::f64 : DType::f32);
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t h = 0; h < heads; ++h) {
      const double slope = p.alibi_slope(b, h);
      const int64_t row = (b * heads + h) * n;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t distance = std::abs(t - (p.len_q - 1) - p.alibi_diagonal);
        if (f64) p.alibi_biases.data<double>()[row + t] = -(slope * static_cast<double>(distance));
        else p.alibi_biases.data<float>()[row + t] = -(static_cast<float>(slope) * static_cast<float>(distance));
      }
    }
  MaskTerm term;
  term.dtype = p.alibi_biases.dtype();
  term.kind = MaskKind::additive;
  const size_t size = dtype_size(term.dtype);
  term.data = static_cast<const std::byte*>(p.alibi_biases.view().data) + (p.len_q - 1) * size;  // bias (0, 0)
  term.strides = {batches > 1 ? heads * n : 0, heads > 1 ? n : 0, -1, 1};
  if (p.num_masks == static_cast<int>(p.masks.size())) throw Error("alibi_slopes: too many mask terms in one call");
  p.alibi_term = p.num_masks;
  p.add_mask(term);
}

AttentionProblem with_window_as_mask(const AttentionProblem& problem) {
  if (!problem.windowed) return problem;
  AttentionProblem p = problem;
  // One query row (decoding): a row broadcast along the queries, which the decoding kernel maps
  // by key blocks and skips without reading the keys.
  const int64_t rows = p.len_q == 1 ? 1 : p.len_q;
  p.window_mask = Tensor::empty({rows, p.len_k}, DType::boolean);
  uint8_t* keep = p.window_mask.data<uint8_t>();
  parallel_for(rows, resolve_threads(p.num_threads), [&](int64_t i, int) {
    const int64_t begin = p.window_begin(i);
    std::fill_n(keep + i * p.len_k, begin, uint8_t{0});
    std::fill_n(keep + i * p.len_k + begin, p.len_k - begin, uint8_t{1});
  });
  MaskTerm term;
  term.data = keep;
  term.dtype = DType::boolean;
  term.kind = MaskKind::keep_if_true;
  term.strides = {0, 0, rows == 1 ? 0 : p.len_k, 1};
  p.add_mask(term);
  p.windowed = false;
  return p;
}

}  // namespace mha::detail
