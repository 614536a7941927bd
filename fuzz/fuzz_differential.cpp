// Differential: a small random SDPA problem through the fused kernels and the float64 reference.
// The input picks the ISA (every one this CPU runs), the layouts (contiguous [B, H, L, D] or a
// transposed view of [B, L, H, D] storage), GQA, causality and its alignment, a bool or additive
// mask (with -inf entries, broadcast or not; bands and padding that exclude whole blocks; huge
// finite values, Hugging Face's), a sliding window, ALiBi's slopes, attention sinks, soft-capping, scale, dropout and the thread
// count; float8 keys and values for a sixth of the float32 inputs (forward only); then, for a
// quarter of the inputs, the backward. Aborts when
//   - an output, weight or gradient is NaN or infinite (the inputs are finite and bounded by 3), or
//   - the normwise relative error max|fused - ref| / max|ref| of the output (with and without
//     weights), of the weights or of a gradient exceeds 1e-4.
// Scores stay below ~120 in magnitude (|x| <= 3, Dk <= 41, scale <= 2/sqrt(Dk)), so their fp32
// rounding moves the weights by ~1e-5 at most: 1e-4 is a bound a correct kernel always meets.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "fuzz_input.hpp"
#include "normwise.hpp"
#include "mha/mha.hpp"

// A compile-time knob only to check that the target can fail (build with -DMHA_FUZZ_TOLERANCE=1e-12).
#ifndef MHA_FUZZ_TOLERANCE
#define MHA_FUZZ_TOLERANCE 1e-4
#endif

namespace {

// A [B, H, L, D] tensor of values uniform in [-amplitude, amplitude], stored contiguous or as
// [B, L, H, D] (then viewed transposed, as a batch-first caller passes it). `owner` keeps the
// storage. The input bytes choose the structure; the values come from a generator seeded by them,
// so that even short inputs give full tensors.
mha::TensorView tensor(FuzzInput& in, std::mt19937_64& rng, float amplitude, int64_t B, int64_t H, int64_t L,
                       int64_t D, mha::Tensor& owner) {
  const bool transposed = in.flag();
  owner = transposed ? mha::Tensor::empty({B, L, H, D}) : mha::Tensor::empty({B, H, L, D});
  std::uniform_real_distribution<float> u(-amplitude, amplitude);
  for (int64_t i = 0; i < owner.numel(); ++i) owner.data<float>()[i] = u(rng);
  return transposed ? owner.view().transpose(1, 2) : owner.view();
}

[[noreturn]] void fail(const char* what, double err, double scale, int64_t B, int64_t Hq, int64_t Lq, int64_t Lk) {
  std::fprintf(stderr, "%s: normwise error %.3e (scale %.3e), ISA %s, B=%lld Hq=%lld Lq=%lld Lk=%lld\n", what, err,
               scale, std::string(mha::detail::isa_name(mha::detail::active_isa())).c_str(),
               static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Lq),
               static_cast<long long>(Lk));
  __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in{data, size};
  static const std::vector<mha::detail::Isa> isas = mha::detail::supported_isas();
  mha::detail::force_isa(isas[in.byte() % isas.size()]);

  const int64_t B = 1 + in.small(1), Hkv = 1 + in.small(2), group = 1 + in.small(2), Hq = Hkv * group;
  // Up to 151 queries and keys: several blocks of the tile kernels (48 queries, 64 or 72 keys), so
  // that structured masks below exclude whole blocks, which the kernels skip.
  const int64_t Lq = 1 + in.small(150), Lk = 1 + in.small(150), Dk = 1 + in.small(40), Dv = 1 + in.small(40);
  std::mt19937_64 rng(in.u64());
  static const float amplitudes[] = {0.25f, 1.0f, 3.0f};
  const float amplitude = amplitudes[in.small(2)];
  mha::Tensor qs, ks, vs;
  mha::TensorView q = tensor(in, rng, amplitude, B, Hq, Lq, Dk, qs), k = tensor(in, rng, amplitude, B, Hkv, Lk, Dk, ks),
                  v = tensor(in, rng, amplitude, B, Hkv, Lk, Dv, vs);
  mha::SdpaOptions o;
  o.enable_gqa = group > 1;
  switch (in.tail_byte() % 6) {  // batch dimensions that broadcast (the output stays [B, Hq, Lq, Dv])
    case 1: k = k.select(0, 0), v = v.select(0, 0); break;  // keys and values shared by the batch: [Hkv, Lk, D]
    case 2: q = q.slice(0, 0, 1); break;                     // one query set for every batch entry
    case 3: k = k.slice(1, 0, 1), v = v.slice(1, 0, 1), o.enable_gqa = false; break;  // one head for all, no enable_gqa
    default: break;
  }
  o.is_causal = in.flag();
  o.causal_alignment = in.flag() ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (in.flag()) o.dropout_p = 0.25, o.dropout_seed = in.byte();
  if (in.flag()) o.scale = (0.05 + in.small(39) / 20.0) / std::sqrt(static_cast<double>(Dk));  // 0.05x to 2x the default
  o.num_threads = 1 + static_cast<int>(in.small(2));
  // A sliding window (read from the end: kept inputs keep their meaning): none, one side or both,
  // from the diagonal alone to wider than the sequences.
  const uint8_t w = in.tail_byte();
  if (w % 4 == 1 || w % 4 == 3) o.window_left = (w >> 2) % 2 == 0 ? (w >> 3) % 4 : (w >> 3) % 32 * 5;
  if (w % 4 == 2 || w % 4 == 3) o.window_right = (w >> 2) % 2 == 0 ? (w >> 4) % 3 : (w >> 4) % 16 * 9;
  mha::Tensor mask;
  switch (in.small(6)) {
    case 1: {  // bool [Lq, Lk], true = attend
      mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
      const uint64_t keep = 1 + in.small(8);  // attend with probability keep / 9
      for (int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = rng() % 9 < keep;
      break;
    }
    case 2: {  // bool [Lk], broadcast over rows: padding
      mask = mha::Tensor::empty({Lk}, mha::DType::boolean);
      for (int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = rng() % 4 != 0;
      break;
    }
    case 3: {  // additive [B or 1, Hq or 1, Lq, Lk] with some -inf
      mask = mha::Tensor::empty({in.flag() ? B : 1, in.flag() ? Hq : 1, Lq, Lk});
      const uint64_t excluded = in.small(8);  // -inf with probability excluded / 9, else in [-4, 4]
      std::uniform_real_distribution<float> u(-4.0f, 4.0f);
      for (int64_t i = 0; i < mask.numel(); ++i) {
        mask.data<float>()[i] = rng() % 9 < excluded ? -std::numeric_limits<float>::infinity() : u(rng);
      }
      break;
    }
    case 4: {  // bool [Lq, Lk] band: query i attends keys [i + lo, i + hi] (a causal or local window as a tensor)
      mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
      const int64_t lo = -static_cast<int64_t>(in.small(80)), hi = lo + static_cast<int64_t>(in.small(80));
      for (int64_t i = 0; i < Lq; ++i)
        for (int64_t j = 0; j < Lk; ++j) mask.data<bool>()[i * Lk + j] = j - i >= lo && j - i <= hi;
      break;
    }
    case 5: {  // bool [B, 1, 1, Lk] padding: batch entry b attends its first length_b keys (0 to Lk)
      mask = mha::Tensor::empty({B, 1, 1, Lk}, mha::DType::boolean);
      for (int64_t b = 0; b < B; ++b) {
        const int64_t length = static_cast<int64_t>(rng() % static_cast<uint64_t>(Lk + 1));
        for (int64_t j = 0; j < Lk; ++j) mask.data<bool>()[b * Lk + j] = j < length;
      }
      break;
    }
    case 6: {  // additive [B, 1, Lq, Lk] as Hugging Face builds it: huge finite values, not -inf, where hidden
      mask = mha::Tensor::zeros({B, 1, Lq, Lk});
      static const float huge[] = {std::numeric_limits<float>::lowest(), -2e38f, -1e38f, -1e35f};
      const float fill = huge[in.small(3)], other = huge[in.small(3)];  // a second value in some places
      const bool causal = in.flag();
      for (int64_t b = 0; b < B; ++b) {
        const int64_t pad = static_cast<int64_t>(rng() % static_cast<uint64_t>(Lk + 1));  // left padding
        for (int64_t i = 0; i < Lq; ++i)
          for (int64_t j = 0; j < Lk; ++j)
            if (j < pad || (causal && j > i + Lk - Lq)) mask.data<float>()[(b * Lq + i) * Lk + j] = rng() % 5 ? fill : other;
      }
      break;
    }
    default: break;
  }
  if (mask.defined()) o.attn_mask = mask.view();

  // float64 (a tail byte, for a sixth of the inputs): the same problem in float64, whose kernel
  // must agree with the reference to float64 rounding, forward and backward.
  const bool float64 = in.tail_byte() % 6 == 5;
  // ALiBi (the next tail byte): none, slopes per head or per batch entry and head, BLOOM's
  // 2^(-8 h / H) times 1/16 to 1, or of either sign (biases below 300: the float32 sums of scores
  // and biases round by 2e-5 at most, within the 1e-4 bound).
  const uint8_t a = in.tail_byte();
  mha::Tensor slopes;
  if (a % 3 != 0) {
    slopes = a % 3 == 1 ? mha::Tensor::empty({Hq}) : mha::Tensor::empty({B, Hq});
    static const float factors[] = {0.0625f, 0.25f, 0.5f, 1.0f};
    const float factor = factors[(a >> 2) % 4];
    const bool signed_slopes = (a >> 4) % 4 == 0;
    for (int64_t x = 0; x < slopes.numel(); ++x) {
      const float base = factor * std::exp2(-8.0f * static_cast<float>(x % Hq + 1) / static_cast<float>(Hq));
      slopes.data<float>()[x] = signed_slopes && rng() % 2 ? -base : base;
    }
    o.alibi_slopes = slopes.view();
  }
  // Attention sinks (the next tail byte, a quarter of the inputs): one per query head, around the
  // scores or far above and below them.
  const uint8_t k_byte = in.tail_byte();
  mha::Tensor sinks;
  if (k_byte % 4 == 1) {
    sinks = mha::Tensor::empty({Hq});
    std::uniform_real_distribution<float> around(-4.0f, 4.0f);
    for (int64_t h = 0; h < Hq; ++h) {
      const int kind = (k_byte >> 2) % 8;
      sinks.data<float>()[h] = kind == 0 ? 30.0f : kind == 1 ? -30.0f : around(rng);
    }
    o.sinks = sinks.view();
  }
  // Logit soft-capping (the next tail byte, a quarter of the inputs): caps that bend the scores
  // hard (0.25) to barely (50).
  const uint8_t c_byte = in.tail_byte();
  if (c_byte % 4 == 1) {
    static const double caps[] = {0.25, 1.0, 5.0, 50.0};
    o.softcap = caps[(c_byte >> 2) % 4];
  }
  if (float64) {
    mha::Tensor sinks64;
    if (sinks.defined()) {
      sinks64 = mha::Tensor::copy_of(sinks, mha::DType::f64);
      o.sinks = sinks64.view();
    }
    const mha::Tensor q64 = mha::Tensor::copy_of(q, mha::DType::f64), k64 = mha::Tensor::copy_of(k, mha::DType::f64),
                      v64 = mha::Tensor::copy_of(v, mha::DType::f64);
    mha::Tensor mask64;  // an additive mask in float64 too, as PyTorch takes it (its gradient is then float64)
    if (mask.defined() && mask.dtype() == mha::DType::f32) {
      mask64 = mha::Tensor::copy_of(mask, mha::DType::f64);
      o.attn_mask = mask64.view();
    }
    const auto saved = mha::scaled_dot_product_attention_for_training(q64, k64, v64, o);
    const auto ref = mha::reference::scaled_dot_product_attention(q64, k64, v64, o);
    double scale = 0, err = 0;
    if ((err = normwise(saved.output, ref.output, &scale)) > 1e-10) fail("float64 output", err, scale, B, Hq, Lq, Lk);
    mha::Tensor grad = mha::Tensor::empty(saved.output.sizes(), mha::DType::f64);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t i = 0; i < grad.numel(); ++i) grad.data<double>()[i] = u(rng);
    const bool mask_grad = mask.defined() && mask.dtype() == mha::DType::f32;
    const auto g = mha::scaled_dot_product_attention_backward(q64, k64, v64, saved, grad, o, mask_grad);
    const auto r = mha::reference::scaled_dot_product_attention_backward(q64, k64, v64, grad, o);
    mha::Tensor floor = mha::Tensor::empty({1}, mha::DType::f64);
    floor.data<double>()[0] = 1.0;  // gradients that cancel: against at least 1
    if ((err = normwise(g.query, r.query, &scale, floor)) > 1e-10) fail("float64 dq", err, scale, B, Hq, Lq, Lk);
    if ((err = normwise(g.key, r.key, &scale, floor)) > 1e-10) fail("float64 dk", err, scale, B, Hq, Lq, Lk);
    if ((err = normwise(g.value, r.value, &scale, floor)) > 1e-10) fail("float64 dv", err, scale, B, Hq, Lq, Lk);
    if (mask_grad && (err = normwise(*g.attn_mask, r.attn_mask, &scale, floor)) > 1e-10)
      fail("float64 dmask", err, scale, B, Hq, Lq, Lk);
    if (sinks.defined() && (err = normwise(g.sinks, r.sinks, &scale, floor)) > 1e-10)
      fail("float64 dsinks", err, scale, B, Hq, Lq, Lk);
    return 0;
  }
  // float8 keys and values (the next tail byte, a sixth of the float32 inputs): rounded to e4m3 or
  // e5m2, the forward against the reference on those values, and the bits of the float32 call on
  // them widened (the kernels widen each element exactly).
  // With scales (half of them: k_descale and v_descale, powers of two per batch entry and key/value
  // head, so that the kernels' folding into the softmax scale and the output's 1 / l moves no
  // rounding), the widened call's keys and values are multiplied by them.
  if (const uint8_t f_byte = in.tail_byte(); f_byte % 6 == 1) {
    const mha::DType eight = (f_byte >> 3) % 2 ? mha::DType::f8e5m2 : mha::DType::f8e4m3;
    const mha::Tensor k8 = mha::Tensor::copy_of(k, eight), v8 = mha::Tensor::copy_of(v, eight);
    mha::Tensor k32 = mha::Tensor::copy_of(k8, mha::DType::f32), v32 = mha::Tensor::copy_of(v8, mha::DType::f32);
    mha::Tensor k_scales, v_scales;
    if ((f_byte >> 4) % 2 && k.ndim == 4) {  // (keys of their own per batch entry: the widened copies keep their layout)
      const int64_t heads = k.shape[1];
      k_scales = mha::Tensor::empty({B, heads}), v_scales = mha::Tensor::empty({B, heads});
      for (int64_t i = 0; i < B * heads; ++i) {
        k_scales.data<float>()[i] = std::ldexp(1.0f, static_cast<int>(rng() % 4) - 2);  // 1/4 to 2
        v_scales.data<float>()[i] = std::ldexp(1.0f, static_cast<int>(rng() % 7) - 3);  // 1/8 to 8
      }
      o.k_descale = k_scales.view(), o.v_descale = v_scales.view();
      // The keys and values scaled, one [B, heads, L, D] copy each (k may be shared by the batch).
      auto scale_heads = [&](mha::Tensor& x32, const mha::Tensor& scales) {  // x32 is contiguous [B, heads, L, D]
        const int64_t per_head = x32.numel() / (B * heads);
        for (int64_t t = 0; t < B * heads; ++t)
          for (int64_t e = 0; e < per_head; ++e) x32.data<float>()[t * per_head + e] *= scales.data<float>()[t];
      };
      scale_heads(k32, k_scales), scale_heads(v32, v_scales);
    }
    const auto fused = mha::scaled_dot_product_attention_with_weights(q, k8, v8, o);
    const mha::Tensor plain = mha::scaled_dot_product_attention(q, k8, v8, o);
    const auto ref = mha::reference::scaled_dot_product_attention(q, k8, v8, o);
    double scale = 0, err = 0;
    if ((err = normwise(fused.output, ref.output, &scale)) > MHA_FUZZ_TOLERANCE) fail("float8 output (with weights)", err, scale, B, Hq, Lq, Lk);
    if ((err = normwise(plain, ref.output, &scale)) > MHA_FUZZ_TOLERANCE) fail("float8 output", err, scale, B, Hq, Lq, Lk);
    if ((err = normwise(fused.weights, ref.weights, &scale)) > MHA_FUZZ_TOLERANCE) fail("float8 weights", err, scale, B, Hq, Lq, Lk);
    mha::SdpaOptions widened = o;  // (the scales are in k32 and v32)
    widened.k_descale.reset(), widened.v_descale.reset();
    const mha::Tensor wide = mha::scaled_dot_product_attention(q, k32, v32, widened);
    if (std::memcmp(plain.data<float>(), wide.data<float>(), sizeof(float) * static_cast<size_t>(plain.numel())) != 0)
      fail("float8 output against its widened call", normwise(plain, wide, &scale), scale, B, Hq, Lq, Lk);
    return 0;
  }
  const auto fused = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
  const mha::Tensor plain = mha::scaled_dot_product_attention(q, k, v, o);
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
  double scale = 0, err = 0;
  if ((err = normwise(fused.output, ref.output, &scale)) > MHA_FUZZ_TOLERANCE) fail("output (with weights)", err, scale, B, Hq, Lq, Lk);
  if ((err = normwise(plain, ref.output, &scale)) > MHA_FUZZ_TOLERANCE) fail("output", err, scale, B, Hq, Lq, Lk);
  if ((err = normwise(fused.weights, ref.weights, &scale)) > MHA_FUZZ_TOLERANCE) fail("weights", err, scale, B, Hq, Lq, Lk);
  if (in.small(3) != 0) return 0;  // (a quarter of the inputs: the float64 backwards are slow)

  // The backward, with the mask's gradient where the mask is additive. Gradients are longer float32
  // chains: within 1e-4 of each one's largest value, or of 5% of the largest of them all and of dV
  // with |dO| (the same sums without their cancellation), as tests/test_backward.cpp judges them.
  mha::Tensor grad = mha::Tensor::empty({B, Hq, Lq, Dv}), grad_magnitude = mha::Tensor::empty({B, Hq, Lq, Dv});
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t i = 0; i < grad.numel(); ++i) grad_magnitude.data<float>()[i] = std::fabs(grad.data<float>()[i] = u(rng));
  const bool mask_grad = mask.defined() && mask.dtype() == mha::DType::f32;
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o, mask_grad);
  const auto r = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
  const auto magnitude = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad_magnitude, o);
  auto largest = [](const mha::Tensor& t) {
    double m = 0;
    const mha::Tensor d = mha::Tensor::copy_of(t.view(), mha::DType::f64);
    for (int64_t i = 0; i < d.numel(); ++i) m = std::max(m, std::fabs(d.data<double>()[i]));
    return m;
  };
  mha::Tensor floor = mha::Tensor::empty({1}, mha::DType::f64);  // (normwise's scale is at least this)
  floor.data<double>()[0] = 0.05 * std::max({largest(r.query), largest(r.key), largest(r.value), largest(magnitude.value)});
  if ((err = normwise(g.query, r.query, &scale, floor)) > MHA_FUZZ_TOLERANCE) fail("dq", err, scale, B, Hq, Lq, Lk);
  if ((err = normwise(g.key, r.key, &scale, floor)) > MHA_FUZZ_TOLERANCE) fail("dk", err, scale, B, Hq, Lq, Lk);
  if ((err = normwise(g.value, r.value, &scale, floor)) > MHA_FUZZ_TOLERANCE) fail("dv", err, scale, B, Hq, Lq, Lk);
  if (mask_grad && (err = normwise(*g.attn_mask, r.attn_mask, &scale, floor)) > MHA_FUZZ_TOLERANCE)
    fail("dmask", err, scale, B, Hq, Lq, Lk);
  if (sinks.defined() && (err = normwise(g.sinks, r.sinks, &scale, floor)) > MHA_FUZZ_TOLERANCE)
    fail("dsinks", err, scale, B, Hq, Lq, Lk);
  return 0;
}
