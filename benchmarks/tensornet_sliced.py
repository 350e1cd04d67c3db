"""Sliced tensor networks with gradients: torch_gradops.tensornet against cotengra + autograd.

The targets of issue 12, each configuration in a fresh process (2 threads):

* lattices (``cotengra.utils.lattice_equation``): 5x5 with bonds of 16 and 6x6 with bonds of
  8, float32, scalar output, memory limits 64, 16, 4 and 1 MiB, forward + backward. The peer:
  ``cotengra.HyperOptimizer(methods=["greedy"], max_repeats=16,
  slicing_opts=dict(target_size=limit_elements))`` + ``tree.contract(arrays, backend="torch")``
  + torch autograd, i.e. the same largest-intermediate budget (autograd then holds every
  slice's intermediates until backward).
* random-circuit amplitudes built with quimb (an optional dependency of this script only):
  4x4 depth 10 and 4x5 depth 12, U3 + CZ layers on the grid's edges, complex64,
  ``circ.amplitude_tn(bitstring)``, sliced to 128 KiB and 1 MiB; ours must equal quimb's
  ``circ.amplitude`` and opt_einsum-on-torch's gradients. Same peer.
* the same circuits and lattices unsliced, forward and forward + backward, against torch.einsum
  (one call per pairwise step of opt_einsum's path: the networks have more modes than
  torch.einsum has letters), opt_einsum (``backend="torch"``) and cotengra
  (``tree.contract(backend="torch")``).

Times: ``plan_s`` (path search and slicing; for ours everything ``tn.plan`` does), ``run_s``
(median of the steady-state forward + backward, or forward) and ``total_s = plan_s + run_s``
(what a single call costs, planning included: the targets compare this); ``run_s`` is the
median of 3-20 runs, as many as fit in about a second after the first (1 for runs of 5 s or
more); ``--repeat N`` runs each configuration's timing process N times, alternating between
the implementations, and keeps the fastest (also recording every process's total and their
median: the peer's search is unseeded, so its plan and time vary from process to process).
Peak memory: the growth of the process's resident-set high-water mark over one forward + backward
(``torch_gradops.testing.PeakMemory``), measured in a separate process with glibc's mmap
threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``), so that freed tensors go back to the
OS instead of staying in the heap as slack: every page touched, an upper bound on tensor
memory, the same way for every implementation (``peak_bytes_default_malloc``: the same in the
timing process, with glibc's adaptive threshold). Where one run takes less than 1.5 s the
peak process also records ``tensor_peak_bytes``, the tensor allocator's exact peak
(``testing.peak_allocated_bytes``, what the tests check): at limits of a few hundred KiB the
resident set's pages and the interpreter's objects are of the order of the contract itself.
FLOPs: real floating-point operations
of the forward over all slices (a complex multiply-add counts 8).

    python benchmarks/tensornet_sliced.py                  # everything (about 20-40 minutes)
    python benchmarks/tensornet_sliced.py --only lattice   # or circuit / unsliced
    python benchmarks/tensornet_sliced.py --quick          # small networks (smoke test)
    python benchmarks/tensornet_sliced.py --device cuda    # on a GPU (the peers too)

On a GPU the times wait for the device (``torch.cuda.synchronize``), the peak is the growth of
``torch.cuda.max_memory_allocated`` over one forward + backward, and the results also give the
achieved FLOP/s (forward FLOPs times 3 for forward + backward, plus ours recomputed) against a
same-run matmul's (``matmul_flops_per_s`` in the JSON).

Writes benchmarks/results/tensornet_sliced_<cpu|cuda>.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _common import machine_info, matmul_flops_per_s, run_worker, write_json  # noqa: E402

warnings.filterwarnings("ignore")
THREADS = 2
MIB = 2 ** 20


# ---------------------------------------------------------------------------- networks
def lattice(rows, cols, bond):
    """(inputs as int labels, output, float32 arrays) of the benchmark lattice."""
    import torch
    from torch_gradops.testing import lattice_network
    return lattice_network(rows, cols, bond, seed=0, dtype=torch.float32)


def quimb_circuit(rows, cols, depth, seed=0):
    """A random circuit on a rows x cols grid: per layer U3 on every qubit, then CZ on the
    grid edges of one of four patterns (horizontal even/odd, vertical even/odd); and a random
    bitstring."""
    import numpy as np
    import quimb.tensor as qtn
    rng = np.random.default_rng(seed)
    n = rows * cols
    q = lambda r, c: r * cols + c  # noqa: E731
    patterns = [
        [(q(r, c), q(r, c + 1)) for r in range(rows) for c in range(0, cols - 1, 2)],
        [(q(r, c), q(r + 1, c)) for r in range(0, rows - 1, 2) for c in range(cols)],
        [(q(r, c), q(r, c + 1)) for r in range(rows) for c in range(1, cols - 1, 2)],
        [(q(r, c), q(r + 1, c)) for r in range(1, rows - 1, 2) for c in range(cols)],
    ]
    circ = qtn.Circuit(n)
    for layer in range(depth):
        for i in range(n):
            circ.apply_gate("U3", *rng.uniform(0, 2 * math.pi, 3), i)
        for a, b in patterns[layer % 4]:
            circ.apply_gate("CZ", a, b)
    bits = "".join(rng.choice(["0", "1"], n))
    return circ, bits


def circuit(rows, cols, depth):
    """(inputs as index-name labels, output, complex64 arrays, scale, quimb's amplitude): the
    amplitude network ``circ.amplitude_tn(bits)`` (quimb simplifies it; its value times
    ``scale`` = 10**exponent is the amplitude)."""
    import torch
    circ, bits = quimb_circuit(rows, cols, depth)
    tn = circ.amplitude_tn(bits, dtype="complex64")
    inputs = [list(t.inds) for t in tn.tensors]
    arrays = [torch.from_numpy(t.data.copy()).to(torch.complex64) for t in tn.tensors]
    amp = complex(circ.amplitude(bits, dtype="complex128"))
    return inputs, list(tn.outer_inds()), arrays, 10.0 ** float(getattr(tn, "exponent", 0.0)), amp


def network(spec):
    if spec["kind"] == "lattice":
        inputs, output, arrays = lattice(spec["rows"], spec["cols"], spec["bond"])
        return inputs, output, arrays, 1.0, None
    return circuit(spec["rows"], spec["cols"], spec["depth"])


def symbolic(inputs, output):
    """Labels -> single-character symbols (opt_einsum / cotengra / quimb-style equations)."""
    import opt_einsum as oe
    ids = {}
    for t in list(inputs) + [output]:
        for ix in t:
            ids.setdefault(ix, oe.get_symbol(len(ids)))
    return [[ids[ix] for ix in t] for t in inputs], [ids[ix] for ix in output]


# ---------------------------------------------------------------------------- workers
def _median(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(spec, impl):
    import torch
    torch.set_num_threads(THREADS)
    device = torch.device(spec.get("device", "cpu"))
    if impl == "matmul":
        print(json.dumps(dict(impl=impl, matmul_flops_per_s=matmul_flops_per_s(str(device)))))
        return
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    import cotengra as ctg
    import opt_einsum as oe
    from torch_gradops import tensornet as tnet
    from torch_gradops.testing import PeakMemory, einsum_pairwise, interleave

    inputs, output, arrays, scale, amp = network(spec)
    arrays = [a.to(device) for a in arrays]
    limit = spec.get("limit")
    grads_wanted = spec["mode"] == "fwd_bwd"
    leaves = [a.clone().requires_grad_(grads_wanted) for a in arrays]
    sym_in, sym_out = symbolic(inputs, output)
    size_dict = {s: a.shape[d] for t, a in zip(sym_in, arrays) for d, s in enumerate(t)}
    is_complex = arrays[0].dtype.is_complex
    res = dict(spec=spec, impl=impl)

    if impl == "ours":
        t0 = time.perf_counter()
        plan = tnet.plan(*interleave(inputs, arrays, output), memory_limit=limit, max_overhead=None)
        res["plan_s"] = time.perf_counter() - t0
        res.update(slices=plan.num_slices, flops=plan.flops, recompute_flops=plan.recompute_flops,
                   largest_intermediate_bytes=plan.largest_intermediate[1], modelled_peak_bytes=plan.modelled_peak,
                   checkpoints=len(plan.checkpoints), sliced_modes=len(plan.sliced_modes),
                   search_s=plan.search_s)

        def call():
            return plan.contract(*leaves)
    elif impl in ("cotengra", "opt_einsum", "torch.einsum"):
        t0 = time.perf_counter()
        if impl == "cotengra":
            slicing = dict(target_size=limit // arrays[0].element_size()) if limit else None
            opt = ctg.HyperOptimizer(methods=["greedy"], max_repeats=16, slicing_opts=slicing, progbar=False,
                                     parallel=False)
            tree = opt.search(sym_in, sym_out, size_dict)
            res.update(slices=tree.nslices, flops=int(tree.total_flops() * 2 * (4 if is_complex else 1)),
                       largest_intermediate_bytes=int(tree.max_size()) * arrays[0].element_size())

            def call():
                return tree.contract(leaves, backend="torch")
        elif impl == "opt_einsum":
            eq = ",".join("".join(t) for t in sym_in) + "->" + "".join(sym_out)
            info = oe.contract_path(eq, *[a.shape for a in arrays], optimize="auto", shapes=True)[1]
            expr = oe.contract_expression(eq, *[a.shape for a in arrays], optimize=info.path)
            res.update(slices=1, flops=int(float(info.opt_cost) * (4 if is_complex else 1)))

            def call():
                return expr(*leaves, backend="torch")
        else:
            path = oe.contract_path(",".join("".join(t) for t in sym_in) + "->" + "".join(sym_out), *arrays,
                                    optimize="auto", shapes=False)[0]

            def call():
                return einsum_pairwise(inputs, output, leaves, path)
        res["plan_s"] = time.perf_counter() - t0
    else:
        raise ValueError(impl)

    def run():
        for x in leaves:
            x.grad = None
        out = call()
        if grads_wanted:
            out.real.backward() if is_complex else out.backward()
        sync()
        return out

    t0 = time.perf_counter()
    out = run()
    res["first_run_s"] = time.perf_counter() - t0
    if spec.get("measure") != "peak":
        # 3-20 repeats, about a second's worth (this VM's noise comes in bursts); 1 for runs of 5 s or more
        reps = 1 if res["first_run_s"] >= 5 else max(3, min(20, int(1.0 / max(res["first_run_s"], 1e-3))))
        res["run_s"] = _median(run, reps)
        res["total_s"] = res["plan_s"] + res["run_s"]
        if "flops" in res:  # forward FLOPs x 3 for forward + backward, plus what ours recomputes
            work = res["flops"] * (3 if grads_wanted else 1) + (res.get("recompute_flops", 0) if grads_wanted else 0)
            res["flops_per_s"] = work / res["run_s"]
    # The process's resident-set high-water mark over one more run (the torch profiler's memory
    # events, exact for tensors, grew to gigabytes and minutes over thousands of sliced steps).
    with PeakMemory(str(device)) as mem:
        run()
    res["peak_bytes"] = mem.peak_bytes
    if spec.get("measure") == "peak" and device.type == "cpu" and res["first_run_s"] < 1.5:
        # exact tensor bytes (the torch profiler's allocator events; what the tests check), where
        # a run is short enough for its event list: the resident set also counts pages and the
        # interpreter's objects, of the order of a small limit's contract
        from torch_gradops.testing import peak_allocated_bytes
        res["tensor_peak_bytes"] = peak_allocated_bytes(run)
    value = complex(out.detach()) * scale
    res["value"] = [value.real, value.imag]
    if amp is not None:
        res["rel_err_vs_quimb"] = abs(value - amp) / abs(amp)
    if grads_wanted and spec.get("check_grads"):
        # reference gradients: opt_einsum on torch, unsliced, in complex128 / float64
        wide = [a.to(torch.complex128 if is_complex else torch.float64).requires_grad_(True) for a in arrays]
        eq = ",".join("".join(t) for t in sym_in) + "->" + "".join(sym_out)
        ref = oe.contract(eq, *wide, backend="torch", optimize="greedy")
        (ref.real if is_complex else ref).backward()
        err = max(float((x.grad.to(w.grad.dtype) - w.grad).abs().max() / w.grad.abs().max().clamp_min(1e-30))
                  for x, w in zip(leaves, wide))
        res["grad_rel_err_vs_opt_einsum"] = err
    print(json.dumps(res))


# ---------------------------------------------------------------------------- driver
def configs(quick, only, device="cpu"):
    lat = [dict(kind="lattice", rows=5, cols=5, bond=16), dict(kind="lattice", rows=6, cols=6, bond=8)]
    circ = [dict(kind="circuit", rows=4, cols=4, depth=10), dict(kind="circuit", rows=4, cols=5, depth=12)]
    if quick:
        lat = [dict(kind="lattice", rows=4, cols=4, bond=8)]
        circ = [dict(kind="circuit", rows=3, cols=3, depth=8)]
    out = []
    if only in (None, "lattice"):
        for net in lat:
            for mib in ((64, 16, 4, 1) if not quick else (1, 0.25)):
                for impl in ("ours", "cotengra"):
                    out.append((dict(net, limit=int(mib * MIB), mode="fwd_bwd", check_grads=False, device=device),
                                impl))
    if only in (None, "circuit"):
        for net in circ:
            for kib in (1024, 128):
                for impl in ("ours", "cotengra"):
                    out.append((dict(net, limit=kib * 1024, mode="fwd_bwd", check_grads=impl == "ours",
                                     device=device), impl))
    if only in (None, "unsliced"):
        for net in circ + lat:
            for mode in ("fwd", "fwd_bwd"):
                for impl in ("ours", "torch.einsum", "opt_einsum", "cotengra"):
                    out.append((dict(net, limit=None, mode=mode, check_grads=False, device=device), impl))
    return out


def _bytes(n):
    """Bytes for the tables; '-' where the peak process failed (its error is in the JSON)."""
    from torch_gradops.testing import format_bytes
    return "-" if n is None else format_bytes(n)


def _name(spec):
    if spec["kind"] == "lattice":
        net = f"lattice {spec['rows']}x{spec['cols']} bond {spec['bond']}"
    else:
        net = f"circuit {spec['rows']}x{spec['cols']} depth {spec['depth']}"
    lim = "unsliced" if spec["limit"] is None else (f"{spec['limit'] / MIB:g} MiB" if spec["limit"] >= MIB
                                                     else f"{spec['limit'] / 1024:g} KiB")
    return f"{net}, {lim}, {spec['mode']}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["lattice", "circuit", "unsliced"])
    ap.add_argument("--match", default=None, help="run only configurations whose name contains this")
    ap.add_argument("--repeat", type=int, default=1, help="timing processes per configuration (the fastest is kept)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every implementation runs there)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/tensornet_sliced_<device>.json")
    args = ap.parse_args()
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                        f"tensornet_sliced_{args.device.split(':')[0]}.json")
    if args.worker:
        worker(json.loads(args.worker[0]), args.worker[1])
        return
    import torch
    torch.set_num_threads(THREADS)
    from torch_gradops.testing import format_bytes
    info = machine_info(args.device)
    results = []
    # idle OpenMP threads must not spin on shared cores
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    info["omp_wait_policy"] = env["OMP_WAIT_POLICY"]  # the timing processes', not this one's
    on_gpu = args.device.startswith("cuda")
    matmul = run_worker(__file__, [json.dumps(dict(device=args.device)), "matmul"], timeout=600, env=env)
    info["matmul_flops_per_s"] = matmul.get("matmul_flops_per_s")
    chosen = [(spec, impl) for spec, impl in configs(args.quick, args.only, args.device)
              if not args.match or args.match in _name(spec)]
    # The timing processes of one network and limit alternate between the implementations
    # (ours, peer, ours, peer, ...), so that a slow spell of this shared VM hits both alike.
    best = [None] * len(chosen)
    totals = [[] for _ in chosen]  # every timing process's total_s, for the median over processes
    for rep in range(args.repeat):
        for i, (spec, impl) in enumerate(chosen):
            t = run_worker(__file__, [json.dumps(spec), impl], timeout=1800, env=env)
            print(f"  timing {rep + 1}/{args.repeat}: {_name(spec):55s} {impl:13s} "
                  + (f"total {t['total_s']:.3f} s" if "error" not in t else "ERROR"), flush=True)
            if "error" not in t:
                totals[i].append(t["total_s"])
            r = best[i]
            if r is None or "error" in r or ("error" not in t and t["total_s"] < r["total_s"]):
                best[i] = t
    for (spec, impl), r, ts in zip(chosen, best, totals):
        if len(ts) > 1:  # the peer's search is unseeded: its plan, and so its time, varies by process
            r["totals_s"] = ts
            r["median_total_s"] = statistics.median(ts)
        if "error" not in r and not on_gpu:  # on a GPU the timing process's allocator peak is exact
            m = run_worker(__file__, [json.dumps(dict(spec, measure="peak", check_grads=False)), impl], timeout=1800,
                           env={**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
            r["peak_bytes_default_malloc"] = r["peak_bytes"]
            r["peak_bytes"] = m.get("peak_bytes")
            r["tensor_peak_bytes"] = m.get("tensor_peak_bytes")
            if "error" in m:
                r["peak_error"] = f"returncode {m.get('returncode')}: {m['error'][-300:]}"
        r.setdefault("spec", spec)
        r.setdefault("impl", impl)
        results.append(r)
        write_json(args.out, dict(machine=info, threads=THREADS, results=results, partial=True))  # so far
        if "error" in r:
            print(f"{_name(spec):55s} {impl:13s} ERROR {r['error'][-300:]}", flush=True)
            continue
        extra = ""
        if "rel_err_vs_quimb" in r:
            extra += f" |amp-quimb|/|quimb| {r['rel_err_vs_quimb']:.1e}"
        if "grad_rel_err_vs_opt_einsum" in r:
            extra += f" grad err {r['grad_rel_err_vs_opt_einsum']:.1e}"
        if "flops_per_s" in r:
            extra += f" {r['flops_per_s'] / 1e9:.1f} GFLOP/s"
        print(f"{_name(spec):55s} {impl:13s} total {r['total_s']:8.3f} s (plan {r['plan_s']:.3f} s, run "
              f"{r['run_s']:.3f} s) slices {r.get('slices', '-')!s:>6} FLOP {r.get('flops', float('nan')):.3g} "
              f"peak {_bytes(r['peak_bytes'])}{extra}", flush=True)
    # summary: ours against the peer (sliced) or the best of the others (unsliced)
    summary = []
    groups = {}
    for r in results:
        if "error" not in r:
            groups.setdefault(json.dumps({k: v for k, v in r["spec"].items() if k != "check_grads"}, sort_keys=True),
                              []).append(r)
    print("\n| configuration | ours: total (plan + run) | peer: total (plan + run) | ratio | slices ours / peer | "
          "peak ours / peer | contract (4 x limit + operands + grads) |")
    print("|---|---|---|---|---|---|---|")
    for key, rs in groups.items():
        spec = json.loads(key)
        ours = next((r for r in rs if r["impl"] == "ours"), None)
        others = [r for r in rs if r["impl"] != "ours"]
        if ours is None or not others:
            continue
        peer = min(others, key=lambda r: r["total_s"])
        ratio = ours["total_s"] / peer["total_s"]
        arrays_bytes = None
        row = dict(config=_name(spec), ours=ours["total_s"], ours_plan=ours["plan_s"], peer=peer["impl"],
                   peer_total=peer["total_s"], peer_plan=peer["plan_s"], ratio=ratio,
                   slices=(ours.get("slices"), peer.get("slices")), peak=(ours["peak_bytes"], peer["peak_bytes"]),
                   tensor_peak=(ours.get("tensor_peak_bytes"), peer.get("tensor_peak_bytes")))
        ref = (info.get("matmul_flops_per_s") or {}).get("float32" if spec["kind"] == "lattice" else "complex64")
        if ref:  # achieved FLOP/s as a fraction of the same run's matmul
            row["matmul_fraction"] = tuple(r["flops_per_s"] / ref if "flops_per_s" in r else None for r in (ours, peer))
        contract = "-"
        if spec["limit"] is not None:
            inputs, output, arrays, _, _ = network(spec)
            arrays_bytes = sum(a.numel() * a.element_size() for a in arrays)
            bound = 4 * spec["limit"] + 2 * arrays_bytes + 1024
            row["contract_bytes"] = bound
            row["within_contract"] = ours["peak_bytes"] is not None and ours["peak_bytes"] <= bound
            contract = f"{format_bytes(bound)}: {'met' if row['within_contract'] else 'MISSED'}"
            if ours.get("tensor_peak_bytes") is not None:
                row["within_contract_tensors"] = ours["tensor_peak_bytes"] <= bound
                contract += f" (tensors: {'met' if row['within_contract_tensors'] else 'MISSED'})"
        if "median_total_s" in ours and "median_total_s" in peer:
            row["ours_median"], row["peer_median"] = ours["median_total_s"], peer["median_total_s"]
            row["ratio_median"] = ours["median_total_s"] / peer["median_total_s"]
        summary.append(row)
        tensors = ""
        if ours.get("tensor_peak_bytes") is not None:
            tensors = f" (tensors {_bytes(ours['tensor_peak_bytes'])} / {_bytes(peer.get('tensor_peak_bytes'))})"
        median = f" (median of {len(ours['totals_s'])}: {row['ratio_median']:.2f}x)" if "ratio_median" in row else ""
        print(f"| {_name(spec)} | {ours['total_s']:.3f} s ({ours['plan_s']:.3f} + {ours['run_s']:.3f}) | "
              f"{peer['impl']} {peer['total_s']:.3f} s ({peer['plan_s']:.3f} + {peer['run_s']:.3f}) | "
              f"{ratio:.2f}x{median} | {ours.get('slices', '-')} / {peer.get('slices', '-')} | "
              f"{_bytes(ours['peak_bytes'])} / {_bytes(peer['peak_bytes'])}{tensors} | {contract} |")
    write_json(args.out, dict(machine=info, threads=THREADS, results=results, summary=summary,
                              note="total_s = plan_s + run_s (median steady-state run); peaks: growth of the process's "
                                   "resident-set high-water mark over one run (PeakMemory); tensor peaks: the "
                                   "tensor allocator's exact peak over one run (testing.peak_allocated_bytes), "
                                   "where a run takes less than 1.5 s"))


if __name__ == "__main__":
    main()
