// The GEMM team: see gemm_team.h.
#include "cpu/gemm_team.h"

#include <ATen/ATen.h>
#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

// MKL's C entry point for the calling thread's BLAS thread count (the one ATen's set_num_threads
// sets). Weak: with a torch built without MKL it stays null.
#if defined(__linux__)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
#else
static int (*const MKL_Set_Num_Threads_Local)(int) = nullptr;
#endif

namespace torch_gradops {

int set_blas_threads_local(int n) {
  return MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(n) : -1;
}

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

enum : int { kIdle = 0, kPosted = 1, kTaken = 2, kDone = 3 };

// One helper's mailbox: a part posted by the owner, taken by the helper or by the owner itself.
struct Mailbox {
  std::atomic<int> state{kIdle};
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t part = 0;
  std::exception_ptr error;

  void run() {
    try {
      (*fn)(part);
    } catch (...) {
      error = std::current_exception();
    }
    state.store(kDone, std::memory_order_release);
  }
  bool take() {
    int posted = kPosted;
    return state.compare_exchange_strong(posted, kTaken, std::memory_order_acq_rel);
  }
};

class Team {
 public:
  std::mutex owner;  // held by the GemmTeamScope using the team

  // Parts 1..parts-1 for the helpers; part 0 and every part no helper has taken yet here.
  void run(int64_t parts, const std::function<void(int64_t)>& fn) {
    while (static_cast<int64_t>(boxes_.size()) < parts - 1) {
      boxes_.emplace_back();
      std::thread(&Team::helper, this, &boxes_.back()).detach();  // lives as long as the process
    }
    if (!spinning_.load(std::memory_order_relaxed)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        spinning_.store(true, std::memory_order_release);
      }
      cv_.notify_all();
    }
    for (int64_t i = 1; i < parts; ++i) {
      Mailbox& box = boxes_[i - 1];
      box.fn = &fn;
      box.part = i;
      box.error = nullptr;
      box.state.store(kPosted, std::memory_order_release);
    }
    std::exception_ptr error;
    {
      SerialOmp one_omp(true);  // this thread's parts as the helpers' (theirs is set once)
      try {
        fn(0);
      } catch (...) {
        error = std::current_exception();
      }
      for (int64_t i = 1; i < parts; ++i) {
        Mailbox& box = boxes_[i - 1];
        if (box.take()) box.run();
        while (box.state.load(std::memory_order_acquire) != kDone) cpu_relax();
        if (!error && box.error) error = box.error;
        box.state.store(kIdle, std::memory_order_relaxed);
      }
    }
    if (error) std::rethrow_exception(error);
  }

  // Back to sleep once the helpers see it.
  void stop_spinning() { spinning_.store(false, std::memory_order_release); }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> spinning_{false};
  std::deque<Mailbox> boxes_;  // stable addresses

  void helper(Mailbox* box) {
    set_blas_threads_local(1);
#ifdef _OPENMP
    omp_set_num_threads(1);  // ATen's parallel_for inside a part runs inline
#endif
    at::AutoDispatchBelowADInplaceOrView below;  // as the executor: autograd is ContractFunction's
    for (;;) {
      if (box->state.load(std::memory_order_acquire) == kPosted) {
        if (box->take()) box->run();
        continue;
      }
      if (spinning_.load(std::memory_order_acquire)) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return spinning_.load(std::memory_order_acquire); });
    }
  }
};

// The process's team, created on first use; a forked child (whose helpers did not survive the
// fork) starts a new one. The old one is leaked: its mutexes may be held by threads of the parent.
std::atomic<Team*> g_team{nullptr};
std::once_flag g_atfork;
std::atomic<int64_t> g_parts_run{0};
thread_local Team* t_team = nullptr;  // the team the calling thread's scope owns
thread_local int64_t t_threads = 0;   // and its threads

Team& team() {
  std::call_once(g_atfork, [] { pthread_atfork(nullptr, nullptr, [] { g_team.store(nullptr); }); });
  Team* t = g_team.load(std::memory_order_acquire);
  if (t == nullptr) {
    Team* fresh = new Team();
    if (g_team.compare_exchange_strong(t, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;
  }
  return *t;
}

}  // namespace

GemmTeamScope::GemmTeamScope(int64_t threads) {
  if (threads < 2 || t_team != nullptr) return;
  Team& t = team();
  if (t.owner.try_lock()) {
    team_ = t_team = &t;
    t_threads = threads;
  }
}

GemmTeamScope::~GemmTeamScope() {
  if (team_ == nullptr) return;
  Team* t = static_cast<Team*>(team_);
  t->stop_spinning();
  t->owner.unlock();
  t_team = nullptr;
  t_threads = 0;
}

bool gemm_team_run(int64_t parts, const std::function<void(int64_t)>& fn) {
  if (t_team == nullptr || parts < 2) return false;
  t_team->run(parts, fn);
  g_parts_run.fetch_add(parts, std::memory_order_relaxed);
  return true;
}

int64_t gemm_team_threads() { return t_threads; }

int64_t gemm_team_parts_run() { return g_parts_run.load(std::memory_order_relaxed); }

}  // namespace torch_gradops
