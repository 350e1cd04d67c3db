"""A drop-in replacement for ``torch_geometric.nn.GATv2Conv`` (PyG 2.8) on the fused GATv2 op."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from torch_geometric.nn.conv import GATv2Conv as PyGGATv2Conv

from ..gatv2 import _check_inputs, _gatv2_attention_csc
from ..graph import BipartiteCSC, _append_zero_row
from .adjacency import (FusedMessagePassing, attention_result, coalesced_adjacency, csc_graph, layer_edge_features,
                        layer_edge_dim, needs_message_passing, propagate_sizes)

__all__ = ["GATv2Conv"]


class GATv2Conv(FusedMessagePassing, PyGGATv2Conv):
    r"""Drop-in replacement for :class:`torch_geometric.nn.GATv2Conv` (PyG 2.8), computed by the
    fused, deterministic :func:`torch_gradops.gatv2_attention` kernel.

    It *is* a PyG ``GATv2Conv`` subclass: the constructor (``share_weights``, ``edge_dim``,
    ``fill_value``, ``residual``, ...), parameters (``lin_l``, ``lin_r``, ``att``, ``lin_edge``,
    ``res``, ``bias``), their initialisation, ``state_dict`` keys and ``repr`` are PyG's own. Only
    ``forward`` differs: scores, softmax, dropout and aggregation run in one kernel, and none of
    the ``E x heads x out_channels`` tensors PyG materialises (``x_i + x_j``, the projected edge
    features, their leaky_relu, the messages) is allocated: edge features enter the kernel raw,
    with ``lin_edge``'s weight, and are projected per edge in registers.

    Args: see :class:`torch_geometric.nn.GATv2Conv`.

    Shapes:
        - input: ``x [N, F]`` or ``(x_src [N_s, F_s], x_dst [N_t, F_t])``; ``edge_index`` a
          ``[2, E]`` Tensor / ``EdgeIndex`` (row 0 = source), a ``torch.sparse`` COO/CSR/CSC or
          ``torch_sparse.SparseTensor`` *transposed* adjacency ``adj_t [N_t, N_s]``;
          ``edge_attr [E, edge_dim]`` (or ``[E]``) in the edge order of ``edge_index``.
        - output: ``[N_t, heads * out_channels]`` (``[N_t, out_channels]`` if ``concat=False``),
          and with ``return_attention_weights=True`` what PyG returns (see
          :func:`torch_gradops.nn.adjacency.attention_result`).
    """

    def forward(
        self,
        x: Union[Tensor, Tuple[Tensor, Tensor]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        if needs_message_passing(self):  # explainer masks, MessagePassing hooks: PyG's propagate
            return super().forward(x, edge_index, edge_attr, return_attention_weights)
        edge_index = coalesced_adjacency(edge_index, None if self.lin_edge is None else edge_attr)
        x_l, x_r, res = self._project(x)
        num_dst, num_loops = propagate_sizes(edge_index, x_l.size(0), x_r.size(0), None, self.add_self_loops,
                                             self.edge_dim)
        graph = csc_graph(edge_index, x_l.size(0), num_dst, num_loops)
        edge_feats, input_order = self._edge_features(edge_attr, edge_index, graph, num_loops)
        out, alpha = self._attend(x_l, x_r, edge_feats, input_order, graph, num_dst, bool(return_attention_weights))
        out = self._finish(out, res)
        if return_attention_weights:
            return out, attention_result(edge_index, alpha.to(out.dtype), num_loops)
        return out

    # ------------------------------------------------------------------ steps
    def _project(self, x) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """``(x_l [N_s, H, C], x_r [N_t, H, C], residual or None)``, as PyG projects them."""
        H, C = self.heads, self.out_channels
        if isinstance(x, Tensor):
            assert x.dim() == 2
            res = self.res(x) if self.res is not None else None
            x_l = self.lin_l(x).view(-1, H, C)
            x_r = x_l if self.share_weights else self.lin_r(x).view(-1, H, C)
            return x_l, x_r, res
        x_l, x_r = x
        assert x_l.dim() == 2
        assert x_r is not None, "GATv2Conv needs destination features: pass (x_src, x_dst)"
        res = self.res(x_r) if self.res is not None else None
        return self.lin_l(x_l).view(-1, H, C), self.lin_r(x_r).view(-1, H, C), res

    def _edge_features(self, edge_attr: Optional[Tensor], edge_index, graph: BipartiteCSC,
                       num_loops: Optional[int]) -> Tuple[Optional[Tensor], bool]:
        """``([E (+ loops), edge_dim], input_order)``: the raw edge features, the added loops' by
        ``fill_value`` (``lin_edge`` is applied inside the kernel), in CSC order or in the input
        order that ``graph.perm`` reads (:func:`~torch_gradops.nn.adjacency.layer_edge_features`)."""
        if edge_attr is None:
            return None, False
        assert self.lin_edge is not None, "edge_attr was given but the layer has no edge_dim"
        return layer_edge_features(edge_attr, edge_index, graph, num_loops, self.fill_value,
                                   self.lin_edge.weight.dtype, layer_edge_dim(self))

    def _attend(self, x_l: Tensor, x_r: Tensor, edge_feats: Optional[Tensor], input_order: bool,
                graph: BipartiteCSC, num_dst: int, want_alpha: bool):
        """The fused op in the projected features' dtype (autocast-aware): ``(out [N_t, H, C],
        alpha [E', H] or None)``, with the trash row of the input's own self-loops (built under
        torch.compile only, see :func:`~torch_gradops.graph.csc_from_edges`) dropped."""
        H, C = self.heads, self.out_channels
        dtype = x_l.dtype
        if x_r.size(0) != num_dst:  # (a no-op slice would still cost a copy in the backward)
            x_r = x_r[:num_dst]
        if graph.num_dst == num_dst + 1:  # (torch.compile) the extra row holding the input's self-loops
            x_r = _append_zero_row(x_r)
        weight = None
        if edge_feats is not None:
            # lin_edge (no bias): x @ W^T, i.e. edge_weight[k, h, c] = W[h*C + c, k]
            weight = self.lin_edge.weight.t().reshape(-1, H, C).to(dtype)
            edge_feats = edge_feats.to(dtype)
        p = float(self.dropout) if self.training else 0.0
        x_l, x_r, att = x_l.contiguous(), x_r.to(dtype).contiguous(), self.att.view(H, C).to(dtype)
        _check_inputs(x_l, x_r, att, graph, edge_feats, weight, p, csc_order=not input_order)
        result = _gatv2_attention_csc(x_l, x_r, att, graph, self.negative_slope, edge_feats, weight, p,
                                      self.training, want_alpha, input_order=input_order)
        out, alpha = result if want_alpha else (result, None)
        if graph.num_dst == num_dst + 1:
            # split, not a slice: its backward pads the gradient in one pass (a slice's zero-fills
            # then copies)
            out = out.split([num_dst, 1])[0]
        return out, alpha

    def _finish(self, out: Tensor, res: Optional[Tensor]) -> Tensor:
        """Heads concatenated or averaged, then residual and bias, in PyG's output dtype."""
        # PyG multiplies the features by float32 attention (att is a float32 parameter)
        out = out.to(torch.promote_types(out.dtype, self.att.dtype))
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if res is not None:
            out = out + res
        if self.bias is not None:
            out = out + self.bias
        return out
