// Fused GATv2 attention: declarations shared by the dispatcher (gatv2.cpp) and the backend
// kernels (cpu/gatv2_cpu.cpp, cuda/gatv2_cuda.cu).
//
// For destination i, head h, incoming edge e = (j -> i) (CSC order) and channel c:
//   z[e,h,c]  = x_src[j,h,c] + x_dst[i,h,c] + ep[e,h,c]
//   ep[e,h,c] = sum_k edge_attr[r,k] * edge_weight[k,h,c]   (kProject)
//             = edge_attr[r,h,c]                            (kDirect: features already projected)
//             = 0                                           (kNone)
//   with r = edge_attr_rows[e] when given (edge_attr in the caller's edge order, read through the
//   graph's permutation: no reordered copy), else r = e (edge_attr in CSC order)
//   s[e,h]    = sum_c att[h,c] * leaky_relu(z[e,h,c])
//   alpha     = softmax of s over the incoming edges of i, then the dropout mask (scaled)
//   out[i,h,:]= sum_e alpha[e,h] * x_src[j,h,:]
// Nothing of size E x H x C is stored: the kernels recompute z where they need it.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <array>
#include <tuple>

#include "gat.h"  // gat_acc_type, leaky_relu, leaky_relu_grad

namespace torch_gradops {

// How the edge term ep of the pre-activation is formed.
enum class Gatv2EdgeMode : int { kNone = 0, kProject = 1, kDirect = 2 };

// Validates gatv2_forward's arguments (shapes, dtypes, devices); throws naming the argument.
void check_gatv2_forward_args(const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
                              const c10::optional<at::Tensor>& edge_attr,
                              const c10::optional<at::Tensor>& edge_weight, const at::Tensor& indptr,
                              const at::Tensor& indices, const c10::optional<at::Tensor>& dropout_mask,
                              double dropout_scale, const c10::optional<at::Tensor>& edge_attr_rows);

// gatv2_forward's tensors after the checks, made contiguous; an absent optional is undefined.
struct Gatv2ForwardArgs {
  at::Tensor x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask, edge_attr_rows;
  Gatv2EdgeMode edge_mode = Gatv2EdgeMode::kNone;
  int64_t edge_dim = 0;  // K of edge_attr [R, K] in kProject mode, else 0
};
Gatv2ForwardArgs prepare_gatv2_forward(const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
                                       const c10::optional<at::Tensor>& edge_attr,
                                       const c10::optional<at::Tensor>& edge_weight, const at::Tensor& indptr,
                                       const at::Tensor& indices, const c10::optional<at::Tensor>& dropout_mask,
                                       double dropout_scale, const c10::optional<at::Tensor>& edge_attr_rows);

// gatv2_forward's outputs, allocated: out [num_dst,H,C], lse [num_dst,H] (float64), alpha [E or 0, H].
std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_gatv2_outputs(const Gatv2ForwardArgs& a, bool return_alpha);

// gatv2_backward's tensors, checked and contiguous, and which gradients to compute (those of
// edge_attr / edge_weight only when they were given).
struct Gatv2BackwardArgs {
  Gatv2ForwardArgs fwd;
  at::Tensor grad_out, grad_alpha, out, lse, rev_indptr, rev_edge, rev_dst;
  bool want_x_src, want_x_dst, want_att, want_edge_attr, want_edge_weight;
  bool any() const { return want_x_src || want_x_dst || want_att || want_edge_attr || want_edge_weight; }
};
Gatv2BackwardArgs prepare_gatv2_backward(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_alpha, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& x_src, const at::Tensor& x_dst, const at::Tensor& att,
    const c10::optional<at::Tensor>& edge_attr, const c10::optional<at::Tensor>& edge_weight,
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& rev_indptr, const at::Tensor& rev_edge,
    const at::Tensor& rev_dst, const c10::optional<at::Tensor>& dropout_mask, double dropout_scale,
    std::array<bool, 5> output_mask, const c10::optional<at::Tensor>& edge_attr_rows);

// gatv2_backward's gradients (x_src, x_dst, att, edge_attr, edge_weight), allocated
// uninitialised, except grad edge_attr read through edge_attr_rows with rows no edge reads (zeros
// there); a skipped one is a distinct empty tensor, since op outputs must not alias.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> allocate_gatv2_gradients(
    const Gatv2BackwardArgs& a);

}  // namespace torch_gradops
