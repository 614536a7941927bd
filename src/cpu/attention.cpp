// run_attention: the step between a validated problem and an ISA's kernel.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/thread_pool.hpp"
#include "cpu/amx.hpp"
#include "cpu/attention_kernel.hpp"
#include "cpu/backward_delta.hpp"
#include "cpu/backward_rows.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/mask_only_rows.hpp"
#include "cpu/mask_scores.hpp"

namespace mha::detail {
namespace {

template <class E>
void fill_zero(E* base, const int64_t* shape, const int64_t* strides) {
  // Nothing to fill when any size is 0, however large the others (a batch of 2^43 empty rows).
  if (shape[0] == 0 || shape[1] == 0 || shape[2] == 0 || shape[3] == 0) return;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d)
          base[a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]] = E{0};
}
// An output of float32 or a 16-bit dtype (all-zero bits are +0 in bfloat16 and float16 alike).
void fill_zero(void* base, DType dtype, const int64_t* shape, const int64_t* strides) {
  if (base == nullptr) return;  // a gradient nobody wants
  if (dtype == DType::f32) fill_zero(static_cast<float*>(base), shape, strides);
  else fill_zero(static_cast<uint16_t*>(base), shape, strides);
}

// The kernels read rows with unit stride; an input without it is copied once (into `copies`), in
// its own dtype (the forward takes q, k and v in one dtype).
AttentionProblem with_unit_row_strides(const AttentionProblem& problem, std::vector<Tensor>& copies) {
  AttentionProblem p = problem;
  for (TensorView* t : {&p.q, &p.k, &p.v}) {
    if (t->strides[3] != 1 && t->shape[3] > 1) {
      copies.push_back(Tensor::copy_of(*t, t->dtype));
      *t = copies.back().view();
    }
  }
  return p;
}

// An empty operand (a size of 0 somewhere) may have no storage; the kernels still form (never
// dereference) addresses from it, so it gets a stand-in that arithmetic on it cannot leave.
float g_stand_in[16] = {};
void stand_in_if_empty(TensorView& t) {
  if (t.numel() == 0) {
    t.data = g_stand_in;
    t.strides = {};
  }
}
template <class E>
void stand_in_if_null(E*& data, int64_t* strides) {
  if (data == nullptr) {
    data = g_stand_in;
    for (int d = 0; d < 4; ++d) strides[d] = 0;
  }
}

}  // namespace

std::atomic<int64_t>& widened_chunk_floats() {
  static std::atomic<int64_t> floats{int64_t{2} << 20};  // 8 MiB, bounded: float32 copies of k and v would grow with B, H and L
  return floats;
}

std::atomic<int64_t>& transposed_mask_floats() {
  static std::atomic<int64_t> floats{int64_t{8} << 20};  // 32 MiB: an [Lq, Lk] mask up to about 2900 x 2900
  return floats;
}

std::atomic<int64_t>& amx_backward_span_bytes() {  // (here, not in the AMX file: builds without it have the setting too)
  static std::atomic<int64_t> bytes{int64_t{3} << 19};
  return bytes;
}

std::atomic<bool>& skips_excluded_blocks() {
  static std::atomic<bool> on{true};
  return on;
}

ForwardKernel forward_kernel(const AttentionProblem& p, const ForwardOutputs& o) {
  switch (active_isa()) {
    case Isa::amx:  // no float32 kernel of its own: AVX-512 does float32 (and what the tile unit does not take)
    case Isa::avx512: return flash_forward_avx512;
    case Isa::avx512_bf16:
      return bf16_pairs_supports(p) && (bf16_pairs_take_shape(p.len_q, p.dim_qk) || bf16_pairs_take_few_queries(p, o))
                 ? flash_forward_avx512bf16
                 : flash_forward_avx512;
    case Isa::avx2: return flash_forward_avx2;
    case Isa::portable: break;
  }
  return flash_forward_portable;
}

bool reads_pages_in_place(const AttentionProblem& p) {
  if (p.q.dtype == DType::f64) return false;
  if (p.len_q <= kFewQueriesPerHead) return !(p.q.dtype != DType::f32 && amx_usable() && amx_bf16_supports(p));
  // The pair kernel copies each head's rows once (whole heads per thread) or reads a key block's
  // rows per task, and so reads pages at no cost. The float32 tile kernel, and the widening of
  // float16 / bfloat16 per key block, read them per task: on Zen 5 that measured level with the
  // gathered copy at 40 queries (float32; float16 1.03x slower) and 1.06x slower at 512 (float16:
  // a page's rows 2 KiB apart in FlashAttention's layout defeat the prefetchers), so they gather.
  // (Unit last strides: run_attention's preparations would otherwise copy the rows.)
  return forward_kernel(p, ForwardOutputs{}) == flash_forward_avx512bf16 && p.k.strides[3] == 1 && p.v.strides[3] == 1;
}

void run_attention(const AttentionProblem& problem, const ForwardOutputs& o) {
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max();
  if (problem.len_q > kMaxLen || problem.len_k > kMaxLen) {
    throw Error("query/key: sequence lengths up to 2^31 - 1 are supported, got Lq = " +
                std::to_string(problem.len_q) + ", Lk = " + std::to_string(problem.len_k));
  }
  if (problem.batch == 0 || problem.heads_q == 0 || problem.len_q == 0) return;  // nothing to write

  if (problem.dropout_p >= 1.0) {  // every weight dropped: the output and the weights are zero
    const int64_t out_shape[4] = {problem.batch, problem.heads_q, problem.len_q, problem.dim_v};
    fill_zero(o.out, o.out_dtype, out_shape, o.out_strides);
    if (o.weights) {
      const int64_t w_shape[4] = {problem.batch, problem.heads_q, problem.len_q, problem.len_k};
      fill_zero(o.weights, w_shape, o.weights_strides);
    }
    if (o.average_weights) std::fill_n(o.average_weights, problem.batch * problem.len_q * problem.len_k, 0.0f);
    if (o.lse) {  // every weight is zero: +inf makes exp(score - lse) zero in a backward too
      std::fill_n(o.lse, problem.batch * problem.heads_q * problem.len_q, std::numeric_limits<float>::infinity());
    }
    return;
  }

  std::vector<Tensor> copies;
  AttentionProblem p = with_unit_row_strides(problem, copies);
  // Rows of mask values alone (below) are found along whole causal rows: with a sliding window,
  // the window is a mask term there too.
  if (p.windowed && one_contiguous_term(p)) p = with_window_as_mask(p);
  if (p.len_k == 0) {  // no key: every row is fully masked
    const int64_t out_shape[4] = {p.batch, p.heads_q, p.len_q, p.dim_v};
    fill_zero(o.out, o.out_dtype, out_shape, o.out_strides);
    if (o.lse) std::fill_n(o.lse, p.batch * p.heads_q * p.len_q, std::numeric_limits<float>::infinity());
    return;
  }
  for (TensorView* t : {&p.q, &p.k, &p.v}) stand_in_if_empty(*t);
  ForwardOutputs outputs = o;
  stand_in_if_null(outputs.out, outputs.out_strides);  // Dv == 0: nothing is written there
  const ForwardKernel kernel = forward_kernel(p, outputs);
  // Leading rows whose scores are their mask values (a left-padded batch's padding rows under
  // Hugging Face's masks) come from the mask, the rest from the kernel.
  const std::vector<int64_t> prefixes = mask_only_prefixes(p, outputs);
  if (prefixes.empty()) kernel(p, outputs);
  else run_with_mask_only_prefixes(p, outputs, prefixes, kernel);
}

}  // namespace mha::detail

namespace mha::detail {

void run_attention_backward(const AttentionProblem& problem, const BackwardInputs& in, const BackwardOutputs& out) {
  constexpr int64_t kMaxLen = std::numeric_limits<int32_t>::max();
  if (problem.len_q > kMaxLen || problem.len_k > kMaxLen) {
    throw Error("query/key: sequence lengths up to 2^31 - 1 are supported, got Lq = " +
                std::to_string(problem.len_q) + ", Lk = " + std::to_string(problem.len_k));
  }
  const AttentionProblem& p0 = problem;
  const int64_t dq_shape[4] = {p0.batch, p0.heads_q, p0.len_q, p0.dim_qk};
  const int64_t dk_shape[4] = {p0.batch, p0.heads_kv, p0.len_k, p0.dim_qk};
  const int64_t dv_shape[4] = {p0.batch, p0.heads_kv, p0.len_k, p0.dim_v};
  const int64_t ds_shape[4] = {p0.batch, p0.heads_q, p0.len_q, p0.len_k};
  if (p0.batch == 0 || p0.heads_q == 0 || p0.len_q == 0 || p0.len_k == 0 || p0.dropout_p >= 1.0) {
    // No query, no key (every row fully masked: a zero output), or every weight dropped:
    // nothing flows back.
    fill_zero(out.dq, out.grad_dtype, dq_shape, out.dq_strides);
    fill_zero(out.dk, out.grad_dtype, dk_shape, out.dk_strides);
    fill_zero(out.dv, out.grad_dtype, dv_shape, out.dv_strides);
    if (out.dscores) fill_zero(out.dscores, ds_shape, out.dscores_strides);
    return;
  }
  std::vector<Tensor> copies;
  AttentionProblem p = with_unit_row_strides(problem, copies);
  // bfloat16 on the tile unit, where it takes the problem: its sliding window stays a window.
  const AttentionProblem window_kept = p;
  // Rows of mask values alone (backward_row_normalisers) are found along whole causal rows: with
  // a sliding window, the window is a mask term there too.
  if (p.windowed && one_contiguous_term(p)) p = with_window_as_mask(p);
  for (TensorView* t : {&p.q, &p.k, &p.v}) stand_in_if_empty(*t);
  BackwardInputs inputs = in;
  const int64_t* gs = in.grad_out_strides;
  if (gs[3] != 1 && p.dim_v > 1) {  // rows of unit stride for the kernel, in the gradient's dtype
    const TensorView g(in.grad_out, in.grad_out_dtype, {p.batch, p.heads_q, p.len_q, p.dim_v},
                       {gs[0], gs[1], gs[2], gs[3]});
    copies.push_back(Tensor::copy_of(g, in.grad_out_dtype));
    inputs.grad_out = copies.back().view().data;
    const TensorView& c = copies.back().view();
    for (int d = 0; d < 4; ++d) inputs.grad_out_strides[d] = c.strides[d];
  }
  if (p.dim_v == 0) {  // empty output and gradient: stand-ins for their (absent) storage
    inputs.out = g_stand_in, inputs.grad_out = g_stand_in;
    for (int d = 0; d < 4; ++d) inputs.out_strides[d] = inputs.grad_out_strides[d] = 0;
  }
  // delta = rowsum(dO * O), the softmax's correction term, and each row's normaliser, once per
  // row; rows split over the threads in blocks (serial, delta took 3% of the samples of a
  // backward at L=128, on one thread).
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  Tensor per_row = Tensor::empty({3, rows});
  float* dl = per_row.data<float>();
  float* lse2 = dl + rows;
  float* p_scale = lse2 + rows;
  backward_delta(active_isa(), p, inputs, dl);
  constexpr int64_t kRowsPerTask = 512;
  const int64_t row_blocks = (p.len_q + kRowsPerTask - 1) / kRowsPerTask;
  parallel_for(p.batch * row_blocks, resolve_threads(p.num_threads), [&](int64_t t, int) {
    const int64_t b = t / row_blocks, i0 = t % row_blocks * kRowsPerTask, i1 = std::min(p.len_q, i0 + kRowsPerTask);
    backward_row_normalisers(p, inputs.lse, b, i0, i1, lse2, p_scale);
  });
  inputs.delta = dl;
  inputs.lse2 = lse2;
  inputs.p_scale = p_scale;
  if (amx_bf16_backward_supports(window_kept, inputs, out)) {
    amx_bf16_backward(window_kept, inputs, out);
    return;
  }
  switch (active_isa()) {
    case Isa::avx512_bf16:
      if (bf16_pairs_backward_takes(p, inputs, out)) {
        flash_backward_avx512bf16(p, inputs, out);
        break;
      }
      [[fallthrough]];
    case Isa::amx:
    case Isa::avx512: flash_backward_avx512(p, inputs, out); break;
    case Isa::avx2: flash_backward_avx2(p, inputs, out); break;
    case Isa::portable: flash_backward_portable(p, inputs, out); break;
  }
}

}  // namespace mha::detail
