"""PyTorch Geometric integration: drop-in ``GATConv`` and ``GATv2Conv``, the ``GAT`` model and
``convert``.

Needs ``torch_geometric`` (``pip install torch_gradops[pyg]``).
"""
from __future__ import annotations

import torch
from torch_geometric.nn.conv import GATConv as PyGGATConv
from torch_geometric.nn.conv import GATv2Conv as PyGGATv2Conv
from torch_geometric.nn.models import GAT as PyGGAT

from .adjacency import clear_csc_cache
from .gat_conv import GATConv
from .gatv2_conv import GATv2Conv

__all__ = ["GATConv", "GATv2Conv", "GAT", "convert", "clear_csc_cache"]

# PyG's layer class -> ours (a subclass with the same constructor and parameters)
_OURS = {PyGGATConv: GATConv, PyGGATv2Conv: GATv2Conv}


class GAT(PyGGAT):
    """:class:`torch_geometric.nn.models.GAT` (same arguments and behaviour) on our
    :class:`GATConv`, or with ``v2=True`` our :class:`GATv2Conv`."""

    def init_conv(self, in_channels, out_channels, **kwargs):
        conv = super().init_conv(in_channels, out_channels, **kwargs)
        # Same constructor, same RNG draws as PyG's model: only the forward is swapped.
        if type(conv) in _OURS:
            conv.__class__ = _OURS[type(conv)]
        return conv


def convert(model: torch.nn.Module) -> torch.nn.Module:
    """Make every ``torch_geometric.nn.GATConv`` and ``GATv2Conv`` inside ``model`` one of ours,
    in place.

    Each layer keeps its parameter objects (weights, optimizer state and hooks stay valid):
    only its class changes, to our subclass, whose ``forward`` computes the same function.
    Works on any ``nn.Module``, including ``torch.fx`` ``GraphModule``\\ s made by
    ``torch_geometric.nn.to_hetero`` (their per-edge-type copies are plain submodules).
    Subclasses of PyG's layers other than ours are left alone (they may override ``message``
    etc.). Returns ``model``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert() expects a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        if type(module) in _OURS:
            module.__class__ = _OURS[type(module)]
    return model
