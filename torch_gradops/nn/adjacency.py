"""PyG adjacencies -> cached :class:`~torch_gradops.BipartiteCSC` graphs, for the attention layers.

Accepts what PyG's message passing accepts: a ``[2, E]`` Tensor or ``EdgeIndex`` (row 0 =
source), a ``torch.sparse`` (COO/CSR/CSC) or ``torch_sparse.SparseTensor`` *transposed* adjacency
``adj_t [num_dst, num_src]``. The conversion (:func:`torch_gradops.graph.csc_from_edges`, with
PyG's self-loop handling) is cached by the adjacency object's identity and ``_version`` (and, for
a CPU edge_index or ``SparseTensor``, a key of its ids' values, :func:`content_key`) and shared
by every layer, so a whole model converts each graph once; a CSR ``adj_t``, a ``SparseTensor`` or
an ``EdgeIndex`` sorted by column (destination) is converted without any sort.
"""
from __future__ import annotations

import contextlib
import functools
import random
import weakref
from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from torch_geometric.typing import SparseTensor, torch_sparse
from torch_geometric.utils import add_self_loops, is_torch_sparse_tensor, remove_self_loops, to_edge_index
from torch_geometric.utils.loop import compute_loop_attr
from torch_geometric.utils.sparse import set_sparse_value

from .._transforms import has_tangent, is_transformed
from .._segments import Segments, index_add_rows, plain_ops
from ..graph import BipartiteCSC, _func_off_unless_wrapped, csc_from_edges

__all__ = ["edge_list", "is_edge_index", "csc_graph", "clear_csc_cache", "CSC_CACHE", "propagate_sizes",
           "content_key", "KEY_CHUNK", "num_edges", "layer_edge_dim", "edge_attr_2d", "loop_edge_attr",
           "layer_edge_features", "EDGE_FEATURE_CACHE", "LOOP_GROUP_CACHE", "attention_result", "needs_message_passing",
           "coalesced_adjacency", "FusedMessagePassing"]

try:  # PyG >= 2.5
    from torch_geometric import EdgeIndex
except ImportError:  # pragma: no cover
    EdgeIndex = None

# edge_index object -> {(num_src, num_dst, num_loops): ((edge_index._version, content_key), BipartiteCSC)}.
# Keyed by identity and held weakly: an entry lives exactly as long as the user's edge_index,
# and is shared by all layers, so a whole model converts each graph once.
CSC_CACHE = WeakIdKeyDictionary()


# edge_attr object -> ((edge_attr._version, _feature_key), weakref to the BipartiteCSC, num_loops,
# fill_value, dtype, features in CSC order): one entry per edge_attr, held weakly like CSC_CACHE;
# never an entry whose features are edge_attr's own memory (it would keep its key alive).
EDGE_FEATURE_CACHE = WeakIdKeyDictionary()


# BipartiteCSC (from csc_graph: a new one for another or an edited edge_index) -> {num_loops:
# (Segments, ids, count)}: the input edges grouped by the added self-loop whose features they
# reduce into (loop_edge_attr), and each group's size. Sorting them is most of the reduction's
# cost (about 80 of 130 ms at E=2M), which features that need a gradient pay every step.
LOOP_GROUP_CACHE = WeakIdKeyDictionary()


def clear_csc_cache() -> None:
    """Forget every cached CSC conversion, ordered edge features and self-loop grouping (they
    are also dropped with their ``edge_index`` / ``edge_attr``)."""
    CSC_CACHE.clear()
    EDGE_FEATURE_CACHE.clear()
    LOOP_GROUP_CACHE.clear()


def _version(t) -> Optional[int]:
    try:
        return t._version
    except (AttributeError, RuntimeError):  # e.g. SparseTensor, some sparse layouts
        return None


KEY_CHUNK = 1 << 16  # ids per step of _ids_key


@functools.lru_cache(maxsize=1)
def _key_weights() -> Tensor:
    """``KEY_CHUNK`` float64 weights in [1, 2), one per offset in a chunk: drawn once, on the
    first key, with Python's random (torch's RNG refuses to run inside vmap, where a layer's
    first call may come). A plain normal tensor even when that call is under a torch.func
    transform (kept, a transform's tensor would fail later calls: "escaped?") or inference mode."""
    rng = random.Random(0x5EED)
    with torch._C._DisableFuncTorch(), torch.inference_mode(False):
        return torch.tensor([1.0 + rng.random() for _ in range(KEY_CHUNK)], dtype=torch.float64)


def _ids_key(ids: Tensor) -> Tuple[int, int, int]:
    """Length, sum, and a hash of position-weighted float64 sums of an integer tensor's values:
    per chunk of ``KEY_CHUNK`` values, the sum of each value times a fixed random weight of its
    offset (the chunks' sums hashed as a tuple, so a change in one is not lost in the rounding of
    a total). Moving two values ``a != b`` within a chunk changes its sum by ``(a - b) (w_i -
    w_j)``, far above its rounding unless the two weights nearly coincide; between chunks, or
    changing a value, changes the sums by a multiple of a weight. Random, not a regular sequence:
    with weights ``1 + frac(k * golden ratio)`` the swap of an edge (both its ids) cancelled in
    1.2% of the swaps on small graphs, the two ids' changes having equal weight differences.
    Float64 products and sums: torch's int64 multiplies take 1.6-12 ns per element on CPU, and
    XOR-based keys (no multiply) only see their masks' low bits for small ids."""
    ids = ids.detach().reshape(-1)
    weights = _key_weights()
    sums = []
    for start in range(0, ids.numel(), KEY_CHUNK):
        part = ids[start:start + KEY_CHUNK].to(torch.float64)
        sums.append(float(torch.dot(part, weights[:part.numel()])))
    return (ids.numel(), int(ids.sum(dtype=torch.int64)), hash(tuple(sums)))


def content_key(edge_index) -> Optional[Tuple]:
    """For a CPU ``[2, E]`` Tensor or ``EdgeIndex``: its length, the sum of its ids and a hash
    of position-weighted sums of them (:func:`_ids_key`), which a cache hit must match too; for a
    CPU ``SparseTensor`` (which has no version counter at all) the same of its row pointers and
    column ids. Writes that bypass the version counter (a ``torch.from_numpy`` buffer edited
    through numpy, ``.data``, DLPack, a ``SparseTensor``'s ``storage.col()`` edited in place)
    change it without a new version. About a tenth of a conversion or less (8-22 ms against
    139-272 ms for 10^6 edges, one thread, Xeon VM shared with other work, 2026-11-29).
    None elsewhere: on a GPU the comparison would synchronise, and ``torch.sparse`` adjacencies
    keep their ids in other layouts."""
    if isinstance(edge_index, SparseTensor) and edge_index.device().type == "cpu":
        return _ids_key(edge_index.storage.rowptr()) + _ids_key(edge_index.storage.col())
    if not isinstance(edge_index, Tensor) or edge_index.layout != torch.strided or edge_index.device.type != "cpu":
        return None
    return _ids_key(edge_index.as_tensor() if is_edge_index(edge_index) else edge_index)


_KEY_ROWS = 1 << 16  # rows per GEMV of _feature_key: a half or integer chunk is widened, not all


def _feature_key(edge_attr: Tensor) -> Optional[float]:
    """For CPU edge features ``[E, ...]``: a weighted sum of every value (weights that differ per
    column and per row), which a cache hit of :data:`EDGE_FEATURE_CACHE` must match too, for the
    writes that bypass the version counter (see :func:`content_key`). Each row's weighted sum is
    a GEMV in float32 (float64 for float64 and integer features; half types and integers widened
    a chunk of rows at a time; complex as real pairs), summed over the rows in float64. A change
    smaller than the rounding of a row's weighted sum can go unseen; its effect on a layer's
    output is of that size. NaN features never match (rebuilt every call); infinite ones hide
    later edits, when the layer's output is infinite or NaN anyway. None on a GPU (the
    comparison would synchronise)."""
    if edge_attr.device.type != "cpu" or edge_attr.layout != torch.strided:
        return None
    t = edge_attr.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dim() == 0 or t.numel() == 0:
        return float(t.sum(dtype=torch.float64))
    rows = t.reshape(t.size(0), -1)
    work = torch.float64 if t.dtype == torch.float64 or not t.is_floating_point() else torch.float32
    col_w = torch.arange(1, rows.size(1) + 1, dtype=torch.float64).mul_(0.6180339887498949).frac_().add_(1).to(work)
    row_w = torch.arange(1, rows.size(0) + 1, dtype=torch.float64).mul_(0.7548776662466927).frac_().add_(1)
    total = 0.0
    for start in range(0, rows.size(0), _KEY_ROWS):
        part = rows[start:start + _KEY_ROWS].to(work)  # (no copy in the features' own dtype)
        total += float((part @ col_w).to(torch.float64) @ row_w[start:start + _KEY_ROWS])
    return total


def _is_inference(t) -> bool:
    """Whether ``t`` is an inference tensor (made under ``torch.inference_mode()``): no version
    counter, so the caches cannot see it change."""
    return isinstance(t, Tensor) and t.is_inference()


def is_edge_index(t) -> bool:
    return EdgeIndex is not None and isinstance(t, EdgeIndex)


def edge_list(edge_index) -> Tuple[Tensor, Tensor, Optional[bool]]:
    """``(src, dst, dst_sorted)`` of any supported adjacency, in its own edge (value) order.

    Sparse adjacencies are PyG's transposed ``adj_t [num_dst, num_src]``: rows are
    destinations, so a CSR ``adj_t`` (or a ``SparseTensor``) is already our CSC.
    """
    if isinstance(edge_index, SparseTensor):
        row, col, _ = edge_index.coo()
        return col, row, True
    if is_torch_sparse_tensor(edge_index):
        if edge_index.layout == torch.sparse_coo:
            # its indices as they are: PyG's to_edge_index marks the tensor coalesced
            # (``_coalesced_(True)``), which bumps the version of indices that another layer of
            # the same forward may have saved for its backward ("modified by an inplace operation")
            row, col = edge_index._indices()
            return col, row, None
        (row, col), _ = to_edge_index(edge_index)
        return col, row, True if edge_index.layout == torch.sparse_csr else None
    if is_edge_index(edge_index):
        plain = edge_index.as_tensor()
        return plain[0], plain[1], True if edge_index.is_sorted_by_col else None
    if isinstance(edge_index, Tensor):
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(f"edge_index must have shape [2, E], got {tuple(edge_index.shape)}")
        if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
            raise ValueError(f"edge_index must be an integer tensor, got {edge_index.dtype}")
        return edge_index[0], edge_index[1], None
    raise _not_an_adjacency(edge_index)


def _not_an_adjacency(edge_index) -> ValueError:
    return ValueError("edge_index must be a [2, E] integer Tensor, an EdgeIndex, a torch.sparse adjacency or a "
                      f"torch_sparse.SparseTensor, got {type(edge_index).__name__}")


# torch.sparse COO adj_t flagged coalesced -> (its indices' version, whether they are sorted and
# unique): held weakly, so a tensor is checked once per version (on a GPU the check synchronises)
_COO_CHECKS = WeakIdKeyDictionary()


def _is_coalesced(adj) -> bool:
    """Whether a COO ``adj_t`` is coalesced in fact, not only by its flag: PyG's ``to_edge_index``
    sets the flag (``_coalesced_(True)``) without merging duplicates, so a tensor that a PyG
    layer read earlier in the model may carry duplicate or unsorted entries under it. One pass
    over its ids, cached per tensor and version of its indices (the flag cannot be cleared)."""
    if not adj.is_coalesced():
        return False
    if torch.compiler.is_compiling():  # no data-dependent check in a graph: the flag
        return True
    idx = adj._indices()
    version = _version(idx)
    hit = _COO_CHECKS.get(adj)
    if hit is not None and version is not None and hit[0] == version:
        return hit[1]
    lin = idx[0] * adj.size(1) + idx[1]
    ok = bool((lin[1:] > lin[:-1]).all()) if lin.numel() > 1 else True
    if version is not None:
        _COO_CHECKS[adj] = (version, ok)
    return ok


def coalesced_adjacency(edge_index, edge_attr: Optional[Tensor]):
    """``edge_index`` as the layers read it: an uncoalesced ``torch.sparse`` COO ``adj_t`` (or
    one flagged coalesced that is not, see :func:`_is_coalesced`) as a coalesced copy
    (duplicates merged), the graph PyG's layers use (with self-loops; without, they refuse a
    tensor not flagged coalesced), so that every later step sees one edge list; the caller's
    tensor is left as it is (PyG's ``to_edge_index`` would mark it coalesced without
    coalescing it). With ``edge_attr``, whose rows such a tensor cannot order, it is refused.
    (The copy is new each call, so its graph conversion is not cached.) Anything but an
    adjacency (None, a tuple of rows, a list) is refused here, before any cache sees it."""
    if not isinstance(edge_index, (Tensor, SparseTensor)):
        raise _not_an_adjacency(edge_index)
    if not (is_torch_sparse_tensor(edge_index) and edge_index.layout == torch.sparse_coo
            and not _is_coalesced(edge_index)):
        return edge_index
    if edge_attr is not None:
        raise ValueError("edge_attr with an uncoalesced torch.sparse COO adjacency: its entries have no "
                         "edge order to match edge_attr's rows (PyG's layers merge or refuse them); "
                         "coalesce() it first")
    if edge_index.is_coalesced():  # flagged but not: coalesce() would return it as it is
        return torch.sparse_coo_tensor(edge_index._indices(), edge_index.values(), edge_index.shape).coalesce()
    return edge_index.coalesce()


def csc_graph(edge_index, num_src: int, num_dst: int, num_loops: Optional[int]) -> BipartiteCSC:
    """The (cached) CSC graph of ``edge_index`` with ``num_loops`` self-loops handled as
    :func:`~torch_gradops.graph.csc_from_edges` describes (None: edges kept as they are)."""
    def build():
        src, dst, dst_sorted = edge_list(edge_index)
        return csc_from_edges(src, dst, num_src, num_dst, self_loops=num_loops, dst_sorted=dst_sorted)

    if torch.compiler.is_compiling() or torch.jit.is_tracing() or _is_inference(edge_index):
        # Under torch.compile the conversion is traced into the graph (static-shape ops);
        # a Python-side cache cannot live inside a compiled region. Under torch.jit.trace a hit
        # would leave the conversion out of the recorded graph (its check run then records a
        # different graph from the first). An inference tensor has no version counter: an
        # in-place edit of it could not be told from a cache hit.
        return build()
    key = (num_src, num_dst, num_loops)
    version = (_version(edge_index), content_key(edge_index))
    entries = CSC_CACHE.get(edge_index)
    if entries is not None:
        hit = entries.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
    # normal tensors even under inference mode: the cached graph serves later training calls,
    # whose backward cannot save inference tensors; and plain ones under a torch.func transform
    # (a first call under hessian), which later calls under other transforms could not use
    # ("escaped?"), unless edge_index itself is the transform's (its entry dies with it)
    ids = edge_index.storage.col() if isinstance(edge_index, SparseTensor) else edge_index
    with torch.inference_mode(False), _func_off_unless_wrapped(ids):
        graph = build()
    if entries is None:
        entries = {}
        CSC_CACHE[edge_index] = entries
    entries[key] = (version, graph)
    return graph


# ---------------------------------------------------------------------------- PyG conventions
def propagate_sizes(edge_index, num_src: int, num_dst_rows: Optional[int], size: Optional[Tuple[int, int]],
                    add_loops: bool, edge_dim: Optional[int] = None) -> Tuple[int, Optional[int]]:
    """``(num_dst, num_loops)`` as PyG's attention layers infer them: destinations from ``x_dst``'s
    rows, ``size[1]``, a sparse adjacency's rows or an ``EdgeIndex``'s columns (else the source
    count); the self-loops to add (None without ``add_loops``), as those layers count them.
    ``num_dst_rows`` is ``x_dst.size(0)`` or None. Like PyG, a ``SparseTensor`` with self-loops
    to add cannot carry edge features (``edge_dim`` set): ``NotImplementedError``."""
    if add_loops and edge_dim is not None and isinstance(edge_index, SparseTensor):
        raise NotImplementedError("The usage of 'edge_attr' and 'add_self_loops' simultaneously is currently not "
                                  "yet supported for 'edge_index' in a 'SparseTensor' form")
    sparse = isinstance(edge_index, SparseTensor) or is_torch_sparse_tensor(edge_index)
    num_dst: Optional[int] = None
    if sparse:
        if edge_index.size(1) != num_src:
            raise ValueError(f"the adjacency has {edge_index.size(1)} columns (sources) but x has {num_src} "
                             "source rows")
        num_dst = edge_index.size(0)
    if size is not None:
        if size[0] is not None and size[0] != num_src:
            raise ValueError(f"size[0]={size[0]} but x has {num_src} source rows")
        if size[1] is not None:
            num_dst = size[1]
    if num_dst_rows is not None:
        if num_dst is not None and num_dst != num_dst_rows:
            raise ValueError(f"{num_dst} destinations expected but x_dst has {num_dst_rows} rows")
        num_dst = num_dst_rows
    num_loops: Optional[int] = None
    if add_loops:
        if sparse:
            num_loops = min(edge_index.size(0), edge_index.size(1))
        else:
            num_loops = num_src if num_dst_rows is None else min(num_src, num_dst_rows)
            if size is not None:
                num_loops = min(size)
    if is_edge_index(edge_index) and size is None:
        _check_edge_index_size(edge_index, num_src, num_dst_rows, num_loops)
    if num_dst is None:
        # `(x_src, None)` without `size`: PyG's propagate falls back to the source count (or to
        # an EdgeIndex's number of columns, after PyG's concatenation with the self-loops'
        # EdgeIndex, whose sizes are the larger of the two's).
        if is_edge_index(edge_index) and edge_index.num_cols is not None:
            num_dst = max(edge_index.num_cols, num_loops or 0)
        else:
            num_dst = num_src
    return num_dst, num_loops


def _check_edge_index_size(edge_index, num_src: int, num_dst_rows: Optional[int], num_loops: Optional[int]) -> None:
    """An ``EdgeIndex``'s ``sparse_size`` must match the node features, as PyG's propagate
    checks it: sources against ``x_src``'s rows, destinations against ``x_dst``'s (when given),
    after the self-loops (``num_loops`` of them) widen each known size to at least that."""
    for dim, (known, rows, what) in enumerate(zip(edge_index.sparse_size(), (num_src, num_dst_rows),
                                                  ("sources", "destinations"))):
        if known is None or rows is None:
            continue
        expected = known if num_loops is None else max(known, num_loops)
        if expected != rows:
            raise ValueError(f"Encountered tensor with size {rows} in dimension 0, but expected size {expected}: "
                             f"edge_index is an EdgeIndex of sparse_size {tuple(edge_index.sparse_size())}, whose "
                             f"dimension {dim} ({what}, {expected} with the self-loops added) must match the "
                             f"{'source' if dim == 0 else 'destination'} features' {rows} rows")


def num_edges(edge_index) -> int:
    """The number of edges of any supported adjacency (before self-loop handling)."""
    if isinstance(edge_index, SparseTensor):
        return edge_index.nnz()
    if is_torch_sparse_tensor(edge_index):
        return edge_index._nnz()
    return edge_index.size(1)


def layer_edge_dim(layer) -> Optional[int]:
    """A layer's declared ``edge_dim`` (None when unknown or lazy, ``-1``)."""
    dim = getattr(layer, "edge_dim", None)
    return dim if isinstance(dim, int) and dim > 0 else None


def _check_edge_attr(edge_attr, edge_dim: Optional[int]) -> None:
    """A tensor of at least one dim whose last (or only) dim has ``edge_dim`` features."""
    if not isinstance(edge_attr, Tensor) or edge_attr.dim() == 0:
        raise ValueError(f"edge_attr must be a tensor [E, edge_dim] or [E], got "
                         f"{tuple(edge_attr.shape) if isinstance(edge_attr, Tensor) else type(edge_attr).__name__}")
    width = 1 if edge_attr.dim() == 1 else edge_attr.size(-1)
    if edge_dim is not None and width != edge_dim:
        raise ValueError(f"edge_attr has {width} features per edge (shape {tuple(edge_attr.shape)}), but the "
                         f"layer was built with edge_dim={edge_dim}")


def edge_attr_2d(edge_attr: Tensor, edge_index, dtype: torch.dtype, edge_dim: Optional[int] = None) -> Tensor:
    """``edge_attr`` as PyG's attention layers read it, ``[E, edge_dim]``: ``[E]`` is one feature
    per edge, and the leading dims of ``[..., edge_dim]`` hold the ``E`` rows (PyG's ``lin_edge``
    maps the last dim, then views ``[-1, heads, C]``); integer features become ``dtype``, as
    PyG's concatenation with the loops' features promotes them (without loops, or with a tensor
    ``fill_value``, PyG's ``lin_edge`` refuses them; this accepts them). ``E`` must be ``edge_index``'s
    number of edges. An inference tensor used with autograd on is copied to a normal one (which
    autograd can save, as PyG's concatenation makes one)."""
    _check_edge_attr(edge_attr, edge_dim)
    ea = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr.reshape(-1, edge_attr.size(-1))
    expected = num_edges(edge_index)
    if ea.size(0) != expected:
        raise ValueError(f"edge_attr must have one row per edge of edge_index ({expected}), got shape "
                         f"{tuple(edge_attr.shape)}")
    if not (ea.is_floating_point() or ea.is_complex()):
        ea = ea.to(dtype)
    elif not torch.compiler.is_compiling() and ea.is_inference() and not torch.is_inference_mode_enabled():
        ea = ea.clone()
    return ea


def _loop_columns(edge_index, num_loops: int) -> Tuple[Tensor, Tensor]:
    """``(src, col)`` (int64): each input edge's source and the loop row its features reduce into,
    ``num_loops`` (a scratch row) for the input's own self-loops and edges into destinations that
    get no loop."""
    src, dst, _ = edge_list(edge_index)
    src, dst = src.long(), dst.long()
    return src, torch.where((src == dst) | (dst >= num_loops), num_loops, dst)


def _loop_groups(edge_index, num_loops: int, graph: Optional[BipartiteCSC]):
    """``(segments, ids, count)`` of the loop rows (:func:`_loop_columns`): the input edges
    grouped by row (:meth:`Segments.of_index`) and each row's edge count ``[num_loops + 1]``,
    cached per ``graph`` (built each call without one). Built as the graph builds its own
    cached indices (``BipartiteCSC._building``): normal tensors even under inference mode, and
    with torch.func off, so that groups first built inside a transform (``hessian``) are not
    its wrappers, which a later call under another transform could not use."""
    entries = None if graph is None else LOOP_GROUP_CACHE.get(graph)
    if entries is not None and num_loops in entries:
        return entries[num_loops]
    with (graph._building() if graph is not None else contextlib.nullcontext()), torch.inference_mode(False):
        col = _loop_columns(edge_index, num_loops)[1]
        segs, ids = Segments.of_index(col)
        count = torch.bincount(col, minlength=num_loops + 1)
    if graph is not None:
        LOOP_GROUP_CACHE.setdefault(graph, {})[num_loops] = (segs, ids, count)
    return segs, ids, count


def loop_edge_attr(edge_attr: Tensor, edge_index, num_loops: int, fill_value,
                   graph: Optional[BipartiteCSC] = None) -> Tensor:
    """Edge features of the added self-loops, ``[num_loops, edge_dim]``, by ``fill_value``.

    Like PyG (``remove_self_loops`` then ``compute_loop_attr``), the input's own self-loops take
    no part in a reduction; they (and edges into destinations that get no loop) are routed to a
    scratch row ``num_loops`` instead of being removed, to keep shapes static. ``graph``, the
    CSC graph of ``edge_index`` (:func:`csc_graph`), keys a cache of the edges' grouping by loop
    for the sums and means."""
    if not isinstance(fill_value, str):
        return compute_loop_attr(edge_attr.new_zeros((2, 0), dtype=torch.long), edge_attr, num_loops, False,
                                 fill_value)
    if fill_value in ("add", "sum", "mean") and not torch.compiler.is_compiling():
        # PyG's scatter sum/mean (scatter_add_, atomic on CUDA), summed in a fixed order
        total = edge_attr.new_zeros((num_loops + 1,) + edge_attr.shape[1:])
        if plain_ops():  # torch.jit.trace: index_add itself (index_add_rows), nothing to cache
            col = _loop_columns(edge_index, num_loops)[1]
            out, count = index_add_rows(total, col, edge_attr), torch.bincount(col, minlength=num_loops + 1)
        else:
            segs, ids, count = _loop_groups(edge_index, num_loops, graph)
            out = index_add_rows(total, None, edge_attr, groups=(segs, ids))
        if fill_value == "mean":
            out = out / count.clamp(min=1).to(out.dtype).view((-1,) + (1,) * (out.dim() - 1))
        return out[:num_loops]
    src, col = _loop_columns(edge_index, num_loops)
    return compute_loop_attr(torch.stack([src, col]), edge_attr, num_loops + 1, False, fill_value)[:num_loops]


def layer_edge_features(edge_attr: Tensor, edge_index, graph: BipartiteCSC, num_loops: Optional[int],
                        fill_value, dtype: torch.dtype, edge_dim: Optional[int] = None) -> Tuple[Tensor, bool]:
    """``(features [E', edge_dim], input_order)``: ``edge_attr`` (as :func:`edge_attr_2d` reads
    it, integers as ``dtype``) followed by the added self-loops' features
    (:func:`loop_edge_attr`), in ``graph``'s CSC order (``input_order`` False), or in the
    processed input edge order that ``graph.perm`` reads (``input_order`` True; ``graph`` is
    :func:`csc_graph` of ``edge_index``).

    Edge features that need no gradient are usually fixed data, passed again every step: the
    result is then reordered once and cached per ``edge_attr`` (one entry, keyed and invalidated
    like the CSC conversion), so the loop features' reduction and the reordering (three passes
    over ``E x edge_dim``) run once, and the kernels read the features in order. Otherwise they
    are left in input order, for the kernels to read through ``graph.perm`` (no reordered copy,
    and their gradient written in place). Not cached for features with a forward-mode tangent
    (a dual's tangent can change in place, as ``gradcheck(check_forward_ad=True)`` does), under ``torch.compile`` or
    ``torch.jit.trace``, inference mode (an inference tensor cannot be saved for a later
    backward), for an inference tensor (no version counter), under torch.func transforms (of
    any input: what they compute is their wrappers), with a Tensor ``fill_value``, or where the
    input is already in CSC order with nothing added (nothing to save)."""
    def full_features():
        ea = edge_attr_2d(edge_attr, edge_index, dtype)  # (its width is checked below, once)
        return ea if num_loops is None else torch.cat([ea, loop_edge_attr(ea, edge_index, num_loops, fill_value, graph)])

    _check_edge_attr(edge_attr, edge_dim)  # (before the cache: a hit must not skip it)
    if (edge_attr.requires_grad or has_tangent(edge_attr) or torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch.is_inference_mode_enabled()
            or _is_inference(edge_attr) or isinstance(fill_value, Tensor) or is_transformed(edge_attr)
            or torch._C._are_functorch_transforms_active()):  # (its results are the transforms' wrappers)
        return full_features(), graph.perm is not None
    if graph.perm is None and num_loops is None and (edge_attr.is_floating_point() or edge_attr.is_complex()):
        # already in CSC order and nothing added: the features as they are (a view of
        # ``edge_attr``, which an entry would keep alive from its own value: a leak per batch).
        # Every other case below builds a new tensor (reordered, extended or cast).
        return full_features(), False
    hit = EDGE_FEATURE_CACHE.get(edge_attr)
    version = (_version(edge_attr), _feature_key(edge_attr))
    if hit is not None:
        v, graph_ref, loops, fill, dt, ordered = hit
        # dtype too: integer features are cast to it, and the loops' features computed in it
        if v == version and graph_ref() is graph and loops == num_loops and fill == fill_value and dt == dtype:
            return ordered, False
    # (a cache hit's edge_attr was read and checked when its entry was built)
    ordered = graph.edge_order(full_features())
    EDGE_FEATURE_CACHE[edge_attr] = (version, weakref.ref(graph), num_loops, fill_value, dtype, ordered)
    return ordered, False


def attention_result(edge_index, alpha: Tensor, num_loops: Optional[int]):
    """What PyG's attention layers return for ``return_attention_weights=True``, from ``alpha``
    in processed edge order (:func:`~torch_gradops.graph.csc_from_edges`): ``(edge_index',
    alpha)`` for Tensor input (after self-loop handling), ``(adj', alpha)`` for
    ``torch.sparse``, ``adj'`` with the attention as values for a ``SparseTensor``."""
    if num_loops is not None:
        src, dst, _ = edge_list(edge_index)
        E = src.numel()
        keep = src != dst
        # One nonzero for every selection by `keep`: under torch.compile each boolean mask gets
        # its own unbacked size, and torch 2.11's Inductor fails unifying two of them.
        kept = keep.nonzero().view(-1)
        alpha = torch.cat([alpha[:E].index_select(0, kept), alpha[E:]])
    if isinstance(edge_index, SparseTensor):
        adj = torch_sparse.set_diag(edge_index) if num_loops is not None else edge_index
        if num_loops is not None:
            # set_diag returns a row-major (dst, src)-sorted adjacency: sort our edges alike.
            loops = torch.arange(num_loops, device=src.device)
            s = torch.cat([src.index_select(0, kept), loops]).long()
            d = torch.cat([dst.index_select(0, kept), loops]).long()
            alpha = alpha[torch.argsort(d * max(adj.size(1), 1) + s, stable=True)]
        return adj.set_value(alpha, layout='coo')
    if is_torch_sparse_tensor(edge_index):
        if num_loops is None:
            return set_sparse_value(edge_index, alpha), alpha
        # PyG rebuilds the adjacency (remove_self_loops, add_self_loops) in canonical order;
        # build it from our edge list the same way, carrying the attention as values.
        from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor
        loops = torch.arange(num_loops, device=src.device)
        full = torch.stack([torch.cat([dst.index_select(0, kept).long(), loops]),
                            torch.cat([src.index_select(0, kept).long(), loops])])
        size = (edge_index.size(0), edge_index.size(1))
        build = {torch.sparse_coo: to_torch_coo_tensor, torch.sparse_csr: to_torch_csr_tensor,
                 torch.sparse_csc: to_torch_csc_tensor}[edge_index.layout]
        # PyG's attention follows the value order of that canonical adjacency: row-major for
        # COO/CSR, column-major for CSC. Permute explicitly (differentiably).
        major, minor = (full[1], full[0]) if edge_index.layout == torch.sparse_csc else (full[0], full[1])
        order = torch.argsort(major * max(size[0], size[1], 1) + minor, stable=True)
        alpha = alpha.index_select(0, order)
        adj = build(full[:, order], None, size)
        return set_sparse_value(adj, alpha), alpha
    if num_loops is not None:
        # The exact edge_index PyG returns (type included, e.g. EdgeIndex), from its own utils;
        # a plain Tensor loses its loops by `kept` (what remove_self_loops selects).
        if type(edge_index) is Tensor:
            edge_index = edge_index.index_select(1, kept)
        else:
            edge_index, _ = remove_self_loops(edge_index)
        edge_index, _ = add_self_loops(edge_index, num_nodes=num_loops)
    return edge_index, alpha


# MessagePassing's own hooks, which run inside propagate()
_MESSAGE_PASSING_HOOKS = tuple(f"_{stage}_forward{kind}_hooks" for stage in
                               ("propagate", "message", "aggregate", "message_and_aggregate", "edge_update")
                               for kind in ("_pre", ""))


def needs_message_passing(layer) -> bool:
    """Whether ``layer`` must run PyG's own ``propagate``: an explainer's edge mask is installed
    (``layer.explain``, what ``torch_geometric.explain`` sets) or a MessagePassing hook is
    registered (``register_message_forward_hook``, ...). The fused kernel has neither a
    per-edge message to mask nor one to show a hook, so the layers then run PyG's forward."""
    if getattr(layer, "explain", False):
        return True
    return any(len(getattr(layer, name, ())) for name in _MESSAGE_PASSING_HOOKS)


class FusedMessagePassing:
    """Base of the fused layers, before PyG's layer class: PyG specialises ``propagate()`` and
    ``edge_updater()`` to the calls that ``forward``'s source makes, and the fused ``forward``
    makes none, so the specialised ones took no arguments. The generic ones stay, for PyG's
    forward when :func:`needs_message_passing` (explainers, MessagePassing hooks)."""

    def _set_jittable_templates(self, raise_on_error: bool = False) -> None:
        return
