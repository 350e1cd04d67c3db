// CPU kernels for the fused GAT ops (schemas in ../gat.cpp).
//
// Forward: one pass per destination over its incoming edges, all heads at once, with an online
// softmax (running max and sum per head, exps of all heads in one vectorised call); a source
// row x_src[j] (H*C contiguous values) is read once per edge. Saves only the log-sum-exp per
// (destination, head).
//
// Backward, without atomics and in a fixed order (bitwise reproducible for any thread count),
// with a single row gather (the CUDA backward has two; on CPU the gathers are the cost):
//   pass A, per destination: D = <g_i, out_i>, packed with a_dst and lse;
//   pass B, per source over the reverse index: alpha = exp(s - lse), dA = <g_i, x_j>, dz;
//           grad x_src and grad a_src; dz into an [E,H] workspace;
//   pass C, per destination: grad a_dst = sum of dz over the incoming edges.
//
// SpMM (edge-weighted aggregation) and SDDMM (per-edge dot products): the two primitives of
// the differentiable paths (double backward, forward mode), at the end of this file.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../gat.h"
#include "kernel_utils.h"

namespace torch_gradops {
namespace {

using cpu::check_ptr_ends;
using cpu::dot;
using cpu::exp_inplace;
using cpu::kPrefetchDistance;
using cpu::parallel_over_rows;
using cpu::prefetch_row;

// logit_t: the element type of a_src, a_dst, edge_logits and alpha (scalar_t, or float32 for
// half features: with_logit_type).
template <typename scalar_t, typename logit_t, typename index_t>
void forward_kernel(const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
                    const at::Tensor* edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
                    const at::Tensor* mask, double negative_slope, double dropout_scale,
                    at::Tensor& out, at::Tensor& lse, at::Tensor* alpha) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_src = x_src.size(0), H = x_src.size(1), C = x_src.size(2), HC = H * C;
  const int64_t num_dst = a_dst.size(0), E = indices.numel();
  const scalar_t* x = x_src.data_ptr<scalar_t>();
  const logit_t* as = a_src.data_ptr<logit_t>();
  const logit_t* ad = a_dst.data_ptr<logit_t>();
  const logit_t* el = edge_logits ? edge_logits->data_ptr<logit_t>() : nullptr;
  const bool* mk = mask ? mask->data_ptr<bool>() : nullptr;
  const index_t* ptr = indptr.data_ptr<index_t>();
  const index_t* idx = indices.data_ptr<index_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  double* lse_p = lse.data_ptr<double>();
  logit_t* al = alpha ? alpha->data_ptr<logit_t>() : nullptr;
  const acc_t slope = static_cast<acc_t>(negative_slope);
  const acc_t keep_scale = static_cast<acc_t>(dropout_scale);
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  check_ptr_ends(ptr, num_dst, E, "indptr");

  // slope and neg_inf by value: read through the lambda's references, GCC did not vectorise the
  // head loops (it cannot tell the stores from them).
  parallel_over_rows(ptr, num_dst, HC, [&, slope, neg_inf](int64_t begin, int64_t end) {
    // ex holds, per edge, the H rescale factors then the H edge weights: one exp call for all.
    std::vector<acc_t> acc(HC), run_max(H), run_sum(H), adst(H), score(H), ex(2 * H);
    acc_t* rescale = ex.data();
    acc_t* weight = ex.data() + H;
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(run_max.begin(), run_max.end(), neg_inf);
      std::fill(run_sum.begin(), run_sum.end(), acc_t(0));
      for (int64_t h = 0; h < H; ++h) adst[h] = static_cast<acc_t>(ad[i * H + h]);
      const int64_t e0 = ptr[i], e1 = ptr[i + 1];
      TORCH_CHECK(e0 <= e1 && e0 >= 0 && e1 <= E, "indptr must be non-decreasing and within [0, E]");
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t j = idx[e];
        TORCH_CHECK(j >= 0 && j < num_src, "indices: source id ", j, " out of range [0, ", num_src, ")");
        if (e + kPrefetchDistance < E) {
          const int64_t jn = idx[e + kPrefetchDistance];
          if (jn >= 0 && jn < num_src) {
            prefetch_row(x + jn * HC, HC);
            __builtin_prefetch(as + jn * H);  // a lone random line: its miss would stall the softmax
          }
        }
        // Online softmax for all heads at once: new maximum, the old sums' rescale factor
        // exp(old_max - new_max) and the edge's weight exp(s - new_max). Selects, not branches,
        // so that the head loops vectorise (a random-sign leaky_relu branch mispredicts half
        // the time).
        const logit_t* asj = as + j * H;
        if (el) {
          for (int64_t h = 0; h < H; ++h) score[h] = static_cast<acc_t>(asj[h]) + adst[h] + static_cast<acc_t>(el[e * H + h]);
        } else {
          for (int64_t h = 0; h < H; ++h) score[h] = static_cast<acc_t>(asj[h]) + adst[h];
        }
        for (int64_t h = 0; h < H; ++h) {
          const acc_t s = leaky_relu(score[h], slope), old = run_max[h];
          const acc_t m = s > old ? s : old;  // a NaN score is no maximum; exp spreads it
          rescale[h] = m == old ? acc_t(0) : old - m;  // also -inf - -inf: no NaN
          weight[h] = s == neg_inf ? acc_t(-1000) : s - m;  // a -inf score (masked edge) weighs 0
          run_max[h] = m;
        }
        exp_inplace(ex.data(), 2 * H);
        for (int64_t h = 0; h < H; ++h) {  // rare after the first edges: the maximum settles
          const acc_t r = rescale[h];
          if (r != acc_t(1)) {
            acc_t* a = acc.data() + h * C;
            for (int64_t c = 0; c < C; ++c) a[c] *= r;
          }
        }
        const scalar_t* xj = x + j * HC;
        for (int64_t h = 0; h < H; ++h) {
          const acc_t p = weight[h];
          run_sum[h] = run_sum[h] * rescale[h] + p;
          const acc_t w = mk ? (mk[e * H + h] ? p * keep_scale : acc_t(0)) : p;
          const scalar_t* xjh = xj + h * C;
          acc_t* a = acc.data() + h * C;
          for (int64_t c = 0; c < C; ++c) a[c] += w * static_cast<acc_t>(xjh[c]);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const bool empty = e0 == e1;
        const acc_t inv = empty ? acc_t(0) : acc_t(1) / run_sum[h];
        scalar_t* oi = o + i * HC + h * C;
        const acc_t* a = acc.data() + h * C;
        for (int64_t c = 0; c < C; ++c) oi[c] = static_cast<scalar_t>(a[c] * inv);
        lse_p[i * H + h] = lse_of(run_max[h], run_sum[h]);
      }
      if (al) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t j = idx[e];
          for (int64_t h = 0; h < H; ++h) {
            acc_t z = static_cast<acc_t>(as[j * H + h]) + adst[h];
            if (el) z += static_cast<acc_t>(el[e * H + h]);
            // exp(s - max) / sum, not exp(s - lse): at large scores lse's rounding swamps the log-sum
            const acc_t s = leaky_relu(z, slope);
            acc_t a = (s == neg_inf ? acc_t(0) : std::exp(s - run_max[h])) / run_sum[h];
            if (mk) a = mk[e * H + h] ? a * keep_scale : acc_t(0);
            al[e * H + h] = static_cast<logit_t>(a);
          }
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gat_forward_cpu(
    const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
    const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
    const c10::optional<at::Tensor>& dropout_mask, double negative_slope, double dropout_scale,
    bool return_alpha) {
  const auto a = prepare_gat_forward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask,
                                     dropout_scale);
  at::Tensor out, lse, alpha;
  std::tie(out, lse, alpha) = allocate_gat_outputs(a, return_alpha);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x_src.scalar_type(), "gat_forward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(a.indices.scalar_type(), "gat_forward_cpu_index", [&] {
      with_logit_type<scalar_t>(a.a_src.scalar_type(), [&](auto tag) {
        using logit_t = typename decltype(tag)::type;
        forward_kernel<scalar_t, logit_t, index_t>(
            a.x_src, a.a_src, a.a_dst, a.edge_logits.defined() ? &a.edge_logits : nullptr, a.indptr, a.indices,
            a.dropout_mask.defined() ? &a.dropout_mask : nullptr, negative_slope, dropout_scale, out, lse,
            return_alpha ? &alpha : nullptr);
      });
    });
  });
  return {out, lse, alpha};
}

template <typename scalar_t, typename logit_t, typename index_t>
void backward_kernel(const at::Tensor& grad_out, const at::Tensor* grad_alpha, const at::Tensor& out,
                     const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& a_src,
                     const at::Tensor& a_dst, const at::Tensor* edge_logits, const at::Tensor& indptr,
                     const at::Tensor& indices, const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
                     const at::Tensor& rev_dst, const at::Tensor* mask, double negative_slope,
                     double dropout_scale, at::Tensor* gx, at::Tensor* gas, at::Tensor* gad,
                     at::Tensor* gel) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_src = x_src.size(0), H = x_src.size(1), C = x_src.size(2), HC = H * C;
  const int64_t num_dst = a_dst.size(0), E = indices.numel();
  const bool need_dz = gas || gad || gel;
  const scalar_t* g = grad_out.data_ptr<scalar_t>();
  const logit_t* ga = grad_alpha ? grad_alpha->data_ptr<logit_t>() : nullptr;
  const scalar_t* o = out.data_ptr<scalar_t>();
  const double* lse_p = lse.data_ptr<double>();
  const scalar_t* x = x_src.data_ptr<scalar_t>();
  const logit_t* as = a_src.data_ptr<logit_t>();
  const logit_t* ad = a_dst.data_ptr<logit_t>();
  const logit_t* el = edge_logits ? edge_logits->data_ptr<logit_t>() : nullptr;
  const bool* mk = mask ? mask->data_ptr<bool>() : nullptr;
  const index_t* ptr = indptr.data_ptr<index_t>();
  const index_t* idx = indices.data_ptr<index_t>();
  const acc_t slope = static_cast<acc_t>(negative_slope);
  const acc_t keep_scale = static_cast<acc_t>(dropout_scale);
  const auto acc_opts = x_src.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  check_ptr_ends(ptr, num_dst, E, "indptr");
  check_ptr_ends(rev_indptr.data_ptr<index_t>(), num_src, E, "rev_indptr");

  // Pass A, per destination: one record {a_dst, lse hi, lse lo, D} of 4H values (split_lse), so
  // that pass B touches a single small line per edge for everything it needs of the destination.
  at::Tensor rec_t = at::empty({num_dst, 4 * H}, acc_opts);
  acc_t* rec = rec_t.data_ptr<acc_t>();
  parallel_over_rows(ptr, num_dst, HC, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      acc_t* r = rec + i * 4 * H;
      const int64_t e0 = ptr[i], e1 = ptr[i + 1];
      TORCH_CHECK(e0 <= e1 && e0 >= 0 && e1 <= E, "indptr must be non-decreasing and within [0, E]");
      for (int64_t h = 0; h < H; ++h) {
        r[h] = static_cast<acc_t>(ad[i * H + h]);
        split_lse(lse_p[i * H + h], r[H + h], r[2 * H + h]);
        acc_t d = 0;
        if (need_dz) {
          const scalar_t* gih = g + i * HC + h * C;
          const scalar_t* oih = o + i * HC + h * C;
          d = dot<acc_t>(gih, oih, C);
        }
        r[3 * H + h] = d;
      }
      if (need_dz && ga) {  // attention weights used directly: D gains sum_e A_e * dL/dA_e
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t j = idx[e];
          TORCH_CHECK(j >= 0 && j < num_src, "indices: source id ", j, " out of range [0, ", num_src, ")");
          for (int64_t h = 0; h < H; ++h) {
            acc_t z = static_cast<acc_t>(as[j * H + h]) + r[h];
            if (el) z += static_cast<acc_t>(el[e * H + h]);
            acc_t a = std::exp((leaky_relu(z, slope) - r[H + h]) - r[2 * H + h]);
            if (mk) a = mk[e * H + h] ? a * keep_scale : acc_t(0);
            r[3 * H + h] += a * static_cast<acc_t>(ga[e * H + h]);
          }
        }
      }
    }
  });

  // Pass B, per source over the reverse index: the one row gather of the backward (grad_out of
  // each destination). It gives grad x_src, dA = <g_i, x_j> and so dz, hence grad a_src; dz goes
  // to an [E,H] workspace for the destination-side sums. Zeroed: a valid reverse index writes
  // every edge, but the raw op cannot afford to prove one valid (a permutation, consistent with
  // indptr), and an edge it misses must read as zero, not as uninitialised memory.
  at::Tensor dz_t = (gad || gel) ? at::zeros({E, H}, acc_opts) : at::Tensor();
  acc_t* dz_ws = dz_t.defined() ? dz_t.data_ptr<acc_t>() : nullptr;
  const index_t* rptr = rev_indptr.data_ptr<index_t>();
  const index_t* redge = rev_edge.data_ptr<index_t>();
  const index_t* rdst = rev_dst.data_ptr<index_t>();
  scalar_t* gxp = gx ? gx->data_ptr<scalar_t>() : nullptr;
  logit_t* gasp = gas ? gas->data_ptr<logit_t>() : nullptr;
  parallel_over_rows(rptr, num_src, HC, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> accx(gx ? HC : 0), accs(H), heads(5 * H);
    acc_t* slope_grad = heads.data();
    acc_t* alphas = heads.data() + H;
    acc_t* keeps = heads.data() + 2 * H;
    acc_t* dots = heads.data() + 3 * H;
    acc_t* zs = heads.data() + 4 * H;
    for (int64_t j = begin; j < end; ++j) {
      std::fill(accx.begin(), accx.end(), acc_t(0));
      std::fill(accs.begin(), accs.end(), acc_t(0));
      const scalar_t* xj = x + j * HC;
      const int64_t k0 = rptr[j], k1 = rptr[j + 1];
      TORCH_CHECK(k0 <= k1 && k0 >= 0 && k1 <= E, "rev_indptr must be non-decreasing and within [0, E]");
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t e = redge[k], i = rdst[k];
        TORCH_CHECK(e >= 0 && e < E && i >= 0 && i < num_dst, "reverse index entry out of range");
        if (k + kPrefetchDistance < E) {
          const int64_t in = rdst[k + kPrefetchDistance];
          if (in >= 0 && in < num_dst) {
            prefetch_row(g + in * HC, HC);
            prefetch_row(rec + in * 4 * H, 4 * H);
          }
          // The edge's own values sit at random places too (edge order is destination order):
          // its dz slot (for writing, or the store misses stall the loop) and its logit and mask.
          const int64_t en = redge[k + kPrefetchDistance];
          if (en >= 0 && en < E) {
            if (dz_ws) __builtin_prefetch(dz_ws + en * H, 1);
            if (el) __builtin_prefetch(el + en * H);
            if (mk) __builtin_prefetch(mk + en * H);
            if (ga) __builtin_prefetch(ga + en * H);
          }
        }
        const acc_t* r = rec + i * 4 * H;
        const scalar_t* gi = g + i * HC;
        // Head loops split so that the elementwise ones vectorise (selects, no data-dependent
        // branches): alpha = exp(s - lse) and leaky_relu' for all heads; then the per-head row
        // work (dA = <g_i, x_j> and grad x_src); then dz for all heads.
        const logit_t* asj = as + j * H;
        for (int64_t h = 0; h < H; ++h) zs[h] = static_cast<acc_t>(asj[h]) + r[h];
        if (el) {
          for (int64_t h = 0; h < H; ++h) zs[h] += static_cast<acc_t>(el[e * H + h]);
        }
        for (int64_t h = 0; h < H; ++h) {
          slope_grad[h] = leaky_relu_grad(zs[h], slope);
          alphas[h] = (leaky_relu(zs[h], slope) - r[H + h]) - r[2 * H + h];
        }
        if (mk) {
          for (int64_t h = 0; h < H; ++h) keeps[h] = mk[e * H + h] ? keep_scale : acc_t(0);
        } else {
          for (int64_t h = 0; h < H; ++h) keeps[h] = acc_t(1);
        }
        exp_inplace(alphas, H);
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* gih = gi + h * C;
          if (need_dz) dots[h] = dot<acc_t>(gih, xj + h * C, C);
          if (gxp) {
            const acc_t w = alphas[h] * keeps[h];
            acc_t* a = accx.data() + h * C;
            for (int64_t c = 0; c < C; ++c) a[c] += w * static_cast<acc_t>(gih[c]);
          }
        }
        if (need_dz) {
          for (int64_t h = 0; h < H; ++h) {
            acc_t dA = dots[h];
            if (ga) dA += static_cast<acc_t>(ga[e * H + h]);
            const acc_t dz = alphas[h] * (dA * keeps[h] - r[3 * H + h]) * slope_grad[h];
            accs[h] += dz;
            if (dz_ws) dz_ws[e * H + h] = dz;
          }
        }
      }
      if (gxp) {
        for (int64_t f = 0; f < HC; ++f) gxp[j * HC + f] = static_cast<scalar_t>(accx[f]);
      }
      if (gasp) {
        for (int64_t h = 0; h < H; ++h) gasp[j * H + h] = static_cast<logit_t>(accs[h]);
      }
    }
  });

  // Pass C, per destination: grad a_dst sums dz over the incoming edges in CSC order (a
  // sequential read); grad edge_logits is dz itself.
  if (gad) {
    logit_t* gadp = gad->data_ptr<logit_t>();
    parallel_over_rows(ptr, num_dst, H, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sum(H);
      for (int64_t i = begin; i < end; ++i) {
        std::fill(sum.begin(), sum.end(), acc_t(0));
        for (int64_t e = ptr[i]; e < ptr[i + 1]; ++e) {
          for (int64_t h = 0; h < H; ++h) sum[h] += dz_ws[e * H + h];
        }
        for (int64_t h = 0; h < H; ++h) gadp[i * H + h] = static_cast<logit_t>(sum[h]);
      }
    });
  }
  if (gel) gel->copy_(dz_t);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gat_backward_cpu(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
    const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
    const at::Tensor& rev_indptr, const at::Tensor& rev_edge, const at::Tensor& rev_dst,
    const c10::optional<at::Tensor>& dropout_mask, double negative_slope, double dropout_scale,
    std::array<bool, 4> output_mask) {
  const auto a = prepare_gat_backward(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, indptr,
                                      indices, rev_indptr, rev_edge, rev_dst, dropout_mask, dropout_scale,
                                      output_mask);
  at::Tensor gx, gas, gad, gel;
  std::tie(gx, gas, gad, gel) = allocate_gat_gradients(a);
  const auto& f = a.fwd;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, f.x_src.scalar_type(), "gat_backward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(f.indices.scalar_type(), "gat_backward_cpu_index", [&] {
      with_logit_type<scalar_t>(f.a_src.scalar_type(), [&](auto tag) {
        using logit_t = typename decltype(tag)::type;
        backward_kernel<scalar_t, logit_t, index_t>(
            a.grad_out, a.grad_alpha.defined() ? &a.grad_alpha : nullptr, a.out, a.lse, f.x_src, f.a_src, f.a_dst,
            f.edge_logits.defined() ? &f.edge_logits : nullptr, f.indptr, f.indices, a.rev_indptr, a.rev_edge,
            a.rev_dst, f.dropout_mask.defined() ? &f.dropout_mask : nullptr, negative_slope, dropout_scale,
            a.want_x ? &gx : nullptr, a.want_a_src ? &gas : nullptr, a.want_a_dst ? &gad : nullptr,
            a.want_edge_logits ? &gel : nullptr);
      });
    });
  });
  return {gx, gas, gad, gel};
}

// ------------------------------------------------------------------ SpMM / SDDMM primitives
// Each output row (SpMM) or edge (SDDMM) is written by exactly one task, summing in a fixed
// order: bitwise reproducible for any thread count.

template <typename scalar_t, typename index_t>
void spmm_kernel(const GatSpmmArgs& a, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = a.indptr.numel() - 1, E = a.neighbors.numel();
  const int64_t num_values = a.values.size(0), H = a.values.size(1), C = a.values.size(2), HC = H * C;
  const scalar_t* w = a.weight.data_ptr<scalar_t>();
  const scalar_t* v = a.values.data_ptr<scalar_t>();
  const index_t* ptr = a.indptr.data_ptr<index_t>();
  const index_t* nbr = a.neighbors.data_ptr<index_t>();
  const index_t* eid = a.edge_ids.defined() ? a.edge_ids.data_ptr<index_t>() : nullptr;
  scalar_t* o = out.data_ptr<scalar_t>();
  check_ptr_ends(ptr, rows, E, "indptr");
  parallel_over_rows(ptr, rows, HC, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(HC);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), acc_t(0));
      const int64_t k0 = ptr[n], k1 = ptr[n + 1];
      TORCH_CHECK(k0 <= k1 && k0 >= 0 && k1 <= E, "indptr must be non-decreasing and within [0, E]");
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t j = nbr[k];
        const int64_t e = eid ? static_cast<int64_t>(eid[k]) : k;
        TORCH_CHECK(j >= 0 && j < num_values, "neighbors: id ", j, " out of range [0, ", num_values, ")");
        TORCH_CHECK(e >= 0 && e < E, "edge_ids: id ", e, " out of range [0, ", E, ")");
        if (k + kPrefetchDistance < k1) {
          const int64_t jn = nbr[k + kPrefetchDistance];
          if (jn >= 0 && jn < num_values) prefetch_row(v + jn * HC, HC);
        }
        const scalar_t* vj = v + j * HC;
        const scalar_t* we = w + e * H;
        for (int64_t h = 0; h < H; ++h) {
          const acc_t wh = static_cast<acc_t>(we[h]);
          const scalar_t* vjh = vj + h * C;
          acc_t* r = acc.data() + h * C;
          for (int64_t c = 0; c < C; ++c) r[c] += wh * static_cast<acc_t>(vjh[c]);
        }
      }
      scalar_t* on = o + n * HC;
      for (int64_t f = 0; f < HC; ++f) on[f] = static_cast<scalar_t>(acc[f]);
    }
  });
}

template <typename scalar_t, typename index_t>
void sddmm_kernel(const GatSddmmArgs& a, at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = a.a.size(0), num_b = a.b.size(0), H = a.a.size(1), C = a.a.size(2), HC = H * C;
  const int64_t E = a.indices.numel();
  const scalar_t* ap = a.a.data_ptr<scalar_t>();
  const scalar_t* bp = a.b.data_ptr<scalar_t>();
  const index_t* ptr = a.indptr.data_ptr<index_t>();
  const index_t* idx = a.indices.data_ptr<index_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  check_ptr_ends(ptr, rows, E, "indptr");
  parallel_over_rows(ptr, rows, HC, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e0 = ptr[i], e1 = ptr[i + 1];
      TORCH_CHECK(e0 <= e1 && e0 >= 0 && e1 <= E, "indptr must be non-decreasing and within [0, E]");
      const scalar_t* ai = ap + i * HC;
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t j = idx[e];
        TORCH_CHECK(j >= 0 && j < num_b, "indices: id ", j, " out of range [0, ", num_b, ")");
        if (e + kPrefetchDistance < e1) {
          const int64_t jn = idx[e + kPrefetchDistance];
          if (jn >= 0 && jn < num_b) prefetch_row(bp + jn * HC, HC);
        }
        const scalar_t* bj = bp + j * HC;
        for (int64_t h = 0; h < H; ++h) o[e * H + h] = static_cast<scalar_t>(dot<acc_t>(ai + h * C, bj + h * C, C));
      }
    }
  });
}

at::Tensor gat_spmm_cpu(const at::Tensor& weight, const at::Tensor& values, const at::Tensor& indptr,
                        const at::Tensor& neighbors, const c10::optional<at::Tensor>& edge_ids) {
  const auto a = prepare_gat_spmm(weight, values, indptr, neighbors, edge_ids);
  at::Tensor out = at::empty({a.indptr.numel() - 1, a.values.size(1), a.values.size(2)}, a.values.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.values.scalar_type(), "gat_spmm_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(a.indptr.scalar_type(), "gat_spmm_cpu_index", [&] {
      spmm_kernel<scalar_t, index_t>(a, out);
    });
  });
  return out;
}

at::Tensor gat_sddmm_cpu(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& indptr,
                         const at::Tensor& indices) {
  const auto a = prepare_gat_sddmm(a_in, b_in, indptr, indices);
  at::Tensor out = at::empty({a.indices.numel(), a.a.size(1)}, a.a.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.a.scalar_type(), "gat_sddmm_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(a.indptr.scalar_type(), "gat_sddmm_cpu_index", [&] {
      sddmm_kernel<scalar_t, index_t>(a, out);
    });
  });
  return out;
}

}  // namespace
}  // namespace torch_gradops

TORCH_LIBRARY_IMPL(torch_gradops, CPU, m) {
  m.impl("gat_forward", &torch_gradops::gat_forward_cpu);
  m.impl("gat_backward", &torch_gradops::gat_backward_cpu);
  m.impl("gat_spmm", &torch_gradops::gat_spmm_cpu);
  m.impl("gat_sddmm", &torch_gradops::gat_sddmm_cpu);
}
