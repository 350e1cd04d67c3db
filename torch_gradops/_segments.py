"""Deterministic sums of rows by segment: the ``index_add`` of the differentiable paths.

``index_add`` on CUDA adds with atomics, so the order of each sum (and its rounding) changes
from run to run. :func:`segment_sum` sums each segment's rows in a fixed order with the fused
SpMM primitive (``gat_spmm``: one task per output row, no atomics); its adjoint is a gather
by segment, and each differentiates into the other, so every order of derivative, forward AD
and vmap (through ``gat_spmm``'s head-folding rule) stays bitwise repeatable on CPU and CUDA.
:func:`index_add_rows` replaces ``total.index_add(0, index, rows)`` for any ``index``: the rows
of each distinct id are summed by segment first, so the final ``index_add`` has distinct ids
(one add per element, exact in any order). On the CPU the sums are in the order
``index_add`` takes (by row), so results are bitwise the same as with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .library import ops

__all__ = ["plain_tensor", "Segments", "segment_sum", "gather_rows", "sum_sorted_rows", "index_add_rows"]


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torch.func wrappers: for index tensors, which carry no tangents or batch
    dimensions, so that closures can use them at any transform level."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


# (A dataclass, not a NamedTuple: torch.func treats it as one opaque Function argument.)
@dataclass(frozen=True)
class Segments:
    """``R`` rows grouped into ``S`` segments: segment ``n`` is rows ``order[ptr[n]:ptr[n+1]]``,
    summed in that order; ``segment [R]`` is each row's segment. All int64, on one device."""
    ptr: torch.Tensor
    order: torch.Tensor
    segment: torch.Tensor

    @property
    def num_segments(self) -> int:
        return self.ptr.numel() - 1

    @staticmethod
    def contiguous(ptr: torch.Tensor, segment: torch.Tensor) -> "Segments":
        """Rows already grouped: segment ``n`` is rows ``ptr[n]..ptr[n+1]`` (``segment`` is
        non-decreasing, e.g. a CSC chunk's destinations)."""
        ptr, segment = plain_tensor(ptr), plain_tensor(segment)
        with torch._C._DisableFuncTorch():  # plain results, usable at every transform level
            segment = segment.long()
            return Segments(ptr.long(), torch.arange(segment.numel(), device=segment.device), segment)

    @staticmethod
    def of_index(index: torch.Tensor) -> Tuple["Segments", torch.Tensor]:
        """``(segments, ids)``: the rows grouped by ``index`` value (rows of one value in row
        order), ``ids [S]`` the distinct values, ascending."""
        index = plain_tensor(index)
        with torch._C._DisableFuncTorch():
            index = index.long()
            ids, segment, counts = torch.unique(index, sorted=True, return_inverse=True, return_counts=True)
            order = torch.sort(segment, stable=True).indices
            ptr = torch.zeros(ids.numel() + 1, dtype=torch.long, device=index.device)
            torch.cumsum(counts, 0, out=ptr[1:])
            return Segments(ptr, order, segment), ids


def _sum_kernel(x: torch.Tensor, segs: Segments) -> torch.Tensor:
    rows, num = x.size(0), segs.num_segments
    width = math.prod(x.shape[1:])
    if width == 0 or rows == 0:
        return x.new_zeros((num,) + tuple(x.shape[1:]))
    flat = x.reshape(rows, 1, width)  # [R, 1, K]: one "head", K channels
    out = ops.gat_spmm(flat.new_ones((rows, 1)), flat, segs.ptr, segs.order, None)
    return out.reshape((num,) + tuple(x.shape[1:]))


class _SegmentSum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, segs):
        return _sum_kernel(x, segs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.segs = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _SegmentGather.apply(grad, ctx.segs), None

    @staticmethod
    def jvp(ctx, t_x, _):
        return _SegmentSum.apply(t_x, ctx.segs)


class _SegmentGather(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(y, segs):
        return y.index_select(0, segs.segment)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.segs = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return _SegmentSum.apply(grad, ctx.segs), None

    @staticmethod
    def jvp(ctx, t_y, _):
        return _SegmentGather.apply(t_y, ctx.segs)


def segment_sum(x: torch.Tensor, segs: Segments) -> torch.Tensor:
    """``[R, ...] -> [S, ...]``: each segment's rows summed in its fixed order (zeros for an
    empty segment). Half types accumulate in float32."""
    return _SegmentSum.apply(x, segs)


class _GatherRows(torch.autograd.Function):
    """``t.index_select(0, index)`` whose backward sums by :func:`index_add_rows`."""
    generate_vmap_rule = True

    @staticmethod
    def forward(t, index):
        return t.index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, index = inputs
        ctx.index = plain_tensor(index)
        ctx.num_rows = t.size(0)

    @staticmethod
    def backward(ctx, grad):
        total = grad.new_zeros((ctx.num_rows,) + tuple(grad.shape[1:]))
        return index_add_rows(total, ctx.index, grad), None

    @staticmethod
    def jvp(ctx, t_t, _):
        return _GatherRows.apply(t_t, ctx.index)


def plain_ops() -> bool:
    """Whether to use plain PyTorch ops instead of the segment Functions: under ``torch.compile``
    (which traces plain ops only) and under ``torch.jit.trace`` (whose tracer cannot record a
    Function taking a :class:`Segments`)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)``, differentiable into deterministic sums at every order
    (under ``torch.compile`` or ``torch.jit.trace``, ``index_select`` itself)."""
    if plain_ops():
        return t.index_select(0, index)
    return _GatherRows.apply(t, plain_tensor(index))


def sum_sorted_rows(x: torch.Tensor, ptr: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``[R, ...] -> [len(ptr) - 1, ...]``: rows already grouped by ``segment`` (non-decreasing,
    with ``ptr`` its segment boundaries) summed by :func:`segment_sum` (under ``torch.compile``
    or ``torch.jit.trace`` by ``index_add``)."""
    if plain_ops():
        return x.new_zeros((ptr.numel() - 1,) + tuple(x.shape[1:])).index_add(0, segment, x)
    return segment_sum(x, Segments.contiguous(ptr, segment))


def index_add_rows(total: torch.Tensor, index: Optional[torch.Tensor], rows: torch.Tensor,
                   groups: Optional[Tuple[Segments, torch.Tensor]] = None) -> torch.Tensor:
    """``total.index_add(0, index, rows)``, deterministic: the rows of each id summed in row
    order by :func:`segment_sum`, then added once per distinct id. In place when torch allows
    (not an unbatched ``total`` taking batched rows under vmap). Under ``torch.compile`` or
    ``torch.jit.trace``, ``index_add`` itself. ``groups``: ``Segments.of_index(index)`` when
    the caller keeps it; ``index`` may then be None, except under those two."""
    if plain_ops():
        if index is None:
            raise ValueError("index_add_rows: index is needed under torch.compile and torch.jit.trace")
        return total.index_add(0, index, rows)
    segs, ids = groups if groups is not None else Segments.of_index(index)
    sums = segment_sum(rows, segs)
    try:
        return total.index_add_(0, ids, sums)
    except RuntimeError:
        return total.index_add(0, ids, sums)
