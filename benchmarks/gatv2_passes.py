"""Where the fused GATv2 op's CPU time goes: forward and backward by the gradients asked for.

The backward (``torch.ops.torch_gradops.gatv2_backward``) runs pass 1 (per destination) for
any gradient, and pass 2 (per source, over the reverse index) only for ``x_src``'s. Asking
for gradients one group at a time separates the costs:

* ``att``: pass 1 alone (scores, softmax and ``att``'s partial sums; no ``dz`` rows kept);
* ``att+x_dst``: adds the ``x_dst`` rows of ``dz``;
* ``att+x_dst+edge_weight``: adds the ``dz`` rows kept per tile and the ``edge_weight``
  products (``edge_attr^T dz``), with ``edge_dim``;
* ``all``: the layer's backward (``x_src``, ``x_dst``, ``att``, ``edge_weight``);
* ``x_src``: ``x_src``'s gradient alone.

``x_src``'s gradient is computed either by pass 2 (per source, over the reverse index: ``reverse``)
or scattered into per-group partials in pass 1 (``scatter``); the kernel picks one by the machine's
thread count and memory (see ``scatter_groups`` in ``csrc/cpu/gatv2_cpu.cpp``). The two variants
that ask for it run both ways, forced with ``TORCH_GRADOPS_GATV2_SOURCE_PASS``.

Every configuration runs in one process, the forward and the backward variants alternating,
``--repeats`` rounds; medians in ms. On a shared VM one process's rounds are steadier than
separate processes. The inputs of ``gatv2_attention.py`` (uniform random graph, seed 0), ``H=8``,
``C=32``, fp32.

    python benchmarks/gatv2_passes.py                       # N=100k/E=2M, edge_dim 0 and 16
    python benchmarks/gatv2_passes.py --sizes 50000:1000000 --edge-dims 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import machine_info, run_worker, write_json  # noqa: E402

# name -> (x_src, x_dst, att, edge_attr, edge_weight) gradients asked for
VARIANTS = {
    "att": (False, False, True, False, False),
    "att+x_dst": (False, True, True, False, False),
    "att+x_dst+edge_weight": (False, True, True, False, True),
    "all": (True, True, True, False, True),
    "x_src": (True, False, False, False, False),
}
SOURCE_PASSES = ("reverse", "scatter")


def backward_calls():
    """``[(name, gradient mask, source pass or None)]``: each variant, those with x_src's gradient
    once per source pass."""
    return [(f"{name} ({how})" if how else name, mask, how) for name, mask in VARIANTS.items()
            for how in (SOURCE_PASSES if mask[0] else (None,))]


def worker(a) -> dict:
    import torch
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.dirname(HERE))
    from torch_gradops import BipartiteCSC
    from gatv2_attention import random_inputs  # the op benchmark's inputs
    ops = torch.ops.torch_gradops
    K = a.edge_dim
    edge_index, *leaves, grad_out = random_inputs(a.nodes, a.edges, a.heads, a.channels, K)
    xs, xd, att, ea, w = (None if t is None else t.detach() for t in leaves)  # the raw ops take plain tensors
    graph = BipartiteCSC.from_edge_index(edge_index, num_src=a.nodes, num_dst=a.nodes)
    rev = graph.reverse_index()

    def forward():
        return ops.gatv2_forward(xs, xd, att, ea, w, graph.indptr, graph.indices, None, 0.2, 1.0, False)

    out, lse, _ = forward()

    def backward(mask, how):
        mask = list(mask)
        mask[4] = mask[4] and K > 0
        os.environ["TORCH_GRADOPS_GATV2_SOURCE_PASS"] = how or "auto"
        ops.gatv2_backward(grad_out, None, out, lse, xs, xd, att, ea, w, graph.indptr, graph.indices,
                           rev.indptr, rev.edge, rev.dst, None, 0.2, 1.0, mask)

    calls = {"forward": forward}
    for name, mask, how in backward_calls():
        calls[name] = lambda m=mask, h=how: backward(m, h)
    for fn in calls.values():  # warm-up
        fn()
    times = {name: [] for name in calls}
    for _ in range(a.repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {"median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "times_ms": {k: [round(1e3 * t, 1) for t in v] for k, v in times.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nodes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--edges", type=int, help=argparse.SUPPRESS)
    p.add_argument("--edge-dim", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="100000:2000000", help="comma-separated N:E pairs")
    p.add_argument("--edge-dims", default="0,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--channels", type=int, default=32)
    p.add_argument("--out", default=os.path.join(HERE, "results", "gatv2_passes_cpu.json"))
    a = p.parse_args()
    if a.worker:
        import json
        print(json.dumps(worker(a)))
        return
    rows = []
    for size in a.sizes.split(","):
        n, e = (int(v) for v in size.split(":"))
        for k in (int(v) for v in a.edge_dims.split(",")):
            res = run_worker(os.path.abspath(__file__),
                             ["--nodes", str(n), "--edges", str(e), "--edge-dim", str(k), "--threads", str(a.threads),
                              "--repeats", str(a.repeats), "--heads", str(a.heads), "--channels", str(a.channels)],
                             env={"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)})
            rows.append({"nodes": n, "edges": e, "edge_dim": k, **res})
    names = ["forward"] + [name for name, _, _ in backward_calls()]
    print(f"{'N / E / edge_dim':<24}" + "".join(f"{n:>24}" for n in names))
    for r in rows:
        label = f"{r['nodes']} / {r['edges']} / {r['edge_dim']}"
        if "error" in r:
            print(f"{label:<24} error: {r['error'][-300:]}")
            continue
        print(f"{label:<24}" + "".join(f"{r['median_ms'][n]:>21.0f} ms" for n in names))
    write_json(a.out, {"benchmark": "gatv2_passes", "machine": machine_info("cpu"),
                       "method": "one process per configuration; forward and backward variants alternating; "
                                 "medians of --repeats rounds after a warm-up",
                       "heads": a.heads, "channels": a.channels, "results": rows})


if __name__ == "__main__":
    main()
