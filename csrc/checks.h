// Shared argument checks for torch_gradops ops: every message names the argument.
#pragma once
#include <ATen/ATen.h>

namespace torch_gradops {

inline void check_same_device(const at::Tensor& ref, const char* ref_name, const at::Tensor& t,
                              const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* name) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

inline void check_floating(const at::Tensor& t, const char* name) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name,
              " must be a floating-point tensor (float64/float32/float16/bfloat16), got ",
              t.scalar_type());
}

inline void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
              " must be an int32 or int64 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
}

}  // namespace torch_gradops
