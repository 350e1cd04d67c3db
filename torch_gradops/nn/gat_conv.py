"""A drop-in replacement for ``torch_geometric.nn.GATConv`` (PyG 2.8) on the fused GAT op."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from torch_geometric.nn.conv import GATConv as PyGGATConv
from torch_geometric.typing import SparseTensor, torch_sparse
from torch_geometric.utils import (add_self_loops, is_torch_sparse_tensor, remove_self_loops,
                                   to_edge_index)
from torch_geometric.utils.loop import compute_loop_attr
from torch_geometric.utils.sparse import set_sparse_value

from ..gat import gat_attention
from ..graph import BipartiteCSC
from ._csc import build_csc

try:  # PyG >= 2.5
    from torch_geometric import EdgeIndex
except ImportError:  # pragma: no cover
    EdgeIndex = None

__all__ = ["GATConv", "clear_csc_cache"]

# edge_index object -> {(num_src, num_dst, num_loops): (edge_index._version, BipartiteCSC)}.
# Keyed by identity and held weakly: an entry lives exactly as long as the user's edge_index,
# and is shared by all layers, so a whole model converts each graph once.
_CSC_CACHE = WeakIdKeyDictionary()


def clear_csc_cache() -> None:
    """Forget every cached CSC conversion (they are also dropped with their ``edge_index``)."""
    _CSC_CACHE.clear()


def _version(t) -> Optional[int]:
    try:
        return t._version
    except (AttributeError, RuntimeError):  # e.g. SparseTensor, some sparse layouts
        return None


def _is_edge_index(t) -> bool:
    return EdgeIndex is not None and isinstance(t, EdgeIndex)


def _edge_list(edge_index) -> Tuple[Tensor, Tensor, Optional[bool]]:
    """``(src, dst, dst_sorted)`` of any supported adjacency, in its own edge (value) order.

    Sparse adjacencies are PyG's transposed ``adj_t [num_dst, num_src]``: rows are
    destinations, so a CSR ``adj_t`` (or a ``SparseTensor``) is already our CSC.
    """
    if isinstance(edge_index, SparseTensor):
        row, col, _ = edge_index.coo()
        return col, row, True
    if is_torch_sparse_tensor(edge_index):
        (row, col), _ = to_edge_index(edge_index)
        return col, row, True if edge_index.layout == torch.sparse_csr else None
    if _is_edge_index(edge_index):
        plain = edge_index.as_tensor()
        return plain[0], plain[1], True if edge_index.is_sorted_by_col else None
    if isinstance(edge_index, Tensor):
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(f"GATConv: edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
        if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
            raise ValueError(f"GATConv: edge_index must be an integer tensor, got {edge_index.dtype}")
        return edge_index[0], edge_index[1], None
    raise ValueError("GATConv: edge_index must be a [2, E] integer Tensor, an EdgeIndex, a "
                     f"torch.sparse adjacency or a torch_sparse.SparseTensor, got {type(edge_index).__name__}")


def _graph_for(edge_index, num_src: int, num_dst: int, num_loops: Optional[int]) -> BipartiteCSC:
    """The (cached) CSC graph for ``edge_index``; see :func:`torch_gradops.nn._csc.build_csc`."""
    def build():
        src, dst, dst_sorted = _edge_list(edge_index)
        return build_csc(src, dst, num_src, num_dst, num_loops, dst_sorted)

    if torch.compiler.is_compiling():
        # Under torch.compile the conversion is traced into the graph (static-shape ops);
        # a Python-side cache cannot live inside a compiled region.
        return build()
    key = (num_src, num_dst, num_loops)
    version = _version(edge_index)
    entries = _CSC_CACHE.get(edge_index)
    if entries is not None:
        hit = entries.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
    graph = build()
    if entries is None:
        entries = {}
        _CSC_CACHE[edge_index] = entries
    entries[key] = (version, graph)
    return graph


# Fold the source attention vector into the projection weight when in_features <= this x
# out_channels (see GATConv.forward).
_FOLD_MAX_IN_PER_CHANNEL = 8


class GATConv(PyGGATConv):
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

    The CSC conversion of ``edge_index`` (with the self-loops added) is cached by object
    identity and ``_version`` and shared across layers; a CSR ``adj_t``, a ``SparseTensor`` or
    an ``EdgeIndex`` sorted by column (destination) is converted without any sort.
    """

    def forward(  # noqa: C901
        self,
        x: Union[Tensor, Tuple[Tensor, Optional[Tensor]]],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        size: Optional[Tuple[int, int]] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        H, C = self.heads, self.out_channels

        # --- projections: PyG's (shared `lin`, or `lin_src`/`lin_dst` if bipartite).
        res: Optional[Tensor] = None
        if isinstance(x, Tensor):
            assert x.dim() == 2, "Static graphs not supported in 'GATConv'"
            if self.res is not None:
                res = self.res(x)
            x_in_src, x_in_dst = x, x
        else:
            x_in_src, x_in_dst = x
            assert x_in_src.dim() == 2, "Static graphs not supported in 'GATConv'"
            if x_in_dst is not None and self.res is not None:
                res = self.res(x_in_dst)
        lin_s = self.lin if self.lin is not None else self.lin_src
        lin_d = self.lin if self.lin is not None else self.lin_dst
        x_src = lin_s(x_in_src).view(-1, H, C)
        if (x_in_dst is not None and lin_d is not lin_s
                and isinstance(lin_d.weight, torch.nn.parameter.UninitializedParameter)):
            # The destination projection itself is never needed (only its attention logits,
            # through the folded weight), but a lazy `lin_dst` initialises on its first call,
            # at the point of PyG's forward where it would: keep that (and the RNG draws).
            lin_d(x_in_dst)

        # --- node attention logits [N, H]. PyG computes (lin(x) * att).sum(-1), an N x H x C
        # product and reduction (and the same again in backward). Folding `att` into the
        # projection weight first, x @ W_att with W_att [F, H], is the same linear map (lin has
        # no bias). For the source side, whose projection is needed anyway, the fold pays on
        # narrow inputs only: about 6 F H GEMM multiply-adds per node (forward and backward)
        # against about 6 memory passes over H C values, so on wide inputs (Cora's 1433
        # features: F > 8 C) PyG's product is cheaper. A separate destination projection exists
        # only for its logits, so there the fold (F H instead of F H C per node) always pays.
        same_side = x_in_dst is x_in_src and lin_d is lin_s
        fold_src = x_in_src.size(-1) <= _FOLD_MAX_IN_PER_CHANNEL * C
        if same_side and fold_src:  # one GEMM for both logits
            w = torch.cat([self._fold(lin_s, self.att_src), self._fold(lin_s, self.att_dst)], 1)
            alpha_src, alpha_dst = (x_in_src @ w).split(H, dim=1)
        else:
            alpha_src = (x_in_src @ self._fold(lin_s, self.att_src) if fold_src
                         else (x_src * self.att_src).sum(-1))
            if x_in_dst is None:
                alpha_dst = None
            elif same_side:
                alpha_dst = (x_src * self.att_dst).sum(-1)
            else:
                alpha_dst = x_in_dst @ self._fold(lin_d, self.att_dst)
        num_dst_rows = None if x_in_dst is None else x_in_dst.size(0)

        # --- node counts, as PyG's propagate infers them.
        sparse = isinstance(edge_index, SparseTensor) or is_torch_sparse_tensor(edge_index)
        num_src = x_src.size(0)
        num_dst: Optional[int] = None
        if sparse:
            if edge_index.size(1) != num_src:
                raise ValueError(f"GATConv: the adjacency has {edge_index.size(1)} columns (sources) "
                                 f"but x has {num_src} source rows")
            num_dst = edge_index.size(0)
        if size is not None:
            if size[0] is not None and size[0] != num_src:
                raise ValueError(f"GATConv: size[0]={size[0]} but x has {num_src} source rows")
            if size[1] is not None:
                num_dst = size[1]
        if num_dst_rows is not None:
            if num_dst is not None and num_dst != num_dst_rows:
                raise ValueError(f"GATConv: {num_dst} destinations expected but x_dst has {num_dst_rows} rows")
            num_dst = num_dst_rows

        num_loops: Optional[int] = None
        if self.add_self_loops:
            if sparse:
                num_loops = min(edge_index.size(0), edge_index.size(1))
            else:
                num_loops = num_src if num_dst_rows is None else min(num_src, num_dst_rows)
                if size is not None:
                    num_loops = min(size)
        if num_dst is None:
            # `(x_src, None)` without `size`: PyG's propagate falls back to the source count
            # (or to an EdgeIndex's number of columns).
            if _is_edge_index(edge_index) and edge_index.num_cols is not None:
                num_dst = edge_index.num_cols
            else:
                num_dst = num_src

        graph = _graph_for(edge_index, num_src, num_dst, num_loops)
        trash = graph.num_dst == num_dst + 1  # one extra row holding the removed self-loops

        # --- edge-feature logits [E (+ loops), H] = edge_attr @ W, W [edge_dim, H].
        edge_logits: Optional[Tensor] = None
        if edge_attr is not None and self.lin_edge is not None:
            ea = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
            w = self._fold(self.lin_edge, self.att_edge)  # [edge_dim, H]
            edge_logits = ea @ w
            if num_loops is not None:
                edge_logits = torch.cat([edge_logits, self._loop_attr(ea, edge_index, num_loops) @ w])

        # --- fused attention + aggregation, in the projected features' dtype (autocast-aware).
        dtype = x_src.dtype
        a_src = alpha_src.to(dtype)
        a_dst = (alpha_dst.to(dtype) if alpha_dst is not None
                 else x_src.new_zeros((num_dst, H)))
        if trash:
            a_dst = torch.cat([a_dst, a_dst.new_zeros((1, H))])
        if edge_logits is not None:
            edge_logits = edge_logits.to(dtype)
        p = float(self.dropout) if self.training else 0.0
        drop_all = p >= 1.0  # F.dropout(p=1) zeroes everything; the kernel takes p < 1
        result = gat_attention(x_src.contiguous(), a_src.contiguous(), a_dst.contiguous(), graph,
                               negative_slope=self.negative_slope, edge_logits=edge_logits,
                               dropout=0.0 if drop_all else p, training=self.training,
                               return_attention=bool(return_attention_weights))
        out, alpha = result if return_attention_weights else (result, None)
        if trash:
            out = out[:num_dst]
        # PyG multiplies float32 attention by the (possibly autocast-half) features: match its
        # output dtype.
        out_dtype = torch.promote_types(x_src.dtype, self.att_src.dtype)
        out = out.to(out_dtype)
        if drop_all:
            out = out * 0.0
            alpha = None if alpha is None else alpha * 0.0

        if self.concat:
            out = out.reshape(-1, H * C)
        else:
            out = out.mean(dim=1)
        # Without autograd recording, `out` is a fresh tensor nobody else holds: add in place
        # (saves one [N, H*C] buffer in inference). With autograd, the op saved `out` for its
        # backward, so it must not be modified.
        in_place = not (torch.is_grad_enabled() and out.requires_grad) and out.dtype == out_dtype
        if res is not None:
            out = out.add_(res) if in_place and res.dtype == out.dtype else out + res
        if self.bias is not None:
            out = out.add_(self.bias) if in_place and self.bias.dtype == out.dtype else out + self.bias

        if return_attention_weights:
            return out, self._attention_result(edge_index, alpha.to(out_dtype), num_loops)
        return out

    # ------------------------------------------------------------------ helpers
    def _fold(self, lin, att: Tensor) -> Tensor:
        """``W [in, H]`` with ``x @ W == (lin(x).view(-1, H, C) * att).sum(-1)`` (lin has no bias)."""
        H, C = self.heads, self.out_channels
        return (lin.weight.view(H, C, -1) * att.view(H, C, 1)).sum(dim=1).t()

    def _loop_attr(self, edge_attr: Tensor, edge_index, num_loops: int) -> Tensor:
        """Edge features of the added self-loops, ``[num_loops, edge_dim]``, by ``fill_value``.

        Like PyG (``remove_self_loops`` then ``compute_loop_attr``), the input's own self-loops
        do not take part in a reduction; we route them (and edges into destinations that get no
        loop) to a scratch row ``num_loops`` instead of removing them, to keep shapes static.
        """
        if not isinstance(self.fill_value, str):
            return compute_loop_attr(edge_attr.new_zeros((2, 0), dtype=torch.long), edge_attr,
                                     num_loops, False, self.fill_value)
        src, dst, _ = _edge_list(edge_index)
        src, dst = src.long(), dst.long()
        col = torch.where((src == dst) | (dst >= num_loops), num_loops, dst)
        return compute_loop_attr(torch.stack([src, col]), edge_attr, num_loops + 1, False,
                                 self.fill_value)[:num_loops]

    def _attention_result(self, edge_index, alpha: Tensor, num_loops: Optional[int]):
        """PyG's ``return_attention_weights`` output from ``alpha`` in processed edge order."""
        if num_loops is not None:
            src, dst, _ = _edge_list(edge_index)
            E = src.numel()
            keep = src != dst
            alpha = torch.cat([alpha[:E][keep], alpha[E:]])
        if isinstance(edge_index, SparseTensor):
            adj = torch_sparse.set_diag(edge_index) if num_loops is not None else edge_index
            if num_loops is not None:
                # set_diag returns a row-major (dst, src)-sorted adjacency: sort our edges alike.
                src, dst, _ = _edge_list(edge_index)
                loops = torch.arange(num_loops, device=src.device)
                s = torch.cat([src[keep], loops]).long()
                d = torch.cat([dst[keep], loops]).long()
                alpha = alpha[torch.argsort(d * max(adj.size(1), 1) + s, stable=True)]
            return adj.set_value(alpha, layout='coo')
        if is_torch_sparse_tensor(edge_index):
            if num_loops is None:
                adj = set_sparse_value(edge_index, alpha)
                return adj, alpha
            # PyG rebuilds the adjacency (remove_self_loops, add_self_loops) in canonical order;
            # build it from our edge list the same way, carrying the attention as values.
            from torch_geometric.utils import (to_torch_coo_tensor, to_torch_csc_tensor,
                                               to_torch_csr_tensor)
            src, dst, _ = _edge_list(edge_index)
            loops = torch.arange(num_loops, device=src.device)
            full = torch.stack([torch.cat([dst[keep].long(), loops]), torch.cat([src[keep].long(), loops])])
            size = (edge_index.size(0), edge_index.size(1))
            build = {torch.sparse_coo: to_torch_coo_tensor, torch.sparse_csr: to_torch_csr_tensor,
                     torch.sparse_csc: to_torch_csc_tensor}[edge_index.layout]
            # PyG's attention follows the value order of that canonical adjacency: row-major
            # for COO/CSR, column-major for CSC. Permute explicitly (differentiably).
            major, minor = (full[1], full[0]) if edge_index.layout == torch.sparse_csc else (full[0], full[1])
            order = torch.argsort(major * max(size[0], size[1], 1) + minor, stable=True)
            alpha = alpha.index_select(0, order)
            adj = build(full[:, order], None, size)
            return set_sparse_value(adj, alpha), alpha
        if num_loops is not None:
            # The exact edge_index PyG returns (type included, e.g. EdgeIndex), from its own utils.
            edge_index, _ = remove_self_loops(edge_index)
            edge_index, _ = add_self_loops(edge_index, num_nodes=num_loops)
        return edge_index, alpha
