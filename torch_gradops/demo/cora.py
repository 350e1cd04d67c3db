"""Demo piece: the original GAT (Velickovic et al., 2018) trained on the shipped Cora graph with
our GATConv and, from the same seed, with PyG's (:func:`torch_gradops.testing.train_cora`): test
accuracy, time per epoch and peak memory of both."""
from __future__ import annotations

import torch

from torch_gradops.testing import format_bytes, train_cora

ACC_RANGE = (0.79, 0.84)  # the usual GAT-on-Cora test accuracy after FULL_EPOCHS
FULL_EPOCHS = 200


def run(device: str = "cpu", epochs: int = 200, progress: bool = True) -> bool:
    """Train the original GAT on Cora with our GATConv and PyG's; True if ours lands in 0.79-0.84.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        epochs: training epochs (the paper's configuration uses 200 here).
        progress: show a tqdm progress bar per model.
    """
    from torch_geometric.nn import GATConv as PyGGATConv

    from torch_gradops.datasets import load_cora
    from torch_gradops.nn import GATConv

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
              f"peak memory {'n/a' if r['peak_bytes'] is None else format_bytes(r['peak_bytes'])}")
    ours, pyg = results["torch_gradops"], results["PyG"]
    print(f"   speed-up per epoch: {pyg['epoch_s'] / ours['epoch_s']:.2f}x; peak memory: {mem_note}")
    lo, hi = ACC_RANGE
    if epochs < FULL_EPOCHS:  # the range is that of a full training run
        print(f"   torch_gradops test accuracy {ours['test_acc']:.4f} (not checked: the expected range "
              f"[{lo}, {hi}] is for {FULL_EPOCHS} epochs or more)")
        return True
    ok = lo <= ours["test_acc"] <= hi
    print(f"   torch_gradops test accuracy {ours['test_acc']:.4f} "
          f"{'in' if ok else 'OUTSIDE'} the expected range [{lo}, {hi}] -> {'OK' if ok else 'FAIL'}")
    return ok

