"""Fused graph attention (GAT) on a :class:`~torch_gradops.BipartiteCSC` graph.

The forward kernel makes one pass over each destination's incoming edges with an online
softmax and saves only the per-(destination, head) log-sum-exp; the backward recomputes the
attention from it and sums without atomics, so gradients are bitwise reproducible. Nothing of
size ``E x heads x channels`` is allocated on these paths:

* first-order backward (``.backward()``, ``autograd.grad`` without ``create_graph``): the fused
  backward kernel;
* double backward (``create_graph=True``, ``torch.func.grad``/``jacrev``/``hessian``) and
  forward-mode AD (``torch.func.jvp``/``jacfwd``, dual tensors): the same math written with two
  fused primitives, edge-weighted aggregation (SpMM, :func:`edge_aggregate`) and per-edge dot
  products (SDDMM, :func:`edge_dot`), plus ``E x H`` elementwise ops. The primitives'
  derivatives are the primitives again, so every order is exact with ``O(E x H)`` extra memory;
* ``torch.vmap``: the vmapped dimension is folded into the heads (``[B, N, H, C] -> [N, B*H, C]``)
  and every kernel runs once for the whole batch (vmap rules on the ops).

Two cases run as plain PyTorch ops instead (``E x H x C``; see :mod:`._transforms`): nested
forward mode (``jacfwd(jacfwd(f))``, where torch.func would drop the second-order terms of a
custom ``jvp``) and reverse-mode torch.func transforms inside ``torch.compile``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._transforms import COMPOSITE, FUSED_JVP, has_tangent, join_dual, route, split_duals
from .library import check_backend, ops
from .graph import BipartiteCSC, as_index, csc_destinations

__all__ = ["gat_attention", "GATAttentionFunction", "mha_gat_n2n", "edge_aggregate", "edge_dot"]

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types accumulate (and keep the log-sum-exp) in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------------------- fake kernels
@torch.library.register_fake("torch_gradops::gat_forward")
def _gat_forward_fake(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask,
                      negative_slope, dropout_scale, return_alpha):
    num_dst, heads, channels = a_dst.size(0), x_src.size(1), x_src.size(2)
    out = x_src.new_empty((num_dst, heads, channels))
    lse = x_src.new_empty((num_dst, heads), dtype=torch.float64)  # float64 for every dtype (csrc/gat.h)
    alpha = a_src.new_empty((indices.size(0) if return_alpha else 0, heads))
    return out, lse, alpha


@torch.library.register_fake("torch_gradops::gat_backward")
def _gat_backward_fake(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, indptr,
                       indices, rev_indptr, rev_edge, rev_dst, dropout_mask, negative_slope,
                       dropout_scale, output_mask):
    def maybe(flag, like):
        # contiguous whatever the input's strides, as the kernels return them
        return like.new_empty(like.shape) if flag else like.new_empty((0,))
    # as the kernels: no edge_logits, no gradient for them (an empty tensor) whatever the mask
    grad_el = (a_src.new_empty((indices.size(0), x_src.size(1))) if output_mask[3] and edge_logits is not None
               else a_src.new_empty((0,)))
    return (maybe(output_mask[0], x_src), maybe(output_mask[1], a_src),
            maybe(output_mask[2], a_dst), grad_el)


@torch.library.register_fake("torch_gradops::gat_spmm")
def _gat_spmm_fake(weight, values, indptr, neighbors, edge_ids):
    return values.new_empty((indptr.size(0) - 1, values.size(1), values.size(2)))


@torch.library.register_fake("torch_gradops::gat_sddmm")
def _gat_sddmm_fake(a, b, indptr, indices):
    return a.new_empty((indices.size(0), a.size(1)))


# ---------------------------------------------------------------------------- vmap rules
# Every tensor argument of the ops is laid out [rows, heads, ...] and heads are independent, so
# a vmapped dimension folds into the heads: [B, rows, H, ...] -> [rows, B*H, ...] (an input
# shared by the batch is expanded), one kernel call serves the batch, and the outputs unfold.
# The graph's index tensors cannot fold: vmapped over (a different graph per item), the op runs
# once per batch item.

def _fold_heads(t: torch.Tensor, bdim: Optional[int], batch: int) -> torch.Tensor:
    if bdim is None:
        t = t.unsqueeze(1).expand(t.size(0), batch, *t.shape[1:])
    else:
        t = t.movedim(bdim, 1)
    return t.reshape(t.size(0), batch * t.size(2), *t.shape[3:])


def _unfold_heads(t: torch.Tensor, batch: int) -> torch.Tensor:
    # A copy, not a view: the ops run inside autograd Functions, and a Function's view outputs
    # may not be modified in place (GATConv adds its bias in place when nothing records).
    return t.view(t.size(0), batch, t.size(1) // batch, *t.shape[2:]).clone()


def _vmap_per_item(op, batch, in_dims, args):
    results = [op(*[a if d is None else a.select(d, b) for a, d in zip(args, in_dims)]) for b in range(batch)]
    if isinstance(results[0], torch.Tensor):
        return torch.stack(results), 0
    return tuple(torch.stack(r) for r in zip(*results)), (0,) * len(results[0])


def _register_head_folding_vmap(name: str, graph_args: Tuple[int, ...]) -> None:
    op = getattr(ops, name).default

    def rule(info, in_dims, *args):
        batch = info.batch_size
        if any(in_dims[i] is not None for i in graph_args):
            return _vmap_per_item(op, batch, in_dims, args)
        folded = [_fold_heads(a, d, batch) if isinstance(a, torch.Tensor) and i not in graph_args else a
                  for i, (a, d) in enumerate(zip(args, in_dims))]
        out = op(*folded)
        if isinstance(out, torch.Tensor):
            return _unfold_heads(out, batch), 1
        # gat_backward's skipped gradients are 1-D empty placeholders, shared by the batch.
        return (tuple(o if o.dim() < 2 else _unfold_heads(o, batch) for o in out),
                tuple(None if o.dim() < 2 else 1 for o in out))

    torch.library.register_vmap(f"torch_gradops::{name}", rule)


_register_head_folding_vmap("gat_forward", (4, 5))
_register_head_folding_vmap("gat_backward", (8, 9, 10, 11, 12))
_register_head_folding_vmap("gat_spmm", (2, 3, 4))
_register_head_folding_vmap("gat_sddmm", (2, 3))


# ---------------------------------------------------------------------------- fused primitives
def _prepare_graph(graph: BipartiteCSC, reverse: bool, inverse: bool):
    """Build the graph's lazily cached index tensors that this call needs (the reverse index if
    ``reverse``, the inverse edge permutation if ``inverse``) now; return the reverse index (or
    None). (The graph builds them with torch.func off, see ``BipartiteCSC._building``.)"""
    if inverse and graph.perm is not None:
        graph.original_order(graph.indices.new_empty((graph.num_edges, 0)))  # caches the inverse
    return graph.reverse_index() if reverse else None


class _Edges(NamedTuple):
    """The index tensors the primitives walk: CSC (``indptr``, ``indices``: source per position,
    ``dst``: destination per position) and the source-grouped reverse index (None when no
    reverse-mode gradient was wanted)."""
    indptr: torch.Tensor
    indices: torch.Tensor
    dst: torch.Tensor  # destination of each CSC position
    rev_indptr: Optional[torch.Tensor]
    rev_edge: Optional[torch.Tensor]
    rev_dst: Optional[torch.Tensor]
    num_src: int

    @property
    def num_dst(self) -> int:
        return self.indptr.numel() - 1

    @staticmethod
    def of(graph: BipartiteCSC) -> "_Edges":
        rev = _prepare_graph(graph, reverse=True, inverse=True)
        return _Edges(graph.indptr, graph.indices, graph.dst_index(), rev.indptr, rev.edge, rev.dst,
                      graph.num_src)

    @staticmethod
    def of_csc(indptr, indices, rev_indptr, rev_edge, rev_dst, num_src) -> "_Edges":
        return _Edges(indptr, indices, csc_destinations(indptr, indices.numel()), rev_indptr, rev_edge,
                      rev_dst, num_src)


def _need_reverse(rev_indptr) -> None:
    if rev_indptr is None:
        raise RuntimeError("torch_gradops GAT: a gradient that sums over each source's edges is needed, "
                           "but the reverse index was not passed (call gat_attention(), which builds it "
                           "when an input requires grad or carries a forward-mode tangent)")


class _EdgeAggregate(torch.autograd.Function):
    """SpMM: ``out[n,h,:] = sum over the edges e of node n of weight[e,h] * values[m,h,:]``, with
    ``m`` the other end of ``e``; into destinations (``into_dst``, walking CSC) or into sources
    (walking the reverse index). ``weight [E, H]`` in CSC order, ``values [N_other, H, C]``.

    d/d weight is :class:`_EdgeDot`, d/d values the aggregation the other way."""
    generate_vmap_rule = True

    @staticmethod
    def forward(weight, values, into_dst, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src):
        if into_dst:
            return ops.gat_spmm(weight, values, indptr, indices, None)
        _need_reverse(rev_indptr)
        return ops.gat_spmm(weight, values, rev_indptr, rev_dst, rev_edge)

    @staticmethod
    def setup_context(ctx, inputs, output):
        weight, values, into_dst, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src = inputs
        ctx.into_dst = into_dst
        ctx.num_src = num_src
        # (Not trimmed by needs_input_grad: under torch.func transforms setup_context runs per
        # level and a trimmed save came back None where a gradient was wanted.)
        ctx.save_for_backward(weight, values, indptr, indices, dst, rev_indptr, rev_edge, rev_dst)
        ctx.save_for_forward(weight, values, indptr, indices, dst, rev_indptr, rev_edge, rev_dst)

    @staticmethod
    def backward(ctx, grad):
        weight, values, *index = ctx.saved_tensors
        edges = _Edges(*index, ctx.num_src)
        grad_weight = grad_values = None
        if ctx.needs_input_grad[0]:
            # into dst: <grad[dst e], values[src e]>; into src: <values[dst e], grad[src e]>
            grad_weight = (_edge_dot(grad, values, edges) if ctx.into_dst
                           else _edge_dot(values, grad, edges))
        if ctx.needs_input_grad[1]:
            grad_values = _edge_aggregate(weight, grad, edges, not ctx.into_dst)
        return (grad_weight, grad_values) + (None,) * 8

    @staticmethod
    def jvp(ctx, t_weight, t_values, *_):
        weight, values, *index = ctx.saved_tensors
        edges = _Edges(*index, ctx.num_src)
        t_out = None if t_weight is None else _edge_aggregate(t_weight, values, edges, ctx.into_dst)
        if t_values is not None:
            t = _edge_aggregate(weight, t_values, edges, ctx.into_dst)
            t_out = t if t_out is None else t_out + t
        return t_out


class _EdgeDot(torch.autograd.Function):
    """SDDMM: ``out[e,h] = <a[dst e,h,:], b[src e,h,:]>`` in CSC order; ``a [num_dst, H, C]``,
    ``b [num_src, H, C]``. d/d a and d/d b are :class:`_EdgeAggregate` into each side."""
    generate_vmap_rule = True

    @staticmethod
    def forward(a, b, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src):
        return ops.gat_sddmm(a, b, indptr, indices)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src = inputs
        ctx.num_src = num_src
        ctx.save_for_backward(a, b, indptr, indices, dst, rev_indptr, rev_edge, rev_dst)
        ctx.save_for_forward(a, b, indptr, indices, dst, rev_indptr, rev_edge, rev_dst)

    @staticmethod
    def backward(ctx, grad):
        a, b, *index = ctx.saved_tensors
        edges = _Edges(*index, ctx.num_src)
        grad_a = _edge_aggregate(grad, b, edges, True) if ctx.needs_input_grad[0] else None
        grad_b = _edge_aggregate(grad, a, edges, False) if ctx.needs_input_grad[1] else None
        return (grad_a, grad_b) + (None,) * 7

    @staticmethod
    def jvp(ctx, t_a, t_b, *_):
        a, b, *index = ctx.saved_tensors
        edges = _Edges(*index, ctx.num_src)
        t_out = None if t_a is None else _edge_dot(t_a, b, edges)
        if t_b is not None:
            t = _edge_dot(a, t_b, edges)
            t_out = t if t_out is None else t_out + t
        return t_out


def _edge_aggregate(weight, values, edges: _Edges, into_dst: bool) -> torch.Tensor:
    return _EdgeAggregate.apply(weight, values, into_dst, *edges)


def _edge_dot(a, b, edges: _Edges) -> torch.Tensor:
    return _EdgeDot.apply(a, b, *edges)


# E x H moves between nodes and edges. Gathers are index_select (deterministic); sums are the
# SpMM primitive with one channel of ones (deterministic, no scatter atomics). Each is the
# other's adjoint, so all orders stay deterministic and O(E x H).
class _ToEdges(torch.autograd.Function):
    """``[N, H]`` per-node values -> ``[E, H]`` (CSC order): each edge takes its ``side`` node's."""
    generate_vmap_rule = True

    @staticmethod
    def forward(t, side, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src):
        if side == "src":
            return t.index_select(0, indices)
        return t.index_select(0, dst)

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, side, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src = inputs
        ctx.side = side
        ctx.num_src = num_src
        ctx.save_for_backward(indptr, indices, dst, rev_indptr, rev_edge, rev_dst)
        ctx.save_for_forward(indptr, indices, dst, rev_indptr, rev_edge, rev_dst)

    @staticmethod
    def backward(ctx, grad):
        edges = _Edges(*ctx.saved_tensors, ctx.num_src)
        return (_sum_to_nodes(grad, edges, ctx.side),) + (None,) * 8

    @staticmethod
    def jvp(ctx, t_t, *_):
        return _to_edges(t_t, _Edges(*ctx.saved_tensors, ctx.num_src), ctx.side)


def _to_edges(t: torch.Tensor, edges: _Edges, side: str) -> torch.Tensor:
    """``[N, H]`` per-node values -> ``[E, H]``: each edge takes its ``side`` node's value."""
    return _ToEdges.apply(t, side, *edges)


class _ToNodes(torch.autograd.Function):
    """``[E, H]`` (CSC order) -> ``[N, H]``: each ``side`` node sums the values of its edges."""
    generate_vmap_rule = True

    @staticmethod
    def forward(w, side, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src):
        if side == "dst":
            ones = torch.ones((num_src, w.size(1), 1), dtype=w.dtype, device=w.device)
            return ops.gat_spmm(w, ones, indptr, indices, None).squeeze(-1)
        _need_reverse(rev_indptr)
        ones = torch.ones((indptr.numel() - 1, w.size(1), 1), dtype=w.dtype, device=w.device)
        return ops.gat_spmm(w, ones, rev_indptr, rev_dst, rev_edge).squeeze(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        w, side, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src = inputs
        ctx.side = side
        ctx.num_src = num_src
        ctx.save_for_backward(indptr, indices, dst, rev_indptr, rev_edge, rev_dst)
        ctx.save_for_forward(indptr, indices, dst, rev_indptr, rev_edge, rev_dst)

    @staticmethod
    def backward(ctx, grad):
        edges = _Edges(*ctx.saved_tensors, ctx.num_src)
        return (_to_edges(grad, edges, ctx.side),) + (None,) * 8

    @staticmethod
    def jvp(ctx, t_w, *_):
        return _sum_to_nodes(t_w, _Edges(*ctx.saved_tensors, ctx.num_src), ctx.side)


def _sum_to_nodes(w: torch.Tensor, edges: _Edges, side: str) -> torch.Tensor:
    """``[E, H]`` -> ``[N, H]``: each ``side`` node sums the values of its edges."""
    return _ToNodes.apply(w, side, *edges)


# ---------------------------------------------------------------------------- differentiable GAT math
class _EdgeSoftmax(torch.autograd.Function):
    """Softmax of edge scores ``s [E, H]`` (CSC order) over each destination's incoming edges.

    ``lse [num_dst, H]`` (the forward kernel's log-sum-exp, float64) only shifts the exponent
    for stability (taken in the scores' dtype); the result is renormalised, so it is exact.
    Saves only its output: inside a double backward the recorded graph keeps one ``E x H``
    tensor here, not every temporary."""
    generate_vmap_rule = True

    @staticmethod
    def forward(scores, lse, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src):
        edges = _Edges(indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src)
        q = torch.exp(scores - _to_edges(lse.to(scores.dtype), edges, "dst"))
        return q / _to_edges(_sum_to_nodes(q, edges, "dst"), edges, "dst")

    @staticmethod
    def setup_context(ctx, inputs, output):
        scores, lse, indptr, indices, dst, rev_indptr, rev_edge, rev_dst, num_src = inputs
        ctx.num_src = num_src
        ctx.save_for_backward(output, indptr, indices, dst, rev_indptr, rev_edge, rev_dst)
        ctx.save_for_forward(output, indptr, indices, dst, rev_indptr, rev_edge, rev_dst)

    @staticmethod
    def backward(ctx, grad_p):
        p, *index = ctx.saved_tensors
        return (_softmax_jvp(p, grad_p, _Edges(*index, ctx.num_src)),) + (None,) * 8

    @staticmethod
    def jvp(ctx, t_scores, *_):
        p, *index = ctx.saved_tensors
        if t_scores is None:  # only the (constant) shift moved
            return torch.zeros_like(p)
        return _softmax_jvp(p, t_scores, _Edges(*index, ctx.num_src))


def _softmax_jvp(p, t_s, edges: _Edges):
    """Directional derivative of the per-destination softmax ``p`` along scores moving by ``t_s``
    (also its vector-Jacobian product, the Jacobian ``diag(p) - p p^T`` being symmetric)."""
    pt = p * t_s
    return pt - p * _to_edges(_sum_to_nodes(pt, edges, "dst"), edges, "dst")


def _attention_probs(a_src, a_dst, el, lse, edges: _Edges, negative_slope: float):
    """Pre-activation scores ``z [E, H]`` and softmax ``p [E, H]`` (before dropout), CSC order."""
    z = _to_edges(a_src, edges, "src") + _to_edges(a_dst, edges, "dst")
    if el is not None:
        z = z + el
    p = _EdgeSoftmax.apply(F.leaky_relu(z, negative_slope), lse, *edges)
    return z, p


def _leaky_relu_grad(grad: torch.Tensor, z: torch.Tensor, negative_slope: float) -> torch.Tensor:
    """``grad * leaky_relu'(z)`` (slope where z <= 0, as autograd and the kernels take it), with
    no slope tensor materialised; differentiable to any order, with forward mode and vmap."""
    return torch.ops.aten.leaky_relu_backward(grad, z, negative_slope, False)


def _gat_backward_differentiable(grad_out, grad_alpha, x_src, a_src, a_dst, el, lse, edges: _Edges,
                                 mask, negative_slope, dropout_scale, needs):
    """GAT's first-order backward written with the fused primitives and ``E x H`` ops, so that
    it is itself differentiable (``create_graph=True``) at ``O(E x H)`` extra memory. Half types
    compute in float32; each gradient comes back in its input's dtype."""
    acc = _acc_dtype(x_src.dtype)
    x, a_s, a_d, e_l, g = (None if t is None else t.to(acc) for t in (x_src, a_src, a_dst, el, grad_out))
    z, p = _attention_probs(a_s, a_d, e_l, lse, edges, negative_slope)
    keep = None if mask is None else mask.to(acc) * dropout_scale
    grads = [None] * 4
    if needs[0]:
        grads[0] = _edge_aggregate(p if keep is None else p * keep, g, edges, False)
    if any(needs[1:]):
        d_alpha = _edge_dot(g, x, edges)
        if grad_alpha is not None:
            d_alpha = d_alpha + grad_alpha.to(acc)
        d_z = _softmax_jvp(p, d_alpha if keep is None else d_alpha * keep, edges)
        d_z = _leaky_relu_grad(d_z, z, negative_slope)
        if needs[1]:
            grads[1] = _sum_to_nodes(d_z, edges, "src")
        if needs[2]:
            grads[2] = _sum_to_nodes(d_z, edges, "dst")
        if needs[3]:
            grads[3] = d_z
    return [None if t is None else t.to(like.dtype) for t, like in zip(grads, (x_src, a_src, a_dst, a_src))]


def _gat_jvp(t_x, t_asrc, t_adst, t_el, x_src, a_src, a_dst, el, lse, edges: _Edges, mask,
             negative_slope, dropout_scale, want_alpha):
    """Tangents of ``out`` and of ``alpha`` (CSC order; None unless ``want_alpha``):
    ``t_out = SpMM(t_alpha, x) + SpMM(alpha, t_x)``, ``t_alpha`` from ``E x H`` ops; ``t_out`` in
    the features' dtype, ``t_alpha`` in the logits'."""
    acc = _acc_dtype(x_src.dtype)
    x, a_s, a_d, e_l = (None if t is None else t.to(acc) for t in (x_src, a_src, a_dst, el))
    z, p = _attention_probs(a_s, a_d, e_l, lse, edges, negative_slope)
    keep = None if mask is None else mask.to(acc) * dropout_scale
    t_z = None
    for t, side in ((t_asrc, "src"), (t_adst, "dst")):
        if t is not None:
            t = _to_edges(t.to(acc), edges, side)
            t_z = t if t_z is None else t_z + t
    if t_el is not None and el is not None:
        t_z = t_el.to(acc) if t_z is None else t_z + t_el.to(acc)
    t_out = t_alpha = None
    if t_z is not None:
        t_alpha = _softmax_jvp(p, _leaky_relu_grad(t_z, z, negative_slope), edges)
        if keep is not None:
            t_alpha = t_alpha * keep
        t_out = _edge_aggregate(t_alpha, x, edges, True)
    if t_x is not None:
        t = _edge_aggregate(p if keep is None else p * keep, t_x.to(acc), edges, True)
        t_out = t if t_out is None else t_out + t
    if t_out is None:  # no tangent reached the inputs that matter (e.g. only t_el, without el)
        t_out = x.new_zeros((edges.num_dst,) + tuple(x.shape[1:]))
    if want_alpha and t_alpha is None:
        t_alpha = torch.zeros_like(p)
    return t_out.to(x_src.dtype), (t_alpha.to(a_src.dtype) if want_alpha else None)


def _attend_composite(scores, x_src, graph: BipartiteCSC, src, dst, mask, dropout_scale: float, dtype,
                      alpha_dtype=None):
    """The attention half shared by the GAT and GATv2 composites: softmax of ``scores [E, H]``
    (CSC order) over each destination's edges, dropout, ``out[i] = sum_e alpha[e] x_src[j]``;
    ``(out, alpha)`` cast to ``dtype`` (alpha to ``alpha_dtype`` when given). The shift by each
    segment's maximum is a constant (the result is renormalised)."""
    heads = scores.size(-1)
    index = dst.unsqueeze(-1).expand_as(scores)
    shift = scores.detach().new_full((graph.num_dst, heads), float("-inf"))
    shift = shift.scatter_reduce(0, index, scores.detach(), "amax", include_self=True)
    q = torch.exp(scores - shift.index_select(0, dst))
    alpha = q / q.new_zeros((graph.num_dst, heads)).index_add(0, dst, q).index_select(0, dst)
    if mask is not None:
        alpha = alpha * (mask.to(alpha.dtype) * dropout_scale)
    out = x_src.new_zeros((graph.num_dst,) + tuple(x_src.shape[1:]))
    out = out.index_add(0, dst, alpha.unsqueeze(-1) * x_src.index_select(0, src))
    return out.to(dtype), alpha.to(dtype if alpha_dtype is None else alpha_dtype)


def _composite_edges(graph: BipartiteCSC):
    """``(src, dst)`` int64 of each CSC position, for the composites."""
    return graph.indices.long(), csc_destinations(graph.indptr, graph.num_edges).long()


def _gat_composite(x_src, a_src, a_dst, el, graph: BipartiteCSC, mask, negative_slope: float,
                   dropout_scale: float):
    """``(out, alpha)`` (alpha in CSC order) in plain PyTorch ops, differentiable by PyTorch in
    every mode and at every order; holds ``E x H x C`` (see :mod:`._transforms` for when)."""
    acc = _acc_dtype(x_src.dtype)
    src, dst = _composite_edges(graph)
    z = a_src.to(acc).index_select(0, src) + a_dst.to(acc).index_select(0, dst)
    if el is not None:
        z = z + el.to(acc)
    return _attend_composite(F.leaky_relu(z, negative_slope), x_src.to(acc), graph, src, dst, mask,
                             dropout_scale, x_src.dtype, a_src.dtype)


# ---------------------------------------------------------------------------- autograd
class _GATAttentionFirstOrder(torch.autograd.Function):
    """Forward and backward of :class:`GATAttentionFunction`, without ``jvp``: the class that
    ``torch.compile`` traces (Dynamo cannot trace a Function that defines ``jvp``)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
                dropout_mask, negative_slope, dropout_scale, return_alpha):
        return ops.gat_forward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask,
                               negative_slope, dropout_scale, return_alpha)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
         dropout_mask, negative_slope, dropout_scale, return_alpha) = inputs
        out, lse, alpha = output
        # One call: each call replaces the previous set (a second call had left lse
        # differentiable, and its None tangent then tripped an internal assert in forward AD).
        ctx.mark_non_differentiable(*((lse,) if return_alpha else (lse, alpha)))
        ctx.negative_slope = negative_slope
        ctx.dropout_scale = dropout_scale
        ctx.has_edge_logits = edge_logits is not None
        ctx.has_rev = rev_indptr is not None
        ctx.return_alpha = return_alpha
        saved = (x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
                 dropout_mask, out, lse)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_alpha):
        (x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
         dropout_mask, out, lse) = ctx.saved_tensors
        # Dynamo, tracing inside a torch.func transform, reports inputs wrapped by the transform
        # as not needing a gradient (their gradients then came out zero): compute them all.
        needs = [True] * 4 if torch.compiler.is_compiling() else list(ctx.needs_input_grad[:4])
        needs[3] = needs[3] and ctx.has_edge_logits
        if any(needs) and not ctx.has_rev:
            raise RuntimeError("GATAttentionFunction: the reverse index was not passed to forward, "
                               "but a gradient is needed; call gat_attention() instead")
        edges = _Edges.of_csc(indptr, indices, rev_indptr, rev_edge, rev_dst, x_src.size(0))
        grads = _gat_backward(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, edges,
                              dropout_mask, ctx.negative_slope, ctx.dropout_scale, needs)
        return tuple(grads) + (None,) * 9


def _gat_backward(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, edges: _Edges,
                  dropout_mask, negative_slope, dropout_scale, needs):
    """Gradients of x_src, a_src, a_dst, edge_logits (None where not ``needs``): the fused
    deterministic kernel, or under ``create_graph=True`` (also every ``torch.func.grad``/``vjp``,
    which record for higher orders) the differentiable formulation."""
    if not any(needs):
        return [None] * 4
    if grad_alpha is not None and grad_alpha.numel() == 0:
        grad_alpha = None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if torch.is_grad_enabled():
        return _gat_backward_differentiable(grad_out, grad_alpha, x_src, a_src, a_dst, edge_logits, lse,
                                            edges, dropout_mask, negative_slope, dropout_scale, needs)
    grads = ops.gat_backward(
        grad_out.contiguous(), None if grad_alpha is None else grad_alpha.contiguous(), out, lse,
        x_src, a_src, a_dst, edge_logits, edges.indptr, edges.indices, edges.rev_indptr, edges.rev_edge,
        edges.rev_dst, dropout_mask, negative_slope, dropout_scale, needs)
    return [g if n else None for g, n in zip(grads, needs)]


class GATAttentionFunction(_GATAttentionFirstOrder):
    """Autograd for the fused GAT kernels. All per-edge tensors are in CSC edge order.

    ``forward(x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
    dropout_mask, negative_slope, dropout_scale, return_alpha) -> (out, lse, alpha)``

    * ``x_src [num_src, H, C]``, ``a_src [num_src, H]``, ``a_dst [num_dst, H]``,
      ``edge_logits [E, H]`` or None; ``dropout_mask [E, H]`` bool or None (kept edges).
    * ``out [num_dst, H, C]``; ``lse [num_dst, H]`` (float64; non-differentiable log-sum-exp of the
      scores); ``alpha [E, H]`` after dropout if ``return_alpha`` else ``[0, H]``.
    * The reverse (source-grouped) index ``rev_*`` is only needed when a reverse-mode gradient
      is wanted.

    Backward: the deterministic fused kernel; under ``create_graph=True`` the same math in the
    fused SpMM/SDDMM primitives and ``E x H`` ops, differentiable to any order. Forward mode
    (``jvp``): ``t_out = SpMM(t_alpha, x) + SpMM(alpha, t_x)``. Neither allocates
    ``E x H x C``. ``torch.vmap`` folds the batch into the heads (vmap rules on the ops).
    """

    @staticmethod
    def jvp(ctx, t_x, t_asrc, t_adst, t_el, *_):
        (x_src, a_src, a_dst, el, indptr, indices, rev_indptr, rev_edge, rev_dst, mask, out,
         lse) = ctx.saved_tensors
        edges = _Edges.of_csc(indptr, indices, rev_indptr, rev_edge, rev_dst, x_src.size(0))
        t_out, t_alpha = _gat_jvp(t_x, t_asrc, t_adst, t_el, x_src, a_src, a_dst, el, lse, edges, mask,
                                  ctx.negative_slope, ctx.dropout_scale, ctx.return_alpha)
        return t_out, None, t_alpha


# Autograd on the op itself. Eager code differentiates through the Functions above (their
# backward, jvp and vmap rules). But torch.compile, inside a torch.func transform, may
# differentiate a Function's *forward* instead of using its rules; without a formula on the op
# the gradient then came out silently zero. With this one it is right (or Dynamo refuses and
# falls back to eager). Forward mode cannot be registered on an op: see gat_attention.
def _gat_forward_setup_context(ctx, inputs, output):
    (x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask, negative_slope, dropout_scale,
     return_alpha) = inputs
    out, lse, _ = output
    ctx.mark_non_differentiable(lse)  # the log-sum-exp is the backward's, not an output to differentiate
    ctx.negative_slope = negative_slope
    ctx.dropout_scale = dropout_scale
    ctx.has_edge_logits = edge_logits is not None
    ctx.save_for_backward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask, out, lse)


def _gat_forward_backward(ctx, grad_out, grad_lse, grad_alpha):
    x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask, out, lse = ctx.saved_tensors
    needs = [True] * 4 if torch.compiler.is_compiling() else list(ctx.needs_input_grad[:4])
    needs[3] = needs[3] and ctx.has_edge_logits
    # No graph object here: build the reverse index as BipartiteCSC does.
    edges = _Edges.of(BipartiteCSC(indptr, indices, x_src.size(0), validate=False))
    grads = _gat_backward(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, edges,
                          dropout_mask, ctx.negative_slope, ctx.dropout_scale, needs)
    return tuple(grads) + (None,) * 6


torch.library.register_autograd("torch_gradops::gat_forward", _gat_forward_backward,
                                setup_context=_gat_forward_setup_context)


# ---------------------------------------------------------------------------- primitives, public
def edge_aggregate(weight: torch.Tensor, values: torch.Tensor, graph: BipartiteCSC,
                   into: str = "dst") -> torch.Tensor:
    """Edge-weighted aggregation (SpMM) over ``graph``, fused, deterministic and differentiable
    to any order (reverse and forward mode, ``torch.vmap``).

    ``into="dst"``: ``out[i,h,:] = sum over edges e = (j -> i) of weight[e,h] * values[j,h,:]``
    with ``values [num_src, H, C]`` and ``out [num_dst, H, C]``; ``into="src"``: the transpose,
    ``out[j] = sum over e = (j -> i) of weight[e] * values[i]``, ``values [num_dst, H, C]``.
    ``weight [E, H]`` is in the original edge order.
    """
    if into not in ("dst", "src"):
        raise ValueError(f"into must be 'dst' or 'src', got {into!r}")
    _check_primitive_args(graph, weight=weight, values=values)
    rows = graph.num_src if into == "dst" else graph.num_dst
    if weight.dim() != 2 or weight.size(0) != graph.num_input_edges:
        raise ValueError(f"weight must have shape [E={graph.num_input_edges}, H], got {tuple(weight.shape)}")
    if values.dim() != 3 or values.size(0) != rows:
        raise ValueError(f"values must have shape [{'num_src' if into == 'dst' else 'num_dst'}={rows}, H, C] "
                         f"for into={into!r}, got {tuple(values.shape)}")
    return _edge_aggregate(graph.edge_order(weight), values, _Edges.of(graph), into == "dst")


def edge_dot(a: torch.Tensor, b: torch.Tensor, graph: BipartiteCSC) -> torch.Tensor:
    """Per-edge dot products (SDDMM) over ``graph``, fused, deterministic and differentiable to
    any order: ``out[e,h] = <a[i,h,:], b[j,h,:]>`` for each edge ``e = (j -> i)``, with
    ``a [num_dst, H, C]``, ``b [num_src, H, C]`` and ``out [E, H]`` in the original edge order."""
    _check_primitive_args(graph, a=a, b=b)
    if a.dim() != 3 or a.size(0) != graph.num_dst:
        raise ValueError(f"a must have shape [num_dst={graph.num_dst}, H, C], got {tuple(a.shape)}")
    if b.dim() != 3 or b.size(0) != graph.num_src:
        raise ValueError(f"b must have shape [num_src={graph.num_src}, H, C], got {tuple(b.shape)}")
    return graph.original_order(_edge_dot(a, b, _Edges.of(graph)))


def _check_primitive_args(graph, **tensors):
    if not isinstance(graph, BipartiteCSC):
        raise TypeError(f"graph must be a torch_gradops.BipartiteCSC, got {type(graph).__name__}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_backend(t, name)
        if t.device != graph.device:
            raise ValueError(f"{name} is on {t.device} but graph is on {graph.device}; use graph.to(device)")


# ---------------------------------------------------------------------------- public API
def _dropout_mask(num_edges: int, heads: int, dropout: float, device: torch.device) -> Tuple[torch.Tensor, float]:
    """``(keep [num_edges, heads] bool, scale)``: attention dropout's kept edges, each with
    probability ``1 - dropout`` as ``F.dropout`` keeps elements, and the scale of the kept ones.
    On CUDA the draw goes straight into the bool mask: ``rand >= dropout`` first holds a float
    per element, 4 bytes per edge and head (1.6 GB at E = 50M, H = 8). On the CPU, whose
    ``bernoulli_`` into bool runs serially (0.29 s against 0.17 s at E = 2M, H = 8, 2 threads),
    and while compiling (Inductor fuses the comparison), it is ``rand >= dropout``. With
    ``dropout = 1`` nothing is kept (``F.dropout(p=1)`` zeroes its input) and the scale is 1,
    not ``1/0``: the kernels multiply kept weights by it."""
    if dropout >= 1.0:
        return torch.zeros((num_edges, heads), dtype=torch.bool, device=device), 1.0
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        keep = torch.empty((num_edges, heads), dtype=torch.bool, device=device).bernoulli_(1.0 - dropout)
    else:
        keep = torch.rand((num_edges, heads), device=device) >= dropout
    return keep, 1.0 / (1.0 - dropout)


def _check_logit_dtype(name: str, t: torch.Tensor, x_src: torch.Tensor, a_src: torch.Tensor) -> None:
    """Logits have the features' dtype, or float32 for half features (what PyG's layers compute
    under autocast, float32 attention parameters times half features), all the same one."""
    allowed = (x_src.dtype, _acc_dtype(x_src.dtype))
    if t.dtype not in allowed:
        also = " or float32" if allowed[1] != allowed[0] else ""
        raise TypeError(f"{name} ({t.dtype}) must have the dtype of x_src ({x_src.dtype}){also}")
    if t.dtype != a_src.dtype:
        raise TypeError(f"{name} ({t.dtype}) must have the dtype of a_src ({a_src.dtype})")


def _check_inputs(x_src, a_src, a_dst, graph, edge_logits, dropout):
    if not isinstance(graph, BipartiteCSC):
        raise TypeError(f"graph must be a torch_gradops.BipartiteCSC, got {type(graph).__name__}")
    for name, t in (("x_src", x_src), ("a_src", a_src), ("a_dst", a_dst)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float64/float32/float16/bfloat16, got {t.dtype}")
        check_backend(t, name)
    if x_src.dim() != 3:
        raise ValueError(f"x_src must have shape [num_src, heads, channels], got {tuple(x_src.shape)}")
    num_src, heads, _ = x_src.shape
    if a_src.shape != (num_src, heads):
        raise ValueError(f"a_src must have shape [num_src, heads] = {(num_src, heads)}, got {tuple(a_src.shape)}")
    if a_dst.dim() != 2 or a_dst.size(1) != heads:
        raise ValueError(f"a_dst must have shape [num_dst, heads={heads}], got {tuple(a_dst.shape)}")
    if num_src != graph.num_src:
        raise ValueError(f"x_src has {num_src} source rows but graph.num_src is {graph.num_src}")
    if a_dst.size(0) != graph.num_dst:
        raise ValueError(f"a_dst has {a_dst.size(0)} rows but graph.num_dst is {graph.num_dst}")
    for name, t in (("a_src", a_src), ("a_dst", a_dst)):
        _check_logit_dtype(name, t, x_src, a_src)
        if t.device != x_src.device:
            raise ValueError(f"{name} ({t.device}) must be on the device of x_src ({x_src.device})")
    if graph.device != x_src.device:
        raise ValueError(f"graph is on {graph.device} but x_src is on {x_src.device}; use graph.to(device)")
    if edge_logits is not None:
        if not isinstance(edge_logits, torch.Tensor):
            raise TypeError(f"edge_logits must be a torch.Tensor or None, got {type(edge_logits).__name__}")
        if edge_logits.shape != (graph.num_input_edges, heads):
            raise ValueError(f"edge_logits must have shape [E, heads] = {(graph.num_input_edges, heads)}, "
                             f"got {tuple(edge_logits.shape)}")
        _check_logit_dtype("edge_logits", edge_logits, x_src, a_src)
        if edge_logits.device != x_src.device:
            raise ValueError(f"edge_logits ({edge_logits.device}) must be on the device of x_src ({x_src.device})")
    if not (0.0 <= float(dropout) <= 1.0):
        raise ValueError(f"dropout must be in [0, 1], got {dropout}")


def gat_attention(x_src: torch.Tensor, a_src: torch.Tensor, a_dst: torch.Tensor, graph: BipartiteCSC,
                  negative_slope: float = 0.2, edge_logits: Optional[torch.Tensor] = None,
                  dropout: float = 0.0, training: bool = False, return_attention: bool = False
                  ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Fused GAT attention and aggregation (PyG ``GATConv`` between its projections and bias).

    For every destination ``i``, head ``h`` and incoming edge ``e = (j -> i)``::

        s[e,h]     = leaky_relu(a_src[j,h] + a_dst[i,h] + edge_logits[e,h], negative_slope)
        alpha[e,h] = softmax of s over the incoming edges of i   (then dropout if training)
        out[i,h,:] = sum_e alpha[e,h] * x_src[j,h,:]

    Args:
        x_src: ``[num_src, H, C]`` projected source features.
        a_src: ``[num_src, H]`` source attention logits. The logits (``a_src``, ``a_dst``,
            ``edge_logits``) share one dtype: ``x_src``'s, or float32 when ``x_src`` is
            float16/bfloat16 (the mixed precision of PyG's layers under autocast: the softmax
            inputs keep float32 precision while the features travel in half). ``alpha`` and
            the logits' gradients come back in that dtype.
        a_dst: ``[num_dst, H]`` destination attention logits.
        graph: the edges, as a :class:`BipartiteCSC` on the features' device.
        negative_slope: LeakyReLU slope.
        edge_logits: ``[E, H]`` per-edge logits in the original edge order, or None.
        dropout: attention dropout probability in ``[0, 1]``, applied when ``training`` and
            scaled by ``1/(1-dropout)`` like ``F.dropout``.
        return_attention: also return ``alpha [E, H]`` (after dropout) in the original edge order.

    Returns:
        ``out [num_dst, H, C]``, or ``(out, alpha)``. Destinations without incoming edges get zeros.
    """
    _check_inputs(x_src, a_src, a_dst, graph, edge_logits, dropout)
    heads = x_src.size(1)
    el = None if edge_logits is None else graph.edge_order(edge_logits)
    mask = None
    scale = 1.0
    if training and dropout > 0.0:
        mask, scale = _dropout_mask(graph.num_edges, heads, dropout, x_src.device)
    grad_inputs = [t for t in (x_src, a_src, a_dst, edge_logits) if t is not None]
    compiling = torch.compiler.is_compiling()
    how = route(grad_inputs)
    if how == COMPOSITE:
        _prepare_graph(graph, reverse=False, inverse=bool(return_attention))
        out, alpha = _gat_composite(x_src, a_src, a_dst, el, graph, mask, float(negative_slope), scale)
        return (out, graph.original_order(alpha)) if return_attention else out
    # The reverse index serves reverse-mode gradients; an input with a forward-mode tangent may
    # have its tangent's graph differentiated later (jacrev over jvp), so it gets one too. Under
    # torch.compile requires_grad does not show through torch.func transforms: always built.
    # Under torch.jit.trace always: trace's check run records under no_grad, where nothing
    # requires grad, and a traced graph must not depend on that (nor lack the index later).
    want_reverse = torch.jit.is_tracing() or torch.is_grad_enabled() and (
        compiling or any(t.requires_grad or has_tangent(t) for t in grad_inputs))
    rev = _prepare_graph(graph, reverse=want_reverse, inverse=bool(return_attention))
    rev_tensors = (rev.indptr, rev.edge, rev.dst) if want_reverse else (None, None, None)
    tail = (graph.indptr, graph.indices, *rev_tensors, mask, float(negative_slope), float(scale),
            bool(return_attention))
    if not compiling:
        out, _, alpha = GATAttentionFunction.apply(x_src, a_src, a_dst, el, *tail)
    elif how == FUSED_JVP:
        # Dynamo does not call a Function's jvp (see _transforms): the tangents come from the
        # fused JVP here, the primal from the first-order Function.
        (xp, asp, adp, elp), (t_x, t_as, t_ad, t_el) = split_duals((x_src, a_src, a_dst, el))
        out, lse, alpha = _GATAttentionFirstOrder.apply(xp, asp, adp, elp, *tail)
        edges = _Edges.of_csc(graph.indptr, graph.indices, *rev_tensors, xp.size(0))
        t_out, t_alpha = _gat_jvp(t_x, t_as, t_ad, t_el, xp, asp, adp, elp, lse, edges, mask,
                                  float(negative_slope), float(scale), bool(return_attention))
        out = join_dual(out, t_out)
        if return_attention:  # (reordered before joining: an index_select of a dual fails to trace)
            return out, join_dual(graph.original_order(alpha), graph.original_order(t_alpha))
    else:
        # Dynamo cannot trace a Function that defines jvp: compiled code gets the first-order one.
        out, _, alpha = _GATAttentionFirstOrder.apply(x_src, a_src, a_dst, el, *tail)
    if return_attention:
        return out, graph.original_order(alpha)
    return out


# ---------------------------------------------------------------------------- cugraph-ops compat
def _cugraph_inputs(feat, attn_weights, graph: BipartiteCSC, num_heads: int, activation, negative_slope: float,
                    edge_feat: Optional[torch.Tensor]):
    """The checked inputs of the cugraph-ops compatibility functions (:func:`mha_gat_n2n`,
    :func:`~torch_gradops.gatv2.mha_gat_v2_n2n`): ``(feat_src [n_src, H*C], feat_dst [n_dst,
    H*C], edge_feat [E, H*C] or None, negative_slope)``, the slope 1 for a linear activation.
    ``attn_weights``' shape is each function's own; its type and dtype are checked here."""
    heads = as_index(num_heads)  # ints, numpy integers, 0-dim integer tensors
    if heads is None or heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    num_heads = heads
    if isinstance(feat, (tuple, list)):
        if len(feat) != 2:
            raise ValueError(f"feat must be a tensor or a (feat_src, feat_dst) pair, got {len(feat)} tensors")
        feat_src, feat_dst = feat
    else:
        feat_src, feat_dst = feat, feat[: graph.num_dst]
    if feat_src.dim() != 2 or feat_src.size(1) % num_heads != 0:
        raise ValueError(f"feat must have shape [n, num_heads*C] with num_heads={num_heads}, "
                         f"got {tuple(feat_src.shape)}")
    hc = feat_src.size(1)
    if feat_dst.dim() != 2 or feat_dst.size(1) != hc:
        raise ValueError(f"the destination features must have shape [n_dst, {hc}], got {tuple(feat_dst.shape)}")
    pair = isinstance(feat, (tuple, list))
    if feat_src.size(0) != graph.num_src:
        raise ValueError(f"{'feat[0]' if pair else 'feat'} has {feat_src.size(0)} rows, but the graph has "
                         f"num_src = {graph.num_src} source nodes (one row each)")
    if feat_dst.size(0) != graph.num_dst:
        raise ValueError(f"feat[1] has {feat_dst.size(0)} rows, but the graph has num_dst = {graph.num_dst} "
                         "destination nodes (one row each)" if pair else
                         f"feat has {feat_src.size(0)} rows, fewer than the graph's num_dst = {graph.num_dst} "
                         "destination nodes (its first num_dst rows are theirs)")
    if edge_feat is not None and (edge_feat.dim() != 2 or edge_feat.size(1) != hc
                                  or edge_feat.size(0) != graph.num_input_edges):
        raise ValueError(f"edge_feat must have shape [E = {graph.num_input_edges}, num_heads*C = {hc}] (one row "
                         f"per edge of the graph, original order), got {tuple(edge_feat.shape)}")
    if not isinstance(attn_weights, torch.Tensor):
        raise TypeError(f"attn_weights must be a torch.Tensor, got {type(attn_weights).__name__}")
    if attn_weights.dtype != feat_src.dtype:
        raise TypeError(f"attn_weights ({attn_weights.dtype}) must have feat's dtype ({feat_src.dtype})")
    for name, t in (("the destination features", feat_dst), ("edge_feat", edge_feat)):
        if t is not None and t.dtype != feat_src.dtype:  # (they were promoted silently)
            raise TypeError(f"{name} ({t.dtype}) must have feat's dtype ({feat_src.dtype})")
    if activation in (None, "Linear", "linear", "Identity"):
        negative_slope = 1.0
    elif activation != "LeakyReLU":
        raise ValueError(f"activation must be 'LeakyReLU' or 'Linear', got {activation!r}")
    return feat_src, feat_dst, edge_feat, negative_slope


def mha_gat_n2n(feat, attn_weights: torch.Tensor, graph: BipartiteCSC, num_heads: int = 1,
                activation: str = "LeakyReLU", negative_slope: float = 0.2, concat_heads: bool = True,
                edge_feat: Optional[torch.Tensor] = None, deterministic_dgrad: bool = False,
                deterministic_wgrad: bool = False, high_precision_dgrad: bool = False,
                high_precision_wgrad: bool = False) -> torch.Tensor:
    """Drop-in for ``pylibcugraphops.pytorch.operators.mha_gat_n2n`` (withdrawn in RAPIDS 25.02).

    Args:
        feat: ``[n, num_heads*C]`` already projected node features, used as sources and (its first
            ``graph.num_dst`` rows) as destinations; or a ``(feat_src, feat_dst)`` pair.
        attn_weights: ``[2*num_heads*C]`` (source part, then destination part), plus
            ``num_heads*C`` for the edge part when ``edge_feat`` is given.
        graph: a :class:`BipartiteCSC`.
        activation: ``"LeakyReLU"`` (or ``"Linear"``/None for no activation).
        edge_feat: ``[E, num_heads*C]`` projected edge features (original edge order), or None.
        deterministic_dgrad, deterministic_wgrad, high_precision_dgrad, high_precision_wgrad:
            accepted for compatibility and ignored: the gradients here are always deterministic,
            and for float16/bfloat16 inputs always accumulated in float32.

    Returns:
        ``[n_dst, num_heads*C]`` if ``concat_heads`` else ``[n_dst, C]`` (mean over heads).
    """
    del deterministic_dgrad, deterministic_wgrad, high_precision_dgrad, high_precision_wgrad
    feat_src, feat_dst, edge_feat, negative_slope = _cugraph_inputs(feat, attn_weights, graph, num_heads,
                                                                    activation, negative_slope, edge_feat)
    hc = feat_src.size(1)
    channels = hc // num_heads
    expect = (3 if edge_feat is not None else 2) * hc
    if attn_weights.dim() != 1 or attn_weights.numel() != expect:
        raise ValueError(f"attn_weights must be 1-D with {expect} entries, got {tuple(attn_weights.shape)}")
    x_src = feat_src.view(-1, num_heads, channels)
    x_dst = feat_dst.reshape(-1, num_heads, channels)
    att = attn_weights.view(-1, num_heads, channels)
    a_src = (x_src * att[0]).sum(-1)
    a_dst = (x_dst * att[1]).sum(-1)
    edge_logits = None
    if edge_feat is not None:
        edge_logits = (edge_feat.view(-1, num_heads, channels) * att[2]).sum(-1)
    out = gat_attention(x_src, a_src, a_dst, graph, negative_slope=negative_slope,
                        edge_logits=edge_logits)
    return out.reshape(-1, hc) if concat_heads else out.mean(dim=1)
