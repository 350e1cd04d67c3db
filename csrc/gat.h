// Fused GAT attention: declarations shared by the dispatcher (gat.cpp) and the
// backend kernels (cpu/gat_cpu.cpp, cuda/gat_cuda.cu).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace torch_gradops {

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

// dtype in which half types accumulate and the log-sum-exp is kept.
inline at::ScalarType gat_acc_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

}  // namespace torch_gradops

// Scalar math shared by the CPU and CUDA kernels.
#if defined(__CUDACC__)
#define GRADOPS_HD __host__ __device__ __forceinline__
#else
#define GRADOPS_HD inline
#endif

namespace torch_gradops {
template <typename acc_t>
GRADOPS_HD acc_t leaky_relu(acc_t z, acc_t slope) { return z > acc_t(0) ? z : z * slope; }
template <typename acc_t>
GRADOPS_HD acc_t leaky_relu_grad(acc_t z, acc_t slope) { return z > acc_t(0) ? acc_t(1) : slope; }
}  // namespace torch_gradops
