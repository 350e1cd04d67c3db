// Helper threads that run parts of the contraction executor's CPU GEMMs.
//
// With OMP_WAIT_POLICY=PASSIVE (OpenMP workers sleep between parallel regions) every parallel
// region wakes its workers, about 0.14 ms on a 2-core VM: more than a GEMM of 10^7 multiply-adds
// gains from a second thread, so such GEMMs ran on one core. A GemmTeamScope, held by one
// executor call, lets the GEMMs of that call be split into parts run by helper threads that spin
// for work while the scope lives (the first split wakes them; the calling thread runs any part
// no helper has taken yet, so it never waits for a wake-up) and sleep after it.
#pragma once

#include <cstdint>
#include <functional>

namespace torch_gradops {

// MKL's thread count for BLAS calls on the calling thread (MKL_Set_Num_Threads_Local: 0 restores
// the global setting); returns the previous local setting, or -1 where torch was built without
// MKL (then nothing changes).
int set_blas_threads_local(int n);

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
// running anything when the calling thread holds no GemmTeamScope. Helpers run with one BLAS and
// one OpenMP thread, below autograd (as the executor). The first exception thrown by a part is
// rethrown after every part has finished.
bool gemm_team_run(int64_t parts, const std::function<void(int64_t)>& fn);

// The threads of the calling thread's GemmTeamScope, or 0 when it holds none.
int64_t gemm_team_threads();

// Parts run by gemm_team_run in this process so far (torch_gradops.testing.gemm_team_parts).
int64_t gemm_team_parts_run();

}  // namespace torch_gradops
