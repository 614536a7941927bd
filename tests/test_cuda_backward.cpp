// The GPU backward (src/cuda/flash_backward.cu) against the float64 reference's gradients, on
// fresh random inputs; its determinism; what it refuses. Without a GPU the GpuTest cases skip,
// and the argument checks that need no device run anyway.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_support.hpp"
#include "mha/cuda.hpp"
#include "test_support.hpp"

namespace {

using mha_test::expect_error;
using mha_test::GpuTest;
using mha_test::KernelChoice;
using mha_test::Operand;
using mha_test::operand;
using mha_test::poisoned;
using mha_test::randn;
using mha_test::rel_error;
using mha_test::test_seed;

// The backward rounds P and dS to 16 bits before their products (as FlashAttention does): bf16
// (2^-9 relative per rounding) 2e-2 normwise, fp16 (2^-12) 4e-3, against the expected gradients
// below, with the CPU backward tests' floor of 5% of the largest gradient for one that cancels.
double gradient_tolerance(mha::DType dtype) { return dtype == mha::DType::bf16 ? 2e-2 : 4e-3; }

// What a backward that reads the saved, rounded output should give. Its delta_i = sum_d dO_id O_id
// uses that output where the float64 reference uses the exact one; the difference Delta_i moves
// dS_ij = P_ij (dP_ij - delta_i) by -P_ij Delta_i, so dQ_i by -scale Delta_i (P K)_i and dK_j by
// -scale sum_i P_ij Delta_i Q_i (over the group's query heads). Without this, a row that sees a
// single key (dS = 0 exactly, so dQ = 0) would be judged on the rounding of O alone.
struct ExpectedGradients {
  mha::Tensor query, key, value;  // float64
  double floor;                   // 5% of the largest of them
};
ExpectedGradients expected_gradients(const mha::TensorView& q, const mha::TensorView& k, const mha::TensorView& v,
                                     const mha::TensorView& grad, const mha::TensorView& saved_output,
                                     const mha::SdpaOptions& host_options) {
  const auto forward = mha::reference::scaled_dot_product_attention(q, k, v, host_options);
  const auto ref = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, host_options);
  const mha::Tensor Q = mha::Tensor::copy_of(q, mha::DType::f64), K = mha::Tensor::copy_of(k, mha::DType::f64),
                    dO = mha::Tensor::copy_of(grad, mha::DType::f64),
                    O = mha::Tensor::copy_of(saved_output, mha::DType::f64);
  const int64_t B = q.shape[0], Hq = q.shape[1], Lq = q.shape[2], D = q.shape[3], Hkv = k.shape[1], Lk = k.shape[2];
  const double scale = host_options.scale ? *host_options.scale : 1.0 / std::sqrt(static_cast<double>(D));
  ExpectedGradients e{mha::Tensor::copy_of(ref.query), mha::Tensor::copy_of(ref.key), mha::Tensor::copy_of(ref.value), 0};
  const double* P = forward.weights.data<double>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      for (int64_t i = 0; i < Lq; ++i) {
        const int64_t row = ((b * Hq + h) * Lq + i) * D;
        double delta = 0;
        for (int64_t x = 0; x < D; ++x)
          delta += dO.data<double>()[row + x] * (O.data<double>()[row + x] - forward.output.data<double>()[row + x]);
        const double* p = P + ((b * Hq + h) * Lq + i) * Lk;
        for (int64_t j = 0; j < Lk; ++j) {
          if (p[j] == 0) continue;
          const int64_t key_row = ((b * Hkv + hk) * Lk + j) * D;
          for (int64_t x = 0; x < D; ++x) {
            e.query.data<double>()[row + x] -= scale * delta * p[j] * K.data<double>()[key_row + x];
            e.key.data<double>()[key_row + x] -= scale * delta * p[j] * Q.data<double>()[row + x];
          }
        }
      }
    }
  e.floor = 0.05 * std::max({mha_test::max_abs(e.query), mha_test::max_abs(e.key), mha_test::max_abs(e.value)});
  return e;
}

// Leaves freed device memory full of NaN, so that a gradient buffer allocated next from it fails
// the comparison where the kernels skip an element (the device's block cache hands the newest
// freed block of a size out again; with MHA_CUDA_CACHE_MB=0 cudaMalloc does so in practice, and a
// fresh block is zeros, which the exact-zero checks still catch).
void poison_device_memory(const std::vector<mha::Shape>& shapes, mha::DType dtype) {
  std::vector<mha::Tensor> held;
  for (const mha::Shape& s : shapes) held.push_back(poisoned(s, dtype));
}

struct Case {
  mha::DType dtype;
  int64_t B, Hq, Hkv, Lq, Lk, d;
  mha::SdpaOptions options;      // for the device call (its mask on the device)
  mha::SdpaOptions host_options; // the same with the mask on the host
};

// Runs the training forward and backward on the device and compares every gradient with the
// float64 reference's on the same (rounded) inputs.
void check_against_reference(const Case& c, std::mt19937_64& rng) {
  const Operand q = operand({c.B, c.Hq, c.Lq, c.d}, rng, c.dtype), k = operand({c.B, c.Hkv, c.Lk, c.d}, rng, c.dtype),
                v = operand({c.B, c.Hkv, c.Lk, c.d}, rng, c.dtype), grad = operand({c.B, c.Hq, c.Lq, c.d}, rng, c.dtype);
  const auto saved = mha::scaled_dot_product_attention_for_training(q.device, k.device, v.device, c.options);
  poison_device_memory({q.host.sizes(), k.host.sizes(), v.host.sizes()}, c.dtype);
  const mha::AttentionGradients g =
      mha::scaled_dot_product_attention_backward(q.device, k.device, v.device, saved, grad.device, c.options);
  const ExpectedGradients e =
      expected_gradients(q.host, k.host, v.host, grad.host, saved.output.to(mha::Device::cpu()), c.host_options);
  ASSERT_FALSE(g.query.device().is_cpu());
  EXPECT_EQ(g.query.dtype(), c.dtype);
  EXPECT_LT(rel_error(g.query.to(mha::Device::cpu()), e.query, e.floor), gradient_tolerance(c.dtype)) << "dQ";
  EXPECT_LT(rel_error(g.key.to(mha::Device::cpu()), e.key, e.floor), gradient_tolerance(c.dtype)) << "dK";
  EXPECT_LT(rel_error(g.value.to(mha::Device::cpu()), e.value, e.floor), gradient_tolerance(c.dtype)) << "dV";
}

// The expected gradients' correction, checked on the float32 host backward given a saved output
// rounded to bfloat16 (it reads delta from whatever output it is given): against them it is off
// by float32 rounding; against the plain reference, by the rounding of O it was handed.
TEST(Cuda, ExpectedGradientsAccountForTheRoundedOutput) {
  std::mt19937_64 rng(test_seed());
  const mha::Tensor q = randn({2, 4, 37, 64}, rng), k = randn({2, 2, 53, 64}, rng), v = randn({2, 2, 53, 64}, rng),
                    grad = randn({2, 4, 37, 64}, rng);
  const mha::SdpaOptions o{.is_causal = true, .causal_alignment = mha::CausalAlignment::BottomRight, .enable_gqa = true};
  mha::AttentionForTraining saved = mha::scaled_dot_product_attention_for_training(q, k, v, o);
  saved.output = mha::Tensor::copy_of(mha::Tensor::copy_of(saved.output, mha::DType::bf16), mha::DType::f32);
  const auto g = mha::scaled_dot_product_attention_backward(q, k, v, saved, grad, o);
  const ExpectedGradients e = expected_gradients(q, k, v, grad, saved.output, o);
  const auto ref = mha::reference::scaled_dot_product_attention_backward(q, k, v, grad, o);
  EXPECT_LT(rel_error(g.query, e.query, e.floor), 1e-5);
  EXPECT_LT(rel_error(g.key, e.key, e.floor), 1e-5);
  EXPECT_LT(rel_error(g.value, e.value, e.floor), 1e-5);
  EXPECT_GT(rel_error(g.query, ref.query, e.floor), 1e-4);  // what the correction accounts for
  EXPECT_GT(rel_error(g.key, ref.key, e.floor), 1e-4);
}

std::string describe(const Case& c, int n) {
  return std::string(mha::dtype_name(c.dtype)) + " d=" + std::to_string(c.d) + " B=" + std::to_string(c.B) +
         " Hq=" + std::to_string(c.Hq) + " Hkv=" + std::to_string(c.Hkv) + " Lq=" + std::to_string(c.Lq) +
         " Lk=" + std::to_string(c.Lk) + " case " + std::to_string(n);
}

// The tilings MHA_CUDA_BACKWARD_TILE chooses between (flash_backward.cu); "" is the default mix.
const char* const kTiles[] = {"", "64", "32"};

// Every head dim and dtype, causal in both alignments, GQA, Lq != Lk, a bool and an additive
// mask (with -inf entries), a key padding mask, a given scale; on each tiling.
TEST_F(GpuTest, BackwardMatchesFloat64ReferenceAcrossOptions) {
  std::mt19937_64 rng(test_seed());
  for (const char* tile : kTiles)
  for (mha::DType dtype : {mha::DType::bf16, mha::DType::f16}) {
    const KernelChoice choice(tile, "MHA_CUDA_BACKWARD_TILE");
    for (int64_t d : {64, 128, 256}) {
      for (int n = 0; n < 7; ++n) {
        Case c{.dtype = dtype, .d = d};
        c.B = 1 + rng() % 2;
        c.Hkv = 1 + rng() % 2;
        c.Hq = c.Hkv * (1 + rng() % 3);
        c.Lq = 1 + rng() % 200;
        c.Lk = n % 3 == 0 ? c.Lq : 1 + rng() % 200;
        mha::SdpaOptions o;
        o.enable_gqa = c.Hq != c.Hkv;
        o.is_causal = n % 2 == 1;
        o.causal_alignment = n % 4 == 1 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
        if (n == 4) o.scale = 0.3;
        mha::Tensor mask_host, mask_device;
        if (n == 2) {  // bool [Lq, Lk], true attends
          mask_host = mha::Tensor::empty({c.Lq, c.Lk}, mha::DType::boolean);
          for (int64_t i = 0; i < mask_host.numel(); ++i) mask_host.data<bool>()[i] = rng() % 5 != 0;
        } else if (n == 6) {  // key padding, bool [B, 1, 1, Lk]: each entry's last keys dropped
          mask_host = mha::Tensor::empty({c.B, 1, 1, c.Lk}, mha::DType::boolean);
          for (int64_t b = 0; b < c.B; ++b) {
            const int64_t kept = 1 + static_cast<int64_t>(rng() % c.Lk);
            for (int64_t j = 0; j < c.Lk; ++j) mask_host.data<bool>()[b * c.Lk + j] = j < kept;
          }
        } else if (n == 5) {  // additive [B, 1, Lq, Lk] with some -inf
          mask_host = randn({c.B, 1, c.Lq, c.Lk}, rng);
          for (int64_t i = 0; i < mask_host.numel(); ++i)
            if (rng() % 10 == 0) mask_host.data<float>()[i] = -INFINITY;
        }
        c.options = c.host_options = o;
        if (mask_host.defined()) {
          mask_device = mask_host.to(mha::Device::cuda());
          c.options.attn_mask = mask_device.view();
          c.host_options.attn_mask = mask_host.view();
        }
        SCOPED_TRACE(describe(c, n) + " tile '" + tile + "'");
        check_against_reference(c, rng);
      }
    }
  }
}

// Many query tiles and key blocks (the cases above stay under 200), GQA over three query heads
// per key/value head, causal in both alignments.
TEST_F(GpuTest, BackwardOfLongSequencesMatchesTheFloat64Reference) {
  std::mt19937_64 rng(test_seed());
  for (const char* tile : kTiles)
  for (int64_t d : {64, 128}) {
    const KernelChoice choice(tile, "MHA_CUDA_BACKWARD_TILE");
    for (int n = 0; n < 3; ++n) {
      Case c{.dtype = n == 1 ? mha::DType::f16 : mha::DType::bf16, .B = 1, .Hq = 3, .Hkv = 1, .d = d};
      c.Lq = 500 + rng() % 400;
      c.Lk = n == 0 ? c.Lq : 500 + rng() % 400;
      c.options = {.is_causal = n != 2, .enable_gqa = true};
      c.options.causal_alignment = n == 1 ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
      c.host_options = c.options;
      SCOPED_TRACE(describe(c, n) + " tile '" + tile + "'");
      check_against_reference(c, rng);
    }
  }
}

// Keys that no query sees (top-left causality with Lk > Lq) get zero gradients, exactly; rows
// that see no key (bottom-right with Lq > Lk) give a zero dQ; the rest matches the reference.
TEST_F(GpuTest, BackwardGivesZerosWhereNothingIsSeen) {
  std::mt19937_64 rng(test_seed());
  for (const auto alignment : {mha::CausalAlignment::TopLeft, mha::CausalAlignment::BottomRight}) {
    const bool top_left = alignment == mha::CausalAlignment::TopLeft;
    const int64_t Lq = top_left ? 40 : 150, Lk = top_left ? 150 : 40;
    const mha::DType dtype = mha::DType::bf16;
    const Operand q = operand({1, 2, Lq, 64}, rng, dtype), k = operand({1, 2, Lk, 64}, rng, dtype),
                  v = operand({1, 2, Lk, 64}, rng, dtype), grad = operand({1, 2, Lq, 64}, rng, dtype);
    const mha::SdpaOptions o{.is_causal = true, .causal_alignment = alignment};
    const auto saved = mha::scaled_dot_product_attention_for_training(q.device, k.device, v.device, o);
    poison_device_memory({q.host.sizes(), k.host.sizes()}, dtype);
    const auto g = mha::scaled_dot_product_attention_backward(q.device, k.device, v.device, saved, grad.device, o);
    const mha::Tensor dq = g.query.to(mha::Device::cpu()), dk = g.key.to(mha::Device::cpu()),
                      dv = g.value.to(mha::Device::cpu());
    for (int64_t h = 0; h < 2; ++h) {
      if (top_left) {  // keys 40.. are seen by no query
        for (int64_t j = 40; j < Lk; ++j)
          for (int64_t x = 0; x < 64; ++x) {
            ASSERT_EQ(dk.at({0, h, j, x}), 0.0) << j;
            ASSERT_EQ(dv.at({0, h, j, x}), 0.0) << j;
          }
      } else {  // rows 0 .. Lq - Lk - 1 see no key
        for (int64_t i = 0; i < Lq - Lk; ++i)
          for (int64_t x = 0; x < 64; ++x) ASSERT_EQ(dq.at({0, h, i, x}), 0.0) << i;
      }
    }
    const ExpectedGradients e = expected_gradients(q.host, k.host, v.host, grad.host, saved.output.to(mha::Device::cpu()), o);
    EXPECT_LT(rel_error(dq, e.query, e.floor), gradient_tolerance(dtype));
    EXPECT_LT(rel_error(dk, e.key, e.floor), gradient_tolerance(dtype));
    EXPECT_LT(rel_error(dv, e.value, e.floor), gradient_tolerance(dtype));
  }
}

// No query rows, or no keys: empty gradients where the inputs are empty, zeros where nothing is
// seen (every dQ row without keys).
TEST_F(GpuTest, BackwardOfEmptySequences) {
  std::mt19937_64 rng(test_seed());
  const mha::DType dtype = mha::DType::bf16;
  for (const auto& [Lq, Lk] : {std::pair<int64_t, int64_t>{0, 70}, {70, 0}}) {
    const Operand q = operand({2, 2, Lq, 64}, rng, dtype), k = operand({2, 2, Lk, 64}, rng, dtype),
                  v = operand({2, 2, Lk, 64}, rng, dtype), grad = operand({2, 2, Lq, 64}, rng, dtype);
    const auto saved = mha::scaled_dot_product_attention_for_training(q.device, k.device, v.device);
    const auto g = mha::scaled_dot_product_attention_backward(q.device, k.device, v.device, saved, grad.device);
    EXPECT_EQ(g.query.sizes(), q.host.sizes());
    EXPECT_EQ(g.key.sizes(), k.host.sizes());
    const mha::Tensor dq = g.query.to(mha::Device::cpu()), dk = g.key.to(mha::Device::cpu()),
                      dv = g.value.to(mha::Device::cpu());
    for (const mha::Tensor* t : {&dq, &dk, &dv}) EXPECT_EQ(rel_error(*t, mha::Tensor::zeros(t->sizes())), 0.0);  // NaN fails
  }
}

// No atomics: two backward calls give the same bits; a subset of the gradients is the same as
// the full set's; strided [B, L, H, D] views give what contiguous copies give.
TEST_F(GpuTest, BackwardIsDeterministicAndTakesSubsetsAndStridedViews) {
  std::mt19937_64 rng(test_seed());
  const mha::DType dtype = mha::DType::f16;
  const Operand q = operand({2, 300, 4, 128}, rng, dtype), k = operand({2, 333, 2, 128}, rng, dtype),
                v = operand({2, 333, 2, 128}, rng, dtype), grad = operand({2, 300, 4, 128}, rng, dtype);
  const mha::TensorView qt = q.device.view().transpose(1, 2), kt = k.device.view().transpose(1, 2),
                        vt = v.device.view().transpose(1, 2), gt = grad.device.view().transpose(1, 2);
  const mha::SdpaOptions o{.is_causal = true, .enable_gqa = true};
  const auto saved = mha::scaled_dot_product_attention_for_training(qt, kt, vt, o);
  const auto first = mha::scaled_dot_product_attention_backward(qt, kt, vt, saved, gt, o);
  const auto second = mha::scaled_dot_product_attention_backward(qt, kt, vt, saved, gt, o);
  const mha::Tensor* a[] = {&first.query, &first.key, &first.value};
  const mha::Tensor* b[] = {&second.query, &second.key, &second.value};
  for (int i = 0; i < 3; ++i) {
    const mha::Tensor x = a[i]->to(mha::Device::cpu()), y = b[i]->to(mha::Device::cpu());
    EXPECT_TRUE(mha_test::same_bits(x, y)) << i;
  }
  const auto only_q = mha::scaled_dot_product_attention_backward(qt, kt, vt, saved, gt, o, {.key = false, .value = false});
  EXPECT_FALSE(only_q.key.defined());
  EXPECT_FALSE(only_q.value.defined());
  EXPECT_TRUE(mha_test::same_bits(only_q.query.to(mha::Device::cpu()), first.query.to(mha::Device::cpu())));
  const auto only_v = mha::scaled_dot_product_attention_backward(qt, kt, vt, saved, gt, o, {.query = false, .key = false});
  EXPECT_TRUE(mha_test::same_bits(only_v.value.to(mha::Device::cpu()), first.value.to(mha::Device::cpu())));
  // The strided views against the reference on contiguous host copies.
  const ExpectedGradients e = expected_gradients(
      mha::Tensor::copy_of(q.host.view().transpose(1, 2)), mha::Tensor::copy_of(k.host.view().transpose(1, 2)),
      mha::Tensor::copy_of(v.host.view().transpose(1, 2)), mha::Tensor::copy_of(grad.host.view().transpose(1, 2)),
      saved.output.to(mha::Device::cpu()), o);
  EXPECT_LT(rel_error(first.query.to(mha::Device::cpu()), e.query, e.floor), gradient_tolerance(dtype));
  EXPECT_LT(rel_error(first.key.to(mha::Device::cpu()), e.key, e.floor), gradient_tolerance(dtype));
  EXPECT_LT(rel_error(first.value.to(mha::Device::cpu()), e.value, e.floor), gradient_tolerance(dtype));
}

TEST_F(GpuTest, BackwardRefusesWhatItCannotDo) {
  std::mt19937_64 rng(test_seed());
  const mha::DType dtype = mha::DType::bf16;
  const Operand q = operand({2, 2, 16, 64}, rng, dtype), grad = operand({2, 2, 16, 64}, rng, dtype);
  const mha::Tensor mask = randn({16, 16}, rng).to(mha::Device::cuda());
  const mha::SdpaOptions o{.attn_mask = mask.view()};
  const auto saved = mha::scaled_dot_product_attention_for_training(q.device, q.device, q.device, o);
  expect_error([&] { mha::scaled_dot_product_attention_backward(q.device, q.device, q.device, saved, grad.device, o, true); },
               "attn_mask_grad: the mask's gradient is computed by the host backward; got inputs on cuda:0");
  // Keys and values of one batch entry for both (broadcast): their gradients would be sums over
  // the batch, which the host backward forms.
  const mha::TensorView shared_k = q.device.view().slice(0, 0, 1);
  const auto saved2 = mha::scaled_dot_product_attention_for_training(q.device, shared_k, shared_k);
  expect_error([&] { mha::scaled_dot_product_attention_backward(q.device, shared_k, shared_k, saved2, grad.device); },
               "key: on cuda:0 the backward takes inputs of the full batch shape [2, 2, 16, 64], got [1, 2, 16, 64]");
  const auto plain = mha::scaled_dot_product_attention_for_training(q.device, q.device, q.device);
  expect_error([&] { mha::scaled_dot_product_attention_backward(q.device, q.device, q.device, plain, grad.host); },
               "grad_output: expected the query's device cuda:0, got cpu");
  {
    const KernelChoice choice("16", "MHA_CUDA_BACKWARD_TILE");
    expect_error([&] { mha::scaled_dot_product_attention_backward(q.device, q.device, q.device, plain, grad.device); },
                 "MHA_CUDA_BACKWARD_TILE: expected 64 or 32, got '16'");
  }
}

// Without a GPU: the backward checks where its operands are before it allocates anything.
TEST(Cuda, BackwardChecksItsOperandsDevices) {
  static float dummy[64];
  const mha::TensorView host(dummy, {1, 2, 4, 8});
  const mha::TensorView device = host.on(mha::Device::cuda());
  mha::AttentionForTraining saved;
  saved.output = mha::Tensor::zeros({1, 2, 4, 8});
  saved.lse = mha::Tensor::zeros({1, 2, 4});
  expect_error([&] { mha::scaled_dot_product_attention_backward(device, device, device, saved, host); },
               "grad_output: expected the query's device cuda:0, got cpu");
  expect_error([&] { mha::scaled_dot_product_attention_backward(device, device, device, saved, device); },
               "saved.output: expected the query's device cuda:0, got cpu");
  expect_error([&] { mha::scaled_dot_product_attention_backward(host, host, host, saved, device); },
               "grad_output: expected a tensor in host (cpu) memory");
}

}  // namespace
