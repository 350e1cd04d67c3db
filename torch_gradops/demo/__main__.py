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

import torch

import torch_gradops as tg
from torch_gradops.demo import cora, tensornet
from torch_gradops.demo.gat_op import gat_op_check


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
    print()
    ok = cora.run(args.device, args.epochs, progress=not args.no_progress) and ok
    print()
    ok = tensornet.run(args.device, progress=not args.no_progress) and ok
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
