// mha::Error: the one exception type the library throws for bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace mha {

// Thrown for every invalid argument. The message names the argument, what was expected and what
// was given, e.g. "query: expected 3 dimensions (L, N, E), got shape [4, 8]".
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

}  // namespace mha
