// The contraction program format, C++ side: the twin of torch_gradops/tensornet/program.py.
//
// A program is a flat int64 list that the Python planner emits once per plan:
//
//   header : VERSION, n_operands, n_sliced, out_ndim, out_shape[out_ndim], n_instr
//   SELECT  : 1, slot, dim, k                  slot = slot.select(dim, index of sliced mode k)
//   SUM     : 2, slot, n, dims[n]              slot = slot.sum(dims)
//   CONTRACT: 3, a, b, c, ra, permA[ra], rb, permB[rb], tA, tB, Bt, M, K, N, rc, shapeC[rc]
//             slot c = bmm(A, B).view(shapeC) with A = a.permute(permA).reshape(Bt,M,K) or, if tA,
//             a.permute(permA).reshape(Bt,K,M).transpose(1,2) (B likewise: [Bt,K,N] or, if tB,
//             [Bt,N,K] transposed): the planner picks the layout that needs no copy. Slots a and b
//             are released.
//   FINAL   : 4, slot, rf, perm[rf], n_blk, (pos, k)[n_blk]
//             out.select(pos, index of sliced mode k)... += slot.permute(perm)
//   CHECKPOINT: 5                              no-op forward; the backward keeps the live slots
//             here and recomputes one segment between checkpoints at a time
//
// Slots 0..n_operands-1 hold the operands; every CONTRACT creates a new slot. Changing the format
// means changing VERSION, this header and program.py together; tests/test_tensornet_program.py
// round-trips programs through both sides.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace torch_gradops {

constexpr int64_t kVersion = 1;
enum Op : int64_t { kSelect = 1, kSum = 2, kContract = 3, kFinal = 4, kCheckpoint = 5 };

struct Instr {
  int64_t op = 0;
  int64_t slot = 0, dim = 0, k = 0;             // SELECT (slot also for SUM/FINAL)
  std::vector<int64_t> dims;                    // SUM dims
  int64_t a = 0, b = 0, c = 0;                  // CONTRACT
  std::vector<int64_t> perm_a, perm_b, shape_c;
  int64_t bt = 0, m = 0, kk = 0, n = 0;
  bool ta = false, tb = false;
  std::vector<int64_t> perm;                    // FINAL
  std::vector<std::pair<int64_t, int64_t>> blocks;  // FINAL (pos, k), pos descending
};

struct Program {
  int64_t n_operands = 0, n_sliced = 0, n_slots = 0;
  std::vector<int64_t> out_shape;
  std::vector<Instr> instrs;
  std::vector<size_t> checkpoints;  // instruction indices of the CHECKPOINTs
  std::vector<size_t> consumer;     // per slot: the CONTRACT or FINAL that uses it
};

// Decodes and checks a program for n_operands operands (a malformed program is an error, never
// an out-of-range read).
Program decode_program(at::IntArrayRef program, int64_t n_operands);

// The flat int list of a decoded program (decode_program's inverse).
std::vector<int64_t> encode_program(const Program& P);

// One pairwise step of a compiled program, for the planner's memory model: multiply-adds,
// result elements and GEMM operand elements per slice, the steps whose results it copies into
// its GEMM layout, and whether its own result is copied by the step that reads it.
struct CompiledStep {
  int64_t macs = 0, result = 0, gemm_operands = 0;
  std::vector<int64_t> copied;
  bool result_copied = false;
};

struct CompiledProgram {
  std::vector<int64_t> program;  // encoded
  std::vector<CompiledStep> steps;
};

// The contraction compiler (contract_compiler.cpp; documented in
// torch_gradops/tensornet/compiler.py): the program of `path` over the network `inputs ->
// output` (mode ids 0..sizes.size()-1) with the `sliced` modes selected and a CHECKPOINT before
// each step in `checkpoints`. Steps of fewer than `quick_macs` multiply-adds over all slices get
// the quick layout instead of the search. Throws std::invalid_argument for a malformed path.
CompiledProgram compile_contract_program(const std::vector<std::vector<int64_t>>& inputs,
                                         const std::vector<int64_t>& output, const std::vector<int64_t>& sizes,
                                         const std::vector<std::pair<int64_t, int64_t>>& path,
                                         const std::vector<int64_t>& sliced, int64_t itemsize, bool is_complex,
                                         const std::vector<int64_t>& checkpoints, int64_t quick_macs);

// The planner's model of one slice's forward + backward memory (contract_memory.cpp; documented
// in torch_gradops/tensornet/slicer.py), per pairwise step of one slice, in elements. Counts are
// doubles: exact below 2^53 elements, relative error 1e-16 above (a model, not an allocation).
struct StepMemory {
  std::vector<double> result;                           // the step's result
  std::vector<int64_t> consumer;                        // the step that reads it; n for the last
  std::vector<std::pair<int64_t, int64_t>> from_step;  // the steps that made its operands; -1: operand
  std::vector<double> trans;                            // what it holds briefly (step_transients)
};

// Per step, what it holds briefly beyond the slice's intermediates (slicer._transients), from its
// operands' sizes and, when the compiled layout is known, `copies`: per step the steps whose
// results it copies into its GEMM layout and whether its reader copies its result.
std::vector<double> step_transients(const std::vector<std::pair<double, double>>& inputs,
                                    const std::vector<double>& result,
                                    const std::vector<std::pair<std::vector<int64_t>, bool>>* copies, bool is_complex);

// The modelled peak with a backward CHECKPOINT before each step in `checkpoints` (slicer.memory_model).
double checkpointed_peak(const StepMemory& c, const std::vector<int64_t>& checkpoints);

// slicer.place_checkpoints: the checkpoints of least recomputation within `cap` elements (no
// cap: none) and their modelled peak, or, when none fits, the lowest-peak placement found.
struct CheckpointPlacement {
  double peak = 0;
  std::vector<int64_t> checkpoints;
};
CheckpointPlacement place_checkpoints(const StepMemory& c, std::optional<double> cap);

}  // namespace torch_gradops
