"""Expressions: einsum strings and the interleaved form, mode labels, and the effective network.

An expression names each operand's modes (``"ab,bc->ac"``, or ``(a, [0, 1], b, [1, 2], [0, 2])``
in the interleaved form). :func:`network_of` turns the labels into small integer mode ids and
describes the *effective* network the planner works on: broadcast dimensions (extent 1 against a
larger extent of the same label or ``...`` dimension elsewhere) squeezed away and repeated modes of one operand taken as diagonals, so that every mode occurs at
most once per operand. :func:`preprocess` applies those steps to the operand tensors (as
differentiable views). :func:`split_modes` splits modes into chunks (a view too), so that the
slicer can slice a mode in ranges rather than index by index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..graph import as_index

__all__ = ["EllipsisDim", "autocast_operands", "ModeChunks", "Network", "split_modes", "parse_string", "split_interleaved", "normalize_labels", "network_of",
           "promoted_dtype", "preprocess", "check_operands", "shapes_of", "label_str", "describe"]


class EllipsisDim:
    """Label of the ``p``-th broadcast (``...``) dimension, counted from the left of the
    broadcast shape."""
    __slots__ = ("p",)

    def __init__(self, p):
        self.p = p

    def __eq__(self, other):
        return isinstance(other, EllipsisDim) and other.p == self.p

    def __hash__(self):
        return hash(("torch_gradops.ellipsis", self.p))

    def __repr__(self):
        return f"...{self.p}"


class ModeChunks:
    """Label of the chunk index of a split mode: mode ``label`` of extent ``e`` taken as
    ``chunks`` ranges of ``e // chunks`` indices (:func:`split_modes`); slicing it slices
    ``label`` in ranges."""
    __slots__ = ("label", "chunks")

    def __init__(self, label, chunks: int):
        n = as_index(chunks)
        if n is None or n < 2:
            raise ValueError(f"ModeChunks({label!r}, {chunks!r}): chunks must be an int >= 2 (the mode's "
                             f"ranges; slice the whole mode by passing {label!r} itself)")
        self.label, self.chunks = label, n

    def __eq__(self, other):
        return isinstance(other, ModeChunks) and (other.label, other.chunks) == (self.label, self.chunks)

    def __hash__(self):
        return hash(("torch_gradops.chunks", self.label, self.chunks))

    def __repr__(self):
        return f"{label_str(self.label)}/{self.chunks}"


def label_str(label) -> str:
    return label if isinstance(label, str) else repr(label)


# ---------------------------------------------------------------------------- einsum strings
def _parse_term(term: str, where: str) -> List[Any]:
    if term.count("...") > 1:
        raise ValueError(f"{where} has more than one '...'")
    out: List[Any] = []
    parts = term.split("...")
    for j, part in enumerate(parts):
        if j:
            out.append(Ellipsis)
        for ch in part:
            if ch == "." or ch in ",->" or ch.isspace():
                raise ValueError(f"{where}: character {ch!r} is not a mode label (a '.' must be part of '...')")
            out.append(ch)
    return out


def parse_string(expr: str, n_operands: int):
    """``(terms, output or None)`` of an einsum string: lists of labels (characters or
    ``Ellipsis``); ``output`` is None for an implicit output."""
    if any(part.lstrip().startswith(">") for part in expr.split("-")[1:] if part[:1].isspace()):
        raise ValueError(f"expr {expr!r}: '->' is split by whitespace")  # (torch.einsum refuses it too)
    # ASCII whitespace only: other whitespace (U+3000, a no-break space) dropped silently made the
    # errors name terms the user never wrote; _parse_term refuses it as a label instead
    expr = "".join(ch for ch in expr if ch not in " \t\n\r\f\v")
    if expr.count("->") > 1:
        raise ValueError(f"expr {expr!r} has more than one '->'")
    lhs, arrow, rhs = expr.partition("->")
    if ("-" in lhs or ">" in lhs) or ("-" in rhs or ">" in rhs):
        raise ValueError(f"expr {expr!r}: a '-' or '>' outside of '->'")
    terms = lhs.split(",")
    if len(terms) != n_operands:
        raise ValueError(f"expr {expr!r} has {len(terms)} operand term(s) but {n_operands} operand(s) were given")
    parsed = [_parse_term(t, f"term {i} ({t!r}) of expr") for i, t in enumerate(terms)]
    output = _parse_term(rhs, "the output of expr") if arrow else None
    return parsed, output


# ---------------------------------------------------------------------------- interleaved form
def _is_label_list(x) -> bool:
    return isinstance(x, (list, tuple)) and not isinstance(x, torch.Tensor)


# Labels and option values of these types are hashable without asking hash(), which torch.compile
# could not trace before torch 2.14 (a graph break under fullgraph=True).
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def is_hashable(x) -> bool:
    """Whether ``x`` can be a dict key (a mode label, part of the plan cache's key)."""
    if isinstance(x, _PLAIN):
        return True
    try:
        hash(x)
    except TypeError:
        return False
    return True


def split_interleaved(args):
    """``(a, modes_a, b, modes_b, ..., [out_modes])`` -> ``(operands, terms, output or None)``."""
    operands, terms = [], []
    n = len(args)
    for k in range(n // 2):
        op, modes = args[2 * k], args[2 * k + 1]
        if k == 0 and not _is_label_list(modes) and not isinstance(op, torch.Tensor):
            raise TypeError(f"the first argument must be an einsum expression (a str) or, in the interleaved form, "
                            f"an operand followed by its list of modes; got {type(op).__name__} then "
                            f"{type(modes).__name__}")
        if not _is_label_list(modes):
            raise TypeError(f"interleaved form: the modes of operand {k} must be a list or tuple of "
                            f"hashable labels, got {type(modes).__name__}")
        for lab in modes:
            if lab is not Ellipsis and not is_hashable(lab):
                raise TypeError(f"interleaved form: mode label {lab!r} of operand {k} is not hashable")
        operands.append(op)
        terms.append(list(modes))
    output = None
    if n % 2:
        if not _is_label_list(args[-1]):
            raise TypeError("interleaved form: the last argument must be the list of output modes, got "
                            f"{type(args[-1]).__name__}")
        output = list(args[-1])
        for lab in output:
            if lab is not Ellipsis and not is_hashable(lab):
                raise TypeError(f"interleaved form: output mode label {lab!r} is not hashable")
    if not operands:
        raise ValueError("contract needs at least one operand")
    return operands, terms, output


def canonical_network(terms, output) -> Tuple[Tuple[Tuple[int, ...], ...], Tuple[int, ...]]:
    """``terms -> output`` (labels as :func:`normalize_labels` returns them) with every label
    renumbered by first appearance: two expressions of the same contraction under other labels
    (``"ij,jk->ik"``, ``"ab,bc->ac"``) get the same value."""
    ids: Dict[Any, int] = {}
    number = lambda labels: tuple(ids.setdefault(x, len(ids)) for x in labels)  # noqa: E731
    return tuple(number(t) for t in terms), number(output)


def describe(terms, output) -> str:
    """A readable expression for the interleaved form (plans and errors show it)."""
    return "interleaved: " + ",".join("(" + ",".join(label_str(x) for x in t) + ")" for t in terms) + \
        "->(" + ",".join(label_str(x) for x in output) + ")"


# ---------------------------------------------------------------------------- operands
def check_operands(operands) -> None:
    """Operands must be floating-point or complex tensors on one device."""
    if not operands:
        raise ValueError("contract needs at least one operand")
    for i, op in enumerate(operands):
        if not isinstance(op, torch.Tensor):
            hint = " of tensors" + _ONE_BY_ONE if _holds_tensors(op) else ""
            raise TypeError(f"operand {i} must be a torch.Tensor, got {type(op).__name__}{hint}")
    for i, op in enumerate(operands):
        check_dtype(op.dtype, f"operand {i}", operand=True)
    check_dtype(promoted_dtype(operands), "the operands' common dtype")
    dev = operands[0].device
    for i, op in enumerate(operands):
        if op.device != dev:
            raise ValueError(f"operand {i} is on {op.device} but operand 0 is on {dev}; all operands must "
                             "be on one device")


def check_dtype(dtype, what: str, operand: bool = False) -> None:
    """Contractions are of floating-point or complex tensors (GEMMs; gradients). ``operand``: the
    dtype of one operand, which may be complex32 when another promotes the contraction past it
    (complex32 with complex64 contracts in complex64)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype (torch.float32, ...), got {dtype!r} ({type(dtype).__name__})")
    # complex32 passes is_complex and float8/float4 is_floating_point, but torch has no matrix
    # multiply for them (CPU or CUDA): named here, not a "not implemented" from inside a GEMM
    if operand and dtype == torch.complex32:
        return
    if not (dtype.is_floating_point or dtype.is_complex) or dtype.itemsize == 1 or dtype == torch.complex32:
        why = ""
        if dtype == torch.complex32:
            why = " (torch has no matrix multiply for complex32; use complex64)"
        elif dtype.is_floating_point:
            why = " (torch has no general matrix multiply for float8 or float4)"
        raise TypeError(f"{what} must have a floating-point or complex dtype (float64/32/16, bfloat16, "
                        f"complex128/64), got {dtype}{why}")


_ONE_BY_ONE = " (pass the operands one by one: *operands)"


def _holds_tensors(x) -> bool:
    """Whether ``x`` is a list or tuple holding tensors: the operands passed as one argument."""
    return isinstance(x, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in x)


def _describe_bad_shape(x) -> str:
    """A short description of a tuple or list that is not a shape: its repr when short, else its
    type, length and the types of its first items (a list of tensors passed as one operand, for
    ``*operands``, would print every tensor)."""
    text = repr(x)
    if len(text) <= 80:
        return text
    kinds = ", ".join(dict.fromkeys(type(e).__name__ for e in x[:8]))
    return f"a {type(x).__name__} of {len(x)} items ({kinds}){_ONE_BY_ONE if _holds_tensors(x) else ''}"


def shapes_of(operands_or_shapes) -> Tuple[List[Tuple[int, ...]], List[torch.Tensor]]:
    """``(shapes, tensors)`` of a mix of tensors and shapes (tuples of non-negative ints)."""
    shapes, tensors = [], []
    for i, x in enumerate(operands_or_shapes):
        if isinstance(x, torch.Tensor):
            shapes.append(tuple(x.shape))
            tensors.append(x)
        elif isinstance(x, (tuple, list, torch.Size)) and all(isinstance(e, int) and 0 <= e < 2 ** 63 for e in x):
            shapes.append(tuple(int(e) for e in x))
        else:
            got = _describe_bad_shape(x) if isinstance(x, (tuple, list)) else type(x).__name__
            raise TypeError(f"operand {i} must be a torch.Tensor or a shape (tuple of non-negative ints below "
                            f"2^63), got {got}")
    return shapes, tensors


# ---------------------------------------------------------------------------- labels
def _rank_error(i, term, shape, named) -> ValueError:
    return ValueError(f"operand {i} has {len(shape)} dimension(s) (shape {tuple(shape)}) but its term "
                      f"{''.join('...' if x is Ellipsis else label_str(x) for x in term)!r} names {named}")


def _label_sizes(labels_per_operand, shapes):
    """``(sizes, broadcast)`` for operands' labels (``...`` expanded): each label's extent, which
    must be the same in every operand or 1 there (an extent of 1 broadcasts, as in
    ``torch.einsum``; within one operand a repeated label's extents must be equal), and per
    operand the dims of extent 1 whose label is larger elsewhere (squeezed away: that operand
    does not carry the mode)."""
    sizes: Dict[Any, int] = {}
    where: Dict[Any, int] = {}  # the operand that set a label's extent (for the error)
    for i, (labels, shape) in enumerate(zip(labels_per_operand, shapes)):
        own: Dict[Any, int] = {}
        for lab, ext in zip(labels, shape):
            ext = int(ext)
            if own.setdefault(lab, ext) != ext:
                raise ValueError(f"mode {label_str(lab)!r} is repeated in operand {i} with extents {own[lab]} "
                                 f"and {ext} (a diagonal needs equal extents)")
            cur = sizes.get(lab)
            if cur is None or (cur == 1 and ext != 1):
                sizes[lab], where[lab] = ext, i
            elif ext != cur and ext != 1:
                raise ValueError(f"mode {label_str(lab)!r} has extent {ext} in operand {i} but extent {cur} in "
                                 f"operand {where[lab]} (extents must match or be 1)")
    broadcast = [[d for d, (lab, ext) in enumerate(zip(labels, shape)) if int(ext) == 1 and sizes[lab] != 1]
                 for labels, shape in zip(labels_per_operand, shapes)]
    return sizes, broadcast


def _ellipsis_labels(terms, shapes):
    """:func:`normalize_labels`' first half for terms with ``...``: ``(terms, sizes, broadcast,
    number of '...' dimensions)``."""
    n_ell = 0
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        named = sum(1 for x in term if x is not Ellipsis)
        has_ell = any(x is Ellipsis for x in term)
        if (len(shape) < named) if has_ell else (len(shape) != named):
            raise _rank_error(i, term, shape, named)
        if has_ell:
            n_ell = max(n_ell, len(shape) - named)
    ell_sizes = [1] * n_ell
    out_terms = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        labels = []
        k = len(shape) - sum(1 for x in term if x is not Ellipsis)
        for x in term:
            if x is Ellipsis:
                labels.extend(EllipsisDim(n_ell - k + j) for j in range(k))
            else:
                labels.append(x)
        for lab, ext in zip(labels, shape):
            if isinstance(lab, EllipsisDim) and ext != 1:
                if ell_sizes[lab.p] not in (1, ext):
                    raise ValueError(f"the '...' dimensions do not broadcast: operand {i} has extent {ext} "
                                     f"where another operand has {ell_sizes[lab.p]}")
                ell_sizes[lab.p] = ext
        out_terms.append(labels)
    sizes, broadcast = _label_sizes(out_terms, shapes)
    return out_terms, sizes, broadcast, n_ell


def _plain_labels(terms, shapes):
    """:func:`_ellipsis_labels` for terms without ``...`` (the common case, a few times faster)."""
    out_terms = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        if len(shape) != len(term):
            raise _rank_error(i, term, shape, len(term))
        out_terms.append(list(term))
    sizes, broadcast = _label_sizes(out_terms, shapes)
    return out_terms, sizes, broadcast, 0


def normalize_labels(terms, output, shapes):
    """Expand ``...`` into per-dimension labels and check ranks and extents.

    Returns ``(terms, output, sizes, broadcast)``: terms/output as lists of labels,
    ``sizes[label]`` the extent, ``broadcast`` per operand the dims that are broadcast
    (extent 1 against a larger extent of the same label or ``...`` dimension, as ``torch.einsum``
    broadcasts them).
    """
    if not any(x is Ellipsis for term in terms for x in term):
        out_terms, sizes, broadcast, n_ell = _plain_labels(terms, shapes)
    else:
        out_terms, sizes, broadcast, n_ell = _ellipsis_labels(terms, shapes)
    counts: Dict[Any, int] = {}
    for labels in out_terms:
        for lab in labels:
            counts[lab] = counts.get(lab, 0) + 1
    ell_out = [EllipsisDim(p) for p in range(n_ell)]
    if output is None:
        single = [lab for lab, c in counts.items() if c == 1 and not isinstance(lab, EllipsisDim)]
        try:
            single = sorted(single)
        except TypeError:  # unorderable interleaved labels: order of first appearance
            pass
        out = ell_out + single
    else:
        if sum(1 for x in output if x is Ellipsis) > 1:
            raise ValueError("the output has more than one '...'")
        out = []
        for x in output:
            if x is Ellipsis:
                out.extend(ell_out)
            else:
                out.append(x)
        for lab in out:
            if lab not in counts and not isinstance(lab, EllipsisDim):
                raise ValueError(f"output mode {label_str(lab)!r} does not appear in any operand")
        if len(set(out)) != len(out):
            raise ValueError(f"the output repeats a mode: {[label_str(x) for x in out]}")
    return out_terms, out, sizes, broadcast


# ---------------------------------------------------------------------------- effective network
@dataclass(frozen=True)
class Network:
    """The effective network the planner and compiler work on.

    Attributes:
        labels: the user's label of each mode id (ids are ``0 .. len(labels)-1``).
        ids: label -> mode id.
        inputs: per operand its mode ids after preprocessing (all distinct within an operand).
        output: the output's mode ids.
        sizes: mode id -> extent.
        pre: per operand the preprocessing steps (``("squeeze", d)`` / ``("diag", d1, d2)`` /
            ``("split", d, chunks)``), or None.
    """
    labels: Tuple[Any, ...]
    ids: Dict[Any, int]
    inputs: Tuple[Tuple[int, ...], ...]
    output: Tuple[int, ...]
    sizes: Dict[int, int]
    pre: Tuple[Optional[Tuple[tuple, ...]], ...]

    def mode_counts(self) -> Dict[int, int]:
        """How many operands (the output counting as one) carry each mode."""
        count: Dict[int, int] = {}
        for t in list(self.inputs) + [self.output]:
            for m in t:
                count[m] = count.get(m, 0) + 1
        return count


def network_of(terms, output, sizes, broadcast) -> Network:
    """Mode ids for the labels of :func:`normalize_labels`'s result; per operand the
    preprocessing (broadcast squeeze, diagonals) and its modes afterwards."""
    ids: Dict[Any, int] = {}
    labels: List[Any] = []

    def idof(lab):
        if lab not in ids:
            ids[lab] = len(labels)
            labels.append(lab)
        return ids[lab]

    inputs, pre = [], []
    for i, term in enumerate(terms):
        modes = [idof(lab) for lab in term]
        steps = []
        for d in sorted(broadcast[i], reverse=True):
            steps.append(("squeeze", d))
            modes.pop(d)
        while len(set(modes)) != len(modes):
            seen = {}
            for d, m in enumerate(modes):
                if m in seen:
                    d1, d2 = seen[m], d
                    break
                seen[m] = d
            steps.append(("diag", d1, d2))
            # torch.diagonal puts the diagonal last
            modes = [m for d, m in enumerate(modes) if d not in (d1, d2)] + [modes[d1]]
        inputs.append(tuple(modes))
        pre.append(tuple(steps) or None)
    out = tuple(idof(lab) for lab in output)
    id_sizes = {ids[lab]: ext for lab, ext in sizes.items() if lab in ids}
    return Network(tuple(labels), ids, tuple(inputs), out, id_sizes, tuple(pre))


def split_modes(network: Network, splits: Dict[int, int]) -> Tuple[Network, Dict[int, int]]:
    """The network with each mode ``m`` of ``splits`` (not an output mode) split into a chunk
    mode of extent ``splits[m]`` (labelled :class:`ModeChunks`, a new id) followed by ``m`` of
    extent ``sizes[m] // splits[m]``; the operands get the split as a view (``unflatten``).
    Same operands in the same order, so any path of the network is a path of the result.
    Returns the network and the new ids (mode -> its chunk mode)."""
    labels, ids, sizes = list(network.labels), dict(network.ids), dict(network.sizes)
    chunk_id: Dict[int, int] = {}
    for m, f in sorted(splits.items()):
        e = sizes[m]
        if m in network.output or not 1 < f < e or e % f:
            raise ValueError(f"cannot split mode {label_str(labels[m])!r} of extent {e} into {f} chunks")
        lab = ModeChunks(labels[m], f)
        chunk_id[m] = len(labels)
        ids[lab] = len(labels)
        labels.append(lab)
        sizes[chunk_id[m]] = f
        sizes[m] = e // f
    inputs, pre = [], []
    for modes, steps in zip(network.inputs, network.pre):
        steps = list(steps or ())
        modes = list(modes)
        for d in sorted((d for d, m in enumerate(modes) if m in chunk_id), reverse=True):
            steps.append(("split", d, splits[modes[d]]))
            modes.insert(d, chunk_id[modes[d]])
        inputs.append(tuple(modes))
        pre.append(tuple(steps) or None)
    return Network(tuple(labels), ids, tuple(inputs), network.output, sizes, tuple(pre)), chunk_id


def apply_steps(t: torch.Tensor, steps: Sequence[tuple]) -> torch.Tensor:
    """One operand's preprocessing (squeeze broadcast dims, take diagonals, split modes into
    chunks), as views."""
    for kind, *args in steps:
        if kind == "squeeze":
            t = t.squeeze(args[0])
        elif kind == "diag":
            t = torch.diagonal(t, 0, args[0], args[1])
        else:
            t = t.unflatten(args[0], (args[1], t.shape[args[0]] // args[1]))
    return t


def promoted_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype the operands are contracted in: their promotion (as torch's binary ops)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != dtype:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def preprocess(operands: Sequence[torch.Tensor], pre, dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
    """Promote the operands to one dtype (``dtype``: their :func:`promoted_dtype`, when the
    caller has it) and apply each one's preprocessing (differentiable views)."""
    dtype = promoted_dtype(operands) if dtype is None else dtype
    out = [op if op.dtype == dtype else op.to(dtype) for op in operands]
    return [t if steps is None else apply_steps(t, steps) for t, steps in zip(out, pre)]


def autocast_operands(args) -> tuple:
    """Under ``torch.autocast`` for the operands' device: ``args`` with the float16, bfloat16 and
    float32 operands cast to autocast's dtype, torch.einsum's policy, when they are all of
    those dtypes (with a float64 or complex operand the network runs in that dtype, uncast;
    torch.einsum refuses such a mix); else ``args`` unchanged."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return args
    try:
        enabled = torch.is_autocast_enabled(tensors[0].device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return args
    if not enabled:
        return args
    eligible = (torch.float16, torch.bfloat16, torch.float32)
    if promoted_dtype(tensors) not in eligible:  # a float64 or complex operand: the whole network is
        return args                               # contracted in it; a bfloat16 copy would only lose bits
    low = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(a.to(low) if isinstance(a, torch.Tensor) and a.dtype in eligible else a for a in args)
