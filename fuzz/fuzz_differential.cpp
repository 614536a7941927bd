// Differential: a small random SDPA problem through the fused kernels (the CPU's best ISA) and
// the float64 reference; aborts when they disagree by more than 1e-4 of the largest output (fp32
// outputs are within ~1e-6 on inputs bounded by 8; 1e-4 leaves room for long rows of large scores).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fuzz_input.hpp"
#include "mha/mha.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzInput in{data, size};
  const int64_t B = 1 + in.small(1), Hkv = 1 + in.small(2), group = 1 + in.small(2), Hq = Hkv * group;
  const int64_t Lq = 1 + in.small(70), Lk = 1 + in.small(70), Dk = 1 + in.small(40), Dv = 1 + in.small(40);
  auto tensor = [&](mha::Shape shape) {
    mha::Tensor t = mha::Tensor::empty(shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = in.value();
    return t;
  };
  const mha::Tensor q = tensor({B, Hq, Lq, Dk}), k = tensor({B, Hkv, Lk, Dk}), v = tensor({B, Hkv, Lk, Dv});
  mha::SdpaOptions o;
  o.enable_gqa = group > 1;
  o.is_causal = in.flag();
  o.causal_alignment = in.flag() ? mha::CausalAlignment::TopLeft : mha::CausalAlignment::BottomRight;
  if (in.flag()) o.dropout_p = 0.25, o.dropout_seed = in.byte();
  mha::Tensor mask;
  if (in.flag()) {
    mask = mha::Tensor::empty({Lq, Lk}, mha::DType::boolean);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.data<bool>()[i] = in.byte() % 5 != 0;
    o.attn_mask = mask.view();
  }
  const auto fused = mha::scaled_dot_product_attention_with_weights(q, k, v, o);
  const auto ref = mha::reference::scaled_dot_product_attention(q, k, v, o);
  double err = 0, scale = 1e-30;
  for (int64_t i = 0; i < ref.output.numel(); ++i) {
    const double r = ref.output.data<double>()[i], f = fused.output.data<float>()[i];
    if (std::isnan(f)) __builtin_trap();
    err = std::max(err, std::abs(f - r));
    scale = std::max(scale, std::abs(r));
  }
  if (err > 1e-4 * scale && err > 1e-30) {
    std::fprintf(stderr, "disagreement %.3e (scale %.3e) B=%lld Hq=%lld Lq=%lld Lk=%lld\n", err, scale,
                 static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Lq),
                 static_cast<long long>(Lk));
    __builtin_trap();
  }
  return 0;
}
