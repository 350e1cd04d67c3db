// CUDA kernels for the fused GAT ops (schemas in ../gat.cpp; CPU twins in ../cpu/gat_cpu.cpp).
//
// Forward: a thread per (destination, feature f = h*C + c); it walks the destination's incoming
// edges once with an online softmax, so a warp reads source rows x_src[j, f..f+31] coalesced.
// Each thread recomputes its head's score (cheap next to the row gather). The thread with c == 0
// writes the log-sum-exp (and alpha, when asked).
//
// Backward, without atomics and in a fixed order (bitwise reproducible run to run):
//   pass 1: a warp per (destination, head): D = <g_i, out_i>, per edge dA = <g_i, x_j> by a
//           fixed-pattern warp reduction, dz and alpha-after-dropout into [E,H] workspaces,
//           grad a_dst summed in edge order;
//   pass 2: a thread per (source, feature) over the source-grouped reverse index: grad x_src,
//           and grad a_src from the threads with c == 0.
// SpMM (edge-weighted aggregation) and SDDMM (per-edge dot products), the primitives of the
// differentiable paths, are at the end of this file.
// All offsets that scale with nodes x features or edges are 64-bit.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../gat.h"
#include "kernel_utils.cuh"

namespace torch_gradops {
namespace {

using namespace cuda_kernels;

template <typename logit_t, typename acc_t>
__device__ __forceinline__ acc_t score_logit(const logit_t* __restrict__ as, const logit_t* __restrict__ el,
                                             int64_t j, int64_t e, int64_t h, int64_t H, acc_t adst) {
  acc_t z = static_cast<acc_t>(as[j * H + h]) + adst;
  if (el) z += static_cast<acc_t>(el[e * H + h]);
  return z;
}

// kEdgeBatch: edges whose source ids, scores and rows a thread loads before it folds any of them
// into the online softmax, so that kEdgeBatch row gathers are in flight per thread instead of one
// after another (the sequential walk was latency-bound). The folding order, and so every result
// bit, is the same for every kEdgeBatch. logit_t: the element type of the logits and alpha
// (scalar_t, or float32 for half features: with_logit_type).
template <typename scalar_t, typename logit_t, typename index_t, int kEdgeBatch>
__global__ void gat_forward_kernel(const scalar_t* __restrict__ x, const logit_t* __restrict__ as,
                                   const logit_t* __restrict__ ad, const logit_t* __restrict__ el,
                                   const bool* __restrict__ mk, const index_t* __restrict__ ptr,
                                   const index_t* __restrict__ idx, scalar_t* __restrict__ out,
                                   double* __restrict__ lse, logit_t* __restrict__ alpha,
                                   int64_t num_src, int64_t num_dst, int64_t E, int64_t H, int64_t C,
                                   at::opmath_type<scalar_t> slope, at::opmath_type<scalar_t> keep_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t HC = H * C;
  const int64_t f = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (f >= HC) return;
  const int64_t h = f / C;
  const bool head_leader = (f % C) == 0;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; i < num_dst;
       i += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t e0 = ptr[i], e1 = ptr[i + 1];
    check_edge_range(e0, e1, i, num_dst, E);
    const acc_t adst = static_cast<acc_t>(ad[i * H + h]);
    acc_t run_max = neg_inf, run_sum = 0, acc = 0;
    for (int64_t eb = e0; eb < e1; eb += kEdgeBatch) {
      acc_t sb[kEdgeBatch], xb[kEdgeBatch];
      bool kb[kEdgeBatch];
#pragma unroll
      for (int u = 0; u < kEdgeBatch; ++u) {
        const int64_t e = eb + u;
        if (e < e1) {
          const int64_t j = idx[e];
          CUDA_KERNEL_ASSERT(j >= 0 && j < num_src && "indices: source id out of range");
          sb[u] = leaky_relu(score_logit(as, el, j, e, h, H, adst), slope);
          xb[u] = static_cast<acc_t>(x[j * HC + f]);
          kb[u] = mk ? mk[e * H + h] : true;
        }
      }
#pragma unroll
      for (int u = 0; u < kEdgeBatch; ++u) {
        if (eb + u >= e1) break;
        const acc_t s = sb[u];
        if (s > run_max) {  // rescale what was summed under the old maximum
          const acc_t r = dev_exp(run_max - s);
          run_sum *= r;
          acc *= r;
          run_max = s;
        }
        // A -inf score (a masked edge) weighs 0, also when it comes first (run_max still -inf).
        const acc_t p = s == neg_inf ? acc_t(0) : dev_exp(s - run_max);
        run_sum += p;
        const acc_t w = mk ? (kb[u] ? p * keep_scale : acc_t(0)) : p;
        acc += w * xb[u];
      }
    }
    const bool empty = e0 == e1;
    out[i * HC + f] = static_cast<scalar_t>(empty ? acc_t(0) : acc / run_sum);
    if (head_leader) {
      lse[i * H + h] = lse_of(run_max, run_sum);
      if (alpha) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t j = idx[e];
          // exp(s - max) / sum, not exp(s - lse): at large scores lse's rounding swamps the log-sum
          const acc_t s = leaky_relu(score_logit(as, el, j, e, h, H, adst), slope);
          acc_t a = (s == neg_inf ? acc_t(0) : dev_exp(s - run_max)) / run_sum;
          if (mk) a = mk[e * H + h] ? a * keep_scale : acc_t(0);
          alpha[e * H + h] = static_cast<logit_t>(a);
        }
      }
    }
  }
}

template <typename scalar_t, typename logit_t, typename index_t>
__global__ void gat_backward_dst_kernel(
    const scalar_t* __restrict__ g, const logit_t* __restrict__ ga, const scalar_t* __restrict__ o,
    const double* __restrict__ lse, const scalar_t* __restrict__ x,
    const logit_t* __restrict__ as, const logit_t* __restrict__ ad, const logit_t* __restrict__ el,
    const bool* __restrict__ mk, const index_t* __restrict__ ptr, const index_t* __restrict__ idx,
    at::opmath_type<scalar_t>* __restrict__ dz_ws, at::opmath_type<scalar_t>* __restrict__ w_ws,
    logit_t* __restrict__ gad, logit_t* __restrict__ gel, int64_t num_src, int64_t num_dst, int64_t E,
    int64_t H, int64_t C, bool need_dz, at::opmath_type<scalar_t> slope, at::opmath_type<scalar_t> keep_scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t HC = H * C;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps_per_block = blockDim.x / kWarp;
  const int64_t total = num_dst * H;
  for (int64_t pair = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / kWarp; pair < total;
       pair += static_cast<int64_t>(gridDim.x) * warps_per_block) {
    const int64_t i = pair / H, h = pair % H;
    const int64_t e0 = ptr[i], e1 = ptr[i + 1];
    check_edge_range(e0, e1, i, num_dst, E);
    const acc_t adst = static_cast<acc_t>(ad[i * H + h]);
    acc_t l_hi, l_lo;  // exp((s - l_hi) - l_lo): see kLseType
    split_lse(lse[i * H + h], l_hi, l_lo);
    const scalar_t* gih = g + i * HC + h * C;
    acc_t D = 0;
    if (need_dz) {
      acc_t part = 0;
      const scalar_t* oih = o + i * HC + h * C;
      for (int64_t c = lane; c < C; c += kWarp) part += static_cast<acc_t>(gih[c]) * static_cast<acc_t>(oih[c]);
      if (ga) {  // attention weights used directly: D gains sum_e A_e * dL/dA_e
        for (int64_t e = e0 + lane; e < e1; e += kWarp) {
          const int64_t j = idx[e];
          CUDA_KERNEL_ASSERT(j >= 0 && j < num_src && "indices: source id out of range");
          acc_t a = dev_exp((leaky_relu(score_logit(as, el, j, e, h, H, adst), slope) - l_hi) - l_lo);
          if (mk) a = mk[e * H + h] ? a * keep_scale : acc_t(0);
          part += a * static_cast<acc_t>(ga[e * H + h]);
        }
      }
      D = warp_sum(part);
    }
    acc_t gad_acc = 0;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t j = idx[e];
      CUDA_KERNEL_ASSERT(j >= 0 && j < num_src && "indices: source id out of range");
      const acc_t z = score_logit(as, el, j, e, h, H, adst);
      const acc_t alpha = dev_exp((leaky_relu(z, slope) - l_hi) - l_lo);
      const acc_t keep = mk ? (mk[e * H + h] ? keep_scale : acc_t(0)) : acc_t(1);
      if (need_dz) {
        acc_t part = 0;
        const scalar_t* xjh = x + j * HC + h * C;
        for (int64_t c = lane; c < C; c += kWarp) part += static_cast<acc_t>(gih[c]) * static_cast<acc_t>(xjh[c]);
        acc_t dA = warp_sum(part);
        if (ga) dA += static_cast<acc_t>(ga[e * H + h]);
        const acc_t dz = alpha * (dA * keep - D) * leaky_relu_grad(z, slope);
        gad_acc += dz;
        if (lane == 0) {
          if (dz_ws) dz_ws[e * H + h] = dz;
          if (gel) gel[e * H + h] = static_cast<logit_t>(dz);
        }
      }
      if (w_ws && lane == 0) w_ws[e * H + h] = alpha * keep;
    }
    if (gad && lane == 0) gad[i * H + h] = static_cast<logit_t>(gad_acc);
  }
}

template <typename scalar_t, typename logit_t, typename index_t>
__global__ void gat_backward_src_kernel(const scalar_t* __restrict__ g,
                                        const at::opmath_type<scalar_t>* __restrict__ dz_ws,
                                        const at::opmath_type<scalar_t>* __restrict__ w_ws,
                                        const index_t* __restrict__ rptr, const index_t* __restrict__ redge,
                                        const index_t* __restrict__ rdst, scalar_t* __restrict__ gx,
                                        logit_t* __restrict__ gas, int64_t num_src, int64_t num_dst, int64_t E,
                                        int64_t H, int64_t C) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t HC = H * C;
  const int64_t f = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (f >= HC) return;
  const int64_t h = f / C;
  const bool head_leader = (f % C) == 0;
  if (!gx && !head_leader) return;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; j < num_src;
       j += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    acc_t accx = 0, accs = 0;
    const int64_t k0 = rptr[j], k1 = rptr[j + 1];
    check_edge_range(k0, k1, j, num_src, E);
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t e = redge[k], i = rdst[k];
      CUDA_KERNEL_ASSERT(e >= 0 && e < E && i >= 0 && i < num_dst && "reverse index entry out of range");
      if (gx) accx += w_ws[e * H + h] * static_cast<acc_t>(g[i * HC + f]);
      if (gas && head_leader) accs += dz_ws[e * H + h];
    }
    if (gx) gx[j * HC + f] = static_cast<scalar_t>(accx);
    if (gas && head_leader) gas[j * H + h] = static_cast<logit_t>(accs);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gat_forward_cuda(
    const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
    const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
    const c10::optional<at::Tensor>& dropout_mask, double negative_slope, double dropout_scale,
    bool return_alpha) {
  const auto a = prepare_gat_forward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask,
                                     dropout_scale);
  const c10::cuda::CUDAGuard guard(a.x_src.device());
  at::Tensor out, lse, alpha;
  std::tie(out, lse, alpha) = allocate_gat_outputs(a, return_alpha);
  const int64_t num_dst = a.a_dst.size(0), H = a.x_src.size(1), C = a.x_src.size(2);
  if (num_dst == 0) return {out, lse, alpha};
  const dim3 block = feature_block(H * C);
  const dim3 grid = feature_grid(num_dst, H * C, block);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x_src.scalar_type(), "gat_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "gat_forward_cuda_index", [&] {
      with_logit_type<scalar_t>(a.a_src.scalar_type(), [&](auto tag) {
        using logit_t = typename decltype(tag)::type;
        auto kernel = cuda_forward_one_edge_at_a_time() ? gat_forward_kernel<scalar_t, logit_t, index_t, 1>
                                                        : gat_forward_kernel<scalar_t, logit_t, index_t, 4>;
        kernel<<<grid, block, 0, stream>>>(
            a.x_src.data_ptr<scalar_t>(), a.a_src.data_ptr<logit_t>(), a.a_dst.data_ptr<logit_t>(),
            ptr_or_null<logit_t>(a.edge_logits), ptr_or_null<bool>(a.dropout_mask), a.indptr.data_ptr<index_t>(),
            a.indices.data_ptr<index_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<double>(),
            return_alpha ? alpha.data_ptr<logit_t>() : nullptr, a.x_src.size(0), num_dst, a.indices.numel(), H, C,
            static_cast<acc_t>(negative_slope), static_cast<acc_t>(dropout_scale));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {out, lse, alpha};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward_cuda(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
    const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
    const at::Tensor& rev_indptr, const at::Tensor& rev_edge, const at::Tensor& rev_dst,
    const c10::optional<at::Tensor>& dropout_mask, double negative_slope, double dropout_scale,
    std::array<bool, 4> output_mask) {
  const auto a = prepare_gat_backward(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, indptr,
                                      indices, rev_indptr, rev_edge, rev_dst, dropout_mask, dropout_scale,
                                      output_mask);
  const auto& f = a.fwd;
  const c10::cuda::CUDAGuard guard(f.x_src.device());
  const bool need_dz = a.want_a_src || a.want_a_dst || a.want_edge_logits;
  const int64_t num_src = f.x_src.size(0), num_dst = f.a_dst.size(0), H = f.x_src.size(1), C = f.x_src.size(2);
  const int64_t E = f.indices.numel();
  // The kernels write every entry (nodes without edges get zeros), so no zero-fill pass.
  at::Tensor gx, gas, gad, gel;
  std::tie(gx, gas, gad, gel) = allocate_gat_gradients(a);
  if (E == 0) {
    for (auto* t : {&gx, &gas, &gad}) t->zero_();
    return {gx, gas, gad, gel};
  }
  if (!a.want_x && !a.want_a_src && !a.want_a_dst && !a.want_edge_logits) return {gx, gas, gad, gel};
  // Shape limits are checked before any launch.
  const dim3 src_block = feature_block(H * C);
  const dim3 src_grid = feature_grid(num_src, H * C, src_block);
  const auto acc_opts = f.x_src.options().dtype(gat_acc_type(f.x_src.scalar_type()));
  at::Tensor dz_ws = a.want_a_src ? at::empty({E, H}, acc_opts) : at::Tensor();
  at::Tensor w_ws = a.want_x ? at::empty({E, H}, acc_opts) : at::Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, f.x_src.scalar_type(), "gat_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    AT_DISPATCH_INDEX_TYPES(f.indices.scalar_type(), "gat_backward_cuda_index", [&] {
      with_logit_type<scalar_t>(f.a_src.scalar_type(), [&](auto tag) {
        using logit_t = typename decltype(tag)::type;
        const int64_t pairs = num_dst * H;
        const int64_t warps_per_block = kThreads / kWarp;
        const unsigned blocks1 = static_cast<unsigned>(
            std::max<int64_t>(1, std::min<int64_t>((pairs + warps_per_block - 1) / warps_per_block, kMaxBlocks)));
        gat_backward_dst_kernel<scalar_t, logit_t, index_t><<<blocks1, kThreads, 0, stream>>>(
            a.grad_out.data_ptr<scalar_t>(), ptr_or_null<logit_t>(a.grad_alpha), a.out.data_ptr<scalar_t>(),
            a.lse.data_ptr<double>(), f.x_src.data_ptr<scalar_t>(), f.a_src.data_ptr<logit_t>(),
            f.a_dst.data_ptr<logit_t>(), ptr_or_null<logit_t>(f.edge_logits), ptr_or_null<bool>(f.dropout_mask),
            f.indptr.data_ptr<index_t>(), f.indices.data_ptr<index_t>(), ptr_or_null<acc_t>(dz_ws),
            ptr_or_null<acc_t>(w_ws), a.want_a_dst ? gad.data_ptr<logit_t>() : nullptr,
            a.want_edge_logits ? gel.data_ptr<logit_t>() : nullptr, num_src, num_dst, E, H, C, need_dz,
            static_cast<acc_t>(negative_slope), static_cast<acc_t>(dropout_scale));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (a.want_x || a.want_a_src) {
          gat_backward_src_kernel<scalar_t, logit_t, index_t><<<src_grid, src_block, 0, stream>>>(
              a.grad_out.data_ptr<scalar_t>(), ptr_or_null<acc_t>(dz_ws), ptr_or_null<acc_t>(w_ws),
              a.rev_indptr.data_ptr<index_t>(), a.rev_edge.data_ptr<index_t>(), a.rev_dst.data_ptr<index_t>(),
              a.want_x ? gx.data_ptr<scalar_t>() : nullptr,
              a.want_a_src ? gas.data_ptr<logit_t>() : nullptr, num_src, num_dst, E, H, C);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
    });
  });
  return {gx, gas, gad, gel};
}

// ------------------------------------------------------------------ SpMM / SDDMM primitives
// SpMM: a thread per (output row, feature f = h*C + c), summing the row's edges in order, as
// the forward kernel does (a warp reads values[j, f..f+31] coalesced). No atomics.
template <typename scalar_t, typename index_t>
__global__ void gat_spmm_kernel(const scalar_t* __restrict__ w, const scalar_t* __restrict__ v,
                                const index_t* __restrict__ ptr, const index_t* __restrict__ nbr,
                                const index_t* __restrict__ eid, scalar_t* __restrict__ out, int64_t rows,
                                int64_t num_values, int64_t E, int64_t H, int64_t C) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t HC = H * C;
  const int64_t f = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (f >= HC) return;
  const int64_t h = f / C;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; n < rows;
       n += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t k0 = ptr[n], k1 = ptr[n + 1];
    check_edge_range(k0, k1, n, rows, E);
    acc_t acc = 0;
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t j = nbr[k];
      const int64_t e = eid ? static_cast<int64_t>(eid[k]) : k;
      CUDA_KERNEL_ASSERT(j >= 0 && j < num_values && "neighbors: id out of range");
      CUDA_KERNEL_ASSERT(e >= 0 && e < E && "edge_ids: id out of range");
      acc += static_cast<acc_t>(w[e * H + h]) * static_cast<acc_t>(v[j * HC + f]);
    }
    out[n * HC + f] = static_cast<scalar_t>(acc);
  }
}

// SDDMM: a group of `group` lanes (a power of two <= 32, >= min(C, 32)) per (edge, head) pair,
// each summing a strided share of the channels, then a fixed butterfly within the group. All
// lanes of a warp run the same iterations (the loop bound depends only on the warp), so the
// full-mask shuffles are well defined. The edge's row comes from a binary search of indptr.
template <typename scalar_t, typename index_t>
__global__ void gat_sddmm_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                 const index_t* __restrict__ ptr, const index_t* __restrict__ idx,
                                 scalar_t* __restrict__ out, int64_t rows, int64_t num_b, int64_t E, int64_t H,
                                 int64_t C, int group) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t HC = H * C;
  const int lane = threadIdx.x % kWarp;
  const int sub = lane / group, lane_in_group = lane % group;
  const int64_t pairs_per_warp = kWarp / group;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  const int64_t total = E * H;
  if (warp == 0 && lane == 0) {
    CUDA_KERNEL_ASSERT(ptr[0] == 0 && static_cast<int64_t>(ptr[rows]) == E && "indptr must start at 0 and end at E");
  }
  for (int64_t base = warp * pairs_per_warp; base < total; base += num_warps * pairs_per_warp) {
    const int64_t pair = base + sub;
    const bool valid = pair < total;
    acc_t part = 0;
    int64_t e = 0, h = 0;
    if (valid) {
      e = pair / H;
      h = pair % H;
      const int64_t i = csc_row_of(ptr, rows, e);
      CUDA_KERNEL_ASSERT(static_cast<int64_t>(ptr[i]) <= e && e < static_cast<int64_t>(ptr[i + 1]) &&
                         "indptr must be non-decreasing and within [0, E]");
      const int64_t j = idx[e];
      CUDA_KERNEL_ASSERT(j >= 0 && j < num_b && "indices: id out of range");
      const scalar_t* ai = a + i * HC + h * C;
      const scalar_t* bj = b + j * HC + h * C;
      for (int64_t c = lane_in_group; c < C; c += group) part += static_cast<acc_t>(ai[c]) * static_cast<acc_t>(bj[c]);
    }
    for (int offset = group / 2; offset > 0; offset /= 2) part += __shfl_xor_sync(0xffffffffu, part, offset);
    if (valid && lane_in_group == 0) out[e * H + h] = static_cast<scalar_t>(part);
  }
}

at::Tensor gat_spmm_cuda(const at::Tensor& weight, const at::Tensor& values, const at::Tensor& indptr,
                         const at::Tensor& neighbors, const c10::optional<at::Tensor>& edge_ids) {
  const auto a = prepare_gat_spmm(weight, values, indptr, neighbors, edge_ids);
  const c10::cuda::CUDAGuard guard(a.values.device());
  const int64_t rows = a.indptr.numel() - 1, H = a.values.size(1), C = a.values.size(2);
  at::Tensor out = at::empty({rows, H, C}, a.values.options());
  if (out.numel() == 0) return out;
  const dim3 block = feature_block(H * C);
  const dim3 grid = feature_grid(rows, H * C, block);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.values.scalar_type(), "gat_spmm_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(a.indptr.scalar_type(), "gat_spmm_cuda_index", [&] {
      gat_spmm_kernel<scalar_t, index_t><<<grid, block, 0, stream>>>(
          a.weight.data_ptr<scalar_t>(), a.values.data_ptr<scalar_t>(), a.indptr.data_ptr<index_t>(),
          a.neighbors.data_ptr<index_t>(), ptr_or_null<index_t>(a.edge_ids), out.data_ptr<scalar_t>(), rows,
          a.values.size(0), a.neighbors.numel(), H, C);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

at::Tensor gat_sddmm_cuda(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& indptr,
                          const at::Tensor& indices) {
  const auto a = prepare_gat_sddmm(a_in, b_in, indptr, indices);
  const c10::cuda::CUDAGuard guard(a.a.device());
  const int64_t rows = a.a.size(0), H = a.a.size(1), C = a.a.size(2), E = a.indices.numel();
  at::Tensor out = at::empty({E, H}, a.a.options());
  if (out.numel() == 0) return out;
  if (C == 0) return out.zero_();
  int group = 1;
  while (group < C && group < kWarp) group *= 2;
  const int64_t pairs_per_block = (kThreads / kWarp) * (kWarp / group);
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((E * H + pairs_per_block - 1) / pairs_per_block, kMaxBlocks)));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.a.scalar_type(), "gat_sddmm_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(a.indptr.scalar_type(), "gat_sddmm_cuda_index", [&] {
      gat_sddmm_kernel<scalar_t, index_t><<<blocks, kThreads, 0, stream>>>(
          a.a.data_ptr<scalar_t>(), a.b.data_ptr<scalar_t>(), a.indptr.data_ptr<index_t>(),
          a.indices.data_ptr<index_t>(), out.data_ptr<scalar_t>(), rows, a.b.size(0), E, H, C, group);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace
}  // namespace torch_gradops

TORCH_LIBRARY_IMPL(torch_gradops, CUDA, m) {
  m.impl("gat_forward", &torch_gradops::gat_forward_cuda);
  m.impl("gat_backward", &torch_gradops::gat_backward_cuda);
  m.impl("gat_spmm", &torch_gradops::gat_spmm_cuda);
  m.impl("gat_sddmm", &torch_gradops::gat_sddmm_cuda);
}
