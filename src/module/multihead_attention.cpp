// MultiheadAttention: construction, parameters, initialisation and state dicts.
#include "mha/multihead_attention.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "core/dropout.hpp"
#include "core/parallel_copy.hpp"
#include "core/thread_pool.hpp"

namespace mha {
namespace {

// A reproducible stream of uniform and normal numbers from a seed (the same on every platform,
// unlike std:: distributions).
class InitRng {
 public:
  explicit InitRng(uint64_t seed) : state_(seed) {}
  double uniform() {  // [0, 1)
    state_ += 0x9e3779b97f4a7c15ull;
    return static_cast<double>(detail::splitmix64(state_) >> 11) * 0x1.0p-53;
  }
  double normal() {  // Box-Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

void fill_uniform(Tensor& t, InitRng& rng, double bound) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
}

void fill_normal(Tensor& t, InitRng& rng, double stddev) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(rng.normal() * stddev);
}

// PyTorch's fan computation for a weight [out, in] (or [a, b, c...]): fan_in = size(1) * receptive,
// fan_out = size(0) * receptive.
std::pair<double, double> fans(const Tensor& t) {
  double receptive = 1;
  for (int d = 2; d < t.ndim(); ++d) receptive *= static_cast<double>(t.size(d));
  return {static_cast<double>(t.size(1)) * receptive, static_cast<double>(t.size(0)) * receptive};
}

void check_module_dtype(DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f64 && dtype != DType::bf16 && dtype != DType::f16) {
    throw Error("dtype: expected float32, float64, bfloat16 or float16 for the module's parameters, got " +
                std::string(dtype_name(dtype)));
  }
}

}  // namespace

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, const MultiheadAttentionOptions& options)
    : embed_dim_(embed_dim), num_heads_(num_heads), options_(options) {
  if (embed_dim <= 0) throw Error("embed_dim: expected a positive size, got " + std::to_string(embed_dim));
  if (num_heads <= 0) throw Error("num_heads: expected a positive count, got " + std::to_string(num_heads));
  if (embed_dim % num_heads != 0) {
    throw Error("embed_dim must be divisible by num_heads: embed_dim = " + std::to_string(embed_dim) +
                ", num_heads = " + std::to_string(num_heads));
  }
  kdim_ = options.kdim.value_or(embed_dim);
  vdim_ = options.vdim.value_or(embed_dim);
  if (kdim_ <= 0) throw Error("kdim: expected a positive size, got " + std::to_string(kdim_));
  if (vdim_ <= 0) throw Error("vdim: expected a positive size, got " + std::to_string(vdim_));
  check_module_dtype(options.dtype);
  if (!(options.dropout >= 0.0 && options.dropout <= 1.0)) {
    throw Error("dropout: expected a probability in [0, 1], got " + std::to_string(options.dropout));
  }
  // Sizes whose weights cannot even be counted are an Error here, before any arithmetic on them.
  checked_numel({3, embed_dim, embed_dim}, "embed_dim (weights of 3 * embed_dim x embed_dim)");
  checked_numel({embed_dim, std::max(kdim_, vdim_)}, "kdim/vdim (weights of embed_dim x kdim)");
  const int64_t E = embed_dim;
  std::vector<std::pair<std::string, Shape>>& shapes = shapes_;  // in named_parameters() order
  auto add = [&](const char* name, const Shape& shape) { shapes.emplace_back(name, shape); };
  if (qkv_same_embed_dim()) {
    add("in_proj_weight", {3 * E, E});
  } else {
    add("q_proj_weight", {E, E});
    add("k_proj_weight", {E, kdim_});
    add("v_proj_weight", {E, vdim_});
  }
  if (options.bias) add("in_proj_bias", {3 * E});
  if (options.add_bias_kv) {
    add("bias_k", {1, 1, E});
    add("bias_v", {1, 1, E});
  }
  add("out_proj.weight", {E, E});
  if (options.bias) add("out_proj.bias", {E});
  if (!options.own_parameters) return;
  // The largest first: a module too large for memory fails (mha::Error) before the others take any.
  std::vector<size_t> order(shapes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto numel = [&](size_t i) {
    int64_t n = 1;
    for (const int64_t d : shapes[i].second) n *= d;  // counted without overflow above
    return n;
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return numel(a) > numel(b); });
  std::vector<Tensor> tensors(shapes.size());
  for (const size_t i : order) tensors[i] = Tensor::empty(shapes[i].second, options.dtype);
  for (size_t i = 0; i < shapes.size(); ++i) params_.emplace_back(shapes[i].first, std::move(tensors[i]));
  reset_parameters(options.seed);
}

MultiheadAttention::MultiheadAttention(const MultiheadAttention& other) : MultiheadAttention(other, other.dtype()) {}

MultiheadAttention::MultiheadAttention(const MultiheadAttention& other, DType dtype, bool parameters)
    : embed_dim_(other.embed_dim_),
      num_heads_(other.num_heads_),
      kdim_(other.kdim_),
      vdim_(other.vdim_),
      options_(other.options_),
      training_(other.training_),
      shapes_(other.shapes_),
      dropout_calls_(other.dropout_calls_.load()) {
  check_module_dtype(dtype);
  options_.dtype = dtype;
  if (!parameters) {
    options_.own_parameters = false;
    return;
  }
  const int threads = detail::resolve_threads(0);
  for (const auto& [name, t] : other.params_) params_.emplace_back(name, detail::parallel_copy_of(t, dtype, threads));
}

std::vector<std::pair<std::string, TensorView>> MultiheadAttention::parameters_for_call(const ParameterViews* given,
                                                                                        const char* caller) const {
  std::vector<std::pair<std::string, TensorView>> views;
  if (given == nullptr) {
    if (!options_.own_parameters) {
      throw Error(std::string(caller) + ": this module holds no parameters (own_parameters is false); "
                  "give them to forward_with/backward_with");
    }
    for (const auto& [name, t] : params_) views.emplace_back(name, t.view());
    return views;
  }
  const std::string where = std::string(caller) + ": parameters";
  for (const auto& [name, shape] : shapes_) {
    const auto it = given->find(name);
    if (it == given->end()) throw Error(where + ": missing '" + name + "' (expected every parameter of the module)");
    const TensorView& v = it->second;
    require_cpu(v, where + "['" + name + "']");
    if (v.sizes() != shape || v.dtype != options_.dtype) {
      throw Error(where + "['" + name + "']: expected " + std::string(dtype_name(options_.dtype)) + " " +
                  TensorView(nullptr, options_.dtype, shape).shape_str() + " (the module's), got " +
                  std::string(dtype_name(v.dtype)) + " " + v.shape_str());
    }
    if (v.numel() > 0 && v.data == nullptr) throw Error(where + "['" + name + "']: data pointer is null");
    views.emplace_back(name, v);
  }
  if (given->size() != shapes_.size()) {
    for (const auto& [name, v] : *given) {
      bool known = false;
      for (const auto& [n, shape] : shapes_) known = known || n == name;
      if (!known) throw Error(where + ": unexpected '" + name + "' (not a parameter of this module)");
    }
  }
  return views;
}

void MultiheadAttention::to(DType dtype) {
  if (dtype != options_.dtype) *this = MultiheadAttention(*this, dtype);
}

MultiheadAttention& MultiheadAttention::operator=(const MultiheadAttention& other) {
  if (this != &other) *this = MultiheadAttention(other);
  return *this;
}

MultiheadAttention::MultiheadAttention(MultiheadAttention&& other) noexcept
    : embed_dim_(other.embed_dim_),
      num_heads_(other.num_heads_),
      kdim_(other.kdim_),
      vdim_(other.vdim_),
      options_(std::move(other.options_)),
      training_(other.training_),
      shapes_(std::move(other.shapes_)),
      params_(std::move(other.params_)),
      dropout_calls_(other.dropout_calls_.load()) {}

MultiheadAttention& MultiheadAttention::operator=(MultiheadAttention&& other) noexcept {
  embed_dim_ = other.embed_dim_;
  num_heads_ = other.num_heads_;
  kdim_ = other.kdim_;
  vdim_ = other.vdim_;
  options_ = std::move(other.options_);
  training_ = other.training_;
  shapes_ = std::move(other.shapes_);
  params_ = std::move(other.params_);
  dropout_calls_.store(other.dropout_calls_.load());
  return *this;
}

void MultiheadAttention::reset_parameters(uint64_t seed) {
  InitRng rng(seed);
  for (auto& [name, param] : params_) {
    // Drawn in float32 (the same values for every dtype), then rounded to the parameter's dtype.
    Tensor t = param.dtype() == DType::f32 ? param : Tensor::empty(param.sizes());
    if (name == "in_proj_bias" || name == "out_proj.bias") {
      std::fill_n(t.data<float>(), t.numel(), 0.0f);
    } else if (name == "out_proj.weight") {
      fill_uniform(t, rng, 1.0 / std::sqrt(static_cast<double>(embed_dim_)));  // kaiming_uniform(a=sqrt(5))
    } else if (name == "bias_k" || name == "bias_v") {
      const auto [fan_in, fan_out] = fans(t);
      fill_normal(t, rng, std::sqrt(2.0 / (fan_in + fan_out)));  // xavier_normal
    } else {
      const auto [fan_in, fan_out] = fans(t);
      fill_uniform(t, rng, std::sqrt(6.0 / (fan_in + fan_out)));  // xavier_uniform
    }
    if (param.dtype() != DType::f32) copy_into(t, param.view());
  }
}

std::vector<std::pair<std::string, Tensor>> MultiheadAttention::named_parameters() const { return params_; }

Tensor MultiheadAttention::parameter(const std::string& name) const {
  for (const auto& [n, t] : params_) {
    if (n == name) return t;
  }
  if (!options_.own_parameters) throw Error("parameter: this module holds no parameters (own_parameters is false)");
  std::string known;
  for (const auto& [n, t] : params_) known += (known.empty() ? "" : ", ") + n;
  throw Error("parameter: no parameter named '" + name + "' (this module has: " + known + ")");
}

void MultiheadAttention::load_state_dict(const std::unordered_map<std::string, TensorView>& state, bool strict) {
  if (!options_.own_parameters) {
    throw Error("load_state_dict: this module holds no parameters (own_parameters is false)");
  }
  std::set<std::string> expected;
  for (const auto& [name, t] : params_) expected.insert(name);
  if (strict) {
    std::string missing, unexpected;
    for (const auto& name : expected)
      if (!state.count(name)) missing += (missing.empty() ? "" : ", ") + name;
    std::set<std::string> extra;
    for (const auto& [name, v] : state)
      if (!expected.count(name)) extra.insert(name);
    for (const auto& name : extra) unexpected += (unexpected.empty() ? "" : ", ") + name;
    if (!missing.empty() || !unexpected.empty()) {
      throw Error("load_state_dict: missing keys [" + missing + "], unexpected keys [" + unexpected + "]");
    }
  }
  // Check everything before changing anything, so a failed load leaves the module as it was.
  for (const auto& [name, t] : params_) {
    auto it = state.find(name);
    if (it == state.end()) continue;
    const TensorView& v = it->second;
    if (v.sizes() != t.sizes()) {
      throw Error("load_state_dict: '" + name + "' expected shape " + t.shape_str() + ", got " + v.shape_str());
    }
    if (v.dtype == DType::boolean) throw Error("load_state_dict: '" + name + "' expected a floating dtype, got bool");
    if (v.numel() > 0 && v.data == nullptr) throw Error("load_state_dict: '" + name + "' has a null data pointer");
  }
  // Over the pool: the Python module loads its parameters before every call (16 MiB at E = 1024).
  const int threads = detail::resolve_threads(0);
  for (auto& [name, t] : params_) {
    auto it = state.find(name);
    if (it != state.end()) detail::parallel_copy_into(it->second, t.view(), threads);
  }
}

}  // namespace mha
