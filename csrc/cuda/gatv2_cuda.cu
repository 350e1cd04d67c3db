// CUDA kernels for the fused GATv2 ops (schemas and the math in ../gatv2.h, ../gatv2.cpp; CPU
// twins in ../cpu/gatv2_cpu.cpp).
//
// A score s[e,h] = sum_c att[h,c] * leaky_relu(z[e,h,c]) is always computed by one warp, lanes
// over channels (c = lane, lane + 32, ...) and a fixed butterfly reduction, so every kernel that
// needs it gets the same value and all lanes hold it (warp-uniform control flow).
//
// Forward: a warp per (destination, head, block of kChannelBlock channels); it walks the
// destination's incoming edges once with an online softmax; each lane accumulates kPerLane
// channels of the output. Channel blocks beyond the first (C > 128) recompute the score.
//
// Backward, without atomics and in a fixed order (bitwise reproducible run to run):
//   dst:    a warp per (destination, head, channel block): D, then per edge alpha, dalpha, ds;
//           ds and alpha-after-dropout to [E,H] workspaces; grad x_dst = sum of dz; grad
//           edge_attr = dz when the edge features come already projected;
//   params: a warp per (fixed edge chunk, 32 features, 8 edge dims): per-chunk partials of
//           grad att = sum ds*leaky_relu(z) and grad edge_weight = sum edge_attr*dz, then a
//           kernel sums the partials over the chunks in chunk order;
//   edge:   a warp per destination, lanes over edge dims: grad edge_attr = dz W^T (projected);
//   src:    a thread per (source, feature) over the source-grouped reverse index: grad x_src.
// z is recomputed wherever it is needed; nothing of size E x H x C is stored. All offsets that
// scale with nodes x features or edges are 64-bit.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "../gatv2.h"
#include "kernel_utils.cuh"

namespace torch_gradops {
namespace {

using namespace cuda_kernels;

constexpr int kPerLane = 4;                           // output channels per lane
constexpr int64_t kChannelBlock = kWarp * kPerLane;   // channels per warp
constexpr int kEdgeDimBlock = 8;                      // edge_weight rows per warp (params kernel)
constexpr int64_t kMaxChunks = 1024;                  // edge chunks of the params kernel
constexpr int64_t kPartialBudget = int64_t(1) << 23;  // partial values in all

// The read-only inputs every kernel needs to form z[e, f] = x_src[j, f] + x_dst[i, f] + ep[e, f].
template <typename scalar_t, typename index_t>
struct Preact {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* __restrict__ xs;
  const scalar_t* __restrict__ xd;
  const scalar_t* __restrict__ att;
  const scalar_t* __restrict__ ea;
  const scalar_t* __restrict__ w;
  const index_t* __restrict__ rows;  // edge_attr_rows, or null: edge e reads row e
  int mode;  // Gatv2EdgeMode
  int64_t H, C, HC, K, num_rows;
  acc_t slope;

  // The row of edge_attr that edge e (a CSC position) reads.
  __device__ __forceinline__ int64_t attr_row(int64_t e) const {
    if (!rows) return e;
    const int64_t r = rows[e];
    CUDA_KERNEL_ASSERT(r >= 0 && r < num_rows && "edge_attr_rows: row out of range");
    return r;
  }
  __device__ __forceinline__ acc_t edge_term(int64_t e, int64_t f) const {
    if (mode == static_cast<int>(Gatv2EdgeMode::kProject)) {
      acc_t r = 0;
      const scalar_t* er = ea + attr_row(e) * K;
      for (int64_t k = 0; k < K; ++k) r += static_cast<acc_t>(er[k]) * static_cast<acc_t>(w[k * HC + f]);
      return r;
    }
    if (mode == static_cast<int>(Gatv2EdgeMode::kDirect)) return static_cast<acc_t>(ea[attr_row(e) * HC + f]);
    return acc_t(0);
  }
  __device__ __forceinline__ acc_t z(int64_t j, int64_t i, int64_t e, int64_t f) const {
    return (static_cast<acc_t>(xs[j * HC + f]) + static_cast<acc_t>(xd[i * HC + f])) + edge_term(e, f);
  }
  __device__ __forceinline__ acc_t lrelu(acc_t v) const { return v > acc_t(0) ? v : v * slope; }
  __device__ __forceinline__ acc_t lrelu_grad(acc_t v) const { return v > acc_t(0) ? acc_t(1) : slope; }
  // The score of edge e (source j, destination i) for head h; the whole warp must call it.
  __device__ __forceinline__ acc_t score(int64_t j, int64_t i, int64_t e, int64_t h, int lane) const {
    acc_t part = 0;
    for (int64_t c = lane; c < C; c += kWarp) {
      const int64_t f = h * C + c;
      part += static_cast<acc_t>(att[f]) * lrelu(z(j, i, e, f));
    }
    return warp_sum(part);
  }
  // The scores of two edges (ea from source ja, eb from jb) for head h, their loads interleaved;
  // each summed exactly as score() sums it. The whole warp must call it.
  __device__ __forceinline__ void score2(int64_t ja, int64_t ea_, int64_t jb, int64_t eb, int64_t i, int64_t h,
                                         int lane, acc_t& sa, acc_t& sb) const {
    acc_t pa = 0, pb = 0;
    for (int64_t c = lane; c < C; c += kWarp) {
      const int64_t f = h * C + c;
      pa += static_cast<acc_t>(att[f]) * lrelu(z(ja, i, ea_, f));
      pb += static_cast<acc_t>(att[f]) * lrelu(z(jb, i, eb, f));
    }
    sa = warp_sum(pa);
    sb = warp_sum(pb);
  }
};

// kEdgeBatch 2: the scores of two edges at a time (score2), so that two edges' row gathers and
// warp reductions are in flight together instead of one dependent chain per edge; the edges are
// folded into the online softmax in the same order, so the results are the same bits as with 1.
template <typename scalar_t, typename index_t, int kEdgeBatch>
__global__ void gatv2_forward_kernel(Preact<scalar_t, index_t> P, const bool* __restrict__ mk,
                                     const index_t* __restrict__ ptr, const index_t* __restrict__ idx,
                                     scalar_t* __restrict__ out,
                                     double* __restrict__ lse, scalar_t* __restrict__ alpha,
                                     int64_t num_src, int64_t num_dst, int64_t E, int64_t n_cb,
                                     at::opmath_type<scalar_t> keep_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t H = P.H, C = P.C, HC = P.HC;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int64_t total = num_dst * H * n_cb;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; item < total;
       item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t i = item / (H * n_cb), h = (item / n_cb) % H, cb = item % n_cb;
    const int64_t e0 = ptr[i], e1 = ptr[i + 1];
    check_edge_range(e0, e1, i, num_dst, E);
    acc_t run_max = neg_inf, run_sum = 0, acc[kPerLane];
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) acc[v] = 0;
    auto fold = [&](int64_t e, int64_t j, acc_t s) {
      if (s > run_max) {  // rescale what was summed under the old maximum (warp-uniform)
        const acc_t r = dev_exp(run_max - s);
        run_sum *= r;
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) acc[v] *= r;
        run_max = s;
      }
      // A -inf score weighs 0, also when it comes first (run_max still -inf).
      const acc_t p = s == neg_inf ? acc_t(0) : dev_exp(s - run_max);
      run_sum += p;
      const acc_t wgt = mk ? (mk[e * H + h] ? p * keep_scale : acc_t(0)) : p;
#pragma unroll
      for (int v = 0; v < kPerLane; ++v) {
        const int64_t c = cb * kChannelBlock + v * kWarp + lane;
        if (c < C) acc[v] += wgt * static_cast<acc_t>(P.xs[j * HC + h * C + c]);
      }
    };
    if constexpr (kEdgeBatch == 2) {
      for (int64_t e = e0; e < e1; e += 2) {
        const int64_t ja = idx[e];
        CUDA_KERNEL_ASSERT(ja >= 0 && ja < num_src && "indices: source id out of range");
        if (e + 1 < e1) {  // warp-uniform: the warp shares the destination
          const int64_t jb = idx[e + 1];
          CUDA_KERNEL_ASSERT(jb >= 0 && jb < num_src && "indices: source id out of range");
          acc_t sa, sb;
          P.score2(ja, e, jb, e + 1, i, h, lane, sa, sb);
          fold(e, ja, sa);
          fold(e + 1, jb, sb);
        } else {  // an odd degree's last edge alone (score2 of it twice gathered its rows twice)
          fold(e, ja, P.score(ja, i, e, h, lane));
        }
      }
    } else {
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t j = idx[e];
        CUDA_KERNEL_ASSERT(j >= 0 && j < num_src && "indices: source id out of range");
        fold(e, j, P.score(j, i, e, h, lane));
      }
    }
    const bool empty = e0 == e1;
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) {
      const int64_t c = cb * kChannelBlock + v * kWarp + lane;
      if (c < C) out[i * HC + h * C + c] = static_cast<scalar_t>(empty ? acc_t(0) : acc[v] / run_sum);
    }
    if (cb == 0) {
      if (lane == 0) lse[i * H + h] = lse_of(run_max, run_sum);
      if (alpha) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t j = idx[e];
          // exp(s - max) / sum, not exp(s - lse): at large scores lse's rounding swamps the log-sum
          const acc_t s = P.score(j, i, e, h, lane);
          acc_t a = (s == neg_inf ? acc_t(0) : dev_exp(s - run_max)) / run_sum;
          if (mk) a = mk[e * H + h] ? a * keep_scale : acc_t(0);
          if (lane == 0) alpha[e * H + h] = static_cast<scalar_t>(a);
        }
      }
    }
  }
}

template <typename scalar_t, typename index_t>
__global__ void gatv2_backward_dst_kernel(
    Preact<scalar_t, index_t> P, const scalar_t* __restrict__ g, const scalar_t* __restrict__ ga,
    const scalar_t* __restrict__ o, const double* __restrict__ lse, const bool* __restrict__ mk,
    const index_t* __restrict__ ptr, const index_t* __restrict__ idx, at::opmath_type<scalar_t>* __restrict__ ds_ws,
    at::opmath_type<scalar_t>* __restrict__ aw_ws, scalar_t* __restrict__ gxd, scalar_t* __restrict__ gea_direct,
    int64_t num_src, int64_t num_dst, int64_t E, int64_t n_cb, at::opmath_type<scalar_t> keep_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t H = P.H, C = P.C, HC = P.HC;
  const int64_t total = num_dst * H * n_cb;
  const bool need_dz = gxd || gea_direct;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; item < total;
       item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t i = item / (H * n_cb), h = (item / n_cb) % H, cb = item % n_cb;
    const int64_t e0 = ptr[i], e1 = ptr[i + 1];
    check_edge_range(e0, e1, i, num_dst, E);
    acc_t l_hi, l_lo;  // exp((s - l_hi) - l_lo): see kLseType
    split_lse(lse[i * H + h], l_hi, l_lo);
    const scalar_t* gih = g + i * HC + h * C;
    acc_t part = 0;
    for (int64_t c = lane; c < C; c += kWarp)
      part += static_cast<acc_t>(gih[c]) * static_cast<acc_t>(o[i * HC + h * C + c]);
    acc_t D = warp_sum(part);
    if (ga) {  // attention weights used directly: D gains sum_e A_e * dL/dA_e (edge order)
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t j = idx[e];
        CUDA_KERNEL_ASSERT(j >= 0 && j < num_src && "indices: source id out of range");
        acc_t a = dev_exp((P.score(j, i, e, h, lane) - l_hi) - l_lo);
        if (mk) a = mk[e * H + h] ? a * keep_scale : acc_t(0);
        D += a * static_cast<acc_t>(ga[e * H + h]);
      }
    }
    acc_t gacc[kPerLane];
#pragma unroll
    for (int v = 0; v < kPerLane; ++v) gacc[v] = 0;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t j = idx[e];
      CUDA_KERNEL_ASSERT(j >= 0 && j < num_src && "indices: source id out of range");
      const acc_t alpha = dev_exp((P.score(j, i, e, h, lane) - l_hi) - l_lo);
      const acc_t keep = mk ? (mk[e * H + h] ? keep_scale : acc_t(0)) : acc_t(1);
      acc_t dpart = 0;
      for (int64_t c = lane; c < C; c += kWarp)
        dpart += static_cast<acc_t>(gih[c]) * static_cast<acc_t>(P.xs[j * HC + h * C + c]);
      acc_t dA = warp_sum(dpart);
      if (ga) dA += static_cast<acc_t>(ga[e * H + h]);
      const acc_t ds = alpha * (dA * keep - D);
      if (cb == 0 && lane == 0) {
        if (ds_ws) ds_ws[e * H + h] = ds;
        if (aw_ws) aw_ws[e * H + h] = alpha * keep;
      }
      if (need_dz) {
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) {
          const int64_t c = cb * kChannelBlock + v * kWarp + lane;
          if (c < C) {
            const int64_t f = h * C + c;
            const acc_t dz = ds * static_cast<acc_t>(P.att[f]) * P.lrelu_grad(P.z(j, i, e, f));
            gacc[v] += dz;
            if (gea_direct) gea_direct[P.attr_row(e) * HC + f] = static_cast<scalar_t>(dz);
          }
        }
      }
    }
    if (gxd) {
#pragma unroll
      for (int v = 0; v < kPerLane; ++v) {
        const int64_t c = cb * kChannelBlock + v * kWarp + lane;
        if (c < C) gxd[i * HC + h * C + c] = static_cast<scalar_t>(gacc[v]);
      }
    }
  }
}

// Per-chunk partials of grad att [n_chunks, HC] and grad edge_weight [n_chunks, K, HC]. A warp
// per (chunk, 32 features, kEdgeDimBlock edge dims); lane = feature. Each partial element has
// one owner, which sums its chunk's edges in edge order.
template <typename scalar_t, typename index_t>
__global__ void gatv2_backward_params_kernel(Preact<scalar_t, index_t> P,
                                             const at::opmath_type<scalar_t>* __restrict__ ds_ws,
                                             const index_t* __restrict__ ptr, const index_t* __restrict__ idx,
                                             at::opmath_type<scalar_t>* __restrict__ patt,
                                             at::opmath_type<scalar_t>* __restrict__ pw, int64_t num_dst, int64_t E,
                                             int64_t n_chunks, int64_t n_fb, int64_t n_kb) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t H = P.H, C = P.C, HC = P.HC, K = P.K;
  const int64_t total = n_chunks * n_fb * n_kb;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; item < total;
       item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t chunk = item / (n_fb * n_kb), fb = (item / n_kb) % n_fb, kb = item % n_kb;
    const int64_t f = fb * kWarp + lane;
    const bool want_att_here = patt && kb == 0;
    if (f >= HC || (!want_att_here && !pw)) continue;  // no warp-wide operations below
    const int64_t h = f / C;
    const int64_t e_begin = E / n_chunks * chunk + (E % n_chunks) * chunk / n_chunks;
    const int64_t e_end = E / n_chunks * (chunk + 1) + (E % n_chunks) * (chunk + 1) / n_chunks;
    acc_t att_acc = 0, w_acc[kEdgeDimBlock];
#pragma unroll
    for (int r = 0; r < kEdgeDimBlock; ++r) w_acc[r] = 0;
    int64_t i = e_begin < e_end ? csc_row_of(ptr, num_dst, e_begin) : 0;
    for (int64_t e = e_begin; e < e_end; ++e) {
      while (i + 1 < num_dst && static_cast<int64_t>(ptr[i + 1]) <= e) ++i;  // next destination (CSC order)
      const int64_t j = idx[e];
      const acc_t zv = P.z(j, i, e, f);
      const acc_t ds = ds_ws[e * H + h];
      if (want_att_here) att_acc += ds * P.lrelu(zv);
      if (pw) {
        const acc_t dz = ds * static_cast<acc_t>(P.att[f]) * P.lrelu_grad(zv);
        const scalar_t* er = P.ea + P.attr_row(e) * K;
#pragma unroll
        for (int r = 0; r < kEdgeDimBlock; ++r) {
          const int64_t k = kb * kEdgeDimBlock + r;
          if (k < K) w_acc[r] += static_cast<acc_t>(er[k]) * dz;
        }
      }
    }
    if (want_att_here) patt[chunk * HC + f] = att_acc;
    if (pw) {
#pragma unroll
      for (int r = 0; r < kEdgeDimBlock; ++r) {
        const int64_t k = kb * kEdgeDimBlock + r;
        if (k < K) pw[(chunk * K + k) * HC + f] = w_acc[r];
      }
    }
  }
}

// out[f] = sum over chunks of partial[chunk, f], in chunk order.
template <typename scalar_t>
__global__ void sum_partials_kernel(const at::opmath_type<scalar_t>* __restrict__ partial, scalar_t* __restrict__ out,
                                    int64_t n_chunks, int64_t size) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t f = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; f < size;
       f += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc_t s = 0;
    for (int64_t c = 0; c < n_chunks; ++c) s += partial[c * size + f];
    out[f] = static_cast<scalar_t>(s);
  }
}

// grad edge_attr[e, k] = sum_f dz[e, f] * W[k, f] (projected edge features). A warp per
// destination over its edges; lane = k (blocks of 32 edge dims); dz of 32 features at a time,
// one per lane, then handed round the warp by shuffles in a fixed order.
template <typename scalar_t, typename index_t>
__global__ void gatv2_backward_edge_kernel(Preact<scalar_t, index_t> P,
                                           const at::opmath_type<scalar_t>* __restrict__ ds_ws,
                                           const index_t* __restrict__ ptr, const index_t* __restrict__ idx,
                                           scalar_t* __restrict__ gea, int64_t num_dst, int64_t E) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t H = P.H, C = P.C, HC = P.HC, K = P.K;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; i < num_dst;
       i += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t e0 = ptr[i], e1 = ptr[i + 1];
    check_edge_range(e0, e1, i, num_dst, E);
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t j = idx[e];
      for (int64_t k0 = 0; k0 < K; k0 += kWarp) {
        const int64_t k = k0 + lane;
        acc_t acc = 0;
        for (int64_t f0 = 0; f0 < HC; f0 += kWarp) {
          const int64_t f = f0 + lane;
          acc_t dz = 0;
          if (f < HC) dz = ds_ws[e * H + f / C] * static_cast<acc_t>(P.att[f]) * P.lrelu_grad(P.z(j, i, e, f));
          const int64_t n = HC - f0 < kWarp ? HC - f0 : kWarp;
          for (int t = 0; t < n; ++t) {
            const acc_t dzt = __shfl_sync(0xffffffffu, dz, t);
            if (k < K) acc += dzt * static_cast<acc_t>(P.w[k * HC + f0 + t]);
          }
        }
        if (k < K) gea[P.attr_row(e) * K + k] = static_cast<scalar_t>(acc);
      }
    }
  }
}

template <typename scalar_t, typename index_t>
__global__ void gatv2_backward_src_kernel(Preact<scalar_t, index_t> P, const scalar_t* __restrict__ g,
                                          const at::opmath_type<scalar_t>* __restrict__ ds_ws,
                                          const at::opmath_type<scalar_t>* __restrict__ aw_ws,
                                          const index_t* __restrict__ rptr, const index_t* __restrict__ redge,
                                          const index_t* __restrict__ rdst, scalar_t* __restrict__ gxs, int64_t num_src,
                                          int64_t num_dst, int64_t E) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t H = P.H, C = P.C, HC = P.HC;
  const int64_t f = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (f >= HC) return;
  const int64_t h = f / C;
  const acc_t att_f = static_cast<acc_t>(P.att[f]);
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; j < num_src;
       j += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t k0 = rptr[j], k1 = rptr[j + 1];
    check_edge_range(k0, k1, j, num_src, E);
    acc_t accx = 0;
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t e = redge[k], i = rdst[k];
      CUDA_KERNEL_ASSERT(e >= 0 && e < E && i >= 0 && i < num_dst && "reverse index entry out of range");
      const acc_t dz = ds_ws[e * H + h] * att_f * P.lrelu_grad(P.z(j, i, e, f));
      accx += aw_ws[e * H + h] * static_cast<acc_t>(g[i * HC + f]) + dz;
    }
    gxs[j * HC + f] = static_cast<scalar_t>(accx);
  }
}

template <typename scalar_t, typename index_t>
Preact<scalar_t, index_t> make_preact(const Gatv2ForwardArgs& a, double negative_slope) {
  Preact<scalar_t, index_t> p;
  p.xs = a.x_src.data_ptr<scalar_t>();
  p.xd = a.x_dst.data_ptr<scalar_t>();
  p.att = a.att.data_ptr<scalar_t>();
  p.ea = ptr_or_null<scalar_t>(a.edge_attr);
  p.w = ptr_or_null<scalar_t>(a.edge_weight);
  p.rows = ptr_or_null<index_t>(a.edge_attr_rows);
  p.num_rows = a.edge_attr.defined() ? a.edge_attr.size(0) : 0;
  p.mode = static_cast<int>(a.edge_mode);
  p.H = a.x_src.size(1);
  p.C = a.x_src.size(2);
  p.HC = p.H * p.C;
  p.K = a.edge_dim;
  p.slope = static_cast<at::opmath_type<scalar_t>>(negative_slope);
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gatv2_forward_cuda(
    const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att, const c10::optional<at::Tensor>& edge_attr,
    const c10::optional<at::Tensor>& edge_weight, const at::Tensor& indptr, const at::Tensor& indices,
    const c10::optional<at::Tensor>& dropout_mask, double negative_slope, double dropout_scale, bool return_alpha,
    const c10::optional<at::Tensor>& edge_attr_rows) {
  const auto a = prepare_gatv2_forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask,
                                       dropout_scale, edge_attr_rows);
  const c10::cuda::CUDAGuard guard(a.x_src.device());
  at::Tensor out, lse, alpha;
  std::tie(out, lse, alpha) = allocate_gatv2_outputs(a, return_alpha);
  const int64_t num_dst = a.x_dst.size(0), H = a.x_src.size(1), C = a.x_src.size(2);
  if (num_dst == 0) return {out, lse, alpha};
  const int64_t n_cb = (C + kChannelBlock - 1) / kChannelBlock;
  const unsigned blocks = warp_grid(num_dst * H * n_cb);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x_src.scalar_type(), "gatv2_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "gatv2_forward_cuda_index", [&] {
      auto kernel = cuda_forward_one_edge_at_a_time() ? gatv2_forward_kernel<scalar_t, index_t, 1>
                                                            : gatv2_forward_kernel<scalar_t, index_t, 2>;
      kernel<<<blocks, kThreads, 0, stream>>>(
          make_preact<scalar_t, index_t>(a, negative_slope), ptr_or_null<bool>(a.dropout_mask),
          a.indptr.data_ptr<index_t>(), a.indices.data_ptr<index_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<double>(),
          return_alpha ? alpha.data_ptr<scalar_t>() : nullptr, a.x_src.size(0), num_dst, a.indices.numel(), n_cb,
          static_cast<acc_t>(dropout_scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, lse, alpha};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gatv2_backward_cuda(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
    const c10::optional<at::Tensor>& edge_attr, const c10::optional<at::Tensor>& edge_weight,
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
    const at::Tensor& rev_dst, const c10::optional<at::Tensor>& dropout_mask, double negative_slope,
    double dropout_scale, std::array<bool, 5> output_mask, const c10::optional<at::Tensor>& edge_attr_rows) {
  const auto b = prepare_gatv2_backward(grad_out, grad_alpha, out, lse, x_src, x_dst, att, edge_attr, edge_weight,
                                        indptr, indices, rev_indptr, rev_edge, rev_dst, dropout_mask, dropout_scale,
                                        output_mask, edge_attr_rows);
  const auto& a = b.fwd;
  const c10::cuda::CUDAGuard guard(a.x_src.device());
  at::Tensor gxs, gxd, gatt, gea, gw;
  std::tie(gxs, gxd, gatt, gea, gw) = allocate_gatv2_gradients(b);
  if (!b.any()) return {gxs, gxd, gatt, gea, gw};
  const int64_t num_src = a.x_src.size(0), num_dst = a.x_dst.size(0), H = a.x_src.size(1), C = a.x_src.size(2);
  const int64_t HC = H * C, K = a.edge_dim, E = a.indices.numel();
  const bool project = a.edge_mode == Gatv2EdgeMode::kProject;
  if (E == 0) {  // every gradient is zero (edge_attr's is empty, or zeros: no edge reads a row)
    for (auto* t : {&gxs, &gxd, &gatt, &gw}) t->zero_();
    return {gxs, gxd, gatt, gea, gw};
  }
  if (b.want_edge_attr && a.edge_attr_rows.defined()) {
    // Each row named at most once (the CPU backward raises): two edges writing one gradient row
    // would race, and with R == E a row named by none would stay uninitialised. Checked on the
    // device, without a synchronisation, like the kernels' other index checks. (int32 counts
    // unless E could wrap one to 1.)
    const auto count_type = E > std::numeric_limits<int32_t>::max() ? at::kLong : at::kInt;
    at::Tensor counts = at::zeros({a.edge_attr.size(0)}, a.indices.options().dtype(count_type));
    counts.index_add_(0, a.edge_attr_rows, at::ones({E}, counts.options()));
    at::_assert_async(counts.max() <= 1,
                      "edge_attr_rows must name distinct rows of edge_attr when its gradient is wanted");
  }
  // Shape limits are checked before any launch.
  const dim3 src_block = feature_block(HC);
  const dim3 src_grid = feature_grid(num_src, HC, src_block);
  const int64_t n_cb = (C + kChannelBlock - 1) / kChannelBlock;
  const bool want_params = b.want_att || b.want_edge_weight;
  const int64_t partial_size = (b.want_att ? HC : 0) + (b.want_edge_weight ? K * HC : 0);
  int64_t n_chunks = std::min<int64_t>(kMaxChunks, std::max<int64_t>(1, E / 256));
  n_chunks = std::min<int64_t>(n_chunks, std::max<int64_t>(1, kPartialBudget / std::max<int64_t>(partial_size, 1)));
  const int64_t n_fb = (HC + kWarp - 1) / kWarp;
  // At least one k block, also for K = 0: the params kernel also writes grad att's partials.
  const int64_t n_kb = b.want_edge_weight ? std::max<int64_t>(1, (K + kEdgeDimBlock - 1) / kEdgeDimBlock) : 1;
  const auto acc_opts = a.x_src.options().dtype(gat_acc_type(a.x_src.scalar_type()));
  const bool need_ds = b.want_x_src || want_params || (b.want_edge_attr && project);
  at::Tensor ds_ws = need_ds ? at::empty({E, H}, acc_opts) : at::Tensor();
  at::Tensor aw_ws = b.want_x_src ? at::empty({E, H}, acc_opts) : at::Tensor();
  at::Tensor patt = b.want_att ? at::empty({n_chunks, HC}, acc_opts) : at::Tensor();
  at::Tensor pw = b.want_edge_weight ? at::empty({n_chunks, K, HC}, acc_opts) : at::Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x_src.scalar_type(), "gatv2_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "gatv2_backward_cuda_index", [&] {
      const auto P = make_preact<scalar_t, index_t>(a, negative_slope);
      const index_t* ptr = a.indptr.data_ptr<index_t>();
      const index_t* idx = a.indices.data_ptr<index_t>();
      gatv2_backward_dst_kernel<scalar_t, index_t><<<warp_grid(num_dst * H * n_cb), kThreads, 0, stream>>>(
          P, b.grad_out.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(b.grad_alpha), b.out.data_ptr<scalar_t>(),
          b.lse.data_ptr<double>(), ptr_or_null<bool>(a.dropout_mask), ptr, idx, ptr_or_null<acc_t>(ds_ws),
          ptr_or_null<acc_t>(aw_ws), b.want_x_dst ? gxd.data_ptr<scalar_t>() : nullptr,
          b.want_edge_attr && !project ? gea.data_ptr<scalar_t>() : nullptr, num_src, num_dst, E, n_cb,
          static_cast<acc_t>(dropout_scale));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (want_params) {
        gatv2_backward_params_kernel<scalar_t, index_t><<<warp_grid(n_chunks * n_fb * n_kb), kThreads, 0, stream>>>(
            P, ds_ws.data_ptr<acc_t>(), ptr, idx, ptr_or_null<acc_t>(patt), ptr_or_null<acc_t>(pw), num_dst, E,
            n_chunks, n_fb, n_kb);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        const std::pair<at::Tensor*, at::Tensor*> sums[] = {{&patt, &gatt}, {&pw, &gw}};
        for (const auto& pr : sums) {
          if (!pr.first->defined()) continue;
          const int64_t size = pr.second->numel();
          const unsigned blocks = static_cast<unsigned>(
              std::max<int64_t>(1, std::min<int64_t>((size + kThreads - 1) / kThreads, kMaxBlocks)));
          sum_partials_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(pr.first->data_ptr<acc_t>(),
                                                                         pr.second->data_ptr<scalar_t>(), n_chunks,
                                                                         size);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      }
      if (b.want_edge_attr && project) {
        gatv2_backward_edge_kernel<scalar_t, index_t><<<warp_grid(num_dst), kThreads, 0, stream>>>(
            P, ds_ws.data_ptr<acc_t>(), ptr, idx, gea.data_ptr<scalar_t>(), num_dst, E);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (b.want_x_src) {
        gatv2_backward_src_kernel<scalar_t, index_t><<<src_grid, src_block, 0, stream>>>(
            P, b.grad_out.data_ptr<scalar_t>(), ds_ws.data_ptr<acc_t>(), aw_ws.data_ptr<acc_t>(),
            b.rev_indptr.data_ptr<index_t>(), b.rev_edge.data_ptr<index_t>(), b.rev_dst.data_ptr<index_t>(),
            gxs.data_ptr<scalar_t>(), num_src, num_dst, E);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return {gxs, gxd, gatt, gea, gw};
}

}  // namespace
}  // namespace torch_gradops

TORCH_LIBRARY_IMPL(torch_gradops, CUDA, m) {
  m.impl("gatv2_forward", &torch_gradops::gatv2_forward_cuda);
  m.impl("gatv2_backward", &torch_gradops::gatv2_backward_cuda);
}
