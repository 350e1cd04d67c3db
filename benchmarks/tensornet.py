"""Benchmark of torch_gradops.tensornet against torch.einsum, opt_einsum and cotengra.

Each (case, implementation) runs in a fresh Python process; every implementation uses the
same contraction path (a seeded cotengra search, and for the sliced cases the same sliced
modes). Measured: forward (inference) and forward+backward median wall time, and peak
allocator bytes of each (torch profiler memory events, a separate run). ``--repeat N`` (default
3) runs every timing process N times, alternating between the implementations, and keeps each
implementation's fastest forward and fastest forward+backward: on a shared 2-core VM a single
process ran up to 3x slower than the same process repeated. FLOPs are the plan's real
floating-point operations; achieved FLOP/s is compared with torch.matmul throughput measured
in the same run.

    python benchmarks/tensornet.py                # all cases, writes benchmarks/results/tensornet_cpu.json
    python benchmarks/tensornet.py --quick        # smaller networks (smoke test)

"torch.einsum" means one torch.einsum call per pairwise step of the path: torch.einsum accepts
at most 52 mode letters and these networks have hundreds of modes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _common import machine_info, matmul_flops_per_s, run_worker  # noqa: E402

from torch_gradops.testing import format_bytes, interleave, peak_allocated_bytes  # noqa: E402
warnings.filterwarnings("ignore")

THREADS = 2


# ---------------------------------------------------------------------------- cases
def make_network(spec):
    import torch
    from torch_gradops import testing as demo
    dtype = getattr(torch, spec["dtype"])
    kind, kw = spec["kind"], spec["params"]
    if kind == "circuit":
        return demo.circuit_amplitude_network(kw["rows"], kw["cols"], kw["depth"], seed=kw["seed"], dtype=dtype)
    if kind == "peps":
        return demo.peps_norm_network(kw["rows"], kw["cols"], kw["bond"], seed=kw["seed"], dtype=dtype)
    if kind == "mps":
        return demo.mps_network(kw["n"], bond=kw["bond"], seed=kw["seed"], dtype=dtype)
    raise ValueError(kind)


def _interleaved(inputs, output, arrays):
    return interleave(inputs, arrays, output)


def build_specs(quick: bool):
    """Cases with their shared path (cotengra's or greedy) and sliced modes, planned once here."""
    from torch_gradops import tensornet as tn
    circ = dict(rows=4, cols=5, depth=12 if not quick else 8, seed=0)
    peps = dict(rows=6 if not quick else 4, cols=6 if not quick else 4, bond=3, seed=0)
    cases = [
        dict(name="circuit", kind="circuit", params=circ, dtype="complex64", optimize="cotengra",
             desc=f"random circuit amplitude {circ['rows']}x{circ['cols']} depth {circ['depth']}, complex64"),
        dict(name="peps", kind="peps", params=peps, dtype="float32", optimize="cotengra",
             desc=f"PEPS norm {peps['rows']}x{peps['cols']} bond {peps['bond']}, float32"),
        dict(name="mps", kind="mps", params=dict(n=75, bond=4, seed=0), dtype="float32", optimize="greedy",
             desc="MPS norm, 150 tensors [4,2,4], float32 (per-call overhead)"),
        dict(name="sliced16", kind="circuit", params=circ, dtype="complex64", optimize="cotengra", slices=16,
             desc="circuit, memory_limit forcing >= 16 slices"),
        dict(name="sliced64", kind="circuit", params=circ, dtype="complex64", optimize="cotengra", slices=64,
             desc="circuit, memory_limit forcing >= 64 slices"),
    ]
    paths = {}
    for c in cases:
        inputs, output, arrays = make_network(c)
        key = (c["kind"], json.dumps(c["params"]), c["optimize"])
        if key not in paths:
            if c["optimize"] == "cotengra":
                import cotengra as ctg
                # seeded: an unseeded search gave paths whose largest intermediate varied 2-8 MiB from
                # run to run, and the timings with them
                opt = ctg.HyperOptimizer(max_repeats=32, progbar=False, parallel=False, seed=0)
                p = tn.plan(*_interleaved(inputs, output, arrays), optimize=opt)
            else:
                p = tn.plan(*_interleaved(inputs, output, arrays), optimize=c["optimize"])
            paths[key] = p
        base = paths[key]
        c["path"] = [list(x) for x in base.path]
        c["sliced"] = []
        if c.get("slices"):
            # memory_limit bounds the largest intermediate of one slice: take the budget that the
            # requested number of slices needs, and plan with it
            sl = {"min_slices": c["slices"]}
            forced = tn.plan(*_interleaved(inputs, output, arrays), optimize=base.path, slicing=sl)
            limit = forced.largest_intermediate[1]
            p = tn.plan(*_interleaved(inputs, output, arrays), optimize=base.path, memory_limit=limit, slicing=sl)
            c["sliced"] = list(p.sliced_modes)
            c["memory_limit"] = limit
        else:
            p = base
        c["flops"] = p.flops
        c["num_slices"] = p.num_slices
        c["largest_intermediate_bytes"] = p.largest_intermediate[1]
        c["n_tensors"] = len(arrays)
        c["operand_bytes"] = sum(a.numel() * a.element_size() for a in arrays)
    return cases


IMPLS = {
    "circuit": ["torch_gradops", "torch.einsum", "opt_einsum", "cotengra"],
    "peps": ["torch_gradops", "torch.einsum", "opt_einsum", "cotengra"],
    "mps": ["torch_gradops", "torch.einsum", "opt_einsum", "cotengra"],
    "sliced16": ["torch_gradops", "cotengra"],
    "sliced64": ["torch_gradops", "cotengra"],
}


# ---------------------------------------------------------------------------- worker


def _median_time(fn, budget_s, min_reps=3, max_reps=30):
    fn()  # warm-up (thread pools, allocator, first-call costs)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def make_callable(impl, spec, inputs, output, arrays):
    """A function of the operand list returning the contraction (scalar here)."""
    import opt_einsum
    from torch_gradops import testing as demo
    from torch_gradops import tensornet as tn
    path = [tuple(p) for p in spec["path"]]
    sliced = spec["sliced"]
    if impl == "torch_gradops":
        plan = tn.plan(*_interleaved(inputs, output, arrays), optimize=path, slicing=sliced or None)
        assert plan.num_slices == spec["num_slices"]
        return lambda ops: plan.contract(*ops)
    if impl == "torch.einsum":
        return lambda ops: demo.einsum_pairwise(inputs, output, ops, path)
    if impl == "opt_einsum":
        sym = opt_einsum.get_symbol
        eq = ",".join("".join(sym(m) for m in t) for t in inputs) + "->" + "".join(sym(m) for m in output)
        # per call as users call it: opt_einsum.contract with the explicit path
        return lambda ops: opt_einsum.contract(eq, *ops, optimize=path, backend="torch")
    if impl == "cotengra":
        import cotengra as ctg
        sym = opt_einsum.get_symbol  # cotengra wants str labels
        sizes = {}
        for t, a in zip(inputs, arrays):
            sizes.update(zip((sym(m) for m in t), a.shape))
        tree = ctg.ContractionTree.from_path([tuple(sym(m) for m in t) for t in inputs],
                                             tuple(sym(m) for m in output), sizes, path=path)
        for ix in sliced:
            tree.remove_ind_(sym(ix))
        assert tree.nslices == spec["num_slices"]
        return lambda ops: tree.contract(ops, backend="torch")
    raise ValueError(impl)


def worker(spec, impl):
    import resource

    import torch
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    torch.set_num_threads(THREADS)
    inputs, output, arrays = make_network(spec)
    fn = make_callable(impl, spec, inputs, output, arrays)
    # At least 5 timed calls each: with 2 (what large cases had) one slow call on this shared VM
    # moved a median by 20%.
    budget = 2.0
    with torch.no_grad():
        value = complex(fn(arrays).item())
        t_fwd, n_fwd = _median_time(lambda: fn(arrays), budget, min_reps=5)
    leaves = [a.clone().requires_grad_(True) for a in arrays]

    def fwd_bwd():
        out = fn(leaves)
        loss = out.real if out.is_complex() else out
        torch.autograd.grad(loss, leaves)
    t_fb, n_fb = _median_time(fwd_bwd, budget, min_reps=5)
    with torch.no_grad():
        peak_fwd = peak_allocated_bytes(lambda: fn(arrays))
    peak_fb = peak_allocated_bytes(fwd_bwd)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # the whole process's CPU time and page faults, to tell a slow run of this shared VM from a slow path
    return dict(case=spec["name"], impl=impl, value=[value.real, value.imag], fwd_s=t_fwd, fwd_reps=n_fwd,
                fwdbwd_s=t_fb, fwdbwd_reps=n_fb, fwd_peak_bytes=peak_fwd, fwdbwd_peak_bytes=peak_fb,
                process_sys_s=usage.ru_stime - usage0.ru_stime, process_user_s=usage.ru_utime - usage0.ru_utime,
                process_minor_faults=usage.ru_minflt - usage0.ru_minflt)


def matmul_worker():
    import torch
    torch.set_num_threads(THREADS)
    return matmul_flops_per_s("cpu", 1024)


# ---------------------------------------------------------------------------- driver
def _worker_env():
    # Shared 2-core machine: spin-waiting OpenMP workers made timings swing 10x between runs
    # (for every implementation); passive waiting keeps them comparable.
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _run_sub(args, timeout=600):
    return run_worker(os.path.abspath(__file__), args, timeout=timeout, worker_flag=None, env=_worker_env())


def _fmt_t(s):
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2, metavar=("SPECFILE", "IMPL"))
    ap.add_argument("--case")
    ap.add_argument("--matmul", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="timing processes per (case, implementation)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "tensornet_cpu.json"))
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.worker:
        with open(args.worker[0]) as f:
            specs = {s["name"]: s for s in json.load(f)}
        print(json.dumps(worker(specs[args.case], args.worker[1])))
        return
    if args.matmul:
        print(json.dumps(matmul_worker()))
        return

    t_start = time.perf_counter()
    info = machine_info("cpu")
    info["omp_wait_policy"] = _worker_env()["OMP_WAIT_POLICY"]  # the timing processes', not this one's
    info["threads"] = THREADS
    print(f"machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}, {info['date']}")
    specs = build_specs(args.quick)
    matmul = _run_sub(["--matmul"])
    print(f"torch.matmul 1024^3: {matmul.get('float32', 0) / 1e9:.1f} GFLOP/s float32, "
          f"{matmul.get('complex64', 0) / 1e9:.1f} GFLOP/s complex64")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(specs, f)
        specfile = f.name
    results = []
    for spec in specs:
        runs = {impl: [] for impl in IMPLS[spec["name"]]}
        for rep in range(args.repeat):  # ours, peers, ours, peers, ...: a slow spell hits all alike
            for impl in runs:
                r = _run_sub(["--worker", specfile, impl, "--case", spec["name"]])
                runs[impl].append(r)
                if "error" in r:
                    print(f"  {spec['name']:9s} {impl:14s} ERROR {r['error'][-300:]}", flush=True)
                else:
                    print(f"  {rep + 1}/{args.repeat} {spec['name']:9s} {impl:14s} fwd {_fmt_t(r['fwd_s']):>10s}  "
                          f"fwd+bwd {_fmt_t(r['fwdbwd_s']):>10s}  sys {r['process_sys_s']:.2f} s", flush=True)
        for impl, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            if not ok:
                r = dict(rs[-1], case=spec["name"], impl=impl)
                results.append(r)
                continue
            r = dict(min(ok, key=lambda r: r["fwd_s"]))
            fb = min(ok, key=lambda r: r["fwdbwd_s"])
            r.update(fwdbwd_s=fb["fwdbwd_s"], fwdbwd_reps=fb["fwdbwd_reps"], processes=len(ok),
                     fwd_s_all=[x["fwd_s"] for x in ok], fwdbwd_s_all=[x["fwdbwd_s"] for x in ok],
                     process_sys_s_all=[x["process_sys_s"] for x in ok])
            peak_ref = matmul.get(spec["dtype"], 0)
            r["fwd_flops_per_s"] = spec["flops"] / r["fwd_s"]
            r["fwd_fraction_of_matmul"] = r["fwd_flops_per_s"] / peak_ref if peak_ref else None
            print(f"  {spec['name']:9s} {impl:14s} fwd {_fmt_t(r['fwd_s']):>10s}  fwd+bwd {_fmt_t(r['fwdbwd_s']):>10s}"
                  f"  peak fwd {format_bytes(r['fwd_peak_bytes']):>10s}  peak fwd+bwd "
                  f"{format_bytes(r['fwdbwd_peak_bytes']):>10s}  (fastest of {len(ok)})", flush=True)
            results.append(r)
    os.unlink(specfile)

    # ratios: ours / best peer on the same path
    summary = []
    for spec in specs:
        rows = {r["impl"]: r for r in results if r["case"] == spec["name"] and "error" not in r}
        ours = rows.get("torch_gradops")
        peers = {k: v for k, v in rows.items() if k != "torch_gradops"}
        if not ours or not peers:
            continue
        best_f = min(peers.values(), key=lambda r: r["fwd_s"])
        best_fb = min(peers.values(), key=lambda r: r["fwdbwd_s"])
        s = dict(case=spec["name"], desc=spec["desc"], n_tensors=spec["n_tensors"], num_slices=spec["num_slices"],
                 flops=spec["flops"], fwd_ratio_vs_best=ours["fwd_s"] / best_f["fwd_s"], best_fwd_peer=best_f["impl"],
                 fwdbwd_ratio_vs_best=ours["fwdbwd_s"] / best_fb["fwdbwd_s"], best_fwdbwd_peer=best_fb["impl"],
                 fwdbwd_peak_ratio_vs_peers={k: ours["fwdbwd_peak_bytes"] / v["fwdbwd_peak_bytes"]
                                             for k, v in peers.items()})
        if spec["name"] == "mps" and "opt_einsum" in peers:
            s["mps_overhead_ratio_vs_opt_einsum"] = ours["fwd_s"] / peers["opt_einsum"]["fwd_s"]
        if spec.get("memory_limit"):
            s["memory_limit_bytes"] = spec["memory_limit"]
            s["operand_bytes"] = spec["operand_bytes"]
        summary.append(s)

    print()
    print("| case | tensors | slices | GFLOP | impl | fwd | fwd+bwd | peak fwd+bwd | fwd GFLOP/s (% matmul) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in specs:
        for r in results:
            if r["case"] != spec["name"] or "error" in r:
                continue
            frac = r.get("fwd_fraction_of_matmul")
            print(f"| {spec['name']} | {spec['n_tensors']} | {spec['num_slices']} | {spec['flops'] / 1e9:.3g} | {r['impl']} | "
                  f"{_fmt_t(r['fwd_s'])} | {_fmt_t(r['fwdbwd_s'])} | {format_bytes(r['fwdbwd_peak_bytes'])} | "
                  f"{r['fwd_flops_per_s'] / 1e9:.3g} ({100 * frac:.1f}%) |" if frac else "|")
    print()
    for s in summary:
        line = (f"{s['case']}: ours/best peer fwd {s['fwd_ratio_vs_best']:.2f}x ({s['best_fwd_peer']}), "
                f"fwd+bwd {s['fwdbwd_ratio_vs_best']:.2f}x ({s['best_fwdbwd_peer']}); peak fwd+bwd vs peers "
                + ", ".join(f"{k} {v:.2f}x" for k, v in s["fwdbwd_peak_ratio_vs_peers"].items()))
        if "mps_overhead_ratio_vs_opt_einsum" in s:
            line += f"; per-call overhead vs opt_einsum {s['mps_overhead_ratio_vs_opt_einsum']:.3f}x (target <= 0.333)"
        print(line)
    out = dict(machine=info, matmul_flops_per_s=matmul, repeat=args.repeat, cases=specs, results=results, summary=summary,
               total_wall_s=time.perf_counter() - t_start)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.out} ({out['total_wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
