// The forward's query rows whose scores are their mask values alone (mask_scores.hpp): a
// left-padded batch's padding rows under Hugging Face's masks, which see no key but at finfo.min.
// The kernels compute such a row whole, against every key (they are all it sees), and at a
// quarter of the rows padded that doubled a prefill's time. Their output is the mask's weighted
// mean of the values (the plain mean where the row's values are one), which needs no q.k:
// run_attention takes the leading such rows of each batch entry off the kernel's problem and
// writes them from the mask, once per head for consecutive rows that read the same mask values.
#pragma once

#include <cstdint>
#include <vector>

#include "core/attention_problem.hpp"
#include "cpu/attention_kernel.hpp"

namespace mha::detail {

// For each batch entry, how many leading query rows have scores that are their mask values in
// every head; empty where the forward does not look for them: several mask terms, a mask whose
// keys are not contiguous, dropout, weights asked for, or block skipping off
// (skips_excluded_blocks).
std::vector<int64_t> mask_only_prefixes(const AttentionProblem& p, const ForwardOutputs& o);

// The forward with rows [0, prefixes[b]) of each batch entry b written from the mask and the
// rest by `kernel`, one batch entry at a time.
void run_with_mask_only_prefixes(const AttentionProblem& p, const ForwardOutputs& o,
                                 const std::vector<int64_t>& prefixes, ForwardKernel kernel);

}  // namespace mha::detail
