"""Every compiled kernel of torch_gradops once on a device, checked against the CPU kernels.

    python scripts/cuda_smoke.py [--device cuda] [--small]

Runs the GAT and GATv2 forward and backward kernels (all edge-feature modes, return_attention,
dropout, int32 and int64 indices, float64/32/16/bfloat16, GAT's half features with float32
logits), the SpMM/SDDMM primitives through a double backward (GATv2's twice: it must be
bitwise repeatable too), and the tensor-network executor (a sliced plan, its forward and
gradients), on small graphs with a hub destination, destinations without edges and
``num_src != num_dst``. Each result is compared with the same call on the CPU (whose kernels
the test suite checks against plain-PyTorch references); the backward is also run twice and
must be bitwise equal.

A short driver rather than the test suite, so that compute-sanitizer (memcheck, racecheck,
synccheck, initcheck) can run every kernel in minutes: ``--small`` shrinks the graphs further
for that. Exits 1 if a check fails. ``--device cpu`` runs the same calls on the CPU (checks the
script itself where there is no GPU).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import torch_gradops as tg
from torch_gradops.gat import edge_aggregate, edge_dot
from torch_gradops import tensornet as tnet
from torch_gradops.testing import lattice_network, interleave

FAILURES = []
TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def check(name, got, want, dtype):
    """Relative max-norm agreement of ``got`` (device) with ``want`` (CPU), for the dtype."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if got.shape != want.shape:
        FAILURES.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    if not torch.isfinite(got).all():
        FAILURES.append(f"{name}: non-finite values")
        return
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)) if want.numel() else 0.0
    if err > TOL[dtype]:
        FAILURES.append(f"{name}: relative error {err:.3g} > {TOL[dtype]:.0e}")


def check_bitwise(name, a, b):
    for x, y in zip(a, b):
        if x is not None and not torch.equal(x, y):
            FAILURES.append(f"{name}: backward not bitwise repeatable")
            return


def graph_edges(num_src, num_dst, edges, hub, gen):
    """A random edge index with a hub destination (``hub`` extra edges into destination 0) and
    the last few destinations left without edges."""
    src = torch.randint(0, num_src, (edges,), generator=gen)
    dst = torch.randint(0, max(num_dst - 3, 1), (edges,), generator=gen)
    src = torch.cat([src, torch.randint(0, num_src, (hub,), generator=gen)])
    dst = torch.cat([dst, torch.zeros(hub, dtype=torch.long)])
    return torch.stack([src, dst])


def grads_of(out, inputs, seed):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g).to(out)
    return torch.autograd.grad(out, [t for t in inputs if t is not None], go, allow_unused=True)


def run_gat(dev, sizes, index_dtype, dtype, gen, float32_logits=False):
    """``float32_logits``: half features with float32 logits (GATConv under autocast)."""
    n_src, n_dst, E, hub, H, C = sizes
    ei = graph_edges(n_src, n_dst, E, hub, gen).to(index_dtype)
    E = ei.size(1)
    host = dict(x=torch.randn(n_src, H, C, generator=gen), a_s=torch.randn(n_src, H, generator=gen),
                a_d=torch.randn(n_dst, H, generator=gen), el=torch.randn(E, H, generator=gen))
    rows_dst, edge_w = torch.randn(n_dst, H, C, generator=gen), torch.randn(E, H, generator=gen)
    results = {}
    for where in ("cpu", dev):
        g = tg.BipartiteCSC.from_edge_index(ei, n_src, n_dst).to(where)
        t = {k: v.to(where, dtype if k == "x" or not float32_logits else torch.float32).requires_grad_()
             for k, v in host.items()}
        out, alpha = tg.gat_attention(t["x"], t["a_s"], t["a_d"], g, edge_logits=t["el"], return_attention=True)
        inputs = [t["x"], t["a_s"], t["a_d"], t["el"]]
        first = grads_of(out + 0 * alpha.sum(), inputs, 1)
        again = grads_of(tg.gat_attention(t["x"], t["a_s"], t["a_d"], g, edge_logits=t["el"]), inputs, 1)
        results[where] = (out, alpha, first, again)
        if dtype == torch.float64:  # double backward: the SpMM/SDDMM primitives
            o = tg.gat_attention(t["x"], t["a_s"], t["a_d"], g, edge_logits=t["el"])
            gx = torch.autograd.grad((o * o).sum(), t["x"], create_graph=True)[0]
            results[where] += (torch.autograd.grad((gx * gx).sum(), inputs),)
        # dropout: not comparable across devices (different random streams); run for coverage
        tg.gat_attention(t["x"], t["a_s"], t["a_d"], g, dropout=0.5, training=True).sum().backward()
        w, a = edge_w.to(where, dtype), rows_dst.to(where, dtype)
        results[where] += (edge_aggregate(w, t["x"].detach(), g), edge_dot(a, t["x"].detach(), g))
    tag = f"gat[{dtype}{', float32 logits' if float32_logits else ''}, {index_dtype}]"
    cpu, gpu = results["cpu"], results[dev]
    check(f"{tag} out", gpu[0], cpu[0], dtype)
    check(f"{tag} alpha", gpu[1], cpu[1], dtype)
    for k, (a, b) in enumerate(zip(gpu[2], cpu[2])):
        check(f"{tag} grad {k}", a, b, dtype)
    check_bitwise(f"{tag}", gpu[2], gpu[3])
    if dtype == torch.float64:
        for k, (a, b) in enumerate(zip(gpu[4], cpu[4])):
            check(f"{tag} double backward {k}", a, b, dtype)
    check(f"{tag} edge_aggregate", gpu[-2], cpu[-2], dtype)
    check(f"{tag} edge_dot", gpu[-1], cpu[-1], dtype)


def run_gatv2(dev, sizes, index_dtype, dtype, mode, gen):
    n_src, n_dst, E, hub, H, C = sizes
    K = 5
    ei = graph_edges(n_src, n_dst, E, hub, gen).to(index_dtype)
    E = ei.size(1)
    host = dict(xs=torch.randn(n_src, H, C, generator=gen), xd=torch.randn(n_dst, H, C, generator=gen),
                att=torch.randn(H, C, generator=gen))
    if mode == "project":
        host.update(ea=torch.randn(E, K, generator=gen), w=torch.randn(K, H, C, generator=gen) / K)
    elif mode == "direct":
        host.update(ea=torch.randn(E, H, C, generator=gen))
    results = {}
    for where in ("cpu", dev):
        g = tg.BipartiteCSC.from_edge_index(ei, n_src, n_dst).to(where)
        t = {k: v.to(where, dtype).requires_grad_() for k, v in host.items()}
        kw = dict(edge_attr=t.get("ea"), edge_weight=t.get("w"))
        out, alpha = tg.gatv2_attention(t["xs"], t["xd"], t["att"], g, return_attention=True, **kw)
        inputs = [t["xs"], t["xd"], t["att"], t.get("ea"), t.get("w")]
        first = grads_of(out + 0 * alpha.sum(), inputs, 2)
        again = grads_of(tg.gatv2_attention(t["xs"], t["xd"], t["att"], g, **kw), inputs, 2)
        results[where] = (out, alpha, first, again)
        if dtype in (torch.float64, torch.float32):  # double backward twice: segment sums, no atomics
            results[where] += tuple(gatv2_double_backward(g, t, inputs, kw) for _ in range(2))
        tg.gatv2_attention(t["xs"], t["xd"], t["att"], g, dropout=0.5, training=True, **kw).sum().backward()
    tag = f"gatv2[{mode}, {dtype}, {index_dtype}]"
    cpu, gpu = results["cpu"], results[dev]
    check(f"{tag} out", gpu[0], cpu[0], dtype)
    check(f"{tag} alpha", gpu[1], cpu[1], dtype)
    for k, (a, b) in enumerate(zip(gpu[2], cpu[2])):
        if a is not None:
            check(f"{tag} grad {k}", a, b, dtype)
    check_bitwise(tag, gpu[2], gpu[3])
    if len(gpu) > 4:
        for k, (a, b) in enumerate(zip(gpu[4], cpu[4])):
            if a is not None:
                check(f"{tag} double backward {k}", a, b, dtype)
        check_bitwise(f"{tag} double backward", gpu[4], gpu[5])


def gatv2_double_backward(g, t, inputs, kw):
    """Gradients of a gradient penalty (the squared x_src / x_dst gradients, create_graph=True)."""
    out = tg.gatv2_attention(t["xs"], t["xd"], t["att"], g, **kw)
    present = [x for x in inputs if x is not None]
    gx = torch.autograd.grad(out.square().sum(), present[:2], create_graph=True)
    return torch.autograd.grad(sum(x.square().sum() for x in gx), present, allow_unused=True)


def run_tensornet(dev, small):
    inputs, output, arrays = lattice_network(3, 3 if small else 4, 4, seed=0, dtype=torch.float64)
    res = {}
    for where in ("cpu", dev):
        ops = [a.to(where).requires_grad_() for a in arrays]
        plan = tnet.plan(*interleave(inputs, ops, output), memory_limit=2 ** 10, max_overhead=None)
        val = plan.contract(*ops)
        res[where] = (val, torch.autograd.grad(val, ops), plan.gradients(*ops, output_grad=torch.ones_like(val)))
        if plan.num_slices < 2:
            FAILURES.append(f"tensornet: the plan has {plan.num_slices} slice(s); the check wants a sliced one")
    check("tensornet value", res[dev][0], res["cpu"][0], torch.float64)
    for k, (a, b) in enumerate(zip(res[dev][1], res["cpu"][1])):
        check(f"tensornet autograd grad {k}", a, b, torch.float64)
    for k, (a, b) in enumerate(zip(res[dev][2], res["cpu"][2])):
        check(f"tensornet plan.gradients {k}", a, b, torch.float64)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="smaller graphs (for compute-sanitizer)")
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not (torch.cuda.is_available() and tg.built_with_cuda()):
        print("no CUDA device, or the extension was built without its CUDA kernels", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    # (num_src, num_dst, edges, hub edges, heads, channels): C = 8 and 32 and one C > 32
    shapes = [(50, 40, 300, 200, 2, 8), (70, 90, 600, 300, 4, 32)]
    if not args.small:
        shapes += [(3000, 2500, 40000, 20000, 8, 32), (200, 150, 2000, 500, 2, 72)]
    t0 = time.perf_counter()
    for sizes in shapes:
        for index_dtype in (torch.int64, torch.int32):
            for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
                if args.small and dtype in (torch.float16, torch.bfloat16) and index_dtype == torch.int32:
                    continue
                run_gat(dev, sizes, index_dtype, dtype, gen)
                if dtype in (torch.float16, torch.bfloat16):
                    run_gat(dev, sizes, index_dtype, dtype, gen, float32_logits=True)
                for mode in ("none", "project", "direct"):
                    run_gatv2(dev, sizes, index_dtype, dtype, mode, gen)
    run_tensornet(dev, args.small)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"cuda_smoke on {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}): "
          f"{len(FAILURES)} failure(s) in {time.perf_counter() - t0:.1f} s")
    for f in FAILURES:
        print("  FAIL", f)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
