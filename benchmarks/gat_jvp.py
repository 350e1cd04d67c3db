"""Forward-mode AD (JVP) and double backward of ``gat_attention`` vs the plain-PyTorch composite.

Modes, each w.r.t. ``x_src``, ``a_src`` and ``a_dst``:

* ``jvp``: ``torch.func.jvp`` with random tangents on all three inputs (output and tangent);
* ``double_backward``: the gradients ``g`` of ``<out, w>`` w.r.t. the three inputs with
  ``create_graph=True``, then the gradient of ``sum(g**2)`` w.r.t. them (a gradient penalty).

Ours runs the fused SpMM/SDDMM formulation (no ``E x H x C`` tensor); the composite is the
index_select + scatter GAT of ``benchmarks/gat_attention.py`` under the same transforms. Each
(size, implementation, mode) runs in a fresh process: median time after a warm-up and the peak
extra memory of one call (``_common.PeakMemory``: resident-set high-water mark on CPU). Prints a
table and writes JSON under ``benchmarks/results/``.

    python benchmarks/gat_jvp.py                       # CPU, 2 threads, N=100k/E=2M, H=8, C=32, fp32
    python benchmarks/gat_jvp.py --sizes 10000:200000 100000:2000000
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PeakMemory, format_bytes, machine_info, median_time, run_worker, write_json  # noqa: E402
from torch_gradops.testing import gat_composite  # noqa: E402

HERE = os.path.abspath(__file__)


def worker(args) -> dict:
    import torch_gradops as tg

    torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    n, e, h, c = args.nodes, args.edges, args.heads, args.channels
    edge_index = torch.randint(0, n, (2, e), generator=gen).to(device)
    primals = (torch.randn(n, h, c, generator=gen).to(device, dtype),
               torch.randn(n, h, generator=gen).to(device, dtype),
               torch.randn(n, h, generator=gen).to(device, dtype))
    tangents = tuple(torch.randn(t.shape, generator=gen).to(device, dtype) for t in primals)
    weight = torch.randn(n, h, c, generator=gen).to(device, dtype)
    if args.impl == "op":
        graph = tg.BipartiteCSC.from_edge_index(edge_index, n, n)
        graph.reverse_index()  # graph preprocessing, cached across calls: not timed
        fn = lambda x, a_s, a_d: tg.gat_attention(x, a_s, a_d, graph)  # noqa: E731
    else:
        src, dst = edge_index[0], edge_index[1]
        fn = lambda x, a_s, a_d: gat_composite(x, a_s, a_d, src, dst, n)[0]  # noqa: E731

    def step():
        if args.mode == "jvp":
            torch.func.jvp(fn, primals, tangents)
        else:
            inputs = tuple(t.detach().requires_grad_() for t in primals)
            grads = torch.autograd.grad(fn(*inputs), inputs, weight, create_graph=True)
            torch.autograd.grad(sum(g.square().sum() for g in grads), inputs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # warm-up outside the memory window
    with PeakMemory(device) as mem:
        step()
    seconds = median_time(step, device, args.repeats, warmup=0)
    return {"seconds": seconds, "peak_extra_bytes": mem.peak_bytes,
            "edges_heads_channels_bytes": e * h * c * torch.finfo(dtype).bits // 8}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["op", "composite"], default="op", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["jvp", "double_backward"], default="jvp", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=100000, help=argparse.SUPPRESS)
    p.add_argument("--edges", type=int, default=2000000, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", nargs="+", default=["100000:2000000"], help="NODES:EDGES pairs")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    rows = []
    for size in args.sizes:
        n, e = map(int, size.split(":"))
        for mode in ("jvp", "double_backward"):
            res = {}
            for impl in ("op", "composite"):
                res[impl] = run_worker(HERE, ["--impl", impl, "--mode", mode, "--nodes", str(n), "--edges", str(e),
                                              "--device", args.device, "--dtype", args.dtype,
                                              "--heads", str(args.heads), "--channels", str(args.channels),
                                              "--threads", str(args.threads), "--repeats", str(args.repeats)])
            row = {"nodes": n, "edges": e, "mode": mode, "op": res["op"], "composite": res["composite"]}
            if "error" not in res["op"] and "error" not in res["composite"]:
                row["speedup"] = res["composite"]["seconds"] / res["op"]["seconds"]
                row["peak_ratio_op_to_composite"] = (res["op"]["peak_extra_bytes"]
                                                     / max(res["composite"]["peak_extra_bytes"], 1))
            rows.append(row)
            print(_row_text(row), flush=True)
    info = machine_info(args.device)
    info["threads"] = args.threads
    out = args.out or os.path.join(os.path.dirname(HERE), "results", f"gat_jvp_{args.device.split(':')[0]}.json")
    write_json(out, {"benchmark": "gat_jvp", "machine": info, "heads": args.heads, "channels": args.channels,
                     "dtype": args.dtype, "memory_method": PeakMemory(args.device).method, "rows": rows})


def _row_text(row):
    def cell(r):
        if "error" in r:
            return f"{'error: ' + str(r['error'])[-40:]:>34}"
        return f"{r['seconds'] * 1e3:10.1f} ms {format_bytes(r['peak_extra_bytes']):>12}"
    extra = ""
    if "speedup" in row:
        extra = f" | speed-up {row['speedup']:5.1f}x | peak ours/composite {row['peak_ratio_op_to_composite']:.3f}"
    return (f"N={row['nodes']:>8} E={row['edges']:>9} {row['mode']:>15} | ours {cell(row['op'])} | "
            f"composite {cell(row['composite'])}{extra}")


if __name__ == "__main__":
    main()
