// Variable-length attention: each packed sequence is one scaled_dot_product_attention problem on
// strided views of the packed tensors, run by the same kernels, the sequences spread over the
// threads by cost.
#include "mha/varlen.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/attention_problem.hpp"
#include "core/sdpa_host.hpp"
#include "core/sequence_schedule.hpp"
#include "core/thread_pool.hpp"

namespace mha {

uint64_t varlen_dropout_seed(uint64_t seed, int64_t sequence) {
  // splitmix64's finaliser over the seed and the sequence index: nearby seeds and indices give
  // unrelated results, and sequence s of one call never shares a mask with sequence s + 1.
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(sequence) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

using detail::AttentionProblem;

struct PackedShape {
  int64_t sequences = 0, total_q = 0, total_k = 0, heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
};

// Checks what is particular to the packed layout; make_sdpa_problem checks the rest (dtypes,
// head counts, head dims, scale, dropout) on the whole packed tensors as one sequence.
PackedShape validate(const TensorView& q, const TensorView& k, const TensorView& v, std::span<const int64_t> cu_q,
                     std::span<const int64_t> cu_k, const SdpaOptions& options) {
  const TensorView* inputs[] = {&q, &k, &v};
  const char* names[] = {"query", "key", "value"};
  const char* layouts[] = {"[Tq, Hq, Dk]", "[Tk, Hkv, Dk]", "[Tk, Hkv, Dv]"};
  for (int i = 0; i < 3; ++i) {
    if (inputs[i]->ndim != 3) {
      throw Error(std::string(names[i]) + ": expected a packed " + layouts[i] + " tensor (rank 3), got shape " +
                  inputs[i]->shape_str());
    }
    require_cpu(*inputs[i], names[i]);
  }
  if (k.size(0) != v.size(0) || k.size(1) != v.size(1)) {
    throw Error("key/value: expected the same rows and heads [Tk, Hkv], got key " + k.shape_str() + " and value " +
                v.shape_str());
  }
  if (options.attn_mask) {
    throw Error("attn_mask: not taken by the variable-length functions (causality and the sequence boundaries are "
                "their masks); pad the batch and call scaled_dot_product_attention to pass a mask");
  }
  detail::check_offsets(cu_q, q.size(0), "cu_seqlens_q", "query");
  detail::check_offsets(cu_k, k.size(0), "cu_seqlens_k", "key/value");
  if (cu_q.size() != cu_k.size()) {
    throw Error("cu_seqlens_q/cu_seqlens_k: expected one offset per sequence plus one in each, got " +
                std::to_string(cu_q.size()) + " and " + std::to_string(cu_k.size()) + " offsets");
  }
  const int64_t sequences = static_cast<int64_t>(cu_q.size()) - 1;
  SdpaOptions whole = options;
  whole.is_causal = false;
  // Per-sequence options: [H] or [sequences, H] (FlashAttention's [batch, H]); the rest (dtype,
  // heads) is checked below on the first sequence's.
  for (auto [option, name, heads] : {std::tuple{&SdpaOptions::alibi_slopes, "alibi_slopes", "[Hq]"},
                                     std::tuple{&SdpaOptions::k_descale, "k_descale", "[Hkv]"},
                                     std::tuple{&SdpaOptions::v_descale, "v_descale", "[Hkv]"}}) {
    if (!(options.*option)) continue;
    detail::check_per_sequence_option(*(options.*option), name, heads, "sequences", sequences, option != &SdpaOptions::alibi_slopes);
    whole.*option = detail::first_sequence_option(options.*option);
  }
  (void)detail::make_sdpa_problem(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), whole,
                                  detail::InputDtypes::fused);
  return {sequences, q.size(0), k.size(0), q.size(1), k.size(1), q.size(2), v.size(2)};
}

// Rows [begin, end) of a packed [T, H, D] tensor as the [H, L, D] view SDPA reads.
TensorView rows(const TensorView& packed, int64_t begin, int64_t end) {
  return packed.slice(0, begin, end).transpose(0, 1);
}

// Sets rows [begin, end) of a packed [T, H, D] tensor to zero.
void zero_rows(const Tensor& packed, int64_t begin, int64_t end) {
  const TensorView r = packed.view().slice(0, begin, end);
  copy_into(Tensor::zeros(r.sizes(), r.dtype), r);
}

// Sequence s's own problem, on `threads` threads, ready to run.
AttentionProblem sequence_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                                  std::span<const int64_t> cu_q, std::span<const int64_t> cu_k,
                                  const SdpaOptions& options, int64_t s, int threads) {
  SdpaOptions o = options;
  o.num_threads = threads;
  if (options.dropout_p > 0) o.dropout_seed = varlen_dropout_seed(options.dropout_seed, s);
  for (auto option : {&SdpaOptions::alibi_slopes, &SdpaOptions::k_descale, &SdpaOptions::v_descale})
    o.*option = detail::sequence_option(options.*option, s);  // [1, H]: this sequence's
  AttentionProblem p = detail::make_sdpa_problem(rows(q, cu_q[s], cu_q[s + 1]), rows(k, cu_k[s], cu_k[s + 1]),
                                                 rows(v, cu_k[s], cu_k[s + 1]), o, detail::InputDtypes::fused);
  detail::materialise_inputs(p);
  return p;
}

// Each sequence's share of the work: its (query, key) pairs times the head dims and heads.
std::vector<double> sequence_costs(const PackedShape& shape, std::span<const int64_t> cu_q,
                                   std::span<const int64_t> cu_k, const SdpaOptions& options) {
  std::vector<double> cost(static_cast<size_t>(shape.sequences));
  for (int64_t s = 0; s < shape.sequences; ++s) {
    const int64_t lq = cu_q[s + 1] - cu_q[s], lk = cu_k[s + 1] - cu_k[s];
    // (head dims of 0 still leave the softmax's work, which the kernels still do)
    cost[s] = lq == 0 || lk == 0 ? 0.0
                                 : attention_flops(1, shape.heads_q, lq, lk, std::max<int64_t>(shape.dim_qk, 1),
                                                   std::max<int64_t>(shape.dim_v, 1), options.is_causal,
                                                   options.causal_alignment);
  }
  return cost;
}

// The forward, into out [Tq, Hq, Dv] and, when defined, lse [Hq, Tq].
void varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v, std::span<const int64_t> cu_q,
                    std::span<const int64_t> cu_k, const SdpaOptions& options, const PackedShape& shape,
                    const Tensor& out, const Tensor* lse) {
  const DType lse_dtype = q.dtype == DType::f64 ? DType::f64 : DType::f32;
  // Sequences with queries and no key: zeros, and the log-sum-exp of no visible key (+inf, or the
  // sink's).
  for (int64_t s = 0; s < shape.sequences; ++s) {
    if (cu_q[s + 1] == cu_q[s] || cu_k[s + 1] != cu_k[s]) continue;
    zero_rows(out, cu_q[s], cu_q[s + 1]);
    if (lse) detail::fill_lse_without_keys(options, lse->view().slice(1, cu_q[s], cu_q[s + 1]));
  }
  const int threads = detail::resolve_threads(options.num_threads);
  detail::for_each_sequence(sequence_costs(shape, cu_q, cu_k, options), threads, [&](int64_t s, int call_threads) {
    const int64_t q0 = cu_q[s], q1 = cu_q[s + 1];
    const AttentionProblem p = sequence_problem(q, k, v, cu_q, cu_k, options, s, call_threads);
    if (!lse) {
      detail::sdpa_forward_host(p, rows(out, q0, q1), nullptr, nullptr);
      return;
    }
    Tensor own_lse = Tensor::empty({shape.heads_q, q1 - q0}, lse_dtype);  // the kernels write it packed
    detail::sdpa_forward_host(p, rows(out, q0, q1), nullptr, own_lse.view().data);
    copy_into(own_lse, lse->view().slice(1, q0, q1));
  });
}

}  // namespace

Tensor scaled_dot_product_attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                                           std::span<const int64_t> cu_seqlens_q,
                                           std::span<const int64_t> cu_seqlens_k, const SdpaOptions& options) {
  const PackedShape shape = validate(q, k, v, cu_seqlens_q, cu_seqlens_k, options);
  Tensor out = Tensor::empty({shape.total_q, shape.heads_q, shape.dim_v}, q.dtype);
  varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options, shape, out, nullptr);
  return out;
}

AttentionForTraining scaled_dot_product_attention_varlen_for_training(const TensorView& q, const TensorView& k,
                                                                      const TensorView& v,
                                                                      std::span<const int64_t> cu_seqlens_q,
                                                                      std::span<const int64_t> cu_seqlens_k,
                                                                      const SdpaOptions& options) {
  const PackedShape shape = validate(q, k, v, cu_seqlens_q, cu_seqlens_k, options);
  AttentionForTraining r;
  r.output = Tensor::empty({shape.total_q, shape.heads_q, shape.dim_v}, q.dtype);
  r.lse = Tensor::empty({shape.heads_q, shape.total_q}, q.dtype == DType::f64 ? DType::f64 : DType::f32);
  varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options, shape, r.output, &r.lse);
  return r;
}

AttentionGradients scaled_dot_product_attention_varlen_backward(
    const TensorView& q, const TensorView& k, const TensorView& v, std::span<const int64_t> cu_q,
    std::span<const int64_t> cu_k, const AttentionForTraining& saved, const TensorView& grad_output,
    const SdpaOptions& options, const SdpaGradientsWanted& wanted) {
  const PackedShape shape = validate(q, k, v, cu_q, cu_k, options);
  if (wanted.attn_mask) throw Error("wanted.attn_mask: the variable-length functions take no attn_mask");
  const DType lse_dtype = q.dtype == DType::f64 ? DType::f64 : DType::f32;
  detail::check_output_view(saved.output, {shape.total_q, shape.heads_q, shape.dim_v}, q.dtype, "saved.output");
  detail::check_output_view(saved.lse, {shape.heads_q, shape.total_q}, lse_dtype, "saved.lse");
  detail::check_output_view(grad_output, {shape.total_q, shape.heads_q, shape.dim_v}, q.dtype, "grad_output");
  require_cpu(grad_output, "grad_output");

  AttentionGradients g;
  if (wanted.query) g.query = Tensor::empty(q.sizes(), q.dtype);
  if (wanted.key) g.key = Tensor::empty(k.sizes(), q.dtype);
  if (wanted.value) g.value = Tensor::empty(v.sizes(), q.dtype);
  // A sequence without queries or without keys runs no kernel: its rows' gradients are zero.
  for (int64_t s = 0; s < shape.sequences; ++s) {
    if (cu_q[s + 1] != cu_q[s] && cu_k[s + 1] != cu_k[s]) continue;
    if (wanted.query) zero_rows(g.query, cu_q[s], cu_q[s + 1]);
    if (wanted.key) zero_rows(g.key, cu_k[s], cu_k[s + 1]);
    if (wanted.value) zero_rows(g.value, cu_k[s], cu_k[s + 1]);
  }
  const int threads = detail::resolve_threads(options.num_threads);
  detail::for_each_sequence(sequence_costs(shape, cu_q, cu_k, options), threads, [&](int64_t s, int call_threads) {
    const int64_t q0 = cu_q[s], q1 = cu_q[s + 1], k0 = cu_k[s], k1 = cu_k[s + 1];
    const AttentionProblem p = sequence_problem(q, k, v, cu_q, cu_k, options, s, call_threads);
    const Tensor own_lse = Tensor::copy_of(saved.lse.view().slice(1, q0, q1));  // the kernels read it packed
    detail::BackwardViews views;
    views.out = detail::folded(p, rows(saved.output, q0, q1), shape.heads_q, "saved.output");
    views.grad_out = detail::folded(p, rows(grad_output, q0, q1), shape.heads_q, "grad_output");
    views.lse = own_lse.view().data;
    if (wanted.query) views.dq = detail::folded(p, rows(g.query, q0, q1), shape.heads_q, "query");
    if (wanted.key) views.dk = detail::folded(p, rows(g.key, k0, k1), shape.heads_kv, "key");
    if (wanted.value) views.dv = detail::folded(p, rows(g.value, k0, k1), shape.heads_kv, "value");
    detail::sdpa_backward_host(p, views);
  });
  if (options.sinks) {  // over every row at once: [1, Hq, Tq, Dv] views of the packed rows
    auto heads_first = [](const TensorView& t) { return t.transpose(0, 1).unsqueeze(0); };
    g.sinks = detail::sink_gradient(*options.sinks, heads_first(saved.output), heads_first(grad_output),
                                    saved.lse.view().unsqueeze(0), threads);
  }
  return g;
}

}  // namespace mha
