// A validated attention call in one normalised form: 4-D strided views (batch dimensions folded,
// core/batch_dims.hpp), masks broadcast to (b, h, i, j) strides, causality as an offset. The SDPA front end and the module build it; the
// fused kernels and the reference consume it.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "mha/sdpa.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

enum class MaskKind : uint8_t {
  additive,      // float32 values added to the scaled scores
  keep_if_true,  // bool, SDPA convention: true attends
  drop_if_true,  // bool, nn.MultiheadAttention convention: true is masked out
};

struct MaskTerm {
  const void* data = nullptr;
  DType dtype = DType::f32;
  MaskKind kind = MaskKind::additive;
  std::array<int64_t, 4> strides{};  // over (b, h, i, j); 0 where broadcast

  // What the mask adds to score (b, h, i, j): 0, -inf, or the additive value.
  float bias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const int64_t off = b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3];
    if (kind == MaskKind::additive) return static_cast<const float*>(data)[off];
    const bool v = static_cast<const uint8_t*>(data)[off] != 0;  // any nonzero byte is true
    return v == (kind == MaskKind::keep_if_true) ? 0.0f : -std::numeric_limits<float>::infinity();
  }
  // A term of j - i alone read with query stride -1 (ALiBi's biases, add_alibi_term): a key's
  // values for consecutive queries lie consecutive in memory, the last query's first.
  bool by_distance() const { return kind == MaskKind::additive && strides[2] == -1 && strides[3] == 1; }
  // bias() in float64, for float64 calls: a float64 term's values as they are.
  double bias_f64(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (kind != MaskKind::additive || dtype != DType::f64) return bias(b, h, i, j);
    return static_cast<const double*>(data)[b * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]];
  }
};

// Sink h of an [Hq] sinks view (float32 or float64).
inline double sink_value(const TensorView& sinks, int64_t h) {
  const int64_t off = h * sinks.strides[0];
  return sinks.dtype == DType::f64 ? sinks.data_as<double>()[off] : sinks.data_as<float>()[off];
}

struct AttentionProblem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_k = 0, dim_qk = 0, dim_v = 0;
  TensorView q, k, v;  // [B, H, L, D] views, any strides
  std::array<MaskTerm, 3> masks{};
  int num_masks = 0;
  bool causal = false;
  int64_t causal_offset = 0;  // query i sees key j iff j <= i + causal_offset
  // The left end of a sliding window: query i sees no key j < i + window_offset. (Its right end
  // is a causal offset.) The float32 flash forward and backward skip and mask by it; the other
  // paths read it as a mask term (with_window_as_mask).
  bool windowed = false;
  int64_t window_offset = 0;
  // ALiBi: -slope(b, h) * |i + alibi_diagonal - j| added to score (b, h, i, j). make_sdpa_problem
  // keeps the slopes as given; materialise_inputs folds them to [B, H] (alibi_slopes) and adds the
  // term every kernel reads (alibi_term its index): per slope slice a buffer of the biases by
  // j - i, read with query stride -1 and key stride 1 (Lq + Lk - 1 floats, not Lq x Lk).
  std::optional<TensorView> alibi_input;
  TensorView alibi_slopes;  // [B, H] view (stride 0 where the slopes broadcast), float32 or float64
  int64_t alibi_diagonal = 0;
  int alibi_term = -1;
  // Attention sinks [Hq] (float32, float64 for float64 calls): the kernels never see them; the
  // host forward scales each row by its share of the softmax with the sink (apply_sinks).
  std::optional<TensorView> sinks;
  double sink(int64_t h) const { return sink_value(*sinks, h); }
  // Dequantisation scales of float8 keys and values (SdpaOptions::k_descale, v_descale), as given
  // (checked by make_sdpa_problem), then read by materialise_inputs into [B, Hkv] float32 each
  // (descale_storage; null without them). The kernels fold the key's into the head's softmax
  // scale and the value's into its output's 1 / l.
  std::array<std::optional<TensorView>, 2> descale_input;
  const float* k_descales = nullptr;
  const float* v_descales = nullptr;
  Tensor descale_storage;
  float key_descale(int64_t b, int64_t hk) const { return k_descales ? k_descales[b * heads_kv + hk] : 1.0f; }
  float value_descale(int64_t b, int64_t hk) const { return v_descales ? v_descales[b * heads_kv + hk] : 1.0f; }
  // A paged key/value cache (core/paged_attention.cpp; one batch entry): key j lies in page
  // key_pages[j / page_size] at row j % page_size, k's and v's strides[0] stepping from page to
  // page. Null for keys and values in one strided view. The decoding kernel (few_queries.hpp) and
  // the bfloat16 pair-product tile kernel read pages; other calls gather them first
  // (reads_pages_in_place, cpu/attention_kernel.hpp).
  const int32_t* key_pages = nullptr;
  int64_t page_size = 0;
  double scale = 1.0;
  // Logit soft-capping: each scaled score s becomes softcap * tanh(s / softcap) before the mask
  // terms (0: none). Every host kernel applies it where it forms its scores (cpu/softcap.hpp).
  double softcap = 0.0;
  double dropout_p = 0.0;
  uint64_t dropout_seed = 0;
  int num_threads = 1;
  Tensor mask_storage;  // a float32 copy of a bfloat16/float16 attn_mask, which its term reads (materialise_inputs)
  Tensor window_mask;   // [Lq, Lk] bool, the sliding window's left end as a mask term (with_window_as_mask)
  Tensor alibi_storage;  // the folded slopes where they do not fold in place, then the term's biases
  Tensor alibi_biases;   // [slope slices, Lq + Lk - 1]: ALiBi's term reads it
  // The call's batch dimensions (every dimension of the output before its last two, broadcast as
  // PyTorch broadcasts them; empty for 2-D inputs): batch = the product of all but the last,
  // heads_q the last.
  Shape batch_shape;
  // Inputs (q, k, v, attn_mask) whose batch dimensions do not fold into one stride: the views as
  // given, until materialise_inputs copies them (their slots above hold stand-ins until then),
  // and the copies.
  std::array<std::optional<TensorView>, 4> unfolded;
  std::array<Tensor, 4> input_storage;
  // Keys (slot 1) or values (slot 2) with a head count of their own, which materialise_inputs
  // repeats to heads_kv (PyTorch's repeat_interleave) before folding them; 0 where not.
  std::array<int64_t, 4> repeat_heads_to{};

  // batch_shape with the heads replaced by `heads` (the key/value heads): the batch dimensions of
  // a tensor read or written per key/value head.
  Shape batch_shape_with_heads(int64_t heads) const {
    Shape s = batch_shape;
    if (!s.empty()) s.back() = heads;
    return s;
  }

  bool on_cpu() const { return q.device.is_cpu(); }
  // Query heads per key/value head (1 for a call without heads, which has nothing to group).
  int64_t group() const { return heads_kv > 0 ? heads_q / heads_kv : 1; }
  // Keys [0, causal_end(i)) are visible to query i (all of them without causality).
  int64_t causal_end(int64_t i) const {
    if (!causal) return len_k;
    const int64_t e = i + causal_offset + 1;
    return e < 0 ? 0 : (e > len_k ? len_k : e);
  }
  // Keys [window_begin(i), causal_end(i)) are visible to query i.
  int64_t window_begin(int64_t i) const {
    if (!windowed) return 0;
    const int64_t b = i + window_offset;
    return b < 0 ? 0 : (b > len_k ? len_k : b);
  }
  bool visible(int64_t i, int64_t j) const { return j >= window_begin(i) && j < causal_end(i); }
  // Where row j of k or v (key/value head h of batch entry b) starts, in elements from t.data.
  int64_t key_row_offset(const TensorView& t, int64_t b, int64_t h, int64_t j) const {
    if (key_pages == nullptr) return b * t.strides[0] + h * t.strides[1] + j * t.strides[2];
    return key_pages[j / page_size] * t.strides[0] + h * t.strides[1] + j % page_size * t.strides[2];
  }
  // Whether keys [j, j + n) lie t.strides[2] apart (in one page of a paged cache).
  bool key_rows_evenly_spaced(int64_t j, int64_t n) const {
    return key_pages == nullptr || j % page_size + n <= page_size;
  }
  // ALiBi's slope for (b, h) (after materialise_inputs).
  double alibi_slope(int64_t b, int64_t h) const {
    const int64_t off = b * alibi_slopes.strides[0] + h * alibi_slopes.strides[1];
    return alibi_slopes.dtype == DType::f64 ? alibi_slopes.data_as<double>()[off] : alibi_slopes.data_as<float>()[off];
  }
  void add_mask(const MaskTerm& m) { masks[num_masks++] = m; }
};

// Which input dtypes a caller accepts: the public functions float32, float64, bfloat16 and float16,
// one dtype for q, k, v (float64 on the host only); the reference any floating dtypes, mixed.
enum class InputDtypes { fused, any_float };

// Validates the arguments of scaled_dot_product_attention (mha::Error on any problem) and builds
// the problem.
AttentionProblem make_sdpa_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                                   const SdpaOptions& options, InputDtypes dtypes);

// The steps of building a problem that read data, which make_sdpa_problem (a validator that never
// reads data) leaves to the public functions that run it: inputs whose batch dimensions do not
// fold into one stride are copied (p.unfolded), and a float mask term of bfloat16 or float16
// (PyTorch's usual mask for a bfloat16 model) is replaced by a float32 copy the kernels read
// (exact), held in p.mask_storage; ALiBi's slopes become its term (add_alibi_term). mha::Error for
// any of these on a device, and for a sliding window's left end (window_left), which the host
// kernels apply.
void materialise_inputs(AttentionProblem& p);

// ALiBi's term (materialise_inputs): folds p.alibi_input to p.alibi_slopes, checks the slopes are
// finite, and adds the mask term of their biases. mha::Error on a device.
void add_alibi_term(AttentionProblem& p);

// p with the left end of its sliding window as a bool mask term ([Lq, Lk], or [1, Lk] broadcast
// along the queries for one query row; held in window_mask; the kernels skip the blocks it
// excludes, as they skip a padding mask's) for the paths that do not apply the window
// themselves; p as it is without a window.
AttentionProblem with_window_as_mask(const AttentionProblem& p);

// Scales per key/value head (SdpaOptions::k_descale, v_descale; write_paged_cache's): float32 on
// the host, broadcastable to `target` (right-aligned, dimensions of size 1 or missing stretching);
// mha::Error naming `name` otherwise. check_scale_values reads each element (finite and > 0 or
// an mha::Error); read_scales checks both and returns them broadcast to `target`, numel(target)
// floats in row-major order.
void check_scales(const TensorView& scales, const Shape& target, const std::string& name);
void check_scale_values(const TensorView& scales, const std::string& name);
std::vector<float> read_scales(const TensorView& scales, const Shape& target, const std::string& name);

// A per-sequence option of a paged or packed call (alibi_slopes, k_descale, v_descale): [H] or
// [sequences, H] (FlashAttention's [batch, H]), either dimension 1 to broadcast, or [] where
// `scalar_ok`; mha::Error naming it otherwise ("[Hq]" the heads it names, "B" the sequences').
// The rest (dtype, heads) is checked on one sequence's (first_sequence_option) by make_sdpa_problem.
void check_per_sequence_option(const TensorView& t, const std::string& name, const std::string& heads,
                               const std::string& sequences_name, int64_t sequences, bool scalar_ok);
// The option as sequence s reads it: row s of a [sequences, H] tensor (as [1, H]), else as given.
std::optional<TensorView> sequence_option(const std::optional<TensorView>& t, int64_t s);
// The first sequence's, as the validation reads it: row 0 of a [sequences, H] tensor as [H].
std::optional<TensorView> first_sequence_option(const std::optional<TensorView>& t);

// t, of shape p.batch_shape_with_heads(heads) + [rows, cols], as the [B, heads, rows, cols] view
// the kernels read or write (fold_batch); mha::Error naming `name` where its strides do not fold.
TensorView folded(const AttentionProblem& p, const TensorView& t, int64_t heads, const std::string& name);

// Checks a mask's dtype and broadcastability to `target` (B, H, Lq, Lk) and returns its term.
// Bool masks take `bool_kind`; float masks are additive (the kernels read float32: a bfloat16 or
// float16 term is for the caller to widen, see make_sdpa_problem; a float64 one only in a
// `float64_call`, whose kernel reads float64); anything else is an mha::Error.
MaskTerm make_mask_term(const TensorView& mask, const std::string& name, MaskKind bool_kind,
                        const std::array<int64_t, 4>& target, bool float64_call = false);

// Checks that a caller-provided output view has shape `expected`, float32 or float64 as given,
// and data.
void check_output_view(const TensorView& out, const Shape& expected, DType dtype, const std::string& name);

// The shape of a result over the call's batch dimensions: p.batch_shape + [rows, cols] (the
// output, the weights), or p.batch_shape + [rows] (the log-sum-exp, cols < 0).
Shape output_shape(const AttentionProblem& p, int64_t rows, int64_t cols = -1);

}  // namespace mha::detail
