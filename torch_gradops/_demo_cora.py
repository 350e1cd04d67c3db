"""Cora training demo: the original GAT (Velickovic et al., 2018) with our GATConv and PyG's.

``run(device, epochs)`` trains the paper's Cora configuration (2 layers, 8 heads x 8 hidden
units, one output head, dropout 0.6 on features and attention, ELU, Adam lr 0.005, weight decay
5e-4) twice from the same seed: once with :class:`torch_gradops.nn.GATConv`, once with
``torch_geometric.nn.GATConv``. It prints the test accuracy of both (at the epoch of best
validation accuracy, the paper's model selection), the time per epoch and the peak memory.
"""
from __future__ import annotations

import time
from typing import Dict

import torch
import torch.nn.functional as F

from ._memory import PeakMemory

ACC_RANGE = (0.79, 0.84)  # the usual GAT-on-Cora test accuracy


class CoraGAT(torch.nn.Module):
    """The paper's 2-layer GAT for Cora, on a given ``GATConv`` class."""

    def __init__(self, conv_cls, in_channels: int, num_classes: int, hidden: int = 8,
                 heads: int = 8, dropout: float = 0.6):
        super().__init__()
        self.dropout = dropout
        self.conv1 = conv_cls(in_channels, hidden, heads=heads, dropout=dropout)
        self.conv2 = conv_cls(hidden * heads, num_classes, heads=1, concat=False, dropout=dropout)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


# ------------------------------------------------------------------------------ training
def train_cora(conv_cls, data, device: torch.device, epochs: int = 200, seed: int = 0,
               progress: bool = False, desc: str = "") -> Dict[str, float]:
    """Train :class:`CoraGAT` on ``data`` (already on ``device``); returns the metrics.

    Returns:
        ``{"test_acc": test accuracy at the best validation accuracy, "best_val_acc",
        "final_test_acc", "epoch_s": mean wall time of one epoch (training step + evaluation),
        "peak_bytes": see torch_gradops._memory.PeakMemory (None if unavailable)}``.
    """
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    model = CoraGAT(conv_cls, data.num_features, int(data.y.max()) + 1).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    best_val, test_at_best, test_acc = -1.0, 0.0, 0.0

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with PeakMemory(device) as mem:
        sync()
        t0 = time.perf_counter()
        bar = tqdm(range(epochs), desc=desc, disable=not progress, leave=True)
        for _ in bar:
            model.train()
            opt.zero_grad()
            out = model(data.x, data.edge_index)
            loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                pred = model(data.x, data.edge_index).argmax(dim=-1)
            correct = pred == data.y
            val_acc = correct[data.val_mask].float().mean().item()
            test_acc = correct[data.test_mask].float().mean().item()
            if val_acc > best_val:
                best_val, test_at_best = val_acc, test_acc
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val_acc:.3f}", test=f"{test_acc:.3f}")
        sync()
        elapsed = time.perf_counter() - t0
    return {"test_acc": test_at_best, "best_val_acc": best_val, "final_test_acc": test_acc,
            "epoch_s": elapsed / max(epochs, 1), "peak_bytes": mem.peak_bytes}


def _fmt_mem(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f} MiB"


def run(device: str = "cpu", epochs: int = 200, progress: bool = True) -> bool:
    """Train the original GAT on Cora with our GATConv and PyG's; True if ours lands in 0.79-0.84.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        epochs: training epochs (the paper's configuration uses 200 here).
        progress: show a tqdm progress bar per model.
    """
    from torch_geometric.nn import GATConv as PyGGATConv

    from .datasets import load_cora
    from .nn import GATConv

    dev = torch.device(device)
    data = load_cora(normalize_features=True).to(dev)
    print(f"== GAT on Cora (2 layers, 8 heads x 8 hidden, dropout 0.6, lr 0.005, wd 5e-4), "
          f"{epochs} epochs on {dev}: {data.num_nodes} nodes, {data.num_edges} edges")
    # Warm both up first (one-time costs: thread pools, first allocations, lazy imports) so
    # that neither the timing nor the memory of the first model measured carries them.
    for cls in (GATConv, PyGGATConv):
        train_cora(cls, data, dev, epochs=2, seed=0)
    results = {}
    for name, cls in (("torch_gradops", GATConv), ("PyG", PyGGATConv)):
        results[name] = train_cora(cls, data, dev, epochs=epochs, seed=0, progress=progress,
                                   desc=f"{name:>13s}")
    mem_note = ("CUDA max_memory_allocated over training" if dev.type == "cuda" else
                "CPU: growth of the process RSS high-water mark over training, an approximation")
    for name, r in results.items():
        print(f"   {name:>13s}: test accuracy {r['test_acc']:.4f} (at best val {r['best_val_acc']:.4f}; "
              f"last epoch {r['final_test_acc']:.4f}) | {r['epoch_s'] * 1e3:7.2f} ms/epoch | "
              f"peak memory {_fmt_mem(r['peak_bytes'])}")
    ours, pyg = results["torch_gradops"], results["PyG"]
    print(f"   speed-up per epoch: {pyg['epoch_s'] / ours['epoch_s']:.2f}x; peak memory: {mem_note}")
    lo, hi = ACC_RANGE
    ok = lo <= ours["test_acc"] <= hi
    print(f"   torch_gradops test accuracy {ours['test_acc']:.4f} "
          f"{'in' if ok else 'OUTSIDE'} the expected range [{lo}, {hi}] -> {'OK' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":  # pragma: no cover
    import sys
    raise SystemExit(0 if run(sys.argv[1] if len(sys.argv) > 1 else "cpu") else 1)
