"""Does this CPU overlap random row gathers with independent arithmetic? A machine probe.

The fused GAT/GATv2 forwards interleave two kinds of work per edge: a gather of one random
``x_src`` row (``H*C`` floats) and arithmetic on registers and cache-resident data (scores,
softmax, with edge features the 16 x 256 multiply-adds of the edge projection). How far their
sum can drop towards the larger of the two is a property of the core, not of the kernels. This
probe measures it with nothing else in the loop: per "edge", a random row of a ``[N, row]``
float32 table summed into four registers (``gather``), a fixed number of blocks of eight independent
fused multiply-add chains on registers (``compute``), and both in one loop (``both``), one
thread. Row prefetches: none, ``burst`` (all lines of the row ``distance`` edges ahead at the
top of each edge) or ``spread`` (one line per arithmetic block, the row ``distance`` edges
ahead; the float32 kernels issue theirs a head's slice at a time through the score loop, in
between).

``overlap = (gather + compute - both) / min(gather, compute)``: 1 when the smaller of the two
hides entirely under the larger, 0 when they add up (negative when together they run slower than
apart).

Prints a table and writes JSON under ``benchmarks/results/``. Compiles its C++ loop with
``torch.utils.cpp_extension.load_inline`` (a C++ compiler is needed; ``-march=native``).

    python benchmarks/gather_overlap_probe.py
    python benchmarks/gather_overlap_probe.py --nodes 100000 --edges 2000000 --work 16 32 64 --distances 4 8 16
    THP_MEM_ALLOC_ENABLE=1 python benchmarks/gather_overlap_probe.py   # the table on 2 MiB pages
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, write_json  # noqa: E402

HERE = os.path.abspath(__file__)

_SOURCE = r"""
#include <torch/extension.h>
#include <chrono>

typedef float v8 __attribute__((vector_size(32)));

// ns per edge of one loop over idx: gather (a random row of table summed into a register),
// compute (`work` blocks of eight independent multiply-add chains on registers) or both;
// prefetch: 0 none, 1 burst (every line of the row `dist` edges ahead, at the top of the
// edge), 2 spread (one line of that row per arithmetic block, the rest at the end).
double probe(torch::Tensor table, torch::Tensor idx, bool gather, bool compute, int64_t work,
             int64_t prefetch, int64_t dist) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kFloat && table.is_contiguous(), "table");
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == torch::kLong, "idx");
  const float* x = table.data_ptr<float>();
  const int64_t* ix = idx.data_ptr<int64_t>();
  const int64_t E = idx.numel(), row = table.size(1), row_bytes = row * 4;
  const int64_t lines = (row_bytes + 63) / 64;
  v8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, c0, c1, r0, r1, r2, r3, r4, r5, r6, r7;
  for (int i = 0; i < 8; ++i) {
    c0[i] = 0.999f; c1[i] = 1e-4f;
    r0[i] = 0; r1[i] = 1; r2[i] = 2; r3[i] = 3; r4[i] = 4; r5[i] = 5; r6[i] = 6; r7[i] = 7;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t e = 0; e < E; ++e) {
    const char* ahead = gather && prefetch && e + dist < E
        ? reinterpret_cast<const char*>(x + ix[e + dist] * row) : nullptr;
    if (ahead && prefetch == 1) {
      for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(ahead + 64 * l);
    }
    if (gather) {
      const float* xr = x + ix[e] * row;
      int64_t f = 0;
      for (; f + 32 <= row; f += 32) {  // four independent sums: no long add chain per row
        v8 v0, v1, v2, v3;
        __builtin_memcpy(&v0, xr + f, 32);
        __builtin_memcpy(&v1, xr + f + 8, 32);
        __builtin_memcpy(&v2, xr + f + 16, 32);
        __builtin_memcpy(&v3, xr + f + 24, 32);
        a0 += v0; a1 += v1; a2 += v2; a3 += v3;
      }
      for (; f + 8 <= row; f += 8) {
        v8 v;
        __builtin_memcpy(&v, xr + f, 32);
        a0 += v;
      }
    }
    int64_t issued = 0;
    if (compute) {
      const int64_t every = work >= lines ? work / lines : 1;
      for (int64_t w = 0; w < work; ++w) {
        if (ahead && prefetch == 2 && w % every == 0 && issued < lines) __builtin_prefetch(ahead + 64 * issued++);
        r0 = r0 * c0 + c1; r1 = r1 * c0 + c1; r2 = r2 * c0 + c1; r3 = r3 * c0 + c1;
        r4 = r4 * c0 + c1; r5 = r5 * c0 + c1; r6 = r6 * c0 + c1; r7 = r7 * c0 + c1;
      }
    }
    if (ahead && prefetch == 2) {
      for (; issued < lines; ++issued) __builtin_prefetch(ahead + 64 * issued);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  v8 sink = ((a0 + a1) + (a2 + a3)) + ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7));
  static volatile v8 keep;  // every lane stored: no part of the loops may be optimised away
  keep = sink;
  return s / static_cast<double>(E) * 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe); }
"""

PREFETCH = {"none": 0, "burst": 1, "spread": 2}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=100000, help="table rows (x_src's nodes)")
    p.add_argument("--edges", type=int, default=2000000, help="gathers per loop")
    p.add_argument("--row", type=int, default=256, help="floats per row (H*C)")
    p.add_argument("--work", type=int, nargs="+", default=[16, 64],
                   help="arithmetic blocks per edge (each: 8 independent 8-wide multiply-adds)")
    p.add_argument("--prefetch", nargs="+", default=["none", "burst", "spread"], choices=list(PREFETCH))
    p.add_argument("--distances", type=int, nargs="+", default=[4, 16], help="prefetch this many edges ahead")
    p.add_argument("--repeats", type=int, default=5, help="rounds, the three loops alternating in each")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from torch.utils.cpp_extension import load_inline
    ext = load_inline("gather_overlap_probe", cpp_sources=[_SOURCE], extra_cflags=["-O2", "-march=native"],
                      verbose=False)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(args.nodes, args.row, generator=gen)
    idx = torch.randint(0, args.nodes, (args.edges,), generator=gen)

    rows = []
    print(f"table {args.nodes} x {args.row} float32 ({table.numel() * 4 / 2**20:.0f} MiB), {args.edges} random "
          f"gathers, 1 thread, medians of {args.repeats} rounds (ns per edge)")
    print(f"{'work':>5} {'prefetch':>8} {'dist':>4} | {'gather':>7} {'compute':>8} {'both':>7} {'sum':>7} | overlap")
    configs = [(w, pf, d) for w in args.work for pf in args.prefetch
               for d in (args.distances if pf != "none" else [0])]
    for work, pf, distance in configs:
        times = {"gather": [], "compute": [], "both": []}
        args_of = {"gather": (True, False), "compute": (False, True), "both": (True, True)}
        for name, (g, c) in args_of.items():  # warm-up
            ext.probe(table, idx[: args.edges // 10], g, c, work, PREFETCH[pf], distance)
        for _ in range(args.repeats):
            for name, (g, c) in args_of.items():
                times[name].append(ext.probe(table, idx, g, c, work, PREFETCH[pf], distance))
        med = {k: statistics.median(v) for k, v in times.items()}
        overlap = (med["gather"] + med["compute"] - med["both"]) / min(med["gather"], med["compute"])
        rows.append({"work": work, "prefetch": pf, "distance": distance, "ns_per_edge": med,
                     "all_ns_per_edge": times, "overlap": overlap})
        print(f"{work:>5} {pf:>8} {distance:>4} | {med['gather']:7.1f} {med['compute']:8.1f} {med['both']:7.1f} "
              f"{med['gather'] + med['compute']:7.1f} | {overlap:6.2f}", flush=True)
    info = machine_info("cpu")
    info["threads"] = 1
    out = args.out or os.path.join(os.path.dirname(HERE), "results", "gather_overlap_probe_cpu.json")
    write_json(out, {"benchmark": "gather_overlap_probe", "machine": info, "nodes": args.nodes,
                     "edges": args.edges, "row_floats": args.row,
                     "overlap": "(gather + compute - both) / min(gather, compute)", "rows": rows})


if __name__ == "__main__":
    main()
