// Helpers shared by the CUDA graph-attention kernels (gat_cuda.cu, gatv2_cuda.cu): launch
// shapes, device math wrappers, the fixed-order warp sum, CSC pointer checks and the CSC row
// search. (The CPU kernels' twin is ../cpu/kernel_utils.h.)
#pragma once
#include <ATen/ATen.h>
#include <c10/macros/Macros.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace torch_gradops {
namespace cuda_kernels {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int64_t kMaxBlocks = 65535LL * 32;  // grid-stride beyond this

__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  // Fixed butterfly pattern: every lane ends with the same, order-determined sum.
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Graph arrays are trusted by the host code (reading them there would synchronise), so each
// node's edge range is checked where it is read: non-decreasing, within [0, E], and the first and
// last node pin the ends to 0 and E (else edges past ptr[n] would be read by one kernel only).
__device__ __forceinline__ void check_edge_range(int64_t e0, int64_t e1, int64_t node, int64_t nodes, int64_t E) {
  CUDA_KERNEL_ASSERT(0 <= e0 && e0 <= e1 && e1 <= E && "edge pointer ranges must be non-decreasing, within [0, E]");
  CUDA_KERNEL_ASSERT((node != 0 || e0 == 0) && "edge pointers must start at 0");
  CUDA_KERNEL_ASSERT((node != nodes - 1 || e1 == E) && "edge pointers must end at E");
}

// The CSC row holding position e: the largest i < rows with ptr[i] <= e (ptr non-decreasing).
template <typename index_t>
__device__ __forceinline__ int64_t csc_row_of(const index_t* __restrict__ ptr, int64_t rows, int64_t e) {
  int64_t lo = 0, hi = rows - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (static_cast<int64_t>(ptr[mid]) <= e) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// Blocks for `warps` warps of kWarpsPerBlock per block, at least one, grid-stride past kMaxBlocks.
inline unsigned warp_grid(int64_t warps) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                                                     kMaxBlocks)));
}

// Block shape for the per-(node, feature) kernels: x over features, y over nodes.
inline dim3 feature_block(int64_t HC) {
  int tx = 32;
  while (tx < HC && tx < kThreads) tx *= 2;
  return dim3(tx, kThreads / tx);
}

// Grid for the per-(node, feature) kernels: features on y (at most 65535 blocks, checked on the
// host), nodes on x (grid-stride past kMaxBlocks).
inline dim3 feature_grid(int64_t nodes, int64_t HC, const dim3& block) {
  TORCH_CHECK((HC + block.x - 1) / block.x <= 65535, "heads * channels too large for the CUDA kernels: ", HC);
  const int64_t bx = std::min<int64_t>((nodes + block.y - 1) / block.y, kMaxBlocks);
  return dim3(static_cast<unsigned>(std::max<int64_t>(bx, 1)), static_cast<unsigned>((HC + block.x - 1) / block.x));
}

}  // namespace cuda_kernels
}  // namespace torch_gradops
