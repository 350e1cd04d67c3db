"""Fused graph attention (GAT) on a :class:`~torch_gradops.BipartiteCSC` graph.

The forward kernel makes one pass over each destination's incoming edges with an online
softmax and saves only the per-(destination, head) log-sum-exp; the backward recomputes the
attention from it and sums without atomics, so gradients are bitwise reproducible. Nothing of
size ``E x heads x channels`` is ever allocated, except on the double-backward and forward-AD
paths, which are composite (see :class:`GATAttentionFunction`).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .library import check_backend, ops
from .graph import BipartiteCSC, csc_destinations

__all__ = ["gat_attention", "GATAttentionFunction", "mha_gat_n2n"]

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
    lse = x_src.new_empty((num_dst, heads), dtype=_acc_dtype(x_src.dtype))
    alpha = x_src.new_empty((indices.size(0) if return_alpha else 0, heads))
    return out, lse, alpha


@torch.library.register_fake("torch_gradops::gat_backward")
def _gat_backward_fake(grad_out, grad_alpha, out, lse, x_src, a_src, a_dst, edge_logits, indptr,
                       indices, rev_indptr, rev_edge, rev_dst, dropout_mask, negative_slope,
                       dropout_scale, output_mask):
    def maybe(flag, like):
        return torch.empty_like(like) if flag else like.new_empty((0,))
    grad_el = (x_src.new_empty((indices.size(0), x_src.size(1))) if output_mask[3]
               else x_src.new_empty((0,)))
    return (maybe(output_mask[0], x_src), maybe(output_mask[1], a_src),
            maybe(output_mask[2], a_dst), grad_el)


# ---------------------------------------------------------------------------- composite path
def _gat_composite(x_src, a_src, a_dst, el, src, dst, num_dst, mask, negative_slope, scale):
    """Differentiable plain-PyTorch GAT in CSC edge order; returns ``(out, alpha_after_dropout)``.

    Used only where a first-order kernel cannot serve: double backward (``create_graph=True``).
    It materialises ``E x H x C`` and computes in float32 for half types.
    """
    dtype = x_src.dtype
    acc = _acc_dtype(dtype)
    x_src, a_src, a_dst = x_src.to(acc), a_src.to(acc), a_dst.to(acc)
    src, dst = src.long(), dst.long()
    heads = a_src.size(1)
    z = a_src.index_select(0, src) + a_dst.index_select(0, dst)
    if el is not None:
        z = z + el.to(acc)
    s = F.leaky_relu(z, negative_slope)
    dst_h = dst.view(-1, 1).expand(-1, heads)
    smax = torch.full((num_dst, heads), float("-inf"), dtype=acc, device=s.device)
    smax = smax.scatter_reduce(0, dst_h, s.detach(), "amax", include_self=True)
    p = torch.exp(s - smax.index_select(0, dst))
    denom = torch.zeros((num_dst, heads), dtype=acc, device=s.device).index_add(0, dst, p)
    alpha = p / denom.index_select(0, dst)
    if mask is not None:
        alpha = alpha * mask.to(acc) * scale
    msg = alpha.unsqueeze(-1) * x_src.index_select(0, src)
    out = torch.zeros((num_dst,) + tuple(x_src.shape[1:]), dtype=acc, device=s.device).index_add(0, dst, msg)
    return out.to(dtype), alpha.to(dtype)


# ---------------------------------------------------------------------------- autograd
class _GATAttentionFirstOrder(torch.autograd.Function):
    """Forward and backward of :class:`GATAttentionFunction`, without ``jvp``: the class that
    ``torch.compile`` traces (Dynamo cannot trace a Function that defines ``jvp``)."""

    @staticmethod
    def forward(x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
                dropout_mask, negative_slope, dropout_scale, return_alpha):
        return ops.gat_forward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask,
                               negative_slope, dropout_scale, return_alpha)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
         dropout_mask, negative_slope, dropout_scale, return_alpha) = inputs
        out, lse, _ = output
        ctx.mark_non_differentiable(lse)
        if not return_alpha:
            ctx.mark_non_differentiable(output[2])
        ctx.negative_slope = negative_slope
        ctx.dropout_scale = dropout_scale
        ctx.has_edge_logits = edge_logits is not None
        ctx.has_mask = dropout_mask is not None
        ctx.has_rev = rev_indptr is not None
        ctx.return_alpha = return_alpha
        ctx.save_for_backward(x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr,
                              rev_edge, rev_dst, dropout_mask, out, lse)
        ctx.save_for_forward(x_src, a_src, a_dst, edge_logits, indptr, indices, dropout_mask, out, lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_alpha):
        (x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
         dropout_mask, out, lse) = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[:4])
        needs[3] = needs[3] and ctx.has_edge_logits
        none_rest = (None,) * 9
        if not any(needs):
            return (None,) * 4 + none_rest
        if grad_alpha is not None and grad_alpha.numel() == 0:
            grad_alpha = None
        if grad_out is None:
            grad_out = torch.zeros_like(out)

        if torch.is_grad_enabled():
            # create_graph=True: differentiable composite recomputation (exact, not fused).
            dst = csc_destinations(indptr, indices.numel()).long()
            with torch.enable_grad():
                inputs = [t for t, n in zip((x_src, a_src, a_dst, edge_logits), needs) if n]
                detached = [t.detach().requires_grad_() if not t.requires_grad else t for t in inputs]
                mapping = dict(zip(map(id, inputs), detached))
                args = [mapping.get(id(t), t) if n else (t.detach() if t is not None else None)
                        for t, n in zip((x_src, a_src, a_dst, edge_logits), needs)]
                o, a = _gat_composite(args[0], args[1], args[2], args[3], indices, dst,
                                      a_dst.size(0), dropout_mask, ctx.negative_slope,
                                      ctx.dropout_scale)
                outs, grads = [o], [grad_out]
                if grad_alpha is not None:
                    outs.append(a)
                    grads.append(grad_alpha)
                res = torch.autograd.grad(outs, detached, grads, create_graph=True, allow_unused=True)
            it = iter(res)
            result = [next(it) if n else None for n in needs]
            result = [torch.zeros_like(t) if r is None and n else r
                      for r, t, n in zip(result, (x_src, a_src, a_dst, edge_logits), needs)]
            return tuple(result) + none_rest

        if not ctx.has_rev:
            raise RuntimeError("GATAttentionFunction: the reverse index was not passed to forward, "
                               "but a gradient is needed; call gat_attention() instead")
        gx, gas, gad, gel = ops.gat_backward(
            grad_out.contiguous(), None if grad_alpha is None else grad_alpha.contiguous(), out, lse,
            x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
            dropout_mask, ctx.negative_slope, ctx.dropout_scale, needs)
        result = [g if n else None for g, n in zip((gx, gas, gad, gel), needs)]
        return tuple(result) + none_rest


class GATAttentionFunction(_GATAttentionFirstOrder):
    """Autograd for the fused GAT kernels. All per-edge tensors are in CSC edge order.

    ``forward(x_src, a_src, a_dst, edge_logits, indptr, indices, rev_indptr, rev_edge, rev_dst,
    dropout_mask, negative_slope, dropout_scale, return_alpha) -> (out, lse, alpha)``

    * ``x_src [num_src, H, C]``, ``a_src [num_src, H]``, ``a_dst [num_dst, H]``,
      ``edge_logits [E, H]`` or None; ``dropout_mask [E, H]`` bool or None (kept edges).
    * ``out [num_dst, H, C]``; ``lse [num_dst, H]`` (non-differentiable log-sum-exp of the
      scores); ``alpha [E, H]`` after dropout if ``return_alpha`` else ``[0, H]``.
    * The reverse (source-grouped) index ``rev_*`` is only needed when a gradient is wanted.

    Backward: the deterministic kernel. Under ``create_graph=True`` it switches to a composite
    differentiable recomputation, so gradients of gradients are exact. Forward-mode AD (``jvp``)
    is composite as well.
    """

    @staticmethod
    def jvp(ctx, t_x, t_asrc, t_adst, t_el, *_):
        x_src, a_src, a_dst, el, indptr, indices, mask, out, lse = ctx.saved_tensors
        acc = _acc_dtype(x_src.dtype)
        src = indices.long()
        dst = csc_destinations(indptr, indices.numel()).long()
        z = a_src.index_select(0, src).to(acc) + a_dst.index_select(0, dst).to(acc)
        if el is not None:
            z = z + el.to(acc)
        s = F.leaky_relu(z, ctx.negative_slope)
        slope = torch.where(z > 0, torch.ones_like(z), torch.full_like(z, ctx.negative_slope))
        alpha = torch.exp(s - lse.index_select(0, dst))
        dz = torch.zeros_like(z)
        if t_asrc is not None:
            dz = dz + t_asrc.to(acc).index_select(0, src)
        if t_adst is not None:
            dz = dz + t_adst.to(acc).index_select(0, dst)
        if t_el is not None and el is not None:
            dz = dz + t_el.to(acc)
        ds = slope * dz
        dbar = torch.zeros_like(lse).index_add(0, dst, alpha * ds)
        keep = mask.to(acc) * ctx.dropout_scale if mask is not None else 1.0
        t_alpha = alpha * (ds - dbar.index_select(0, dst)) * keep
        t_out = torch.zeros(out.shape, dtype=acc, device=out.device).index_add(
            0, dst, t_alpha.unsqueeze(-1) * x_src.to(acc).index_select(0, src))
        if t_x is not None:
            t_out = t_out.index_add(0, dst, (alpha * keep).unsqueeze(-1) * t_x.to(acc).index_select(0, src))
        t_alpha_out = t_alpha.to(x_src.dtype) if ctx.return_alpha else None
        return t_out.to(out.dtype), None, t_alpha_out


# ---------------------------------------------------------------------------- public API
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
        if t.dtype != x_src.dtype:
            raise TypeError(f"{name} ({t.dtype}) must have the dtype of x_src ({x_src.dtype})")
        if t.device != x_src.device:
            raise ValueError(f"{name} ({t.device}) must be on the device of x_src ({x_src.device})")
    if graph.device != x_src.device:
        raise ValueError(f"graph is on {graph.device} but x_src is on {x_src.device}; use graph.to(device)")
    if edge_logits is not None:
        if not isinstance(edge_logits, torch.Tensor):
            raise TypeError(f"edge_logits must be a torch.Tensor or None, got {type(edge_logits).__name__}")
        if edge_logits.shape != (graph.num_edges, heads):
            raise ValueError(f"edge_logits must have shape [E, heads] = {(graph.num_edges, heads)}, "
                             f"got {tuple(edge_logits.shape)}")
        if edge_logits.dtype != x_src.dtype:
            raise TypeError(f"edge_logits ({edge_logits.dtype}) must have the dtype of x_src ({x_src.dtype})")
        if edge_logits.device != x_src.device:
            raise ValueError(f"edge_logits ({edge_logits.device}) must be on the device of x_src ({x_src.device})")
    if not (0.0 <= float(dropout) < 1.0):
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")


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
        a_src: ``[num_src, H]`` source attention logits.
        a_dst: ``[num_dst, H]`` destination attention logits.
        graph: the edges, as a :class:`BipartiteCSC` on the features' device.
        negative_slope: LeakyReLU slope.
        edge_logits: ``[E, H]`` per-edge logits in the original edge order, or None.
        dropout: attention dropout probability in ``[0, 1)``, applied when ``training`` and
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
        mask = torch.rand((graph.num_edges, heads), device=x_src.device) >= dropout
        scale = 1.0 / (1.0 - dropout)
    grad_inputs = (x_src, a_src, a_dst, edge_logits)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grad_inputs):
        rev = graph.reverse_index()
        rev_tensors = (rev.indptr, rev.edge, rev.dst)
    else:
        rev_tensors = (None, None, None)
    # Dynamo cannot trace a Function with a custom jvp; compiled code gets the first-order one.
    function = _GATAttentionFirstOrder if torch.compiler.is_compiling() else GATAttentionFunction
    out, _, alpha = function.apply(
        x_src, a_src, a_dst, el, graph.indptr, graph.indices, *rev_tensors, mask,
        float(negative_slope), float(scale), bool(return_attention))
    if return_attention:
        return out, graph.original_order(alpha)
    return out


# ---------------------------------------------------------------------------- cugraph-ops compat
def mha_gat_n2n(feat, attn_weights: torch.Tensor, graph: BipartiteCSC, num_heads: int = 1,
                activation: str = "LeakyReLU", negative_slope: float = 0.2, concat_heads: bool = True,
                edge_feat: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Drop-in for ``pylibcugraphops.pytorch.operators.mha_gat_n2n`` (withdrawn in RAPIDS 25.02).

    Args:
        feat: ``[n, num_heads*C]`` already projected node features, used as sources and (its first
            ``graph.num_dst`` rows) as destinations; or a ``(feat_src, feat_dst)`` pair.
        attn_weights: ``[2*num_heads*C]`` (source part, then destination part), plus
            ``num_heads*C`` for the edge part when ``edge_feat`` is given.
        graph: a :class:`BipartiteCSC`.
        activation: ``"LeakyReLU"`` (or ``"Linear"``/None for no activation).
        edge_feat: ``[E, num_heads*C]`` projected edge features (original edge order), or None.

    Returns:
        ``[n_dst, num_heads*C]`` if ``concat_heads`` else ``[n_dst, C]`` (mean over heads).
    """
    if isinstance(feat, (tuple, list)):
        feat_src, feat_dst = feat
    else:
        feat_src, feat_dst = feat, feat[: graph.num_dst]
    if feat_src.dim() != 2 or feat_src.size(1) % num_heads != 0:
        raise ValueError(f"feat must have shape [n, num_heads*C] with num_heads={num_heads}, got {tuple(feat_src.shape)}")
    hc = feat_src.size(1)
    channels = hc // num_heads
    expect = (3 if edge_feat is not None else 2) * hc
    if attn_weights.dim() != 1 or attn_weights.numel() != expect:
        raise ValueError(f"attn_weights must be 1-D with {expect} entries, got {tuple(attn_weights.shape)}")
    if activation in (None, "Linear", "linear", "Identity"):
        negative_slope = 1.0
    elif activation != "LeakyReLU":
        raise ValueError(f"activation must be 'LeakyReLU' or 'Linear', got {activation!r}")
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
