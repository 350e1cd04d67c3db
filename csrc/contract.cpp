// Executor for compiled tensor-network contraction programs (torch_gradops/tensornet/).
//
// The program format (opcodes, layout) is in contract_program.h, the twin of
// torch_gradops/tensornet/program.py.
//
// Slots 0..n_operands-1 hold the operands; every CONTRACT creates a new slot. A "slice table"
// holds one row of n_sliced indices per slice to run; the op runs all rows in one call and sums
// them (or writes output blocks, for sliced output modes). Everything goes through ATen, so the
// same code serves CPU and CUDA on the current stream; the op is CompositeExplicitAutograd and
// its autograd lives in Python (ContractFunction), whose backward calls
// contract_program_backward: it recomputes one slice at a time, keeping only that slice's
// intermediates (segment by segment between CHECKPOINTs), writes each intermediate's gradient
// over the intermediate (so the backward holds no more than the recomputed slice), and
// accumulates each operand's gradient across slices. contract_program_accumulate adds the
// gradients of further slice chunks into the same buffers and, for a one-element output, runs
// each slice's forward and backward in one pass (the value and the gradients under a unit
// cotangent), saving the recomputation. The planner's memory model of all this is
// torch_gradops/tensornet/slicer.py's memory_model.
//
// The entry points run below autograd and ADInplaceOrView (ExecutorScope): autograd is
// ContractFunction's, and the view tracking of the executor's own permute/reshape/select/
// transpose calls (dozens per step and slice, all on tensors it creates or only reads) cost
// about a quarter of the time of plans of many small steps. The one in-place write the caller
// can see, into contract_program_accumulate's `grads`, bumps their version counters itself.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <optional>
#include <vector>

#include "checks.h"
#include "contract_program.h"
#include "cpu/gemm_team.h"
#include "cpu/strided_copy.h"

namespace torch_gradops {
namespace {

// Bounds-checked reader: a malformed program is an error, never an out-of-range read.
struct Reader {
  at::IntArrayRef p;
  size_t i = 0;
  int64_t next() {
    TORCH_CHECK(i < p.size(), "contract_program: program is truncated (read past ", p.size(), " ints)");
    return p[i++];
  }
  std::vector<int64_t> vec(int64_t n) {
    TORCH_CHECK(n >= 0 && static_cast<size_t>(n) <= p.size() - std::min(i, p.size()),
                "contract_program: program is truncated");
    std::vector<int64_t> v(p.begin() + i, p.begin() + i + n);
    i += n;
    return v;
  }
};

}  // namespace

Program decode_program(at::IntArrayRef prog, int64_t n_given) {
  Reader r{prog};
  Program P;
  TORCH_CHECK(r.next() == kVersion, "contract_program: unknown program version");
  P.n_operands = r.next();
  TORCH_CHECK(P.n_operands == n_given, "contract_program: the program is for ", P.n_operands,
              " operands, got ", n_given);
  P.n_sliced = r.next();
  TORCH_CHECK(P.n_sliced >= 0, "contract_program: bad n_sliced");
  P.out_shape = r.vec(r.next());
  const int64_t n_instr = r.next();
  P.n_slots = P.n_operands;
  auto slot_ok = [&](int64_t s) {
    TORCH_CHECK(s >= 0 && s < P.n_slots, "contract_program: slot ", s, " out of range");
    return s;
  };
  for (int64_t t = 0; t < n_instr; ++t) {
    Instr in;
    in.op = r.next();
    switch (in.op) {
      case kSelect:
        in.slot = slot_ok(r.next());
        in.dim = r.next();
        in.k = r.next();
        TORCH_CHECK(in.k >= 0 && in.k < P.n_sliced, "contract_program: bad sliced-mode index");
        break;
      case kSum:
        in.slot = slot_ok(r.next());
        in.dims = r.vec(r.next());
        break;
      case kContract:
        in.a = slot_ok(r.next());
        in.b = slot_ok(r.next());
        in.c = r.next();
        TORCH_CHECK(in.c == P.n_slots, "contract_program: CONTRACT must create slot ", P.n_slots);
        P.n_slots += 1;
        in.perm_a = r.vec(r.next());
        in.perm_b = r.vec(r.next());
        in.ta = r.next() != 0;
        in.tb = r.next() != 0;
        in.bt = r.next();
        in.m = r.next();
        in.kk = r.next();
        in.n = r.next();
        in.shape_c = r.vec(r.next());
        break;
      case kCheckpoint:
        P.checkpoints.push_back(static_cast<size_t>(t));
        break;
      case kFinal: {
        in.slot = slot_ok(r.next());
        in.perm = r.vec(r.next());
        const int64_t nb = r.next();
        for (int64_t j = 0; j < nb; ++j) {
          const int64_t pos = r.next(), k = r.next();
          TORCH_CHECK(k >= 0 && k < P.n_sliced, "contract_program: bad sliced-mode index");
          in.blocks.emplace_back(pos, k);
        }
        TORCH_CHECK(t == n_instr - 1, "contract_program: FINAL must be the last instruction");
        break;
      }
      default:
        TORCH_CHECK(false, "contract_program: unknown instruction ", in.op);
    }
    P.instrs.push_back(std::move(in));
  }
  TORCH_CHECK(!P.instrs.empty() && P.instrs.back().op == kFinal,
              "contract_program: program has no FINAL instruction");
  TORCH_CHECK(r.i == prog.size(), "contract_program: trailing ints after the program");
  P.consumer.assign(P.n_slots, P.instrs.size());
  for (size_t t = 0; t < P.instrs.size(); ++t) {
    const Instr& in = P.instrs[t];
    if (in.op == kContract) P.consumer[in.a] = P.consumer[in.b] = t;
    if (in.op == kFinal) P.consumer[in.slot] = t;
  }
  return P;
}

std::vector<int64_t> encode_program(const Program& P) {
  std::vector<int64_t> out{kVersion, P.n_operands, P.n_sliced, static_cast<int64_t>(P.out_shape.size())};
  out.insert(out.end(), P.out_shape.begin(), P.out_shape.end());
  out.push_back(static_cast<int64_t>(P.instrs.size()));
  auto vec = [&](const std::vector<int64_t>& v) {
    out.push_back(static_cast<int64_t>(v.size()));
    out.insert(out.end(), v.begin(), v.end());
  };
  for (const Instr& in : P.instrs) {
    out.push_back(in.op);
    switch (in.op) {
      case kSelect:
        out.insert(out.end(), {in.slot, in.dim, in.k});
        break;
      case kSum:
        out.push_back(in.slot);
        vec(in.dims);
        break;
      case kContract:
        out.insert(out.end(), {in.a, in.b, in.c});
        vec(in.perm_a);
        vec(in.perm_b);
        out.insert(out.end(), {int64_t(in.ta), int64_t(in.tb), in.bt, in.m, in.kk, in.n});
        vec(in.shape_c);
        break;
      case kFinal:
        out.push_back(in.slot);
        vec(in.perm);
        out.push_back(static_cast<int64_t>(in.blocks.size()));
        for (const auto& [pos, k] : in.blocks) out.insert(out.end(), {pos, k});
        break;
      default:  // kCheckpoint: no operands
        break;
    }
  }
  return out;
}

namespace {

int64_t num_rows(const Program& P, at::IntArrayRef table) {
  if (P.n_sliced == 0) {
    TORCH_CHECK(table.empty(), "contract_program: slice_table must be empty for an unsliced program");
    return 1;
  }
  TORCH_CHECK(table.size() % P.n_sliced == 0, "contract_program: slice_table length ", table.size(),
              " is not a multiple of the number of sliced modes ", P.n_sliced);
  return static_cast<int64_t>(table.size()) / P.n_sliced;
}

// a * b, refusing int64 overflow (sizes in a malformed program can be anything).
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r = 0;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &r), "contract_program: ", what, " overflows int64");
  return r;
}

int64_t numel_of(at::IntArrayRef shape, const char* what) {
  int64_t n = 1;
  for (int64_t e : shape) {
    TORCH_CHECK(e >= 0, "contract_program: ", what, " has a negative extent: ", shape);
    n = checked_mul(n, e, what);
  }
  return n;
}

bool is_permutation(const std::vector<int64_t>& perm, size_t rank) {
  if (perm.size() != rank) return false;
  std::vector<char> seen(rank, 0);
  for (int64_t d : perm) {
    if (d < 0 || d >= static_cast<int64_t>(rank) || seen[d]) return false;
    seen[d] = 1;
  }
  return true;
}

// Checks a decoded program against its operands and slice table before anything runs: slots
// read only while they hold a tensor, SELECT and SUM dims within their slot's rank, every
// permutation a permutation of its slot's dims, GEMM sizes that match the slots they reshape,
// FINAL's result of out_shape's block shape, slice-table entries within their modes' extents.
// The executor indexes shape vectors with these numbers, so a malformed program (the ops are
// public through torch.ops) must fail here with an error, not read out of range later. Linear
// in the program and the table.
void check_program(const Program& P, at::TensorList operands, at::IntArrayRef table) {
  std::vector<std::vector<int64_t>> shp(P.n_slots);
  std::vector<char> live(P.n_slots, 0), summed(P.n_operands, 0);
  for (int64_t i = 0; i < P.n_operands; ++i) {
    shp[i] = operands[i].sizes().vec();
    live[i] = 1;
  }
  std::vector<int64_t> extent(P.n_sliced, -1);  // per sliced mode, once a SELECT or block fixes it
  auto fix_extent = [&](int64_t k, int64_t e) {
    TORCH_CHECK(extent[k] < 0 || extent[k] == e, "contract_program: sliced mode ", k, " has extent ", extent[k],
                " in one place and ", e, " in another");
    extent[k] = e;
  };
  auto read = [&](int64_t s, const char* what) -> std::vector<int64_t>& {
    TORCH_CHECK(live[s], "contract_program: ", what, " reads slot ", s,
                ", which holds no tensor there (released by an earlier CONTRACT, or made later)");
    return shp[s];
  };
  for (const Instr& in : P.instrs) {
    switch (in.op) {
      case kSelect: {
        TORCH_CHECK(in.slot < P.n_operands, "contract_program: SELECT applies to operands only, got slot ", in.slot);
        TORCH_CHECK(!summed[in.slot], "contract_program: SELECT of operand ", in.slot, " after a SUM of it");
        std::vector<int64_t>& s = read(in.slot, "SELECT");
        TORCH_CHECK(in.dim >= 0 && in.dim < static_cast<int64_t>(s.size()), "contract_program: SELECT dim ", in.dim,
                    " is out of range for operand ", in.slot, " with ", s.size(), " dims left");
        fix_extent(in.k, s[in.dim]);
        s.erase(s.begin() + in.dim);
        break;
      }
      case kSum: {
        std::vector<int64_t>& s = read(in.slot, "SUM");
        if (in.slot < P.n_operands) summed[in.slot] = 1;
        std::vector<char> seen(s.size(), 0);
        for (int64_t d : in.dims) {
          TORCH_CHECK(d >= 0 && d < static_cast<int64_t>(s.size()) && !seen[d], "contract_program: SUM dims ",
                      at::IntArrayRef(in.dims), " are not distinct dims of slot ", in.slot, " (", s.size(), " dims)");
          seen[d] = 1;
        }
        std::vector<int64_t> kept;
        for (size_t d = 0; d < s.size(); ++d)
          if (!seen[d]) kept.push_back(s[d]);
        s = std::move(kept);
        break;
      }
      case kContract: {
        TORCH_CHECK(in.a != in.b, "contract_program: CONTRACT of slot ", in.a, " with itself");
        const std::vector<int64_t>& sa = read(in.a, "CONTRACT");
        const std::vector<int64_t>& sb = read(in.b, "CONTRACT");
        TORCH_CHECK(is_permutation(in.perm_a, sa.size()) && is_permutation(in.perm_b, sb.size()),
                    "contract_program: CONTRACT permutations ", at::IntArrayRef(in.perm_a), " and ",
                    at::IntArrayRef(in.perm_b), " do not permute its operands' dims (", sa.size(), " and ", sb.size(),
                    ")");
        const char* what = "a CONTRACT's GEMM size";
        TORCH_CHECK(in.bt >= 0 && in.m >= 0 && in.kk >= 0 && in.n >= 0, "contract_program: negative GEMM size");
        const int64_t mk = checked_mul(checked_mul(in.bt, in.m, what), in.kk, what);
        const int64_t kn = checked_mul(checked_mul(in.bt, in.kk, what), in.n, what);
        const int64_t mn = checked_mul(checked_mul(in.bt, in.m, what), in.n, what);
        TORCH_CHECK(numel_of(sa, "an operand") == mk && numel_of(sb, "an operand") == kn &&
                        numel_of(in.shape_c, "a CONTRACT's result shape") == mn,
                    "contract_program: CONTRACT of slots ", in.a, " ", at::IntArrayRef(sa), " and ", in.b, " ",
                    at::IntArrayRef(sb), " into ", at::IntArrayRef(in.shape_c), " does not match its GEMM [", in.bt,
                    ", ", in.m, ", ", in.kk, "] x [", in.bt, ", ", in.kk, ", ", in.n, "]");
        live[in.a] = live[in.b] = 0;
        live[in.c] = 1;
        shp[in.c] = in.shape_c;
        break;
      }
      case kFinal: {
        const std::vector<int64_t>& s = read(in.slot, "FINAL");
        TORCH_CHECK(is_permutation(in.perm, s.size()), "contract_program: FINAL permutation ",
                    at::IntArrayRef(in.perm), " does not permute the dims of slot ", in.slot, " (", s.size(), ")");
        numel_of(P.out_shape, "out_shape");
        std::vector<int64_t> block = P.out_shape;
        int64_t prev = static_cast<int64_t>(block.size());
        for (const auto& [pos, k] : in.blocks) {  // descending positions, as block_of selects them
          TORCH_CHECK(pos >= 0 && pos < prev, "contract_program: FINAL block positions must descend within the "
                      "output's ", P.out_shape.size(), " dims");
          fix_extent(k, block[pos]);
          block.erase(block.begin() + pos);
          prev = pos;
        }
        std::vector<int64_t> permuted;
        for (int64_t d : in.perm) permuted.push_back(s[d]);
        TORCH_CHECK(permuted == block, "contract_program: the result ", at::IntArrayRef(permuted),
                    " does not fill the output block ", at::IntArrayRef(block), " of out_shape ",
                    at::IntArrayRef(P.out_shape));
        break;
      }
      default:  // kCheckpoint
        break;
    }
  }
  if (P.n_sliced == 0) return;
  for (size_t j = 0; j < table.size(); ++j) {
    const int64_t k = static_cast<int64_t>(j % P.n_sliced), v = table[j];
    TORCH_CHECK(v >= 0 && (extent[k] < 0 || v < extent[k]), "contract_program: slice_table entry ", v,
                " for sliced mode ", k, " is out of range [0, ", extent[k] < 0 ? 0 : extent[k], ")");
  }
}

void check_operands(at::TensorList operands) {
  TORCH_CHECK(!operands.empty(), "contract_program: needs at least one operand");
  for (size_t i = 1; i < operands.size(); ++i) {
    TORCH_CHECK(operands[i].scalar_type() == operands[0].scalar_type(), "contract_program: operand ", i,
                " has dtype ", operands[i].scalar_type(), ", operand 0 has ", operands[0].scalar_type());
    check_same_device(operands[0], "operand 0", operands[i], "every operand");
  }
}

}  // namespace
}  // namespace torch_gradops

namespace torch_gradops {
namespace {

// Whether OMP_WAIT_POLICY=PASSIVE: OpenMP workers then sleep between parallel regions instead of
// spinning, and waking them costs about 0.14 ms on a 2-core VM.
bool passive_omp_workers() {
  static const bool passive = [] {
    const char* v = std::getenv("OMP_WAIT_POLICY");
    if (v == nullptr) return false;
    std::string s(v);
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
    return s == "passive";
  }();
  return passive;
}

// GEMMs below this many real multiply-adds run on the calling thread: MKL opens an OpenMP team
// for every call, and waking its workers can cost more than they save. With spinning workers
// (the default policy) measured on a 2-core VM: one thread is faster below 2^20 multiply-adds
// (20-40 us on one core), two are 1.3-1.9x faster from 2^20 to 2^24. With sleeping workers
// (PASSIVE) p threads win when a GEMM's one-core time T1 exceeds wake + T1 / p, i.e. above
// wake x p / (p - 1); the wake, 0.14 ms, is the time of about 6e6 multiply-adds on one core
// (there: 64 x 64 x 2048 takes 0.19 ms on one thread, 0.24 ms on two; 512 x 128 x 256, 0.33
// and 0.26 ms).
double serial_gemm_macs() {
  if (!passive_omp_workers()) return 1 << 20;
  const int p = std::max(2, at::get_num_threads());
  return 6e6 * p / (p - 1);
}

// Real GEMMs whose result rows are shorter than this, over at least kThinMinMacs multiply-adds,
// run as C^T = B^T A^T (see matmul3).
constexpr int64_t kThinRow = 16;
constexpr double kThinMinMacs = 1 << 17;
constexpr int64_t kThinWhole = 1 << 14;

// Elements below which a step's tensors are handled on the calling thread under PASSIVE.
constexpr double kSerialStepElems = 1 << 20;

// Whether a CONTRACT step runs on the calling thread alone (SerialOmp): with sleeping OpenMP
// workers, when its GEMM runs on one BLAS thread (serial_gemm_macs) and its operands and result
// have fewer than kSerialStepElems elements each.
bool serial_step(const Instr& in, const at::Tensor& like) {
  if (!passive_omp_workers() || !like.defined() || !like.device().is_cpu()) return false;
  const double bt = static_cast<double>(in.bt), m = in.m, k = in.kk, n = in.n;
  const double macs = bt * m * k * n * (like.is_complex() ? 4 : 1);
  return macs < serial_gemm_macs() && std::max({bt * m * k, bt * k * n, bt * m * n}) < kSerialStepElems;
}

// Every entry point's ATen calls skip the autograd and ADInplaceOrView kernels (see the top), and
// autocast's: the program runs in its operands' dtype (under torch.autocast a bmm would come back
// in bfloat16 and its out= variants refuse the float32 buffers; contract() casts the operands
// itself, as torch.einsum's autocast policy does).
struct ExecutorScope {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

// GEMMs of at least this many multiply-adds (complex counted 4x) are split across the GEMM team
// when the executor call holds it (team_threads): about 3 us on one core, where handing a part to a
// spinning helper costs well under a microsecond.
constexpr double kSplitMinMacs = 1 << 18;
// Rows or columns per part, at least, when a single GEMM is split along M or N.
constexpr int64_t kSplitMinWidth = 16;

// The threads of the GEMM team that an executor call on `like`'s device runs its GEMMs on (0:
// none): ATen's thread count on the CPU with sleeping OpenMP workers (PASSIVE; otherwise the
// spinning workers serve as well), outside a parallel region.
int64_t team_threads(const at::Tensor& like) {
  if (!passive_omp_workers() || !like.defined() || !like.device().is_cpu() || at::in_parallel_region()) return 0;
  return at::get_num_threads();
}

// out = A B ([Bt,M,K] x [Bt,K,N] -> [Bt,M,N], `out` contiguous) in a part per thread of the
// GEMM team (one BLAS thread each): over the batch when it has a part per thread, else
// (one batch) over the longer of M and N in blocks of at least kSplitMinWidth. False (nothing
// done) when the call does not hold the team or the GEMM is too narrow to split.
bool split_matmul3(const at::Tensor& a3, const at::Tensor& b3, at::Tensor& out) {
  const int64_t bt = a3.size(0), m = a3.size(1), n = b3.size(2);
  int64_t parts = gemm_team_threads();
  int axis = 0;  // 0: batches, 1: rows, 2: columns
  int64_t len = bt;
  if (bt < parts) {
    if (bt != 1) return false;
    axis = m >= n ? 1 : 2;
    len = std::max(m, n);
    parts = std::min(parts, len / kSplitMinWidth);
  }
  if (parts < 2) return false;
  return gemm_team_run(parts, [&](int64_t i) {
    const int64_t lo = len * i / parts, w = len * (i + 1) / parts - lo;
    SerialBlas serial(true);  // the helpers run on one BLAS thread already
    if (axis == 0) {
      at::Tensor o = out.narrow(0, lo, w);
      at::bmm_out(o, a3.narrow(0, lo, w), b3.narrow(0, lo, w));
    } else if (axis == 1) {
      at::Tensor o = out.select(0, 0).narrow(0, lo, w);
      at::mm_out(o, a3.select(0, 0).narrow(0, lo, w), b3.select(0, 0));
    } else {
      at::Tensor o = out.select(0, 0).narrow(1, lo, w);
      at::mm_out(o, a3.select(0, 0), b3.select(0, 0).narrow(1, lo, w));
    }
  });
}

// C = A B for [Bt,M,K] x [Bt,K,N], into `into` when given.
at::Tensor matmul3(const at::Tensor& a3, const at::Tensor& b3, at::Tensor* into = nullptr) {
  // Always bmm, even for one batch: for tiny products ATen's CPU bmm uses its own loop, where
  // mm would call BLAS, whose thread start-up dominates small GEMMs.
  const double macs = static_cast<double>(a3.numel()) * b3.size(2) * (a3.is_complex() ? 4 : 1);
  const bool cpu = a3.device().is_cpu();
  SerialBlas serial(cpu && macs < serial_gemm_macs());
  const int64_t m = a3.size(1), k = a3.size(2), n = b3.size(2);
  const bool real = a3.scalar_type() == at::kFloat || a3.scalar_type() == at::kDouble;
  if (cpu && real && n < kThinRow && m >= 4 * n && k >= 4 * n && macs >= kThinMinMacs) {
    // Result rows of n < 16 elements: MKL's row-major GEMM runs at 3-25 GFLOP/s on such shapes
    // and at 40-47 on the transposed product (AMD EPYC, float32, [2048,64] x [64,8]: 2-12x
    // faster, the transposing copy included; complex GEMMs gain nothing). The transposed
    // product of a block of rows goes through a buffer the memory model does not count: blocks
    // of a quarter of the rows (m >= 4n keeps each block's GEMM at least n wide) bound it by a
    // quarter of the result, which the step makes anyway; results of at most kThinWhole elements
    // go in one block.
    at::Tensor out = into ? *into : at::empty({a3.size(0), m, n}, a3.options());
    const int64_t rows = out.numel() > kThinWhole ? (m + 3) / 4 : m;
    const at::Tensor bt = b3.transpose(1, 2);
    for (int64_t r0 = 0; r0 < m; r0 += rows) {
      const int64_t r = std::min(rows, m - r0);
      out.narrow(1, r0, r).copy_(at::bmm(bt, a3.narrow(1, r0, r).transpose(1, 2)).transpose(1, 2));
    }
    return out;
  }
  if (cpu && macs >= kSplitMinMacs) {
    at::Tensor out = into ? *into : at::empty({a3.size(0), m, n}, a3.options());
    if (split_matmul3(a3, b3, out)) return out;
    return at::bmm_out(out, a3, b3);
  }
  return into ? at::bmm_out(*into, a3, b3) : at::bmm(a3, b3);
}

// Copies of at least this many elements are split across the GEMM team when the call holds it
// (or across ATen's threads when it does not).
constexpr int64_t kSplitMinCopy = 1 << 14;

// dst.copy_(src): on the CPU by the tiled strided copy (cpu/strided_copy.h), else ATen's.
void layout_copy(at::Tensor dst, const at::Tensor& src) {
  if (!strided_copy_cpu(dst, src)) dst.copy_(src);
}

// t.reshape(shape); a copy (when the memory order does not allow a view) is split across the
// GEMM team along the first dimension with a part per thread. On the CPU the copy is tiled, so
// that a permutation moving the source's contiguous dimension outward still reads and writes
// whole cache lines (cpu/strided_copy.h: 1.3-7x ATen's copy_ on runs of 2-16 elements).
at::Tensor reshape_for_gemm(const at::Tensor& t, at::IntArrayRef shape) {
  if (!t.device().is_cpu() || t.is_conj() || t.is_neg() || at::detail::computeStride(t.sizes(), t.strides(), shape))
    return t.reshape(shape);
  at::Tensor out = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t parts = gemm_team_threads();
  // The dimension the parts split: the first with a part per thread.
  const int64_t want = std::max<int64_t>({parts, static_cast<int64_t>(at::get_num_threads()), 2});
  int64_t d = 0;
  while (d < t.dim() && t.size(d) < want) ++d;
  if (t.numel() < kSplitMinCopy) {
    layout_copy(out, t);
  } else if (d == t.dim()) {
    out.copy_(t);  // no dimension to split per thread: ATen's copy, which splits its own way
  } else if (parts >= 2) {
    gemm_team_run(parts, [&](int64_t i) {
      const int64_t lo = t.size(d) * i / parts, w = t.size(d) * (i + 1) / parts - lo;
      layout_copy(out.narrow(d, lo, w), t.narrow(d, lo, w));
    });
  } else {
    const int64_t per_index = t.numel() / t.size(d);
    const int64_t grain = std::max<int64_t>(1, (kSplitMinCopy + per_index - 1) / per_index);
    at::parallel_for(0, t.size(d), grain, [&](int64_t lo, int64_t hi) {
      layout_copy(out.narrow(d, lo, hi - lo), t.narrow(d, lo, hi - lo));
    });
  }
  return out.view(shape);
}

// The GEMM operands as stored ([Bt,M,K] or, transposed, [Bt,K,M]; [Bt,K,N] or [Bt,N,K]) and as
// bmm takes them.
at::Tensor stored_a(const at::Tensor& slot, const Instr& in) {
  return reshape_for_gemm(slot.permute(in.perm_a),
                          in.ta ? at::IntArrayRef{in.bt, in.kk, in.m} : at::IntArrayRef{in.bt, in.m, in.kk});
}
at::Tensor stored_b(const at::Tensor& slot, const Instr& in) {
  return reshape_for_gemm(slot.permute(in.perm_b),
                          in.tb ? at::IntArrayRef{in.bt, in.n, in.kk} : at::IntArrayRef{in.bt, in.kk, in.n});
}
at::Tensor gemm_a(const at::Tensor& stored, const Instr& in) { return in.ta ? stored.transpose(1, 2) : stored; }
at::Tensor gemm_b(const at::Tensor& stored, const Instr& in) { return in.tb ? stored.transpose(1, 2) : stored; }

at::Tensor block_of(at::Tensor t, const Instr& fin, const int64_t* idx) {
  for (const auto& [pos, k] : fin.blocks) t = t.select(pos, idx[k]);
  return t;
}

// Saved per CONTRACT step by the backward's recomputation: the GEMM operands that the
// gradients need and the permuted shapes to undo the reshapes.
struct Saved {
  at::Tensor a3, b3;
  std::vector<int64_t> shape_a, shape_b;  // after permute, before reshape
  // The stored operand owns its memory (a fresh intermediate of this slice or a copy, contiguous,
  // not kept by the forward's cache): the backward may overwrite it with its own gradient, which
  // keeps the backward's memory that of the recomputed slice.
  bool a_owned = false, b_owned = false;
};

// Whether a stored GEMM operand may be overwritten by its gradient: contiguous, without a conj
// bit, and either a copy of its slot or a view of an intermediate (intermediates are created per
// slice and read once; operands belong to the caller).
bool owns(const at::Tensor& stored, const at::Tensor& slot, bool slot_is_intermediate) {
  if (!stored.is_contiguous() || stored.is_conj() || stored.is_neg()) return false;
  return slot_is_intermediate || !stored.is_alias_of(slot);
}

// kRun: the forward. kRecord: the forward, also keeping in `saved` the GEMM operands that the
// gradients of the slots in `needs` use. kBackward: as kRecord but without the last GEMM (the
// backward needs its inputs, not its result). kReplay: no GEMM at all; the GEMM operands come
// from `replay` (what a kRecord forward returned: two per CONTRACT, empty where not kept).
// Except in kRun, shapes are tracked so that `sum_shapes` gets the pre-sum shape of each SUM.
enum class Mode { kRun, kRecord, kBackward, kReplay };

// The slots of one slice (and, except in kRun, their shapes) while a program runs.
struct State {
  std::vector<at::Tensor> slots;
  std::vector<std::vector<int64_t>> shp;
};

State initial_state(const Program& P, at::TensorList operands, bool track) {
  State st;
  st.slots.resize(P.n_slots);
  st.shp.resize(track ? P.n_slots : 0);
  for (int64_t i = 0; i < P.n_operands; ++i) {
    st.slots[i] = operands[i];
    if (track) st.shp[i] = operands[i].sizes().vec();
  }
  return st;
}

// Runs instructions [t0, t1) on `st`; returns FINAL's result (kRun, kRecord) when it is reached.
// kBackward skips every GEMM whose result no instruction in [t0, t1) but FINAL uses.
at::Tensor run_range(const Program& P, State& st, const int64_t* idx, Mode mode, size_t t0, size_t t1,
                     std::vector<Saved>* saved = nullptr, const std::vector<char>* needs = nullptr,
                     std::vector<std::vector<int64_t>>* sum_shapes = nullptr, at::TensorList replay = {}) {
  std::vector<at::Tensor>& slots = st.slots;
  std::vector<std::vector<int64_t>>& shp = st.shp;
  const bool track = mode != Mode::kRun;
  size_t r = 0;
  at::Tensor like;  // any tensor of the run, for serial_step's device and dtype (PASSIVE only)
  if (passive_omp_workers()) {
    for (const auto& x : slots)
      if (x.defined()) {
        like = x;
        break;
      }
    if (!like.defined() && !replay.empty()) like = replay[0];
  }
  for (size_t t = t0; t < t1; ++t) {
    const Instr& in = P.instrs[t];
    switch (in.op) {
      case kSelect:
        slots[in.slot] = slots[in.slot].select(in.dim, idx[in.k]);
        if (track) shp[in.slot].erase(shp[in.slot].begin() + in.dim);
        break;
      case kSum:
        if (track) {
          (*sum_shapes)[t] = shp[in.slot];
          std::vector<int64_t> dims = in.dims;
          std::sort(dims.rbegin(), dims.rend());
          for (int64_t d : dims) shp[in.slot].erase(shp[in.slot].begin() + d);
        }
        if (slots[in.slot].defined()) slots[in.slot] = slots[in.slot].sum(in.dims);
        break;
      case kContract: {
        SerialOmp serial(serial_step(in, like));
        if (mode == Mode::kRun) {
          slots[in.c] = matmul3(gemm_a(stored_a(slots[in.a], in), in), gemm_b(stored_b(slots[in.b], in), in))
                            .view(in.shape_c);
        } else {
          at::Tensor a3, b3;  // stored layout; Saved keeps them so
          if (mode == Mode::kReplay) {
            TORCH_CHECK(r + 2 <= replay.size(), "contract_program_backward: too few cached tensors");
            a3 = replay[r];
            b3 = replay[r + 1];
            r += 2;
          } else {
            a3 = stored_a(slots[in.a], in);
            b3 = stored_b(slots[in.b], in);
            const size_t use = P.consumer[in.c];
            if (mode == Mode::kRecord || (use < t1 && P.instrs[use].op != kFinal))
              slots[in.c] = matmul3(gemm_a(a3, in), gemm_b(b3, in)).view(in.shape_c);
          }
          Saved& s = (*saved)[t];
          // dA needs B and dB needs A; keep only what an operand that needs a gradient uses.
          const bool replay = mode == Mode::kReplay;
          if ((*needs)[in.a]) {
            s.b3 = b3;
            s.b_owned = !replay && owns(b3, slots[in.b], in.b >= P.n_operands);
            for (int64_t d : in.perm_a) s.shape_a.push_back(shp[in.a][d]);
          }
          if ((*needs)[in.b]) {
            s.a3 = a3;
            s.a_owned = !replay && owns(a3, slots[in.a], in.a >= P.n_operands);
            for (int64_t d : in.perm_b) s.shape_b.push_back(shp[in.b][d]);
          }
          shp[in.c] = in.shape_c;
        }
        slots[in.a] = at::Tensor();  // release: memory stays one slice's live intermediates
        slots[in.b] = at::Tensor();
        break;
      }
      case kCheckpoint:
        break;
      case kFinal:
        if (mode == Mode::kRun || mode == Mode::kRecord) return slots[in.slot].permute(in.perm);
        TORCH_CHECK(mode != Mode::kReplay || r == replay.size(),
                    "contract_program_backward: too many cached tensors");
        return at::Tensor();
    }
  }
  return at::Tensor();
}

at::Tensor run_slice(const Program& P, at::TensorList operands, const int64_t* idx, Mode mode,
                     std::vector<Saved>* saved = nullptr, const std::vector<char>* needs = nullptr,
                     std::vector<std::vector<int64_t>>* sum_shapes = nullptr, at::TensorList replay = {}) {
  State st = initial_state(P, operands, mode != Mode::kRun);
  at::Tensor r = run_range(P, st, idx, mode, 0, P.instrs.size(), saved, needs, sum_shapes, replay);
  TORCH_CHECK(mode == Mode::kBackward || mode == Mode::kReplay || r.defined(), "contract_program: unreachable");
  return r;
}

std::vector<int64_t> inverse(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

bool aliases_operand(const at::Tensor& t, at::TensorList operands) {
  for (const auto& op : operands)
    if (op.defined() && t.storage().is_alias_of(op.storage())) return true;
  return false;
}

// The dtype sums over slices run in: float32 for float16/bfloat16 operands (a sum of thousands
// of slices in 8 mantissa bits loses most of them), the operands' own otherwise.
at::ScalarType accumulate_type(const at::Tensor& t) { return at::toOpMathType(t.scalar_type()); }

at::Tensor to_dtype_of(const at::Tensor& t, const at::Tensor& like) {
  return t.scalar_type() == like.scalar_type() ? t : t.to(like.scalar_type());
}

}  // namespace

at::Tensor finish_single(at::Tensor r, at::TensorList operands) {
  // A fresh, contiguous, conj-resolved result: the fake kernel promises exactly that and a
  // custom op must not return a view of its input (e.g. a single operand "ij->ji").
  if (r.is_conj()) r = r.resolve_conj();
  if (!r.is_contiguous() || aliases_operand(r, operands)) r = r.clone(at::MemoryFormat::Contiguous);
  return r;
}

// Sum over the slice-table rows of the program's result, shape out_shape, in `dtype`: the
// operands' (default) or the wider type the rows are summed in (float32 for float16/bfloat16),
// which leaves the sum unrounded for a caller that adds several calls (slice groups, ranks).
at::Tensor contract_program(at::TensorList operands, at::IntArrayRef program, at::IntArrayRef slice_table,
                            std::optional<at::ScalarType> dtype) {
  ExecutorScope scope;
  check_operands(operands);
  const at::ScalarType want = dtype.value_or(operands[0].scalar_type());
  TORCH_CHECK(want == operands[0].scalar_type() || want == accumulate_type(operands[0]),
              "contract_program: dtype must be the operands' (", operands[0].scalar_type(), ")",
              accumulate_type(operands[0]) == operands[0].scalar_type() ? "" : " or their accumulate type",
              ", got ", want);
  GemmTeamScope team(team_threads(operands[0]));
  const Program P = decode_program(program, static_cast<int64_t>(operands.size()));
  check_program(P, operands, slice_table);
  const int64_t rows = num_rows(P, slice_table);
  const Instr& fin = P.instrs.back();
  if (rows == 1 && fin.blocks.empty()) {
    const int64_t* idx = P.n_sliced ? slice_table.data() : nullptr;
    at::Tensor r = finish_single(run_slice(P, operands, idx, Mode::kRun), operands);
    return r.scalar_type() == want ? r : r.to(want);
  }
  at::Tensor out = at::zeros(P.out_shape, operands[0].options().dtype(accumulate_type(operands[0])));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t* idx = slice_table.data() + row * P.n_sliced;
    block_of(out, fin, idx).add_(run_slice(P, operands, idx, Mode::kRun));
  }
  return out.scalar_type() == want ? out : out.to(want);
}

std::vector<char> slot_needs(const Program& P, at::IntArrayRef needs_grad) {
  TORCH_CHECK(static_cast<int64_t>(needs_grad.size()) == P.n_operands,
              "contract_program: needs_grad must have one entry per operand");
  std::vector<char> needs(P.n_slots, 0);
  for (int64_t i = 0; i < P.n_operands; ++i) needs[i] = needs_grad[i] != 0;
  for (const auto& in : P.instrs)
    if (in.op == kContract) needs[in.c] = needs[in.a] || needs[in.b];
  return needs;
}

// One slice (slice_table has one row, or none for an unsliced program), also returning the
// GEMM operands that contract_program_backward can reuse instead of recomputing the slice: per
// CONTRACT (program order) the [Bt,M,K] and [Bt,K,N] matrices, each an empty tensor where no
// gradient in needs_grad uses it. The forward cache of a single slice.
std::tuple<at::Tensor, std::vector<at::Tensor>> contract_program_cached(at::TensorList operands,
                                                                        at::IntArrayRef program,
                                                                        at::IntArrayRef slice_table,
                                                                        at::IntArrayRef needs_grad) {
  ExecutorScope scope;
  check_operands(operands);
  GemmTeamScope team(team_threads(operands[0]));
  const Program P = decode_program(program, static_cast<int64_t>(operands.size()));
  check_program(P, operands, slice_table);
  TORCH_CHECK(num_rows(P, slice_table) == 1, "contract_program_cached: runs exactly one slice");
  const std::vector<char> needs = slot_needs(P, needs_grad);
  const Instr& fin = P.instrs.back();
  const int64_t* idx = P.n_sliced ? slice_table.data() : nullptr;
  std::vector<Saved> saved(P.instrs.size());
  std::vector<std::vector<int64_t>> sum_shapes(P.instrs.size());
  at::Tensor r = run_slice(P, operands, idx, Mode::kRecord, &saved, &needs, &sum_shapes);
  std::vector<at::Tensor> keep;
  auto own = [&](const at::Tensor& t) {
    // outputs of a custom op may not alias its inputs (copy the operand-sized views) and
    // must have the fake kernel's contiguous layout
    if (!t.defined()) return at::empty({0}, operands[0].options());
    if (aliases_operand(t, operands) || t.is_conj()) return t.resolve_conj().clone(at::MemoryFormat::Contiguous);
    return t.contiguous();
  };
  for (size_t t = 0; t < P.instrs.size(); ++t) {
    if (P.instrs[t].op != kContract) continue;
    keep.push_back(own(saved[t].a3));
    keep.push_back(own(saved[t].b3));
  }
  if (fin.blocks.empty()) return {finish_single(r, operands), keep};
  at::Tensor out = at::zeros(P.out_shape, operands[0].options());
  block_of(out, fin, idx).add_(r);
  return {out, keep};
}

namespace {

// The stored-layout gradients of one CONTRACT (C = A B): dA = dC B^H and dB = A^H dC (torch.matmul's
// complex convention), written into the stored operand's own memory where it owns it (its value is
// not needed once both gradients exist), so the backward holds no more than the recomputed slice.
void contract_grads(const Instr& in, Saved& s, const at::Tensor& gc3, bool need_a, bool need_b, at::Tensor& ga,
                    at::Tensor& gb) {
  auto grad_a = [&](at::Tensor* into) {
    // [Bt,K,M] when transposed: (dC B^H)^T = conj(B) dC^T
    at::Tensor x = in.ta ? gemm_b(s.b3, in).conj() : gc3;
    at::Tensor y = in.ta ? gc3.transpose(1, 2) : gemm_b(s.b3, in).mH();
    return matmul3(x, y, into);
  };
  auto grad_b = [&](at::Tensor* into) {
    // [Bt,N,K] when transposed: (A^H dC)^T = dC^T conj(A)
    at::Tensor x = in.tb ? gc3.transpose(1, 2) : gemm_a(s.a3, in).mH();
    at::Tensor y = in.tb ? gemm_a(s.a3, in).conj() : gc3;
    return matmul3(x, y, into);
  };
  if (need_a && need_b) {
    // The second gradient may overwrite the operand the first one read.
    const bool a_last = s.a_owned && (!s.b_owned || s.a3.numel() >= s.b3.numel());
    if (a_last) {
      gb = grad_b(nullptr);
      ga = grad_a(&s.a3);
    } else {
      ga = grad_a(nullptr);
      gb = s.b_owned ? grad_b(&s.b3) : grad_b(nullptr);
    }
  } else if (need_a) {
    ga = grad_a(nullptr);
  } else if (need_b) {
    gb = grad_b(nullptr);
  }
  if (ga.defined()) ga = ga.resolve_conj();
  if (gb.defined()) gb = gb.resolve_conj();
}

// Adds into `grads` (one entry per operand; undefined or empty: not wanted) the gradients of the
// sum over the slice-table rows of program(operands) under grad_out; with `value` the rows'
// results are also added into it (the last segment then runs as a recording forward, so the
// value costs only the final GEMM). `cached`: the GEMM operands of contract_program_cached
// (a single row) instead of recomputing.
void accumulate_gradients(const Program& P, at::TensorList operands, at::IntArrayRef slice_table,
                          const at::Tensor& grad_out, const std::vector<char>& needs, at::TensorList cached,
                          std::vector<at::Tensor>& grads, at::Tensor* value) {
  const int64_t rows = num_rows(P, slice_table);
  const Instr& fin = P.instrs.back();
  if (!needs[fin.slot] && value == nullptr) return;
  std::vector<at::Tensor> g(P.n_slots);
  std::vector<Saved> saved(P.instrs.size());
  std::vector<std::vector<int64_t>> sum_shapes(P.instrs.size());
  const std::vector<int64_t> fin_inv = inverse(fin.perm);
  TORCH_CHECK(cached.empty() || rows == 1, "contract_program_backward: cached GEMM operands need a single slice");
  TORCH_CHECK(cached.empty() || value == nullptr, "contract_program: no value with cached GEMM operands");
  // Segments between CHECKPOINTs (one segment without them, or with the forward's cache).
  std::vector<size_t> bounds{0};
  if (cached.empty()) bounds.insert(bounds.end(), P.checkpoints.begin(), P.checkpoints.end());
  bounds.push_back(P.instrs.size());
  const size_t nseg = bounds.size() - 1;
  // An operand's gradient is complete once the reverse sweep has passed the first SUM or
  // CONTRACT that reads it: add it to the caller's buffer there and free it.
  std::vector<std::vector<int64_t>> done_at(P.instrs.size());
  std::vector<std::vector<std::pair<int64_t, int64_t>>> selects(P.n_operands);
  {
    std::vector<char> seen(P.n_operands, 0);
    for (size_t t = 0; t < P.instrs.size(); ++t) {
      const Instr& in = P.instrs[t];
      std::vector<int64_t> reads;
      if (in.op == kSelect) selects[in.slot].emplace_back(in.dim, in.k);
      if (in.op == kSum) reads = {in.slot};
      if (in.op == kContract) reads = {in.a, in.b};
      if (in.op == kFinal) reads = {in.slot};
      for (int64_t s : reads)
        if (s < P.n_operands && !seen[s]) {
          seen[s] = 1;
          done_at[t].push_back(s);
        }
    }
  }
  // The slots each segment reads that an earlier segment made (or the operands): all that its
  // checkpoint keeps. A slot read only by a later segment is kept by that segment's checkpoint
  // alone, so that once a segment has copied an earlier intermediate into its GEMM layout the
  // original is freed, and its gradient (written over the copy) is the only one held.
  std::vector<std::vector<int64_t>> reads(nseg);
  for (size_t j = 0; j < nseg; ++j) {
    std::vector<char> made(P.n_slots, 0), seen(P.n_slots, 0);
    auto read = [&](int64_t s) {
      if (!made[s] && !seen[s]) {
        seen[s] = 1;
        reads[j].push_back(s);
      }
    };
    for (size_t t = bounds[j]; t < bounds[j + 1]; ++t) {
      const Instr& in = P.instrs[t];
      if (in.op == kSelect || in.op == kSum || in.op == kFinal) read(in.slot);
      if (in.op == kContract) {
        read(in.a);
        read(in.b);
        made[in.c] = 1;
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t* idx = P.n_sliced ? slice_table.data() + row * P.n_sliced : nullptr;
    std::fill(saved.begin(), saved.end(), Saved{});
    std::fill(g.begin(), g.end(), at::Tensor());
    // Forward to the last checkpoint, keeping at each one the slots its segment reads.
    std::vector<std::vector<at::Tensor>> snaps(nseg);
    {
      State st = initial_state(P, operands, /*track=*/false);
      for (size_t j = 0; j < nseg; ++j) {
        snaps[j].resize(P.n_slots);
        for (int64_t s : reads[j]) snaps[j][s] = st.slots[s];
        if (j + 1 < nseg) run_range(P, st, idx, Mode::kRun, bounds[j], bounds[j + 1]);
      }
    }
    if (needs[fin.slot]) g[fin.slot] = block_of(grad_out, fin, idx).permute(fin_inv);
    for (size_t j = nseg; j-- > 0;) {
      // Recompute this segment from its checkpoint keeping its GEMM operands, then sweep back.
      State st;
      st.slots = std::move(snaps[j]);
      st.shp.resize(P.n_slots);
      for (int64_t s = 0; s < P.n_slots; ++s)
        if (st.slots[s].defined()) st.shp[s] = st.slots[s].sizes().vec();
      const bool last = j + 1 == nseg;
      const Mode mode = !cached.empty() ? Mode::kReplay : (last && value ? Mode::kRecord : Mode::kBackward);
      at::Tensor r = run_range(P, st, idx, mode, bounds[j], bounds[j + 1], &saved, &needs, &sum_shapes, cached);
      if (mode == Mode::kRecord) block_of(*value, fin, idx).add_(r);
      r = at::Tensor();
      st.slots.clear();  // the saved GEMM operands hold what the sweep needs
      for (size_t t = bounds[j + 1]; t-- > bounds[j];) {
        const Instr& in = P.instrs[t];
        SerialOmp serial(in.op == kContract && serial_step(in, operands[0]));
        if (in.op == kSum) {
          if (g[in.slot].defined()) {
            at::Tensor x = g[in.slot];
            std::vector<int64_t> dims = in.dims;
            std::sort(dims.begin(), dims.end());
            for (int64_t d : dims) x = x.unsqueeze(d);
            g[in.slot] = x.expand(sum_shapes[t]);
          }
        } else if (in.op == kContract && g[in.c].defined()) {
          Saved& s = saved[t];
          at::Tensor gc3 = reshape_for_gemm(g[in.c], {in.bt, in.m, in.n});
          g[in.c] = at::Tensor();
          at::Tensor ga, gb;
          contract_grads(in, s, gc3, needs[in.a], needs[in.b], ga, gb);
          gc3 = at::Tensor();
          if (ga.defined()) g[in.a] = ga.reshape(s.shape_a).permute(inverse(in.perm_a));
          if (gb.defined()) g[in.b] = gb.reshape(s.shape_b).permute(inverse(in.perm_b));
          saved[t] = Saved{};  // free as we go: the reverse sweep only shrinks memory
        }
        for (int64_t i : done_at[t]) {
          if (!needs[i] || !g[i].defined()) continue;
          at::Tensor view = grads[i];
          for (const auto& [dim, k] : selects[i]) view = view.select(dim, idx[k]);
          view.add_(g[i]);
          g[i] = at::Tensor();
        }
      }
    }
  }
}

// What ADInplaceOrView does for an in-place op: the caller's buffers were written (under
// ExecutorScope the executor's add_ does not), so autograd sees that they changed.
void bump_versions(const std::vector<at::Tensor>& grads, const std::vector<char>& needs) {
  for (size_t i = 0; i < grads.size(); ++i)
    if (needs[i]) grads[i].unsafeGetTensorImpl()->bump_version();
}

std::vector<char> needs_of(const Program& P, at::TensorList grads) {
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == P.n_operands,
              "contract_program_accumulate: grads must have one entry per operand");
  std::vector<int64_t> flags;
  for (const auto& t : grads) flags.push_back(t.defined() && t.numel() > 0 ? 1 : 0);
  return slot_needs(P, flags);
}

}  // namespace

// Gradients of sum_rows(program(operands)) under grad_out, for the operands flagged in
// needs_grad (the others come back as empty tensors, at no cost). Complex follows PyTorch's
// convention (grad_A = grad_C @ B^H, as torch.matmul's backward).
std::vector<at::Tensor> contract_program_backward(at::TensorList operands, at::IntArrayRef program,
                                                  at::IntArrayRef slice_table, const at::Tensor& grad_out,
                                                  at::IntArrayRef needs_grad, at::TensorList cached) {
  ExecutorScope scope;
  check_operands(operands);
  GemmTeamScope team(team_threads(operands[0]));
  const Program P = decode_program(program, static_cast<int64_t>(operands.size()));
  check_program(P, operands, slice_table);
  const int64_t rows = num_rows(P, slice_table);
  TORCH_CHECK(static_cast<int64_t>(needs_grad.size()) == P.n_operands,
              "contract_program_backward: needs_grad must have one entry per operand");
  check_shape(grad_out, P.out_shape, "grad_out");
  check_same_device(operands[0], "operand 0", grad_out, "grad_out");
  const std::vector<char> needs = slot_needs(P, needs_grad);
  std::vector<at::Tensor> grads(P.n_operands);
  for (int64_t i = 0; i < P.n_operands; ++i)  // summed over the slices in accumulate_type
    grads[i] = needs[i] ? at::zeros_like(operands[i],
                                         operands[i].options().dtype(rows > 1 ? accumulate_type(operands[i])
                                                                               : operands[i].scalar_type()),
                                         at::MemoryFormat::Contiguous).resolve_conj()
                        : at::empty({0}, operands[i].options());
  const at::Tensor g_out = to_dtype_of(grad_out, operands[0]);
  accumulate_gradients(P, operands, slice_table, g_out, needs, cached, grads, nullptr);
  for (int64_t i = 0; i < P.n_operands; ++i)
    if (needs[i]) grads[i] = to_dtype_of(grads[i], operands[i]);
  return grads;
}

// Adds into `grads` the operands' gradients of the sum over the slice-table rows (entries with no
// elements: not wanted). With grad_out, under it, returning an empty tensor; without, under a unit
// output cotangent (the output must have one element) and returning the value as well (in the
// accumulate type): the forward and the backward of each slice in one pass, so a scalar's
// gradient costs one recomputation less.
at::Tensor contract_program_accumulate(at::TensorList operands, at::IntArrayRef program,
                                       at::IntArrayRef slice_table, const std::optional<at::Tensor>& grad_out,
                                       at::TensorList grads) {
  ExecutorScope scope;
  check_operands(operands);
  GemmTeamScope team(team_threads(operands[0]));
  const Program P = decode_program(program, static_cast<int64_t>(operands.size()));
  check_program(P, operands, slice_table);
  num_rows(P, slice_table);
  const std::vector<char> needs = needs_of(P, grads);
  std::vector<at::Tensor> into(grads.begin(), grads.end());
  for (int64_t i = 0; i < P.n_operands; ++i) {
    if (!needs[i]) continue;
    // the operand's dtype, or the float32 that float16/bfloat16 gradients are summed in
    TORCH_CHECK(into[i].sizes() == operands[i].sizes() && (into[i].scalar_type() == operands[i].scalar_type() ||
                                                           into[i].scalar_type() == accumulate_type(operands[i])),
                "contract_program_accumulate: grads[", i, "] must have operand ", i, "'s shape and its dtype (",
                operands[i].scalar_type(), ") or ", accumulate_type(operands[i]), ", got ", into[i].scalar_type());
    check_same_device(operands[0], "operand 0", into[i], "grads");
  }
  if (grad_out.has_value()) {
    check_shape(*grad_out, P.out_shape, "grad_out");
    check_same_device(operands[0], "operand 0", *grad_out, "grad_out");
    const at::Tensor g_out = grad_out->to(operands[0].scalar_type());
    accumulate_gradients(P, operands, slice_table, g_out, needs, {}, into, nullptr);
    bump_versions(into, needs);
    return at::empty({0}, operands[0].options());
  }
  at::Tensor value = at::zeros(P.out_shape, operands[0].options().dtype(accumulate_type(operands[0])));
  TORCH_CHECK(value.numel() == 1, "contract_program_accumulate: without grad_out the output must have one "
              "element, it has shape ", P.out_shape);
  const at::Tensor unit = at::ones(P.out_shape, operands[0].options());
  accumulate_gradients(P, operands, slice_table, unit, needs, {}, into, &value);
  bump_versions(into, needs);
  return value;  // in the accumulate type: a caller adding several calls rounds once
}

}  // namespace torch_gradops

TORCH_LIBRARY_FRAGMENT(torch_gradops, m) {
  // Runs a compiled contraction program (see the top of csrc/contract.cpp) once per row of
  // slice_table and returns the sum of the rows' results (shape from the program's header),
  // with the sum in `dtype` (default: the operands'; or their accumulate type, unrounded).
  m.def("contract_program(Tensor[] operands, int[] program, int[] slice_table, ScalarType? dtype=None) -> Tensor");
  // Gradients of contract_program's result under grad_out, for operands with needs_grad != 0
  // (the others come back as empty tensors). Recomputes one slice at a time, or reuses
  // `cached` (from contract_program_cached; empty list: recompute).
  m.def(
      "contract_program_backward(Tensor[] operands, int[] program, int[] slice_table, Tensor grad_out, "
      "int[] needs_grad, Tensor[] cached) -> Tensor[]");
  // Adds the operands' gradients over the slice-table rows into `grads` (entries with no
  // elements: not wanted); without grad_out (a one-element output only) under a unit cotangent,
  // also returning the value (in the operands' accumulate type, float32 for float16/bfloat16,
  // unrounded): forward and backward of each slice in one pass.
  m.def(
      "contract_program_accumulate(Tensor[] operands, int[] program, int[] slice_table, Tensor? grad_out, "
      "Tensor(a!)[] grads) -> Tensor");
  // One slice, plus the GEMM operands that contract_program_backward can take (as `cached`)
  // instead of recomputing the slice.
  m.def(
      "contract_program_cached(Tensor[] operands, int[] program, int[] slice_table, int[] needs_grad) "
      "-> (Tensor, Tensor[])");
}

// ATen ops only, so one implementation serves every backend; autograd is ContractFunction's.
TORCH_LIBRARY_IMPL(torch_gradops, CompositeExplicitAutograd, m) {
  m.impl("contract_program", &torch_gradops::contract_program);
  m.impl("contract_program_backward", &torch_gradops::contract_program_backward);
  m.impl("contract_program_cached", &torch_gradops::contract_program_cached);
  m.impl("contract_program_accumulate", &torch_gradops::contract_program_accumulate);
}

// Autograd lives in Python (ContractFunction). A direct call that autograd would differentiate
// gets an error at backward time instead of a silently missing gradient.
TORCH_LIBRARY_IMPL(torch_gradops, Autograd, m) {
  m.impl("contract_program", torch::autograd::autogradNotImplementedFallback());
  m.impl("contract_program_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("contract_program_cached", torch::autograd::autogradNotImplementedFallback());
}
