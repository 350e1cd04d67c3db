"""How close ``ContractionPlan.estimated_seconds`` comes to the measured time.

For a set of networks (lattices, circuit amplitudes and VQE-style expectation values, MPS and
PEPS norms, random networks, matrix chains) in float32, float64 and complex64, at memory limits
from none down to a few hundred bytes (1 to ~16,000 slices, steps of one element to millions),
plans each, then times ``plan.contract`` forward and forward + backward (``.backward()`` of the
real part's sum, every operand requiring grad): the median after one warm-up (9 runs under
50 ms, 5 under 0.5 s, else 3). Prints per network the estimate, the time and their ratio, and
the ratio's spread; writes JSON. Plans estimated above ``--max-estimate`` seconds are skipped.
The constants fitted from such a run are ``torch_gradops.tensornet.plan.TIME_MODEL``.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/tensornet_estimate.py
    python benchmarks/tensornet_estimate.py --only lattice --out /tmp/est.json

Writes benchmarks/results/tensornet_estimate_cpu.json.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _common import machine_info, write_json  # noqa: E402

import torch  # noqa: E402

DTYPES = {"f32": torch.float32, "f64": torch.float64, "c64": torch.complex64}

# (kind, arguments, dtype, memory limits)
CASES = [
    ("circuit", (3, 4, 6), "c64", [None, "1KiB", "256B"]),
    ("circuit", (4, 4, 8), "c64", [None, "16KiB", "2KiB"]),
    ("circuit", (4, 5, 10), "c64", [None, "64KiB", "16KiB"]),
    ("vqe", (3, 4, 6), "c64", [None, "16KiB", "4KiB", "1KiB"]),
    ("vqe", (4, 4, 6), "c64", [None, "64KiB", "16KiB"]),
    ("lattice", (4, 4, 4), "f32", [None, "1KiB", "256B"]),
    ("lattice", (5, 5, 4), "f64", [None, "16KiB", "1KiB"]),
    ("lattice", (6, 6, 3), "f32", [None, "64KiB", "4KiB"]),
    ("lattice", (4, 4, 8), "f64", [None, "1MiB", "64KiB", "4KiB"]),
    ("lattice", (5, 5, 8), "c64", [None, "1MiB", "256KiB", "64KiB"]),
    ("lattice", (5, 5, 16), "f32", [None, "16MiB"]),
    ("rand", (20, 3, 2, 8, 1), "f64", [None, "64KiB", "4KiB", "1KiB"]),
    ("rand", (30, 3, 2, 4, 2), "c64", [None, "16KiB", "2KiB"]),
    ("rand", (14, 4, 4, 12, 3), "f32", [None, "4MiB", "256KiB", "16KiB"]),
    ("mps", (30, 32), "f32", [None, "16KiB"]),
    ("mps", (100, 8), "f64", [None]),
    ("mps", (60, 16), "f32", [None]),
    ("mps", (12, 256), "f32", [None, "1MiB", "64KiB"]),
    ("peps", (3, 3, 4), "f64", [None, "64KiB", "4KiB"]),
    ("peps", (3, 3, 3), "c64", [None, "2KiB", "512B"]),
    ("chain", (4, 256), "f32", [None, "64KiB", "4KiB"]),
    ("chain", (3, 1024), "f64", [None, "1MiB", "64KiB"]),
    ("chain", (8, 64), "c64", [None]),
]


def vqe_network(rows, cols, depth, dtype):
    """<psi| Z0 Z1 |psi> for the circuit state of ``circuit_amplitude_network`` (its closing
    bitstring tensors removed): the circuit, its conjugate mirror and the observable."""
    from torch_gradops.testing import circuit_amplitude_network
    inputs, _, arrays = circuit_amplitude_network(rows, cols, depth, seed=0, dtype=dtype)
    nq = rows * cols
    inputs, arrays = inputs[:-nq], arrays[:-nq]
    count = {}
    for t in inputs:
        for m in t:
            count[m] = count.get(m, 0) + 1
    final = [m for m in sorted(count) if count[m] == 1 and m >= nq]  # the open output legs
    shift = max(count) + 1
    terms = [list(t) for t in inputs] + [[m + shift for m in t] for t in inputs]
    tensors = list(arrays) + [a.conj() for a in arrays]
    for k, m in enumerate(final):
        op = torch.diag(torch.tensor([1.0, -1.0])) if k < 2 else torch.eye(2)
        terms.append([m, m + shift])
        tensors.append(op.to(dtype))
    return terms, [], tensors


def random_network(n, reg, d_min, d_max, n_out, dtype):
    import cotengra
    eq = cotengra.utils.rand_equation(n, reg, n_out=n_out, d_min=d_min, d_max=d_max, seed=0)
    ids = {}
    terms = [[ids.setdefault(ix, len(ids)) for ix in t] for t in eq.inputs]
    output = [ids.setdefault(ix, len(ids)) for ix in eq.output]
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for t in eq.inputs:
        shape = tuple(eq.size_dict[ix] for ix in t)
        tensors.append((torch.randn(shape, generator=gen, dtype=torch.float64)
                        / max(1, math.prod(shape)) ** 0.25).to(dtype))
    return terms, output, tensors


def network(kind, args, dtype):
    from torch_gradops import testing
    if kind == "circuit":
        return testing.circuit_amplitude_network(*args, seed=0, dtype=dtype)
    if kind == "vqe":
        return vqe_network(*args, dtype)
    if kind == "lattice":
        return testing.lattice_network(*args, seed=0, dtype=dtype)
    if kind == "mps":
        return testing.mps_network(*args, dtype=dtype)
    if kind == "peps":
        return testing.peps_norm_network(*args, dtype=dtype)
    if kind == "rand":
        return random_network(*args, dtype)
    if kind == "chain":  # a product of k n x n matrices, open ends
        k, n = args
        gen = torch.Generator().manual_seed(0)
        return ([[i, i + 1] for i in range(k)], [0, k],
                [(torch.randn(n, n, generator=gen, dtype=torch.float64) / n ** 0.5).to(dtype) for _ in range(k)])
    raise ValueError(kind)


def timed(fn):
    """(median seconds, all runs) after one warm-up: 9 runs under 50 ms, 5 under 0.5 s, else 3."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    runs = []
    for _ in range(9 if first < 0.05 else 5 if first < 0.5 else 3):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs


def measure(kind, args, dtype_name, limit, max_estimate):
    import torch_gradops.tensornet as tn
    from torch_gradops.tensornet.plan import device_flop_rate
    from torch_gradops.testing import interleave
    inputs, output, arrays = network(kind, args, DTYPES[dtype_name])
    p = tn.plan(*interleave(inputs, arrays, output), memory_limit=limit, max_overhead=None)
    parts = p.hoisted.plans() if p.hoisted is not None else [p]
    row = {"network": f"{kind}{args}", "dtype": dtype_name, "memory_limit": limit, "tensors": len(inputs),
           "slices": p.num_slices, "steps": len(p.path), "flops": sum(q.flops for q in parts),
           "step_slices": sum(q.num_slices * max(len(q.path), 1) for q in parts),
           "recompute_flops": sum(q.recompute_flops for q in parts),
           "bytes_moved": sum(q.bytes_moved for q in parts), "flop_rate": device_flop_rate("cpu", p.dtype),
           "estimate_forward_s": p.estimated_seconds(False), "estimate_forward_backward_s": p.estimated_seconds(True)}
    if row["estimate_forward_backward_s"] > max_estimate:
        row["skipped"] = f"estimated above {max_estimate} s"
        return row
    row["forward_s"], row["forward_runs"] = timed(lambda: p.contract(*arrays))
    leaves = [a.detach().clone().requires_grad_(True) for a in arrays]

    def forward_backward():
        for t in leaves:
            t.grad = None
        r = p.contract(*leaves)
        (r.real if r.is_complex() else r).sum().backward()

    row["forward_backward_s"], row["forward_backward_runs"] = timed(forward_backward)
    row["ratio_forward"] = row["forward_s"] / row["estimate_forward_s"]
    row["ratio_forward_backward"] = row["forward_backward_s"] / row["estimate_forward_backward_s"]
    return row


def spread(values):
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}" if values else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="run only the networks of this kind (circuit, vqe, lattice, ...)")
    ap.add_argument("--max-estimate", type=float, default=5.0, help="skip plans estimated above this (s)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tensornet_estimate_cpu.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'network':<26} {'dtype':<4} {'limit':>6} {'slices':>6} {'steps':>5}  "
          f"{'forward: est / measured (ratio)':<34} forward+backward: est / measured (ratio)")
    for kind, net_args, dtype_name, limits in CASES:
        if args.only and kind != args.only:
            continue
        for limit in limits:
            row = measure(kind, net_args, dtype_name, limit, args.max_estimate)
            rows.append(row)
            head = f"{row['network']:<26} {dtype_name:<4} {str(limit):>6} {row['slices']:>6} {row['steps']:>5}  "
            if "skipped" in row:
                print(head + row["skipped"], flush=True)
                continue
            print(head + f"{row['estimate_forward_s']:.3g} / {row['forward_s']:.3g} s ({row['ratio_forward']:.2f})"
                  .ljust(35) + f"{row['estimate_forward_backward_s']:.3g} / {row['forward_backward_s']:.3g} s "
                  f"({row['ratio_forward_backward']:.2f})", flush=True)
    done = [r for r in rows if "skipped" not in r]
    fwd, fb = [r["ratio_forward"] for r in done], [r["ratio_forward_backward"] for r in done]
    print(f"measured / estimated over {len(done)} plans (min / median / max): forward {spread(fwd)}, "
          f"forward+backward {spread(fb)}")
    write_json(args.out, {"machine": machine_info("cpu"), "rows": rows,
                          "ratio_forward": {"min": min(fwd), "median": statistics.median(fwd), "max": max(fwd)},
                          "ratio_forward_backward": {"min": min(fb), "median": statistics.median(fb),
                                                     "max": max(fb)}})


if __name__ == "__main__":
    main()
