// Helper threads that run parts of the contraction executor's CPU GEMMs, and the guards that
// hold a thread to one BLAS / one OpenMP thread (the executor's small steps use them too).
//
// With OMP_WAIT_POLICY=PASSIVE (OpenMP workers sleep between parallel regions) every parallel
// region wakes its workers, about 0.14 ms on a 2-core VM: more than a GEMM of 10^7 multiply-adds
// gains from a second thread, so such GEMMs ran on one core. A GemmTeamScope, held by one
// executor call, lets the GEMMs of that call be split into parts run by helper threads that spin
// for work while the scope lives (the first split wakes them; the calling thread runs any part
// no helper has taken yet, so it never waits for a wake-up) and sleep after it.
#pragma once

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>
#include <functional>

namespace torch_gradops {

// MKL's thread count for BLAS calls on the calling thread (MKL_Set_Num_Threads_Local: 0 restores
// the global setting); returns the previous local setting, or -1 where torch was built without
// MKL (then nothing changes).
int set_blas_threads_local(int n);

// One BLAS thread for the calling thread while it lives, when `on` (with MKL; without it every
// GEMM keeps ATen's threading).
class SerialBlas {
 public:
  explicit SerialBlas(bool on) {
    if (on) prev_ = set_blas_threads_local(1);
  }
  ~SerialBlas() {
    if (prev_ >= 0) set_blas_threads_local(prev_);  // 0, "no local setting", restores the global one
  }
  SerialBlas(const SerialBlas&) = delete;
  SerialBlas& operator=(const SerialBlas&) = delete;

 private:
  int prev_ = -1;  // -1: nothing to restore
};

// The calling thread's OpenMP team of one while it lives, when `on`: ATen's parallel_for (copies,
// sums, adds) then runs inline. Under OMP_WAIT_POLICY=PASSIVE a parallel region wakes sleeping
// workers (about 0.14 ms on a 2-core VM), which costs more than it saves on these sizes: there a
// transposing copy gains nothing from a second thread up to 2^22 elements, a contiguous add_
// loses up to 2^20 (80 us on one thread, 117 us on two).
class SerialOmp {
 public:
  explicit SerialOmp(bool on) {
#ifdef _OPENMP
    if (on && omp_get_max_threads() > 1) {
      prev_ = omp_get_max_threads();
      omp_set_num_threads(1);  // the nthreads ICV of this thread only
    }
#endif
  }
  ~SerialOmp() {
#ifdef _OPENMP
    if (prev_ > 0) omp_set_num_threads(prev_);
#endif
  }
  SerialOmp(const SerialOmp&) = delete;
  SerialOmp& operator=(const SerialOmp&) = delete;

 private:
  int prev_ = 0;
};

// While alive, the calling thread owns the process's GEMM team of `threads` threads (itself and
// threads - 1 helpers; when threads > 1 and no other thread owns the team): gemm_team_run may
// use it. The helpers stop spinning when the scope ends.
class GemmTeamScope {
 public:
  explicit GemmTeamScope(int64_t threads);
  ~GemmTeamScope();
  GemmTeamScope(const GemmTeamScope&) = delete;
  GemmTeamScope& operator=(const GemmTeamScope&) = delete;

 private:
  void* team_ = nullptr;  // the team this scope owns
};

// Runs fn(0), ..., fn(parts - 1), fn(0) on the calling thread and the others on helpers (or on
// the calling thread, when it gets to them first), and returns true; returns false without
// running anything when the calling thread holds no GemmTeamScope. Every part runs with one
// OpenMP thread (the team is the parallelism: no OpenMP region to wake), helpers below autograd
// (as the executor) and on one BLAS thread; a part that calls BLAS on the calling thread holds a
// SerialBlas itself (setting MKL's count is not free: done around every part, copies included, it
// slowed the 6x6 / 1 MiB lattice's forward+backward from 0.060 s to 0.074-0.084 s). The first
// exception thrown by a part is rethrown after every part has finished.
bool gemm_team_run(int64_t parts, const std::function<void(int64_t)>& fn);

// The threads of the calling thread's GemmTeamScope, or 0 when it holds none.
int64_t gemm_team_threads();

// Parts run by gemm_team_run in this process so far (torch_gradops.testing.gemm_team_parts).
int64_t gemm_team_parts_run();

}  // namespace torch_gradops
