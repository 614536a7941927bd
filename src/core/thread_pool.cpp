#include "core/thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <pthread.h>
#include <string>
#include <thread>
#include <vector>

#include "mha/error.hpp"
#if defined(MHA_HAVE_OPENMP)
#include <omp.h>
#endif
#include "mha/threading.hpp"

namespace mha::detail {
namespace {

// How long an idle worker, and a caller waiting for its helpers, spin before sleeping on the
// condition variable: a wake through the kernel costs a few to tens of microseconds (a job of 16
// empty tasks took 13-17 us on 2 threads of a VM, against 1 us on one), as much as a whole
// decoding step on a small cache. Calls in a row (the module's projections, attention and output
// projection; an inference engine's layers) then find the workers awake. Short, so that a caller
// running other threads between our calls loses little to the spinning: MHA_SPIN_US, 0 to 10000,
// default 50; 0 always sleeps.
int spin_microseconds() {
  static const int us = [] {
    const char* env = std::getenv("MHA_SPIN_US");
    if (env == nullptr || *env == '\0') return 50;
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (*end != '\0' || n < 0 || n > 10000) {
      throw Error(std::string("MHA_SPIN_US: expected a whole number of microseconds from 0 to 10000, got '") + env + "'");
    }
    return static_cast<int>(n);
  }();
  return us;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or `us` microseconds have passed; returns done(). Past the first few
// microseconds it yields the core between checks, so that on a machine with more runnable threads
// than cores (another library's spinning team, the caller's own threads) the thread it waits for
// can run.
template <class Done>
bool spin_until(Done done, int us) {
  if (us <= 0) return done();
  const auto start = std::chrono::steady_clock::now();
  const auto yield_after = start + std::chrono::microseconds(std::min(us, 5));
  const auto deadline = start + std::chrono::microseconds(us);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return done();
    if (now >= yield_after) std::this_thread::yield();
  }
}

class ThreadPool {
 public:
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // Returns false without running anything if another job holds the pool.
  bool try_run(int64_t n, int threads, const std::function<void(int64_t, int)>& task) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const int spin_us = spin_microseconds();  // read here first: a malformed setting throws on the caller's thread
    ensure_workers(threads - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      n_tasks_ = n;
      next_.store(0);
      error_ = nullptr;
      helpers_wanted_ = threads - 1;
      helpers_active_.store(0);
      generation_.store(generation_.load() + 1);
    }
    wake_.notify_all();
    work(0);
    // Every task is handed out: a helper that has not joined yet would find none, so it is no
    // longer waited for (a worker slow to wake no longer delays the call). Those that joined are.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      helpers_wanted_ = 0;
    }
    spin_until([&] { return helpers_active_.load(std::memory_order_acquire) == 0; }, spin_us);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return helpers_active_.load() == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this] { loop(); });
    }
  }

  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      // Until a job this worker can join: one it has not seen that still wants helpers. A job it
      // missed (its tasks all handed out first) counts as seen. It spins a while on the job
      // counter (spin_microseconds), then sleeps.
      while (!stopping_ && !(generation_.load() != seen && helpers_wanted_ > 0)) {
        seen = generation_.load();
        lock.unlock();
        const bool woke = spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; }, spin_microseconds());
        lock.lock();
        if (!woke) wake_.wait(lock, [&] { return stopping_ || generation_.load() != seen; });
      }
      if (stopping_) return;
      seen = generation_.load();
      // Only the first `threads - 1` workers to wake join this job; ids stay below `threads`
      // because a helper takes the next free slot rather than its own id.
      const int slot = helpers_active_.fetch_add(1) + 1;
      --helpers_wanted_;
      lock.unlock();
      work(slot);
      lock.lock();
      if (helpers_active_.fetch_sub(1) == 1) done_.notify_all();
    }
  }

  void work(int worker) {
    for (;;) {
      const int64_t i = next_.fetch_add(1);
      if (i >= n_tasks_) return;
      try {
        (*task_)(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_tasks_);  // stop handing out work
      }
    }
  }

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;      // guards every field below; the atomics are also read without it, to spin
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t, int)>* task_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
  int helpers_wanted_ = 0;
  std::atomic<int> helpers_active_{0};
  std::atomic<uint64_t> generation_{0};
  bool stopping_ = false;
};

// The pool lives for the whole process (never destroyed: at exit its idle workers simply end with
// it). A child created by fork() has none of the parent's worker threads, so it drops the
// inherited pool (left as it was, never touched again) and builds its own on first use.
std::atomic<ThreadPool*> g_pool{nullptr};
std::once_flag g_atfork_once;
// Whether this process has run an OpenMP job, and whether it is a fork() child of one that had:
// libgomp's team does not survive fork (a child that enters a parallel region hangs), so such a
// child runs its jobs on its own pool instead.
std::atomic<bool> g_openmp_started{false}, g_openmp_inherited{false};

void watch_fork() {
  std::call_once(g_atfork_once, [] {
    pthread_atfork(nullptr, nullptr, [] {
      g_pool.store(nullptr);
      if (g_openmp_started.load()) g_openmp_inherited.store(true);
    });
  });
}

ThreadPool& pool() {
  watch_fork();
  ThreadPool* p = g_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    static std::mutex create;
    std::lock_guard<std::mutex> lock(create);
    p = g_pool.load(std::memory_order_acquire);
    if (p == nullptr) {
      p = new ThreadPool();
      g_pool.store(p, std::memory_order_release);
    }
  }
  return *p;
}

int default_threads() {
  if (const char* env = std::getenv("MHA_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (*end != '\0' || n < 1 || n > 4096) {
      throw Error(std::string("MHA_NUM_THREADS: expected a whole number from 1 to 4096, got '") + env + "'");
    }
    return static_cast<int>(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

std::atomic<int> g_num_threads{0};  // 0: not yet decided

// The same job on the OpenMP team: indices handed out one at a time as in the pool, the worker
// index being the thread's number in the team (< threads). One job at a time, as in the pool; a
// call from inside a parallel region (ours or the caller's) returns false and runs inline.
bool try_run_openmp(int64_t n, int threads, const std::function<void(int64_t, int)>& task) {
#if defined(MHA_HAVE_OPENMP)
  static std::mutex busy_mutex;
  std::unique_lock<std::mutex> busy(busy_mutex, std::try_to_lock);
  if (!busy.owns_lock() || omp_in_parallel()) return false;
  watch_fork();
  g_openmp_started.store(true);
  std::atomic<int64_t> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel num_threads(threads)
  {
    const int worker = omp_get_thread_num();
    for (;;) {
      const int64_t i = next.fetch_add(1);
      if (i >= n) break;
      try {
        task(i, worker);
      } catch (...) {  // an exception must not leave the parallel region
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(n);
      }
    }
  }
  if (error) std::rethrow_exception(error);
  return true;
#else
  (void)n, (void)threads, (void)task;
  return false;
#endif
}

Threading default_threading() {
  const char* env = std::getenv("MHA_THREADING");
  if (env == nullptr || *env == '\0' || std::string(env) == "pool") return Threading::pool;
  if (std::string(env) == "openmp") {
    if (!openmp_available()) throw Error("MHA_THREADING=openmp: this build of mha has no OpenMP");
    return Threading::openmp;
  }
  throw Error(std::string("MHA_THREADING: expected 'pool' or 'openmp', got '") + env + "'");
}

std::atomic<int> g_threading{-1};  // -1: not yet decided

}  // namespace

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  if (requested < 0) throw Error("num_threads: expected >= 0 (0 for the library setting), got " + std::to_string(requested));
  return get_num_threads();
}

void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int)>& task) {
  if (n <= 0) return;
  threads = static_cast<int>(std::min<int64_t>(std::max(threads, 1), n));
  if (threads == 1) {
    for (int64_t i = 0; i < n; ++i) task(i, 0);
    return;
  }
  const bool openmp = get_threading() == Threading::openmp && !g_openmp_inherited.load();
  const bool ran = openmp ? try_run_openmp(n, threads, task) : pool().try_run(n, threads, task);
  if (!ran) {
    for (int64_t i = 0; i < n; ++i) task(i, 0);
  }
}

}  // namespace mha::detail

namespace mha {

bool openmp_available() {
#if defined(MHA_HAVE_OPENMP)
  return true;
#else
  return false;
#endif
}

void set_threading(Threading threading) {
  if (threading == Threading::openmp && !openmp_available()) {
    throw Error("set_threading: this build of mha has no OpenMP (threading 'openmp' is unavailable)");
  }
  detail::g_threading.store(static_cast<int>(threading));
}

Threading get_threading() {
  int t = detail::g_threading.load();
  if (t < 0) {
    int expected = -1;
    detail::g_threading.compare_exchange_strong(expected, static_cast<int>(detail::default_threading()));
    t = detail::g_threading.load();
  }
  return static_cast<Threading>(t);
}

void set_num_threads(int n) {
  if (n < 1) throw Error("set_num_threads: expected a thread count >= 1, got " + std::to_string(n));
  detail::g_num_threads.store(n);
}

int get_num_threads() {
  int n = detail::g_num_threads.load();
  if (n == 0) {
    n = detail::default_threads();
    detail::g_num_threads.store(n);
  }
  return n;
}

}  // namespace mha
