"""Per-edge maps evaluated in chunks of edges and recomputed for their derivatives.

Some higher-order paths (GATv2's double backward, ``torch.func.grad``/``jacrev``/``hessian``)
need functions of the edges whose intermediates are ``[E, H, C]``. :class:`EdgeMap` applies such
a function to one chunk of edges at a time and keeps only its inputs: its backward and forward
derivatives recompute each chunk under ``torch.func.vjp``, so no more than one chunk's
intermediates are alive at once, at every order (reverse, forward, vmap, and any nesting of
them that torch.func allows). Chunks are ranges of whole nodes in a traversal order of the
edges (CSC, or grouped by source), so a per-node sum over a chunk's edges is a block of rows.

(``torch.utils.checkpoint`` does the same for plain autograd, but torch.func refuses the saved
tensor hooks it relies on.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["EdgeChunks", "EdgeMapSpec", "EdgeMap", "chunk_size", "node_ranges", "plain_tensor"]

# A chunk's [chunk, H, C] temporaries hold about E x H elements, and at least this many, so that
# small graphs take one or a few chunks (each chunk costs a few Python-level op calls).
_MIN_CHUNK_ELEMENTS = 1 << 18


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torch.func wrappers: for index tensors, which carry no tangents or batch
    dimensions, so that closures can use them at any transform level."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


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
    gathered inputs are taken for the rows and summed into the input with ``index_add``, so a
    chunk never allocates a whole input's gradient. ``vjp(inputs, grads, needs)``, if given,
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


def _to_traversal(t: Optional[torch.Tensor], order: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or order is None else t.index_select(0, order)


def _from_traversal(t: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    return t if order is None else t.new_empty(t.shape).index_copy(0, order, t)


def _assemble(spec: EdgeMapSpec, per_chunk: List[Sequence[torch.Tensor]]) -> Tuple[torch.Tensor, ...]:
    """The chunks' outputs joined: per-edge and per-node parts concatenated (per-edge ones back
    in CSC order), sums added in chunk order."""
    n_cat = spec.num_edge_out + spec.num_row_out
    out = []
    for k in range(len(per_chunk[0])):
        parts = [c[k] for c in per_chunk]
        if k < n_cat:
            joined = torch.cat(parts) if len(parts) > 1 else parts[0]
            out.append(_from_traversal(joined, spec.chunks.order) if k < spec.num_edge_out else joined)
        else:
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            out.append(total)
    return tuple(out)


def _chunk_inputs(spec: EdgeMapSpec, inputs: Sequence[Optional[torch.Tensor]], edge_in, chunk):
    """What ``fn`` gets for one chunk: edge inputs sliced, node inputs whole or gathered."""
    _, _, e0, e1 = chunk
    nodes = []
    for j, t in enumerate(inputs[spec.num_edge_in:]):
        idx = spec.gather(j)
        nodes.append(t if t is None or idx is None else t.index_select(0, idx[e0:e1]))
    return [None if t is None else t[e0:e1] for t in edge_in] + nodes


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
        edge_in = [_to_traversal(t, spec.chunks.order) for t in inputs[:spec.num_edge_in]]
        per_chunk = [_bind(spec, chunk, _chunk_inputs(spec, inputs, edge_in, chunk), [])()
                     for chunk in spec.chunks.ranges]
        return _assemble(spec, per_chunk)

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
        edge_in = [_to_traversal(t, order) for t in inputs[:ne]]
        edge_grads = [_to_traversal(g, order) for g in grads[:spec.num_edge_out]]
        row_grads = grads[spec.num_edge_out:spec.num_edge_out + spec.num_row_out]
        sum_grads = tuple(grads[spec.num_edge_out + spec.num_row_out:])
        edge_parts: List[List[torch.Tensor]] = [[] for _ in diff]
        # node inputs: summed as the chunks come; gathered ones by index_add of their rows' grads
        # (out of place: under vmap, including gradcheck's batched checks, where Python cannot
        # tell, an unbatched sum cannot take batched rows in place)
        totals: List[Optional[torch.Tensor]] = [None] * len(diff)
        for chunk in spec.chunks.ranges:
            n0, n1, e0, e1 = chunk
            values = _chunk_inputs(spec, inputs, edge_in, chunk)
            _, vjp_fn = torch.func.vjp(_bind(spec, chunk, values, diff), *[values[i] for i in diff])
            cts = tuple(g[e0:e1] for g in edge_grads) + tuple(g[n0:n1] for g in row_grads) + sum_grads
            for k, g in enumerate(vjp_fn(cts)):
                i = diff[k]
                idx = spec.gather(i - ne) if i >= ne else None
                if i < ne:
                    edge_parts[k].append(g)
                elif idx is not None:
                    total = torch.zeros_like(inputs[i]) if totals[k] is None else totals[k]
                    totals[k] = total.index_add(0, idx[e0:e1], g)
                else:
                    totals[k] = g if totals[k] is None else totals[k] + g
        result: List[Optional[torch.Tensor]] = [None] * len(inputs)
        for k, i in enumerate(diff):
            parts = edge_parts[k]
            result[i] = _from_traversal(torch.cat(parts) if len(parts) > 1 else parts[0], order) if i < ne \
                else totals[k]
        return (None, *result)

    @staticmethod
    def jvp(ctx, _, *tangents):
        # J t as the vector-Jacobian product of u -> J^T u (linear in u): reverse over reverse,
        # since torch.func.jvp inside a Function's jvp would nest forward levels, which torch
        # refuses under plain forward AD.
        spec, inputs = ctx.spec, ctx.saved_tensors
        order, ne = spec.chunks.order, spec.num_edge_in
        diff = [i for i, (t, tt) in enumerate(zip(inputs, tangents)) if t is not None and tt is not None]
        edge_in = [_to_traversal(t, order) for t in inputs[:ne]]
        edge_tan = [_to_traversal(t, order) for t in tangents[:ne]]
        per_chunk = []
        for chunk in spec.chunks.ranges:
            values = _chunk_inputs(spec, inputs, edge_in, chunk)
            tans = _chunk_inputs(spec, tangents, edge_tan, chunk)
            f = _bind(spec, chunk, values, diff)
            primals = [values[i] for i in diff]
            zeros = tuple(torch.zeros_like(o) for o in f(*primals))

            def transpose(u, f=f, primals=primals):
                return torch.func.vjp(f, *primals)[1](u)
            per_chunk.append(torch.func.vjp(transpose, zeros)[1](tuple(tans[i] for i in diff))[0])
        return _assemble(spec, per_chunk)
