// The bfloat16 forward on the tile unit (cpu/flash_forward_amx.cpp), where this CPU has AMX: its
// query tiles read the rows where they lie (whole blocks of 32 queries, head dims that need no
// padding, any row stride) or from zero-padded copies (the rest), with the same bits; tasks whose queries see no key write zeros. Fresh seeds each run (printed;
// MHA_TEST_SEED replays one).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

#include "cpu/dispatch.hpp"
#include "mha/mha.hpp"
#include "test_support.hpp"

namespace {

using mha_test::randn;
using mha_test::rel_error;
using mha_test::same_bits;

// q's heads in the first slots of [B, L, slots, d] storage, seen as [B, heads, L, d]: rows
// slots * d * 2 bytes apart.
mha::TensorView with_rows_apart(const mha::Tensor& q, int64_t slots, mha::Tensor& storage, std::mt19937_64& rng) {
  const int64_t b = q.size(0), heads = q.size(1), l = q.size(2), d = q.size(3);
  storage = randn({b, l, slots, d}, rng, q.dtype());  // (slots past the heads hold other values)
  const mha::TensorView view = storage.view().transpose(1, 2).slice(1, 0, heads);
  for (int64_t n = 0; n < b; ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < l; ++i)
        for (int64_t c = 0; c < d; ++c)
          static_cast<uint16_t*>(view.data)[n * view.strides[0] + h * view.strides[1] + i * view.strides[2] + c] =
              q.data<uint16_t>()[((n * heads + h) * l + i) * d + c];
  return view;
}

TEST(AmxForward, QueryRowsInPlaceOrCopiedGiveTheSameBits) {
  if (mha::detail::active_isa() != mha::detail::Isa::amx) GTEST_SKIP() << "no AMX on this CPU";
  std::mt19937_64 rng(mha_test::test_seed());
  const int64_t B = 2, H = 16, lq = 64, lk = 100;
  for (const int64_t d : {32, 64, 128}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const mha::Tensor q = randn({B, H, lq, d}, rng, mha::DType::bf16), k = randn({B, H, lk, d}, rng, mha::DType::bf16),
                      v = randn({B, H, lk, d}, rng, mha::DType::bf16);
    const mha::Tensor whole = mha::scaled_dot_product_attention(q, k, v);  // two whole blocks: in place
    // Rows 1 to 8 KiB apart, as a module's or a [B, L, H, D] tensor's are.
    for (const int64_t slots : {int64_t{16}, int64_t{32}}) {
      mha::Tensor storage;
      const mha::TensorView strided = with_rows_apart(q, slots, storage, rng);
      EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(strided, k, v), whole)) << slots << " slots";
    }
    // The first 45 queries alone: the second block's 13 rows are copied; each output row depends
    // on its own query only (no mask), so it must match the whole call's row.
    const mha::Tensor first = mha::Tensor::copy_of(q.view().slice(2, 0, 45));
    EXPECT_TRUE(same_bits(mha::scaled_dot_product_attention(first, k, v), mha::Tensor::copy_of(whole.view().slice(2, 0, 45))));
    const auto ref = mha::reference::scaled_dot_product_attention(q, k, v);
    EXPECT_LT(rel_error(whole, ref.output, mha_test::terms_magnitude(q, k, v, {})), 1e-2);
  }
}

// Bottom-right causal alignment with more queries than keys: the first queries see no key, and a
// task of 32 such queries runs no key block at all (its output rows are zeros, as the float32
// kernels write them); the rest match the reference.
TEST(AmxForward, TasksThatSeeNoKeyWriteZeros) {
  if (mha::detail::active_isa() != mha::detail::Isa::amx) GTEST_SKIP() << "no AMX on this CPU";
  std::mt19937_64 rng(mha_test::test_seed());
  const int64_t lq = 100, lk = 30, d = 64;
  const mha::Tensor q = randn({2, 3, lq, d}, rng, mha::DType::bf16), k = randn({2, 3, lk, d}, rng, mha::DType::bf16),
                    v = randn({2, 3, lk, d}, rng, mha::DType::bf16);
  const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight};
  const mha::Tensor out = mha::Tensor::copy_of(mha::scaled_dot_product_attention(q, k, v, o), mha::DType::f32);
  int64_t nonzero = 0;
  for (int64_t bh = 0; bh < 6; ++bh)
    for (int64_t i = 0; i < lq - lk; ++i)
      for (int64_t c = 0; c < d; ++c) nonzero += out.data<float>()[(bh * lq + i) * d + c] != 0.0f;
  EXPECT_EQ(nonzero, 0);
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
  EXPECT_LT(rel_error(out, ref.output, mha_test::terms_magnitude(q, k, v, o)), 1e-2);
}

}  // namespace
