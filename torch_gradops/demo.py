"""The main job: ``python -m torch_gradops.demo``.

1. The fused GAT op on a generated graph, checked against a plain-PyTorch reference (outputs and
   gradients), with the timings of both.
2. The original GAT trained on the shipped Cora graph with our GATConv and, from the same seed,
   with PyG's: test accuracy, time per epoch and peak memory of both.
3. A sliced contraction of a quantum-circuit amplitude network with gradients, checked against
   torch.einsum, with a progress bar over the slices.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import torch_gradops as tg


def _reference_gat(x_src, a_src, a_dst, src, dst, num_dst, negative_slope):
    """index_select + scatter softmax, as PyG computes it (materialises E x H x C)."""
    s = F.leaky_relu(a_src[src] + a_dst[dst], negative_slope)
    smax = torch.full((num_dst, s.size(1)), float("-inf"), dtype=s.dtype, device=s.device)
    smax = smax.scatter_reduce(0, dst.view(-1, 1).expand_as(s), s, "amax", include_self=True)
    p = (s - smax[dst]).exp()
    alpha = p / torch.zeros_like(smax).index_add(0, dst, p)[dst]
    return torch.zeros((num_dst,) + x_src.shape[1:], dtype=x_src.dtype, device=x_src.device).index_add(
        0, dst, alpha.unsqueeze(-1) * x_src[src])


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
    ref = _reference_gat(x, a_src, a_dst, src, dst, nodes, 0.2)
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
    rf = lambda: _reference_gat(x, a_src, a_dst, src, dst, nodes, 0.2)
    t = {name: _timed(run, repeats) for name, run in
         (("op fwd", fwd(op)), ("ref fwd", fwd(rf)), ("op fwd+bwd", fwd_bwd(op)), ("ref fwd+bwd", fwd_bwd(rf)))}
    print(f"   forward:          ours {t['op fwd']*1e3:8.2f} ms | reference {t['ref fwd']*1e3:8.2f} ms | "
          f"speed-up {t['ref fwd']/t['op fwd']:.1f}x")
    print(f"   forward+backward: ours {t['op fwd+bwd']*1e3:8.2f} ms | reference {t['ref fwd+bwd']*1e3:8.2f} ms | "
          f"speed-up {t['ref fwd+bwd']/t['op fwd+bwd']:.1f}x")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_gradops.demo", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nodes", type=int, default=20000)
    parser.add_argument("--edges", type=int, default=400000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=200, help="Cora training epochs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    print(f"torch_gradops {tg.__version__} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"CUDA kernels compiled: {tg.built_with_cuda()}")
    ok = gat_op_check(args.device, args.nodes, args.edges, 8, 32, args.repeats)
    from . import _demo_cora, _demo_tensornet

    print()
    ok = _demo_cora.run(args.device, args.epochs, progress=not args.no_progress) and ok
    print()
    ok = _demo_tensornet.run(args.device, progress=not args.no_progress) and ok
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
