"""Bipartite graphs in compressed sparse column (CSC) form, the layout the GAT kernels walk."""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["BipartiteCSC", "csc_from_edges", "check_edge_range", "csc_destinations", "as_index"]


def _check_index_tensor(t, name, any_integer: bool = False):
    """``t`` a tensor of int32/int64 ids (``any_integer``: of any integer dtype, to be converted)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if any_integer:
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer node ids, got {t.dtype}")
    elif t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")


def as_index(n) -> Optional[int]:
    """``n`` as an int when it is one (an int, a numpy integer, a 0-dim integer tensor), else
    None (bools, floats, None and anything else)."""
    if isinstance(n, bool):
        return None
    if isinstance(n, (int, torch.SymInt)):  # (Dynamo sees a dynamic size as an int: kept symbolic, where
        return n                            # operator.index would specialise it to its current value)
    try:
        return operator.index(n)
    except TypeError:
        return None


def _count(n, name: str) -> int:
    """``n`` as a count (see :func:`as_index`, >= 0), or an error naming ``name``."""
    value = as_index(n)
    if value is None:
        raise TypeError(f"{name} must be an int, got {n!r}" + ("" if n is None or isinstance(n, bool)
                                                             else f" ({type(n).__name__})"))
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


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


def _func_off_unless_wrapped(*tensors) -> contextlib.AbstractContextManager:
    """torch.func off (``_DisableFuncTorch``) for building cached indices from ``tensors``,
    unless one of them is a transform's wrapper tensor (a graph built inside ``vmap``, whose
    cache dies with it): built inside a transform (``hessian``) they would be its wrappers, and
    a later call under another transform would use escaped ones ("escaped?" internal asserts)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(isinstance(t, torch.Tensor) and wrapped(t) for t in tensors):
        return contextlib.nullcontext()
    return torch._C._DisableFuncTorch()


def _append_zero_row(values: torch.Tensor) -> torch.Tensor:
    """``values`` with one zero row after its last: where :meth:`BipartiteCSC._inverse_perm`
    sends the original edges a graph leaves out, and the layers' extra destination row for the
    input's own self-loops under torch.compile (:func:`csc_from_edges`)."""
    return torch.cat([values, values.new_zeros((1,) + values.shape[1:])])


class _EdgePermutation(torch.autograd.Function):
    """``values.index_select(0, index)`` for an injective ``index`` (``back`` its inverse, with
    ``len(index)`` for the rows ``index`` skips), whose backward gathers the gradient with
    ``back``: index_select's own backward scatter-adds into zeros, which for a permutation is the
    same result at more cost (CPU, 2M x 16 float32: about 180 ms against 75 ms for the gather).
    ``pad`` appends a zero row to ``values`` first (the target of the skipped rows), so one class
    serves both directions: CSC order -> original order pads, the reverse does not. Double
    backward, forward mode and vmap follow from the same two gathers."""

    generate_vmap_rule = True

    @staticmethod
    def forward(values, index, back, pad):
        return (_append_zero_row(values) if pad else values).index_select(0, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.index, ctx.back, ctx.pad = inputs  # integer inputs, never differentiated: attributes
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        return _EdgePermutation.apply(grad, ctx.back, ctx.index, not ctx.pad), None, None, None

    @staticmethod
    def jvp(ctx, tangent, _index_tangent, _back_tangent, _pad_tangent):
        return _EdgePermutation.forward(tangent, ctx.index, ctx.back, ctx.pad)


class BipartiteCSC:
    """A directed bipartite graph ``source -> destination`` in CSC form.

    Attributes:
        indptr: ``[num_dst + 1]`` offsets; the incoming edges of destination ``i`` are the CSC
            positions ``indptr[i]:indptr[i+1]``.
        indices: ``[E]`` source id of each edge, in CSC order.
        num_src, num_dst: node counts of the two sides.
        perm: ``[E]`` original edge id of each CSC position, or ``None`` when CSC order is the
            original order (input already sorted by destination).
        num_input_edges: length of the original edge list, ``>= E``. Usually ``E``; larger when
            the graph leaves some original edges out (:func:`csc_from_edges` drops the input's
            self-loops that way): ``perm`` then holds distinct ids in ``[0, num_input_edges)``,
            :meth:`edge_order` skips the rows of the left-out edges and :meth:`original_order`
            gives them zeros.

    ``indptr``, ``indices`` and ``perm`` share one integer dtype (int32 or int64) and one device.
    The source-grouped reverse index that the backward needs is built once, lazily.
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, num_src: int,
                 perm: Optional[torch.Tensor] = None, *, num_input_edges: Optional[int] = None,
                 validate: bool = True):
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
        num_src = _count(num_src, "num_src")
        if perm is not None:
            _check_index_tensor(perm, "perm")
            if perm.shape != indices.shape or perm.device != indices.device:
                raise ValueError("perm must have the shape and device of indices")
            perm = perm.to(indices.dtype)
        E = indices.numel()
        num_input_edges = E if num_input_edges is None else _count(num_input_edges, "num_input_edges")
        if num_input_edges != E and (perm is None or num_input_edges < E):
            raise ValueError(f"num_input_edges ({num_input_edges}) must equal the number of edges ({E}), "
                             "or exceed it with a perm naming which original edges the graph holds")
        if perm is not None and validate and E:
            # the reorderings gather and scatter with perm: distinct ids within range, or rows
            # would be read out of range or lost
            lo, hi = int(perm.min()), int(perm.max())
            if lo < 0 or hi >= num_input_edges:
                raise IndexError(f"perm (original edge ids) out of range [0, {num_input_edges}): found "
                                 f"{lo if lo < 0 else hi}")
            if torch.unique(perm).numel() != E:
                raise ValueError("perm must hold distinct original edge ids (it has repeats)")
        self.num_input_edges = num_input_edges
        self.indptr = indptr.contiguous()
        self.indices = indices.contiguous()
        self.num_src = num_src
        self.num_dst = indptr.numel() - 1
        self.perm = None if perm is None else perm.contiguous()
        self._reverse: Optional[_ReverseIndex] = None
        self._dst: Optional[torch.Tensor] = None
        self._inv_perm: Optional[torch.Tensor] = None
        self._versions_seen = None if torch.compiler.is_compiling() else self._versions()
        if validate:
            self._validate()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_edge_index(cls, edge_index: torch.Tensor, num_src: Optional[int] = None,
                        num_dst: Optional[int] = None) -> "BipartiteCSC":
        """Build from a ``[2, E]`` edge index (row 0 = source, row 1 = destination, PyG's convention).

        ``num_src``/``num_dst`` default to ``max id + 1`` of each row. Edges are stably sorted by
        destination; an input already sorted needs no permutation. For self-loop handling and
        other index dtypes see :func:`csc_from_edges`.
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
        return csc_from_edges(src, dst, num_src, num_dst, index_dtype=edge_index.dtype)

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

    def _versions(self):
        """The version counters of ``indptr``, ``indices`` and ``perm``, or None where one is an
        inference tensor (which has none)."""
        ts = (self.indptr, self.indices) if self.perm is None else (self.indptr, self.indices, self.perm)
        if any(t.is_inference() for t in ts):
            return None
        return tuple(t._version for t in ts)

    def _drop_stale(self) -> None:
        """Forget the derived indices (destinations, reverse index, inverse permutation) when
        ``indptr``, ``indices`` or ``perm`` changed in place since they were built: a stale
        reverse index gives wrong gradients silently. Inference tensors have no version counter,
        so graphs of them rebuild what they use on every call. (Not while compiling: compiled
        graphs build their own.)"""
        if torch.compiler.is_compiling():
            return
        seen = self._versions()
        if seen is None or seen != self._versions_seen:
            self._dst = self._reverse = self._inv_perm = None
            self._versions_seen = seen

    def __getstate__(self):
        # Copies (pickle, torch.save, copy, deepcopy) do not keep version counters: a loaded
        # tensor starts again at its own count. Keep only derived indices that are current now,
        # and tie them to the copy's counters in __setstate__ (a stale index that happened to
        # match the copy's counters gave wrong gradients silently).
        self._drop_stale()
        state = self.__dict__.copy()
        state["_versions_seen"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        if not torch.compiler.is_compiling():
            self._versions_seen = self._versions()

    def _building(self):
        """The mode to build the cached indices in:
        - normal tensors (not inference ones) for a graph of normal tensors, even under
          ``torch.inference_mode()``: an inference tensor cached by a validation pass could not
          be saved by a later training call's backward;
        - torch.func off: built inside a transform (an ``edge_order`` of logits under
          ``hessian``) they would be its wrapped tensors, and a later call under another
          transform would use escaped ones ("escaped?" internal asserts). Unless the graph's
          own tensors are wrappers (a graph built inside the transform), whose cache dies with it.
        Under torch.compile, traced as they are."""
        stack = contextlib.ExitStack()
        if torch.compiler.is_compiling():
            return stack
        if torch.is_inference_mode_enabled() and self._versions() is not None:
            stack.enter_context(torch.inference_mode(False))
        stack.enter_context(_func_off_unless_wrapped(self.indptr, self.indices, self.perm))
        return stack

    def dst_index(self) -> torch.Tensor:
        """``[E]`` destination id of each edge, in CSC order (built once)."""
        self._drop_stale()
        if self._dst is None:
            with self._building():
                self._dst = csc_destinations(self.indptr, self.num_edges)
        return self._dst

    def reverse_index(self) -> _ReverseIndex:
        """Source-grouped edge lists (built once): ``indptr [num_src+1]``, ``edge [E]``, ``dst [E]``."""
        self._drop_stale()
        if self._reverse is None:
            with self._building():
                self._reverse = self._build_reverse()
        return self._reverse

    def _build_reverse(self) -> _ReverseIndex:
        edge = torch.argsort(self.indices, stable=True)
        # searchsorted over the sorted sources rather than bincount: its output size is
        # static (num_src + 1), so torch.compile can trace it without a graph break.
        indptr = torch.searchsorted(
            self.indices.index_select(0, edge),
            torch.arange(self.num_src + 1, device=self.device, dtype=self.dtype))
        return _ReverseIndex(indptr.to(self.dtype), edge.to(self.dtype).contiguous(),
                             self.dst_index()[edge].contiguous())

    def edge_order(self, values: torch.Tensor) -> torch.Tensor:
        """Reorder a per-edge tensor from the original edge order (``[num_input_edges, ...]``) to
        CSC order (``[E, ...]``), differentiably (the gradient is reordered back by a gather, see
        ``_EdgePermutation``)."""
        self._check_rows(values, self.num_input_edges, "edge_order", "num_input_edges")
        if self.perm is None:
            return values
        if not values.requires_grad or torch.compiler.is_compiling():
            # (Dynamo does not trace an autograd.Function with a custom jvp; compiled graphs
            # differentiate index_select themselves.)
            return values.index_select(0, self.perm)
        return _EdgePermutation.apply(values, self.perm, self._inverse_perm(), False)

    def original_order(self, values: torch.Tensor) -> torch.Tensor:
        """Reorder a per-edge tensor from CSC order back to the original edge order (zeros for
        the original edges the graph leaves out, see ``num_input_edges``)."""
        self._check_rows(values, self.num_edges, "original_order", "num_edges")
        if self.perm is None:
            return values
        if self.num_input_edges != self.num_edges:
            values = _append_zero_row(values)
        return values.index_select(0, self._inverse_perm())

    @staticmethod
    def _check_rows(values, rows: int, method: str, what: str) -> None:
        if not isinstance(values, torch.Tensor) or values.dim() < 1 or values.size(0) != rows:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"{method}: values must have one row per edge ({what} = {rows}), got {got}")

    def _inverse_perm(self) -> torch.Tensor:
        """``[num_input_edges]`` CSC position of each original edge (``perm``'s inverse; ``E``
        for the edges left out), cached."""
        self._drop_stale()
        inv = self._inv_perm
        if inv is None:
            # a scatter (perm's ids are distinct), not an argsort: O(E), and it covers left-out edges
            with self._building():
                inv = torch.full((self.num_input_edges,), self.num_edges, dtype=self.dtype, device=self.device)
                inv.index_put_((self.perm.long(),),
                               torch.arange(self.num_edges, dtype=self.dtype, device=self.device))
            if not torch.compiler.is_compiling():  # a traced tensor must not outlive its trace
                self._inv_perm = inv
        return inv

    def to(self, device) -> "BipartiteCSC":
        """A copy on ``device`` (the reverse index moves along if it was built)."""
        device = torch.device(device)
        if device == self.device:
            return self
        self._drop_stale()
        g = BipartiteCSC(self.indptr.to(device), self.indices.to(device), self.num_src,
                         None if self.perm is None else self.perm.to(device),
                         num_input_edges=self.num_input_edges, validate=False)
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
    def _validate(self, check_indptr: bool = True, check_indices: bool = True) -> None:
        E = self.indices.numel()
        if check_indptr:
            if int(self.indptr[0]) != 0:
                raise ValueError(f"indptr[0] must be 0, got {int(self.indptr[0])}")
            if int(self.indptr[-1]) != E:
                raise ValueError(f"indptr[-1] must equal the number of edges ({E}), got {int(self.indptr[-1])}")
            if self.num_dst and not bool((self.indptr[1:] >= self.indptr[:-1]).all()):
                raise ValueError("indptr must be non-decreasing (monotone)")
        if E and check_indices:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0 or hi >= self.num_src:
                bad = lo if lo < 0 else hi
                raise IndexError(f"indices (source ids) out of range [0, {self.num_src}): found {bad}")
        if self.indices.dtype == torch.int32 and E >= 2**31:
            raise ValueError("int32 indices cannot address 2^31 or more edges; use int64")


# ---------------------------------------------------------------------------- edge lists -> CSC
def check_edge_range(src: torch.Tensor, dst: torch.Tensor, num_src: int, num_dst: int) -> None:
    """Out-of-range ids would make the kernels read out of bounds: refuse them (``IndexError``
    naming the row of ``edge_index``). Under ``torch.compile`` an asynchronous device assert
    (no data-dependent Python branch)."""
    if src.numel() == 0:
        return
    if torch.compiler.is_compiling():
        torch._assert_async(((src >= 0) & (src < num_src) & (dst >= 0) & (dst < num_dst)).all(),
                            "edge_index has node ids out of range")
        return
    lo, hi = int(src.min()), int(src.max())
    if lo < 0 or hi >= num_src:
        raise IndexError(f"edge_index[0] (source ids, the CSC indices) out of range [0, {num_src}): "
                         f"found {lo if lo < 0 else hi}")
    lo, hi = int(dst.min()), int(dst.max())
    if lo < 0 or hi >= num_dst:
        raise IndexError(f"edge_index[1] (destinations) out of range [0, {num_dst}): found {lo if lo < 0 else hi}")


def csc_from_edges(src: torch.Tensor, dst: torch.Tensor, num_src: int, num_dst: int, *,
                   self_loops: Optional[int] = None, dst_sorted: Optional[bool] = None,
                   static_shapes: Optional[bool] = None,
                   index_dtype: Optional[torch.dtype] = None) -> BipartiteCSC:
    """The CSC graph of the edges ``src[e] -> dst[e]``, optionally with PyG's self-loop handling.

    Args:
        src, dst: ``[E]`` integer source / destination ids, in the input edge order.
        num_src, num_dst: node counts (ids are range-checked against them).
        self_loops: ``None`` keeps the edges as they are. ``L`` drops the input's self-loops and
            adds ``(i, i)`` for ``i < L``, as PyG's ``remove_self_loops`` then
            ``add_self_loops(num_nodes=L)``. The dropped loops are left out of the graph
            (``graph.num_input_edges`` still counts them: per-edge tensors in processed order
            keep their rows, see :class:`BipartiteCSC`). With ``static_shapes`` they are instead
            routed to one extra "trash" destination row ``num_dst``, always present
            (``graph.num_dst == num_dst + 1``), that the caller drops after aggregation: they
            take no part in any real destination's softmax and, since the trash row's gradient
            is zero, contribute exactly zero to every gradient, and every shape stays
            independent of the data. Their attention weights (``return_attention``) are a
            softmax over the trash row, not zero: drop them with it, as the layers do.
        dst_sorted: ``True`` if ``dst`` is known to be non-decreasing (no sort), ``None`` to check
            (except with ``static_shapes``, which sorts).
        static_shapes: only ops whose output shapes depend on input shapes, never on values
            (what ``torch.compile(fullgraph=True)`` can trace); default: when compiling.
        index_dtype: dtype of the graph's index tensors; default int32 when every id and count
            fits, else int64 (int32 halves the graph and the kernels' index traffic).

    Returns:
        A :class:`BipartiteCSC` whose ``perm`` maps CSC positions to *processed* edge ids
        (``num_input_edges`` of them): ``0 .. E-1`` the input edges in input order (the dropped
        self-loops' ids held by no position, or by the trash row's), ``E .. E+L-1`` the added
        loops ``(i, i)``; None when CSC order is that order.
    """
    static = torch.compiler.is_compiling() if static_shapes is None else bool(static_shapes)
    num_src, num_dst = _count(num_src, "num_src"), _count(num_dst, "num_dst")
    _check_index_tensor(src, "src", any_integer=True)
    _check_index_tensor(dst, "dst", any_integer=True)
    if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
        raise ValueError(f"src and dst must be 1-D with one entry per edge, got shapes {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if src.device != dst.device:
        raise ValueError(f"src ({src.device}) and dst ({dst.device}) must be on one device")
    if self_loops is not None:  # (no int(): a dynamic size stays symbolic)
        self_loops = _count(self_loops, "self_loops")
    device = src.device
    src, dst = src.long(), dst.long()
    E = src.numel()
    check_edge_range(src, dst, num_src, num_dst)
    if dst_sorted is None:
        dst_sorted = not static and (E < 2 or bool((dst[1:] >= dst[:-1]).all()))
    if dst_sorted:
        order: Optional[torch.Tensor] = None
        s, d = src, dst
    else:
        order = torch.argsort(dst, stable=True)
        s, d = src.index_select(0, order), dst.index_select(0, order)

    if self_loops is None:
        counts = torch.zeros(num_dst, dtype=torch.long, device=device).index_add_(0, d, torch.ones_like(d))
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        indices, perm, num_rows, dst_of, num_input_edges = s, order, num_dst, d, E
    else:
        L = self_loops
        if L > num_dst or L > num_src:
            raise ValueError(f"cannot add {L} self-loops to a {num_src} x {num_dst} graph")
        ids = torch.arange(E, device=device) if order is None else order  # processed id per sorted edge
        is_loop = s == d
        not_loop = ~is_loop
        keep = not_loop.long()
        kept_counts = torch.zeros(num_dst, dtype=torch.long, device=device).index_add_(0, d, keep)
        kept_ptr = torch.cat([kept_counts.new_zeros(1), kept_counts.cumsum(0)])  # [num_dst + 1]
        # A destination's segment holds its kept edges (input order) then its added loop, so a
        # kept edge with destination d moves by the min(d, L) loops of the earlier segments.
        kept_rank = keep.cumsum(0) - keep
        pos = kept_rank + d.clamp(max=L)
        if static:  # the input's loops go to the trash row, after every real segment
            loop_rank = (1 - keep).cumsum(0) - (1 - keep)
            pos = torch.where(is_loop, kept_ptr[-1] + L + loop_rank, pos)
            total = E + L
        else:  # left out (an empty selection when there are none)
            pos, s, ids = pos[not_loop], s[not_loop], ids[not_loop]
            total = s.numel() + L
        loop_ids = torch.arange(L, device=device)
        loop_pos = kept_ptr[1:L + 1] + loop_ids
        indices = torch.empty(total, dtype=torch.long, device=device)
        indices.index_put_((pos,), s).index_put_((loop_pos,), loop_ids)
        perm = torch.empty(total, dtype=torch.long, device=device)
        perm.index_put_((pos,), ids).index_put_((loop_pos,), loop_ids + E)
        indptr = kept_ptr + torch.arange(num_dst + 1, device=device).clamp(max=L)
        num_rows, dst_of, num_input_edges = num_dst, None, E + L
        if static:
            indptr = torch.cat([indptr, kept_ptr.new_full((1,), total)])
            num_rows = num_dst + 1

    if index_dtype is None:
        small = indices.numel() < 2**31 and max(num_src, num_rows) < 2**31
        index_dtype = torch.int32 if small else torch.int64
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
    if index_dtype == torch.int32 and max(indices.numel(), num_src, num_rows) >= 2**31:
        raise ValueError("int32 indices cannot address 2^31 or more edges or nodes; use int64")
    cast = lambda t: None if t is None else t.to(index_dtype)  # noqa: E731
    graph = BipartiteCSC(cast(indptr), cast(indices).contiguous(), num_src, cast(perm),
                         num_input_edges=num_input_edges, validate=False)
    graph._validate(check_indptr=False, check_indices=False)  # built here: only the dtype limits
    if dst_of is not None:
        graph._dst = cast(dst_of).contiguous()
    return graph
