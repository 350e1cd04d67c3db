"""Fused ``gatv2_attention`` vs the plain-PyTorch composite (PyG's GATv2Conv math), with a
row-gather bound.

Implementations (each (size, edge_dim, implementation, mode) in a fresh process; median time
over repeats after a warm-up, and the peak extra memory of one call, see ``_common.PeakMemory``):

* ``op``: ``torch_gradops.gatv2_attention`` (edge projection inside the kernels).
* ``composite``: what PyG's ``GATv2Conv`` does between its projections and bias: index_select
  of both endpoints' rows, the projected edge features ``edge_attr @ W`` materialised,
  leaky_relu on ``E x H x C``, ``torch_geometric.utils.softmax``, index_add of the messages.
* ``gather`` (forward only), the row-gather bound: ``torch.sparse.mm(A, x_src.view(N, H*C))``
  with ``A`` the unweighted ``N x N`` adjacency in CSR, i.e. one ``x_src`` row read per edge
  and summed per destination, with nothing of size ``E x H x C`` written. Any GATv2 forward
  must read at least this (it also reads ``x_dst`` and scores every feature). The op's target is
  a forward within 2x of it. The op's forward worker also times the bound alternating with the op
  in its own process (``interleaved_op_over_gather``): on a shared machine that ratio is steadier.
* ``index_select`` (forward only, for reference): ``x_src.view(N, H*C).index_select(0, src)``,
  the same rows gathered into an ``[E, H*C]`` tensor (what the composite does first).

Modes: ``fwd``, ``fwd_bwd`` (gradients of all inputs) and ``double_bwd``: a gradient penalty,
the squared norm of the x_src/x_dst gradients (``create_graph=True``) differentiated again for
all inputs (the op's recomputing higher-order path against the composite's autograd).

Prints a table and writes JSON under ``benchmarks/results/``.

    python benchmarks/gatv2_attention.py          # CPU, 2 threads, N=50k/E=1M and N=100k/E=2M, edge_dim 0 and 16
    python benchmarks/gatv2_attention.py --device cuda --sizes 100000:2000000 1000000:10000000
    python benchmarks/gatv2_attention.py --modes double_bwd --sizes 10000:200000 50000:1000000 \
        --out benchmarks/results/gatv2_attention_cpu_double_backward.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import PeakMemory, format_bytes, machine_info, median_time, run_worker, write_json  # noqa: E402

HERE = os.path.abspath(__file__)
IMPLS_FWD = ("op", "composite", "gather", "index_select")
IMPLS_BWD = ("op", "composite")
MODES = ("fwd", "fwd_bwd", "double_bwd")


def composite_gatv2(x_src, x_dst, att, src, dst, num_dst, edge_attr=None, edge_weight=None, negative_slope=0.2):
    """The reference: PyG's GATv2Conv message/softmax/aggregate on projected features."""
    from torch_geometric.utils import softmax

    heads, channels = att.shape
    z = x_src.index_select(0, src) + x_dst.index_select(0, dst)
    if edge_attr is not None:
        z = z + (edge_attr @ edge_weight.view(edge_weight.size(0), -1)).view(-1, heads, channels)
    alpha = softmax((F.leaky_relu(z, negative_slope) * att).sum(-1), dst, num_nodes=num_dst)
    out = torch.zeros((num_dst, heads, channels), dtype=x_src.dtype, device=x_src.device)
    return out.index_add(0, dst, alpha.unsqueeze(-1) * x_src.index_select(0, src))


def random_inputs(n, e, h, c, k, device="cpu", dtype=torch.float32):
    """The benchmarks' GATv2 op inputs (seed 0): ``edge_index [2, e]`` (uniform, ``n`` nodes), the
    leaves ``x_src, x_dst [n, h, c]``, ``att [h, c]``, ``edge_attr [e, k]`` and ``edge_weight
    [k, h, c]`` (the last two None when ``k`` is 0; scaled so that scores are O(1)), and an output
    gradient ``[n, h, c]``."""
    gen = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, n, (2, e), generator=gen).to(device)
    leaf = lambda t: t.to(device, dtype).requires_grad_()
    x_src = leaf(torch.randn(n, h, c, generator=gen))
    x_dst = leaf(torch.randn(n, h, c, generator=gen))
    att = leaf(torch.randn(h, c, generator=gen) / c ** 0.5)
    edge_attr = leaf(torch.randn(e, k, generator=gen)) if k else None
    edge_weight = leaf(torch.randn(k, h, c, generator=gen) / k ** 0.5) if k else None
    grad = torch.randn(n, h, c, generator=gen).to(device, dtype)
    return edge_index, x_src, x_dst, att, edge_attr, edge_weight, grad


def worker(args) -> dict:
    import torch_gradops as tg

    torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    n, e, h, c, k = args.nodes, args.edges, args.heads, args.channels, args.edge_dim
    edge_index, x_src, x_dst, att, edge_attr, edge_weight, grad = random_inputs(n, e, h, c, k, device, dtype)
    inputs = [t for t in (x_src, x_dst, att, edge_attr, edge_weight) if t is not None]
    src, dst = edge_index[0], edge_index[1]
    if args.impl == "op":
        graph = tg.BipartiteCSC.from_edge_index(edge_index, n, n)
        graph.reverse_index()  # graph preprocessing, cached across calls: not timed
        call = lambda: tg.gatv2_attention(x_src, x_dst, att, graph, 0.2, edge_attr, edge_weight)
    elif args.impl == "composite":
        call = lambda: composite_gatv2(x_src, x_dst, att, src, dst, n, edge_attr, edge_weight)
    elif args.impl == "gather":
        graph = tg.BipartiteCSC.from_edge_index(edge_index, n, n)
        adj = torch.sparse_csr_tensor(graph.indptr, graph.indices, torch.ones(e, dtype=dtype, device=device), (n, n))
        rows = x_src.detach().view(n, h * c)
        call = lambda: torch.sparse.mm(adj, rows)
    else:
        rows = x_src.detach().view(n, h * c)
        call = lambda: rows.index_select(0, src)

    def step():
        if args.mode == "fwd":
            with torch.no_grad():
                call()
        elif args.mode == "fwd_bwd":
            torch.autograd.grad(call(), inputs, grad)
        else:  # a gradient penalty: the feature gradients' squared norm, differentiated again
            first = torch.autograd.grad(call(), (x_src, x_dst), grad, create_graph=True)
            torch.autograd.grad(sum(g.square().sum() for g in first), inputs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    step()  # warm-up outside the memory window
    with PeakMemory(device) as mem:
        step()
    seconds = median_time(step, device, args.repeats, warmup=0)
    result = {"seconds": seconds, "peak_extra_bytes": mem.peak_bytes}
    if args.impl == "op" and args.mode == "fwd":
        # The gather bound again, alternating with the op in this process: on a shared machine
        # the ratio of these two medians is steadier than one of times from separate processes.
        graph = tg.BipartiteCSC.from_edge_index(edge_index, n, n)
        adj = torch.sparse_csr_tensor(graph.indptr, graph.indices, torch.ones(e, dtype=dtype, device=device), (n, n))
        rows = x_src.detach().view(n, h * c)
        gather = lambda: torch.sparse.mm(adj, rows)
        gather()
        op_times, gather_times = [], []
        for _ in range(args.repeats):
            op_times.append(median_time(step, device, 1, warmup=0))
            gather_times.append(median_time(gather, device, 1, warmup=0))
        op_s, gather_s = statistics.median(op_times), statistics.median(gather_times)
        result.update(interleaved_op_seconds=op_s, interleaved_gather_seconds=gather_s,
                      interleaved_op_over_gather=op_s / gather_s)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS_FWD, default="op", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="fwd", help=argparse.SUPPRESS)
    p.add_argument("--modes", choices=MODES, nargs="+", default=["fwd", "fwd_bwd"])
    p.add_argument("--nodes", type=int, default=50000, help=argparse.SUPPRESS)
    p.add_argument("--edges", type=int, default=1000000, help=argparse.SUPPRESS)
    p.add_argument("--edge-dim", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--edge-dims", type=int, nargs="+", default=[0, 16])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sizes", nargs="+", default=["50000:1000000", "100000:2000000"], help="NODES:EDGES pairs")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    rows = []
    for size in args.sizes:
        n, e = map(int, size.split(":"))
        repeats = args.repeats if e <= 1_000_000 else max(3, args.repeats // 2)
        for k in args.edge_dims:
            for mode in args.modes:
                res = {}
                for impl in IMPLS_FWD if mode == "fwd" else IMPLS_BWD:
                    res[impl] = run_worker(HERE, [
                        "--impl", impl, "--mode", mode, "--nodes", str(n), "--edges", str(e), "--edge-dim", str(k),
                        "--device", args.device, "--dtype", args.dtype, "--heads", str(args.heads),
                        "--channels", str(args.channels), "--threads", str(args.threads), "--repeats", str(repeats)])
                row = {"nodes": n, "edges": e, "edge_dim": k, "mode": mode, **res}
                ok = lambda name: name in res and "error" not in res[name]
                if ok("op") and ok("composite"):
                    row["speedup"] = res["composite"]["seconds"] / res["op"]["seconds"]
                    row["memory_ratio"] = res["composite"]["peak_extra_bytes"] / max(res["op"]["peak_extra_bytes"], 1)
                if ok("op") and ok("gather"):
                    row["op_over_gather_bound"] = res["op"]["seconds"] / res["gather"]["seconds"]
                rows.append(row)
                print(_row_text(row), flush=True)
    info = machine_info(args.device)
    info["threads"] = args.threads
    out = args.out or os.path.join(os.path.dirname(HERE), "results", f"gatv2_attention_{args.device.split(':')[0]}.json")
    write_json(out, {"benchmark": "gatv2_attention", "machine": info, "heads": args.heads, "channels": args.channels,
                     "dtype": args.dtype, "memory_method": PeakMemory(args.device).method,
                     "gather_bound": "torch.sparse.mm(unweighted CSR adjacency, x_src.view(N, H*C)): one x_src row "
                                     "read per edge, summed per destination",
                     "rows": rows})


def _row_text(row):
    def cell(name):
        r = row.get(name)
        if r is None:
            return ""
        if "error" in r:
            return f" | {name} error: {str(r['error'])[-60:]!r}"
        return f" | {name} {r['seconds'] * 1e3:9.1f} ms {format_bytes(r['peak_extra_bytes']):>10}"
    extra = ""
    if "speedup" in row:
        extra += f" | speed-up {row['speedup']:5.1f}x, memory {row['memory_ratio']:6.1f}x less"
    if "op_over_gather_bound" in row:
        extra += f" | op/gather {row['op_over_gather_bound']:4.2f}"
        if "interleaved_op_over_gather" in row["op"]:
            extra += f" (interleaved {row['op']['interleaved_op_over_gather']:4.2f})"
    head = f"N={row['nodes']:>7} E={row['edges']:>8} edge_dim={row['edge_dim']:>2} {row['mode']:>10}"
    return head + "".join(cell(i) for i in IMPLS_FWD) + extra


if __name__ == "__main__":
    main()
