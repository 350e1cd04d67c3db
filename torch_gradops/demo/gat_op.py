"""Demo piece: the fused GAT op on a generated graph against the plain-PyTorch composite
(:func:`torch_gradops.testing.gat_composite`): outputs, gradients and the timings of both."""
from __future__ import annotations

import time

import torch

import torch_gradops as tg
from torch_gradops.testing import gat_composite


def _timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gat_op_check(device: str, nodes: int, edges: int, heads: int, channels: int, repeats: int) -> bool:
    print(f"== fused GAT op on a random graph: N={nodes}, E={edges}, H={heads}, C={channels}, device={device}")
    gen = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, nodes, (2, edges), generator=gen).to(device)
    graph = tg.BipartiteCSC.from_edge_index(edge_index, nodes, nodes)
    x = torch.randn(nodes, heads, channels, generator=gen).to(device).requires_grad_()
    a_src = torch.randn(nodes, heads, generator=gen).to(device).requires_grad_()
    a_dst = torch.randn(nodes, heads, generator=gen).to(device).requires_grad_()
    grad = torch.randn(nodes, heads, channels, generator=gen).to(device)
    src, dst = edge_index

    out = tg.gat_attention(x, a_src, a_dst, graph)
    ours = torch.autograd.grad(out, (x, a_src, a_dst), grad)
    ref, _ = gat_composite(x, a_src, a_dst, src, dst, nodes)
    theirs = torch.autograd.grad(ref, (x, a_src, a_dst), grad)
    errs = [(out - ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(ours, theirs)]
    ok = all(e < 1e-4 for e in errs)
    print("   max |ours - reference|: out {:.2e}, grad x {:.2e}, grad a_src {:.2e}, grad a_dst {:.2e} -> {}".format(
        *errs, "OK" if ok else "MISMATCH"))

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def fwd(f):
        def run():
            with torch.no_grad():
                f()
            sync()
        return run

    def fwd_bwd(f):
        def run():
            torch.autograd.grad(f(), (x, a_src, a_dst), grad)
            sync()
        return run

    op = lambda: tg.gat_attention(x, a_src, a_dst, graph)
    rf = lambda: gat_composite(x, a_src, a_dst, src, dst, nodes)[0]
    t = {name: _timed(run, repeats) for name, run in
         (("op fwd", fwd(op)), ("ref fwd", fwd(rf)), ("op fwd+bwd", fwd_bwd(op)), ("ref fwd+bwd", fwd_bwd(rf)))}
    print(f"   forward:          ours {t['op fwd']*1e3:8.2f} ms | reference {t['ref fwd']*1e3:8.2f} ms | "
          f"speed-up {t['ref fwd']/t['op fwd']:.1f}x")
    print(f"   forward+backward: ours {t['op fwd+bwd']*1e3:8.2f} ms | reference {t['ref fwd+bwd']*1e3:8.2f} ms | "
          f"speed-up {t['ref fwd+bwd']/t['op fwd+bwd']:.1f}x")
    return ok
