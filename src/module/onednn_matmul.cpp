#include "module/onednn_matmul.hpp"

#include "core/scratch.hpp"
#include "cpu/dispatch.hpp"
#include "cpu/weight_packing.hpp"
#include "mha/error.hpp"

#if defined(MHA_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.hpp>
#endif
#if defined(MHA_HAVE_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <string>
#include <unordered_map>
#include <vector>

namespace mha::detail {

namespace {
std::atomic<bool> bf16_disabled_for_tests{false}, f32_disabled_for_tests{false};

[[maybe_unused]] bool cpu_has_avx512_bf16() {
  const std::vector<Isa> isas = supported_isas();
  return std::find(isas.begin(), isas.end(), Isa::avx512_bf16) != isas.end();
}
}  // namespace

void disable_bf16_matmul(bool disabled) { bf16_disabled_for_tests.store(disabled); }
void disable_f32_matmul(bool disabled) { f32_disabled_for_tests.store(disabled); }

#if defined(MHA_HAVE_DNNL)

bool bf16_matmul_available() {
  static const bool cpu = cpu_has_avx512_bf16();
  return cpu && !bf16_disabled_for_tests.load() && active_isa() >= Isa::avx512;
}

bool f32_matmul_available() {
  return !f32_disabled_for_tests.load() && active_isa() >= Isa::avx512;
}

struct MatmulBlock::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::memory::desc a, b, c, bias;
  dnnl::memory::desc b_plain;  // b as given, [k, cols] read transposed (what pack() reads)
  int64_t k = 0, cols = 0, ldb = 0;
  enum class Layout { other, bf16_pairs, f32_blocks } layout = Layout::other;  // (pack_slice()'s)
  bool with_bias = false;
  dnnl::memory::desc scratchpad;
  dnnl::matmul matmul;
};

MatmulBlock::MatmulBlock(int64_t rows, int64_t cols, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                         MatmulOutput output)
    : impl_(std::make_unique<Impl>()) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const bool with_bias = output != MatmulOutput::accumulate_f32;
  const dt in = output == MatmulOutput::f32_plus_bias ? dt::f32 : dt::bf16;
  const dt out = output == MatmulOutput::bf16_plus_bias ? dt::bf16 : dt::f32;
  impl_->a = dnnl::memory::desc({rows, k}, in, dnnl::memory::dims{lda, 1});
  impl_->b = dnnl::memory::desc({k, cols}, in, dnnl::memory::dims{1, ldb});  // B^T: B's rows are its columns
  impl_->c = dnnl::memory::desc({rows, cols}, out, dnnl::memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  // Scratch memory given by the caller, per thread: in the library's own mode a primitive's
  // scratchpad is shared by every thread that runs it, and blocks of one shape run on several
  // threads at once (float32 blocks then read each other's partial sums).
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (with_bias) {
    impl_->bias = dnnl::memory::desc({1, cols}, dt::f32, dnnl::memory::dims{cols, 1});
    impl_->with_bias = true;
    impl_->b_plain = impl_->b;
    impl_->b = dnnl::memory::desc({k, cols}, in, tag::any);  // the kernel's choice
  } else {
    dnnl::post_ops accumulate;
    accumulate.append_sum(1.0f);  // c += a b^T: c holds the bias already
    attr.set_post_ops(accumulate);
  }
  try {
    const dnnl::matmul::desc d = with_bias ? dnnl::matmul::desc(impl_->a, impl_->b, impl_->bias, impl_->c)
                                           : dnnl::matmul::desc(impl_->a, impl_->b, impl_->c);
    const dnnl::matmul::primitive_desc pd(d, attr, impl_->engine);
    if (with_bias) {
      impl_->b = pd.weights_desc();
      impl_->k = k, impl_->cols = cols, impl_->ldb = ldb;
      if (in == dt::bf16 && impl_->b == dnnl::memory::desc({k, cols}, in, tag::BA16a64b2a))
        impl_->layout = Impl::Layout::bf16_pairs;
      if (in == dt::f32 && impl_->b == dnnl::memory::desc({k, cols}, in, tag::BA16a64b))
        impl_->layout = Impl::Layout::f32_blocks;
    }
    impl_->scratchpad = pd.scratchpad_desc();
    impl_->matmul = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    throw Error(std::string("internal error: oneDNN could not create a matmul: ") + e.what());
  }
}

MatmulBlock::MatmulBlock(int64_t rows, int64_t cols, int64_t k, bool transpose_a, int64_t lda, bool transpose_b,
                         int64_t ldb, int64_t ldc, float beta, bool bf16)
    : impl_(std::make_unique<Impl>()) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  if (bf16 && beta != 0.0f) throw Error("internal error: a bfloat16 matmul block accumulates into nothing");
  const dt type = bf16 ? dt::bf16 : dt::f32;
  impl_->a = dnnl::memory::desc({rows, k}, type, transpose_a ? dims{1, lda} : dims{lda, 1});
  impl_->b = dnnl::memory::desc({k, cols}, type, transpose_b ? dims{1, ldb} : dims{ldb, 1});
  impl_->c = dnnl::memory::desc({rows, cols}, type, dims{ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // (per thread, as above)
  if (beta != 0.0f) {
    dnnl::post_ops accumulate;
    accumulate.append_sum(beta);
    attr.set_post_ops(accumulate);
  }
  try {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(impl_->a, impl_->b, impl_->c), attr, impl_->engine);
    impl_->scratchpad = pd.scratchpad_desc();
    impl_->matmul = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    throw Error(std::string("internal error: oneDNN could not create a matmul: ") + e.what());
  }
}

void MatmulBlock::run(const void* a, const void* b, void* c, const float* bias) const {
#if defined(MHA_HAVE_OPENMP)
  // oneDNN parallelises over OpenMP's team size; one thread, as each block is one task of ours
  // (and the caller's setting restored: this may be the caller's own thread).
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  dnnl::stream stream(impl_->engine);
  dnnl::memory ma(impl_->a, impl_->engine, const_cast<void*>(a));
  dnnl::memory mb(impl_->b, impl_->engine, const_cast<void*>(b));
  dnnl::memory mc(impl_->c, impl_->engine, c);
  dnnl::memory scratch(impl_->scratchpad, impl_->engine,
                       thread_scratch(impl_->scratchpad.get_size(), ScratchSlot::library));
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, scratch}};
  std::vector<float> zeros;
  if (impl_->with_bias) {
    if (bias == nullptr) zeros.assign(static_cast<size_t>(impl_->bias.dims()[1]), 0.0f), bias = zeros.data();  // (no bias)
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(impl_->bias, impl_->engine, const_cast<float*>(bias)));
  }
  impl_->matmul.execute(stream, args);
  stream.wait();
#if defined(MHA_HAVE_OPENMP)
  omp_set_num_threads(saved);
#endif
}

size_t MatmulBlock::packed_bytes() const { return impl_->b.get_size(); }

void MatmulBlock::pack(const void* b, void* packed) const {
  dnnl::stream stream(impl_->engine);
  dnnl::memory from(impl_->b_plain, impl_->engine, const_cast<void*>(b));
  dnnl::memory to(impl_->b, impl_->engine, packed);
  try {
    dnnl::reorder(from, to).execute(stream, from, to);
  } catch (const dnnl::error& e) {
    throw Error(std::string("internal error: oneDNN could not repack a weight: ") + e.what());
  }
  stream.wait();
}

bool MatmulBlock::same_packing(const MatmulBlock& other) const { return impl_->b == other.impl_->b; }

int64_t MatmulBlock::pack_slices() const {
  return impl_->layout == Impl::Layout::other ? 0 : (impl_->cols + 63) / 64;
}

void MatmulBlock::pack_slice(const void* b, void* packed, int64_t slice) const {
  const int64_t k = impl_->k, cols = impl_->cols, ldb = impl_->ldb;
  switch (impl_->layout) {
    case Impl::Layout::bf16_pairs:
      pack_bf16_weight_slice(static_cast<const uint16_t*>(b), ldb, cols, k, slice,
                             static_cast<uint16_t*>(packed) + slice * 64 * ((k + 31) / 32 * 32));
      return;
    case Impl::Layout::f32_blocks:
      pack_f32_weight_slice(static_cast<const float*>(b), ldb, cols, k, slice,
                            static_cast<float*>(packed) + slice * 64 * ((k + 15) / 16 * 16));
      return;
    case Impl::Layout::other:
      break;
  }
  throw Error("internal error: pack_slice() on a weight layout it does not write");
}

#else  // built without oneDNN

bool bf16_matmul_available() { return false; }
bool f32_matmul_available() { return false; }

struct MatmulBlock::Impl {};

MatmulBlock::MatmulBlock(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, MatmulOutput) {
  throw Error("internal error: a oneDNN matmul was asked of a library built without oneDNN");
}
MatmulBlock::MatmulBlock(int64_t, int64_t, int64_t, bool, int64_t, bool, int64_t, int64_t, float, bool) {
  throw Error("internal error: a oneDNN matmul was asked of a library built without oneDNN");
}

void MatmulBlock::run(const void*, const void*, void*, const float*) const {}
size_t MatmulBlock::packed_bytes() const { return 0; }
void MatmulBlock::pack(const void*, void*) const {}
bool MatmulBlock::same_packing(const MatmulBlock&) const { return true; }
int64_t MatmulBlock::pack_slices() const { return 0; }
void MatmulBlock::pack_slice(const void*, void*, int64_t) const {}

#endif

MatmulBlock::~MatmulBlock() = default;
MatmulBlock::MatmulBlock(MatmulBlock&&) noexcept = default;

}  // namespace mha::detail
