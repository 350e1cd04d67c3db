"""Per-edge maps evaluated in chunks of edges and recomputed for their derivatives.

Some higher-order paths (GATv2's double backward, ``torch.func.grad``/``jacrev``/``hessian``)
need functions of the edges whose intermediates are ``[E, H, C]``. :class:`EdgeMap` applies such
a function to one chunk of edges at a time and keeps only its inputs: its backward and forward
derivatives recompute each chunk under ``torch.func.vjp`` (exact at every order, under vmap and
any nesting torch.func allows), so a pass through it holds one chunk's intermediates at a
time. A pass that is itself recorded for a further derivative (a third derivative of the
original function) keeps what it recomputed, every chunk's. Chunks are ranges of whole nodes in
a traversal order of the edges (CSC, or grouped by source), so a per-node sum over a chunk's
edges is a block of rows.

(``torch.utils.checkpoint`` does the same for plain autograd, but torch.func refuses the saved
tensor hooks it relies on.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ._segments import gather_rows, index_add_rows

__all__ = ["EdgeChunks", "EdgeMapSpec", "EdgeMap", "chunk_size", "node_ranges"]

# A chunk's [chunk, H, C] temporaries hold about E x H elements, and at least this many, so that
# small graphs take one or a few chunks (each chunk costs a few Python-level op calls).
_MIN_CHUNK_ELEMENTS = 1 << 18


def chunk_size(num_edges: int, heads: int, channels: int) -> int:
    """Edges per chunk for ``[chunk, heads, channels]`` temporaries: about ``E x heads``
    elements each (``E / channels`` edges), at least ``2^18`` elements."""
    return max(1, num_edges // max(channels, 1), _MIN_CHUNK_ELEMENTS // max(heads * channels, 1))


def node_ranges(ptr: torch.Tensor, step: int) -> Tuple[Tuple[int, int, int, int], ...]:
    """Split the segments of ``ptr [N + 1]`` (edges ``ptr[n]..ptr[n+1]`` belong to node ``n``)
    into ranges of whole nodes of about ``step`` edges (more where one node has more):
    ``((node0, node1, edge0, edge1), ...)`` covering every node and every edge in order."""
    num_nodes = ptr.numel() - 1
    num_edges = int(ptr[-1]) if num_nodes >= 0 else 0
    if num_edges <= step or num_nodes <= 1:
        return ((0, max(num_nodes, 0), 0, num_edges),)
    targets = torch.arange(step, num_edges, step, dtype=ptr.dtype, device=ptr.device)
    cuts = torch.searchsorted(ptr, targets)  # the first node starting at or after each target
    nodes = sorted({0, num_nodes, *cuts.clamp(max=num_nodes).tolist()})
    starts = ptr[torch.tensor(nodes, device=ptr.device)].tolist()
    return tuple((n0, n1, e0, e1) for n0, n1, e0, e1 in zip(nodes, nodes[1:], starts, starts[1:]))


# (Dataclasses, not NamedTuples: torch.func flattens a Function's arguments as pytrees.)
@dataclass(frozen=True)
class EdgeChunks:
    """Chunks of edges: ``ranges`` from :func:`node_ranges` over a traversal of the edges in
    which position ``r`` holds CSC position ``order[r]`` (``order`` None: CSC order itself)."""
    order: Optional[torch.Tensor]
    ranges: Tuple[Tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class EdgeMapSpec:
    """What :class:`EdgeMap` computes.

    ``fn(node0, node1, edge0, edge1, edge_inputs, node_inputs)`` maps one chunk to a tuple of
    ``num_edge_out`` per-edge outputs ``[edge1 - edge0, ...]`` (traversal order), then
    ``num_row_out`` per-node outputs ``[node1 - node0, ...]``, then whole-graph sums. It gets
    the first ``num_edge_in`` inputs (``[E, ...]`` in CSC order, or None) sliced to the chunk in
    traversal order; the others whole, or, where ``gathers[j]`` (for the j-th of them) is an
    ``[E]`` index in traversal order, their rows at the chunk's entries of it. Derivatives for
    gathered inputs are taken for the rows and summed into the input by
    :func:`~torch_gradops._segments.index_add_rows` (deterministic, no atomics), so a chunk
    never allocates a whole input's gradient. ``vjp(inputs, grads, needs)``, if given,
    replaces the recomputation in backward (it must itself be differentiable)."""
    fn: Callable
    chunks: EdgeChunks
    num_edge_in: int
    num_edge_out: int
    num_row_out: int
    gathers: Tuple[Optional[torch.Tensor], ...] = ()
    vjp: Optional[Callable] = None

    def gather(self, j: int) -> Optional[torch.Tensor]:
        return self.gathers[j] if j < len(self.gathers) else None


class _RowSink:
    """Chunks' row blocks written into one ``[total, ...]`` tensor as they come: rows
    ``b0..b1`` of a chunk go to ``order[b0:b1]`` (``order`` None: to ``b0..b1``), so that the
    parts are never all alive beside their concatenation. In place where torch allows (not
    into an unbatched buffer under vmap; there a copy per chunk)."""

    def __init__(self, total: int, order: Optional[torch.Tensor] = None):
        self.total, self.order, self.out = total, order, None

    def add(self, b0: int, b1: int, part: torch.Tensor) -> None:
        if self.out is None:
            self.out = part.new_zeros((self.total,) + tuple(part.shape[1:]))
        pos = self.order[b0:b1] if self.order is not None else None
        try:
            if pos is None:
                self.out.narrow(0, b0, b1 - b0).copy_(part)
            else:
                self.out.index_copy_(0, pos, part)
        except RuntimeError:
            if pos is None:
                pos = torch.arange(b0, b1, device=part.device)
            self.out = self.out.index_copy(0, pos, part)


class _Assembler:
    """The chunks' outputs joined (see :class:`EdgeMapSpec`): per-edge ones back in CSC order
    and per-node row blocks through :class:`_RowSink`, sums added in chunk order."""

    def __init__(self, spec: EdgeMapSpec):
        self.spec = spec
        _, num_nodes, _, num_edges = spec.chunks.ranges[-1]
        self.sinks = [_RowSink(num_edges, spec.chunks.order) for _ in range(spec.num_edge_out)] + \
                     [_RowSink(num_nodes) for _ in range(spec.num_row_out)]
        self.sums: Optional[List[torch.Tensor]] = None

    def add(self, chunk, outs: Sequence[torch.Tensor]) -> None:
        n0, n1, e0, e1 = chunk
        for k, o in enumerate(outs[:len(self.sinks)]):
            b0, b1 = (e0, e1) if k < self.spec.num_edge_out else (n0, n1)
            self.sinks[k].add(b0, b1, o)
        rest = list(outs[len(self.sinks):])
        self.sums = rest if self.sums is None else [a + b for a, b in zip(self.sums, rest)]

    def result(self) -> Tuple[torch.Tensor, ...]:
        return tuple(k.out for k in self.sinks) + tuple(self.sums or ())


def _edge_slice(t: Optional[torch.Tensor], order: Optional[torch.Tensor], e0: int, e1: int):
    """Traversal positions ``e0..e1`` of a per-edge tensor in CSC order (a gather of the
    chunk's rows, never a permuted copy of the whole tensor)."""
    if t is None:
        return None
    return t[e0:e1] if order is None else t.index_select(0, order[e0:e1])


def _chunk_inputs(spec: EdgeMapSpec, inputs: Sequence[Optional[torch.Tensor]], chunk):
    """What ``fn`` gets for one chunk: edge inputs' rows, node inputs whole or gathered."""
    _, _, e0, e1 = chunk
    nodes = []
    for j, t in enumerate(inputs[spec.num_edge_in:]):
        idx = spec.gather(j)
        nodes.append(t if t is None or idx is None else gather_rows(t, idx[e0:e1]))
    return [_edge_slice(t, spec.chunks.order, e0, e1) for t in inputs[:spec.num_edge_in]] + nodes


def _bind(spec: EdgeMapSpec, chunk, values: List, diff: List[int]):
    """``fn`` on one chunk as a function of the inputs ``diff`` (the rest fixed to ``values``)."""
    def f(*dv):
        v = list(values)
        for i, x in zip(diff, dv):
            v[i] = x
        return tuple(spec.fn(*chunk, v[:spec.num_edge_in], v[spec.num_edge_in:]))
    return f


class EdgeMap(torch.autograd.Function):
    """``EdgeMap.apply(spec, *inputs)``: :class:`EdgeMapSpec` ``spec.fn`` over its chunks, the
    outputs assembled (a tuple). Saves only the inputs; derivatives recompute chunk by chunk."""

    generate_vmap_rule = True

    @staticmethod
    def forward(spec: EdgeMapSpec, *inputs):
        out = _Assembler(spec)
        for chunk in spec.chunks.ranges:
            out.add(chunk, _bind(spec, chunk, _chunk_inputs(spec, inputs, chunk), [])())
        return out.result()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.spec = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def backward(ctx, *grads):
        spec, inputs = ctx.spec, ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        if spec.vjp is not None:
            return (None, *spec.vjp(inputs, grads, needs))
        diff = [i for i, (t, n) in enumerate(zip(inputs, needs)) if n and t is not None]
        order, ne = spec.chunks.order, spec.num_edge_in
        edge_grads = grads[:spec.num_edge_out]
        row_grads = grads[spec.num_edge_out:spec.num_edge_out + spec.num_row_out]
        sum_grads = tuple(grads[spec.num_edge_out + spec.num_row_out:])
        num_edges = spec.chunks.ranges[-1][3]
        edge_sinks = {k: _RowSink(num_edges, order) for k, i in enumerate(diff) if i < ne}
        # node inputs: summed as the chunks come, gathered ones by index_add_rows of their rows' grads
        totals: List[Optional[torch.Tensor]] = [None] * len(diff)
        for chunk in spec.chunks.ranges:
            n0, n1, e0, e1 = chunk
            values = _chunk_inputs(spec, inputs, chunk)
            _, vjp_fn = torch.func.vjp(_bind(spec, chunk, values, diff), *[values[i] for i in diff])
            cts = tuple(_edge_slice(g, order, e0, e1) for g in edge_grads) + \
                tuple(g[n0:n1] for g in row_grads) + sum_grads
            for k, g in enumerate(vjp_fn(cts)):
                i = diff[k]
                idx = spec.gather(i - ne) if i >= ne else None
                if i < ne:
                    edge_sinks[k].add(e0, e1, g)
                elif idx is not None:
                    # (zeros made from g: batched under vmap when g is, so the sum stays in place)
                    total = g.new_zeros(inputs[i].shape) if totals[k] is None else totals[k]
                    totals[k] = index_add_rows(total, idx[e0:e1], g)
                else:
                    totals[k] = g if totals[k] is None else totals[k] + g
            del vjp_fn  # this chunk's intermediates go before the next chunk's are made
        result: List[Optional[torch.Tensor]] = [None] * len(inputs)
        for k, i in enumerate(diff):
            result[i] = edge_sinks[k].out if i < ne else totals[k]
        return (None, *result)

    @staticmethod
    def jvp(ctx, _, *tangents):
        # J t as the vector-Jacobian product of u -> J^T u (linear in u): reverse over reverse,
        # since torch.func.jvp inside a Function's jvp would nest forward levels, which torch
        # refuses under plain forward AD.
        spec, inputs = ctx.spec, ctx.saved_tensors
        diff = [i for i, (t, tt) in enumerate(zip(inputs, tangents)) if t is not None and tt is not None]
        out = _Assembler(spec)
        for chunk in spec.chunks.ranges:
            values = _chunk_inputs(spec, inputs, chunk)
            tans = _chunk_inputs(spec, tangents, chunk)
            f = _bind(spec, chunk, values, diff)
            primals = [values[i] for i in diff]
            zeros = tuple(torch.zeros_like(o) for o in f(*primals))

            def transpose(u, f=f, primals=primals):
                return torch.func.vjp(f, *primals)[1](u)
            out.add(chunk, torch.func.vjp(transpose, zeros)[1](tuple(tans[i] for i in diff))[0])
        return out.result()
