"""Benchmark: torch_gradops.nn.GATConv / GATv2Conv against PyG's, whole layer.

Each (size, edge_dim, implementation, mode) runs in a fresh Python process, so one
configuration's memory cannot leak into another's measurement. The layer is
``GATConv(F_in, C, heads=H)`` (``--layer gatv2``: ``GATv2Conv``), with ``edge_dim`` when given
and PyG's defaults otherwise (self-loops added), on a random graph; "fwd" is an inference forward (no_grad),
"fwd+bwd" a forward plus the backward of ``out.sum()`` into the parameters. Projections, self-loop
handling and (for ours) the cached CSC conversion are all included.

Timing: median over ``--repeats`` runs after one warm-up run (the warm-up pays ours' one-time
CSC conversion; PyG has no such cache).

Peak extra memory:
  * CPU: growth of the process's peak resident set size over the measured region: the freed heap
    is returned to the OS (``malloc_trim``), the kernel's high-water mark ``VmHWM`` is reset via
    ``/proc/self/clear_refs`` (writing ``5``), then ``VmHWM - VmRSS(start)`` after the warm-up and
    all repeats. It covers every byte the process touched (tensors, allocator slack, the cached
    graph), so it is an upper bound on tensor memory, measured the same way for both.
  * CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` at the start (tensor bytes).

Usage: ``python benchmarks/gat_conv.py [--layer gat|gatv2] [--edge-dims 0,16] [--device cpu|cuda]
[--threads 2] [--sizes 10000:200000,...] [--graph uniform|powerlaw|powerlaw-by-degree]``. Writes
``benchmarks/results/<layer>_conv_<device>[_<graph>].json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _common import PeakMemory, format_bytes, machine_info, run_worker  # noqa: E402


GRAPHS = ("uniform", "powerlaw", "powerlaw-by-degree")
GRAPH_TEXT = {
    "uniform": "uniform random edge_index (seed 0), x ~ N(0, 1)",
    "powerlaw": "power-law in- and out-degrees, exponent 2.1 (torch_gradops.testing.powerlaw_edge_index, "
                "seed 0), node ids shuffled; x ~ N(0, 1)",
    "powerlaw-by-degree": "power-law in- and out-degrees, exponent 2.1 (torch_gradops.testing."
                          "powerlaw_edge_index, seed 0), node ids numbered by degree, hubs first; x ~ N(0, 1)",
}


# ---------------------------------------------------------------------------- worker side
def worker(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, ROOT)
    import torch_geometric.nn as pyg_nn
    import torch_gradops.nn as our_nn
    name = {"gat": "GATConv", "gatv2": "GATv2Conv"}[args.layer]
    cls = getattr(our_nn if args.impl == "ours" else pyg_nn, name)
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.nodes, args.f_in, generator=g).to(dev)
    if args.graph == "uniform":
        edge_index = torch.randint(0, args.nodes, (2, args.edges), generator=g).to(dev)
    else:  # power-law in- and out-degrees (exponent 2.1), ids shuffled or numbered by degree
        from torch_gradops.testing import powerlaw_edge_index
        edge_index = powerlaw_edge_index(args.nodes, args.edges, seed=0,
                                         by_degree=args.graph == "powerlaw-by-degree").to(dev)
    edge_dim = args.edge_dim or None
    edge_attr = torch.randn(args.edges, edge_dim, generator=g).to(dev) if edge_dim else None
    if edge_attr is not None and args.edge_attr_grad:  # learned edge features: their gradient too
        edge_attr.requires_grad_()
    torch.manual_seed(0)
    layer = cls(args.f_in, args.channels, heads=args.heads, edge_dim=edge_dim).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step():
        if args.mode == "fwd":
            with torch.no_grad():
                layer(x, edge_index, edge_attr)
        else:
            layer.zero_grad(set_to_none=True)
            if edge_attr is not None:
                edge_attr.grad = None
            layer(x, edge_index, edge_attr).sum().backward()
        sync()

    times, cpu_times = [], []
    with PeakMemory(dev) as mem:
        for i in range(args.repeats + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if i:  # the first run is the warm-up
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - c0)
    peak = mem.peak_bytes
    times.sort()
    cpu_times.sort()
    return {"median_s": times[len(times) // 2], "times_s": times, "peak_extra_bytes": peak,
            "median_cpu_s": cpu_times[len(cpu_times) // 2],
            "loadavg_1min_after": os.getloadavg()[0]}


# ---------------------------------------------------------------------------- driver side
def run_config(impl, mode, nodes, edges, edge_dim, a) -> dict:
    return run_worker(os.path.abspath(__file__),
                      ["--impl", impl, "--mode", mode, "--nodes", str(nodes), "--edges", str(edges),
                       "--layer", a.layer, "--edge-dim", str(edge_dim), "--graph", a.graph,
                       "--device", a.device, "--threads", str(a.threads), "--repeats", str(a.repeats),
                       "--f-in", str(a.f_in), "--heads", str(a.heads), "--channels", str(a.channels)]
                      + (["--edge-attr-grad"] if a.edge_attr_grad else []),
                      timeout=a.timeout, env={"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)})


def _mem(b):
    return "-" if b is None else format_bytes(b)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layer", choices=["gat", "gatv2"], default="gat")
    p.add_argument("--edge-dim", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--edge-dims", default=None,
                   help="comma-separated edge feature widths, 0 = none (default: 0 for gat, 0,16 for gatv2)")
    p.add_argument("--impl", choices=["ours", "pyg"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["fwd", "fwd+bwd"], help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--edges", type=int, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--f-in", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--sizes", default=None,
                   help="comma-separated N:E pairs (default: 10000:200000,100000:2000000 for gat and "
                        "50000:1000000,100000:2000000 for gatv2 on CPU, plus 1000000:10000000 on CUDA)")
    p.add_argument("--graph", choices=GRAPHS, default="uniform",
                   help="uniform random edges; power-law in- and out-degrees (torch_gradops.testing."
                        "powerlaw_edge_index, exponent 2.1) with shuffled ids, or with ids numbered by degree")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--edge-attr-grad", action="store_true",
                   help="edge_attr requires a gradient (learned edge features): not cached in CSC order, and "
                        "forward+backward also computes its gradient")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return

    if a.sizes:
        sizes = [tuple(int(v) for v in s.split(":")) for s in a.sizes.split(",")]
    else:
        sizes = [(10_000, 200_000) if a.layer == "gat" else (50_000, 1_000_000), (100_000, 2_000_000)]
        if a.device.startswith("cuda"):
            sizes.append((1_000_000, 10_000_000))
    edge_dims = [int(v) for v in (a.edge_dims or ("0" if a.layer == "gat" else "0,16")).split(",")]
    layer_name = {"gat": "GATConv", "gatv2": "GATv2Conv"}[a.layer]
    info = machine_info(a.device)
    info["threads"] = a.threads
    results = []
    print(f"{layer_name} benchmark on {a.device} ({info['cpu']}, {a.threads} threads), {a.graph} graph, F_in={a.f_in}, "
          f"heads={a.heads}, C={a.channels}; median of {a.repeats} after 1 warm-up, fresh process each")
    header = f"{'N':>9s} {'E':>10s} {'e_dim':>5s} {'mode':>8s} | {'PyG':>10s} {'ours':>10s} {'speed-up':>8s} " \
             f"{'(cpu-t)':>8s} | {'PyG peak':>13s} {'ours peak':>13s} {'mem ratio':>9s}"
    print(header)
    print("-" * len(header))
    configs = [(n, e, d, m) for n, e in sizes for d in edge_dims for m in ("fwd", "fwd+bwd")]
    for nodes, edges, edge_dim, mode in configs:
        row = {"nodes": nodes, "edges": edges, "edges_with_self_loops": edges + nodes, "edge_dim": edge_dim,
               "mode": mode}
        for impl in ("pyg", "ours"):
            row[impl] = run_config(impl, mode, nodes, edges, edge_dim, a)
        t_p, t_o = row["pyg"].get("median_s"), row["ours"].get("median_s")
        m_p, m_o = row["pyg"].get("peak_extra_bytes"), row["ours"].get("peak_extra_bytes")
        row["speedup"] = t_p / t_o if t_p and t_o else None
        c_p, c_o = row["pyg"].get("median_cpu_s"), row["ours"].get("median_cpu_s")
        row["speedup_cpu_time"] = c_p / c_o if c_p and c_o else None
        row["memory_ratio_ours_over_pyg"] = m_o / m_p if m_p and m_o else None
        results.append(row)
        sp = f"{row['speedup']:7.1f}x" if row["speedup"] else "     n/a"
        mr = f"{row['memory_ratio_ours_over_pyg']:9.3f}" if row["memory_ratio_ours_over_pyg"] else "      n/a"
        tp = f"{t_p * 1e3:8.1f}ms" if t_p else "    failed"
        to = f"{t_o * 1e3:8.1f}ms" if t_o else "    failed"
        spc = f"{row['speedup_cpu_time']:7.1f}x" if row["speedup_cpu_time"] else "     n/a"
        print(f"{nodes:9d} {edges:10d} {edge_dim:5d} {mode:>8s} | {tp:>10s} {to:>10s} {sp:>8s} {spc:>8s} | "
              f"{_mem(m_p):>13s} {_mem(m_o):>13s} {mr}", flush=True)
        for impl in ("pyg", "ours"):
            if "error" in row[impl]:
                print(f"   {impl} failed: {row[impl]['error'][-300:]}")

    targets = None
    if not a.device.startswith("cuda") and a.graph == "uniform":
        # CPU targets at the largest default size, forward+backward: GATConv >= 8x PyG's, GATv2Conv
        # >= 10x (every edge_dim); peak extra memory <= 0.1x PyG's
        need = 8 if a.layer == "gat" else 10
        rows = [r for r in results if r["nodes"] == 100_000 and r["edges"] == 2_000_000 and r["mode"] == "fwd+bwd"]
        if rows:
            targets = [{"edge_dim": r["edge_dim"], "speedup": r["speedup"], f"speedup_ge_{need}x":
                        bool(r["speedup"] and r["speedup"] >= need), "memory_ratio": r["memory_ratio_ours_over_pyg"],
                        "memory_ratio_le_0.1": bool(r["memory_ratio_ours_over_pyg"]
                                                    and r["memory_ratio_ours_over_pyg"] <= 0.1)} for r in rows]
            print("targets (CPU, N=100k/E=2M, fwd+bwd):", json.dumps(targets))
    doc = {
        "benchmark": f"torch_gradops.nn.{layer_name} vs torch_geometric.nn.{layer_name}, whole layer "
                     "(projections, self-loops, attention, aggregation, bias)",
        "machine": info,
        "layer": {"class": layer_name, "in_channels": a.f_in, "out_channels": a.channels, "heads": a.heads,
                  "edge_dims": edge_dims, "add_self_loops": True, "graph": GRAPH_TEXT[a.graph],
                  "edge_attr_requires_grad": bool(a.edge_attr_grad)},
        "method": {
            "process": "each (size, implementation, mode) in a fresh Python subprocess",
            "timing": f"median of {a.repeats} runs after 1 warm-up run (ours' cached CSC conversion "
                      "happens in the warm-up); fwd under torch.no_grad(), fwd+bwd = forward + "
                      "out.sum().backward() into the parameters (and edge_attr with --edge-attr-grad)",
            "cpu_time": "median_cpu_s: the process's CPU time (user+sys, all threads) per run; "
                        "speedup_cpu_time compares those, a view less sensitive to the process being "
                        "descheduled by other jobs (it still feels their memory-bandwidth load)",
            "contention": "the CPU is shared with other jobs: loadavg_1min_after per run records the "
                          "machine's 1-minute load average (above the thread count means the timings "
                          "were slowed by other processes)",
            "memory": ("CUDA: max_memory_allocated minus memory_allocated at the start"
                       if a.device.startswith("cuda") else
                       "CPU: VmHWM - VmRSS from /proc/self/status, after malloc_trim(0) and a VmHWM "
                       "reset (/proc/self/clear_refs = 5) taken once the inputs and the layer exist; "
                       "spans the warm-up (so includes ours' CSC cache) and all repeats; process RSS, "
                       "so tensors plus allocator slack"),
        },
        "results": results,
        "targets": targets,
    }
    suffix = "" if a.graph == "uniform" else "_" + a.graph.replace("-", "_")
    out = a.out or os.path.join(HERE, "results",
                                  f"{a.layer}_conv_{'cuda' if a.device.startswith('cuda') else 'cpu'}{suffix}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
