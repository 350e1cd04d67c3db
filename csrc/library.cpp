// The torch_gradops operator library. Each op family declares its schemas with
// TORCH_LIBRARY_FRAGMENT in its own dispatcher file (gat.cpp, contract.cpp) and
// implements them per backend in csrc/cpu and csrc/cuda with TORCH_LIBRARY_IMPL.
#include <torch/extension.h>

#include <map>
#include <string>

#include "contract_program.h"
#include "cpu/gemm_team.h"

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
  // The C++ side of the contraction program format, for the test that keeps it in step with
  // torch_gradops/tensornet/program.py.
  m.def("contract_program_format", [] {
    using namespace torch_gradops;
    return std::map<std::string, int64_t>{{"VERSION", kVersion}, {"SELECT", kSelect}, {"SUM", kSum},
                                          {"CONTRACT", kContract}, {"FINAL", kFinal}, {"CHECKPOINT", kCheckpoint}};
  }, "Version and opcodes of the contraction program format.");
  m.def("compile_contract_program",
        [](const std::vector<std::vector<int64_t>>& inputs, const std::vector<int64_t>& output,
           const std::vector<int64_t>& sizes, const std::vector<std::pair<int64_t, int64_t>>& path,
           const std::vector<int64_t>& sliced, int64_t itemsize, bool is_complex,
           const std::vector<int64_t>& checkpoints, int64_t quick_macs) {
          auto c = torch_gradops::compile_contract_program(inputs, output, sizes, path, sliced, itemsize, is_complex,
                                                           checkpoints, quick_macs);
          pybind11::tuple program(c.program.size());
          for (size_t i = 0; i < c.program.size(); ++i) program[i] = pybind11::int_(c.program[i]);
          pybind11::list steps;
          for (const auto& s : c.steps) {
            pybind11::tuple copied(s.copied.size());
            for (size_t i = 0; i < s.copied.size(); ++i) copied[i] = pybind11::int_(s.copied[i]);
            steps.append(pybind11::make_tuple(s.macs, s.result, s.gemm_operands, copied, s.result_copied));
          }
          return pybind11::make_tuple(program, steps);
        },
        "The contraction compiler (torch_gradops/tensornet/compiler.py): (encoded program, steps).");
  // The planner's memory model (torch_gradops/tensornet/slicer.py wraps these).
  using Copies = std::vector<std::pair<std::vector<int64_t>, bool>>;
  m.def("step_transients",
        [](const std::vector<std::pair<double, double>>& inputs, const std::vector<double>& result,
           const std::optional<Copies>& copies, bool is_complex) {
          return torch_gradops::step_transients(inputs, result, copies ? &*copies : nullptr, is_complex);
        },
        "Per step, what it holds briefly beyond the slice's intermediates (elements).");
  m.def("checkpointed_peak",
        [](const std::vector<double>& result, const std::vector<int64_t>& consumer, const std::vector<double>& trans,
           const std::vector<int64_t>& checkpoints) {
          torch_gradops::StepMemory c{result, consumer, {}, trans};
          return torch_gradops::checkpointed_peak(c, checkpoints);
        },
        "The modelled peak (elements) with a checkpoint before each step in checkpoints.");
  m.def("place_checkpoints",
        [](const std::vector<double>& result, const std::vector<int64_t>& consumer,
           const std::vector<std::pair<int64_t, int64_t>>& from_step, const std::vector<std::pair<double, double>>& inputs,
           const std::optional<Copies>& copies, bool is_complex, std::optional<double> cap) {
          torch_gradops::StepMemory c{result, consumer, from_step,
                                      torch_gradops::step_transients(inputs, result, copies ? &*copies : nullptr,
                                                                     is_complex)};
          auto r = torch_gradops::place_checkpoints(c, cap);
          return std::make_pair(r.peak, r.checkpoints);
        },
        "(modelled peak, checkpoints): the least-recomputation checkpoints within cap elements.");
  m.def("gemm_team_parts", &torch_gradops::gemm_team_parts_run,
        "GEMM and copy parts run by the contraction executor's GEMM team in this process so far.");
  m.def("reencode_contract_program", [](std::vector<int64_t> program, int64_t n_operands) {
    return torch_gradops::encode_program(torch_gradops::decode_program(program, n_operands));
  }, "Decode a contraction program with the executor's decoder and encode it again.");
}
