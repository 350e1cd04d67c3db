"""The peer's trees on the benchmark lattices: how often its unseeded search slices, and what the
backward of its trees would need at the least.

For each lattice and memory limit of ``tensornet_sliced.py``, runs the peer's search
(``cotengra.HyperOptimizer(methods=["greedy"], max_repeats=16,
slicing_opts=dict(target_size=limit_elements))``) ``--searches`` times in one process (the search
is unseeded: each draws new trees) and records per search the slice count, the forward FLOPs, and,
for trees of one slice, the memory floor of any backward in units of the limit: the most the
forward holds live at once (every intermediate made earlier and read later, plus the step's own
result and transients, as ``torch_gradops.tensornet.slicer``'s memory model counts them). The
backward holds the gradients of that same live set whatever it recomputes, so a tree whose floor
is above ``slicer.BACKWARD_FACTOR`` cannot run within the memory contract by recomputation; it
needs slices. The floor depends on the order of the steps; next to it, the least floor over the
orders of each step's two subtrees (the classic tree schedule: at each step, the subtree that needs
more first), and the lowest peak of one level of checkpoints (what the executor runs).

    python benchmarks/tensornet_peer_trees.py                 # 6x6 / bond 8 and 5x5 / bond 16
    python benchmarks/tensornet_peer_trees.py --searches 10

Writes benchmarks/results/tensornet_peer_trees_cpu.json.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _common import machine_info, write_json  # noqa: E402

MIB = 2 ** 20
LATTICES = [(6, 6, 8), (5, 5, 16)]
LIMITS_MIB = [1, 4, 16]


def least_floor(costs, path, n: int) -> float:
    """The least ``slicer.live_floor`` of the path's tree over the orders of each step's two
    subtrees, in elements: a subtree's floor is the most of its first child's floor, the first
    child's result held while the second runs, and the step itself (both results, its own and its
    transients), minimised per step over which child goes first (post-order schedules)."""
    from torch_gradops.tensornet import paths, slicer
    trans = slicer.step_transients(costs)
    res, floor = {}, {}
    for j, (a, b) in enumerate(paths.linear_to_ssa(path)):
        ra, rb, fa, fb = res.get(a, 0), res.get(b, 0), floor.get(a, 0), floor.get(b, 0)
        top = ra + rb + costs.result[j] + trans[j]
        res[n + j] = costs.result[j]
        floor[n + j] = max(top, min(max(fa, ra + fb), max(fb, rb + fa)))
    return floor[n + len(path) - 1]


def memory_floor(inputs, output, sizes, path) -> tuple:
    """``(floor, least floor over orders, one-level peak)`` of a path unsliced, in elements:
    ``slicer.live_floor``, :func:`least_floor` and ``slicer.place_checkpoints``' lowest-peak
    placement (cap 0: none fits)."""
    from torch_gradops.tensornet import slicer
    steps = slicer.step_table(inputs, output, path)
    costs = slicer.step_costs(steps, sizes, ())
    peak, _, _ = slicer.place_checkpoints(costs, 0.0)
    return slicer.live_floor(costs), least_floor(costs, path, len(inputs)), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--searches", type=int, default=30, help="peer searches per configuration (default 30)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tensornet_peer_trees_cpu.json"))
    args = ap.parse_args()
    import cotengra as ctg
    import torch
    from torch_gradops.testing import lattice_network

    results = []
    print(f"{'lattice':<14} {'limit':>6}  {'slices: searches':<28} {'FLOPs median (min)':<20} "
          f"one-slice trees: floor (least over orders) / one-level peak (x limit)")
    for rows, cols, bond in LATTICES:
        inputs, output, arrays = lattice_network(rows, cols, bond, seed=0, dtype=torch.float32)
        sizes = {m: e for t, a in zip(inputs, arrays) for m, e in zip(t, a.shape)}
        sym = [tuple(ctg.get_symbol(m) for m in t) for t in inputs]
        size_dict = {ctg.get_symbol(m): e for m, e in sizes.items()}
        for limit_mib in LIMITS_MIB:
            limit = limit_mib * MIB // arrays[0].element_size()
            searches = []
            for _ in range(args.searches):
                opt = ctg.HyperOptimizer(methods=["greedy"], max_repeats=16, slicing_opts=dict(target_size=limit),
                                         progbar=False, parallel=False)
                tree = opt.search(sym, (), size_dict)
                entry = {"slices": int(tree.nslices), "flops": float(tree.total_flops()) * 2}
                if tree.nslices == 1:
                    floor, least, peak = memory_floor([list(t) for t in inputs], list(output), sizes,
                                               [tuple(p) for p in tree.get_path()])
                    entry.update(floor_x_limit=floor / limit, least_floor_x_limit=least / limit,
                                 one_level_peak_x_limit=peak / limit)
                searches.append(entry)
            counts = sorted(collections.Counter(s["slices"] for s in searches).items())
            flops = [s["flops"] for s in searches]
            floors = [s["floor_x_limit"] for s in searches if "floor_x_limit" in s]
            least = [s["least_floor_x_limit"] for s in searches if "least_floor_x_limit" in s]
            peaks = [s["one_level_peak_x_limit"] for s in searches if "one_level_peak_x_limit" in s]
            one = (f"{min(floors):.1f}-{max(floors):.1f} ({min(least):.1f}-{max(least):.1f}) / "
                   f"{min(peaks):.1f}-{max(peaks):.1f}" if floors else "-")
            print(f"{rows}x{cols}, bond {bond:<3} {limit_mib:>3} MiB  "
                  f"{', '.join(f'{k}: {v}' for k, v in counts):<28} "
                  f"{statistics.median(flops):.2e} ({min(flops):.2e})  {one}", flush=True)
            results.append({"rows": rows, "cols": cols, "bond": bond, "limit_bytes": limit_mib * MIB,
                            "slice_counts": dict(counts), "searches": searches})
    write_json(args.out, {"machine": machine_info("cpu"), "searches_per_config": args.searches,
                          "results": results})


if __name__ == "__main__":
    main()
