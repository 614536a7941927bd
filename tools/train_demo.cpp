// `mha train-demo`: a C++ training loop. A one-layer model — token embedding plus position,
// one MultiheadAttention, a linear readout — learns to reverse sequences of random tokens, with the
// module's forward/backward and an Adam step written out here. Only the attention can move
// information between positions, so the falling loss is the attention learning to look at
// position L-1-i from position i.
#include "train_demo.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "mha/mha.hpp"

namespace mha::tools {
namespace {

// Adam with the usual defaults (beta1 0.9, beta2 0.999, eps 1e-8), one state per parameter.
class Adam {
 public:
  explicit Adam(double lr) : lr_(lr) {}
  void step(float* param, const float* grad, int64_t n, int slot) {
    if (slot >= static_cast<int>(m_.size())) {
      m_.resize(slot + 1);
      v_.resize(slot + 1);
    }
    if (m_[slot].empty()) m_[slot].assign(n, 0.0), v_[slot].assign(n, 0.0);
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    const double c1 = 1 - std::pow(b1, t_), c2 = 1 - std::pow(b2, t_);
    for (int64_t i = 0; i < n; ++i) {
      m_[slot][i] = b1 * m_[slot][i] + (1 - b1) * grad[i];
      v_[slot][i] = b2 * v_[slot][i] + (1 - b2) * grad[i] * grad[i];
      param[i] -= static_cast<float>(lr_ * (m_[slot][i] / c1) / (std::sqrt(v_[slot][i] / c2) + eps));
    }
  }
  void next() { ++t_; }

 private:
  double lr_;
  int t_ = 1;
  std::vector<std::vector<double>> m_, v_;
};

}  // namespace

int run_train_demo(const TrainDemoOptions& o) {
  const int64_t V = o.vocab, L = o.length, E = o.embed_dim, H = o.heads, N = o.batch;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> token(0, static_cast<int>(V) - 1);

  // Fixed token embeddings and sinusoidal positions; learned attention and readout.
  std::vector<float> embedding(V * E), position(L * E);
  for (float& x : embedding) x = normal(rng);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t e = 0; e < E; ++e) {
      const double freq = std::pow(10000.0, -static_cast<double>(e / 2 * 2) / static_cast<double>(E));
      position[l * E + e] = static_cast<float>(e % 2 == 0 ? std::sin(l * freq) : std::cos(l * freq));
    }
  MultiheadAttention attn(E, H, {.batch_first = true, .seed = o.seed});
  std::vector<float> w_out(V * E), b_out(V, 0.0f);
  for (float& x : w_out) x = normal(rng) / std::sqrt(static_cast<float>(E));
  Adam adam(o.learning_rate);

  std::printf("Training a %lld-head attention layer (E=%lld) to reverse sequences of %lld tokens out of %lld\n",
              static_cast<long long>(H), static_cast<long long>(E), static_cast<long long>(L),
              static_cast<long long>(V));
  std::printf("   step      loss   accuracy\n");
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, last_loss = 0, last_accuracy = 0;
  Tensor x = Tensor::empty({N, L, E});
  std::vector<int> tokens(N * L);
  for (int step = 1; step <= o.steps; ++step) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l) {
        const int t = token(rng);
        tokens[n * L + l] = t;
        for (int64_t e = 0; e < E; ++e) x.data<float>()[(n * L + l) * E + e] = embedding[t * E + e] + position[l * E + e];
      }
    // Forward: attention, then logits = out W^T + b and softmax cross-entropy against the reverse.
    ForwardContext ctx;
    const ForwardResult r = attn.forward(x, x, x, {.need_weights = false}, &ctx);
    const float* out = r.output.data<float>();
    Tensor grad_out = Tensor::zeros({N, L, E});
    std::vector<float> grad_w(V * E, 0.0f), grad_b(V, 0.0f), logits(V);
    double loss = 0;
    int64_t correct = 0;
    const float inv_count = 1.0f / static_cast<float>(N * L);
    for (int64_t row = 0; row < N * L; ++row) {
      const int64_t n = row / L, l = row % L;
      const int target = tokens[n * L + (L - 1 - l)];
      float max = -INFINITY;
      int best = 0;
      for (int64_t c = 0; c < V; ++c) {
        float s = b_out[c];
        for (int64_t e = 0; e < E; ++e) s += w_out[c * E + e] * out[row * E + e];
        logits[c] = s;
        if (s > max) max = s, best = static_cast<int>(c);
      }
      double sum = 0;
      for (int64_t c = 0; c < V; ++c) sum += std::exp(logits[c] - max);
      loss += std::log(sum) + max - logits[target];
      correct += best == target;
      for (int64_t c = 0; c < V; ++c) {  // d loss / d logits = softmax - onehot
        const float d = (static_cast<float>(std::exp(logits[c] - max) / sum) - (c == target ? 1.0f : 0.0f)) * inv_count;
        grad_b[c] += d;
        for (int64_t e = 0; e < E; ++e) {
          grad_w[c * E + e] += d * out[row * E + e];
          grad_out.data<float>()[row * E + e] += d * w_out[c * E + e];
        }
      }
    }
    loss /= static_cast<double>(N * L);
    const double accuracy = static_cast<double>(correct) / static_cast<double>(N * L);
    if (step == 1) first_loss = loss;
    last_loss = loss, last_accuracy = accuracy;

    // Backward through the attention, then one Adam step on every parameter.
    const ModuleGradients g = attn.backward(ctx, grad_out);
    int slot = 0;
    for (const auto& [name, p] : attn.named_parameters()) {
      adam.step(p.data<float>(), g.parameter(name).data<float>(), p.numel(), slot++);
    }
    adam.step(w_out.data(), grad_w.data(), V * E, slot++);
    adam.step(b_out.data(), grad_b.data(), V, slot++);
    adam.next();
    if (step == 1 || step % o.print_every == 0 || step == o.steps) {
      std::printf("  %5d  %8.4f   %6.1f%%\n", step, loss, 100.0 * accuracy);
      std::fflush(stdout);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool learned = last_loss < 0.5 * first_loss;
  std::printf("Loss %.3f -> %.3f (chance: ln %lld = %.3f), accuracy %.1f%%, %d steps in %.1f s: %s\n", first_loss,
              last_loss, static_cast<long long>(V), std::log(static_cast<double>(V)), 100.0 * last_accuracy, o.steps,
              seconds, learned ? "the loss fell" : "the loss did NOT fall by half");
  return learned ? 0 : 1;
}

}  // namespace mha::tools
