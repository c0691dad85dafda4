// The CPU kernels' thread pool: a parallel loop that loses only the CPU it is denied.
//
// at::parallel_for (torch's OpenMP team) splits a loop statically, one range per thread, and
// joins at a barrier: when another process takes one of the two cores, the thread left on the
// other finishes its half and then waits for the preempted one at the barrier, so a forward
// beside a frontend lost 1.7-1.8x the CPU the others took (README, "The serving path").
// Here the loop is cut into a few tasks per thread, claimed one at a time by whoever is
// running: the caller and the helpers. A helper that has not woken by then finds nothing left
// and the caller has done its share; a helper preempted in the middle of a task holds up only
// that task, and the caller then sleeps (futex) so the scheduler can move the helper onto the
// core it frees. No barrier waits on a thread that has no work.
//
// Contract: folio_pool::parallel_for(begin, end, grain, f) calls f(b, e) on disjoint ranges
// that cover [begin, end) exactly once, each at least `grain` long but the last, on the calling
// thread and up to at::get_num_threads() - 1 helpers, and returns when every call has returned.
// An exception from f is rethrown in the caller once all calls are over (later ranges may be
// skipped). A call from inside a task, or while another thread holds the pool, runs inline.
// Fork-safe by construction: a child with no helper threads claims every task itself.
// FOLIO_CPU_POOL=0 uses at::parallel_for instead (for A/B runs).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace folio_pool {

using Fn = void (*)(void* ctx, int64_t b, int64_t e);

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

inline void futex_wait(std::atomic<uint32_t>* a, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<uint32_t>* a, int n) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAKE_PRIVATE, n, nullptr, nullptr, 0);
}

inline bool& in_task() {
  static thread_local bool inside = false;
  return inside;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Whether a thread is on a CPU, from its CPU-time clock: between two looks, it ran for at least
// half the wall time. One look costs a system call (~1 us), taken every LOOK_NS while spinning.
class Watch {
 public:
  static constexpr int64_t LOOK_NS = 20000;
  void start(clockid_t clock) { clock_ = clock, cpu_ = cpu(), wall_ = now_ns(); }
  // false once the thread has been off its CPU for most of the last LOOK_NS
  bool running(int64_t now) {
    if (now - wall_ < LOOK_NS) return true;
    const int64_t c = cpu();
    const bool on = c < 0 || 2 * (c - cpu_) >= now - wall_;
    cpu_ = c, wall_ = now;
    return on;
  }

 private:
  int64_t cpu() const {
    timespec ts;
    return clock_gettime(clock_, &ts) != 0 ? -1 : ts.tv_sec * 1000000000LL + ts.tv_nsec;
  }
  clockid_t clock_ = CLOCK_THREAD_CPUTIME_ID;
  int64_t cpu_ = 0, wall_ = 0;
};

constexpr int MAX_HELPERS = 255;

// Whether thread `tid` of this process is runnable (state R: on a CPU or waiting for one), not
// asleep (waiting on the GIL, a queue, a socket).
inline bool runnable(pid_t tid) {
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/self/task/%d/stat", static_cast<int>(tid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');
  return p != nullptr && p[1] == ' ' && p[2] == 'R';
}

// A thread of the team that waits on another one (the helper for its caller's next job, the
// caller for a helper's task) and finds it runnable but off its CPU (preempted by another
// process) moves it onto its own CPU, which it then leaves by sleeping: the team keeps the core
// it still has. The moved thread takes its normal CPU set back at its next job or task.
class Mover {
 public:
  Mover() {
    CPU_ZERO(&all_);
    if (sched_getaffinity(0, sizeof all_, &all_) != 0) usable_ = false;
  }
  void pull(pid_t tid, std::atomic<bool>& moved) {
    const int cpu = sched_getcpu();
    if (!usable_ || cpu < 0 || !runnable(tid)) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(tid, sizeof one, &one) == 0) moved.store(true, std::memory_order_release);
  }
  // called by a thread on itself
  void restore(std::atomic<bool>& moved) {
    if (moved.load(std::memory_order_relaxed) && moved.exchange(false, std::memory_order_acq_rel))
      sched_setaffinity(0, sizeof all_, &all_);
  }

 private:
  cpu_set_t all_;
  bool usable_ = true;
};

// The claim word: job generation (32 bits, against ABA) | task count (16) | next task (16).
inline uint64_t word(uint64_t gen, uint64_t tasks, uint64_t next) { return gen << 32 | tasks << 16 | next; }

class Pool {
 public:
  std::mutex owner;  // one job at a time; a second caller runs inline
  std::atomic<uint64_t> claim{0};
  std::atomic<uint32_t> wake{0};     // helpers sleep on it; bumped for each job
  std::atomic<int> sleepers{0};
  std::atomic<uint32_t> done{0};     // tasks finished in the current job; the caller sleeps on it
  std::atomic<uint32_t> caller_asleep{0};
  std::atomic<int> active{0};        // helpers [0, active) take part in the current job
  std::atomic<clockid_t> caller_clock{CLOCK_THREAD_CPUTIME_ID};  // the current job's caller
  std::atomic<clockid_t> helper_clock[MAX_HELPERS] = {};
  std::atomic<bool> helper_busy[MAX_HELPERS] = {};  // in a task
  std::atomic<pid_t> caller_tid{0};
  std::atomic<pid_t> helper_tid[MAX_HELPERS] = {};
  std::atomic<bool> caller_moved{false};
  std::atomic<bool> helper_moved[MAX_HELPERS] = {};
  const bool pull = env_int("FOLIO_POOL_PULL", 1) != 0;
  Mover mover;  // the CPU set of the thread that first used the pool
  std::atomic<bool> failed{false};
  std::exception_ptr error;          // the first exception of the job (under error_mu)
  std::mutex error_mu;
  // the current job: written by the caller before it publishes the claim word
  Fn fn = nullptr;
  void* ctx = nullptr;
  int64_t begin = 0, end = 0;
  uint64_t gen = 0;
  const int64_t spin_us = env_int("FOLIO_POOL_SPIN_US", 200);       // helpers: spin, then sleep
  const int64_t wait_spin_us = env_int("FOLIO_POOL_WAIT_US", 200);   // the caller, at the end of a job
  const int64_t tasks_per_thread = std::max<int64_t>(1, env_int("FOLIO_POOL_TASKS", 2));
  std::vector<std::thread> helpers;  // at most MAX_HELPERS

  // Claims and runs tasks of whatever job is open until none is left (helper: its index, else -1).
  void work(int index) {
    for (;;) {
      uint64_t c = claim.load(std::memory_order_acquire);
      const uint32_t tasks = (c >> 16) & 0xffff, next = c & 0xffff;
      if (next >= tasks) return;
      if (!claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
      // the job cannot change until this task is counted in `done`
      if (!failed.load(std::memory_order_relaxed)) {
        const int64_t n = end - begin, b = begin + n * next / tasks, e = begin + n * (next + 1) / tasks;
        in_task() = true;
        if (index >= 0) helper_busy[index].store(true, std::memory_order_relaxed);
        try {
          fn(ctx, b, e);
        } catch (...) {
          std::lock_guard<std::mutex> g(error_mu);
          if (!error) error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
        in_task() = false;
        if (index >= 0) helper_busy[index].store(false, std::memory_order_relaxed);
      }
      done.fetch_add(1, std::memory_order_seq_cst);
      if (caller_asleep.load(std::memory_order_seq_cst)) futex_wake(&done, 1);
    }
  }

  // Waits for the next job: spins while its caller is on a CPU (its next job is then
  // microseconds away), for at most spin_us, then sleeps. A helper that spins while the caller
  // is preempted keeps a core busy for nothing: the process that took the caller's core would
  // have gone to an idle one.
  void helper(int index) {
    pthread_setname_np(pthread_self(), "folio-pool");
    clockid_t own;
    if (pthread_getcpuclockid(pthread_self(), &own) == 0) helper_clock[index].store(own);
    helper_tid[index].store(static_cast<pid_t>(syscall(SYS_gettid)));
    uint32_t seen = wake.load(std::memory_order_acquire);
    for (;;) {
      int64_t t0 = now_ns();
      Watch caller;
      caller.start(caller_clock.load(std::memory_order_relaxed));
      for (int turn = 0; wake.load(std::memory_order_acquire) == seen; ++turn) {
        _mm_pause();
        if ((turn & 63) != 63) continue;
        const int64_t now = now_ns();
        const bool on = caller.running(now);
        if (now - t0 < spin_us * 1000 && on) continue;
        if (!on && pull) mover.pull(caller_tid.load(std::memory_order_relaxed), caller_moved);
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        if (wake.load(std::memory_order_seq_cst) == seen) futex_wait(&wake, seen);
        sleepers.fetch_sub(1, std::memory_order_seq_cst);
        t0 = now_ns();
        caller.start(caller_clock.load(std::memory_order_relaxed));
      }
      seen = wake.load(std::memory_order_acquire);
      mover.restore(helper_moved[index]);
      if (index < active.load(std::memory_order_relaxed)) work(index);
    }
  }

  // Whether every helper still in a task is on a CPU (so the caller's spin will end soon); one
  // that is not is moved here (the caller then sleeps).
  bool busy_helpers_running(std::vector<Watch>& watches, int team, int64_t now) {
    bool on = true;
    for (int i = 0; i + 1 < team; ++i)
      if (helper_busy[i].load(std::memory_order_relaxed) && !watches[i].running(now)) {
        if (on && pull) mover.pull(helper_tid[i].load(std::memory_order_relaxed), helper_moved[i]);
        on = false;
      }
    return on;
  }

  void ensure_helpers(int n) {
    while (static_cast<int>(helpers.size()) < n) {
      const int index = static_cast<int>(helpers.size());
      helpers.emplace_back([this, index] { helper(index); });
      helpers.back().detach();
    }
  }

  void run(int64_t b, int64_t e, int64_t grain, int team, Fn f, void* c) {
    const int64_t n = e - b;
    // balanced: task i is [n i / tasks, n (i + 1) / tasks), each at least `grain` long
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>({n / grain, team * tasks_per_thread, 0xffff}));
    team = std::min(team, MAX_HELPERS + 1);
    ensure_helpers(team - 1);
    fn = f, ctx = c, begin = b, end = e;
    error = nullptr;
    failed.store(false, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    active.store(team - 1, std::memory_order_relaxed);
    mover.restore(caller_moved);
    clockid_t own;
    if (pthread_getcpuclockid(pthread_self(), &own) == 0) caller_clock.store(own, std::memory_order_relaxed);
    caller_tid.store(static_cast<pid_t>(syscall(SYS_gettid)), std::memory_order_relaxed);
    gen = (gen + 1) & 0xffffffff;
    claim.store(word(gen, tasks, 0), std::memory_order_seq_cst);
    wake.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake(&wake, INT_MAX);
    work(-1);
    // every task is claimed: wait for the ones still running on helpers, spinning while those
    // helpers are on a CPU, else asleep (the core goes idle, and the scheduler can bring the
    // preempted helper, or whatever preempted it, to it)
    if (done.load(std::memory_order_acquire) < tasks) {
      const int64_t t0 = now_ns();
      std::vector<Watch> watches(team - 1);
      for (int i = 0; i + 1 < team; ++i) watches[i].start(helper_clock[i].load(std::memory_order_relaxed));
      for (int turn = 0; done.load(std::memory_order_acquire) < tasks; ++turn) {
        _mm_pause();
        if ((turn & 63) != 63) continue;
        const int64_t now = now_ns();
        if (now - t0 < wait_spin_us * 1000 && busy_helpers_running(watches, team, now)) continue;
        caller_asleep.store(1, std::memory_order_seq_cst);
        for (uint32_t d; (d = done.load(std::memory_order_seq_cst)) < tasks;) futex_wait(&done, d);
        caller_asleep.store(0, std::memory_order_seq_cst);
      }
    }
    if (error) std::rethrow_exception(error);
  }
};

inline Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: its helpers are detached and outlive exit's destructors
  return *p;
}

inline bool enabled() {
  static const bool on = env_int("FOLIO_CPU_POOL", 1) != 0;
  return on;
}

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  if (!enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  const int team = in_task() ? 1 : at::get_num_threads();
  if (team <= 1 || end - begin <= grain) {
    f(begin, end);
    return;
  }
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.owner, std::try_to_lock);
  if (!lock.owns_lock()) {
    f(begin, end);
    return;
  }
  p.run(begin, end, grain, team, [](void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); },
        const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace folio_pool
