// float8 keys and values (PyTorch's float8_e4m3fn and float8_e5m2; a key/value cache held in 8
// bits): each format's conversions against its definition, value by value; every kernel that reads keys and
// values (the tile forward, the decoding kernel's row and dot modes, paged caches, packed
// sequences), on every ISA, against the float64 reference and against the same call on float32
// copies of the keys and values, whose bits it must give (the kernels widen each element exactly
// and then run the float32 arithmetic); and the calls that take no float8 (a float8 query,
// mixed caches, float64 queries, the backward) are clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::agree;
using mha_test::expect_error;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

// The value of a byte from the format's definition. e4m3: (-1)^s 2^(e-7) (1 + m/8), subnormals
// 2^-6 (m/8), 0x7f and 0xff NaN. e5m2: (-1)^s 2^(e-15) (1 + m/4), subnormals 2^-14 (m/4), e = 31
// infinity (m = 0) or NaN.
double e4m3_value(uint8_t bits) {
  const int s = bits >> 7, e = (bits >> 3) & 15, m = bits & 7;
  if ((bits & 0x7f) == 0x7f) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -magnitude : magnitude;
}
double e5m2_value(uint8_t bits) {
  const int s = bits >> 7, e = (bits >> 2) & 31, m = bits & 3;
  if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : s ? -INFINITY : INFINITY;
  const double magnitude = e == 0 ? std::ldexp(m / 4.0, -14) : std::ldexp(1.0 + m / 4.0, e - 15);
  return s ? -magnitude : magnitude;
}

// One format's conversions, for tests run on both.
struct Format {
  mha::DType dtype;
  double (*value)(uint8_t);
  float (*widen)(uint8_t);
  uint8_t (*round)(float);
  uint8_t largest;  // the largest finite magnitude's bits
};
const Format kFormats[] = {
    {mha::DType::f8e4m3, e4m3_value, [](uint8_t b) { return static_cast<float>(mha::float8_e4m3::from_bits(b)); },
     [](float x) { return mha::float8_e4m3(x).bits; }, 0x7e},
    {mha::DType::f8e5m2, e5m2_value, [](uint8_t b) { return static_cast<float>(mha::float8_e5m2::from_bits(b)); },
     [](float x) { return mha::float8_e5m2(x).bits; }, 0x7b},
};

TEST(Float8, WideningFollowsTheFormat) {
  for (const Format& f : kFormats) {
    SCOPED_TRACE(std::string(mha::dtype_name(f.dtype)));
    for (int b = 0; b < 256; ++b) {
      SCOPED_TRACE("byte " + std::to_string(b));
      const double want = f.value(static_cast<uint8_t>(b));
      const float got = f.widen(static_cast<uint8_t>(b));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got));
      } else {
        EXPECT_EQ(static_cast<double>(got), want);
        EXPECT_EQ(std::signbit(got), b >= 128);  // (-0 too)
      }
    }
  }
  EXPECT_EQ(kFormats[0].widen(0x7e), 448.0f);
  EXPECT_EQ(kFormats[0].widen(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(kFormats[1].widen(0x7b), 57344.0f);
  EXPECT_EQ(kFormats[1].widen(0x01), std::ldexp(1.0f, -16));
}

// Rounding to nearest, ties to the even mantissa, against a search over the finite values; beyond
// the largest finite value's range e4m3 saturates (infinities too) and e5m2 gives infinity; NaN
// kept: what PyTorch's conversions give.
TEST(Float8, RoundingIsToNearestEven) {
  std::mt19937_64 rng(test_seed());
  for (const Format& f : kFormats) {
    SCOPED_TRACE(std::string(mha::dtype_name(f.dtype)));
    auto nearest = [&](float x) {  // the nearest finite magnitude (ties to the even one), then x's sign
      double best = INFINITY;
      uint8_t pick = 0;
      for (int b = 0; b <= f.largest; ++b) {
        const double d = std::abs(f.value(static_cast<uint8_t>(b)) - std::abs(static_cast<double>(x)));
        if (d < best || (d == best && (b & 1) == 0)) best = d, pick = static_cast<uint8_t>(b);
      }
      return static_cast<uint8_t>(pick | (std::signbit(x) ? 0x80 : 0));
    };
    const double top = f.value(f.largest);
    std::uniform_real_distribution<double> exponent(f.dtype == mha::DType::f8e4m3 ? -12.0 : -20.0, std::log2(top));
    for (int n = 0; n < 20000; ++n) {
      const float x = static_cast<float>((n % 2 ? -1 : 1) * std::exp2(exponent(rng)));
      ASSERT_EQ(f.round(x), nearest(x)) << "x = " << x;
    }
    for (int b = 0; b < 256; ++b) {  // every value and every midpoint between neighbours
      if ((b & 0x7f) > f.largest) continue;
      EXPECT_EQ(f.round(f.widen(static_cast<uint8_t>(b))), b);
      if ((b & 0x7f) < f.largest) {
        const float mid = static_cast<float>((f.value(static_cast<uint8_t>(b)) + f.value(static_cast<uint8_t>(b + 1))) / 2);
        EXPECT_EQ(f.round(mid), (b & 1) ? b + 1 : b) << "midpoint above byte " << b;
      }
    }
    EXPECT_EQ(f.round(NAN) & 0x7f, 0x7f);
    const mha::Tensor wide = randn({300}, rng);
    const mha::Tensor narrow = mha::Tensor::copy_of(wide, f.dtype);
    for (int64_t i = 0; i < 300; ++i) EXPECT_EQ(narrow.data<uint8_t>()[i], f.round(wide.data<float>()[i]));
  }
  for (float x : {448.5f, 464.0f, 470.0f, 480.0f, 1e6f, 3e38f, INFINITY}) {  // e4m3 saturates
    EXPECT_EQ(mha::float8_e4m3(x).bits, 0x7e) << "x = " << x;
    EXPECT_EQ(mha::float8_e4m3(-x).bits, 0xfe) << "x = " << -x;
  }
  EXPECT_EQ(mha::float8_e5m2(61439.0f).bits, 0x7b);  // e5m2: below the midpoint to 65536, 57344
  for (float x : {61440.0f, 65536.0f, 1e6f, INFINITY}) {  // the midpoint (even: 0x7c) and beyond: infinity
    EXPECT_EQ(mha::float8_e5m2(x).bits, 0x7c) << "x = " << x;
    EXPECT_EQ(mha::float8_e5m2(-x).bits, 0xfc) << "x = " << -x;
  }
}

struct Case {
  mha::Tensor q, k8, v8, mask, slopes;
  mha::SdpaOptions options;
  std::string describe;
};

// Shapes for each kernel: one or two queries per key/value head (dot mode), up to 32 (the decoding
// kernel's rows), past 32 (the tile kernel), past 512 queries (keys widened once per head);
// head dimensions that are and are not whole vectors (dot mode reads rows in place or widened).
Case draw_case(std::mt19937_64& rng, mha::DType q_dtype, mha::DType eight, int n) {
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  Case c;
  const int64_t b = 1 + pick(rng) % 2, hkv = 1 + pick(rng) % 2, hq = hkv * (1 + pick(rng) % 3);
  const int64_t lqs[] = {1, 2, 7, 32, 60, 530};
  const int64_t lq = lqs[n % 6], lk = lq == 530 ? 300 : 1 + pick(rng) % 200;
  const int64_t dims[] = {16, 24, 64, 128};
  const int64_t dk = dims[pick(rng) % 4], dv = pick(rng) % 3 == 0 ? dims[pick(rng) % 4] : dk;
  c.q = randn({b, hq, lq, dk}, rng, q_dtype);
  c.k8 = randn({b, hkv, lk, dk}, rng, eight);
  c.v8 = randn({b, hkv, lk, dv}, rng, eight);
  c.options.enable_gqa = hq != hkv;
  c.options.is_causal = pick(rng) % 2 == 0;
  c.options.causal_alignment = pick(rng) % 2 ? mha::CausalAlignment::BottomRight : mha::CausalAlignment::TopLeft;
  if (pick(rng) % 3 == 0) {
    c.mask = randn({lq, lk}, rng);
    c.options.attn_mask = c.mask.view();
  }
  if (pick(rng) % 4 == 0) c.options.window_left = pick(rng) % 40;
  if (pick(rng) % 4 == 0) c.options.softcap = 5.0;
  if (pick(rng) % 4 == 0) {
    c.slopes = mha::Tensor::empty({hq});
    for (int64_t h = 0; h < hq; ++h) c.slopes.data<float>()[h] = 0.1f * static_cast<float>(h + 1);
    c.options.alibi_slopes = c.slopes.view();
  }
  c.describe = std::string(mha::dtype_name(q_dtype)) + " query, " + std::string(mha::dtype_name(eight)) + " B=" + std::to_string(b) + " Hq=" +
               std::to_string(hq) + " Hkv=" + std::to_string(hkv) + " Lq=" + std::to_string(lq) + " Lk=" +
               std::to_string(lk) + " dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) +
               (c.options.is_causal ? " causal" : "") + (c.mask.defined() ? " mask" : "") + " window_left=" +
               std::to_string(c.options.window_left) + (c.options.softcap > 0 ? " softcap" : "") +
               (c.slopes.defined() ? " alibi" : "");
  return c;
}

mha::Tensor f32(const mha::TensorView& t) { return mha::Tensor::copy_of(t, mha::DType::f32); }

// float32 queries: outputs within 2e-5 of the largest against float64 on the same (exact) values,
// as the SDPA tests; and the bits of the float32 call on widened keys and values. 16-bit queries:
// the bits of that float32 call on widened queries too, rounded once.
TEST(Float8, KernelsGiveTheBitsOfWidenedKeysAndValues) {
  std::mt19937_64 rng(test_seed());
  for (mha::detail::Isa isa : mha::detail::supported_isas()) {
    mha::detail::force_isa(isa);
    SCOPED_TRACE(mha::detail::isa_name(isa));
    for (int n = 0; n < 36; ++n) {  // every length of draw_case, each format and query dtype
      const mha::DType dtypes[] = {mha::DType::f32, mha::DType::bf16, mha::DType::f16};
      const mha::DType dtype = dtypes[n / 12 % 3];
      const Case c = draw_case(rng, dtype, kFormats[n / 6 % 2].dtype, n);
      SCOPED_TRACE(c.describe);
      const mha::Tensor out = mha::scaled_dot_product_attention(c.q, c.k8, c.v8, c.options);
      ASSERT_EQ(out.dtype(), dtype);
      const mha::Tensor k = f32(c.k8), v = f32(c.v8);
      const mha::Tensor wide = mha::scaled_dot_product_attention(f32(c.q), k, v, c.options);
      EXPECT_TRUE(agree(out, mha::Tensor::copy_of(wide, dtype)));
      if (dtype != mha::DType::f32) continue;
      const auto ref = mha::reference::scaled_dot_product_attention(c.q, c.k8, c.v8, c.options);
      EXPECT_LT(rel_error(out, ref.output), 2e-5);
      const auto w = mha::scaled_dot_product_attention_with_weights(c.q, c.k8, c.v8, c.options);
      EXPECT_LT(rel_error(w.output, ref.output), 2e-5);
      EXPECT_LT(rel_error(w.weights, ref.weights), 2e-5);
      const auto saved = mha::scaled_dot_product_attention_for_training(c.q, c.k8, c.v8, c.options);
      EXPECT_TRUE(agree(saved.lse, mha::scaled_dot_product_attention_for_training(c.q, k, v, c.options).lse));
    }
  }
  mha::detail::force_isa(std::nullopt);
}

// Every finite byte as a key and value element (rows of 64 over 4 x 64 keys, a permutation of the
// format's finite values and zeros in place of the rest), on every ISA and through both decoding
// modes and the tile kernel: the vector widening of each value is the scalar one, or the bits
// would differ. A NaN element gives its rows NaN, as the float32 call does.
TEST(Float8, EveryValueWidensExactlyOnEveryIsa) {
  std::mt19937_64 rng(test_seed());
  for (const Format& f : kFormats) {
    SCOPED_TRACE(std::string(mha::dtype_name(f.dtype)));
    mha::Tensor k8 = mha::Tensor::empty({1, 1, 4, 64}, f.dtype);
    std::vector<uint8_t> bytes;
    for (int b = 0; b < 256; ++b) bytes.push_back((b & 0x7f) > f.largest ? 0 : static_cast<uint8_t>(b));
    std::shuffle(bytes.begin(), bytes.end(), rng);
    std::copy(bytes.begin(), bytes.end(), k8.data<uint8_t>());
    mha::Tensor v8 = k8.clone();
    std::reverse(v8.data<uint8_t>(), v8.data<uint8_t>() + 256);
    mha::SdpaOptions o;
    o.scale = 1.0 / (64.0 * f.value(f.largest));  // scores of a few units: every key weighs in
    for (mha::detail::Isa isa : mha::detail::supported_isas()) {
      mha::detail::force_isa(isa);
      SCOPED_TRACE(mha::detail::isa_name(isa));
      for (int64_t lq : {1, 8, 40}) {
        const mha::Tensor q = randn({1, 1, lq, 64}, rng);
        const mha::Tensor out = mha::scaled_dot_product_attention(q, k8, v8, o);
        EXPECT_TRUE(agree(out, mha::scaled_dot_product_attention(q, f32(k8), f32(v8), o))) << "Lq=" << lq;
        EXPECT_LT(rel_error(out, mha::reference::scaled_dot_product_attention(q, k8, v8, o).output), 2e-5);
        mha::Tensor nan_v = v8.clone();
        nan_v.data<uint8_t>()[2 * 64 + 5] = 0xff;  // (NaN in both formats)
        const mha::Tensor with_nan = mha::scaled_dot_product_attention(q, k8, nan_v, o);
        for (int64_t i = 0; i < lq; ++i) EXPECT_TRUE(std::isnan(with_nan.data<float>()[i * 64 + 5]));
        EXPECT_FALSE(std::isnan(with_nan.data<float>()[4]));
        // A NaN key (0x7f: the other NaN byte of e4m3) makes its score NaN, and so every output of
        // the rows that see it (here all); the bytes around it widen as ever.
        mha::Tensor nan_k = k8.clone();
        nan_k.data<uint8_t>()[3 * 64 + 17] = f.dtype == mha::DType::f8e4m3 ? 0x7f : 0xff;
        const mha::Tensor nan_scores = mha::scaled_dot_product_attention(q, nan_k, v8, o);
        for (int64_t e = 0; e < nan_scores.numel(); ++e) EXPECT_TRUE(std::isnan(nan_scores.data<float>()[e]));
      }
      // Rows of 48 bytes (a last 16 past the 32-byte steps): a NaN there too.
      mha::Tensor k48 = randn({1, 1, 40, 48}, rng, f.dtype), v48 = randn({1, 1, 40, 48}, rng, f.dtype);
      k48.data<uint8_t>()[5 * 48 + 40] = 0xff;
      const mha::Tensor out48 = mha::scaled_dot_product_attention(randn({1, 1, 2, 48}, rng), k48, v48);
      for (int64_t e = 0; e < out48.numel(); ++e) EXPECT_TRUE(std::isnan(out48.data<float>()[e]));
    }
    mha::detail::force_isa(std::nullopt);
  }
}

// A paged float8 cache, read in place (decoding) and gathered (a prompt chunk), and packed
// sequences: the bits of the same calls on float32 copies.
TEST(Float8, PagedCachesAndPackedSequences) {
  std::mt19937_64 rng(test_seed());
  const int64_t pages = 12, hkv = 2, page_size = 16, d = 64;
  std::vector<int32_t> table(12);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  // Two sequences of 70 and 96 keys (5 and 6 of the pool's shuffled pages; 8 table entries each).
  const std::vector<int32_t> block_table = {table[0], table[1], table[2], table[3], table[4], table[5], -1, -1,
                                            table[6], table[7], table[8], table[9], table[10], table[11], -1, -1};
  const std::vector<int64_t> lens = {70, 96};
  mha::SdpaOptions o;
  o.enable_gqa = true;
  o.is_causal = true;
  o.causal_alignment = mha::CausalAlignment::BottomRight;
  for (const Format& f : kFormats) {
    SCOPED_TRACE(std::string(mha::dtype_name(f.dtype)));
    const mha::Tensor kc = randn({pages, hkv, page_size, d}, rng, f.dtype);
    const mha::Tensor vc = randn({pages, hkv, page_size, d}, rng, f.dtype);
    for (mha::detail::Isa isa : mha::detail::supported_isas()) {
      mha::detail::force_isa(isa);
      SCOPED_TRACE(mha::detail::isa_name(isa));
      for (int64_t lq : {1, 4, 50}) {
        SCOPED_TRACE("Lq=" + std::to_string(lq));
        for (mha::DType dtype : {mha::DType::f32, mha::DType::bf16}) {
          const mha::Tensor q = randn({2, 2 * hkv, lq, d}, rng, dtype);
          const mha::Tensor out = mha::paged_attention(q, kc, vc, block_table, lens, o);
          const mha::Tensor wide = mha::paged_attention(f32(q), f32(kc), f32(vc), block_table, lens, o);
          EXPECT_TRUE(agree(out, mha::Tensor::copy_of(wide, dtype)));
        }
      }
    }
    mha::detail::force_isa(std::nullopt);
    // Packed sequences: [T, H, D] rows with cumulative lengths.
    const std::vector<int64_t> cu_q = {0, 3, 40}, cu_k = {0, 50, 130};
    const mha::Tensor q = randn({40, 4, 32}, rng), k8 = randn({130, 2, 32}, rng, f.dtype);
    const mha::Tensor v8 = randn({130, 2, 32}, rng, f.dtype);
    const mha::Tensor out = mha::scaled_dot_product_attention_varlen(q, k8, v8, cu_q, cu_k, o);
    EXPECT_TRUE(agree(out, mha::scaled_dot_product_attention_varlen(q, f32(k8), f32(v8), cu_q, cu_k, o)));
  }
}

TEST(Float8, CallsThatTakeNoFloat8AreClearErrors) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({1, 2, 5, 16}, rng), k8 = randn({1, 2, 9, 16}, rng, mha::DType::f8e4m3);
  const mha::Tensor v8 = randn({1, 2, 9, 16}, rng, mha::DType::f8e4m3), v = f32(v8);
  const mha::Tensor q8 = mha::Tensor::copy_of(q, mha::DType::f8e4m3);
  expect_error([&] { (void)mha::scaled_dot_product_attention(q8, k8, v8); },
               "query: expected float32, float64, bfloat16 or float16 (float8 is taken for key and value only), got "
               "float8_e4m3fn");
  expect_error([&] { (void)mha::scaled_dot_product_attention(q, k8, v); },
               "key, value: float8 keys and values (float8_e4m3fn or float8_e5m2) go together, in one format");
  expect_error([&] { (void)mha::scaled_dot_product_attention(q, k8, mha::Tensor::copy_of(v8, mha::DType::f8e5m2)); },
               "key float8_e4m3fn, value float8_e5m2");
  expect_error([&] { (void)mha::scaled_dot_product_attention(mha::Tensor::copy_of(q, mha::DType::f64), k8, v8); },
               "got query float64, key float8_e4m3fn");
  const auto saved = mha::scaled_dot_product_attention_for_training(q, k8, v8);
  expect_error([&] { (void)mha::scaled_dot_product_attention_backward(q, k8, v8, saved, saved.output, {}); },
               "key, value: float8 keys and values are for inference");
  const std::vector<int64_t> cu = {0, 5};
  expect_error([&] {
    const mha::Tensor qp = randn({5, 2, 16}, rng), kp = randn({5, 2, 16}, rng, mha::DType::f8e5m2);
    const auto s = mha::scaled_dot_product_attention_varlen_for_training(qp, kp, kp, cu, cu, {});
    (void)mha::scaled_dot_product_attention_varlen_backward(qp, kp, kp, cu, cu, s, s.output, {});
  }, "float8 keys and values are for inference (a quantized cache takes no gradient); the backward takes query, key "
     "and value of one dtype, got float8_e5m2");
  mha::Tensor mask8 = mha::Tensor::copy_of(randn({5, 9}, rng), mha::DType::f8e4m3);
  mha::SdpaOptions o;
  o.attn_mask = mask8.view();
  expect_error([&] { (void)mha::scaled_dot_product_attention(q, k8, v8, o); }, "attn_mask");
}

}  // namespace
