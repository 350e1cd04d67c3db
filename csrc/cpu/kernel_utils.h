// Helpers for the CPU graph-attention kernels: row prefetch, fixed-order vector reductions,
// a vectorisable float exp, CSC pointer checks and edge-balanced parallel row ranges.
// (gat_cpu.cpp has its own copies of some, from before this header: the same algorithms.)
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace torch_gradops {
namespace cpu {

// Gathered rows are random: prefetch the row this many edges ahead so that its cache misses
// overlap with the current edge's arithmetic (the row gathers dominate at scale).
constexpr int64_t kPrefetchDistance = 4;

template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

// <a, b> over n values in 8 interleaved partial sums combined in a fixed tree: the compiler keeps
// them in one vector register (a single running sum is a chain of dependent scalar adds), and the
// order depends only on n, so results are reproducible.
template <typename acc_t, typename TA, typename TB>
inline acc_t dot(const TA* a, const TB* b, int64_t n) {
  constexpr int64_t kLanes = 8;
  acc_t part[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += static_cast<acc_t>(a[c + l]) * static_cast<acc_t>(b[c + l]);
  }
  for (; c < n; ++c) part[c % kLanes] += static_cast<acc_t>(a[c]) * static_cast<acc_t>(b[c]);
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// sum of n values, in the same fixed 8-lane pattern as dot().
template <typename acc_t>
inline acc_t sum8(const acc_t* a, int64_t n) {
  constexpr int64_t kLanes = 8;
  acc_t part[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[c + l];
  }
  for (; c < n; ++c) part[c % kLanes] += a[c];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// Eight values in one (or, for double, two) vector registers, with GCC/Clang vector types: the
// plain-loop form of some reductions was vectorised across the outer loop, with a shuffle per
// element. Loads and stores are unaligned (memcpy compiles to one vmovups).
// (A struct typedef: GCC drops the attribute from an alias template of a dependent type.)
template <typename T>
struct Vec8 {
  typedef T type __attribute__((vector_size(8 * sizeof(T))));
};

// Unaligned load / store of a vector type V of T values (memcpy compiles to one vmovups).
template <typename V, typename T>
inline V load_vec(const T* p) {
  V r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

template <typename V, typename T>
inline void store_vec(T* p, const V& v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename T>
inline typename Vec8<T>::type load8(const T* p) {
  return load_vec<typename Vec8<T>::type>(p);
}

template <typename T>
inline void store8(T* p, const typename Vec8<T>::type& v) {
  store_vec(p, v);
}

// The widest native vector: 64 bytes with AVX-512, else 32. For loops whose per-element order
// does not depend on the width (no reduction across lanes), so results are the same either way.
#if defined(__AVX512F__)
constexpr int kWideBytes = 64;
#else
constexpr int kWideBytes = 32;
#endif
template <typename T>
struct VecWide {
  static constexpr int kLanes = kWideBytes / static_cast<int>(sizeof(T));
  typedef T type __attribute__((vector_size(kWideBytes)));
};

template <typename T>
inline typename VecWide<T>::type load_wide(const T* p) {
  return load_vec<typename VecWide<T>::type>(p);
}

template <typename T>
inline void store_wide(T* p, const typename VecWide<T>::type& v) {
  store_vec(p, v);
}

// The lanes of v summed in the fixed tree that dot() and sum8() use.
template <typename T>
inline T tree8(const typename Vec8<T>::type& p) {
  return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
}

// tree8() of eight vectors at once, lane k of the result being tree8(p[k]): the same additions of
// the same pairs (x + y and y + x round alike), arranged as a transpose. 12 shuffles and 7 vector
// adds instead of eight scalar trees.
template <typename T>
inline typename Vec8<T>::type tree8x8(const typename Vec8<T>::type* p) {
  using vec = typename Vec8<T>::type;
  using mask = typename Vec8<typename std::conditional<sizeof(T) == 8, int64_t, int32_t>::type>::type;
  const mask lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
  const mask even = {0, 2, 4, 6, 8, 10, 12, 14}, odd = {1, 3, 5, 7, 9, 11, 13, 15};
  vec u[4], v[2];
  // u[i] = [p0+p4, p1+p5, p2+p6, p3+p7] of vectors 2i then 2i+1
  for (int i = 0; i < 4; ++i) {
    u[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi);
  }
  // v[i] = [(p0+p4)+(p1+p5), (p2+p6)+(p3+p7)] of vectors 4i .. 4i+3
  for (int i = 0; i < 2; ++i) {
    v[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], even) + __builtin_shuffle(u[2 * i], u[2 * i + 1], odd);
  }
  return __builtin_shuffle(v[0], v[1], even) + __builtin_shuffle(v[0], v[1], odd);
}

// A CSC pointer array must start at 0 and end at E: per-node checks of non-decreasing ranges
// inside [0, E] would still let edges past ptr[n] go unvisited by one pass and visited by another.
template <typename index_t>
void check_ptr_ends(const index_t* ptr, int64_t n, int64_t E, const char* name) {
  TORCH_CHECK(static_cast<int64_t>(ptr[0]) == 0 && static_cast<int64_t>(ptr[n]) == E, name,
              " must start at 0 and end at E = ", E, " (the number of edges), got ", ptr[0], " and ", ptr[n]);
}

// Bounds 0 = b[0] <= b[1] <= ... <= b[n] = rows splitting the rows of a CSR/CSC pointer array
// (ptr[0] = 0, ptr[rows] = E, as check_ptr_ends() requires) into n ranges of about equal weight,
// a row weighing its edges plus row_weight: b[c] is the first row (from b[c-1] on) whose start
// reaches floor(c/n) of the total. Depends on the graph and n only. A malformed (decreasing) ptr
// only misplaces a bound: the kernels check each row's range.
template <typename index_t>
std::vector<int64_t> balanced_row_bounds(const index_t* ptr, int64_t rows, int64_t n, int64_t row_weight) {
  const int64_t total = static_cast<int64_t>(ptr[rows]) + row_weight * rows;
  std::vector<int64_t> bounds(n + 1, rows);
  bounds[0] = 0;
  for (int64_t c = 1; c < n; ++c) {
    const int64_t target = total / n * c + (total % n) * c / n;  // floor(total * c / n) without overflow
    int64_t lo = bounds[c - 1], hi = rows;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<int64_t>(ptr[mid]) + row_weight * mid < target) lo = mid + 1; else hi = mid;
    }
    bounds[c] = lo;
  }
  return bounds;
}

// fn(begin, end) over ranges of the rows of a CSR/CSC pointer array (as balanced_row_bounds()
// wants it), run in parallel, each range holding about the same work: its edges plus one edge's
// worth per row (a row's own set-up and write). at::parallel_for over the rows themselves splits
// them by count, which hands one thread the hubs of a graph numbered by degree (power-law graphs
// often are): the GATv2 forward on such a graph (N=100k, E=2M) ran only 1.15x faster on 2
// threads than on 1. Ranges: a few per thread, each at least 32768 units of work_per_edge (small
// inputs stay on one thread). A row's results never depend on the ranges.
template <typename index_t, typename F>
void parallel_over_rows(const index_t* ptr, int64_t rows, int64_t work_per_edge, const F& fn) {
  if (rows <= 0) return;
  const int64_t total = static_cast<int64_t>(ptr[rows]) + rows;  // edges + one per row
  int64_t n = std::min<int64_t>(rows, 4 * static_cast<int64_t>(at::get_num_threads()));
  n = std::max<int64_t>(1, std::min<int64_t>(n, total * std::max<int64_t>(work_per_edge, 1) / 32768));
  if (n == 1) {
    fn(int64_t(0), rows);
    return;
  }
  const std::vector<int64_t> bounds = balanced_row_bounds(ptr, rows, n, 1);
  at::parallel_for(0, n, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t c = cb; c < ce; ++c) {
      if (bounds[c] < bounds[c + 1]) fn(bounds[c], bounds[c + 1]);
    }
  });
}

// exp of n values in place. float: a branch-free Cody-Waite + degree-6 polynomial (about 1 ulp,
// the same scheme as Cephes' expf) that the compiler vectorises; libm's scalar expf is far
// slower. Below -87.3 it gives 0 (no denormals); NaN stays NaN.
inline void exp_inplace(float* v, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const float x = v[k];
    const float lo = x < -87.3f ? -87.3f : x;  // not fmin/fmax: those are libm calls
    const float xc = lo > 88.7f ? 88.7f : lo;
    const float m = std::nearbyint(xc * 1.44269504088896341f);
    const float r = (xc - m * 0.693359375f) + m * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    int32_t bits;
    const int32_t e = (static_cast<int32_t>(m) + 127) << 23;
    std::memcpy(&bits, &p, sizeof(bits));
    bits += e - (127 << 23);
    float y;
    std::memcpy(&y, &bits, sizeof(y));
    y = x < -87.3f ? 0.0f : y;
    y = x > 88.7f ? std::numeric_limits<float>::infinity() : y;
    v[k] = x != x ? x : y;
  }
}
inline void exp_inplace(double* v, int64_t n) {
  for (int64_t k = 0; k < n; ++k) v[k] = std::exp(v[k]);
}

}  // namespace cpu
}  // namespace torch_gradops
