// `mha train-demo`: a tiny model trained in C++ with the module's backward and an Adam step.
#pragma once

#include <cstdint>

namespace mha::tools {

struct TrainDemoOptions {
  int64_t vocab = 10;
  int64_t length = 8;
  int64_t embed_dim = 32;
  int64_t heads = 4;
  int64_t batch = 32;
  int steps = 300;
  double learning_rate = 1e-2;
  int print_every = 25;
  uint64_t seed = 7;
};

int run_train_demo(const TrainDemoOptions& options);

}  // namespace mha::tools
