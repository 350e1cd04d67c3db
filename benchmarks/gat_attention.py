"""Fused ``gat_attention`` vs the plain-PyTorch composite (index_select + scatter softmax).

Each (size, implementation, mode) runs in a fresh process: median time over repeats after a
warm-up, and peak extra memory of one call (see ``_common.PeakMemory``). Prints a table and
writes JSON under ``benchmarks/results/``.

    python benchmarks/gat_attention.py                      # CPU, 2 threads, N=10k/E=200k and N=100k/E=2M
    python benchmarks/gat_attention.py --device cuda --sizes 100000:2000000 1000000:10000000
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PeakMemory, format_bytes, machine_info, median_time, run_worker, write_json  # noqa: E402

HERE = os.path.abspath(__file__)


def worker(args) -> dict:
    import torch_gradops as tg
    from torch_gradops.testing import gat_composite

    torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    n, e, h, c = args.nodes, args.edges, args.heads, args.channels
    edge_index = torch.randint(0, n, (2, e), generator=gen).to(device)
    x = torch.randn(n, h, c, generator=gen).to(device, dtype).requires_grad_()
    a_src = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_()
    a_dst = torch.randn(n, h, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(n, h, c, generator=gen).to(device, dtype)
    if args.impl == "op":
        graph = tg.BipartiteCSC.from_edge_index(edge_index, n, n)
        graph.reverse_index()  # graph preprocessing, cached across calls: not timed
        call = lambda: tg.gat_attention(x, a_src, a_dst, graph)
    else:
        src, dst = edge_index[0], edge_index[1]
        call = lambda: gat_composite(x, a_src, a_dst, src, dst, n)[0]

    def step():
        if args.mode == "fwd":
            with torch.no_grad():
                call()
        else:
            torch.autograd.grad(call(), (x, a_src, a_dst), grad)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # warm-up outside the memory window
    with PeakMemory(device) as mem:
        step()
    seconds = median_time(step, device, args.repeats, warmup=0)
    moved = (e * h * c + 2 * n * h * c) * torch.finfo(dtype).bits // 8  # gathered rows + x + out
    return {"seconds": seconds, "peak_extra_bytes": mem.peak_bytes, "bytes_moved_fwd": moved}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["op", "composite"], default="op", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["fwd", "fwd_bwd"], default="fwd", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, default=10000, help=argparse.SUPPRESS)
    p.add_argument("--edges", type=int, default=200000, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sizes", nargs="+", default=["10000:200000", "100000:2000000"],
                   help="NODES:EDGES pairs")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    rows = []
    for size in args.sizes:
        n, e = map(int, size.split(":"))
        repeats = args.repeats if e <= 1_000_000 else max(3, args.repeats // 2)
        for mode in ("fwd", "fwd_bwd"):
            res = {}
            for impl in ("op", "composite"):
                res[impl] = run_worker(HERE, ["--impl", impl, "--mode", mode, "--nodes", str(n), "--edges", str(e),
                                              "--device", args.device, "--dtype", args.dtype,
                                              "--heads", str(args.heads), "--channels", str(args.channels),
                                              "--threads", str(args.threads), "--repeats", str(repeats)])
            row = {"nodes": n, "edges": e, "mode": mode, "op": res["op"], "composite": res["composite"]}
            if "error" not in res["op"] and "error" not in res["composite"]:
                row["speedup"] = res["composite"]["seconds"] / res["op"]["seconds"]
                row["memory_ratio"] = res["composite"]["peak_extra_bytes"] / max(res["op"]["peak_extra_bytes"], 1)
            rows.append(row)
            print(_row_text(row), flush=True)
    info = machine_info(args.device)
    info["threads"] = args.threads
    out = args.out or os.path.join(os.path.dirname(HERE), "results", f"gat_attention_{args.device.split(':')[0]}.json")
    write_json(out, {"benchmark": "gat_attention", "machine": info, "heads": args.heads,
                     "channels": args.channels, "dtype": args.dtype, "rows": rows})


def _row_text(row):
    def cell(r):
        if "error" in r:
            return f"{'error: ' + str(r['error'])[:40]:>34}"
        return f"{r['seconds'] * 1e3:10.1f} ms {format_bytes(r['peak_extra_bytes']):>12}"
    extra = ""
    if "speedup" in row:
        extra = f" | speed-up {row['speedup']:5.1f}x | memory {row['memory_ratio']:6.1f}x less"
    return f"N={row['nodes']:>8} E={row['edges']:>9} {row['mode']:>7} | ours {cell(row['op'])} | composite {cell(row['composite'])}{extra}"


if __name__ == "__main__":
    main()
