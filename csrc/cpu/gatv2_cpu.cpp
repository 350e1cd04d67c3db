// CPU kernels for the fused GATv2 ops (schemas and the math in ../gatv2.h, ../gatv2.cpp).
//
// Forward: one pass per destination over its incoming edges, all heads at once, with an online
// softmax stepped per tile of kTile edges. Per edge: z = x_src[j] + x_dst[i] + ep, leaky_relu
// and per-head scores; per tile: the exps of all its scores and rescale factors in one
// vectorised call, and its weighted rows added to the accumulator. Saves only the log-sum-exp.
// ep, the projected edge features edge_attr[e] @ W, is computed per tile of kTile edges (a small
// GEMM in a per-thread buffer, EdgeProjector) and never stored beyond the tile; the edge_attr
// and edge_weight gradients use the same tiles of dz rows.
//
// Backward, without atomics and in a fixed order (bitwise reproducible for any thread count),
// recomputing z wherever it is needed:
//   pass 1, per destination, in fixed destination chunks (edge-balanced, chosen from the graph
//           and the shapes only): D = <g_i, out_i> (+ sum A*grad_alpha), then per edge alpha,
//           dalpha = keep*(<g_i, x_src[j]> + grad_alpha), ds = alpha*(dalpha - D),
//           dz = ds*att*leaky_relu'(z): grad x_dst (sum of dz), grad edge_attr (dz W^T), and
//           per-chunk partial sums of grad att (ds*leaky_relu(z)) and grad edge_weight
//           (edge_attr^T dz); ds and alpha-after-dropout go to [E,H] workspaces;
//   the partials are summed over the chunks in chunk order;
//   grad x_src = sum over a source's edges of A*g_i + dz: where the machine's thread count and
//   memory allow (scatter_groups), pass 1 adds each edge's share to its source's row of a
//   per-group partial, the partials summed in group order after; else pass 2, per source over
//   the reverse index, with z recomputed.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../gatv2.h"
#include "kernel_utils.h"

namespace torch_gradops {
namespace {

using cpu::check_ptr_ends;
using cpu::dot;
using cpu::exp_inplace;
using cpu::kPrefetchDistance;
using cpu::parallel_over_rows;
using cpu::prefetch_row;
using cpu::sum8;

template <typename acc_t, typename T>
std::vector<acc_t> to_acc_vector(const at::Tensor& t) {
  std::vector<acc_t> v;
  if (!t.defined()) return v;
  v.resize(t.numel());
  const T* p = t.data_ptr<T>();
  for (int64_t k = 0; k < t.numel(); ++k) v[k] = static_cast<acc_t>(p[k]);
  return v;
}

// z[f] = (src_row[f] + dst_row[f]) + ep[f] for f < HC, where ep is the edge's term (its row of
// given or projected features, see EdgeProjector) or, when null, nothing.
template <typename acc_t, typename TS, typename TD, typename TE>
inline void edge_preact(acc_t* __restrict__ z, const TS* __restrict__ src_row, const TD* __restrict__ dst_row,
                        const TE* __restrict__ ep, int64_t HC) {
  if (ep) {
    for (int64_t f = 0; f < HC; ++f) {
      z[f] = (static_cast<acc_t>(src_row[f]) + static_cast<acc_t>(dst_row[f])) + static_cast<acc_t>(ep[f]);
    }
  } else {
    for (int64_t f = 0; f < HC; ++f) z[f] = static_cast<acc_t>(src_row[f]) + static_cast<acc_t>(dst_row[f]);
  }
}

// Rows per tile of the edge-feature products (projection, grad edge_attr, grad edge_weight), and
// edges per step of the forward's online softmax.
constexpr int kTile = 8;

// f(std::integral_constant<int, C>) for the common head widths (loops unrolled, the same
// operations), f(std::integral_constant<int, 0>) for any other: the kernels' kC parameters.
template <typename F>
inline void with_head_width(int64_t C, F&& f) {
  switch (C) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// P[b, f] = sum_k eab[b, k] * w[k, f] for the kTile rows of eab [kTile, K]: a small GEMM whose
// two vectors of w per k serve all kTile rows (the per-edge form loaded a vector of w per
// multiply-add and was load-bound). Every element is summed over k in order from zero by the
// same instructions whatever its row, so a row's projection does not depend on the tile (or the
// rows beside it) it was computed with: the forward and both backward passes agree bitwise.
template <typename acc_t>
inline void project_tile(acc_t* __restrict__ P, const acc_t* __restrict__ eab, const acc_t* __restrict__ w,
                         int64_t K, int64_t HC) {
  using vec = typename cpu::VecWide<acc_t>::type;
  constexpr int kLanes = cpu::VecWide<acc_t>::kLanes;
  int64_t f0 = 0;
  for (; f0 + 2 * kLanes <= HC; f0 += 2 * kLanes) {
    vec r0[kTile] = {}, r1[kTile] = {};
    for (int64_t k = 0; k < K; ++k) {
      const vec w0 = cpu::load_wide(w + k * HC + f0), w1 = cpu::load_wide(w + k * HC + f0 + kLanes);
      for (int b = 0; b < kTile; ++b) {
        const acc_t a = eab[b * K + k];
        r0[b] += a * w0;
        r1[b] += a * w1;
      }
    }
    for (int b = 0; b < kTile; ++b) {
      cpu::store_wide(P + b * HC + f0, r0[b]);
      cpu::store_wide(P + b * HC + f0 + kLanes, r1[b]);
    }
  }
  for (; f0 + kLanes <= HC; f0 += kLanes) {
    vec r[kTile] = {};
    for (int64_t k = 0; k < K; ++k) {
      const vec w0 = cpu::load_wide(w + k * HC + f0);
      for (int b = 0; b < kTile; ++b) r[b] += eab[b * K + k] * w0;
    }
    for (int b = 0; b < kTile; ++b) cpu::store_wide(P + b * HC + f0, r[b]);
  }
  for (int64_t f = f0; f < HC; ++f) {
    for (int b = 0; b < kTile; ++b) {
      acc_t r = 0;
      for (int64_t k = 0; k < K; ++k) r += eab[b * K + k] * w[k * HC + f];
      P[b * HC + f] = r;
    }
  }
}

// g[b, k] = sum_f dz[b, f] * w[k, f] for the kTile rows of dz [kTile, HC] (rows of grad
// edge_attr), from wT = w transposed and zero-padded to Kp columns (a multiple of the vector
// width; g is [kTile, Kp]). Each row's vectors are summed over f in two interleaved halves (even
// and odd f, for independent chains) then added: the same for every row.
template <typename acc_t>
inline void edge_attr_grad_tile(acc_t* __restrict__ g, const acc_t* __restrict__ dz, const acc_t* __restrict__ wT,
                                int64_t Kp, int64_t HC) {
  using vec = typename cpu::VecWide<acc_t>::type;
  constexpr int kLanes = cpu::VecWide<acc_t>::kLanes;
  for (int64_t k0 = 0; k0 < Kp; k0 += kLanes) {
    vec r0[kTile] = {}, r1[kTile] = {};
    int64_t f = 0;
    for (; f + 2 <= HC; f += 2) {
      const vec a = cpu::load_wide(wT + f * Kp + k0), b = cpu::load_wide(wT + (f + 1) * Kp + k0);
      for (int row = 0; row < kTile; ++row) {
        r0[row] += dz[row * HC + f] * a;
        r1[row] += dz[row * HC + f + 1] * b;
      }
    }
    if (f < HC) {
      const vec a = cpu::load_wide(wT + f * Kp + k0);
      for (int row = 0; row < kTile; ++row) r0[row] += dz[row * HC + f] * a;
    }
    for (int row = 0; row < kTile; ++row) cpu::store_wide(g + row * Kp + k0, r0[row] + r1[row]);
  }
}

// The edge terms of a pass's positions pos = 0..n-1 (position pos holds edge e = edge_of[pos],
// or edge pos when edge_of is null; edge e reads row r = rows[e] of edge_attr, or row e when rows
// is null): in kProject mode the projected edge features ep[e] = edge_attr[r] @ W, computed per
// aligned tile of kTile positions when a position of a new tile is asked for and kept until then
// (the passes walk positions in order, so each tile is computed about once per thread; nothing of
// size E x H x C: one tile per thread); in kDirect mode the given rows edge_attr[r]; in kNone
// mode none.
template <typename acc_t, typename TE, typename index_t>
class EdgeProjector {
 public:
  EdgeProjector(const TE* ea, const acc_t* w, int64_t K, int64_t HC, int64_t E, int64_t n, const index_t* edge_of,
                const index_t* rows, int64_t num_rows, Gatv2EdgeMode mode)
      : ea_(ea), w_(w), K_(K), HC_(HC), E_(E), n_(n), num_rows_(num_rows), edge_of_(edge_of), rows_(rows),
        mode_(mode) {
    if (mode == Gatv2EdgeMode::kProject) {
      eab_.resize(kTile * K);
      P_.resize(kTile * HC);
    }
  }

  // z = (src_row + dst_row) + the edge term of position pos (edge_preact()).
  template <typename TS, typename TD>
  void preact(acc_t* z, const TS* src_row, const TD* dst_row, int64_t pos) {
    if (mode_ == Gatv2EdgeMode::kProject) {
      edge_preact(z, src_row, dst_row, row(pos), HC_);
    } else {
      const TE* ep = mode_ == Gatv2EdgeMode::kDirect ? ea_ + attr_row(edge(pos)) * HC_ : nullptr;
      edge_preact(z, src_row, dst_row, ep, HC_);
    }
  }

  const acc_t* row(int64_t pos) {
    const int64_t t0 = pos - pos % kTile;
    if (t0 != tile0_) {
      for (int b = 0; b < kTile; ++b) {
        acc_t* dst = eab_.data() + b * K_;
        const int64_t p = t0 + b;
        if (p >= n_) {
          std::fill(dst, dst + K_, acc_t(0));
          continue;
        }
        const TE* src = ea_ + attr_row(edge(p)) * K_;
        for (int64_t k = 0; k < K_; ++k) dst[k] = static_cast<acc_t>(src[k]);
      }
      // The next tile's rows, when scattered: a cache miss each, overlapped with this tile's
      // work instead of stalling its start.
      if (scattered()) {
        const int64_t row_bytes = K_ * static_cast<int64_t>(sizeof(TE));
        for (int64_t p = t0 + kTile; p < t0 + 2 * kTile; ++p) {
          const int64_t r = row_or_none(p);
          if (r < 0) continue;
          const char* line = reinterpret_cast<const char*>(ea_ + r * K_);
          for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(line + off);
        }
      }
      project_tile(P_.data(), eab_.data(), w_, K_, HC_);
      tile0_ = t0;
    }
    return P_.data() + (pos - t0) * HC_;
  }

  // kDirect mode: prefetch position pos's row when the rows are scattered (read in CSC order,
  // the hardware prefetcher follows them).
  void prefetch_direct(int64_t pos) const {
    if (mode_ != Gatv2EdgeMode::kDirect || !scattered()) return;
    const int64_t r = row_or_none(pos);
    if (r >= 0) cpu::prefetch_row(ea_ + r * HC_, HC_);
  }

  // The row of edge_attr that edge e (a CSC position) reads.
  int64_t attr_row(int64_t e) const {
    if (!rows_) return e;
    const int64_t r = rows_[e];
    TORCH_CHECK(r >= 0 && r < num_rows_, "edge_attr_rows: row ", r, " out of range [0, ", num_rows_, ")");
    return r;
  }

 private:
  // Whether the rows are read out of order (through edge_of or rows).
  bool scattered() const { return edge_of_ || rows_; }

  // The row of edge_attr that position pos reads, or -1 past the end or where an index is out of
  // range (the reads report those): for prefetches.
  int64_t row_or_none(int64_t pos) const {
    if (pos >= n_) return -1;
    const int64_t e = edge_of_ ? static_cast<int64_t>(edge_of_[pos]) : pos;
    if (e < 0 || e >= E_) return -1;
    const int64_t r = rows_ ? static_cast<int64_t>(rows_[e]) : e;
    return r >= 0 && r < num_rows_ ? r : -1;
  }

  int64_t edge(int64_t pos) const {
    const int64_t e = edge_of_ ? static_cast<int64_t>(edge_of_[pos]) : pos;
    TORCH_CHECK(e >= 0 && e < E_, "reverse index entry out of range");
    return e;
  }

  const TE* ea_;
  const acc_t* w_;
  int64_t K_, HC_, E_, n_, num_rows_;
  const index_t* edge_of_;
  const index_t* rows_;
  Gatv2EdgeMode mode_;
  int64_t tile0_ = -1;
  std::vector<acc_t> eab_, P_;
};

// s[h] = sum_c att[h,c] * leaky_relu(z[h,c]) (a select, so that it vectorises), eight lanes per
// head combined in a fixed tree; nothing stored but the H scores. The forward and the backward
// both score through here, so the backward's alpha = exp(s - lse) matches the forward's.
template <typename acc_t>
inline void head_scores(const acc_t* __restrict__ z, const acc_t* __restrict__ att, acc_t slope,
                        acc_t* __restrict__ s, int64_t H, int64_t C) {
  using cpu::load8;
  using vec = typename cpu::Vec8<acc_t>::type;
  const int64_t C8 = C / 8 * 8;
  for (int64_t h = 0; h < H; ++h) {
    const acc_t* zh = z + h * C;
    const acc_t* ah = att + h * C;
    vec part = {};
    for (int64_t c = 0; c < C8; c += 8) {
      const vec v = load8(zh + c);
      const vec l = v > acc_t(0) ? v : v * slope;
      part += load8(ah + c) * l;
    }
    for (int64_t c = C8; c < C; ++c) {
      const acc_t v = zh[c];
      part[c - C8] += ah[c] * (v > acc_t(0) ? v : v * slope);
    }
    s[h] = cpu::tree8<acc_t>(part);
  }
}

// head_scores() on z = (x_src row + x_dst row) [+ edge row] formed in registers: the forward's
// path when the rows are already in the accumulation type. Same operations in the same order as
// edge_preact() then head_scores(), hence the same scores. When given, the row `ahead` is
// prefetched a head's slice at a time: a whole row's prefetches at once took every L1 fill
// buffer and stalled the arithmetic until they drained; spread out, they overlap with it.
// kC, when not 0, is C as a constant (with_head_width).
template <typename acc_t, bool kWithEdge, int kC>
inline void head_scores_rows_c(const acc_t* __restrict__ xs, const acc_t* __restrict__ xd,
                               const acc_t* __restrict__ ea, const acc_t* __restrict__ att, acc_t slope,
                               acc_t* __restrict__ s, int64_t H, int64_t C_, const acc_t* ahead) {
  const int64_t C = kC ? kC : C_;
  using cpu::load8;
  using vec = typename cpu::Vec8<acc_t>::type;
  const int64_t C8 = C / 8 * 8;
  const char* pf = reinterpret_cast<const char*>(ahead);
  const int64_t head_bytes = C * static_cast<int64_t>(sizeof(acc_t));
  auto head_part = [&](int64_t h) {
    const int64_t f0 = h * C;
    if (pf) {
      for (int64_t off = h * head_bytes; off < (h + 1) * head_bytes; off += 64) __builtin_prefetch(pf + off);
    }
    vec part = {};
    for (int64_t c = 0; c < C8; c += 8) {
      vec v = load8(xs + f0 + c) + load8(xd + f0 + c);
      if (kWithEdge) v += load8(ea + f0 + c);
      const vec l = v > acc_t(0) ? v : v * slope;
      part += load8(att + f0 + c) * l;
    }
    for (int64_t c = C8; c < C; ++c) {
      acc_t v = xs[f0 + c] + xd[f0 + c];
      if (kWithEdge) v += ea[f0 + c];
      part[c - C8] += att[f0 + c] * (v > acc_t(0) ? v : v * slope);
    }
    return part;
  };
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) {  // eight heads' trees at once: the same sums as tree8()
    vec parts[8];
    for (int k = 0; k < 8; ++k) parts[k] = head_part(h + k);
    cpu::store8(s + h, cpu::tree8x8<acc_t>(parts));
  }
  for (; h < H; ++h) s[h] = cpu::tree8<acc_t>(head_part(h));
}

template <typename acc_t, bool kWithEdge>
inline void head_scores_rows(const acc_t* xs, const acc_t* xd, const acc_t* ea, const acc_t* att, acc_t slope,
                             acc_t* s, int64_t H, int64_t C, const acc_t* ahead = nullptr) {
  with_head_width(C, [&](auto kC) {
    head_scores_rows_c<acc_t, kWithEdge, decltype(kC)::value>(xs, xd, ea, att, slope, s, H, C, ahead);
  });
}

// add_src_grad() with z = (xs_row + xd_row) [+ ep] formed in registers (rows already in the
// accumulation type; the same operations as edge_preact()): pass 2's path for float and double.
template <typename acc_t, bool kWithEdge>
inline void add_src_grad_rows(acc_t* __restrict__ accx, const acc_t* __restrict__ xs_row,
                              const acc_t* __restrict__ xd_row, const acc_t* __restrict__ ep,
                              const acc_t* __restrict__ att, const acc_t* __restrict__ g,
                              const acc_t* __restrict__ aw, const acc_t* __restrict__ ds, acc_t slope, int64_t H,
                              int64_t C) {
  for (int64_t h = 0; h < H; ++h) {
    const acc_t a = aw[h], d = ds[h];
    for (int64_t f = h * C; f < (h + 1) * C; ++f) {
      acc_t zf = xs_row[f] + xd_row[f];
      if (kWithEdge) zf += ep[f];
      accx[f] += a * g[f] + d * att[f] * (zf > acc_t(0) ? acc_t(1) : slope);
    }
  }
}

// p[k, f] += sum_b eab[b, k] * dzb[b, f] over a batch of kTile edges (rows past the
// batch's end are zero): the edges' shares of grad edge_weight, with each vector of p loaded and
// stored once per batch instead of once per edge (per edge, the update was store-bound).
template <typename acc_t>
inline void add_weight_grad_batch(acc_t* __restrict__ p, const acc_t* __restrict__ eab, const acc_t* __restrict__ dzb,
                                  int64_t K, int64_t HC) {
  using vec = typename cpu::VecWide<acc_t>::type;
  constexpr int kLanes = cpu::VecWide<acc_t>::kLanes;
  const int64_t HCw = HC / kLanes * kLanes;
  for (int64_t f = 0; f < HCw; f += kLanes) {
    vec d[kTile];
    for (int b = 0; b < kTile; ++b) d[b] = cpu::load_wide(dzb + b * HC + f);
    for (int64_t k = 0; k < K; ++k) {
      vec acc = cpu::load_wide(p + k * HC + f);
      for (int b = 0; b < kTile; ++b) acc += eab[b * K + k] * d[b];
      cpu::store_wide(p + k * HC + f, acc);
    }
  }
  for (int64_t f = HCw; f < HC; ++f) {
    for (int64_t k = 0; k < K; ++k) {
      acc_t acc = p[k * HC + f];
      for (int b = 0; b < kTile; ++b) acc += eab[b * K + k] * dzb[b * HC + f];
      p[k * HC + f] = acc;
    }
  }
}

// accx[h,c] += aw[h] * g[h,c] + ds[h] * att[h,c] * leaky_relu'(z[h,c]): one edge's share of grad x_src.
template <typename acc_t, typename T>
inline void add_src_grad(acc_t* __restrict__ accx, const acc_t* __restrict__ z, const acc_t* __restrict__ att,
                         const T* __restrict__ g, const acc_t* __restrict__ aw, const acc_t* __restrict__ ds,
                         acc_t slope, int64_t H, int64_t C) {
  for (int64_t h = 0; h < H; ++h) {
    const acc_t a = aw[h], d = ds[h];
    for (int64_t c = 0; c < C; ++c) {
      const int64_t f = h * C + c;
      accx[f] += a * static_cast<acc_t>(g[f]) + d * att[f] * (z[f] > acc_t(0) ? acc_t(1) : slope);
    }
  }
}

// An edge's shares of the gradients pass 1 forms, in one sweep over z: p[f] += ds[h] *
// leaky_relu(z[f]) (kAtt), dz = ds[h] * att[f] * leaky_relu'(z[f]) added to gx (kDst) and written
// to dzr (kDz), and sx[f] += aw[h] * g[f] + dz (kSrc: x_src's gradient scattered, the same terms,
// in the same order, as add_src_grad()). The per-element loops live in functions with restrict
// pointers and the slope as a value: inside the kernels' lambdas GCC reloaded the slope through
// the closure on every element (a store might alias it) and left them scalar.
template <typename acc_t, typename T, bool kAtt, bool kDst, bool kDz, bool kSrc>
inline void add_edge_grads(acc_t* __restrict__ p, acc_t* __restrict__ gx, acc_t* __restrict__ dzr,
                           acc_t* __restrict__ sx, const acc_t* __restrict__ z, const acc_t* __restrict__ att,
                           const acc_t* __restrict__ ds, const acc_t* __restrict__ aw, const T* __restrict__ g,
                           acc_t slope, int64_t H, int64_t C) {
  for (int64_t h = 0; h < H; ++h) {
    const acc_t d = ds[h];
    for (int64_t f = h * C; f < (h + 1) * C; ++f) {
      const acc_t v = z[f];
      const bool pos = v > acc_t(0);
      if constexpr (kAtt) p[f] += d * (pos ? v : v * slope);
      const acc_t dzf = d * att[f] * (pos ? acc_t(1) : slope);
      if constexpr (kDz) dzr[f] = dzf;
      if constexpr (kDst) gx[f] += dzf;
      if constexpr (kSrc) sx[f] += aw[h] * static_cast<acc_t>(g[f]) + dzf;
    }
  }
}

// add_edge_grads() with the flags chosen at run time (null pointers: not wanted; aw and g are
// read only with sx).
template <typename acc_t, typename T>
inline void add_edge_grads_any(acc_t* p, acc_t* gx, acc_t* dzr, acc_t* sx, const acc_t* z, const acc_t* att,
                               const acc_t* ds, const acc_t* aw, const T* g, acc_t slope, int64_t H, int64_t C) {
  auto run = [&](auto att_c, auto dst_c, auto dz_c, auto src_c) {
    add_edge_grads<acc_t, T, decltype(att_c)::value, decltype(dst_c)::value, decltype(dz_c)::value,
                   decltype(src_c)::value>(p, gx, dzr, sx, z, att, ds, aw, g, slope, H, C);
  };
  using T1 = std::true_type;
  using F0 = std::false_type;
  auto with_src = [&](auto a, auto d, auto w) { sx ? run(a, d, w, T1{}) : run(a, d, w, F0{}); };
  auto with_dz = [&](auto a, auto d) { dzr ? with_src(a, d, T1{}) : with_src(a, d, F0{}); };
  auto with_dst = [&](auto a) { gx ? with_dz(a, T1{}) : with_dz(a, F0{}); };
  p ? with_dst(T1{}) : with_dst(F0{});
}

// Groups of pass 1's chunks that scatter the x_src gradient into partials of their own (one
// group's chunks run in order on one thread; the partials are summed in group order), or none:
// then pass 2 computes it over the reverse index. Scattering saves pass 2's second recomputation
// of every edge's pre-activation (with its edge projection), its loop and its two row gathers per
// edge, for a read-modify-write of one row per edge in pass 1, but runs pass 1 on at most one
// thread per group. So there is one group per hardware thread (at most one per chunk): the
// grouping depends on the graph, the shapes and the machine, never on the thread count torch
// uses. Chosen when the partials past the one held by the gradient itself take no more memory
// than pass 2's two [E,H] workspaces; TORCH_GRADOPS_GATV2_SOURCE_PASS=scatter or =reverse forces
// either way (tests, benchmarks).
inline int64_t scatter_groups(int64_t num_src, int64_t HC, int64_t E, int64_t H, int64_t n_chunks, bool own_first) {
  const char* force = std::getenv("TORCH_GRADOPS_GATV2_SOURCE_PASS");
  const std::string how = force ? force : "auto";
  TORCH_CHECK(how == "auto" || how == "scatter" || how == "reverse",
              "TORCH_GRADOPS_GATV2_SOURCE_PASS must be auto, scatter or reverse, got '", how, "'");
  if (how == "reverse") return 0;
  const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t groups = std::max<int64_t>(1, std::min(hw, n_chunks));
  if (how == "scatter") return groups;
  const int64_t extra = (own_first ? groups - 1 : groups) * num_src * HC;
  return extra <= 2 * E * H ? groups : 0;
}

// Destination ranges of pass 1, each summed into its own partial of grad att / grad edge_weight,
// the partials then reduced in range order: so the count and the boundaries must depend only on
// the graph and the shapes, never on the thread count. Edge-balanced (hubs land in small
// ranges); at most kMaxChunks ranges and at most kPartialBudget partial values in all.
template <typename index_t>
std::vector<int64_t> chunk_bounds(const index_t* ptr, int64_t num_dst, int64_t E, int64_t partial_size) {
  constexpr int64_t kMaxChunks = 256, kMinEdgesPerChunk = 1024, kPartialBudget = int64_t(1) << 23;
  int64_t n = std::min<int64_t>(kMaxChunks, std::max<int64_t>(1, E / kMinEdgesPerChunk));
  n = std::min<int64_t>(n, std::max<int64_t>(1, kPartialBudget / std::max<int64_t>(partial_size, 1)));
  n = std::max<int64_t>(1, std::min<int64_t>(n, num_dst));
  return cpu::balanced_row_bounds(ptr, num_dst, n, 0);
}

// One online-softmax step over a tile's scores [nt, H], all heads at once (loops over h inside,
// so that they vectorise; per head the same operations in the same order as one head at a time):
// run_max becomes the maximum over the tile too, ex gets the H rescale exponents old - new max
// then the [nt, H] weight exponents s - new max, for one exp call.
template <typename acc_t>
inline void softmax_tile_exponents(const acc_t* __restrict__ score, int nt, int64_t H, acc_t* __restrict__ run_max,
                                   acc_t* __restrict__ ex) {
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  acc_t* __restrict__ m = ex;  // the new maxima, until they become the rescale exponents
  for (int64_t h = 0; h < H; ++h) m[h] = run_max[h];
  for (int t = 0; t < nt; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const acc_t s = score[t * H + h];
      m[h] = s > m[h] ? s : m[h];  // a NaN score is no maximum; exp spreads it
    }
  }
  for (int t = 0; t < nt; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const acc_t s = score[t * H + h];
      ex[H + t * H + h] = s == neg_inf ? acc_t(-1000) : s - m[h];  // a -inf score weighs 0
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const acc_t old = run_max[h], mh = m[h];
    run_max[h] = mh;
    m[h] = mh == old ? acc_t(0) : old - mh;  // also -inf - -inf: no NaN
  }
}

// run_sum[h] = run_sum[h] * rescale[h] + the tile's weights [nt, H] of head h, in edge order.
template <typename acc_t>
inline void softmax_tile_sums(const acc_t* __restrict__ weight, const acc_t* __restrict__ rescale, int nt, int64_t H,
                              acc_t* __restrict__ run_sum) {
  for (int64_t h = 0; h < H; ++h) run_sum[h] *= rescale[h];
  for (int t = 0; t < nt; ++t) {
    for (int64_t h = 0; h < H; ++h) run_sum[h] += weight[t * H + h];
  }
}

// acc[h, c] += sum over the tile's edges t (in order) of w[t, h] * rows[t][h, c]: the forward's
// weighted messages, a tile at a time so that each accumulator vector is loaded and stored once
// per tile instead of once per edge. Each element gets the same operations in the same order
// whichever branch runs (kC: with_head_width).
template <typename acc_t, typename T, int kC>
inline void accumulate_tile_c(acc_t* __restrict__ acc, const T* const* rows, const acc_t* __restrict__ w, int nt,
                              int64_t H, int64_t C_) {
  const int64_t C = kC ? kC : C_;
  using vec = typename cpu::VecWide<acc_t>::type;
  constexpr int kLanes = cpu::VecWide<acc_t>::kLanes;
  if constexpr (std::is_same<acc_t, T>::value) {
    constexpr int kVecs = kC % kLanes == 0 ? kC / kLanes : 0;  // a head's vectors, when C is known
    if constexpr (kVecs >= 1 && kVecs <= 4) {
      // A head's vectors held in registers across the tile: each row's vectors are loaded once,
      // with one broadcast of the weight for all of them (about 5% of the forward at C=32).
      for (int64_t h = 0; h < H; ++h) {
        acc_t* ah = acc + h * kC;
        vec a[kVecs];
        for (int v = 0; v < kVecs; ++v) a[v] = cpu::load_wide(ah + v * kLanes);
        for (int t = 0; t < nt; ++t) {
          const acc_t wt = w[t * H + h];
          const acc_t* xh = rows[t] + h * kC;
          for (int v = 0; v < kVecs; ++v) a[v] += wt * cpu::load_wide(xh + v * kLanes);
        }
        for (int v = 0; v < kVecs; ++v) cpu::store_wide(ah + v * kLanes, a[v]);
      }
      return;
    }
    if (C % kLanes == 0) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t f = h * C; f < (h + 1) * C; f += kLanes) {
          vec a = cpu::load_wide(acc + f);
          for (int t = 0; t < nt; ++t) a += w[t * H + h] * cpu::load_wide(rows[t] + f);
          cpu::store_wide(acc + f, a);
        }
      }
      return;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    acc_t* __restrict__ ah = acc + h * C;
    for (int t = 0; t < nt; ++t) {
      const acc_t wt = w[t * H + h];
      const T* __restrict__ xh = rows[t] + h * C;
      for (int64_t c = 0; c < C; ++c) ah[c] += wt * static_cast<acc_t>(xh[c]);
    }
  }
}

template <typename acc_t, typename T>
inline void accumulate_tile(acc_t* acc, const T* const* rows, const acc_t* w, int nt, int64_t H, int64_t C) {
  with_head_width(C, [&](auto kC) { accumulate_tile_c<acc_t, T, decltype(kC)::value>(acc, rows, w, nt, H, C); });
}

template <typename scalar_t, typename index_t>
void forward_kernel(const Gatv2ForwardArgs& a, double negative_slope, double dropout_scale, at::Tensor& out,
                    at::Tensor& lse, at::Tensor* alpha) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_src = a.x_src.size(0), H = a.x_src.size(1), C = a.x_src.size(2), HC = H * C;
  const int64_t num_dst = a.x_dst.size(0), E = a.indices.numel(), K = a.edge_dim;
  const Gatv2EdgeMode mode = a.edge_mode;
  const scalar_t* xs = a.x_src.data_ptr<scalar_t>();
  const scalar_t* xd = a.x_dst.data_ptr<scalar_t>();
  const scalar_t* ea = a.edge_attr.defined() ? a.edge_attr.data_ptr<scalar_t>() : nullptr;
  const bool* mk = a.dropout_mask.defined() ? a.dropout_mask.data_ptr<bool>() : nullptr;
  const index_t* ptr = a.indptr.data_ptr<index_t>();
  const index_t* idx = a.indices.data_ptr<index_t>();
  const index_t* ea_rows = a.edge_attr_rows.defined() ? a.edge_attr_rows.data_ptr<index_t>() : nullptr;
  const int64_t num_rows = a.edge_attr.defined() ? a.edge_attr.size(0) : 0;
  scalar_t* o = out.data_ptr<scalar_t>();
  double* lse_p = lse.data_ptr<double>();
  scalar_t* al = alpha ? alpha->data_ptr<scalar_t>() : nullptr;
  const std::vector<acc_t> att_v = to_acc_vector<acc_t, scalar_t>(a.att);
  const std::vector<acc_t> w_v = to_acc_vector<acc_t, scalar_t>(a.edge_weight);
  const acc_t* att = att_v.data();
  const acc_t* w = w_v.data();
  const acc_t slope = static_cast<acc_t>(negative_slope);
  const acc_t keep_scale = static_cast<acc_t>(dropout_scale);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  check_ptr_ends(ptr, num_dst, E, "indptr");

  // Scalars captured by value: through the lambda's references GCC does not vectorise the head
  // loops (it cannot tell the stores from them).
  parallel_over_rows(ptr, num_dst, HC * (2 + K),
                   [&, slope, keep_scale, neg_inf, H, C, HC, K, mode](int64_t begin, int64_t end) {
    EdgeProjector<acc_t, scalar_t, index_t> proj(ea, w, K, HC, E, E, nullptr, ea_rows, num_rows, mode);
    // Per tile of up to kTile edges: score holds their [t, h] scores; ex holds the H rescale
    // factors then the [t, h] edge weights, so that one exp call serves the whole tile.
    std::vector<acc_t> acc(HC), xdi(HC), z(HC), run_max(H), run_sum(H), score(kTile * H), ex(H + kTile * H);
    acc_t* rescale = ex.data();
    acc_t* weight = ex.data() + H;
    const scalar_t* rows[kTile];
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(run_max.begin(), run_max.end(), neg_inf);
      std::fill(run_sum.begin(), run_sum.end(), acc_t(0));
      for (int64_t f = 0; f < HC; ++f) xdi[f] = static_cast<acc_t>(xd[i * HC + f]);
      const int64_t e0 = ptr[i], e1 = ptr[i + 1];
      TORCH_CHECK(e0 <= e1 && e0 >= 0 && e1 <= E, "indptr must be non-decreasing and within [0, E]");
      for (int64_t t0 = e0; t0 < e1; t0 += kTile) {
        const int nt = static_cast<int>(std::min<int64_t>(kTile, e1 - t0));
        // The tile's scores, edge after edge: independent of each other, so their row loads
        // overlap (with the prefetches of the rows kPrefetchDistance edges ahead).
        for (int t = 0; t < nt; ++t) {
          const int64_t e = t0 + t;
          const int64_t j = idx[e];
          TORCH_CHECK(j >= 0 && j < num_src, "indices: source id ", j, " out of range [0, ", num_src, ")");
          const scalar_t* ahead = nullptr;  // the row kPrefetchDistance edges on, to prefetch
          if (e + kPrefetchDistance < E) {
            const int64_t jn = idx[e + kPrefetchDistance];
            if (jn >= 0 && jn < num_src) ahead = xs + jn * HC;
            proj.prefetch_direct(e + kPrefetchDistance);
          }
          const scalar_t* xj = xs + j * HC;
          rows[t] = xj;
          acc_t* st = score.data() + t * H;
          if constexpr (std::is_same<scalar_t, acc_t>::value) {
            if (mode == Gatv2EdgeMode::kNone) {
              head_scores_rows<acc_t, false>(xj, xdi.data(), nullptr, att, slope, st, H, C, ahead);
            } else {
              const acc_t* ep = mode == Gatv2EdgeMode::kDirect ? ea + proj.attr_row(e) * HC : proj.row(e);
              head_scores_rows<acc_t, true>(xj, xdi.data(), ep, att, slope, st, H, C, ahead);
            }
          } else {
            if (ahead) prefetch_row(ahead, HC);
            proj.preact(z.data(), xj, xdi.data(), e);
            head_scores(z.data(), att, slope, st, H, C);
          }
        }
        // Online softmax, one step per tile for all heads: the new maximum over the tile, the
        // old sums' rescale factor exp(old_max - new_max) and the weights exp(s - new_max).
        softmax_tile_exponents(score.data(), nt, H, run_max.data(), ex.data());
        exp_inplace(ex.data(), H + nt * H);
        softmax_tile_sums(weight, rescale, nt, H, run_sum.data());
        for (int64_t h = 0; h < H; ++h) {
          const acc_t r = rescale[h];
          if (r != acc_t(1)) {  // rare after the first tile: the maximum settles
            acc_t* ah = acc.data() + h * C;
            for (int64_t c = 0; c < C; ++c) ah[c] *= r;
          }
        }
        if (mk) {
          for (int t = 0; t < nt; ++t) {
            for (int64_t h = 0; h < H; ++h) {
              acc_t& p = weight[t * H + h];
              p = mk[(t0 + t) * H + h] ? p * keep_scale : acc_t(0);
            }
          }
        }
        accumulate_tile(acc.data(), rows, weight, nt, H, C);
      }
      const bool empty = e0 == e1;
      for (int64_t h = 0; h < H; ++h) {
        const acc_t inv = empty ? acc_t(0) : acc_t(1) / run_sum[h];
        scalar_t* oi = o + i * HC + h * C;
        const acc_t* ah = acc.data() + h * C;
        for (int64_t c = 0; c < C; ++c) oi[c] = static_cast<scalar_t>(ah[c] * inv);
        lse_p[i * H + h] = lse_of(run_max[h], run_sum[h]);
      }
      if (al) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t j = idx[e];
          proj.preact(z.data(), xs + j * HC, xdi.data(), e);
          head_scores(z.data(), att, slope, score.data(), H, C);
          // exp(s - max) / sum, not exp(s - lse): at large scores lse's rounding swamps the log-sum
          for (int64_t h = 0; h < H; ++h) weight[h] = score[h] - run_max[h];
          exp_inplace(weight, H);
          for (int64_t h = 0; h < H; ++h) {
            acc_t p = weight[h] / run_sum[h];
            if (mk) p = mk[e * H + h] ? p * keep_scale : acc_t(0);
            al[e * H + h] = static_cast<scalar_t>(p);
          }
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gatv2_forward_cpu(
    const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att, const c10::optional<at::Tensor>& edge_attr,
    const c10::optional<at::Tensor>& edge_weight, const at::Tensor& indptr, const at::Tensor& indices,
    const c10::optional<at::Tensor>& dropout_mask, double negative_slope, double dropout_scale, bool return_alpha,
    const c10::optional<at::Tensor>& edge_attr_rows) {
  const auto a = prepare_gatv2_forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask,
                                       dropout_scale, edge_attr_rows);
  at::Tensor out, lse, alpha;
  std::tie(out, lse, alpha) = allocate_gatv2_outputs(a, return_alpha);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x_src.scalar_type(), "gatv2_forward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "gatv2_forward_cpu_index", [&] {
      forward_kernel<scalar_t, index_t>(a, negative_slope, dropout_scale, out, lse, return_alpha ? &alpha : nullptr);
    });
  });
  return {out, lse, alpha};
}

// edge_attr_rows must name each row at most once where edge_attr's gradient is written through it:
// a row named twice would get two writes (the last wins, which is neither the sum nor
// deterministic across threads). One pass over a byte per row.
template <typename index_t>
void check_distinct_rows(const index_t* rows, int64_t E, int64_t num_rows) {
  std::vector<uint8_t> seen(num_rows, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r = rows[e];
    TORCH_CHECK(r >= 0 && r < num_rows, "edge_attr_rows: row ", r, " out of range [0, ", num_rows, ")");
    TORCH_CHECK(!seen[r], "edge_attr_rows must name distinct rows of edge_attr when its gradient is wanted; row ",
                r, " appears twice");
    seen[r] = 1;
  }
}

template <typename scalar_t, typename index_t>
void backward_kernel(const Gatv2BackwardArgs& b, double negative_slope, double dropout_scale, at::Tensor& gxs_t,
                     at::Tensor& gxd_t, at::Tensor& gatt_t, at::Tensor& gea_t, at::Tensor& gw_t) {
  using acc_t = at::opmath_type<scalar_t>;
  const Gatv2ForwardArgs& a = b.fwd;
  const int64_t num_src = a.x_src.size(0), H = a.x_src.size(1), C = a.x_src.size(2), HC = H * C;
  const int64_t num_dst = a.x_dst.size(0), E = a.indices.numel(), K = a.edge_dim;
  const Gatv2EdgeMode mode = a.edge_mode;
  const bool want_xs = b.want_x_src, want_xd = b.want_x_dst, want_att = b.want_att;
  const bool want_ea = b.want_edge_attr, want_w = b.want_edge_weight;
  const scalar_t* g = b.grad_out.data_ptr<scalar_t>();
  const scalar_t* ga = b.grad_alpha.defined() ? b.grad_alpha.data_ptr<scalar_t>() : nullptr;
  const scalar_t* o = b.out.data_ptr<scalar_t>();
  const double* lse_p = b.lse.data_ptr<double>();
  const scalar_t* xs = a.x_src.data_ptr<scalar_t>();
  const scalar_t* xd = a.x_dst.data_ptr<scalar_t>();
  const scalar_t* ea = a.edge_attr.defined() ? a.edge_attr.data_ptr<scalar_t>() : nullptr;
  const bool* mk = a.dropout_mask.defined() ? a.dropout_mask.data_ptr<bool>() : nullptr;
  const index_t* ptr = a.indptr.data_ptr<index_t>();
  const index_t* idx = a.indices.data_ptr<index_t>();
  const index_t* ea_rows = a.edge_attr_rows.defined() ? a.edge_attr_rows.data_ptr<index_t>() : nullptr;
  const int64_t num_rows = a.edge_attr.defined() ? a.edge_attr.size(0) : 0;
  if (want_ea && ea_rows) check_distinct_rows(ea_rows, E, num_rows);
  const std::vector<acc_t> att_v = to_acc_vector<acc_t, scalar_t>(a.att);
  const std::vector<acc_t> w_v = to_acc_vector<acc_t, scalar_t>(a.edge_weight);
  const acc_t* att = att_v.data();
  const acc_t* w = w_v.data();
  const acc_t slope = static_cast<acc_t>(negative_slope);
  const acc_t keep_scale = static_cast<acc_t>(dropout_scale);
  const auto acc_opts = a.x_src.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  check_ptr_ends(ptr, num_dst, E, "indptr");
  check_ptr_ends(b.rev_indptr.data_ptr<index_t>(), num_src, E, "rev_indptr");

  const int64_t att_part = want_att ? HC : 0;
  const int64_t partial_size = att_part + (want_w ? K * HC : 0);
  const std::vector<int64_t> bounds = chunk_bounds(ptr, num_dst, E, partial_size);
  const int64_t n_chunks = static_cast<int64_t>(bounds.size()) - 1;

  // grad x_src: scattered in pass 1 into one partial per group of chunks (the first partial is
  // the gradient itself when it has the accumulation type), or computed by pass 2.
  constexpr bool kOwnFirst = std::is_same<scalar_t, acc_t>::value;
  const int64_t n_groups = want_xs ? scatter_groups(num_src, HC, E, H, n_chunks, kOwnFirst) : 0;
  const bool pass2 = want_xs && n_groups == 0;
  at::Tensor sx_t;
  std::vector<acc_t*> sx_parts(n_groups, nullptr);
  if (n_groups) {  // (each group's task zeroes its partial: in parallel, and first touched by its thread)
    sx_t = at::empty({kOwnFirst ? n_groups - 1 : n_groups, num_src, HC}, acc_opts);
    for (int64_t grp = 0; grp < n_groups; ++grp) {
      sx_parts[grp] = kOwnFirst && grp == 0 ? reinterpret_cast<acc_t*>(gxs_t.data_ptr())
                                            : sx_t.data_ptr<acc_t>() + (grp - (kOwnFirst ? 1 : 0)) * num_src * HC;
    }
  }
  // Pass 1's tasks: task t runs chunks [task_bounds[t], task_bounds[t + 1]) in order (a group, or one chunk).
  std::vector<int64_t> task_bounds;
  for (int64_t t = 0; t <= (n_groups ? n_groups : n_chunks); ++t) {
    task_bounds.push_back(n_groups ? t * n_chunks / n_groups : t);
  }
  const int64_t n_tasks = static_cast<int64_t>(task_bounds.size()) - 1;

  // [E,H] workspaces for pass 2: ds and alpha after dropout.
  at::Tensor ds_t = pass2 ? at::empty({E, H}, acc_opts) : at::Tensor();
  at::Tensor aw_t = pass2 ? at::empty({E, H}, acc_opts) : at::Tensor();
  acc_t* ds_ws = pass2 ? ds_t.data_ptr<acc_t>() : nullptr;
  acc_t* aw_ws = pass2 ? aw_t.data_ptr<acc_t>() : nullptr;
  scalar_t* gxd = want_xd ? gxd_t.data_ptr<scalar_t>() : nullptr;
  scalar_t* gea = want_ea ? gea_t.data_ptr<scalar_t>() : nullptr;
  at::Tensor partial_t = partial_size ? at::zeros({n_chunks, partial_size}, acc_opts) : at::Tensor();
  acc_t* partial = partial_size ? partial_t.data_ptr<acc_t>() : nullptr;

  // grad edge_attr of projected features comes from dz @ W^T, per tile of edges from W^T padded
  // to whole vectors (see edge_attr_grad_tile).
  const bool project = mode == Gatv2EdgeMode::kProject;
  const bool want_ea_proj = want_ea && project;
  constexpr int kLanes = cpu::VecWide<acc_t>::kLanes;
  const int64_t Kp = (K + kLanes - 1) / kLanes * kLanes;
  std::vector<acc_t> wT(want_ea_proj ? HC * Kp : 0, acc_t(0));
  for (int64_t k = 0; k < (want_ea_proj ? K : 0); ++k) {
    for (int64_t f = 0; f < HC; ++f) wT[f * Kp + k] = w[k * HC + f];
  }
  // Edges whose dz rows are kept in a tile for the grad edge_weight / edge_attr products.
  const bool batch_edges = want_w || want_ea_proj;

  // Pass 1, per destination in fixed chunks (each chunk's partial is its own; a group's x_src
  // partial is its own too).
  at::parallel_for(0, n_tasks, 1, [&, slope, keep_scale, H, C, HC, K, Kp, mode](int64_t tbegin, int64_t tend) {
    EdgeProjector<acc_t, scalar_t, index_t> proj(ea, w, K, HC, E, E, nullptr, ea_rows, num_rows, mode);
    std::vector<acc_t> xdi(HC), z(HC), dz(HC), gxd_acc(HC);
    // The last few edges (in order; flushed every kTile edges and at each chunk's end, so the
    // batches depend on the graph only): their dz rows, edge_attr rows and those rows' ids.
    std::vector<acc_t> dz_batch(batch_edges ? kTile * HC : 0), ea_batch(want_w ? kTile * K : 0);
    std::vector<acc_t> gea_tile(want_ea_proj ? kTile * Kp : 0);
    int64_t batch_row[kTile];
    int n_batch = 0;
    auto flush_batch = [&](acc_t* pw) {
      if (n_batch == 0) return;
      std::fill(dz_batch.begin() + n_batch * HC, dz_batch.end(), acc_t(0));
      if (pw) {
        std::fill(ea_batch.begin() + n_batch * K, ea_batch.end(), acc_t(0));
        add_weight_grad_batch(pw, ea_batch.data(), dz_batch.data(), K, HC);
      }
      if (want_ea_proj) {
        edge_attr_grad_tile(gea_tile.data(), dz_batch.data(), wT.data(), Kp, HC);
        for (int b = 0; b < n_batch; ++b) {
          for (int64_t k = 0; k < K; ++k) gea[batch_row[b] * K + k] = static_cast<scalar_t>(gea_tile[b * Kp + k]);
        }
      }
      n_batch = 0;
    };
    std::vector<acc_t> score(H), alphas(H), keeps(H), dots(H), D(H), ds(H), aw(H), lse_hi(H), lse_lo(H);
    for (int64_t task = tbegin; task < tend; ++task) {
    acc_t* sx = n_groups ? sx_parts[task] : nullptr;
    if (sx) std::fill(sx, sx + num_src * HC, acc_t(0));
    for (int64_t chunk = task_bounds[task]; chunk < task_bounds[task + 1]; ++chunk) {
      acc_t* patt = want_att ? partial + chunk * partial_size : nullptr;
      acc_t* pw = want_w ? partial + chunk * partial_size + att_part : nullptr;
      for (int64_t i = bounds[chunk]; i < bounds[chunk + 1]; ++i) {
        const int64_t e0 = ptr[i], e1 = ptr[i + 1];
        TORCH_CHECK(e0 <= e1 && e0 >= 0 && e1 <= E, "indptr must be non-decreasing and within [0, E]");
        if (e0 == e1) {
          if (gxd) std::fill(gxd + i * HC, gxd + (i + 1) * HC, scalar_t(0));
          continue;
        }
        for (int64_t f = 0; f < HC; ++f) xdi[f] = static_cast<acc_t>(xd[i * HC + f]);
        const scalar_t* gi = g + i * HC;
        for (int64_t h = 0; h < H; ++h) split_lse(lse_p[i * H + h], lse_hi[h], lse_lo[h]);
        for (int64_t h = 0; h < H; ++h) D[h] = dot<acc_t>(gi + h * C, o + i * HC + h * C, C);
        if (ga) {  // attention weights used directly: D gains sum_e A_e * dL/dA_e
          for (int64_t e = e0; e < e1; ++e) {
            const int64_t j = idx[e];
            TORCH_CHECK(j >= 0 && j < num_src, "indices: source id ", j, " out of range [0, ", num_src, ")");
            proj.preact(z.data(), xs + j * HC, xdi.data(), e);
            head_scores(z.data(), att, slope, score.data(), H, C);
            for (int64_t h = 0; h < H; ++h) alphas[h] = (score[h] - lse_hi[h]) - lse_lo[h];
            exp_inplace(alphas.data(), H);
            for (int64_t h = 0; h < H; ++h) {
              const acc_t keep = mk ? (mk[e * H + h] ? keep_scale : acc_t(0)) : acc_t(1);
              D[h] += alphas[h] * keep * static_cast<acc_t>(ga[e * H + h]);
            }
          }
        }
        if (gxd) std::fill(gxd_acc.begin(), gxd_acc.end(), acc_t(0));
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t j = idx[e];
          TORCH_CHECK(j >= 0 && j < num_src, "indices: source id ", j, " out of range [0, ", num_src, ")");
          if (e + kPrefetchDistance < E) {
            const int64_t jn = idx[e + kPrefetchDistance];
            if (jn >= 0 && jn < num_src) {
              prefetch_row(xs + jn * HC, HC);
              if (sx) prefetch_row(sx + jn * HC, HC);
            }
            proj.prefetch_direct(e + kPrefetchDistance);
          }
          const scalar_t* xj = xs + j * HC;
          proj.preact(z.data(), xj, xdi.data(), e);
          head_scores(z.data(), att, slope, score.data(), H, C);
          for (int64_t h = 0; h < H; ++h) alphas[h] = (score[h] - lse_hi[h]) - lse_lo[h];
          exp_inplace(alphas.data(), H);
          if (mk) {
            for (int64_t h = 0; h < H; ++h) keeps[h] = mk[e * H + h] ? keep_scale : acc_t(0);
          } else {
            for (int64_t h = 0; h < H; ++h) keeps[h] = acc_t(1);
          }
          for (int64_t h = 0; h < H; ++h) dots[h] = dot<acc_t>(gi + h * C, xj + h * C, C);
          for (int64_t h = 0; h < H; ++h) {
            acc_t dA = dots[h];
            if (ga) dA += static_cast<acc_t>(ga[e * H + h]);
            ds[h] = alphas[h] * (dA * keeps[h] - D[h]);
          }
          if (ds_ws) {
            for (int64_t h = 0; h < H; ++h) {
              ds_ws[e * H + h] = ds[h];
              aw_ws[e * H + h] = alphas[h] * keeps[h];
            }
          }
          // One sweep for every gradient asked for; a dz row is kept for the edge features' products.
          acc_t* dzr = batch_edges ? dz_batch.data() + n_batch * HC : dz.data();
          if (sx) {
            for (int64_t h = 0; h < H; ++h) aw[h] = alphas[h] * keeps[h];
          }
          add_edge_grads_any<acc_t, scalar_t>(patt, gxd ? gxd_acc.data() : nullptr, want_ea || want_w ? dzr : nullptr,
                                              sx ? sx + j * HC : nullptr, z.data(), att, ds.data(), aw.data(), gi,
                                              slope, H, C);
          if (gea && mode == Gatv2EdgeMode::kDirect) {
            scalar_t* gr = gea + proj.attr_row(e) * HC;
            for (int64_t f = 0; f < HC; ++f) gr[f] = static_cast<scalar_t>(dzr[f]);
          }
          if (batch_edges) {
            const int64_t r = proj.attr_row(e);
            if (pw) {
              for (int64_t k = 0; k < K; ++k) ea_batch[n_batch * K + k] = static_cast<acc_t>(ea[r * K + k]);
            }
            batch_row[n_batch] = r;
            if (++n_batch == kTile) flush_batch(pw);
          }
        }
        if (gxd) {
          for (int64_t f = 0; f < HC; ++f) gxd[i * HC + f] = static_cast<scalar_t>(gxd_acc[f]);
        }
      }
      if (batch_edges) flush_batch(pw);  // a chunk's batch ends with it: the flush points are fixed
    }
    }
  });

  // The x_src partials, summed in group order (nothing to do when the gradient is the only one).
  if (n_groups && !(kOwnFirst && n_groups == 1)) {
    scalar_t* gxs = gxs_t.data_ptr<scalar_t>();
    at::parallel_for(0, num_src * HC, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t f = begin; f < end; ++f) {
        acc_t v = sx_parts[0][f];
        for (int64_t grp = 1; grp < n_groups; ++grp) v += sx_parts[grp][f];
        gxs[f] = static_cast<scalar_t>(v);
      }
    });
  }

  // The partials, summed over the chunks in chunk order.
  if (partial) {
    scalar_t* gatt = want_att ? gatt_t.data_ptr<scalar_t>() : nullptr;
    scalar_t* gw = want_w ? gw_t.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, partial_size, 2048, [&](int64_t begin, int64_t end) {
      for (int64_t f = begin; f < end; ++f) {
        acc_t s = 0;
        for (int64_t c = 0; c < n_chunks; ++c) s += partial[c * partial_size + f];
        if (f < att_part) {
          gatt[f] = static_cast<scalar_t>(s);
        } else {
          gw[f - att_part] = static_cast<scalar_t>(s);
        }
      }
    });
  }

  // Pass 2, per source over the reverse index: grad x_src = sum over its edges of A*g_i + dz,
  // with z recomputed (x_dst[i] and the edge term) and ds, A from the workspaces.
  if (pass2) {
    scalar_t* gxs = gxs_t.data_ptr<scalar_t>();
    const index_t* rptr = b.rev_indptr.data_ptr<index_t>();
    const index_t* redge = b.rev_edge.data_ptr<index_t>();
    const index_t* rdst = b.rev_dst.data_ptr<index_t>();
    parallel_over_rows(rptr, num_src, HC * (2 + K),
                     [&, slope, H, C, HC, K, mode](int64_t begin, int64_t end) {
      // Positions k of the reverse index hold edges redge[k]: tiles of projected rows by position.
      EdgeProjector<acc_t, scalar_t, index_t> proj(ea, w, K, HC, E, E, redge, ea_rows, num_rows, mode);
      std::vector<acc_t> accx(HC), z(HC), aw(H), dsh(H);
      for (int64_t j = begin; j < end; ++j) {
        std::fill(accx.begin(), accx.end(), acc_t(0));
        const scalar_t* xj = xs + j * HC;
        const int64_t k0 = rptr[j], k1 = rptr[j + 1];
        TORCH_CHECK(k0 <= k1 && k0 >= 0 && k1 <= E, "rev_indptr must be non-decreasing and within [0, E]");
        for (int64_t k = k0; k < k1; ++k) {
          const int64_t e = redge[k], i = rdst[k];
          TORCH_CHECK(e >= 0 && e < E && i >= 0 && i < num_dst, "reverse index entry out of range");
          if (k + kPrefetchDistance < E) {
            const int64_t in = rdst[k + kPrefetchDistance], en = redge[k + kPrefetchDistance];
            if (in >= 0 && in < num_dst) {
              prefetch_row(g + in * HC, HC);
              prefetch_row(xd + in * HC, HC);
            }
            if (en >= 0 && en < E) {
              __builtin_prefetch(ds_ws + en * H);
              __builtin_prefetch(aw_ws + en * H);
            }
            proj.prefetch_direct(k + kPrefetchDistance);
          }
          for (int64_t h = 0; h < H; ++h) {
            aw[h] = aw_ws[e * H + h];
            dsh[h] = ds_ws[e * H + h];
          }
          if constexpr (std::is_same<scalar_t, acc_t>::value) {
            if (mode == Gatv2EdgeMode::kNone) {
              add_src_grad_rows<acc_t, false>(accx.data(), xj, xd + i * HC, nullptr, att, g + i * HC, aw.data(),
                                              dsh.data(), slope, H, C);
            } else {
              const acc_t* ep = project ? proj.row(k) : ea + proj.attr_row(e) * HC;
              add_src_grad_rows<acc_t, true>(accx.data(), xj, xd + i * HC, ep, att, g + i * HC, aw.data(),
                                             dsh.data(), slope, H, C);
            }
            continue;
          }
          proj.preact(z.data(), xj, xd + i * HC, k);
          add_src_grad(accx.data(), z.data(), att, g + i * HC, aw.data(), dsh.data(), slope, H, C);
        }
        for (int64_t f = 0; f < HC; ++f) gxs[j * HC + f] = static_cast<scalar_t>(accx[f]);
      }
    });
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_backward_cpu(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
    const c10::optional<at::Tensor>& edge_attr, const c10::optional<at::Tensor>& edge_weight,
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
    const at::Tensor& rev_dst, const c10::optional<at::Tensor>& dropout_mask, double negative_slope,
    double dropout_scale, std::array<bool, 5> output_mask, const c10::optional<at::Tensor>& edge_attr_rows) {
  const auto b = prepare_gatv2_backward(grad_out, grad_alpha, out, lse, x_src, x_dst, att, edge_attr, edge_weight,
                                        indptr, indices, rev_indptr, rev_edge, rev_dst, dropout_mask, dropout_scale,
                                        output_mask, edge_attr_rows);
  at::Tensor gxs, gxd, gatt, gea, gw;
  std::tie(gxs, gxd, gatt, gea, gw) = allocate_gatv2_gradients(b);
  if (!b.any()) return {gxs, gxd, gatt, gea, gw};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.fwd.x_src.scalar_type(), "gatv2_backward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(b.fwd.indices.scalar_type(), "gatv2_backward_cpu_index", [&] {
      backward_kernel<scalar_t, index_t>(b, negative_slope, dropout_scale, gxs, gxd, gatt, gea, gw);
    });
  });
  return {gxs, gxd, gatt, gea, gw};
}

}  // namespace
}  // namespace torch_gradops

TORCH_LIBRARY_IMPL(torch_gradops, CPU, m) {
  m.impl("gatv2_forward", &torch_gradops::gatv2_forward_cpu);
  m.impl("gatv2_backward", &torch_gradops::gatv2_backward_cpu);
}
