"""Fused GATv2 attention on a :class:`~torch_gradops.BipartiteCSC` graph.

GATv2 (Brody et al., "How attentive are graph attention networks?") scores each edge with the
whole feature vector, ``s = att . leaky_relu(x_src[j] + x_dst[i] + W_e edge_attr[e])``. The
forward kernel makes one pass over each destination's incoming edges with an online softmax,
forms the pre-activation of each edge in registers (the projected edge features are never
stored) and saves only the per-(destination, head) log-sum-exp. The backward recomputes the
pre-activations and sums without atomics in a fixed order, so gradients are bitwise
reproducible; its workspaces are ``[E, heads]``. Nothing of size ``E x heads x channels`` is
allocated on the first-order paths. The other paths never hold one beyond a chunk of edges
whose ``[chunk, heads, channels]`` temporaries have about ``E x heads`` elements: forward-mode
AD is plain PyTorch ops over such chunks; the differentiable backward (``create_graph=True``,
``torch.func.grad``/``jacrev``/``hessian``, batched output gradients under vmap) is GAT's fused
primitives plus chunked per-edge maps that recompute their chunks for their own derivatives
(:class:`_Gatv2EdgeMaps`). ``torch.func.vmap`` folds a vmapped dimension into the heads, one
kernel call for the whole batch.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from ._transforms import COMPOSITE, FUSED_JVP, has_tangent, is_transformed, join_dual, route, split_duals
from ._edge_chunks import EdgeChunks, EdgeMap, EdgeMapSpec, chunk_size, node_ranges
from ._segments import gather_rows, index_add_rows, plain_tensor, sum_sorted_rows
from .gat import (_attend_composite, _composite_edges, _cugraph_inputs, _dropout_mask, _edge_aggregate, _edge_dot,
                  _Edges, _EdgeSoftmax, _fold_heads, _leaky_relu_grad, _prepare_graph, _softmax_jvp, _unfold_heads,
                  _vmap_per_item)
from .graph import BipartiteCSC, csc_destinations
from .library import check_backend, ops

__all__ = ["gatv2_attention", "GATv2AttentionFunction", "mha_gat_v2_n2n"]

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types accumulate (and keep the log-sum-exp) in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ---------------------------------------------------------------------------- fake kernels
@torch.library.register_fake("torch_gradops::gatv2_forward")
def _gatv2_forward_fake(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask,
                        negative_slope, dropout_scale, return_alpha, edge_attr_rows=None):
    num_dst, heads, channels = x_dst.size(0), x_src.size(1), x_src.size(2)
    out = x_src.new_empty((num_dst, heads, channels))
    lse = x_src.new_empty((num_dst, heads), dtype=torch.float64)  # float64 for every dtype (csrc/gat.h)
    alpha = x_src.new_empty((indices.size(0) if return_alpha else 0, heads))
    return out, lse, alpha


@torch.library.register_fake("torch_gradops::gatv2_backward")
def _gatv2_backward_fake(grad_out, grad_alpha, out, lse, x_src, x_dst, att, edge_attr, edge_weight,
                         indptr, indices, rev_indptr, rev_edge, rev_dst, dropout_mask, negative_slope,
                         dropout_scale, output_mask, edge_attr_rows=None):
    def maybe(flag, like):
        # contiguous whatever the input's strides, as the kernels return them
        return like.new_empty(like.shape) if flag and like is not None else x_src.new_empty((0,))
    return (maybe(output_mask[0], x_src), maybe(output_mask[1], x_dst), maybe(output_mask[2], att),
            maybe(output_mask[3], edge_attr),
            maybe(output_mask[4] and edge_weight is not None, edge_weight))


# ---------------------------------------------------------------------------- vmap rule
def _fold_heads_first(t: torch.Tensor, bdim: Optional[int], batch: int) -> torch.Tensor:
    """``att [H, C]`` (heads first) batched to ``[B*H, C]``."""
    t = t.unsqueeze(0).expand(batch, *t.shape) if bdim is None else t.movedim(bdim, 0)
    return t.reshape(batch * t.size(1), *t.shape[2:])


@torch.library.register_vmap("torch_gradops::gatv2_forward")
def _gatv2_forward_vmap(info, in_dims, x_src, x_dst, att, edge_attr, edge_weight, indptr, indices,
                        dropout_mask, negative_slope, dropout_scale, return_alpha, edge_attr_rows=None):
    """Heads are independent: a vmapped dimension folds into them (``[B, N, H, C] -> [N, B*H, C]``,
    inputs shared by the batch expanded). Raw edge features ``[E, K]`` have no heads and are
    shared by every head: folded only when not vmapped; a vmapped graph (or ``edge_attr_rows``)
    or ``[E, K]`` runs the op once per batch item."""
    args = (x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask, negative_slope,
            dropout_scale, return_alpha, edge_attr_rows)
    in_dims = tuple(in_dims) + (None,) * (len(args) - len(in_dims))
    batch = info.batch_size
    raw_edges = edge_weight is not None
    if (in_dims[5] is not None or in_dims[6] is not None or in_dims[11] is not None
            or (raw_edges and in_dims[3] is not None)):
        return _vmap_per_item(ops.gatv2_forward.default, batch, in_dims, args)
    fold = lambda t, d: None if t is None else _fold_heads(t, d, batch)  # noqa: E731
    out, lse, alpha = ops.gatv2_forward(
        fold(x_src, in_dims[0]), fold(x_dst, in_dims[1]), _fold_heads_first(att, in_dims[2], batch),
        edge_attr if raw_edges else fold(edge_attr, in_dims[3]), fold(edge_weight, in_dims[4]), indptr, indices,
        fold(dropout_mask, in_dims[7]), negative_slope, dropout_scale, return_alpha, edge_attr_rows)
    return (_unfold_heads(out, batch), _unfold_heads(lse, batch), _unfold_heads(alpha, batch)), (1, 1, 1)


# ---------------------------------------------------------------------------- composite path
def _edge_term(edge_attr, edge_weight):
    """``[E, H, C]`` edge term of the pre-activation (materialised: composite paths only)."""
    if edge_attr is None:
        return None
    if edge_weight is None:
        return edge_attr
    # matmul and reshape: einsum and unflatten have no batching rule under forward AD's
    # batched checks (gradcheck's check_batched_forward_grad)
    k, heads, channels = edge_weight.shape
    return (edge_attr @ edge_weight.reshape(k, heads * channels)).reshape(edge_attr.shape[0], heads, channels)


def _preactivation(xs_rows, xd_rows, edge_attr, edge_weight):
    """``z = x_src[j] + x_dst[i]`` (the endpoints' rows, gathered) ``+`` the edge term: the
    pre-activation of every path but the kernels', summed in that order."""
    term = _edge_term(edge_attr, edge_weight)
    return xs_rows + xd_rows if term is None else xs_rows + xd_rows + term


def _leaky_slope(z: torch.Tensor, negative_slope: float) -> torch.Tensor:
    """d leaky_relu(z) / dz in z's dtype (a Python-scalar torch.where would round the slope to
    float32)."""
    return (z > 0).to(z.dtype) * (1.0 - negative_slope) + negative_slope


def _gatv2_backward_composite(grad_out, grad_alpha, x_src, x_dst, att, edge_attr, edge_weight, src, dst,
                              num_dst, mask, negative_slope, scale, needs):
    """The first-order gradients written in plain PyTorch ops (CSC edge order): what
    ``torch.compile`` traces for a differentiable backward (Dynamo cannot trace the recomputing
    :class:`~torch_gradops._edge_chunks.EdgeMap`, which defines ``jvp``).

    Exact, including the softmax's dependence on the inputs (recomputed, not taken from the
    saved log-sum-exp). It materialises ``E x H x C`` tensors and computes in float32 for half
    types. Returns ``[g_x_src, g_x_dst, g_att, g_edge_attr, g_edge_weight]`` (None where not
    ``needs``).
    """
    dtype = x_src.dtype
    acc = _acc_dtype(dtype)
    cast = lambda t: None if t is None else t.to(acc)  # noqa: E731
    x_src, x_dst, att, edge_attr, edge_weight, grad_out, grad_alpha = map(
        cast, (x_src, x_dst, att, edge_attr, edge_weight, grad_out, grad_alpha))
    heads = att.size(0)
    xs_e = x_src.index_select(0, src)
    z = _preactivation(xs_e, x_dst.index_select(0, dst), edge_attr, edge_weight)
    lr = F.leaky_relu(z, negative_slope)
    s = (lr * att).sum(-1)
    smax = torch.full((num_dst, heads), float("-inf"), dtype=acc, device=s.device)
    smax = smax.scatter_reduce(0, dst.view(-1, 1).expand(-1, heads), s.detach(), "amax", include_self=True)
    p = torch.exp(s - smax.index_select(0, dst))
    alpha = p / torch.zeros((num_dst, heads), dtype=acc, device=s.device).index_add(0, dst, p).index_select(0, dst)
    keep = None if mask is None else mask.to(acc) * scale
    alpha_d = alpha if keep is None else alpha * keep
    g_out_e = grad_out.index_select(0, dst)
    g_alpha_d = (g_out_e * xs_e).sum(-1)  # [E, H]
    if grad_alpha is not None:
        g_alpha_d = g_alpha_d + grad_alpha
    g_alpha = g_alpha_d if keep is None else g_alpha_d * keep
    ds = alpha * (g_alpha - torch.zeros_like(smax).index_add(0, dst, alpha * g_alpha).index_select(0, dst))
    # d leaky_relu(z)/dz: a constant almost everywhere, so its own derivative is zero
    dz = ds.unsqueeze(-1) * att * _leaky_slope(z, negative_slope)
    g = [None] * 5
    if needs[0]:
        g[0] = torch.zeros_like(x_src).index_add(0, src, dz + alpha_d.unsqueeze(-1) * g_out_e)
    if needs[1]:
        g[1] = torch.zeros_like(x_dst).index_add(0, dst, dz)
    if needs[2]:
        g[2] = (ds.unsqueeze(-1) * lr).sum(0)
    if needs[3] or needs[4]:
        width = heads * dz.size(-1)
        flat = dz.reshape(dz.size(0), width)  # explicit sizes: E may be 0
        if needs[3]:
            g[3] = dz if edge_weight is None else flat @ edge_weight.reshape(edge_weight.size(0), width).t()
        if needs[4]:
            g[4] = (edge_attr.t() @ flat).reshape(edge_weight.shape)
    return [None if t is None else t.to(dtype) for t in g]


# ---------------------------------------------------------------------------- higher-order path
class _Gatv2EdgeMaps:
    """GATv2's per-edge maps on one graph, as :class:`~torch_gradops._edge_chunks.EdgeMap` s
    (chunked, recomputed for their derivatives: no ``E x H x C`` tensor outlives a chunk):

    * :meth:`scores`: ``s[e,h] = sum_c att[h,c] leaky_relu(z[e,h,c])`` with ``z`` the
      pre-activation (``x_src[j] + x_dst[i]`` + the edge term), ``[E, H]`` in CSC order;
    * :meth:`scores_vjp`: its vector-Jacobian product, from ``dz = ds * att * leaky_relu'(z)``
      for ``ds [E, H]``: grad ``x_dst`` as destination row blocks over CSC chunks, grad
      ``x_src`` as source row blocks over chunks of the reverse (source-grouped) index, grad
      ``att`` and ``edge_weight`` as sums, grad ``edge_attr`` per edge.

    The scores' backward is :meth:`scores_vjp`, and that one's derivatives recompute its chunks,
    so first and second derivatives of the op keep to one chunk's ``[chunk, H, C]``
    temporaries (a third derivative records the second's recomputed chunks)."""

    def __init__(self, edges: _Edges, heads: int, channels: int, negative_slope: float):
        self.slope = float(negative_slope)
        # The chunk functions close over these; under torch.func they run at other transform
        # levels than this backward's, so they must be plain tensors (constants at every level).
        indptr, indices, dst, rev_indptr, rev_edge, rev_dst = map(plain_tensor, edges[:6])
        step = chunk_size(indices.numel(), heads, channels)
        with torch._C._DisableFuncTorch():
            self.src, self.dst = indices.long(), dst.long()
            self.indptr, self.rev_indptr = indptr.long(), rev_indptr.long()
            self.by_dst = EdgeChunks(None, node_ranges(indptr, step))
            rev_edge = rev_edge.long()
            self.by_src = EdgeChunks(rev_edge, node_ranges(rev_indptr, step))
            self.rev_src, self.rev_dst = self.src.index_select(0, rev_edge), rev_dst.long()

    # chunk functions (see EdgeMapSpec): edge inputs (ds,) ea; node inputs the chunk's x_src and
    # x_dst rows (gathered by EdgeMap), att, w
    def _scores_chunk(self, n0, n1, e0, e1, edge_in, nodes):
        (ea,), (xs_rows, xd_rows, att, w) = edge_in, nodes
        z = _preactivation(xs_rows, xd_rows, ea, w)
        return ((F.leaky_relu(z, self.slope) * att).sum(-1),)

    def _dz(self, ds, z, att):
        return _leaky_relu_grad(ds.unsqueeze(-1) * att, z, self.slope)

    def _by_dst_chunk(self, needs, n0, n1, e0, e1, edge_in, nodes):
        """needs = (x_dst, att, edge_attr, edge_weight): ``(g_edge_attr rows, g_x_dst rows,
        g_att, g_edge_weight)``, the ones needed."""
        (ds, ea), (xs_rows, xd_rows, att, w) = edge_in, nodes
        d_idx = self.dst[e0:e1]
        z = _preactivation(xs_rows, xd_rows, ea, w)
        dz = self._dz(ds, z, att)
        width = dz.size(1) * dz.size(2)
        flat = dz.reshape(dz.size(0), width)  # explicit sizes: a chunk may have no edges
        edge_out, rows, sums = [], [], []
        if needs[2]:
            edge_out.append(dz if w is None else flat @ w.reshape(w.size(0), width).t())
        if needs[0]:
            rows.append(sum_sorted_rows(dz, self.indptr[n0:n1 + 1] - e0, d_idx - n0))
        if needs[1]:
            sums.append((ds.unsqueeze(-1) * F.leaky_relu(z, self.slope)).sum(0))
        if needs[3]:
            sums.append((ea.t() @ flat).reshape(w.shape))
        return (*edge_out, *rows, *sums)

    def _by_src_chunk(self, n0, n1, e0, e1, edge_in, nodes):
        (ds, ea), (xs_rows, xd_rows, att, w) = edge_in, nodes
        dz = self._dz(ds, _preactivation(xs_rows, xd_rows, ea, w), att)
        return (sum_sorted_rows(dz, self.rev_indptr[n0:n1 + 1] - e0, self.rev_src[e0:e1] - n0),)

    # maps
    def scores(self, x_src, x_dst, att, ea, w):
        """``[E, H]`` scores (CSC order)."""
        def vjp(inputs, grads, needs):
            ea_, xs, xd, a, w_ = inputs
            g = self.scores_vjp(grads[0], xs, xd, a, ea_, w_, (needs[1], needs[2], needs[3], needs[0], needs[4]))
            return g[3], g[0], g[1], g[2], g[4]
        spec = EdgeMapSpec(self._scores_chunk, self.by_dst, 1, 1, 0, (self.src, self.dst), vjp)
        return EdgeMap.apply(spec, ea, x_src, x_dst, att, w)[0]

    def scores_vjp(self, ds, x_src, x_dst, att, ea, w, needs):
        """``[g_x_src, g_x_dst, g_att, g_edge_attr, g_edge_weight]`` of ``<ds, scores>`` (None
        where not ``needs`` or the input is None)."""
        needs = [bool(n) and t is not None for n, t in zip(needs, (x_src, x_dst, att, ea, w))]
        grads: List[Optional[torch.Tensor]] = [None] * 5
        rest = (needs[1], needs[2], needs[3], needs[4])
        if any(rest):
            spec = EdgeMapSpec(functools.partial(self._by_dst_chunk, rest), self.by_dst, 2, int(needs[3]),
                               int(needs[1]), (self.src, self.dst))
            outs = list(EdgeMap.apply(spec, ds, ea, x_src, x_dst, att, w))
            for i in (3, 1, 2, 4):  # the chunk function's output order
                if needs[i]:
                    grads[i] = outs.pop(0)
        if needs[0]:
            spec = EdgeMapSpec(self._by_src_chunk, self.by_src, 2, 0, 1, (self.rev_src, self.rev_dst))
            grads[0] = EdgeMap.apply(spec, ds, ea, x_src, x_dst, att, w)[0]
        return grads


def _gatv2_backward_recomputing(grad_out, grad_alpha, x_src, x_dst, att, edge_attr, edge_weight, lse,
                                edges: _Edges, mask, negative_slope, scale, needs):
    """The first-order gradients as a differentiable computation that never holds an
    ``E x H x C`` tensor beyond one chunk of edges: the fused SpMM/SDDMM primitives and
    ``E x H`` ops for the softmax and the messages, :class:`_Gatv2EdgeMaps` for the scores.
    For double backward and the torch.func reverse transforms. Half types compute in float32."""
    dtype = x_src.dtype
    acc = _acc_dtype(dtype)
    xs, xd, a, ea, w, g = (None if t is None else t.to(acc)
                           for t in (x_src, x_dst, att, edge_attr, edge_weight, grad_out))
    maps = _Gatv2EdgeMaps(edges, att.size(0), att.size(1), negative_slope)
    p = _EdgeSoftmax.apply(maps.scores(xs, xd, a, ea, w), lse, *edges)
    keep = None if mask is None else mask.to(acc) * scale
    d_alpha = _edge_dot(g, xs, edges)
    if grad_alpha is not None:
        d_alpha = d_alpha + grad_alpha.to(acc)
    ds = _softmax_jvp(p, d_alpha if keep is None else d_alpha * keep, edges)
    grads = maps.scores_vjp(ds, xs, xd, a, ea, w, needs)
    if needs[0]:  # the messages' share: sum over each source's edges of alpha * grad_out[i]
        grads[0] = grads[0] + _edge_aggregate(p if keep is None else p * keep, g, edges, False)
    return [None if t is None else t.to(dtype) for t in grads]


def _gatv2_composite(x_src, x_dst, att, edge_attr, edge_weight, graph: BipartiteCSC, mask, negative_slope: float,
                     dropout_scale: float):
    """``(out, alpha)`` (alpha in CSC order; ``edge_attr`` in CSC order) in plain PyTorch ops,
    differentiable by PyTorch in every mode and at every order; holds ``E x H x C`` (see
    :mod:`._transforms` for when it runs)."""
    acc = _acc_dtype(x_src.dtype)
    xs = x_src.to(acc)
    src, dst = _composite_edges(graph)
    z = _preactivation(xs.index_select(0, src), x_dst.to(acc).index_select(0, dst),
                       None if edge_attr is None else edge_attr.to(acc),
                       None if edge_weight is None else edge_weight.to(acc))
    scores = (F.leaky_relu(z, negative_slope) * att.to(acc)).sum(-1)
    return _attend_composite(scores, xs, graph, src, dst, mask, dropout_scale, x_src.dtype)


# ---------------------------------------------------------------------------- autograd
_N_DIFF = 5  # x_src, x_dst, att, edge_attr, edge_weight
# indptr, indices, rev_indptr, rev_edge, rev_dst, dropout_mask, slope, scale, return_alpha, edge_attr_rows
_N_REST = 10


def _csc_edge_attr(edge_attr, rows):
    """``edge_attr``'s rows in CSC order: itself, or its rows read through ``rows`` (the op's
    ``edge_attr_rows``); what every path but the kernels' takes."""
    return edge_attr if edge_attr is None or rows is None else edge_attr.index_select(0, rows)


def _rows_grad(grad, rows, edge_attr):
    """A CSC-order gradient of ``edge_attr`` in ``edge_attr``'s own rows (zeros for the rows no
    edge reads), differentiably: :func:`_csc_edge_attr`'s adjoint, a sum over the positions that
    read a row (one each for a graph's perm, so exact and deterministic)."""
    if grad is None or rows is None:
        return grad
    return grad.new_zeros((edge_attr.size(0),) + tuple(grad.shape[1:])).index_add(0, rows.long(), grad)


def _wanted_grads(ctx, grad_out, grad_alpha, out):
    """``(needs, grad_out, grad_alpha)`` for a first-order backward: which of the five
    differentiable inputs get a gradient (``ctx.has``: the inputs given), a missing output
    gradient as zeros, an empty alpha gradient as None."""
    # Dynamo, tracing inside a torch.func transform, reports inputs wrapped by the transform
    # as not needing a gradient (their gradients then came out zero): compute them all.
    wanted = [True] * _N_DIFF if torch.compiler.is_compiling() else ctx.needs_input_grad[:_N_DIFF]
    needs = [n and h for n, h in zip(wanted, ctx.has)]
    if grad_alpha is not None and grad_alpha.numel() == 0:
        grad_alpha = None
    return needs, torch.zeros_like(out) if grad_out is None else grad_out, grad_alpha


def _fused_backward(grad_out, grad_alpha, out, lse, x_src, x_dst, att, edge_attr, edge_weight, indptr, indices,
                    rev_indptr, rev_edge, rev_dst, dropout_mask, negative_slope, dropout_scale, needs,
                    edge_attr_rows) -> tuple:
    """The deterministic backward kernel's gradients (None where not needed)."""
    grads = ops.gatv2_backward(
        grad_out.contiguous(), None if grad_alpha is None else grad_alpha.contiguous(), out, lse,
        x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, rev_indptr, rev_edge, rev_dst,
        dropout_mask, negative_slope, dropout_scale, needs, edge_attr_rows)
    return tuple(g if n else None for g, n in zip(grads, needs))


class _GATv2AttentionFirstOrder(torch.autograd.Function):
    """Forward and backward of :class:`GATv2AttentionFunction`, without ``jvp``: the class that
    ``torch.compile`` traces (Dynamo cannot trace a Function that defines ``jvp``)."""

    # vmap runs forward/backward/jvp on batched tensors: the op's rule folds the batch into heads
    generate_vmap_rule = True

    @staticmethod
    def forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, rev_indptr, rev_edge,
                rev_dst, dropout_mask, negative_slope, dropout_scale, return_alpha, edge_attr_rows=None):
        return ops.gatv2_forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices,
                                 dropout_mask, negative_slope, dropout_scale, return_alpha, edge_attr_rows)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, rev_indptr, rev_edge, rev_dst,
         dropout_mask, negative_slope, dropout_scale, return_alpha, *rest) = inputs
        edge_attr_rows = rest[0] if rest else None
        out, lse, _ = output
        # One call: each call replaces the previous set (lse left differentiable gets a None
        # tangent, which trips an internal assert in forward AD).
        ctx.mark_non_differentiable(*((lse,) if return_alpha else (lse, output[2])))
        ctx.negative_slope = negative_slope
        ctx.dropout_scale = dropout_scale
        ctx.has = (True, True, True, edge_attr is not None, edge_weight is not None)
        ctx.has_rev = rev_indptr is not None
        ctx.return_alpha = return_alpha
        ctx.save_for_backward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, rev_indptr,
                              rev_edge, rev_dst, dropout_mask, out, lse, edge_attr_rows)
        ctx.save_for_forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask,
                             out, lse, edge_attr_rows)

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_alpha):
        (x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, rev_indptr, rev_edge, rev_dst,
         dropout_mask, out, lse, rows) = ctx.saved_tensors
        needs, grad_out, grad_alpha = _wanted_grads(ctx, grad_out, grad_alpha, out)
        none_rest = (None,) * _N_REST
        if not any(needs):
            return (None,) * _N_DIFF + none_rest
        if torch.is_grad_enabled() or any(is_transformed(t) for t in (grad_out, grad_alpha, x_src, x_dst, att,
                                                                       edge_attr, edge_weight)):
            # create_graph=True (every torch.func.grad/vjp records for higher orders), or batched
            # tensors from vmap: the same gradients as a differentiable computation (exact, not
            # the fused kernel). Its per-node sums of edge rows are segment sums in a fixed
            # order (_segments): bitwise repeatable on CPU and CUDA.
            ea = _csc_edge_attr(edge_attr, rows)
            if ctx.has_rev and not torch.compiler.is_compiling():
                edges = _Edges.of_csc(indptr, indices, rev_indptr, rev_edge, rev_dst, x_src.size(0))
                grads = _gatv2_backward_recomputing(grad_out, grad_alpha, x_src, x_dst, att, ea, edge_weight,
                                                    lse, edges, dropout_mask, ctx.negative_slope, ctx.dropout_scale,
                                                    needs)
            else:
                dst = csc_destinations(indptr, indices.numel()).long()
                grads = _gatv2_backward_composite(grad_out, grad_alpha, x_src, x_dst, att, ea, edge_weight,
                                                  indices.long(), dst, x_dst.size(0), dropout_mask,
                                                  ctx.negative_slope, ctx.dropout_scale, needs)
            grads[3] = _rows_grad(grads[3], rows, edge_attr)
            return tuple(grads) + none_rest

        if not ctx.has_rev:
            raise RuntimeError("GATv2AttentionFunction: the reverse index was not passed to forward, "
                               "but a gradient is needed; call gatv2_attention() instead")
        return _fused_backward(grad_out, grad_alpha, out, lse, x_src, x_dst, att, edge_attr, edge_weight, indptr,
                               indices, rev_indptr, rev_edge, rev_dst, dropout_mask, ctx.negative_slope,
                               ctx.dropout_scale, needs, rows) + none_rest


# Autograd on the op itself, as for gat_forward: a program that calls the op without the
# Functions above (torch.export's exported program, which inlines them) differentiates it with
# this formula; without one the exported layer's input gradients were None.
def _gatv2_forward_setup_context(ctx, inputs, output):
    (x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask, negative_slope, dropout_scale,
     return_alpha, *rest) = inputs
    edge_attr_rows = rest[0] if rest else None
    out, lse, _ = output
    ctx.mark_non_differentiable(lse)  # the log-sum-exp is the backward's, not an output to differentiate
    ctx.negative_slope = negative_slope
    ctx.dropout_scale = dropout_scale
    ctx.has = (True, True, True, edge_attr is not None, edge_weight is not None)
    ctx.save_for_backward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask, out, lse,
                          edge_attr_rows)


def _gatv2_forward_backward(ctx, grad_out, grad_lse, grad_alpha):
    x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, dropout_mask, out, lse, rows = ctx.saved_tensors
    needs, grad_out, grad_alpha = _wanted_grads(ctx, grad_out, grad_alpha, out)
    rest = (None,) * 7  # indptr, indices, dropout_mask, slope, scale, return_alpha, edge_attr_rows
    if not any(needs):
        return (None,) * _N_DIFF + rest
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(
            is_transformed(t) for t in (grad_out, grad_alpha, x_src, x_dst, att, edge_attr, edge_weight)):
        dst = csc_destinations(indptr, indices.numel()).long()
        grads = _gatv2_backward_composite(grad_out, grad_alpha, x_src, x_dst, att, _csc_edge_attr(edge_attr, rows),
                                          edge_weight, indices.long(), dst, x_dst.size(0), dropout_mask,
                                          ctx.negative_slope, ctx.dropout_scale, needs)
        grads[3] = _rows_grad(grads[3], rows, edge_attr)
        return tuple(grads) + rest
    # No graph object here: build the reverse index as BipartiteCSC does.
    edges = _Edges.of(BipartiteCSC(indptr, indices, x_src.size(0), validate=False))
    return _fused_backward(grad_out, grad_alpha, out, lse, x_src, x_dst, att, edge_attr, edge_weight, indptr, indices,
                           edges.rev_indptr, edges.rev_edge, edges.rev_dst, dropout_mask, ctx.negative_slope,
                           ctx.dropout_scale, needs, rows) + rest


torch.library.register_autograd("torch_gradops::gatv2_forward", _gatv2_forward_backward,
                                setup_context=_gatv2_forward_setup_context)


class GATv2AttentionFunction(_GATv2AttentionFirstOrder):
    """Autograd for the fused GATv2 kernels. All per-edge tensors are in CSC edge order, except
    ``edge_attr`` when ``edge_attr_rows`` is given.

    ``forward(x_src, x_dst, att, edge_attr, edge_weight, indptr, indices, rev_indptr, rev_edge,
    rev_dst, dropout_mask, negative_slope, dropout_scale, return_alpha, edge_attr_rows=None)
    -> (out, lse, alpha)``

    * ``x_src [num_src, H, C]``, ``x_dst [num_dst, H, C]``, ``att [H, C]``; ``edge_attr [E, K]``
      with ``edge_weight [K, H, C]``, or ``edge_attr [E, H, C]`` (already projected) with
      ``edge_weight=None``, or both None; ``dropout_mask [E, H]`` bool or None (kept edges).
    * ``edge_attr_rows [E]`` (the indices' dtype) or None: the row of ``edge_attr`` that each CSC
      position reads (a graph's ``perm``, distinct rows; ``edge_attr`` then has any number of
      rows, and rows no edge reads get zero gradient). The kernels read through it, so edge
      features in the input edge order need no reordered copy.
    * ``out [num_dst, H, C]``; ``lse [num_dst, H]`` (float64; non-differentiable log-sum-exp of the
      scores); ``alpha [E, H]`` after dropout if ``return_alpha`` else ``[0, H]``.
    * The reverse (source-grouped) index ``rev_*`` is only needed when a gradient is wanted.

    Backward: the deterministic kernel. Under ``create_graph=True`` (and every torch.func
    reverse transform, and for batched output gradients from vmap) it switches to a
    differentiable recomputation (exact at every order) whose ``E x H x C`` intermediates live
    one chunk of edges at a time through second derivatives (:func:`_gatv2_backward_recomputing`; inside
    ``torch.compile``, plain PyTorch ops that build them whole). Forward-mode AD (``jvp``) is
    composite, in edge chunks whose temporaries hold about ``E x H`` elements.
    """

    @staticmethod
    def jvp(ctx, t_xs, t_xd, t_att, t_ea, t_w, *_):
        x_src, x_dst, att, ea, w, indptr, indices, mask, out, lse, rows = ctx.saved_tensors
        t_out, t_alpha = _gatv2_jvp((t_xs, t_xd, t_att, t_ea, t_w), x_src, x_dst, att, ea, w, indptr, indices,
                                    mask, lse, ctx.negative_slope, ctx.dropout_scale, ctx.return_alpha, rows)
        return t_out, None, t_alpha


def _gatv2_jvp(tangents, x_src, x_dst, att, ea, w, indptr, indices, mask, lse, negative_slope, dropout_scale,
               want_alpha, edge_attr_rows=None):
    """Tangents of ``out`` and of ``alpha`` (CSC order; None unless ``want_alpha``) along
    ``tangents`` (of x_src, x_dst, att, edge_attr, edge_weight; None entries: no tangent).
    ``ea`` and its tangent are read through ``edge_attr_rows`` when given."""
    t_xs, t_xd, t_att, t_ea, t_w = tangents
    ea, t_ea = _csc_edge_attr(ea, edge_attr_rows), _csc_edge_attr(t_ea, edge_attr_rows)
    acc = _acc_dtype(x_src.dtype)
    cast = lambda t: None if t is None else t.to(acc)  # noqa: E731
    lse = lse.to(acc)  # (float64 from the kernels) only a shift: alpha is renormalised below
    xs, xd, att_a, ea_a, w_a = map(cast, (x_src, x_dst, att, ea, w))
    t_xs, t_xd, t_att = map(cast, (t_xs, t_xd, t_att))
    t_ea = cast(t_ea) if ea is not None else None
    t_w = cast(t_w) if w is not None else None
    src = indices.long()
    dst = csc_destinations(indptr, indices.numel()).long()
    num_edges, heads, channels = src.numel(), x_src.size(-2), x_src.size(-1)
    # Edges in chunks whose [chunk, H, C] temporaries hold about E x H elements: memory
    # O(E x H), the same arithmetic as one pass.
    step = min(max(num_edges, 1), chunk_size(num_edges, heads, channels))
    keep = mask.to(acc) * dropout_scale if mask is not None else None

    def z_of(lo, hi):
        s, d = src[lo:hi], dst[lo:hi]
        z = _preactivation(gather_rows(xs, s), gather_rows(xd, d), None if ea_a is None else ea_a[lo:hi], w_a)
        tz = None
        for t, idx in ((t_xs, s), (t_xd, d)):
            if t is not None:
                g = gather_rows(t, idx)
                tz = g if tz is None else tz + g
        if t_ea is not None:
            g = _edge_term(t_ea[lo:hi], w_a)
            tz = g if tz is None else tz + g
        if t_w is not None:
            g = _edge_term(ea_a[lo:hi], t_w)
            tz = g if tz is None else tz + g
        return z, tz

    # pass 1: alpha and the score tangents ts[e,h] = d s[e,h]
    alpha_parts, ts_parts = [], []
    for lo in range(0, num_edges, step):
        hi = min(lo + step, num_edges)
        z, tz = z_of(lo, hi)
        lr = F.leaky_relu(z, negative_slope)
        alpha_parts.append(torch.exp((lr * att_a).sum(-1) - lse.index_select(0, dst[lo:hi])))
        ts = torch.zeros_like(alpha_parts[-1])
        if tz is not None:
            slope = _leaky_slope(z, negative_slope)
            ts = ts + (att_a * slope * tz).sum(-1)
        if t_att is not None:
            ts = ts + (t_att * lr).sum(-1)
        ts_parts.append(ts)
    alpha = torch.cat(alpha_parts) if alpha_parts else lse.new_zeros((0, heads))
    if alpha.numel():
        # renormalised (a no-op in value: lse only shifts the exponent), so that alpha is a
        # differentiable softmax of the scores: the saved lse is a constant to autograd, and a
        # tangent differentiated again (reverse over forward) needs the normaliser's derivative
        alpha = alpha / gather_rows(sum_sorted_rows(alpha, indptr, dst), dst)
    ts = torch.cat(ts_parts) if ts_parts else alpha
    t_alpha = alpha * (ts - gather_rows(sum_sorted_rows(alpha * ts, indptr, dst), dst))
    if keep is not None:
        t_alpha, alpha = t_alpha * keep, alpha * keep
    # pass 2: t_out = sum_e t_alpha x_src[j] + alpha t_x_src[j]
    t_out = torch.zeros((x_dst.size(0), heads, channels), dtype=acc, device=x_src.device)
    for lo in range(0, num_edges, step):
        hi = min(lo + step, num_edges)
        s, d = src[lo:hi], dst[lo:hi]
        msg = t_alpha[lo:hi].unsqueeze(-1) * gather_rows(xs, s)
        if t_xs is not None:
            msg = msg + alpha[lo:hi].unsqueeze(-1) * gather_rows(t_xs, s)
        t_out = index_add_rows(t_out, d, msg)
    return t_out.to(x_src.dtype), (t_alpha.to(x_src.dtype) if want_alpha else None)


# ---------------------------------------------------------------------------- public API
def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float64/float32/float16/bfloat16, got {t.dtype}")
    check_backend(t, name)


def _check_inputs(x_src, x_dst, att, graph, edge_attr, edge_weight, dropout, csc_order: bool = False):
    if not isinstance(graph, BipartiteCSC):
        raise TypeError(f"graph must be a torch_gradops.BipartiteCSC, got {type(graph).__name__}")
    for name, t in (("x_src", x_src), ("x_dst", x_dst), ("att", att)):
        _check_tensor(t, name)
    if x_src.dim() != 3:
        raise ValueError(f"x_src must have shape [num_src, heads, channels], got {tuple(x_src.shape)}")
    num_src, heads, channels = x_src.shape
    if x_dst.dim() != 3 or x_dst.shape[1:] != (heads, channels):
        raise ValueError(f"x_dst must have shape [num_dst, heads={heads}, channels={channels}], "
                         f"got {tuple(x_dst.shape)}")
    if att.shape != (heads, channels):
        raise ValueError(f"att must have shape [heads, channels] = {(heads, channels)}, got {tuple(att.shape)}")
    if num_src != graph.num_src:
        raise ValueError(f"x_src has {num_src} source rows but graph.num_src is {graph.num_src}")
    if x_dst.size(0) != graph.num_dst:
        raise ValueError(f"x_dst has {x_dst.size(0)} rows but graph.num_dst is {graph.num_dst}")
    for name, t in (("x_dst", x_dst), ("att", att)):
        if t.dtype != x_src.dtype:
            raise TypeError(f"{name} ({t.dtype}) must have the dtype of x_src ({x_src.dtype})")
        if t.device != x_src.device:
            raise ValueError(f"{name} ({t.device}) must be on the device of x_src ({x_src.device})")
    if graph.device != x_src.device:
        raise ValueError(f"graph is on {graph.device} but x_src is on {x_src.device}; use graph.to(device)")
    if edge_weight is not None and edge_attr is None:
        raise ValueError("edge_weight was given without edge_attr")
    if edge_attr is not None:
        _check_tensor(edge_attr, "edge_attr")
        E = graph.num_edges if csc_order else graph.num_input_edges  # rows in CSC / original order
        if edge_weight is not None:
            _check_tensor(edge_weight, "edge_weight")
            if edge_attr.dim() != 2 or edge_attr.size(0) != E:
                raise ValueError(f"edge_attr must have shape [E={E}, edge_dim] when edge_weight is given, "
                                 f"got {tuple(edge_attr.shape)}")
            expect = (edge_attr.size(1), heads, channels)
            if edge_weight.shape != expect:
                raise ValueError(f"edge_weight must have shape [edge_dim, heads, channels] = {expect}, "
                                 f"got {tuple(edge_weight.shape)}")
        elif edge_attr.shape != (E, heads, channels):
            raise ValueError(f"edge_attr without edge_weight must be already projected, of shape "
                             f"[E, heads, channels] = {(E, heads, channels)}, got {tuple(edge_attr.shape)}; "
                             f"pass edge_weight [edge_dim, heads, channels] for raw [E, edge_dim] features")
        for name, t in (("edge_attr", edge_attr), ("edge_weight", edge_weight)):
            if t is None:
                continue
            if t.dtype != x_src.dtype:
                raise TypeError(f"{name} ({t.dtype}) must have the dtype of x_src ({x_src.dtype})")
            if t.device != x_src.device:
                raise ValueError(f"{name} ({t.device}) must be on the device of x_src ({x_src.device})")
    if not (0.0 <= float(dropout) <= 1.0):
        raise ValueError(f"dropout must be in [0, 1], got {dropout}")


def gatv2_attention(x_src: torch.Tensor, x_dst: torch.Tensor, att: torch.Tensor, graph: BipartiteCSC,
                    negative_slope: float = 0.2, edge_attr: Optional[torch.Tensor] = None,
                    edge_weight: Optional[torch.Tensor] = None, dropout: float = 0.0,
                    training: bool = False, return_attention: bool = False
                    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Fused GATv2 attention and aggregation (PyG ``GATv2Conv`` between its projections and bias).

    For every destination ``i``, head ``h`` and incoming edge ``e = (j -> i)``::

        z[e,h,:]   = x_src[j,h,:] + x_dst[i,h,:] + sum_k edge_attr[e,k] * edge_weight[k,h,:]
        s[e,h]     = sum_c att[h,c] * leaky_relu(z[e,h,c], negative_slope)
        alpha[e,h] = softmax of s over the incoming edges of i   (then dropout if training)
        out[i,h,:] = sum_e alpha[e,h] * x_src[j,h,:]

    The edge term is formed inside the kernels: the ``[E, H, C]`` projected edge features are
    never stored. Gradients (for all five tensors) are deterministic and use ``[E, H]``
    workspaces.

    Args:
        x_src: ``[num_src, H, C]`` projected source features (PyG's ``x_l``; also the message).
        x_dst: ``[num_dst, H, C]`` projected destination features (PyG's ``x_r``).
        att: ``[H, C]`` attention vector.
        graph: the edges, as a :class:`BipartiteCSC` on the features' device.
        negative_slope: LeakyReLU slope.
        edge_attr: ``[E, edge_dim]`` edge features in the original edge order (with
            ``edge_weight``), or ``[E, H, C]`` features already projected (without it), or None.
        edge_weight: ``[edge_dim, H, C]`` edge projection (PyG: ``lin_edge.weight.t()`` viewed
            as ``[edge_dim, H, C]``), or None.
        dropout: attention dropout probability in ``[0, 1]``, applied when ``training`` and
            scaled by ``1/(1-dropout)`` like ``F.dropout``.
        return_attention: also return ``alpha [E, H]`` (after dropout) in the original edge order.

    Returns:
        ``out [num_dst, H, C]``, or ``(out, alpha)``. Destinations without incoming edges get zeros.
    """
    _check_inputs(x_src, x_dst, att, graph, edge_attr, edge_weight, dropout)
    return _gatv2_attention_csc(x_src, x_dst, att, graph, negative_slope, edge_attr, edge_weight, dropout, training,
                                return_attention, input_order=True)


def _gatv2_attention_csc(x_src, x_dst, att, graph: BipartiteCSC, negative_slope: float, edge_attr, edge_weight,
                         dropout: float, training: bool, return_attention: bool, input_order: bool = False):
    """:func:`gatv2_attention` on checked inputs, with the edge features ``edge_attr`` already in
    CSC order (what ``graph.edge_order`` gives: for callers that keep them so across calls), or,
    with ``input_order``, in the graph's input edge order. The kernels read the latter through
    ``graph.perm`` (no reordered copy, and its gradient is written in place); the composite and
    forward-mode paths reorder it themselves."""
    rows = graph.perm if input_order and edge_attr is not None else None
    heads = x_src.size(1)
    mask = None
    scale = 1.0
    if training and dropout > 0.0:
        mask, scale = _dropout_mask(graph.num_edges, heads, dropout, x_src.device)
    diff = (x_src, x_dst, att, edge_attr, edge_weight)
    compiling = torch.compiler.is_compiling()
    # (GATv2's jvp, composite in chunks, has no batching rule under jacrev(jacfwd(f)).)
    how = route([t for t in diff if t is not None], reverse_over_forward=False)
    if how == COMPOSITE:
        _prepare_graph(graph, reverse=False, inverse=bool(return_attention))
        ea = graph.edge_order(edge_attr) if rows is not None else edge_attr
        out, alpha = _gatv2_composite(x_src, x_dst, att, ea, edge_weight, graph, mask, float(negative_slope), scale)
        return (out, graph.original_order(alpha)) if return_attention else out
    # An input with a forward-mode tangent may have its tangent's graph differentiated later
    # (autograd over jvp), so it gets the reverse index too, as in gat_attention.
    want_reverse = torch.jit.is_tracing() or torch.is_grad_enabled() and (
        compiling or any(t is not None and (t.requires_grad or has_tangent(t)) for t in diff))
    rev = _prepare_graph(graph, reverse=want_reverse, inverse=bool(return_attention))
    rev_tensors = (rev.indptr, rev.edge, rev.dst) if want_reverse else (None, None, None)
    tail = (graph.indptr, graph.indices, *rev_tensors, mask, float(negative_slope), float(scale),
            bool(return_attention), rows)
    if not compiling:
        out, _, alpha = GATv2AttentionFunction.apply(*diff, *tail)
    elif how == FUSED_JVP:
        # Dynamo does not call a Function's jvp (see _transforms): the tangents come from the
        # same JVP code here, the primal from the first-order Function.
        primals, tangents = split_duals(diff)
        out, lse, alpha = _GATv2AttentionFirstOrder.apply(*primals, *tail)
        t_out, t_alpha = _gatv2_jvp(tangents, *primals, graph.indptr, graph.indices, mask, lse,
                                    float(negative_slope), float(scale), bool(return_attention), rows)
        out = join_dual(out, t_out)
        alpha = join_dual(alpha, t_alpha) if return_attention else alpha
    else:
        # Dynamo cannot trace a Function that defines jvp: compiled code gets the first-order one.
        out, _, alpha = _GATv2AttentionFirstOrder.apply(*diff, *tail)
    if return_attention:
        return out, graph.original_order(alpha)
    return out


# ---------------------------------------------------------------------------- cugraph-ops compat
def mha_gat_v2_n2n(feat, attn_weights: torch.Tensor, graph: BipartiteCSC, num_heads: int = 1,
                   activation: str = "LeakyReLU", negative_slope: float = 0.2, concat_heads: bool = True,
                   edge_feat: Optional[torch.Tensor] = None, deterministic_dgrad: bool = False,
                   deterministic_wgrad: bool = False) -> torch.Tensor:
    """Drop-in for ``pylibcugraphops.pytorch.operators.mha_gat_v2_n2n`` (withdrawn in RAPIDS 25.02).

    The conventions follow the RAPIDS API documentation of that function
    (docs.rapids.ai/api/cugraph/stable/api_docs/api/ops/pylibcugraphops.pytorch.operators.mha_gat_v2_n2n)
    and its caller, cugraph-pyg's ``GATv2Conv`` (python/cugraph-pyg/cugraph_pyg/nn/conv/gatv2_conv.py
    in rapidsai/cugraph), which passes ``lin_src(x)`` (or the pair ``(lin_src(x_src),
    lin_dst(x_dst))``), ``att`` of shape ``[heads*C]`` and ``lin_edge(edge_attr)``.

    Args:
        feat: ``[n, num_heads*C]`` already projected node features, used as sources and (its first
            ``graph.num_dst`` rows) as destinations (shared weights); or a
            ``(feat_src [n_src, num_heads*C], feat_dst [n_dst, num_heads*C])`` pair.
        attn_weights: ``[num_heads*C]`` attention vector (one vector: GATv2 scores the sum).
        graph: a :class:`BipartiteCSC`.
        activation: ``"LeakyReLU"`` (or ``"Linear"``/None for no activation).
        edge_feat: ``[E, num_heads*C]`` already projected edge features, in the graph's original
            edge order, or None.
        deterministic_dgrad, deterministic_wgrad: accepted for compatibility and ignored: the
            gradients here are always deterministic.

    Returns:
        ``[n_dst, num_heads*C]`` if ``concat_heads`` else ``[n_dst, C]`` (mean over heads).
    """
    del deterministic_dgrad, deterministic_wgrad  # always deterministic
    feat_src, feat_dst, edge_feat, negative_slope = _cugraph_inputs(feat, attn_weights, graph, num_heads,
                                                                    activation, negative_slope, edge_feat)
    hc = feat_src.size(1)
    channels = hc // num_heads
    if attn_weights.dim() != 1 or attn_weights.numel() != hc:
        raise ValueError(f"attn_weights must be 1-D with num_heads*C = {hc} entries, got {tuple(attn_weights.shape)}")
    edge_attr = None if edge_feat is None else edge_feat.reshape(-1, num_heads, channels)
    out = gatv2_attention(feat_src.reshape(-1, num_heads, channels), feat_dst.reshape(-1, num_heads, channels),
                          attn_weights.view(num_heads, channels), graph, negative_slope=negative_slope,
                          edge_attr=edge_attr)
    return out.reshape(-1, hc) if concat_heads else out.mean(dim=1)
