"""Small real graphs shipped inside the package, loaded offline (no network access).

Cora (Planetoid split) comes from Thomas Kipf's ``gcn`` repository (MIT licence); the raw
``ind.cora.*`` files, the licence and the attribution are in ``torch_gradops/data/planetoid/``.
"""
from __future__ import annotations

import os

__all__ = ["load_cora", "planetoid_dir"]


def planetoid_dir() -> str:
    """Folder holding the shipped raw Planetoid files (``ind.cora.*``, ``LICENCE``, ``README.md``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "planetoid")


def load_cora(normalize_features: bool = False):
    """The Cora citation graph with the standard Planetoid split, as a PyG ``Data``.

    Read from the package's raw files with PyG's own Planetoid reader
    (``torch_geometric.io.read_planetoid_data``, which needs scipy), so the result is what
    ``torch_geometric.datasets.Planetoid(root, 'Cora')[0]`` gives, without downloading.

    Args:
        normalize_features: row-normalise ``x`` to sum 1 (PyG's ``NormalizeFeatures``), as the
            GAT paper does.

    Returns:
        ``Data(x [2708, 1433] float32, edge_index [2, 10556] int64 (undirected, sorted),
        y [2708] int64 (7 classes), train_mask/val_mask/test_mask [2708] bool (140/500/1000))``.
    """
    try:
        from torch_geometric.io import read_planetoid_data
    except ImportError as exc:  # pragma: no cover
        raise ImportError("load_cora() needs torch_geometric (pip install torch_gradops[pyg])") from exc
    folder = planetoid_dir()
    if not os.path.exists(os.path.join(folder, "ind.cora.graph")):
        raise FileNotFoundError(f"the Cora files are missing from {folder}; reinstall torch_gradops")
    data = read_planetoid_data(folder, "cora")
    if normalize_features:
        from torch_geometric.transforms import NormalizeFeatures
        data = NormalizeFeatures()(data)
    return data
