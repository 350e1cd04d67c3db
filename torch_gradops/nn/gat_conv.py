"""A drop-in replacement for ``torch_geometric.nn.GATConv`` (PyG 2.8) on the fused GAT op."""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from torch_geometric.nn.conv import GATConv as PyGGATConv

from ..gat import gat_attention
from ..graph import BipartiteCSC, _append_zero_row
from .adjacency import (FusedMessagePassing, attention_result, coalesced_adjacency, csc_graph, edge_attr_2d,
                        layer_edge_dim, loop_edge_attr, needs_message_passing, propagate_sizes)

__all__ = ["GATConv"]

# Fold the source attention vector into the projection weight when in_features <= this x
# out_channels (see GATConv._node_logits).
_FOLD_MAX_IN_PER_CHANNEL = 8


class GATConv(FusedMessagePassing, PyGGATConv):
    r"""Drop-in replacement for :class:`torch_geometric.nn.GATConv` (PyG 2.8), computed by the
    fused, deterministic :func:`torch_gradops.gat_attention` kernel.

    It *is* a PyG ``GATConv`` subclass: the constructor, parameters and buffers (``lin`` or
    ``lin_src``/``lin_dst``, ``att_src``, ``att_dst``, ``lin_edge``, ``att_edge``, ``res``,
    ``bias``), their initialisation, ``state_dict`` keys and ``repr`` are PyG's own. Only
    ``forward`` differs: attention softmax, dropout and aggregation run in one kernel, and no
    ``E x heads x out_channels`` tensor is ever allocated (edge features enter as
    ``edge_attr @ W`` with ``W [edge_dim, heads]`` folded from ``lin_edge`` and ``att_edge``).

    Args: see :class:`torch_geometric.nn.GATConv`.

    Shapes:
        - input: ``x [N, F]`` or ``(x_src [N_s, F_s], x_dst [N_t, F_t] or None)``;
          ``edge_index`` a ``[2, E]`` Tensor / ``EdgeIndex`` (row 0 = source), a ``torch.sparse``
          COO/CSR/CSC or ``torch_sparse.SparseTensor`` *transposed* adjacency ``adj_t [N_t, N_s]``;
          ``edge_attr [E, edge_dim]`` (or ``[E]``) in the edge order of ``edge_index``.
        - output: ``[N_t, heads * out_channels]`` (``[N_t, out_channels]`` if ``concat=False``),
          and with ``return_attention_weights=True`` what PyG returns: ``(edge_index', alpha
          [E', heads])`` for Tensor input (``edge_index'`` after self-loop handling), ``(adj',
          alpha)`` for ``torch.sparse``, ``adj'`` with the attention as values for SparseTensor.

    The CSC conversion of ``edge_index`` (with the self-loops added) is cached and shared
    across layers (:mod:`torch_gradops.nn.adjacency`).
    """

    def forward(
        self,
        x: Union[Tensor, Tuple[Tensor, Optional[Tensor]]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        size: Optional[Tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        if needs_message_passing(self):  # explainer masks, MessagePassing hooks: PyG's propagate
            return super().forward(x, edge_index, edge_attr, size, return_attention_weights)
        edge_index = coalesced_adjacency(edge_index, None if self.lin_edge is None else edge_attr)
        x_in_src, x_in_dst, res = self._inputs(x)
        x_src = self._project(x_in_src, x_in_dst)
        with self._logit_precision(x_src):
            alpha_src, alpha_dst = self._node_logits(x_src, x_in_src, x_in_dst)
        num_dst, num_loops = propagate_sizes(edge_index, x_src.size(0),
                                             None if x_in_dst is None else x_in_dst.size(0), size,
                                             self.add_self_loops, self.edge_dim)
        graph = csc_graph(edge_index, x_src.size(0), num_dst, num_loops)
        with self._logit_precision(x_src):
            edge_logits = self._edge_logits(edge_attr, edge_index, num_loops, graph)
        out, alpha = self._attend(x_src, alpha_src, alpha_dst, edge_logits, graph, num_dst,
                                  bool(return_attention_weights))
        out = self._finish(out, res)
        if return_attention_weights:
            return out, attention_result(edge_index, alpha.to(out.dtype), num_loops)
        return out

    # ------------------------------------------------------------------ steps
    def _logit_dtype(self, features: torch.dtype) -> torch.dtype:
        """The attention logits' dtype: the features', or float32 for half features with wider
        attention parameters (autocast), where PyG's logits come out float32 (half features
        times float32 ``att``) and so do ours: the op takes them so, with half features."""
        if features in (torch.float16, torch.bfloat16) and self.att_src.dtype not in (torch.float16, torch.bfloat16):
            return torch.float32
        return features

    def _logit_precision(self, x_src: Tensor):
        """Autocast off while the logits are computed, where they are float32 for half features
        (:meth:`_logit_dtype`): the folded projections are matmuls, which autocast would round
        to half; a no-op context otherwise."""
        if self._logit_dtype(x_src.dtype) == x_src.dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=x_src.device.type, enabled=False)

    def _inputs(self, x):
        """``(x_src, x_dst or None, residual or None)``: PyG's input forms and its residual."""
        if isinstance(x, Tensor):
            assert x.dim() == 2, "Static graphs not supported in 'GATConv'"
            return x, x, None if self.res is None else self.res(x)
        x_in_src, x_in_dst = x
        assert x_in_src.dim() == 2, "Static graphs not supported in 'GATConv'"
        res = self.res(x_in_dst) if x_in_dst is not None and self.res is not None else None
        return x_in_src, x_in_dst, res

    def _lins(self):
        """The source and destination projections (one shared ``lin``, or ``lin_src``/``lin_dst``)."""
        return (self.lin, self.lin) if self.lin is not None else (self.lin_src, self.lin_dst)

    def _project(self, x_in_src: Tensor, x_in_dst: Optional[Tensor]) -> Tensor:
        """``x_src [N_s, H, C]``: the projected source features (the messages)."""
        lin_s, lin_d = self._lins()
        x_src = lin_s(x_in_src).view(-1, self.heads, self.out_channels)
        if (x_in_dst is not None and lin_d is not lin_s
                and isinstance(lin_d.weight, torch.nn.parameter.UninitializedParameter)):
            # The destination projection itself is never needed (only its attention logits,
            # through the folded weight), but a lazy `lin_dst` initialises on its first call,
            # at the point of PyG's forward where it would: keep that (and the RNG draws).
            lin_d(x_in_dst)
        return x_src

    def _node_logits(self, x_src: Tensor, x_in_src: Tensor, x_in_dst: Optional[Tensor]):
        """``(alpha_src [N_s, H], alpha_dst [N_t, H] or None)``: the node attention logits.

        PyG computes ``(lin(x) * att).sum(-1)``, an ``N x H x C`` product and reduction (and the
        same again in backward). Folding ``att`` into the projection weight first, ``x @ W_att``
        with ``W_att [F, H]``, is the same linear map (lin has no bias). For the source side,
        whose projection is needed anyway, the fold pays on narrow inputs only: about 6 F H GEMM
        multiply-adds per node (forward and backward) against about 6 memory passes over H C
        values, so on wide inputs (Cora's 1433 features: F > 8 C) PyG's product is cheaper. A
        separate destination projection exists only for its logits, so there the fold (F H
        instead of F H C per node) always pays.
        """
        H = self.heads
        lin_s, lin_d = self._lins()
        same_side = x_in_dst is x_in_src and lin_d is lin_s
        fold_src = x_in_src.size(-1) <= _FOLD_MAX_IN_PER_CHANNEL * self.out_channels
        if same_side and fold_src:  # one GEMM for both logits
            w = torch.cat([self._fold(lin_s, self.att_src), self._fold(lin_s, self.att_dst)], 1)
            alpha_src, alpha_dst = (x_in_src.to(w.dtype) @ w).split(H, dim=1)
            return alpha_src, alpha_dst
        if fold_src:
            w = self._fold(lin_s, self.att_src)
            alpha_src = x_in_src.to(w.dtype) @ w
        else:
            alpha_src = (x_src * self.att_src).sum(-1)
        if x_in_dst is None:
            return alpha_src, None
        if same_side:
            return alpha_src, (x_src * self.att_dst).sum(-1)
        w = self._fold(lin_d, self.att_dst)
        return alpha_src, x_in_dst.to(w.dtype) @ w

    def _edge_logits(self, edge_attr: Optional[Tensor], edge_index, num_loops: Optional[int],
                     graph: Optional[BipartiteCSC] = None) -> Optional[Tensor]:
        """``[E (+ loops), H] = edge_attr @ W`` with ``W [edge_dim, H]`` folded from ``lin_edge`` and
        ``att_edge`` (no ``E x H x C`` tensor), the added loops' features by ``fill_value``."""
        if edge_attr is None or self.lin_edge is None:
            return None
        if not torch.compiler.is_compiling() and edge_attr.size(0) == 0 and not num_loops:
            # no edges: PyG's edge_update returns before lin_edge, whose parameters then get no
            # gradient (None, which optimizers skip), not a zero one
            return None
        w = self._fold(self.lin_edge, self.att_edge)
        # (half edge features, e.g. an autocast layer's output, meet float32 logits' w: cast)
        ea = edge_attr_2d(edge_attr, edge_index, w.dtype, layer_edge_dim(self)).to(w.dtype)
        logits = ea @ w
        if num_loops is not None:
            logits = torch.cat([logits, loop_edge_attr(ea, edge_index, num_loops, self.fill_value, graph) @ w])
        return logits

    def _attend(self, x_src: Tensor, alpha_src: Tensor, alpha_dst: Optional[Tensor],
                edge_logits: Optional[Tensor], graph: BipartiteCSC, num_dst: int, want_alpha: bool):
        """The fused op, in the projected features' dtype with logits in :meth:`_logit_dtype`:
        ``(out [N_t, H, C], alpha [E', H] or None)``, with the trash row of the input's own
        self-loops (built under torch.compile only, see
        :func:`~torch_gradops.graph.csc_from_edges`) dropped."""
        H = self.heads
        dtype = self._logit_dtype(x_src.dtype)  # the logits'
        trash = graph.num_dst == num_dst + 1  # (torch.compile) the extra row holding the input's self-loops
        a_dst = alpha_dst.to(dtype) if alpha_dst is not None else x_src.new_zeros((num_dst, H), dtype=dtype)
        if trash:
            a_dst = _append_zero_row(a_dst)
        p = float(self.dropout) if self.training else 0.0
        result = gat_attention(x_src.contiguous(), alpha_src.to(dtype).contiguous(), a_dst.contiguous(), graph,
                               negative_slope=self.negative_slope,
                               edge_logits=None if edge_logits is None else edge_logits.to(dtype),
                               dropout=p, training=self.training,
                               return_attention=want_alpha)
        out, alpha = result if want_alpha else (result, None)
        if trash:
            out = out[:num_dst]
        return out, alpha

    def _finish(self, out: Tensor, res: Optional[Tensor]) -> Tensor:
        """Heads concatenated or averaged, then residual and bias, in PyG's output dtype."""
        # PyG multiplies float32 attention by the (possibly autocast-half) features
        out_dtype = torch.promote_types(out.dtype, self.att_src.dtype)
        out = out.to(out_dtype)
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        # Without autograd recording, `out` is a fresh tensor nobody else holds: add in place
        # (saves one [N, H*C] buffer in inference). With autograd, the op saved `out` for its
        # backward, so it must not be modified. Not under torch.jit.trace either: its check run
        # records under no_grad, and the traced graph must not depend on the grad mode.
        in_place = not (torch.is_grad_enabled() and out.requires_grad or torch.jit.is_tracing())
        if res is not None:
            out = out.add_(res) if in_place and res.dtype == out.dtype else out + res
        if self.bias is not None:
            out = out.add_(self.bias) if in_place and self.bias.dtype == out.dtype else out + self.bias
        return out

    def _fold(self, lin, att: Tensor) -> Tensor:
        """``W [in, H]`` with ``x @ W == (lin(x).view(-1, H, C) * att).sum(-1)`` (lin has no bias)."""
        H, C = self.heads, self.out_channels
        return (lin.weight.view(H, C, -1) * att.view(H, C, 1)).sum(dim=1).t()
