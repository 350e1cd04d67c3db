"""Bipartite graphs in compressed sparse column (CSC) form, the layout the GAT kernels walk."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["BipartiteCSC"]


def _check_index_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")


def csc_destinations(indptr: torch.Tensor, num_edges: int) -> torch.Tensor:
    """``[E]`` destination id of each CSC position, in ``indptr``'s dtype and device."""
    counts = indptr[1:] - indptr[:-1]
    return torch.repeat_interleave(torch.arange(counts.numel(), device=indptr.device, dtype=indptr.dtype),
                                   counts, output_size=num_edges)


@dataclass(frozen=True)
class _ReverseIndex:
    """Edges grouped by source: the order the deterministic backward sums in."""
    indptr: torch.Tensor  # [num_src + 1]
    edge: torch.Tensor    # [E] CSC position of each edge, grouped by source (stable)
    dst: torch.Tensor     # [E] destination of each of those edges


class BipartiteCSC:
    """A directed bipartite graph ``source -> destination`` in CSC form.

    Attributes:
        indptr: ``[num_dst + 1]`` offsets; the incoming edges of destination ``i`` are the CSC
            positions ``indptr[i]:indptr[i+1]``.
        indices: ``[E]`` source id of each edge, in CSC order.
        num_src, num_dst: node counts of the two sides.
        perm: ``[E]`` original edge id of each CSC position, or ``None`` when CSC order is the
            original order (input already sorted by destination).

    ``indptr``, ``indices`` and ``perm`` share one integer dtype (int32 or int64) and one device.
    The source-grouped reverse index that the backward needs is built once, lazily.
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, num_src: int,
                 perm: Optional[torch.Tensor] = None, *, validate: bool = True):
        _check_index_tensor(indptr, "indptr")
        _check_index_tensor(indices, "indices")
        if indptr.dim() != 1 or indptr.numel() < 1:
            raise ValueError(f"indptr must be 1-D with num_dst + 1 >= 1 entries, got shape {tuple(indptr.shape)}")
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
        if indices.dtype != indptr.dtype:
            raise TypeError(f"indices ({indices.dtype}) and indptr ({indptr.dtype}) must share one dtype")
        if indices.device != indptr.device:
            raise ValueError(f"indices ({indices.device}) and indptr ({indptr.device}) must be on one device")
        num_src = int(num_src)
        if num_src < 0:
            raise ValueError(f"num_src must be >= 0, got {num_src}")
        if perm is not None:
            _check_index_tensor(perm, "perm")
            if perm.shape != indices.shape or perm.device != indices.device:
                raise ValueError("perm must have the shape and device of indices")
            perm = perm.to(indices.dtype)
        self.indptr = indptr.contiguous()
        self.indices = indices.contiguous()
        self.num_src = num_src
        self.num_dst = indptr.numel() - 1
        self.perm = None if perm is None else perm.contiguous()
        self._reverse: Optional[_ReverseIndex] = None
        self._dst: Optional[torch.Tensor] = None
        self._inv_perm: Optional[torch.Tensor] = None
        if validate:
            self._validate()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_edge_index(cls, edge_index: torch.Tensor, num_src: Optional[int] = None,
                        num_dst: Optional[int] = None) -> "BipartiteCSC":
        """Build from a ``[2, E]`` edge index (row 0 = source, row 1 = destination, PyG's convention).

        ``num_src``/``num_dst`` default to ``max id + 1`` of each row. Edges are stably sorted by
        destination; an input already sorted needs no permutation.
        """
        _check_index_tensor(edge_index, "edge_index")
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(f"edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
        src, dst = edge_index[0], edge_index[1]
        E = src.numel()
        if num_src is None:
            num_src = int(src.max()) + 1 if E else 0
        if num_dst is None:
            num_dst = int(dst.max()) + 1 if E else 0
        num_src, num_dst = int(num_src), int(num_dst)
        if num_dst < 0 or num_src < 0:
            raise ValueError(f"num_src and num_dst must be >= 0, got {num_src} and {num_dst}")
        if E:
            lo_d, hi_d = int(dst.min()), int(dst.max())
            if lo_d < 0 or hi_d >= num_dst:
                raise IndexError(f"edge_index[1] (destinations) out of range [0, {num_dst}): found {lo_d if lo_d < 0 else hi_d}")
        if E and bool((dst[1:] >= dst[:-1]).all()):
            perm = None
            dst_sorted, src_sorted = dst, src
        else:
            perm = torch.argsort(dst, stable=True)
            dst_sorted, src_sorted = dst[perm], src[perm]
        counts = torch.bincount(dst_sorted, minlength=num_dst) if E else torch.zeros(num_dst, dtype=torch.long, device=dst.device)
        indptr = torch.zeros(num_dst + 1, dtype=torch.long, device=dst.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        dtype = edge_index.dtype
        graph = cls(indptr.to(dtype), src_sorted.to(dtype).contiguous(), num_src,
                    None if perm is None else perm.to(dtype), validate=False)
        graph._validate(check_indptr=False)
        graph._dst = dst_sorted.contiguous()
        return graph

    @classmethod
    def from_csc(cls, indptr: torch.Tensor, indices: torch.Tensor, num_src: int) -> "BipartiteCSC":
        """Build from CSC arrays (edge order = CSC order, so no permutation)."""
        return cls(indptr, indices, num_src)

    # ------------------------------------------------------------------ properties
    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    @property
    def dtype(self) -> torch.dtype:
        return self.indptr.dtype

    def dst_index(self) -> torch.Tensor:
        """``[E]`` destination id of each edge, in CSC order (built once)."""
        if self._dst is None:
            self._dst = csc_destinations(self.indptr, self.num_edges)
        return self._dst

    def reverse_index(self) -> _ReverseIndex:
        """Source-grouped edge lists (built once): ``indptr [num_src+1]``, ``edge [E]``, ``dst [E]``."""
        if self._reverse is None:
            edge = torch.argsort(self.indices, stable=True)
            # searchsorted over the sorted sources rather than bincount: its output size is
            # static (num_src + 1), so torch.compile can trace it without a graph break.
            indptr = torch.searchsorted(
                self.indices.index_select(0, edge),
                torch.arange(self.num_src + 1, device=self.device, dtype=self.dtype))
            self._reverse = _ReverseIndex(indptr.to(self.dtype), edge.to(self.dtype).contiguous(),
                                          self.dst_index()[edge].contiguous())
        return self._reverse

    def edge_order(self, values: torch.Tensor) -> torch.Tensor:
        """Reorder a per-edge tensor from the original edge order to CSC order."""
        return values if self.perm is None else values.index_select(0, self.perm)

    def original_order(self, values: torch.Tensor) -> torch.Tensor:
        """Reorder a per-edge tensor from CSC order back to the original edge order."""
        if self.perm is None:
            return values
        if self._inv_perm is None:
            self._inv_perm = torch.argsort(self.perm).to(self.dtype)
        return values.index_select(0, self._inv_perm)

    def to(self, device) -> "BipartiteCSC":
        """A copy on ``device`` (the reverse index moves along if it was built)."""
        device = torch.device(device)
        if device == self.device:
            return self
        g = BipartiteCSC(self.indptr.to(device), self.indices.to(device), self.num_src,
                         None if self.perm is None else self.perm.to(device), validate=False)
        if self._dst is not None:
            g._dst = self._dst.to(device)
        if self._reverse is not None:
            r = self._reverse
            g._reverse = _ReverseIndex(r.indptr.to(device), r.edge.to(device), r.dst.to(device))
        return g

    def __repr__(self) -> str:
        return (f"BipartiteCSC(num_src={self.num_src}, num_dst={self.num_dst}, "
                f"num_edges={self.num_edges}, dtype={self.dtype}, device={self.device}, "
                f"sorted_input={self.perm is None})")

    # ------------------------------------------------------------------ validation
    def _validate(self, check_indptr: bool = True) -> None:
        E = self.indices.numel()
        if check_indptr:
            if int(self.indptr[0]) != 0:
                raise ValueError(f"indptr[0] must be 0, got {int(self.indptr[0])}")
            if int(self.indptr[-1]) != E:
                raise ValueError(f"indptr[-1] must equal the number of edges ({E}), got {int(self.indptr[-1])}")
            if self.num_dst and not bool((self.indptr[1:] >= self.indptr[:-1]).all()):
                raise ValueError("indptr must be non-decreasing (monotone)")
        if E:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0 or hi >= self.num_src:
                bad = lo if lo < 0 else hi
                raise IndexError(f"indices (source ids) out of range [0, {self.num_src}): found {bad}")
        if self.indices.dtype == torch.int32 and E >= 2**31:
            raise ValueError("int32 indices cannot address 2^31 or more edges; use int64")
