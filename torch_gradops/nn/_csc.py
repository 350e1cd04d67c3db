"""Edge-list -> CSC conversion for :class:`torch_gradops.nn.GATConv`, with self-loop handling.

The conversion is written with ops whose output shapes depend only on input *shapes*
(``argsort``, ``cumsum``, ``index_add``, ``index_put``), never on input *values*, so
``torch.compile(fullgraph=True)`` can trace it: PyG's ``remove_self_loops`` uses boolean-mask
indexing, whose output size depends on the data. Instead of removing the self-loops already in
the input, we route them to one extra "trash" destination row (``num_dst``) that the layer drops
after aggregation: they then take no part in any real destination's softmax, and since the
gradient of the dropped row is zero they contribute exactly zero to every gradient.

Edge order conventions (the ``perm`` of the returned graph maps CSC positions to these ids):

* ids ``0 .. E-1``: the input edges in input order (removed self-loops included, in the trash row);
  when there is nothing to remove (and not compiling) the trash row is left out;
* ids ``E .. E+L-1``: the ``L = num_loops`` added self-loops ``(i, i)``, ``i < L``.

Per-edge tensors (edge logits, attention) of the layer live in that "processed" order.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..graph import BipartiteCSC

__all__ = ["build_csc"]


def _check_range(src: Tensor, dst: Tensor, num_src: int, num_dst: int) -> None:
    """Out-of-range ids would make the kernels read out of bounds: refuse them."""
    if src.numel() == 0:
        return
    if torch.compiler.is_compiling():
        # No data-dependent Python branch under torch.compile; an async assert traces fine.
        torch._assert_async(((src >= 0) & (src < num_src) & (dst >= 0) & (dst < num_dst)).all(),
                            "GATConv: edge_index has node ids out of range")
        return
    lo_s, hi_s = int(src.min()), int(src.max())
    if lo_s < 0 or hi_s >= num_src:
        raise IndexError(f"GATConv: source ids (edge_index[0]) must be in [0, {num_src}), "
                         f"found {lo_s if lo_s < 0 else hi_s}")
    lo_d, hi_d = int(dst.min()), int(dst.max())
    if lo_d < 0 or hi_d >= num_dst:
        raise IndexError(f"GATConv: destination ids (edge_index[1]) must be in [0, {num_dst}), "
                         f"found {lo_d if lo_d < 0 else hi_d}")


def build_csc(src: Tensor, dst: Tensor, num_src: int, num_dst: int, num_loops: Optional[int],
              dst_sorted: Optional[bool] = None) -> BipartiteCSC:
    """CSC graph of the edges ``src[e] -> dst[e]`` after PyG's self-loop handling.

    Args:
        src, dst: ``[E]`` integer source / destination ids (input order).
        num_src, num_dst: node counts.
        num_loops: ``None`` to keep the edges as they are (``add_self_loops=False``); else
            ``L``: drop the input self-loops (to the trash row) and add ``(i, i)`` for ``i < L``,
            like ``remove_self_loops`` followed by ``add_self_loops(num_nodes=L)``.
        dst_sorted: ``True`` if ``dst`` is known to be non-decreasing (no sort then), ``None`` to
            check (eager only; under ``torch.compile`` we sort).

    Returns:
        A :class:`BipartiteCSC` with ``num_dst`` destinations, plus one trash row when
        ``num_loops`` is not None and the input has self-loops (always under torch.compile);
        the caller tells by ``graph.num_dst``. ``perm`` maps CSC positions to processed edge ids (see module
        doc).
    """
    device = src.device
    src, dst = src.long(), dst.long()
    E = src.numel()
    _check_range(src, dst, num_src, num_dst)
    if dst_sorted is None:
        dst_sorted = (not torch.compiler.is_compiling()) and (
            E < 2 or bool((dst[1:] >= dst[:-1]).all()))
    if dst_sorted:
        order: Optional[Tensor] = None
        s, d = src, dst
    else:
        order = torch.argsort(dst, stable=True)
        s, d = src.index_select(0, order), dst.index_select(0, order)
    ids = torch.arange(E, device=device) if order is None else order  # processed id per sorted edge

    if num_loops is None:
        counts = torch.zeros(num_dst, dtype=torch.long, device=device).index_add_(
            0, d, torch.ones_like(d))
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        indices, perm, num_rows = s, order, num_dst
    else:
        L = int(num_loops)
        if L > num_dst or L > num_src:
            raise ValueError(f"cannot add {L} self-loops to a {num_src} x {num_dst} graph")
        is_loop = s == d
        # The trash row is only needed if the input has self-loops; under torch.compile that
        # is data-dependent, so there it is always present.
        trash = torch.compiler.is_compiling() or bool(is_loop.any())
        keep = (~is_loop).long()
        kept_counts = torch.zeros(num_dst, dtype=torch.long, device=device).index_add_(0, d, keep)
        kept_ptr = torch.cat([kept_counts.new_zeros(1), kept_counts.cumsum(0)])  # [num_dst + 1]
        # A destination's segment holds its kept edges (input order) then its added loop, so a
        # kept edge with destination d moves by the min(d, L) loops of the earlier segments.
        kept_rank = keep.cumsum(0) - keep
        loop_rank = (1 - keep).cumsum(0) - (1 - keep)
        pos = torch.where(is_loop, kept_ptr[-1] + L + loop_rank, kept_rank + d.clamp(max=L))
        loop_ids = torch.arange(L, device=device)
        loop_pos = kept_ptr[1:L + 1] + loop_ids
        total = E + L
        indices = torch.empty(total, dtype=torch.long, device=device)
        indices.index_put_((pos,), s).index_put_((loop_pos,), loop_ids)
        perm = torch.empty(total, dtype=torch.long, device=device)
        perm.index_put_((pos,), ids).index_put_((loop_pos,), loop_ids + E)
        rows = torch.arange(num_dst + 1, device=device)
        indptr = kept_ptr + rows.clamp(max=L)
        num_rows = num_dst
        if trash:
            indptr = torch.cat([indptr, kept_ptr.new_full((1,), total)])
            num_rows = num_dst + 1

    # The source-grouped reverse index is built lazily by gat_attention (only when a gradient
    # is needed) and then stays with the cached graph.
    if indices.numel() < 2**31 and max(num_src, num_rows) < 2**31:
        # int32 ids halve the cached graph (and the kernels' index traffic).
        indptr, indices = indptr.int(), indices.int()
        perm = None if perm is None else perm.int()
    graph = BipartiteCSC(indptr, indices, num_src, perm, validate=False)
    assert graph.num_dst == num_rows
    return graph
