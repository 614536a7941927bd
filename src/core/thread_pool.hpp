// A persistent pool of worker threads with one operation: run n independent tasks.
#pragma once

#include <cstdint>
#include <functional>

namespace mha::detail {

// Runs task(i) for i in [0, n) on up to `threads` threads (the caller is one of them), handing out
// indices one at a time so uneven tasks (causal rows) balance. Returns when all are done; the first
// exception thrown by a task is rethrown here. The pool is created once and grows on demand.
// A call made while the pool is busy (another user thread, or from inside a task) runs its tasks
// on the calling thread instead of waiting, so nesting cannot deadlock.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t task, int worker)>& task);

// Upper bound (exclusive) on the `worker` index parallel_for passes for a given thread count, for
// sizing per-worker scratch.
inline int max_workers(int threads) { return threads < 1 ? 1 : threads; }

// The thread count to use for a call: `requested` if > 0, else the library setting.
int resolve_threads(int requested);

}  // namespace mha::detail
