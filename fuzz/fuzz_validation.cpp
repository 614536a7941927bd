// Option and shape validation of SDPA (forward, _into, training forward and backward), of
// variable-length SDPA (offsets too), and of
// MultiheadAttention (construction, forward, backward, on its own parameters or given ones):
// random ranks, sizes (0 to 2^62), strides (0 included), dtypes, masks, flags, scales, dropout
// probabilities, thread counts.
//
// The expected outcome of every call is a result or an mha::Error, never a crash, a sanitizer
// report or another exception. Beyond that:
//   - a call that succeeds on finite inputs returns finite values (inputs here are all finite);
//   - a call given a null data pointer for a non-empty tensor must throw.
// Calls run for real only when they are tiny: every argument fits a buffer of kMaxElements and has
// at most kMaxNumel elements, and (query rows) x (key rows) <= kMaxPairs. Larger and absurd sizes still go through validation:
// the public functions get null data (so they must refuse), and the internal validators
// (detail::make_sdpa_problem, detail::validate_module_call), which never touch the data, get a
// non-null placeholder so that every later check is reached.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "core/attention_problem.hpp"
#include "fuzz_args.hpp"
#include "fuzz_input.hpp"
#include "mha/mha.hpp"
#include "module/module_call.hpp"

namespace {

using namespace fuzz_args;

void fuzz_sdpa(FuzzInput& in) {
  Arg q = make(in, 6), k = make(in, 6), v = make(in, 6), mask = make(in, 6);
  mha::SdpaOptions o, op;  // op: the same options with the placeholder mask
  const bool with_mask = in.flag();
  if (with_mask) o.attn_mask = mask.view, op.attn_mask = mask.placeholder;
  fuzz_options(in, o);
  op.is_causal = o.is_causal, op.causal_alignment = o.causal_alignment, op.scale = o.scale;
  op.enable_gqa = o.enable_gqa, op.dropout_p = o.dropout_p, op.num_threads = o.num_threads;
  op.window_left = o.window_left, op.window_right = o.window_right, op.alibi_slopes = o.alibi_slopes;
  op.k_descale = o.k_descale, op.v_descale = o.v_descale;

  // The validator on every size, absurd ones included.
  try {
    mha::detail::make_sdpa_problem(q.placeholder, k.placeholder, v.placeholder, op,
                                   mha::detail::InputDtypes::fused);
  } catch (const mha::Error&) {
  }
  const int variant = static_cast<int>(in.small(3));
  const bool runs = tiny(q) && tiny(k) && tiny(v) && (!with_mask || tiny(mask)) && small_pairs(q.view, k.view);
  if (!runs) {
    // Null data for a non-empty tensor: the public functions must refuse, whatever the sizes.
    if (has_null(q.view) || has_null(k.view) || has_null(v.view) || (with_mask && has_null(mask.view))) {
      must_refuse([&] { mha::scaled_dot_product_attention(q.view, k.view, v.view, o); });
      must_refuse([&] { mha::scaled_dot_product_attention_with_weights(q.view, k.view, v.view, o); });
    }
    return;
  }
  switch (variant) {
    case 0: check_finite_any(mha::scaled_dot_product_attention(q.view, k.view, v.view, o)); break;
    case 1: {
      const auto r = mha::scaled_dot_product_attention_with_weights(q.view, k.view, v.view, o);
      check_finite_any(r.output);
      check_finite_any(r.weights);
      break;
    }
    case 2: {  // into a fuzzed output view, or a well-formed one
      Arg out = make(in, 5);
      if (in.flag()) {
        const auto p = mha::detail::make_sdpa_problem(q.view, k.view, v.view, o, mha::detail::InputDtypes::fused);
        const mha::Tensor t = mha::Tensor::empty(mha::detail::output_shape(p, p.len_q, p.dim_v), q.view.dtype);
        mha::scaled_dot_product_attention_into(q.view, k.view, v.view, t, o);
        check_finite_any(t);
      } else if (tiny(out)) {
        mha::scaled_dot_product_attention_into(q.view, k.view, v.view, out.view, o);
      }
      break;
    }
    default: {  // training forward, then the backward with a fuzzed or well-formed gradient
      const auto saved = mha::scaled_dot_product_attention_for_training(q.view, k.view, v.view, o);
      check_finite_any(saved.output);
      Arg grad = make(in, 5);
      const bool mask_grad = in.flag();
      mha::Tensor g = saved.output.clone();
      const mha::TensorView gv = in.flag() ? g.view() : grad.view;
      if (!tiny(grad) && gv.data == grad.view.data) return;
      mha::SdpaGradientsWanted wanted{.attn_mask = mask_grad};
      if (in.flag()) wanted.query = in.flag(), wanted.key = in.flag(), wanted.value = in.flag();  // some left out
      const auto grads = mha::scaled_dot_product_attention_backward(q.view, k.view, v.view, saved, gv, o, wanted);
      // (16-bit gradients may overflow where the exact ones do: the same calls on float32 copies.)
      check_gradients(grads, [&] {
        const mha::Tensor wq = widened(q.view), wk = widened(k.view), wv = widened(v.view), wg = widened(gv);
        mha::Tensor wmask;
        mha::SdpaOptions wo = o;
        if (o.attn_mask) wmask = widened(*o.attn_mask), wo.attn_mask = wmask.view();
        const auto wsaved = mha::scaled_dot_product_attention_for_training(wq.view(), wk.view(), wv.view(), wo);
        return mha::scaled_dot_product_attention_backward(wq.view(), wk.view(), wv.view(), wsaved, wg.view(), wo, wanted);
      });
      break;
    }
  }
}

// Variable-length attention: fuzzed packed tensors and offsets (any count, order, sign and size;
// often well-formed at the ends), forward, or training forward then backward.
void fuzz_varlen(FuzzInput& in) {
  Arg q = make(in, 4), k = make(in, 4), v = make(in, 4);
  auto offsets = [&](const mha::TensorView& t) {
    std::vector<int64_t> cu;
    const int64_t n = in.small(6);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t step = in.small(9);  // (no step past the int64 limit: the offsets' own overflow is not tested here)
      cu.push_back(in.small(4) == 0 ? in.dim() : i == 0 ? 0 : cu.back() > INT64_MAX - step ? cu.back() : cu.back() + step);
    }
    if (!cu.empty() && t.ndim >= 1 && in.flag()) cu.back() = t.shape[0];
    return cu;
  };
  const std::vector<int64_t> cu_q = offsets(q.view), cu_k = in.flag() ? cu_q : offsets(k.view);
  mha::SdpaOptions o;
  fuzz_options(in, o);
  const bool runs = tiny(q) && tiny(k) && tiny(v) && small_pairs(q.view, k.view);
  if (!runs) {
    if (has_null(q.view) || has_null(k.view) || has_null(v.view)) {
      must_refuse([&] { mha::scaled_dot_product_attention_varlen(q.view, k.view, v.view, cu_q, cu_k, o); });
    }
    return;
  }
  if (in.flag()) {
    check_finite_any(mha::scaled_dot_product_attention_varlen(q.view, k.view, v.view, cu_q, cu_k, o));
    return;
  }
  const auto saved = mha::scaled_dot_product_attention_varlen_for_training(q.view, k.view, v.view, cu_q, cu_k, o);
  check_finite_any(saved.output);
  Arg grad = make(in, 4);
  const mha::Tensor g = saved.output.clone();
  const mha::TensorView gv = in.flag() ? g.view() : grad.view;
  if (!tiny(grad) && gv.data == grad.view.data) return;
  mha::SdpaGradientsWanted wanted;
  if (in.flag()) wanted.query = in.flag(), wanted.key = in.flag(), wanted.value = in.flag();
  const auto grads =
      mha::scaled_dot_product_attention_varlen_backward(q.view, k.view, v.view, cu_q, cu_k, saved, gv, o, wanted);
  check_gradients(grads, [&] {  // (as in fuzz_sdpa)
    const mha::Tensor wq = widened(q.view), wk = widened(k.view), wv = widened(v.view), wg = widened(gv);
    const auto wsaved =
        mha::scaled_dot_product_attention_varlen_for_training(wq.view(), wk.view(), wv.view(), cu_q, cu_k, o);
    return mha::scaled_dot_product_attention_varlen_backward(wq.view(), wk.view(), wv.view(), cu_q, cu_k, wsaved,
                                                             wg.view(), o, wanted);
  });
}

void fuzz_module(FuzzInput& in) {
  const int64_t heads = in.dim(), embed = in.dim();
  mha::MultiheadAttentionOptions mo;
  mo.bias = in.flag();
  mo.add_bias_kv = in.flag();
  mo.add_zero_attn = in.flag();
  if (in.flag()) mo.kdim = in.dim();
  if (in.flag()) mo.vdim = in.dim();
  mo.batch_first = in.flag();
  if (in.small(3) == 0) mo.dropout = in.value();
  mo.seed = in.byte();
  mo.own_parameters = in.small(3) != 1;  // without: only given parameters run it (0, past the end: with)
  const int64_t widest = std::max({embed, mo.kdim.value_or(0), mo.vdim.value_or(0)});
  if (widest > 256) {
    // Large modules are only constructed: where the largest weight matrix cannot be counted or
    // allocated (beyond 2^42 elements, 16 TiB) that must be an mha::Error; where it is small
    // (up to 2^20 elements) construction may succeed or refuse; sizes between would only slow
    // the fuzzer down (and trip its 4 GiB allocation limit).
    int64_t largest = 0;
    for (int64_t width : {embed, mo.kdim.value_or(embed), mo.vdim.value_or(embed)}) {
      int64_t n;
      if (embed <= 0 || width <= 0) continue;  // refused before any allocation
      largest = __builtin_mul_overflow(embed, width, &n) ? INT64_MAX : std::max(largest, n);
      if (largest == INT64_MAX) break;
    }
    // A module without parameters of its own allocates nothing: any size that can be counted
    // may construct.
    if (!mo.own_parameters) {
      mha::MultiheadAttention(embed, heads, mo);
    } else if (largest > (int64_t{1} << 42)) {
      must_refuse([&] { mha::MultiheadAttention(embed, heads, mo); });
    } else if (largest <= (int64_t{1} << 20)) {
      mha::MultiheadAttention(embed, heads, mo);  // inside the caller's catch of mha::Error
    }
    return;
  }
  mha::MultiheadAttention m(embed, heads, mo);
  Arg q = make(in, 4), k = make(in, 4), v = make(in, 4), mask = make(in, 4), kpm = make(in, 3);
  const bool self_k = in.flag(), self_v = in.flag();
  Arg& kk = self_k ? q : k;
  Arg& vv = self_v ? q : v;
  mha::ForwardOptions f, fp;
  const bool use_mask = in.flag(), use_kpm = in.flag();
  if (use_mask) f.attn_mask = mask.view, fp.attn_mask = mask.placeholder;
  if (use_kpm) f.key_padding_mask = kpm.view, fp.key_padding_mask = kpm.placeholder;
  f.need_weights = fp.need_weights = in.flag();
  f.average_attn_weights = fp.average_attn_weights = in.flag();
  f.is_causal = fp.is_causal = in.flag();
  if (in.flag()) f.dropout_seed = fp.dropout_seed = in.byte();
  f.num_threads = fp.num_threads = static_cast<int>(in.small(3));
  if (in.flag()) m.eval();
  // Sometimes the parameters are given as views (forward_with/backward_with): each the module's
  // own, a fuzzed view or missing, and sometimes a name the module does not have.
  // (A module without parameters of its own is given zeros where its own would go.)
  std::vector<Arg> given_storage;
  given_storage.reserve(8);
  std::vector<mha::Tensor> zeros;
  std::optional<mha::ParameterViews> given;
  if (in.flag()) {
    given.emplace();
    for (const auto& [name, shape] : m.parameter_shapes()) {
      const int64_t how = in.small(3);
      if (how == 0) continue;
      if (how == 1) {
        given_storage.push_back(make(in, 3));
        (*given)[name] = given_storage.back().view;
      } else if (mo.own_parameters) {
        (*given)[name] = m.parameter(name).view();
      } else {
        zeros.push_back(mha::Tensor::zeros(shape, m.dtype()));
        (*given)[name] = zeros.back().view();
      }
    }
    if (in.small(7) == 0) (*given)["junk"] = mha::TensorView(nullptr, mha::DType::f32, {0});
  }

  try {
    const auto call = mha::detail::validate_module_call(m, q.placeholder, kk.placeholder, vv.placeholder, fp);
    mha::detail::module_weights_shape(call, m.num_heads(), fp.average_attn_weights);
    mha::detail::module_output_shape(call, m, mo.batch_first);
  } catch (const mha::Error&) {
  }
  int64_t pairs_times_heads = 0;
  const bool appended_rows = mo.add_bias_kv || mo.add_zero_attn;
  const bool runs = tiny(q) && tiny(kk) && tiny(vv) && (!use_mask || tiny(mask)) && (!use_kpm || tiny(kpm)) &&
                    small_pairs(q.view, kk.view) && (!appended_rows || (rows_if_nonempty(q.view) <= kMaxPairs &&
                    rows_if_nonempty(kk.view) <= kMaxPairs && rows_if_nonempty(vv.view) <= kMaxPairs)) &&
                    !__builtin_mul_overflow(rows(q.view) * rows(kk.view), m.num_heads(), &pairs_times_heads) &&
                    pairs_times_heads <= (int64_t{1} << 20);
  if (!runs) {
    if (has_null(q.view) || has_null(kk.view) || has_null(vv.view) || (use_mask && has_null(mask.view)) ||
        (use_kpm && has_null(kpm.view))) {
      must_refuse([&] { m.forward(q.view, kk.view, vv.view, f); });
    }
    return;
  }
  if (in.flag()) {
    const auto r = given ? m.forward_with(*given, q.view, kk.view, vv.view, f) : m.forward(q.view, kk.view, vv.view, f);
    check_finite_any(r.output);
    if (r.weights) check_finite_any(*r.weights);
  } else {  // with a context, then the backward with a fuzzed or well-formed gradient
    mha::ForwardContext ctx;
    const auto r = given ? m.forward_with(*given, q.view, kk.view, vv.view, f, &ctx)
                         : m.forward(q.view, kk.view, vv.view, f, &ctx);
    check_finite_any(r.output);
    Arg grad = make(in, 4);
    const mha::Tensor g = r.output.clone();
    const mha::TensorView gv = in.flag() ? g.view() : grad.view;
    if (!tiny(grad) && gv.data == grad.view.data) return;
    const auto grads = given ? m.backward_with(*given, ctx, gv) : m.backward(ctx, gv);
    check_finite_any(grads.query);
    for (const auto& [name, t] : grads.parameters) check_finite_any(t);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in{data, size};
  try {
    if (in.tail_byte() % 8 == 1) {  // (a decision read from the end: kept inputs keep their meaning)
      fuzz_varlen(in);
    } else if (in.flag()) {
      fuzz_sdpa(in);
    } else {
      fuzz_module(in);
    }
  } catch (const mha::Error&) {
  }
  return 0;
}
