#include "module/bf16_matmul.hpp"

#include "cpu/amx.hpp"
#include "cpu/dispatch.hpp"
#include "mha/error.hpp"

#if defined(MHA_HAVE_DNNL)
#include <oneapi/dnnl/dnnl.hpp>
#endif
#if defined(MHA_HAVE_OPENMP)
#include <omp.h>
#endif

#include <atomic>
#include <vector>

#include <cpuid.h>

namespace mha::detail {

namespace {
std::atomic<bool> disabled_for_tests{false};

[[maybe_unused]] bool cpu_has_avx512_bf16() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
}
}  // namespace

void disable_bf16_matmul(bool disabled) { disabled_for_tests.store(disabled); }

#if defined(MHA_HAVE_DNNL)

bool bf16_matmul_available() {
  static const bool cpu = cpu_has_avx512_bf16();
  return cpu && !disabled_for_tests.load() && (active_isa() == Isa::avx512 || active_isa() == Isa::amx);
}

struct Bf16MatmulBlock::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::memory::desc a, b, c, bias;
  dnnl::memory::desc b_plain;  // b as given, [k, cols] read transposed (what pack() reads)
  int64_t k = 0, cols = 0, ldb = 0;
  bool tile_layout = false;  // b is oneDNN's BA16a64b2a (pack_slice() writes it)
  bool with_bias = false;
  dnnl::matmul matmul;
};

Bf16MatmulBlock::Bf16MatmulBlock(int64_t rows, int64_t cols, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                                 Bf16Output output)
    : impl_(std::make_unique<Impl>()) {
  using dt = dnnl::memory::data_type;
  const bool rounded = output == Bf16Output::bf16_plus_bias;
  impl_->a = dnnl::memory::desc({rows, k}, dt::bf16, dnnl::memory::dims{lda, 1});
  impl_->b = dnnl::memory::desc({k, cols}, dt::bf16, dnnl::memory::dims{1, ldb});  // B^T: B's rows are its columns
  impl_->c = dnnl::memory::desc({rows, cols}, rounded ? dt::bf16 : dt::f32, dnnl::memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (rounded) {
    impl_->bias = dnnl::memory::desc({1, cols}, dt::f32, dnnl::memory::dims{cols, 1});
    impl_->with_bias = true;
    impl_->b_plain = impl_->b;
    impl_->b = dnnl::memory::desc({k, cols}, dt::bf16, dnnl::memory::format_tag::any);  // the kernel's choice
  } else {
    dnnl::post_ops accumulate;
    accumulate.append_sum(1.0f);  // c += a b^T: c holds the bias already
    attr.set_post_ops(accumulate);
  }
  try {
    const dnnl::matmul::desc d = rounded ? dnnl::matmul::desc(impl_->a, impl_->b, impl_->bias, impl_->c)
                                         : dnnl::matmul::desc(impl_->a, impl_->b, impl_->c);
    const dnnl::matmul::primitive_desc pd(d, attr, impl_->engine);
    if (rounded) {
      impl_->b = pd.weights_desc();
      impl_->k = k, impl_->cols = cols, impl_->ldb = ldb;
      impl_->tile_layout = impl_->b == dnnl::memory::desc({k, cols}, dt::bf16, dnnl::memory::format_tag::BA16a64b2a);
    }
    impl_->matmul = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    throw Error(std::string("internal error: oneDNN could not create a bf16 matmul: ") + e.what());
  }
}

void Bf16MatmulBlock::run(const uint16_t* a, const uint16_t* b, void* c, const float* bias) const {
#if defined(MHA_HAVE_OPENMP)
  // oneDNN parallelises over OpenMP's team size; one thread, as each block is one task of ours
  // (and the caller's setting restored: this may be the caller's own thread).
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  dnnl::stream stream(impl_->engine);
  dnnl::memory ma(impl_->a, impl_->engine, const_cast<uint16_t*>(a));
  dnnl::memory mb(impl_->b, impl_->engine, const_cast<uint16_t*>(b));
  dnnl::memory mc(impl_->c, impl_->engine, c);
  if (impl_->with_bias) {
    std::vector<float> zeros;
    if (bias == nullptr) zeros.assign(static_cast<size_t>(impl_->bias.dims()[1]), 0.0f), bias = zeros.data();  // (no bias)
    dnnl::memory mbias(impl_->bias, impl_->engine, const_cast<float*>(bias));
    impl_->matmul.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_BIAS, mbias}, {DNNL_ARG_DST, mc}});
  } else {
    impl_->matmul.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  }
  stream.wait();
#if defined(MHA_HAVE_OPENMP)
  omp_set_num_threads(saved);
#endif
}

size_t Bf16MatmulBlock::packed_bytes() const { return impl_->b.get_size(); }

void Bf16MatmulBlock::pack(const uint16_t* b, void* packed) const {
  dnnl::stream stream(impl_->engine);
  dnnl::memory from(impl_->b_plain, impl_->engine, const_cast<uint16_t*>(b));
  dnnl::memory to(impl_->b, impl_->engine, packed);
  try {
    dnnl::reorder(from, to).execute(stream, from, to);
  } catch (const dnnl::error& e) {
    throw Error(std::string("internal error: oneDNN could not repack a bf16 weight: ") + e.what());
  }
  stream.wait();
}

bool Bf16MatmulBlock::same_packing(const Bf16MatmulBlock& other) const { return impl_->b == other.impl_->b; }

int64_t Bf16MatmulBlock::pack_slices() const { return impl_->tile_layout ? (impl_->cols + 63) / 64 : 0; }

void Bf16MatmulBlock::pack_slice(const uint16_t* b, void* packed, int64_t slice) const {
  if (!impl_->tile_layout) throw Error("internal error: pack_slice() on a weight layout it does not write");
  const int64_t slice_values = 64 * ((impl_->k + 31) / 32 * 32);
  amx_pack_weight_slice(b, impl_->ldb, impl_->cols, impl_->k, slice,
                        static_cast<uint16_t*>(packed) + slice * slice_values);
}

#else  // built without oneDNN

bool bf16_matmul_available() { return false; }

struct Bf16MatmulBlock::Impl {};

Bf16MatmulBlock::Bf16MatmulBlock(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, Bf16Output) {
  throw Error("internal error: a bf16 matmul was asked of a library built without oneDNN");
}

void Bf16MatmulBlock::run(const uint16_t*, const uint16_t*, void*, const float*) const {}
size_t Bf16MatmulBlock::packed_bytes() const { return 0; }
void Bf16MatmulBlock::pack(const uint16_t*, void*) const {}
bool Bf16MatmulBlock::same_packing(const Bf16MatmulBlock&) const { return true; }
int64_t Bf16MatmulBlock::pack_slices() const { return 0; }
void Bf16MatmulBlock::pack_slice(const uint16_t*, void*, int64_t) const {}

#endif

Bf16MatmulBlock::~Bf16MatmulBlock() = default;
Bf16MatmulBlock::Bf16MatmulBlock(Bf16MatmulBlock&&) noexcept = default;

}  // namespace mha::detail
