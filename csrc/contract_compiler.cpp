// The contraction compiler: lowers a path over a network (and the modes it slices) to a
// contraction program (contract_program.h), choosing each pairwise step's GEMM layout.
//
// Host code, called once per plan from torch_gradops/tensornet/compiler.py: in C++ because in
// Python it took a third of the planning time of a circuit of a few hundred tensors. The
// rules (which operand enters bmm as a view, which is copied and in what order, which side of
// the result comes first) are documented in compiler.py and must stay deterministic: for equal
// estimated costs the first candidate in the order written here wins.
#include <algorithm>
#include <array>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/safe_numerics.h>

#include "contract_program.h"

namespace torch_gradops {
namespace {

using Modes = std::vector<int64_t>;

// Product of extents, refusing what int64 cannot hold (Python's ints never overflowed here).
int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r;
  if (c10::mul_overflows(a, b, &r)) throw std::overflow_error("contraction compiler: a size exceeds int64");
  return r;
}

// The modes of `a`, then of each further list.
template <typename... More>
Modes cat(Modes a, const More&... more) {
  (a.insert(a.end(), more.begin(), more.end()), ...);
  return a;
}

struct Compiler {
  const std::vector<int64_t>& sizes;  // extent per mode id
  int64_t itemsize;
  bool is_complex;

  int64_t size(int64_t m) const { return sizes[m]; }
  int64_t prod(const Modes& ms) const {
    int64_t p = 1;
    for (int64_t m : ms) p = checked_mul(p, size(m));
    return p;
  }
  Modes nonunit(const Modes& ms) const {
    Modes out;
    for (int64_t m : ms)
      if (size(m) > 1) out.push_back(m);
    return out;
  }

  // Row-major strides of `modes` (aligned with them); extents of 0 count as 1.
  std::vector<int64_t> contiguous_strides(const Modes& modes) const {
    std::vector<int64_t> st(modes.size());
    int64_t acc = 1;
    for (size_t j = modes.size(); j-- > 0;) {
      st[j] = acc;
      acc = checked_mul(acc, std::max<int64_t>(size(modes[j]), 1));
    }
    return st;
  }
};

// A slot as the executor holds it: modes in dimension order and the stride of each (strides never
// increase along the dimensions, so memory order is dimension order).
struct Slot {
  Modes modes;
  std::vector<int64_t> strides;
  int64_t stride_of(int64_t m) const {
    for (size_t j = 0; j < modes.size(); ++j)
      if (modes[j] == m) return strides[j];
    return 0;
  }
};

// The modes of one GEMM operand by group: batch, contracted, free.
struct Orders {
  Modes b, k, f;
  Modes& of(char g) { return g == 'b' ? b : g == 'k' ? k : f; }
  bool operator==(const Orders& o) const { return b == o.b && k == o.k && f == o.f; }
};

struct View {
  Orders orders;
  bool contr_first;
};

// Role of a mode at the step that consumes a slot: 's' summed first, 'b', 'k', 'f'. A slot
// consumed by nothing (the final one) has final = true.
struct Consumer {
  bool final = false;
  std::vector<std::pair<int64_t, char>> roles;
  char role(int64_t m) const {
    for (const auto& [x, g] : roles)
      if (x == m) return g;
    return 0;
  }
};

using GroupOf = std::vector<char>;  // per mode id: 'b', 'k' or 'f' (only for the step's modes)

// compiler.py's _view_orders: how a slot can enter a GEMM without a copy, or nullopt.
std::optional<View> view_orders(const Compiler& C, const Slot& s, const GroupOf& group) {
  std::vector<std::pair<int64_t, int64_t>> seq;  // (mode, stride), extents > 1
  for (size_t j = 0; j < s.modes.size(); ++j)
    if (C.size(s.modes[j]) > 1) seq.emplace_back(s.modes[j], s.strides[j]);
  std::string blocks;
  std::array<int64_t, 3> run_of{-1, -1, -1};  // per group b, k, f
  auto gi = [](char g) { return g == 'b' ? 0 : g == 'k' ? 1 : 2; };
  int64_t run = 0;
  for (size_t j = 0; j < seq.size(); ++j) {
    const int64_t m = seq[j].first;
    if (j && seq[j - 1].second != checked_mul(seq[j].second, C.size(m))) ++run;  // not mergeable
    const char g = group[m];
    if (blocks.empty() || blocks.back() != g) {
      if (blocks.find(g) != std::string::npos) return std::nullopt;  // a group split in two
      blocks.push_back(g);
    }
    int64_t& r = run_of[gi(g)];
    if (r < 0) r = run;
    if (r != run) return std::nullopt;  // a group a reshape cannot merge
  }
  if (blocks.find('b') != std::string::npos && blocks[0] != 'b') return std::nullopt;
  View v;
  for (const auto& [m, st] : seq) {
    (void)st;
    v.orders.of(group[m]).push_back(m);
  }
  for (int64_t m : s.modes)
    if (C.size(m) <= 1) v.orders.of(group[m]).push_back(m);
  char first_rest = 0;
  for (char g : blocks)
    if (g != 'b') {
      first_rest = g;
      break;
    }
  v.contr_first = first_rest == 'k';
  return v;
}

bool views_agree(const Compiler& C, const View& a, const View& b) {
  return C.nonunit(a.orders.b) == C.nonunit(b.orders.b) && C.nonunit(a.orders.k) == C.nonunit(b.orders.k);
}

// _result_fits: whether the consumer can use a contiguous result with modes cm without a copy.
bool result_fits(const Compiler& C, const Modes& cm, const Consumer& cons, const Modes& kept) {
  const Modes seq = C.nonunit(cm);
  if (cons.final) return seq == C.nonunit(kept);
  std::string blocks;
  for (int64_t m : seq) {
    const char g = cons.role(m);
    if (g == 's') continue;
    if (blocks.empty() || blocks.back() != g) {
      if (blocks.find(g) != std::string::npos) return false;
      blocks.push_back(g);
    }
  }
  return blocks.find('b') == std::string::npos || blocks[0] == 'b';
}

// _copy_cost: element copies of copying a slot into `order`, with the short-inner-run factor.
double copy_cost(const Compiler& C, const Slot& s, const Modes& order) {
  int64_t run = 1, expect = 1;
  const Modes nz = C.nonunit(order);
  for (size_t j = nz.size(); j-- > 0;) {
    const int64_t m = nz[j];
    if (s.stride_of(m) != expect) break;
    run *= C.size(m);
    expect *= C.size(m);
  }
  return static_cast<double>(C.prod(s.modes)) * (1.0 + 256.0 / static_cast<double>(run * C.itemsize));
}

// _consumer_rank: per result mode its rank in the order the consumer wants (0 if absent).
struct Rank {
  std::vector<std::pair<int64_t, int>> r;
  int of(int64_t m) const {
    for (const auto& [x, v] : r)
      if (x == m) return v;
    return 0;
  }
};

Rank consumer_rank(const Consumer& cons, const Modes& kept, const char* roles) {
  Rank rk;
  if (cons.final) {
    for (size_t j = 0; j < kept.size(); ++j) rk.r.emplace_back(kept[j], static_cast<int>(j));
  } else {
    for (const auto& [m, g] : cons.roles)
      rk.r.emplace_back(m, static_cast<int>(std::string(roles).find(g)));
  }
  return rk;
}

Modes sorted_by(const Modes& ms, const Rank& rank) {
  Modes out = ms;
  std::stable_sort(out.begin(), out.end(), [&](int64_t x, int64_t y) { return rank.of(x) < rank.of(y); });
  return out;
}

// One side of a step's layout: whether the operand is copied, its orders, contracted first.
struct Side {
  bool copied;
  Orders orders;
  bool contr_first;
};

struct Layout {
  bool swap;
  Side a, b;
};

// An operand that enters bmm as the view `v`, uncopied.
Side view_side(const View& v) { return Side{false, v.orders, v.contr_first}; }

// _quick_layout: for steps too small to be worth the search.
Layout quick_layout(const Compiler& C, const Slot& sa, const Slot& sb, const GroupOf& group, const Consumer& cons,
                    const Modes& kept) {
  std::optional<View> va = view_orders(C, sa, group), vb = view_orders(C, sb, group);
  if (va && vb) {
    if (views_agree(C, *va, *vb)) return {false, view_side(*va), view_side(*vb)};
    vb.reset();  // they disagree: copy b
  }
  Modes b, k;
  if (va) {
    b = va->orders.b, k = va->orders.k;
  } else if (vb) {
    b = vb->orders.b, k = vb->orders.k;
  } else {  // both copied: batch and contracted modes in a's memory (= dimension) order
    for (int64_t m : sa.modes) {
      if (group[m] == 'b') b.push_back(m);
      if (group[m] == 'k') k.push_back(m);
    }
  }
  const Rank rank = consumer_rank(cons, kept, "bkfs");
  auto copy = [&](const Slot& s, bool contr_first) {
    Modes free;
    for (int64_t m : s.modes)
      if (group[m] == 'f') free.push_back(m);
    return Side{true, {b, k, sorted_by(free, rank)}, contr_first};
  };
  // a copied a is stored [batch, free, contracted], a copied b [batch, contracted, free]
  return {false, va ? view_side(*va) : copy(sa, false), vb ? view_side(*vb) : copy(sb, true)};
}

// _gemm_layout: the searched layout (see compiler.py for the rules and the cost model).
Layout gemm_layout(const Compiler& C, const Slot& sa, const Slot& sb, const GroupOf& group, const Consumer& cons,
                   const Modes& kept) {
  const std::optional<View> va = view_orders(C, sa, group), vb = view_orders(C, sb, group);
  Modes batch, contr, left, right;
  for (int64_t m : sa.modes) (group[m] == 'b' ? batch : group[m] == 'k' ? contr : left).push_back(m);
  for (int64_t m : sb.modes)
    if (group[m] == 'f') right.push_back(m);
  const int64_t size_c = C.prod(cat(batch, left, right)), size_l = C.prod(left), size_r = C.prod(right);
  const int64_t macs = checked_mul(size_c, C.prod(contr));
  const double narrow = static_cast<double>(macs) * (C.is_complex ? 0.05 : 1.0);
  std::vector<Rank> keys{consumer_rank(cons, kept, "bkfs")};
  if (!cons.final) keys.push_back(consumer_rank(cons, kept, "bfks"));

  auto copied = [&](const Slot& s, const Modes& b, const Modes& k, const Modes& f) {
    // the cheaper stored order of a copied operand: [b, f, k] unless [b, k, f] costs less
    const double c1 = copy_cost(C, s, cat(b, f, k)), c2 = copy_cost(C, s, cat(b, k, f));
    const bool cf = c2 < c1;
    return std::make_pair(cf ? c2 : c1, Side{true, {b, k, f}, cf});
  };

  struct Key {
    double cost;
    int ncopies;
    int swap;
    bool operator<(const Key& o) const {
      if (cost != o.cost) return cost < o.cost;
      if (ncopies != o.ncopies) return ncopies < o.ncopies;
      return swap < o.swap;
    }
  };
  std::optional<Key> best_key;
  Layout best{};
  for (int copy_a = va ? 0 : 1; copy_a <= 1; ++copy_a) {
    for (int copy_b = vb ? 0 : 1; copy_b <= 1; ++copy_b) {
      std::vector<std::pair<Modes, Modes>> shared;  // (batch order, contracted order) of the copies
      if (!copy_a && !copy_b) {
        if (!views_agree(C, *va, *vb)) continue;
        shared.emplace_back();
      } else if (!copy_a) {
        shared.emplace_back(va->orders.b, va->orders.k);
      } else if (!copy_b) {
        shared.emplace_back(vb->orders.b, vb->orders.k);
      } else {  // both copied: each operand's memory (= dimension) order, a's first
        for (const Slot* s : {&sa, &sb}) {
          std::pair<Modes, Modes> bk;
          for (int64_t m : s->modes) {
            if (std::find(batch.begin(), batch.end(), m) != batch.end()) bk.first.push_back(m);
            if (std::find(contr.begin(), contr.end(), m) != contr.end()) bk.second.push_back(m);
          }
          if (std::find(shared.begin(), shared.end(), bk) == shared.end()) shared.push_back(bk);
        }
      }
      for (const Rank& rank : keys) {
        // a copied operand's free modes: the consumer's order, then as stored if different
        auto orders = [&](const Modes& ms) {
          std::vector<Modes> out{sorted_by(ms, rank)};
          if (out[0] != ms) out.push_back(ms);
          return out;
        };
        for (const auto& [b_ord, k_ord] : shared) {
          std::vector<std::pair<double, Side>> opts_a, opts_b;
          if (copy_a) {
            for (const Modes& f : orders(left)) opts_a.push_back(copied(sa, b_ord, k_ord, f));
          } else {
            opts_a.emplace_back(0.0, view_side(*va));
          }
          if (copy_b) {
            for (const Modes& f : orders(right)) opts_b.push_back(copied(sb, b_ord, k_ord, f));
          } else {
            opts_b.emplace_back(0.0, view_side(*vb));
          }
          for (const auto& [cost_a, oa] : opts_a) {
            for (const auto& [cost_b, ob] : opts_b) {
              for (int swap = 0; swap <= 1; ++swap) {
                const Orders& x = swap ? ob.orders : oa.orders;
                const Orders& y = swap ? oa.orders : ob.orders;
                const bool fits = result_fits(C, cat(x.b, x.f, y.f), cons, kept);
                const int64_t cols = swap ? size_l : size_r, rows = swap ? size_r : size_l;
                const double cost = cost_a + cost_b + (fits ? 0.0 : 2.0 * static_cast<double>(size_c)) +
                                    (cols < 16 && rows > cols ? narrow : 0.0);
                const Key key{cost, copy_a + copy_b, swap};
                if (!best_key || key < *best_key) {
                  best_key = key;
                  best = {swap != 0, oa, ob};
                  if (cost == 0 && !swap) return best;  // nothing is copied: cannot do better
                }
              }
            }
          }
        }
      }
    }
  }
  return best;
}

// _consumer_groups: per intermediate slot, the roles of its modes at the step that consumes it.
std::vector<Consumer> consumer_groups(const std::vector<Slot>& lay, std::vector<int64_t> count,
                                      const std::vector<std::pair<int64_t, int64_t>>& path) {
  const size_t n_in = lay.size();
  std::vector<Consumer> consumer(n_in + path.size());
  std::vector<int64_t> slots(n_in);
  std::vector<Modes> msets(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    slots[i] = static_cast<int64_t>(i);
    msets[i] = lay[i].modes;
  }
  int64_t nslot = static_cast<int64_t>(n_in);
  for (const auto& [p, q] : path) {
    const int64_t sb = slots[q];
    Modes setb = std::move(msets[q]);
    slots.erase(slots.begin() + q);
    msets.erase(msets.begin() + q);
    const int64_t sa = slots[p];
    Modes seta = std::move(msets[p]);
    slots.erase(slots.begin() + p);
    msets.erase(msets.begin() + p);
    for (int64_t m : seta) --count[m];
    for (int64_t m : setb) --count[m];
    Modes res;
    for (int side = 0; side < 2; ++side) {
      const Modes& mine = side ? setb : seta;
      const Modes& other = side ? seta : setb;
      Consumer& c = consumer[side ? sb : sa];
      for (int64_t m : mine) {
        char g;
        if (std::find(other.begin(), other.end(), m) != other.end()) {
          g = count[m] > 0 ? 'b' : 'k';
        } else if (count[m] == 0) {
          g = 's';
        } else {
          g = 'f';
        }
        c.roles.emplace_back(m, g);
        if ((g == 'b' || g == 'f') && std::find(res.begin(), res.end(), m) == res.end()) res.push_back(m);
      }
    }
    for (int64_t m : res) ++count[m];
    slots.push_back(nslot++);
    msets.push_back(std::move(res));
  }
  if (!slots.empty()) consumer[slots.back()].final = true;
  return consumer;
}

}  // namespace

CompiledProgram compile_contract_program(const std::vector<std::vector<int64_t>>& inputs,
                                         const std::vector<int64_t>& output, const std::vector<int64_t>& sizes,
                                         const std::vector<std::pair<int64_t, int64_t>>& path_in,
                                         const std::vector<int64_t>& sliced, int64_t itemsize, bool is_complex,
                                         const std::vector<int64_t>& checkpoints, int64_t quick_macs) {
  const int64_t n_modes = static_cast<int64_t>(sizes.size());
  auto check_mode = [&](int64_t m) {
    if (m < 0 || m >= n_modes)
      throw std::invalid_argument("contraction compiler: mode id " + std::to_string(m) + " has no size");
  };
  for (const auto& t : inputs)
    for (int64_t m : t) check_mode(m);
  for (int64_t m : output) check_mode(m);
  for (int64_t m : sliced) check_mode(m);
  const Compiler C{sizes, itemsize, is_complex};
  const int64_t n_in = static_cast<int64_t>(inputs.size());

  std::vector<int64_t> slot_of_k(n_modes, -1);
  std::vector<char> is_sliced(n_modes, 0);
  int64_t nslices = 1;
  for (size_t k = 0; k < sliced.size(); ++k) {
    slot_of_k[sliced[k]] = static_cast<int64_t>(k);
    if (!is_sliced[sliced[k]]) nslices = checked_mul(nslices, C.size(sliced[k]));
    is_sliced[sliced[k]] = 1;
  }
  Program P;
  P.n_operands = n_in;
  P.n_sliced = static_cast<int64_t>(sliced.size());
  for (int64_t m : output) P.out_shape.push_back(C.size(m));
  std::vector<int64_t> count(n_modes, 0);
  for (const auto& t : inputs)
    for (int64_t m : t) ++count[m];
  for (int64_t m : output) ++count[m];

  // operands: SELECTs of sliced modes first (the backward views gradient buffers through them),
  // then the sum of modes no one else has
  std::vector<Slot> lay;
  lay.reserve(n_in + path_in.size());
  for (int64_t i = 0; i < n_in; ++i) {
    Modes modes = inputs[i];
    // operands are assumed contiguous; a selection keeps the other modes' strides
    std::vector<int64_t> strides = C.contiguous_strides(modes);
    for (int64_t m : sliced) {
      auto it = std::find(modes.begin(), modes.end(), m);
      if (it != modes.end()) {
        Instr in;
        in.op = kSelect, in.slot = i, in.dim = it - modes.begin(), in.k = slot_of_k[m];
        P.instrs.push_back(std::move(in));
        strides.erase(strides.begin() + (it - modes.begin()));
        modes.erase(it);
      }
    }
    std::vector<int64_t> dims;
    for (size_t d = 0; d < modes.size(); ++d)
      if (count[modes[d]] == 1) dims.push_back(static_cast<int64_t>(d));
    if (!dims.empty()) {
      Instr in;
      in.op = kSum, in.slot = i, in.dims = dims;
      P.instrs.push_back(std::move(in));
      for (int64_t m : modes)
        if (count[m] == 1) count[m] = 0;
      Modes kept_modes;
      for (int64_t m : modes)
        if (count[m] != 0) kept_modes.push_back(m);
      modes = std::move(kept_modes);
      strides = C.contiguous_strides(modes);
    }
    Slot s{modes, strides};
    lay.push_back(std::move(s));
  }
  // the path, checked: each step names two distinct live tensors
  std::vector<std::pair<int64_t, int64_t>> path;
  int64_t live = n_in;
  for (const auto& [x, y] : path_in) {
    const int64_t p = std::min(x, y), q = std::max(x, y);
    if (p < 0 || q >= live || p == q)
      throw std::invalid_argument("contraction path: step (" + std::to_string(x) + ", " + std::to_string(y) +
                                  ") does not name two of the " + std::to_string(live) + " tensors left");
    path.emplace_back(p, q);
    --live;
  }
  if (live != 1)
    throw std::invalid_argument("the contraction path leaves " + std::to_string(live) +
                                " tensors; it must contract all operands into one");
  for (int64_t m = 0; m < n_modes; ++m)
    if (is_sliced[m]) count[m] = 0;  // sliced modes are gone everywhere
  Modes kept;
  for (int64_t m : output)
    if (!is_sliced[m]) kept.push_back(m);
  const std::vector<Consumer> consumer = consumer_groups(lay, count, path);

  CompiledProgram out;
  std::vector<int64_t> cur(n_in);
  for (int64_t i = 0; i < n_in; ++i) cur[i] = i;
  std::vector<char> is_checkpoint(path.size(), 0);
  for (int64_t j : checkpoints)
    if (j >= 0 && j < static_cast<int64_t>(path.size())) is_checkpoint[j] = 1;
  GroupOf group(n_modes, 0);
  int64_t nslot = n_in;
  for (size_t j = 0; j < path.size(); ++j) {
    if (is_checkpoint[j]) {
      Instr in;
      in.op = kCheckpoint;
      P.instrs.push_back(std::move(in));
    }
    const auto [p, q] = path[j];
    const int64_t sb = cur[q];
    cur.erase(cur.begin() + q);
    const int64_t sa = cur[p];
    cur.erase(cur.begin() + p);
    const Modes ma0 = lay[sa].modes, mb0 = lay[sb].modes;
    for (int64_t m : ma0) --count[m];
    for (int64_t m : mb0) --count[m];
    // modes of one side that no one else needs: sum them before the GEMM
    for (int side = 0; side < 2; ++side) {
      const int64_t s = side ? sb : sa;
      const Modes& other = side ? ma0 : mb0;
      const Modes& modes = lay[s].modes;
      std::vector<int64_t> dims;
      Modes rest;
      for (size_t d = 0; d < modes.size(); ++d) {
        if (count[modes[d]] == 0 && std::find(other.begin(), other.end(), modes[d]) == other.end())
          dims.push_back(static_cast<int64_t>(d));
        else
          rest.push_back(modes[d]);
      }
      if (!dims.empty()) {
        Instr in;
        in.op = kSum, in.slot = s, in.dims = dims;
        P.instrs.push_back(std::move(in));
        lay[s].strides = C.contiguous_strides(rest);
        lay[s].modes = std::move(rest);
      }
    }
    const Slot& A = lay[sa];
    const Slot& B = lay[sb];
    for (int64_t m : A.modes)
      group[m] = std::find(B.modes.begin(), B.modes.end(), m) != B.modes.end() ? (count[m] > 0 ? 'b' : 'k') : 'f';
    for (int64_t m : B.modes)
      group[m] = std::find(A.modes.begin(), A.modes.end(), m) != A.modes.end() ? (count[m] > 0 ? 'b' : 'k') : 'f';
    // _step_layout: the quick layout for steps of few multiply-adds over all slices
    Modes all = A.modes;
    for (int64_t m : B.modes)
      if (std::find(all.begin(), all.end(), m) == all.end()) all.push_back(m);
    // macs * nslices < quick_macs, without overflow
    const int64_t macs = C.prod(all);
    const bool quick = quick_macs > 0 && (nslices == 0 || macs <= (quick_macs - 1) / nslices);
    const Consumer& cons = consumer[nslot];
    const Layout L = quick ? quick_layout(C, A, B, group, cons, kept) : gemm_layout(C, A, B, group, cons, kept);
    // X enters bmm as [Bt,M,K] (stored [Bt,K,M] if tx), Y as [Bt,K,N] (stored [Bt,N,K] if ty)
    const int64_t sx = L.swap ? sb : sa, sy = L.swap ? sa : sb;
    const Modes& mx = lay[sx].modes;
    const Modes& my = lay[sy].modes;
    const Side& X = L.swap ? L.b : L.a;
    const Side& Y = L.swap ? L.a : L.b;
    const bool tx = X.contr_first, ty = !Y.contr_first;
    auto dim_of = [](const Modes& ms, int64_t m) {
      return static_cast<int64_t>(std::find(ms.begin(), ms.end(), m) - ms.begin());
    };
    Instr in;
    in.op = kContract, in.a = sx, in.b = sy, in.c = nslot;
    const Orders& ox = X.orders;
    const Orders& oy = Y.orders;
    for (int64_t m : tx ? cat(ox.b, ox.k, ox.f) : cat(ox.b, ox.f, ox.k)) in.perm_a.push_back(dim_of(mx, m));
    for (int64_t m : ty ? cat(oy.b, oy.f, oy.k) : cat(oy.b, oy.k, oy.f)) in.perm_b.push_back(dim_of(my, m));
    in.ta = tx, in.tb = ty;
    in.bt = C.prod(X.orders.b), in.m = C.prod(X.orders.f), in.kk = C.prod(X.orders.k), in.n = C.prod(Y.orders.f);
    Modes cm = cat(X.orders.b, X.orders.f, Y.orders.f);
    for (int64_t m : cm) in.shape_c.push_back(C.size(m));
    CompiledStep st;
    st.macs = checked_mul(checked_mul(checked_mul(in.bt, in.m), in.kk), in.n);
    st.result = checked_mul(checked_mul(in.bt, in.m), in.n);
    st.gemm_operands = checked_mul(checked_mul(in.bt, in.kk), in.m + in.n);
    P.instrs.push_back(std::move(in));
    for (int64_t m : cm) ++count[m];
    for (int side = 0; side < 2; ++side) {
      const int64_t s = side ? sb : sa;
      const bool cp = side ? L.b.copied : L.a.copied;
      if (s >= n_in && cp) {
        st.copied.push_back(s - n_in);
        out.steps[s - n_in].result_copied = true;
      }
    }
    out.steps.push_back(std::move(st));
    Slot res{cm, C.contiguous_strides(cm)};
    lay.push_back(std::move(res));
    cur.push_back(nslot++);
  }
  const int64_t slot = cur[0];
  const Modes& modes = lay[slot].modes;
  Modes a = modes, b = kept;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  if (a != b) throw std::logic_error("contraction compiler: internal: the final modes are not the output's");
  Instr fin;
  fin.op = kFinal, fin.slot = slot;
  for (int64_t m : kept) fin.perm.push_back(static_cast<int64_t>(std::find(modes.begin(), modes.end(), m) - modes.begin()));
  for (size_t pos = output.size(); pos-- > 0;)
    if (is_sliced[output[pos]]) fin.blocks.emplace_back(static_cast<int64_t>(pos), slot_of_k[output[pos]]);
  std::sort(fin.blocks.begin(), fin.blocks.end(), std::greater<>());
  P.instrs.push_back(std::move(fin));
  out.program = encode_program(P);
  return out;
}

}  // namespace torch_gradops
