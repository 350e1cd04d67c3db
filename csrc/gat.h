// Fused GAT attention: declarations shared by the dispatcher (gat.cpp) and the
// backend kernels (cpu/gat_cpu.cpp, cuda/gat_cuda.cu).
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/Optional.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace torch_gradops {

// TORCH_GRADOPS_CUDA_EDGE_BATCH=1: the GAT and GATv2 CUDA forward kernels walk one edge at a
// time (the schedule measured before edge batching) instead of their batch, so that both can be
// timed from one build. Read once per process.
inline bool cuda_forward_one_edge_at_a_time() {
  static const bool one = [] {
    const char* v = std::getenv("TORCH_GRADOPS_CUDA_EDGE_BATCH");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return one;
}

// Validates gat_forward's arguments (shapes, dtypes, devices); throws with the argument's name.
void check_gat_forward_args(const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
                            const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr,
                            const at::Tensor& indices, const c10::optional<at::Tensor>& dropout_mask,
                            double dropout_scale);

// Validates gat_backward's extra arguments (after check_gat_forward_args on the shared ones).
void check_gat_backward_args(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha,
                             const at::Tensor& out, const at::Tensor& lse, const at::Tensor& x_src,
                             const at::Tensor& a_dst, const at::Tensor& indices,
                             const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
                             const at::Tensor& rev_dst);

// gat_forward's tensors after check_gat_forward_args, made contiguous; an absent optional is an
// undefined tensor. Both backends start from this.
struct GatForwardArgs {
  at::Tensor x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask;
};
GatForwardArgs prepare_gat_forward(const at::Tensor& x_src, const at::Tensor& a_src,
                                   const at::Tensor& a_dst, const c10::optional<at::Tensor>& edge_logits,
                                   const at::Tensor& indptr, const at::Tensor& indices,
                                   const c10::optional<at::Tensor>& dropout_mask, double dropout_scale);

// gat_forward's outputs, allocated: out [num_dst,H,C], lse [num_dst,H], alpha [E or 0, H].
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_gat_outputs(const GatForwardArgs& a, bool return_alpha);

// gat_backward's tensors, checked and contiguous, and which gradients to compute (the edge
// logits' only when they were given).
struct GatBackwardArgs {
  GatForwardArgs fwd;
  at::Tensor grad_out, grad_alpha, out, lse, rev_indptr, rev_edge, rev_dst;
  bool want_x, want_a_src, want_a_dst, want_edge_logits;
};
GatBackwardArgs prepare_gat_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& a_src, const at::Tensor& a_dst,
    const c10::optional<at::Tensor>& edge_logits, const at::Tensor& indptr, const at::Tensor& indices,
    const at::Tensor& rev_indptr, const at::Tensor& rev_edge, const at::Tensor& rev_dst,
    const c10::optional<at::Tensor>& dropout_mask, double dropout_scale, std::array<bool, 4> output_mask);

// gat_backward's gradients, allocated (uninitialised); a skipped one is a distinct empty tensor,
// since op outputs must not alias.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_gat_gradients(const GatBackwardArgs& a);

// gat_spmm: out[n,h,:] = sum over k in indptr[n]..indptr[n+1] of
//   weight[edge_ids[k] (or k), h] * values[neighbors[k], h, :]
// (edge-weighted aggregation into destinations over the CSC arrays, or into sources over the
// reverse index with edge_ids mapping back to CSC positions). Checked and contiguous; an absent
// edge_ids is an undefined tensor.
struct GatSpmmArgs {
  at::Tensor weight, values, indptr, neighbors, edge_ids;
};
GatSpmmArgs prepare_gat_spmm(const at::Tensor& weight, const at::Tensor& values, const at::Tensor& indptr,
                             const at::Tensor& neighbors, const c10::optional<at::Tensor>& edge_ids);

// gat_sddmm: out[e,h] = <a[i,h,:], b[indices[e],h,:]> for the CSC positions e of row i
// (per-edge dot products, in CSC order). Checked and contiguous.
struct GatSddmmArgs {
  at::Tensor a, b, indptr, indices;
};
GatSddmmArgs prepare_gat_sddmm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& indptr,
                               const at::Tensor& indices);

// dtype in which half types accumulate.
inline at::ScalarType gat_acc_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

// The log-sum-exp the forwards save is float64 for every input dtype: the backwards form each
// weight as exp(s - lse), and at large scores (past about 1e5) a float32 lse = max + log(sum)
// rounds away the log of the sum. They split it into hi = lse rounded to the accumulation type
// and lo = the rest, and take exp((s - hi) - lo): s - hi is exact where the weight matters (s
// near the maximum), so the arithmetic stays in the accumulation type.
constexpr at::ScalarType kLseType = at::kDouble;

// Checks that `t` holds logits of features of dtype `features`: that dtype, or float32 for half
// features (as PyG's layers compute them under autocast: float32 attention parameters times
// half features), and the same dtype as the other logits (`logits`).
void check_logit_dtype(const at::Tensor& t, at::ScalarType features, at::ScalarType logits, const char* name);

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<logit_t>{}) with the element type of the logits (and of alpha and the logits'
// gradients): scalar_t, or its float32 accumulate type for half features with float32 logits.
template <typename scalar_t, typename F>
void with_logit_type(at::ScalarType logits, F&& f) {
  using acc_t = at::opmath_type<scalar_t>;
  if constexpr (!std::is_same<acc_t, scalar_t>::value) {
    if (logits != c10::CppTypeToScalarType<scalar_t>::value) {
      TORCH_CHECK(logits == c10::CppTypeToScalarType<acc_t>::value, "logits of ",
                  c10::CppTypeToScalarType<scalar_t>::value, " features must have their dtype or float32, got ",
                  logits);
      f(TypeTag<acc_t>{});
      return;
    }
  }
  f(TypeTag<scalar_t>{});
}

}  // namespace torch_gradops

// Scalar math shared by the CPU and CUDA kernels.
#if defined(__CUDACC__)
#define GRADOPS_HD __host__ __device__ __forceinline__
#else
#define GRADOPS_HD inline
#endif
#define GRADOPS_HAS_ASSOC_BARRIER 0
#if defined(__has_builtin)
#if __has_builtin(__builtin_assoc_barrier)
#undef GRADOPS_HAS_ASSOC_BARRIER
#define GRADOPS_HAS_ASSOC_BARRIER 1
#endif
#endif

namespace torch_gradops {
// z * slope rounded on its own: never fused into a multiply-add with what uses the score (GCC and
// nvcc contract by default), so that every pass that recomputes a score gets the same value. At
// scores of 1e4-1e8 a fused product in one pass and a rounded one in another moved a weight
// exp(s - lse) by up to half an ulp of s in the exponent (GAT's x_src gradient off by 1e-4-0.7).
template <typename T>
GRADOPS_HD T mul_rounded(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same<T, double>::value) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#elif defined(__CUDACC__)
  return a * b;  // the host side of CUDA sources: no kernel runs it
#elif GRADOPS_HAS_ASSOC_BARRIER  // GCC >= 12, Clang >= 15
  return __builtin_assoc_barrier(a * b);
#else
  return a * b;  // (older compilers: scores at 1e4 and up may then lose accuracy in the backward)
#endif
}
template <typename acc_t>
GRADOPS_HD acc_t leaky_relu(acc_t z, acc_t slope) { return z > acc_t(0) ? z : mul_rounded(z, slope); }
template <typename acc_t>
GRADOPS_HD acc_t leaky_relu_grad(acc_t z, acc_t slope) { return z > acc_t(0) ? acc_t(1) : slope; }
// lse (float64) split for exp((s - hi) - lo) in acc_t: see kLseType. (-inf, for a destination
// without edges, gives lo NaN; no weight is formed there.)
template <typename acc_t>
GRADOPS_HD void split_lse(double lse, acc_t& hi, acc_t& lo) {
  hi = static_cast<acc_t>(lse);
  lo = static_cast<acc_t>(lse - static_cast<double>(hi));
}
// The log-sum-exp the forwards save: max + log(sum), in float64; -inf for a destination without
// edges (max -inf, sum 0), as for one whose every score is -inf.
template <typename acc_t>
GRADOPS_HD double lse_of(acc_t run_max, acc_t run_sum) {
  return static_cast<double>(run_max) + log(static_cast<double>(run_sum));
}
}  // namespace torch_gradops
