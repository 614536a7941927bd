// oneDNN's scaled dot-product attention, timed for bench/compare.py: the SDPA subgraph
// (MatMul Q K^T, Multiply by the scale, an additive causal mask, SoftMax, MatMul with V) handed to
// oneDNN's Graph API, which fuses what its backends can fuse on this CPU and runs the rest as
// separate primitives. Prints one JSON object: the median milliseconds, the number of partitions
// (1 means one fused kernel) and the largest relative error of two output rows against a float64
// recomputation, so that a wrong graph cannot pass as a fast one.
//
//   onednn_sdpa --batch 4 --heads 16 --len 2048 --dim 64 [--causal] [--dtype f32|bf16] [--reps 7]
//
// Built by `make onednn-bench` against the oneDNN wheels from PyPI (onednn-cpu-gomp and
// onednn-devel-cpu-gomp); its threads are OpenMP's (OMP_NUM_THREADS).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "oneapi/dnnl/dnnl_graph.hpp"

namespace {

using dnnl::graph::compiled_partition;
using dnnl::graph::logical_tensor;
using dnnl::graph::op;
using dnnl::graph::partition;
using Dt = logical_tensor::data_type;
using Layout = logical_tensor::layout_type;

struct Args {
  int64_t batch = 4, heads = 16, len = 2048, dim = 64;
  bool causal = false;
  bool bf16 = false;
  int reps = 7;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + s);
      return argv[++i];
    };
    if (s == "--batch") a.batch = std::stoll(next());
    else if (s == "--heads") a.heads = std::stoll(next());
    else if (s == "--len") a.len = std::stoll(next());
    else if (s == "--dim") a.dim = std::stoll(next());
    else if (s == "--causal") a.causal = true;
    else if (s == "--dtype") a.bf16 = std::string(next()) == "bf16";
    else if (s == "--reps") a.reps = std::stoi(next());
    else throw std::runtime_error("unknown argument " + s);
  }
  return a;
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A host buffer holding n values of the run's dtype, filled from floats.
struct Buffer {
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  bool bf16;
  Buffer(const std::vector<float>& values, bool as_bf16) : bf16(as_bf16) {
    if (bf16) {
      b16.resize(values.size());
      std::transform(values.begin(), values.end(), b16.begin(), to_bf16);
    } else {
      f32 = values;
    }
  }
  void* data() { return bf16 ? static_cast<void*>(b16.data()) : static_cast<void*>(f32.data()); }
  float at(size_t i) const { return bf16 ? from_bf16(b16[i]) : f32[i]; }
};

int run(const Args& a) {
  const Dt dt = a.bf16 ? Dt::bf16 : Dt::f32;
  const int64_t B = a.batch, H = a.heads, L = a.len, D = a.dim;
  const logical_tensor::dims qkv_dims = {B, H, L, D}, score_dims = {B, H, L, L};
  enum : size_t { kQ, kK, kV, kScore, kScale, kScaled, kMask, kMasked, kProbs, kOut, kScaledQ };
  const logical_tensor q(kQ, dt, qkv_dims, Layout::strided), k(kK, dt, qkv_dims, Layout::strided),
      v(kV, dt, qkv_dims, Layout::strided), score(kScore, dt, score_dims, Layout::strided),
      scale(kScale, dt, logical_tensor::dims{1}, Layout::strided), scaled(kScaled, dt, score_dims, Layout::strided),
      mask(kMask, dt, score_dims, Layout::strided),
      masked(kMasked, dt, score_dims, Layout::strided), probs(kProbs, dt, score_dims, Layout::strided),
      out(kOut, dt, qkv_dims, Layout::strided), scaled_q(kScaledQ, dt, qkv_dims, Layout::strided);

  dnnl::graph::graph g(dnnl::engine::kind::cpu);
  // Causal: the scale goes onto Q first, so that the score MatMul carries a single post-op (the
  // mask). With two binary post-ops (scale and mask) oneDNN 3.2 picks a reference matmul on AVX2,
  // about 100x slower (5 s for B=4, H=16, L=256).
  op mul(1, op::kind::Multiply, "scale");
  op qk(0, op::kind::MatMul, "qk");
  qk.set_attr<bool>(op::attr::transpose_b, true);
  op add(2, op::kind::Add, "mask");
  if (a.causal) {
    mul.add_inputs({q, scale});
    mul.add_outputs({scaled_q});
    qk.add_inputs({scaled_q, k});
    qk.add_outputs({score});
    add.add_inputs({score, mask});
    add.add_outputs({masked});
  } else {
    qk.add_inputs({q, k});
    qk.add_outputs({score});
    mul.add_inputs({score, scale});
    mul.add_outputs({scaled});
  }
  op softmax(3, op::kind::SoftMax, "softmax");
  softmax.set_attr<int64_t>(op::attr::axis, -1);
  softmax.add_inputs({a.causal ? masked : scaled});
  softmax.add_outputs({probs});
  op pv(4, op::kind::MatMul, "pv");
  pv.add_inputs({probs, v});
  pv.add_outputs({out});
  g.add_op(mul);
  g.add_op(qk);
  if (a.causal) g.add_op(add);
  g.add_op(softmax);
  g.add_op(pv);
  g.finalize();

  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const std::vector<partition> parts = g.get_partitions();
  std::vector<compiled_partition> compiled;
  std::map<size_t, logical_tensor> described;  // every tensor as the compiled partitions see it
  for (const partition& p : parts) {
    if (!p.is_supported()) {
      std::printf("{\"error\": \"oneDNN returned an unsupported partition for this graph\"}\n");
      return 2;
    }
    std::vector<logical_tensor> ins = p.get_input_ports(), outs = p.get_output_ports();
    for (auto& t : ins) {
      auto it = described.find(t.get_id());
      if (it != described.end()) t = it->second;  // produced by an earlier partition
    }
    compiled.push_back(p.compile(ins, outs, engine));
    for (const auto& t : ins) described[t.get_id()] = t;
    for (const auto& t : outs) described[t.get_id()] = compiled.back().query_logical_tensor(t.get_id());
  }

  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& e : x) e = normal(rng);
    return x;
  };
  const int64_t n_qkv = B * H * L * D;
  Buffer qb(randn(n_qkv), a.bf16), kb(randn(n_qkv), a.bf16), vb(randn(n_qkv), a.bf16);
  Buffer scale_b({static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)))}, a.bf16);
  // The causal mask at the scores' full shape: broadcast over batch and heads ({1, 1, L, L}) it
  // sends oneDNN 3.2 to a path that had not finished one call in a minute at B=4, H=16, L=2048.
  std::vector<float> mask_values(a.causal ? static_cast<size_t>(B * H * L * L) : 0);
  if (a.causal) {
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < L; ++j)
          mask_values[(bh * L + i) * L + j] = j <= i ? 0.0f : -std::numeric_limits<float>::infinity();
  }
  Buffer mask_b(mask_values, a.bf16);
  std::map<size_t, void*> given = {{kQ, qb.data()}, {kK, kb.data()}, {kV, vb.data()}, {kScale, scale_b.data()},
                                   {kMask, mask_b.data()}};
  std::map<size_t, std::vector<uint8_t>> owned;  // intermediates and the output, sized by oneDNN
  auto handle = [&](const logical_tensor& t) -> void* {
    auto it = given.find(t.get_id());
    if (it != given.end()) return it->second;
    auto& bytes = owned[t.get_id()];
    if (bytes.empty()) bytes.resize(t.get_mem_size());
    return bytes.data();
  };
  std::vector<std::vector<dnnl::graph::tensor>> inputs, outputs;
  for (size_t i = 0; i < parts.size(); ++i) {
    std::vector<dnnl::graph::tensor> in, o;
    for (const auto& t : parts[i].get_input_ports()) {
      const logical_tensor& d = described[t.get_id()];
      in.emplace_back(d, engine, handle(d));
    }
    for (const auto& t : parts[i].get_output_ports()) {
      const logical_tensor& d = described[t.get_id()];
      o.emplace_back(d, engine, handle(d));
    }
    inputs.push_back(std::move(in));
    outputs.push_back(std::move(o));
  }
  auto call = [&] {
    for (size_t i = 0; i < compiled.size(); ++i) compiled[i].execute(stream, inputs[i], outputs[i]);
    stream.wait();
  };

  for (int i = 0; i < 2; ++i) call();  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < a.reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    call();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());

  // Two rows of head (0, 0), the first and the last query, in float64 from the same inputs.
  const auto& out_bytes = owned[kOut];
  double worst = 0;
  for (int64_t i : {int64_t{0}, L - 1}) {
    std::vector<double> s(static_cast<size_t>(L));
    double m = -INFINITY;
    const int64_t visible = a.causal ? i + 1 : L;
    for (int64_t j = 0; j < visible; ++j) {
      double acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += static_cast<double>(qb.at(i * D + d)) * kb.at(j * D + d);
      s[j] = acc / std::sqrt(static_cast<double>(D));
      m = std::max(m, s[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < visible; ++j) sum += s[j] = std::exp(s[j] - m);
    double err = 0, mag = 0;
    for (int64_t d = 0; d < D; ++d) {
      double o = 0;
      for (int64_t j = 0; j < visible; ++j) o += s[j] / sum * vb.at(j * D + d);
      float got;
      if (a.bf16) {
        uint16_t h;
        std::memcpy(&h, out_bytes.data() + 2 * (i * D + d), 2);
        got = from_bf16(h);
      } else {
        std::memcpy(&got, out_bytes.data() + 4 * (i * D + d), 4);
      }
      err = std::max(err, std::abs(got - o));
      mag = std::max(mag, std::abs(o));
    }
    worst = std::max(worst, err / std::max(mag, 1e-30));
  }
  std::printf("{\"ms\": %.3f, \"partitions\": %zu, \"max_rel_error\": %.3g}\n", ms[ms.size() / 2], parts.size(),
              worst);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::printf("{\"error\": \"%s\"}\n", e.what());
    return 2;
  }
}
