// The Python extension `mha._mha`: thin bindings over the C++ API. Argument conversion, PyTorch
// interop and the friendly signatures live in python/mha/__init__.py; this file only moves
// arrays in and out without copies and releases the GIL while the library computes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unordered_map.h>
#include <nanobind/stl/vector.h>

#include <mha/mha.hpp>

#include <map>
#include <optional>
#include <span>
#include <string>

namespace nb = nanobind;

namespace {

using Array = nb::ndarray<nb::ro, nb::device::cpu>;
using NumpyArray = nb::ndarray<nb::numpy>;

mha::DType to_dtype(const nb::dlpack::dtype& t, const std::string& name) {
  if (t == nb::dtype<float>()) return mha::DType::f32;
  if (t == nb::dtype<double>()) return mha::DType::f64;
  if (t == nb::dtype<bool>()) return mha::DType::boolean;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return mha::DType::bf16;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && t.bits == 16) return mha::DType::f16;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float8_E4M3FN) && t.bits == 8) return mha::DType::f8e4m3;
  if (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float8_E5M2) && t.bits == 8) return mha::DType::f8e5m2;
  throw nb::type_error((name + ": unsupported dtype (expected float32, float64, bfloat16, float16, float8_e4m3fn, "
                               "float8_e5m2 or bool)").c_str());
}

// A view of the caller's memory, strides and all: no copy (read-only or writable arrays).
template <class A>
mha::TensorView view_of(const A& a, const std::string& name) {
  if (a.ndim() > static_cast<size_t>(mha::kMaxDims)) {
    throw nb::value_error((name + ": at most " + std::to_string(mha::kMaxDims) + " dimensions are supported").c_str());
  }
  mha::Shape shape(a.ndim()), strides(a.ndim());
  for (size_t d = 0; d < a.ndim(); ++d) {
    shape[d] = static_cast<int64_t>(a.shape(d));
    strides[d] = a.stride(d);
    if (strides[d] < 0) throw nb::value_error((name + ": negative strides are not supported").c_str());
  }
  return mha::TensorView(a.data(), to_dtype(a.dtype(), name), shape, strides);
}

std::optional<mha::TensorView> optional_view(const std::optional<Array>& a, const std::string& name) {
  if (!a) return std::nullopt;
  return view_of(*a, name);
}

// Hands a Tensor to numpy without copying: the capsule keeps its storage alive. numpy has no
// bfloat16: those are handed over as their uint16 bits (the Python layer views them as
// torch.bfloat16, still without a copy) or, with `bf16_bits` false, converted to float32.
NumpyArray to_numpy(const mha::Tensor& tensor, bool bf16_bits = true) {
  // (numpy has no float8 either: such tensors, a file's, come back widened to float32, exactly)
  const bool convert = (tensor.dtype() == mha::DType::bf16 && !bf16_bits) || mha::is_float8(tensor.dtype());
  const mha::Tensor t = convert ? mha::Tensor::copy_of(tensor, mha::DType::f32) : tensor;
  auto* owner = new mha::Tensor(t);
  nb::capsule keep(owner, [](void* p) noexcept { delete static_cast<mha::Tensor*>(p); });
  std::vector<size_t> shape(t.ndim());
  for (int d = 0; d < t.ndim(); ++d) shape[d] = static_cast<size_t>(t.size(d));
  nb::dlpack::dtype dt = nb::dtype<float>();
  if (t.dtype() == mha::DType::f64) dt = nb::dtype<double>();
  if (t.dtype() == mha::DType::boolean) dt = nb::dtype<bool>();
  if (t.dtype() == mha::DType::f16) dt = {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
  if (t.dtype() == mha::DType::bf16) dt = nb::dtype<uint16_t>();
  return NumpyArray(t.view().data, t.ndim(), shape.data(), keep, nullptr, dt);
}

using ForwardReturn = std::pair<NumpyArray, std::optional<NumpyArray>>;

mha::ForwardOptions forward_options(const std::optional<Array>& key_padding_mask, bool need_weights,
                                    const std::optional<Array>& attn_mask, bool average_attn_weights, bool is_causal,
                                    std::optional<uint64_t> dropout_seed, int num_threads) {
  mha::ForwardOptions o;
  o.key_padding_mask = optional_view(key_padding_mask, "key_padding_mask");
  o.need_weights = need_weights;
  o.attn_mask = optional_view(attn_mask, "attn_mask");
  o.average_attn_weights = average_attn_weights;
  o.is_causal = is_causal;
  o.dropout_seed = dropout_seed;
  o.num_threads = num_threads;
  return o;
}

// Parameters to read instead of the module's own (forward_with): views of the caller's arrays.
using ParameterArrays = std::optional<std::unordered_map<std::string, Array>>;
std::optional<mha::ParameterViews> parameter_views(const ParameterArrays& params) {
  if (!params) return std::nullopt;
  mha::ParameterViews views;
  for (const auto& [name, a] : *params) views.emplace(name, view_of(a, "params['" + name + "']"));
  return views;
}

ForwardReturn module_forward(const mha::MultiheadAttention& m, const Array& query, const Array& key,
                             const Array& value, const std::optional<Array>& key_padding_mask, bool need_weights,
                             const std::optional<Array>& attn_mask, bool average_attn_weights, bool is_causal,
                             std::optional<uint64_t> dropout_seed, int num_threads, const ParameterArrays& params) {
  const mha::ForwardOptions o = forward_options(key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                                is_causal, dropout_seed, num_threads);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  const std::optional<mha::ParameterViews> p = parameter_views(params);
  mha::ForwardResult r;
  {
    nb::gil_scoped_release release;  // the arrays above keep the inputs alive meanwhile
    r = p ? m.forward_with(*p, q, k, v, o) : m.forward(q, k, v, o);
  }
  std::optional<NumpyArray> w;
  if (r.weights) w = to_numpy(*r.weights);
  return {to_numpy(r.output), w};
}

// A training forward: the outputs and the context its backward needs.
std::tuple<NumpyArray, std::optional<NumpyArray>, mha::ForwardContext> module_forward_train(
    const mha::MultiheadAttention& m, const Array& query, const Array& key, const Array& value,
    const std::optional<Array>& key_padding_mask, bool need_weights, const std::optional<Array>& attn_mask,
    bool average_attn_weights, bool is_causal, std::optional<uint64_t> dropout_seed, int num_threads,
    const ParameterArrays& params) {
  const mha::ForwardOptions o = forward_options(key_padding_mask, need_weights, attn_mask, average_attn_weights,
                                                is_causal, dropout_seed, num_threads);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  const std::optional<mha::ParameterViews> p = parameter_views(params);
  mha::ForwardContext context;
  mha::ForwardResult r;
  {
    nb::gil_scoped_release release;
    r = p ? m.forward_with(*p, q, k, v, o, &context) : m.forward(q, k, v, o, &context);
  }
  std::optional<NumpyArray> w;
  if (r.weights) w = to_numpy(*r.weights);
  return {to_numpy(r.output), w, std::move(context)};
}

// The gradients as arrays: an input's None where `wanted` (query, key, value) left it out, no
// entry for a parameter named in `frozen`, and the float masks' (key_padding_mask, attn_mask)
// where `masks_wanted` asks for them (else None).
using MaybeArray = std::optional<NumpyArray>;
using ModuleGradientArrays =
    std::tuple<MaybeArray, MaybeArray, MaybeArray, std::unordered_map<std::string, NumpyArray>, MaybeArray, MaybeArray>;
ModuleGradientArrays module_backward(const mha::MultiheadAttention& m, const mha::ForwardContext& context,
                                     const Array& grad_output, const ParameterArrays& params,
                                     std::tuple<bool, bool, bool> wanted, std::vector<std::string> frozen,
                                     std::tuple<bool, bool> masks_wanted, const std::optional<Array>& grad_weights) {
  const mha::TensorView g = view_of(grad_output, "grad_output");
  const std::optional<mha::TensorView> gw = optional_view(grad_weights, "grad_weights");
  const std::optional<mha::ParameterViews> p = parameter_views(params);
  const mha::WantedGradients inputs{std::get<0>(wanted), std::get<1>(wanted), std::get<2>(wanted), std::move(frozen),
                                    std::get<1>(masks_wanted), std::get<0>(masks_wanted)};
  mha::ModuleGradients r;
  {
    nb::gil_scoped_release release;
    r = p ? m.backward_with(*p, context, g, inputs, gw) : m.backward(context, g, inputs, gw);
  }
  std::unordered_map<std::string, NumpyArray> grads;
  for (const auto& [name, t] : r.parameters)
    if (t.defined()) grads.emplace(name, to_numpy(t));
  auto maybe = [](const mha::Tensor& t) { return t.defined() ? MaybeArray(to_numpy(t)) : std::nullopt; };
  return {maybe(r.query), maybe(r.key), maybe(r.value), grads, maybe(r.key_padding_mask), maybe(r.attn_mask)};
}

// The backward of a training forward whose context was kept as tensors (activations(), below):
// the context is rebuilt from them and the forward's inputs and options, then the backward runs.
ModuleGradientArrays module_backward_restored(
    const mha::MultiheadAttention& m, const Array& query, const Array& key, const Array& value,
    const std::optional<Array>& key_padding_mask, const std::optional<Array>& attn_mask, bool is_causal,
    std::optional<uint64_t> dropout_seed, int num_threads, std::tuple<Array, Array, Array, Array, Array> activations,
    const Array& grad_output, const ParameterArrays& params, std::tuple<bool, bool, bool> wanted,
    std::vector<std::string> frozen, std::tuple<bool, bool> masks_wanted, const std::optional<Array>& grad_weights,
    bool average_attn_weights) {
  // (need_weights where a gradient of the weights comes: the context then knows their shape)
  const mha::ForwardOptions o = forward_options(key_padding_mask, grad_weights.has_value(), attn_mask,
                                                average_attn_weights, is_causal, dropout_seed, num_threads);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  const auto& [aq, ak, av, attn, lse] = activations;
  const mha::ActivationViews saved{view_of(aq, "activations.q"), view_of(ak, "activations.k"),
                                   view_of(av, "activations.v"), view_of(attn, "activations.attn"),
                                   view_of(lse, "activations.lse")};
  mha::ForwardContext context;
  {
    nb::gil_scoped_release release;  // the arrays keep the inputs and activations alive meanwhile
    context = m.restore_context(q, k, v, o, saved);
  }
  return module_backward(m, context, grad_output, params, wanted, std::move(frozen), masks_wanted, grad_weights);
}

mha::SdpaOptions sdpa_options(const std::optional<Array>& attn_mask, double dropout_p, bool is_causal,
                              std::optional<double> scale, double softcap, bool enable_gqa, uint64_t dropout_seed, bool bottom_right,
                              int64_t window_left, int64_t window_right, const std::optional<Array>& alibi_slopes,
                              int num_threads, const std::optional<Array>& sinks = std::nullopt,
                              const std::optional<Array>& k_descale = std::nullopt,
                              const std::optional<Array>& v_descale = std::nullopt) {
  mha::SdpaOptions o;
  o.sinks = optional_view(sinks, "sinks");
  o.k_descale = optional_view(k_descale, "k_descale");
  o.v_descale = optional_view(v_descale, "v_descale");
  o.window_left = window_left;
  o.window_right = window_right;
  o.alibi_slopes = optional_view(alibi_slopes, "alibi_slopes");
  o.attn_mask = optional_view(attn_mask, "attn_mask");
  o.dropout_p = dropout_p;
  o.is_causal = is_causal;
  o.causal_alignment = bottom_right ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
  o.scale = scale;
  o.softcap = softcap;
  o.enable_gqa = enable_gqa;
  o.dropout_seed = dropout_seed;
  o.num_threads = num_threads;
  return o;
}

std::pair<NumpyArray, NumpyArray> sdpa_train(const Array& query, const Array& key, const Array& value,
                                             const std::optional<Array>& attn_mask, double dropout_p, bool is_causal,
                                             std::optional<double> scale, double softcap, bool enable_gqa, uint64_t dropout_seed,
                                             bool bottom_right, int64_t window_left, int64_t window_right,
                                             const std::optional<Array>& alibi_slopes, int num_threads,
                                             const std::optional<Array>& sinks, const std::optional<Array>& k_descale,
                                             const std::optional<Array>& v_descale) {
  const mha::SdpaOptions o =
      sdpa_options(attn_mask, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed, bottom_right, window_left,
                   window_right, alibi_slopes, num_threads, sinks, k_descale, v_descale);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  mha::AttentionForTraining r;
  {
    nb::gil_scoped_release release;
    r = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  }
  return {to_numpy(r.output), to_numpy(r.lse)};
}

// The gradients of query, key and value (None where `wanted` left one out), of a float mask
// (when attn_mask_grad) and of the sinks (when given).
std::tuple<MaybeArray, MaybeArray, MaybeArray, MaybeArray, MaybeArray> sdpa_backward(
    const Array& query, const Array& key, const Array& value, const Array& output, const Array& lse,
    const Array& grad_output, const std::optional<Array>& attn_mask, double dropout_p, bool is_causal,
    std::optional<double> scale, double softcap, bool enable_gqa, uint64_t dropout_seed, bool bottom_right, int64_t window_left,
    int64_t window_right, const std::optional<Array>& alibi_slopes, int num_threads, bool attn_mask_grad,
    std::tuple<bool, bool, bool> wanted, const std::optional<Array>& sinks) {
  const mha::SdpaOptions o =
      sdpa_options(attn_mask, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed, bottom_right, window_left,
                   window_right, alibi_slopes, num_threads, sinks);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  mha::AttentionForTraining saved;
  saved.output = mha::Tensor::copy_of(view_of(output, "output"));  // in its dtype, the inputs' (checked there)
  saved.lse = mha::Tensor::copy_of(view_of(lse, "lse"));  // float32, or float64 for float64 inputs (checked there)
  const mha::TensorView g = view_of(grad_output, "grad_output");
  mha::AttentionGradients r;
  {
    nb::gil_scoped_release release;
    r = mha::scaled_dot_product_attention_backward(
        q, k, v, saved, g, o,
        mha::SdpaGradientsWanted{std::get<0>(wanted), std::get<1>(wanted), std::get<2>(wanted), attn_mask_grad});
  }
  auto maybe = [](const mha::Tensor& t) { return t.defined() ? MaybeArray(to_numpy(t)) : std::nullopt; };
  return {maybe(r.query), maybe(r.key), maybe(r.value), r.attn_mask ? maybe(*r.attn_mask) : std::nullopt,
          maybe(r.sinks)};
}

ForwardReturn sdpa(const Array& query, const Array& key, const Array& value, const std::optional<Array>& attn_mask,
                   double dropout_p, bool is_causal, std::optional<double> scale, double softcap, bool enable_gqa, uint64_t dropout_seed,
                   bool need_weights, bool bottom_right, int64_t window_left, int64_t window_right,
                   const std::optional<Array>& alibi_slopes, int num_threads, const std::optional<Array>& sinks,
                   const std::optional<Array>& k_descale, const std::optional<Array>& v_descale) {
  const mha::SdpaOptions o =
      sdpa_options(attn_mask, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed, bottom_right, window_left,
                   window_right, alibi_slopes, num_threads, sinks, k_descale, v_descale);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  if (need_weights) {
    mha::AttentionWithWeights r;
    {
      nb::gil_scoped_release release;
      r = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
    }
    return {to_numpy(r.output), to_numpy(r.weights)};
  }
  mha::Tensor out;
  {
    nb::gil_scoped_release release;
    out = mha::scaled_dot_product_attention(q, k, v, o);
  }
  return {to_numpy(out), std::nullopt};
}

// A paged key/value cache: q [B, Hq, Lq, Dk] and caches [pages, Hkv, page_size, D] (views of the
// caller's arrays, FlashAttention's layout transposed by the Python layer), the block table
// [B, pages_per_sequence] int32 and the lengths [B] int64 read in place.
using PageTable = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Lengths = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Writable = nb::ndarray<nb::device::cpu>;

std::span<const int32_t> table_span(const PageTable& t) { return {t.data(), t.shape(0) * t.shape(1)}; }
std::span<const int64_t> lengths_span(const Lengths& l) { return {l.data(), l.shape(0)}; }

// With cu_seqlens_q, query is packed [Tq, Hq, Dk] rows (paged_attention_varlen). Returns the
// output and, with return_lse, each row's log-sum-exp ([B, Hq, Lq], or [Hq, Tq] packed).
std::pair<NumpyArray, std::optional<NumpyArray>> paged_attention(
    const Array& query, const Array& key_cache, const Array& value_cache, const PageTable& block_table,
    const Lengths& cache_seqlens, bool is_causal, std::optional<double> scale, double softcap, bool enable_gqa, bool bottom_right,
    int64_t window_left, int64_t window_right, const std::optional<Array>& alibi_slopes, int num_threads,
    const std::optional<Lengths>& cu_seqlens_q, bool return_lse, const std::optional<Array>& sinks,
    const std::optional<Array>& k_descale, const std::optional<Array>& v_descale) {
  const mha::SdpaOptions o = sdpa_options(std::nullopt, 0.0, is_causal, scale, softcap, enable_gqa, 0, bottom_right,
                                          window_left, window_right, alibi_slopes, num_threads, sinks, k_descale,
                                          v_descale);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key_cache, "key_cache"),
                        v = view_of(value_cache, "value_cache");
  const std::span<const int32_t> table = table_span(block_table);
  const std::span<const int64_t> lens = lengths_span(cache_seqlens);
  mha::PagedAttentionOutput r;
  {
    nb::gil_scoped_release release;
    if (cu_seqlens_q) {
      const std::span<const int64_t> cu = lengths_span(*cu_seqlens_q);
      r = return_lse ? mha::paged_attention_varlen_with_lse(q, cu, k, v, table, lens, o)
                     : mha::PagedAttentionOutput{mha::paged_attention_varlen(q, cu, k, v, table, lens, o), {}};
    } else {
      r = return_lse ? mha::paged_attention_with_lse(q, k, v, table, lens, o)
                     : mha::PagedAttentionOutput{mha::paged_attention(q, k, v, table, lens, o), {}};
    }
  }
  if (!return_lse) return {to_numpy(r.output), std::nullopt};
  return {to_numpy(r.output), to_numpy(r.lse)};
}

// With cu_seqlens_new, key and value are packed [Tnew, Hkv, D] rows (write_paged_cache_varlen).
void write_paged_cache(const Array& key, const Array& value, const Writable& key_cache, const Writable& value_cache,
                       const PageTable& block_table, const Lengths& cache_seqlens,
                       const std::optional<Lengths>& cu_seqlens_new, const std::optional<Array>& k_descale,
                       const std::optional<Array>& v_descale) {
  const mha::TensorView k = view_of(key, "key"), v = view_of(value, "value");
  const mha::TensorView kc = view_of(key_cache, "key_cache"), vc = view_of(value_cache, "value_cache");
  const mha::CacheWriteScales scales{optional_view(k_descale, "k_descale"), optional_view(v_descale, "v_descale")};
  nb::gil_scoped_release release;
  if (cu_seqlens_new) {
    mha::write_paged_cache_varlen(k, v, lengths_span(*cu_seqlens_new), kc, vc, table_span(block_table),
                                  lengths_span(cache_seqlens), scales);
  } else {
    mha::write_paged_cache(k, v, kc, vc, table_span(block_table), lengths_span(cache_seqlens), scales);
  }
}

// Variable-length attention over packed [T, H, D] arrays and offsets (cu_seqlens_q, cu_seqlens_k):
// the output, or (output, lse) for training, and the gradients; with a sliding window
// (window_left, window_right; -1 unbounded).
using Offsets = std::vector<int64_t>;

NumpyArray sdpa_varlen(const Array& query, const Array& key, const Array& value, const Offsets& cu_q,
                       const Offsets& cu_k, double dropout_p, bool is_causal, std::optional<double> scale, double softcap,
                       bool enable_gqa, uint64_t dropout_seed, bool bottom_right, int64_t window_left,
                       int64_t window_right, const std::optional<Array>& alibi_slopes, int num_threads,
    const std::optional<Array>& sinks, const std::optional<Array>& k_descale, const std::optional<Array>& v_descale) {
  const mha::SdpaOptions o = sdpa_options(std::nullopt, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed,
                                          bottom_right, window_left, window_right, alibi_slopes, num_threads, sinks,
                                          k_descale, v_descale);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  mha::Tensor out;
  {
    nb::gil_scoped_release release;
    out = mha::scaled_dot_product_attention_varlen(q, k, v, cu_q, cu_k, o);
  }
  return to_numpy(out);
}

std::pair<NumpyArray, NumpyArray> sdpa_varlen_train(const Array& query, const Array& key, const Array& value,
                                                    const Offsets& cu_q, const Offsets& cu_k, double dropout_p,
                                                    bool is_causal, std::optional<double> scale, double softcap, bool enable_gqa,
                                                    uint64_t dropout_seed, bool bottom_right, int64_t window_left,
                                                    int64_t window_right, const std::optional<Array>& alibi_slopes, int num_threads,
    const std::optional<Array>& sinks, const std::optional<Array>& k_descale, const std::optional<Array>& v_descale) {
  const mha::SdpaOptions o = sdpa_options(std::nullopt, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed,
                                          bottom_right, window_left, window_right, alibi_slopes, num_threads, sinks,
                                          k_descale, v_descale);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  mha::AttentionForTraining r;
  {
    nb::gil_scoped_release release;
    r = mha::scaled_dot_product_attention_varlen_for_training(q, k, v, cu_q, cu_k, o);
  }
  return {to_numpy(r.output), to_numpy(r.lse)};
}

std::tuple<MaybeArray, MaybeArray, MaybeArray, MaybeArray> sdpa_varlen_backward(
    const Array& query, const Array& key, const Array& value, const Offsets& cu_q, const Offsets& cu_k,
    const Array& output, const Array& lse, const Array& grad_output, double dropout_p, bool is_causal,
    std::optional<double> scale, double softcap, bool enable_gqa, uint64_t dropout_seed, bool bottom_right, int64_t window_left,
    int64_t window_right, const std::optional<Array>& alibi_slopes, int num_threads, std::tuple<bool, bool, bool> wanted,
    const std::optional<Array>& sinks) {
  const mha::SdpaOptions o = sdpa_options(std::nullopt, dropout_p, is_causal, scale, softcap, enable_gqa, dropout_seed,
                                          bottom_right, window_left, window_right, alibi_slopes, num_threads, sinks);
  const mha::TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  mha::AttentionForTraining saved;
  saved.output = mha::Tensor::copy_of(view_of(output, "output"));  // in its dtype, the inputs' (checked there)
  saved.lse = mha::Tensor::copy_of(view_of(lse, "lse"));
  const mha::TensorView g = view_of(grad_output, "grad_output");
  mha::AttentionGradients r;
  {
    nb::gil_scoped_release release;
    r = mha::scaled_dot_product_attention_varlen_backward(
        q, k, v, cu_q, cu_k, saved, g, o,
        mha::SdpaGradientsWanted{std::get<0>(wanted), std::get<1>(wanted), std::get<2>(wanted), false});
  }
  auto maybe = [](const mha::Tensor& t) { return t.defined() ? MaybeArray(to_numpy(t)) : std::nullopt; };
  return {maybe(r.query), maybe(r.key), maybe(r.value), maybe(r.sinks)};
}

}  // namespace

NB_MODULE(_mha, m) {
  m.doc() = "Low-level bindings of the mha C++ library; use the `mha` package's functions instead.";
  // Modules referenced from PyTorch autograd graphs may still be alive when the interpreter exits;
  // that is not a leak of ours, so nanobind's exit-time report is off.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mha::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  nb::class_<mha::ForwardContext>(m, "_Context")
      .def("activations", [](const mha::ForwardContext& self) {
        const mha::SavedActivations a = self.activations();
        return std::make_tuple(to_numpy(a.q), to_numpy(a.k), to_numpy(a.v), to_numpy(a.attn), to_numpy(a.lse));
      });

  nb::class_<mha::MultiheadAttention>(m, "_Module")
      .def(
          "__init__",
          [](mha::MultiheadAttention* self, int64_t embed_dim, int64_t num_heads, double dropout, bool bias,
             bool add_bias_kv, bool add_zero_attn, std::optional<int64_t> kdim, std::optional<int64_t> vdim,
             bool batch_first, uint64_t seed, bool own_parameters) {
            mha::MultiheadAttentionOptions o;
            o.dropout = dropout;
            o.bias = bias;
            o.add_bias_kv = add_bias_kv;
            o.add_zero_attn = add_zero_attn;
            o.kdim = kdim;
            o.vdim = vdim;
            o.batch_first = batch_first;
            o.seed = seed;
            o.own_parameters = own_parameters;
            new (self) mha::MultiheadAttention(embed_dim, num_heads, o);
          },
          nb::arg("embed_dim"), nb::arg("num_heads"), nb::arg("dropout"), nb::arg("bias"), nb::arg("add_bias_kv"),
          nb::arg("add_zero_attn"), nb::arg("kdim").none(), nb::arg("vdim").none(), nb::arg("batch_first"),
          nb::arg("seed"), nb::arg("own_parameters") = true)
      .def("forward", &module_forward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("key_padding_mask").none(), nb::arg("need_weights"), nb::arg("attn_mask").none(),
           nb::arg("average_attn_weights"), nb::arg("is_causal"), nb::arg("dropout_seed").none(),
           nb::arg("num_threads"), nb::arg("params").none() = nb::none())
      .def("forward_train", &module_forward_train, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("key_padding_mask").none(), nb::arg("need_weights"), nb::arg("attn_mask").none(),
           nb::arg("average_attn_weights"), nb::arg("is_causal"), nb::arg("dropout_seed").none(),
           nb::arg("num_threads"), nb::arg("params").none() = nb::none())
      .def("backward", &module_backward, nb::arg("context"), nb::arg("grad_output"),
           nb::arg("params").none() = nb::none(), nb::arg("wanted") = std::make_tuple(true, true, true),
           nb::arg("frozen") = std::vector<std::string>(), nb::arg("masks_wanted") = std::make_tuple(false, false),
           nb::arg("grad_weights").none() = nb::none())
      .def("backward_restored", &module_backward_restored, nb::arg("query"), nb::arg("key"), nb::arg("value"),
           nb::arg("key_padding_mask").none(), nb::arg("attn_mask").none(), nb::arg("is_causal"),
           nb::arg("dropout_seed").none(), nb::arg("num_threads"), nb::arg("activations"), nb::arg("grad_output"),
           nb::arg("params").none(), nb::arg("wanted"), nb::arg("frozen"),
           nb::arg("masks_wanted") = std::make_tuple(false, false), nb::arg("grad_weights").none() = nb::none(),
           nb::arg("average_attn_weights") = true)
      .def("train", &mha::MultiheadAttention::train, nb::arg("on"))
      .def_prop_ro("training", &mha::MultiheadAttention::is_training)
      .def_prop_ro("embed_dim", &mha::MultiheadAttention::embed_dim)
      .def_prop_ro("num_heads", &mha::MultiheadAttention::num_heads)
      .def_prop_ro("head_dim", &mha::MultiheadAttention::head_dim)
      .def_prop_ro("kdim", &mha::MultiheadAttention::kdim)
      .def_prop_ro("vdim", &mha::MultiheadAttention::vdim)
      .def("parameters",
           [](const mha::MultiheadAttention& self) {
             std::vector<std::pair<std::string, NumpyArray>> out;
             for (const auto& [name, t] : self.named_parameters()) out.emplace_back(name, to_numpy(t.clone()));
             return out;
           })
      .def(
          "load_state_dict",
          [](mha::MultiheadAttention& self, const std::unordered_map<std::string, Array>& state, bool strict) {
            std::unordered_map<std::string, mha::TensorView> views;
            for (const auto& [name, a] : state) views.emplace(name, view_of(a, name));
            self.load_state_dict(views, strict);
          },
          nb::arg("state"), nb::arg("strict"))
      .def("reset_parameters", &mha::MultiheadAttention::reset_parameters, nb::arg("seed"))
      .def(
          "to",
          [](mha::MultiheadAttention& self, const std::string& dtype) {
            for (const mha::DType t : {mha::DType::f32, mha::DType::f64, mha::DType::bf16, mha::DType::f16}) {
              if (dtype == mha::dtype_name(t)) return self.to(t);
            }
            throw nb::value_error(("dtype: expected float32, float64, bfloat16 or float16 for the module's parameters, got " +
                                   dtype).c_str());
          },
          nb::arg("dtype"))
      .def_prop_ro("dtype", [](const mha::MultiheadAttention& self) { return std::string(mha::dtype_name(self.dtype())); });

  m.def("sdpa", &sdpa, nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("attn_mask").none(),
        nb::arg("dropout_p"), nb::arg("is_causal"), nb::arg("scale").none(), nb::arg("softcap"), nb::arg("enable_gqa"),
        nb::arg("dropout_seed"), nb::arg("need_weights"), nb::arg("bottom_right"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("alibi_slopes").none(), nb::arg("num_threads"), nb::arg("sinks").none() = nb::none(),
        nb::arg("k_descale").none() = nb::none(), nb::arg("v_descale").none() = nb::none());
  m.def(
      "load_safetensors",
      [](const std::string& path) {
        mha::SafetensorsFile f;
        {
          nb::gil_scoped_release release;
          f = mha::load_safetensors(path);
        }
        std::unordered_map<std::string, NumpyArray> tensors;
        for (const auto& [name, t] : f.tensors) tensors.emplace(name, to_numpy(t, /*bf16_bits=*/false));
        return std::make_pair(tensors, std::unordered_map<std::string, std::string>(f.metadata.begin(), f.metadata.end()));
      },
      nb::arg("path"));
  m.def(
      "save_safetensors",
      [](const std::string& path, const std::unordered_map<std::string, Array>& tensors,
         const std::unordered_map<std::string, std::string>& metadata) {
        std::map<std::string, mha::TensorView> views;
        for (const auto& [name, a] : tensors) views.emplace(name, view_of(a, name));
        nb::gil_scoped_release release;
        mha::save_safetensors(path, views, std::map<std::string, std::string>(metadata.begin(), metadata.end()));
      },
      nb::arg("path"), nb::arg("tensors"), nb::arg("metadata"));
  m.def("sdpa_train", &sdpa_train, nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("attn_mask").none(),
        nb::arg("dropout_p"), nb::arg("is_causal"), nb::arg("scale").none(), nb::arg("softcap"), nb::arg("enable_gqa"),
        nb::arg("dropout_seed"), nb::arg("bottom_right"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("alibi_slopes").none(), nb::arg("num_threads"), nb::arg("sinks").none() = nb::none(),
        nb::arg("k_descale").none() = nb::none(), nb::arg("v_descale").none() = nb::none());
  m.def("sdpa_backward", &sdpa_backward, nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("output"),
        nb::arg("lse"), nb::arg("grad_output"), nb::arg("attn_mask").none(), nb::arg("dropout_p"),
        nb::arg("is_causal"), nb::arg("scale").none(), nb::arg("softcap"), nb::arg("enable_gqa"), nb::arg("dropout_seed"),
        nb::arg("bottom_right"), nb::arg("window_left"), nb::arg("window_right"), nb::arg("alibi_slopes").none(), nb::arg("num_threads"),
        nb::arg("attn_mask_grad"),
        nb::arg("wanted") = std::make_tuple(true, true, true), nb::arg("sinks").none() = nb::none());
  m.def("sdpa_varlen", &sdpa_varlen, nb::arg("query"), nb::arg("key"), nb::arg("value"), nb::arg("cu_seqlens_q"),
        nb::arg("cu_seqlens_k"), nb::arg("dropout_p"), nb::arg("is_causal"), nb::arg("scale").none(), nb::arg("softcap"),
        nb::arg("enable_gqa"), nb::arg("dropout_seed"), nb::arg("bottom_right"), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("alibi_slopes").none(), nb::arg("num_threads"), nb::arg("sinks").none() = nb::none(),
        nb::arg("k_descale").none() = nb::none(), nb::arg("v_descale").none() = nb::none());
  m.def("sdpa_varlen_train", &sdpa_varlen_train, nb::arg("query"), nb::arg("key"), nb::arg("value"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("dropout_p"), nb::arg("is_causal"),
        nb::arg("scale").none(), nb::arg("softcap"), nb::arg("enable_gqa"), nb::arg("dropout_seed"), nb::arg("bottom_right"),
        nb::arg("window_left"), nb::arg("window_right"), nb::arg("alibi_slopes").none(), nb::arg("num_threads"),
        nb::arg("sinks").none() = nb::none(), nb::arg("k_descale").none() = nb::none(), nb::arg("v_descale").none() = nb::none());
  m.def("sdpa_varlen_backward", &sdpa_varlen_backward, nb::arg("query"), nb::arg("key"), nb::arg("value"),
        nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"), nb::arg("output"), nb::arg("lse"), nb::arg("grad_output"),
        nb::arg("dropout_p"), nb::arg("is_causal"), nb::arg("scale").none(), nb::arg("softcap"), nb::arg("enable_gqa"),
        nb::arg("dropout_seed"), nb::arg("bottom_right"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("alibi_slopes").none(), nb::arg("num_threads"), nb::arg("wanted") = std::make_tuple(true, true, true),
        nb::arg("sinks").none() = nb::none());
  m.def("paged_attention", &paged_attention, nb::arg("query"), nb::arg("key_cache"), nb::arg("value_cache"),
        nb::arg("block_table"), nb::arg("cache_seqlens"), nb::arg("is_causal"), nb::arg("scale").none(), nb::arg("softcap"),
        nb::arg("enable_gqa"), nb::arg("bottom_right"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("alibi_slopes").none(), nb::arg("num_threads"), nb::arg("cu_seqlens_q").none(),
        nb::arg("return_lse") = false, nb::arg("sinks").none() = nb::none(), nb::arg("k_descale").none() = nb::none(), nb::arg("v_descale").none() = nb::none());
  m.def("write_paged_cache", &write_paged_cache, nb::arg("key"), nb::arg("value"), nb::arg("key_cache"),
        nb::arg("value_cache"), nb::arg("block_table"), nb::arg("cache_seqlens"),
        nb::arg("cu_seqlens_new").none() = nb::none(), nb::arg("k_descale").none() = nb::none(), nb::arg("v_descale").none() = nb::none());
  m.def("varlen_dropout_seed", &mha::varlen_dropout_seed, nb::arg("seed"), nb::arg("sequence"));
  m.def("set_num_threads", &mha::set_num_threads, nb::arg("n"));
  m.def("get_num_threads", &mha::get_num_threads);
  m.def("cpu_isa", &mha::cpu_isa);
  m.def("bfloat16_products", &mha::bfloat16_products);
  m.def("openmp_available", &mha::openmp_available);
  m.def("host_cache_bytes", &mha::host_cache_bytes);
  m.def("release_host_cache", &mha::release_host_cache);
  m.def(
      "set_threading",
      [](const std::string& name) {
        if (name == "pool") return mha::set_threading(mha::Threading::pool);
        if (name == "openmp") return mha::set_threading(mha::Threading::openmp);
        throw nb::value_error(("threading: expected 'pool' or 'openmp', got '" + name + "'").c_str());
      },
      nb::arg("threading"));
  m.def("get_threading", [] { return mha::get_threading() == mha::Threading::openmp ? "openmp" : "pool"; });
}
