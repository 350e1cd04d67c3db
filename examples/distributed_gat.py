"""Data-parallel GAT training on the shipped Cora graph with DistributedDataParallel.

    torchrun --standalone --nproc_per_node=2 examples/distributed_gat.py --epochs 100

Each rank trains on its share of a per-epoch shuffle of the training nodes (every
``world_size``-th node; shares of equal size, so every rank takes the same number of steps) in
mini-batches of sampled neighbourhoods: PyG's ``NeighborLoader`` when a sampling backend
(pyg-lib or torch-sparse) is installed, otherwise the full ``num_hops`` neighbourhood of the
batch from ``torch_geometric.utils.k_hop_subgraph``. DDP averages the gradients, so a step equals
one single-process step on the mean of the ranks' batch losses (tests/test_distributed.py checks
that). gloo on CPU, NCCL on GPUs (``--device cuda``: one GPU per rank).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.utils import k_hop_subgraph

from torch_gradops.datasets import load_cora
from torch_gradops.nn import GAT


def make_model(num_features: int, num_classes: int, dropout: float, seed: int) -> GAT:
    """The original Cora GAT: 2 layers, 8 heads x 8 hidden units, ELU."""
    torch.manual_seed(seed)
    return GAT(num_features, 64, num_layers=2, out_channels=num_classes, heads=8, dropout=dropout,
               act="elu")


def _sampler_available() -> bool:
    import torch_geometric.typing as pyg_typing
    return bool(getattr(pyg_typing, "WITH_PYG_LIB", False) or getattr(pyg_typing, "WITH_TORCH_SPARSE", False))


def rank_batches(data, rank: int, world_size: int, batch_size: int, num_hops: int, epoch: int, seed: int):
    """This rank's mini-batches for one epoch: ``(x, edge_index, seed_positions, y)``.

    Every rank draws the same shuffle of the training nodes (same seed and epoch), drops its
    last ``len % world_size`` nodes (a different few each epoch) and takes every
    ``world_size``-th node of the rest, so shares are disjoint and of equal size: every rank runs
    the same number of batches, which DDP's gradient all-reduce needs (a rank with one batch
    fewer would leave the others waiting in it).
    """
    train_idx = data.train_mask.nonzero().view(-1)
    gen = torch.Generator().manual_seed(seed * 1000 + epoch)
    even = train_idx.numel() // world_size * world_size
    share = train_idx[torch.randperm(train_idx.numel(), generator=gen)][:even][rank::world_size]
    if _sampler_available():
        from torch_geometric.loader import NeighborLoader
        # The sampler draws from torch's global generator: seed it per (seed, epoch, rank) so a
        # rank's batches can be reproduced in another process (the test does).
        torch.manual_seed(seed * 1000 + epoch * 10 + rank)
        loader = NeighborLoader(data, input_nodes=share, num_neighbors=[10] * num_hops,
                                batch_size=batch_size, shuffle=False)
        for batch in loader:
            n = batch.batch_size
            yield batch.x, batch.edge_index, torch.arange(n), batch.y[:n]
        return
    for seeds in share.split(batch_size):
        subset, edge_index, mapping, _ = k_hop_subgraph(seeds, num_hops, data.edge_index,
                                                        relabel_nodes=True, num_nodes=data.num_nodes)
        yield data.x[subset], edge_index, mapping, data.y[seeds]


def train(rank: int, world_size: int, epochs: int = 30, batch_size: int = 35, lr: float = 0.005,
          weight_decay: float = 5e-4, dropout: float = 0.6, seed: int = 0, device: str = "cpu",
          verbose: bool = False) -> dict:
    """Train on this rank's share (the process group must be initialised); returns the final
    parameters, the per-step losses and the test accuracy."""
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    data = load_cora(normalize_features=True)
    if int(data.train_mask.sum()) < world_size:  # a rank with no nodes would train on empty batches (NaN losses)
        raise ValueError(f"{world_size} ranks but only {int(data.train_mask.sum())} training nodes: every rank "
                         "needs at least one; run fewer ranks")
    model = make_model(data.num_features, int(data.y.max()) + 1, dropout, seed).to(dev)
    ddp = DistributedDataParallel(model, device_ids=None if dev.type == "cpu" else [dev.index])
    opt = torch.optim.Adam(ddp.parameters(), lr=lr, weight_decay=weight_decay)
    torch.manual_seed(seed + 1 + rank)  # dropout draws differ per rank, as with any DDP job
    losses = []
    for epoch in range(epochs):
        ddp.train()
        for x, edge_index, pos, y in rank_batches(data, rank, world_size, batch_size, 2, epoch, seed):
            opt.zero_grad()
            out = ddp(x.to(dev), edge_index.to(dev))
            loss = F.cross_entropy(out[pos.to(dev)], y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if verbose and rank == 0:
            print(f"epoch {epoch + 1:3d} | loss {losses[-1]:.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        pred = model(data.x.to(dev), data.edge_index.to(dev)).argmax(-1).cpu()
    test_acc = (pred[data.test_mask] == data.y[data.test_mask]).float().mean().item()
    return {"state_dict": {k: v.cpu() for k, v in model.state_dict().items()}, "losses": losses,
            "test_acc": test_acc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=35)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        result = train(rank, world_size, epochs=args.epochs, batch_size=args.batch_size,
                       device=args.device, seed=args.seed, verbose=True)
        if rank == 0:
            sampler = "NeighborLoader" if _sampler_available() else "k_hop_subgraph"
            print(f"{world_size} ranks ({sampler} batches): test accuracy {result['test_acc']:.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # one thread per rank unless the caller set OMP_NUM_THREADS (torchrun sets it to 1 for more
    # than one process; torch has read the variable already, so set the count itself)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    main()
