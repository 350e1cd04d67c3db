// The torch_gradops operator library. Each op family declares its schemas with
// TORCH_LIBRARY_FRAGMENT in its own dispatcher file (gat.cpp, contract.cpp) and
// implements them per backend in csrc/cpu and csrc/cuda with TORCH_LIBRARY_IMPL.
#include <torch/extension.h>

TORCH_LIBRARY(torch_gradops, m) {}

namespace {
bool with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_gradops compiled kernels (ops are registered under torch.ops.torch_gradops)";
  m.def("with_cuda", &with_cuda, "True if the CUDA kernels were compiled in.");
}
