"""Benchmark: torch_gradops.nn.GATConv against torch_geometric.nn.GATConv, whole layer.

Each (size, implementation, mode) runs in a fresh Python process, so one configuration's
memory cannot leak into another's measurement. The layer is ``GATConv(F_in, C, heads=H)`` with
PyG's defaults (self-loops added), on a random graph; "fwd" is an inference forward (no_grad),
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

Usage: ``python benchmarks/gat_conv.py [--device cpu|cuda] [--threads 2] [--sizes 10000:200000,...]``
Writes ``benchmarks/results/gat_conv_<device>.json`` and prints a table.
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


# ---------------------------------------------------------------------------- worker side
def worker(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, ROOT)
    if args.impl == "ours":
        from torch_gradops.nn import GATConv
    else:
        from torch_geometric.nn import GATConv
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.nodes, args.f_in, generator=g).to(dev)
    edge_index = torch.randint(0, args.nodes, (2, args.edges), generator=g).to(dev)
    torch.manual_seed(0)
    layer = GATConv(args.f_in, args.channels, heads=args.heads).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step():
        if args.mode == "fwd":
            with torch.no_grad():
                layer(x, edge_index)
        else:
            layer.zero_grad(set_to_none=True)
            layer(x, edge_index).sum().backward()
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
def run_config(impl, mode, nodes, edges, a) -> dict:
    return run_worker(os.path.abspath(__file__),
                      ["--impl", impl, "--mode", mode, "--nodes", str(nodes), "--edges", str(edges),
                       "--device", a.device, "--threads", str(a.threads), "--repeats", str(a.repeats),
                       "--f-in", str(a.f_in), "--heads", str(a.heads), "--channels", str(a.channels)],
                      timeout=a.timeout, env={"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)})


def _mem(b):
    return "-" if b is None else format_bytes(b)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["ours", "pyg"])
    p.add_argument("--mode", choices=["fwd", "fwd+bwd"])
    p.add_argument("--nodes", type=int)
    p.add_argument("--edges", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--f-in", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--sizes", default=None,
                   help="comma-separated N:E pairs (default: 10000:200000,100000:2000000 on CPU, "
                        "plus 1000000:10000000 on CUDA)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return

    if a.sizes:
        sizes = [tuple(int(v) for v in s.split(":")) for s in a.sizes.split(",")]
    else:
        sizes = [(10_000, 200_000), (100_000, 2_000_000)]
        if a.device.startswith("cuda"):
            sizes.append((1_000_000, 10_000_000))
    info = machine_info(a.device)
    info["threads"] = a.threads
    results = []
    print(f"GATConv benchmark on {a.device} ({info['cpu']}, {a.threads} threads), F_in={a.f_in}, "
          f"heads={a.heads}, C={a.channels}; median of {a.repeats} after 1 warm-up, fresh process each")
    header = f"{'N':>9s} {'E':>10s} {'mode':>8s} | {'PyG':>10s} {'ours':>10s} {'speed-up':>8s} {'(cpu-t)':>8s} | " \
             f"{'PyG peak':>13s} {'ours peak':>13s} {'mem ratio':>9s}"
    print(header)
    print("-" * len(header))
    for nodes, edges in sizes:
        for mode in ("fwd", "fwd+bwd"):
            row = {"nodes": nodes, "edges": edges, "edges_with_self_loops": edges + nodes, "mode": mode}
            for impl in ("pyg", "ours"):
                row[impl] = run_config(impl, mode, nodes, edges, a)
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
            print(f"{nodes:9d} {edges:10d} {mode:>8s} | {tp:>10s} {to:>10s} {sp:>8s} {spc:>8s} | "
                  f"{_mem(m_p):>13s} {_mem(m_o):>13s} {mr}", flush=True)
            for impl in ("pyg", "ours"):
                if "error" in row[impl]:
                    print(f"   {impl} failed: {row[impl]['error'][-300:]}")

    target = next((r for r in results if r["nodes"] == 100_000 and r["edges"] == 2_000_000
                   and r["mode"] == "fwd+bwd"), None)
    targets = None
    if target and not a.device.startswith("cuda"):
        sp, mr = target["speedup"], target["memory_ratio_ours_over_pyg"]
        targets = {"cpu_100k_2M_fwd_bwd_speedup_ge_8x": bool(sp and sp >= 8), "speedup": sp,
                   "cpu_100k_2M_fwd_bwd_peak_memory_le_0.1x": bool(mr and mr <= 0.1), "memory_ratio": mr}
        print(f"targets (CPU, N=100k/E=2M, fwd+bwd): speed-up {sp and round(sp, 2)}x (>= 8x: "
              f"{targets['cpu_100k_2M_fwd_bwd_speedup_ge_8x']}), peak memory ratio "
              f"{mr and round(mr, 4)} (<= 0.1: {targets['cpu_100k_2M_fwd_bwd_peak_memory_le_0.1x']})")
    doc = {
        "benchmark": "torch_gradops.nn.GATConv vs torch_geometric.nn.GATConv, whole layer "
                     "(projections, self-loops, attention, aggregation, bias)",
        "machine": info,
        "layer": {"in_channels": a.f_in, "out_channels": a.channels, "heads": a.heads,
                  "add_self_loops": True, "graph": "uniform random edge_index (seed 0), x ~ N(0, 1)"},
        "method": {
            "process": "each (size, implementation, mode) in a fresh Python subprocess",
            "timing": f"median of {a.repeats} runs after 1 warm-up run (ours' cached CSC conversion "
                      "happens in the warm-up); fwd under torch.no_grad(), fwd+bwd = forward + "
                      "out.sum().backward() into the parameters",
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
    out = a.out or os.path.join(HERE, "results", f"gat_conv_{'cuda' if a.device.startswith('cuda') else 'cpu'}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
