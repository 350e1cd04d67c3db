"""Sliced tensor-network contraction with exact, memory-bounded gradients.

``contract("ab,bc,cd->ad", a, b, c)`` plans the contraction once (path from ``opt_einsum`` or
``cotengra``, slicing to fit ``memory_limit``), caches the plan by (expression, shapes, dtype,
device type, options), compiles it into a flat program of pairwise steps
(permute / reshape / batched matmul, with the sums and slice selections around them) and runs
the program in C++ through ATen (``torch.ops.torch_gradops.contract_program``): one op call for
all slices (one per slice with ``progress=True``), no per-step Python.

Gradients (:class:`ContractFunction`) recompute one slice at a time in C++
(``contract_program_backward``; a slice whose intermediates together exceed the budget is
recomputed segment by segment between checkpoints) and accumulate each operand's gradient
across slices. ``memory_limit`` bounds the modelled working set of one slice's forward +
backward (:attr:`ContractionPlan.slice_working_set`), so the peak extra memory of forward +
backward stays within about ``memory_limit`` + operands + their gradients, whatever the
number of slices (and the forward alone within ``memory_limit`` + operands). ``create_graph=True`` and forward-mode AD express the
derivative of a network as further networks and contract them with this same function, so they
are differentiable again.

Shapes: every operand ``k`` has one dimension per mode of its term; the result has one
dimension per output mode (a 0-dim tensor for a scalar output).
"""
from __future__ import annotations

import math
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

import opt_einsum
import torch

from ._library import check_backend, ops

__all__ = ["contract", "plan", "ContractionPlan", "ContractFunction", "parse_memory_limit",
           "plan_cache_info", "clear_plan_cache"]

_VERSION = 1
_SELECT, _SUM, _CONTRACT, _FINAL, _CHECKPOINT = 1, 2, 3, 4, 5


# ---------------------------------------------------------------------------- fake kernels
def _program_out_shape(program):
    ndim = program[3]
    return [int(s) for s in program[4:4 + ndim]]


@torch.library.register_fake("torch_gradops::contract_program")
def _contract_program_fake(operands, program, slice_table):
    return operands[0].new_empty(_program_out_shape(program))


def _cached_shapes(program, needs_grad):
    """Shapes of what contract_program_cached returns: per CONTRACT its [Bt,M,K] and [Bt,K,N]
    GEMM operands, or [0] where no gradient in needs_grad uses it."""
    program = [int(x) for x in program]
    n_ops = program[1]
    needs = {i: bool(needs_grad[i]) for i in range(n_ops)}
    i = 4 + program[3]
    n_instr = program[i]
    i += 1
    shapes = []
    for _ in range(n_instr):
        op = program[i]
        if op == _SELECT:
            i += 4
        elif op == _SUM:
            i += 3 + program[i + 2]
        elif op == _CONTRACT:
            a, b, c = program[i + 1:i + 4]
            ra = program[i + 4]
            rb = program[i + 5 + ra]
            ta, tb, bt, m, k, n = program[i + 6 + ra + rb:i + 12 + ra + rb]
            rc = program[i + 12 + ra + rb]
            # transposed operands are kept in their stored ([Bt,K,M] / [Bt,N,K]) layout
            shapes.append(((bt, k, m) if ta else (bt, m, k)) if needs[b] else (0,))
            shapes.append(((bt, n, k) if tb else (bt, k, n)) if needs[a] else (0,))
            needs[c] = needs[a] or needs[b]
            i += 13 + ra + rb + rc
        elif op == _CHECKPOINT:
            i += 1
        else:
            break
    return shapes


@torch.library.register_fake("torch_gradops::contract_program_cached")
def _contract_program_cached_fake(operands, program, slice_table, needs_grad):
    out = operands[0].new_empty(_program_out_shape(program))
    return out, [operands[0].new_empty(s) for s in _cached_shapes(program, needs_grad)]


@torch.library.register_fake("torch_gradops::contract_program_backward")
def _contract_program_backward_fake(operands, program, slice_table, grad_out, needs_grad, cached):
    return [torch.empty_like(op, memory_format=torch.contiguous_format) if n else op.new_empty((0,))
            for op, n in zip(operands, needs_grad)]


# ---------------------------------------------------------------------------- memory limits
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_LIMIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_memory_limit(limit, device: Union[str, torch.device, None] = None) -> Optional[int]:
    """Bytes from ``None``, an int, or a string such as ``"2GiB"``, ``"500 MB"``, ``"50%"``
    (of ``device``'s total memory; host RAM for cpu)."""
    if limit is None:
        return None
    if isinstance(limit, bool):
        raise TypeError(f"memory_limit must be bytes (int) or a string like '2GiB' or '50%', got {limit!r}")
    if isinstance(limit, (int, float)):
        if not limit > 0:
            raise ValueError(f"memory_limit must be positive, got {limit!r}")
        return int(limit)
    if not isinstance(limit, str):
        raise TypeError(f"memory_limit must be bytes (int) or a string like '2GiB' or '50%', got "
                        f"{type(limit).__name__}")
    m = _LIMIT_RE.match(limit)
    unit = m.group(2).lower() if m else None
    if m is None or (unit != "%" and unit not in _UNITS):
        raise ValueError(f"memory_limit {limit!r} is not understood; use bytes, a size like '2GiB' "
                         "or '512MB', or a percentage like '50%'")
    value = float(m.group(1))
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"memory_limit percentage must be in (0, 100], got {limit!r}")
        return int(_device_memory(torch.device(device or "cpu")) * value / 100)
    if value <= 0:
        raise ValueError(f"memory_limit must be positive, got {limit!r}")
    return int(value * _UNITS[unit])


# ---------------------------------------------------------------------------- parsing
class _EllipsisDim:
    """Label of the ``p``-th broadcast (``...``) dimension, counted from the left of the
    broadcast shape."""
    __slots__ = ("p",)

    def __init__(self, p):
        self.p = p

    def __eq__(self, other):
        return isinstance(other, _EllipsisDim) and other.p == self.p

    def __hash__(self):
        return hash(("torch_gradops.ellipsis", self.p))

    def __repr__(self):
        return f"...{self.p}"


def _label_str(label) -> str:
    return label if isinstance(label, str) else repr(label)


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


def _parse_string(expr: str, n_operands: int):
    """``(terms, output or None)``: lists of labels (chars or ``Ellipsis``)."""
    expr = "".join(expr.split())
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


def _normalize_labels(terms, output, shapes):
    """Expand ``...`` into per-dimension labels and check ranks and extents.

    Returns ``(terms, output, sizes, broadcast)``: terms/output as lists of labels,
    ``sizes[label]`` the extent, ``broadcast`` per operand the dims that are broadcast
    (extent 1 against a larger extent of the same ``...`` dimension).
    """
    n_ell = 0
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        named = sum(1 for x in term if x is not Ellipsis)
        has_ell = any(x is Ellipsis for x in term)
        if (len(shape) < named) if has_ell else (len(shape) != named):
            raise ValueError(f"operand {i} has {len(shape)} dimension(s) (shape {tuple(shape)}) but its term "
                             f"{''.join('...' if x is Ellipsis else _label_str(x) for x in term)!r} names {named}")
        if has_ell:
            n_ell = max(n_ell, len(shape) - named)
    ell_sizes = [1] * n_ell
    out_terms = []
    for i, (term, shape) in enumerate(zip(terms, shapes)):
        labels = []
        k = len(shape) - sum(1 for x in term if x is not Ellipsis)
        for x in term:
            if x is Ellipsis:
                labels.extend(_EllipsisDim(n_ell - k + j) for j in range(k))
            else:
                labels.append(x)
        for lab, ext in zip(labels, shape):
            if isinstance(lab, _EllipsisDim) and ext != 1:
                if ell_sizes[lab.p] not in (1, ext):
                    raise ValueError(f"the '...' dimensions do not broadcast: operand {i} has extent {ext} "
                                     f"where another operand has {ell_sizes[lab.p]}")
                ell_sizes[lab.p] = ext
        out_terms.append(labels)
    sizes: Dict[Any, int] = {}
    first: Dict[Any, int] = {}
    broadcast = []
    for i, (labels, shape) in enumerate(zip(out_terms, shapes)):
        bc = []
        for d, (lab, ext) in enumerate(zip(labels, shape)):
            ext = int(ext)
            if isinstance(lab, _EllipsisDim):
                if ext == 1 and ell_sizes[lab.p] != 1:
                    bc.append(d)
                    continue
            if lab in sizes and sizes[lab] != ext:
                raise ValueError(f"mode {_label_str(lab)!r} has extent {ext} in operand {i} but extent "
                                 f"{sizes[lab]} in operand {first[lab]}")
            sizes.setdefault(lab, ext)
            first.setdefault(lab, i)
        broadcast.append(bc)
    # Labels that only occur broadcast still need an extent (1).
    for p in range(n_ell):
        sizes.setdefault(_EllipsisDim(p), ell_sizes[p])
    counts: Dict[Any, int] = {}
    for labels in out_terms:
        for lab in labels:
            counts[lab] = counts.get(lab, 0) + 1
    ell_out = [_EllipsisDim(p) for p in range(n_ell)]
    if output is None:
        single = [lab for lab, c in counts.items() if c == 1 and not isinstance(lab, _EllipsisDim)]
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
            if lab not in counts and not isinstance(lab, _EllipsisDim):
                raise ValueError(f"output mode {_label_str(lab)!r} does not appear in any operand")
        if len(set(out)) != len(out):
            raise ValueError(f"the output repeats a mode: {[_label_str(x) for x in out]}")
    return out_terms, out, sizes, broadcast


def _is_label_list(x) -> bool:
    return isinstance(x, (list, tuple)) and not isinstance(x, torch.Tensor)


def _split_interleaved(args):
    """``(a, modes_a, b, modes_b, ..., [out_modes])`` -> operands, terms, output."""
    operands, terms = [], []
    n = len(args)
    pairs = n // 2
    for k in range(pairs):
        op, modes = args[2 * k], args[2 * k + 1]
        if not _is_label_list(modes):
            raise TypeError(f"interleaved form: the modes of operand {k} must be a list or tuple of "
                            f"hashable labels, got {type(modes).__name__}")
        for lab in modes:
            if lab is not Ellipsis:
                try:
                    hash(lab)
                except TypeError:
                    raise TypeError(f"interleaved form: mode label {lab!r} of operand {k} is not hashable") from None
        operands.append(op)
        terms.append(list(modes))
    output = None
    if n % 2:
        if not _is_label_list(args[-1]):
            raise TypeError("interleaved form: the last argument must be the list of output modes, got "
                            f"{type(args[-1]).__name__}")
        output = list(args[-1])
    if not operands:
        raise ValueError("contract needs at least one operand")
    return operands, terms, output


def _check_operands(operands) -> None:
    if not operands:
        raise ValueError("contract needs at least one operand")
    for i, op in enumerate(operands):
        if not isinstance(op, torch.Tensor):
            raise TypeError(f"operand {i} must be a torch.Tensor, got {type(op).__name__}")
    dev = operands[0].device
    for i, op in enumerate(operands):
        if op.device != dev:
            raise ValueError(f"operand {i} is on {op.device} but operand 0 is on {dev}; all operands must "
                             "be on one device")


# ---------------------------------------------------------------------------- plans
_CACHE: "OrderedDict[Any, ContractionPlan]" = OrderedDict()
_CACHE_SIZE = 512
_STATS = {"hits": 0, "misses": 0, "path_searches": 0}


def plan_cache_info() -> Dict[str, int]:
    """Plan-cache counters: ``hits``, ``misses``, ``path_searches`` (path optimizer runs),
    ``size``."""
    return dict(_STATS, size=len(_CACHE))


def clear_plan_cache() -> None:
    _CACHE.clear()
    for k in _STATS:
        _STATS[k] = 0


def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", id(x))


class _Compiled:
    """What the autograd Function needs: the program (a tuple of ints), the plan, and whether
    the forward keeps its step results for the backward (single-slice plans only, so the
    memory bound of sliced plans holds)."""
    __slots__ = ("program", "plan", "cache")

    def __init__(self, program, plan, cache=False):
        self.program = program
        self.plan = plan
        self.cache = cache


class ContractionPlan:
    """A planned (and possibly sliced) contraction for fixed shapes, dtype and device type.

    Attributes:
        expr: the expression (einsum string, or a description of the interleaved form).
        inputs / output: per operand the mode labels; the output's mode labels.
        shapes: operand shapes. dtype, device_type: what it was planned for.
        path: pairwise steps, opt_einsum's linear format (positions in the current list; the
            result goes to the end).
        sliced_modes: labels of the sliced modes; slice_extents: their extents;
            num_slices: product of the extents (slice ``s`` is the mixed-radix number of
            the modes' indices, last mode fastest).
        flops: real floating-point operations of all slices (a complex multiply-add counts 8).
        largest_intermediate: ``(elements, bytes)`` of the largest tensor a step creates, per
            slice.
        slice_working_set: bytes that one slice's forward + backward holds at most, beyond the
            operands, the output and the gradients (model: every intermediate of the slice but
            the last, as the backward's recomputation keeps them, plus twice the operands and
            result of the largest step for its gradients and copies). ``memory_limit`` bounds
            this (and so also the largest intermediate and the forward's working memory): the
            peak extra memory of forward + backward is about ``memory_limit`` + operands +
            their gradients + output, whatever the number of slices.
    """

    def __init__(self, *, expr, inputs, output, shapes, dtype, device_type, path, sliced, sizes,
                 eff_inputs, eff_output, pre, memory_limit, optimizer, labels):
        self._labels = labels
        self._parent = None
        self.expr = expr
        self.inputs = inputs
        self.output = output
        self.shapes = tuple(tuple(int(x) for x in s) for s in shapes)
        self.dtype = dtype
        self.device_type = device_type
        self.path = [tuple(p) for p in path]
        self.memory_limit = memory_limit
        self.optimizer = optimizer
        self._ids = sized = sizes  # internal mode id -> extent
        self._eff_inputs = eff_inputs
        self._eff_output = eff_output
        self._pre = pre  # per operand: preprocessing steps (squeeze / diagonal) or None
        self._sliced = list(sliced)
        self.sliced_modes = tuple(_label_of(self, m) for m in sliced)
        self.slice_extents = tuple(sized[m] for m in sliced)
        self.num_slices = int(math.prod(self.slice_extents))
        self.output_shape = tuple(sized[m] for m in eff_output)
        itemsize = torch.empty((), dtype=dtype).element_size()
        # what one slice's forward + backward holds (model: see _working_set), with as few
        # backward checkpoints as keep it within memory_limit
        working, checkpoints = _working_set(_step_table(eff_inputs, eff_output, sized, self.path), sized,
                                            set(sliced), None if memory_limit is None else memory_limit // itemsize)
        self.slice_working_set = int(working * itemsize)
        self.checkpoints = tuple(checkpoints)
        program, steps = _compile(eff_inputs, eff_output, sized, self.path, self._sliced, itemsize,
                                  dtype.is_complex, checkpoints)
        self._compiled = _Compiled(tuple(program), self)
        self._compiled_cached = _Compiled(self._compiled.program, self, cache=True)
        cplx = dtype.is_complex
        per_slice = sum(s[0] for s in steps)
        self.flops = int(per_slice * 2 * (4 if cplx else 1) * self.num_slices)
        largest = max([s[1] for s in steps] + [math.prod(sized[m] for m in eff_output if m not in set(sliced))])
        self.largest_intermediate = (int(largest), int(largest) * itemsize)
        self._tables: Dict[Any, Tuple[int, ...]] = {}

    # -- slices --------------------------------------------------------------------------
    def slice_indices(self, s: int) -> Tuple[int, ...]:
        """The sliced modes' indices of slice ``s``."""
        idx = []
        for ext in reversed(self.slice_extents):
            idx.append(s % ext)
            s //= ext
        return tuple(reversed(idx))

    def _slice_ids(self, slices) -> List[int]:
        if slices is None:
            return list(range(self.num_slices))
        if isinstance(slices, int) and not isinstance(slices, bool):
            slices = [slices]
        if not isinstance(slices, (range, list, tuple)):
            raise TypeError(f"slices must be None, a range or a list of slice ids, got {type(slices).__name__}")
        ids = list(slices)
        for s in ids:
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < self.num_slices:
                raise ValueError(f"slices: slice id {s!r} is out of range for a plan with {self.num_slices} slice(s)")
        return ids

    def _table(self, slices) -> Tuple[int, ...]:
        key = slices if slices is None or isinstance(slices, range) else None
        if key is not None and key in self._tables:
            return self._tables[key]
        ids = self._slice_ids(slices)
        if not self._sliced:
            table = () if ids else None
        else:
            table = tuple(i for s in ids for i in self.slice_indices(s))
        if key is not None:
            self._tables[key] = table
        return table

    # -- operands -----------------------------------------------------------------------
    def _prepare(self, operands) -> List[torch.Tensor]:
        """Check operands against the plan, promote to one dtype and apply the
        preprocessing (broadcast squeeze, diagonals): differentiable views."""
        if len(operands) != len(self.shapes):
            raise ValueError(f"the plan is for {len(self.shapes)} operand(s), got {len(operands)}")
        _check_operands(operands)
        for i, (op, shape) in enumerate(zip(operands, self.shapes)):
            if tuple(op.shape) != shape:
                raise ValueError(f"operand {i} has shape {tuple(op.shape)} but the plan was made for {shape}")
        check_backend(operands[0], "operand 0")
        dtype = operands[0].dtype
        if any(op.dtype != dtype for op in operands):
            dtype = operands[0].dtype
            for op in operands[1:]:
                dtype = torch.promote_types(dtype, op.dtype)
            operands = [op.to(dtype) for op in operands]
        out = list(operands)
        for i, pre in enumerate(self._pre):
            if pre is None:
                continue
            t = out[i]
            for kind, *args in pre:
                t = t.squeeze(args[0]) if kind == "squeeze" else torch.diagonal(t, 0, args[0], args[1])
            out[i] = t
        return out

    # -- forward --------------------------------------------------------------------------
    def contract(self, *operands, slices=None, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                 progress: bool = False) -> torch.Tensor:
        """Contract ``operands`` (shapes as planned) over the slices ``slices`` (None: all; a
        range or list of slice ids: their partial sum, or their output blocks when a sliced
        mode is an output mode). ``out``: write (or with ``accumulate`` add) the result into
        this tensor (no autograd). ``progress``: a tqdm bar over slices.
        Returns a tensor of shape :attr:`output_shape`."""
        eff = self._prepare(operands)
        table = self._table(slices)
        if out is not None:
            if tuple(out.shape) != self.output_shape:
                raise ValueError(f"out has shape {tuple(out.shape)}, the result has {self.output_shape}")
            with torch.no_grad():
                res = self._run(eff, table, slices, progress, grad=False)
                if accumulate:
                    out.add_(res)
                else:
                    out.copy_(res)
            return out
        return self._run(eff, table, slices, progress, grad=_needs_function(eff))

    def _run(self, eff, table, slices, progress, grad):
        prog = self._compiled.program
        if table is None:  # empty slice group
            return eff[0].new_zeros(self.output_shape)
        if progress and self.num_slices > 1:
            from tqdm.auto import tqdm
            ids = self._slice_ids(slices)
            # one op call per chunk of slices (at most ~100 chunks): a live bar at low overhead
            step = max(1, -(-len(ids) // 100))
            total = None
            with tqdm(total=len(ids), desc="contract", unit="slice") as bar:
                for c in range(0, len(ids), step):
                    chunk = ids[c:c + step]
                    t = tuple(i for s in chunk for i in self.slice_indices(s))
                    part = ContractFunction.apply(self._compiled, t, *eff) if grad else \
                        ops.contract_program(eff, list(prog), list(t))
                    total = part if total is None else total + part
                    bar.update(len(chunk))
            return total
        if grad:
            if torch.compiler.is_compiling():
                return _TraceableContract.apply(self._compiled, table, *eff)
            # unsliced and gradients wanted: keep the step results for the backward
            # (a sliced plan recomputes per slice instead: that is its memory bound)
            cache = self.num_slices == 1 and not self.checkpoints and torch.is_grad_enabled() and \
                any(t.requires_grad for t in eff)
            return ContractFunction.apply(self._compiled_cached if cache else self._compiled, table, *eff)
        return ops.contract_program(eff, list(prog), list(table))

    __call__ = contract

    # -- gradients ------------------------------------------------------------------------
    def gradients(self, *operands, output_grad: torch.Tensor, slices=None, grads=None, accumulate: bool = False):
        """Gradients of ``contract(*operands, slices=slices)`` under ``output_grad`` (shape
        :attr:`output_shape`), cuTensorNet-style: one slice's intermediates at a time.

        ``grads``: None to compute every operand's gradient, or one entry per operand, a
        tensor of the operand's shape to write (``accumulate``: add) its gradient into or None
        to skip it. Returns the list of gradients (None where skipped). No autograd graph."""
        n = len(self.shapes)
        if grads is not None and len(grads) != n:
            raise ValueError(f"grads must have one entry per operand ({n}), got {len(grads)}")
        if not isinstance(output_grad, torch.Tensor):
            raise TypeError(f"output_grad must be a torch.Tensor, got {type(output_grad).__name__}")
        if tuple(output_grad.shape) != self.output_shape:
            raise ValueError(f"output_grad has shape {tuple(output_grad.shape)}, the result has {self.output_shape}")
        want = [True] * n if grads is None else [g is not None for g in grads]
        with torch.no_grad():
            ops_ = [op.detach() if isinstance(op, torch.Tensor) else op for op in operands]
            eff = self._prepare(ops_)
            table = self._table(slices)
            if table is None:
                geff = [torch.zeros_like(e) if w else None for e, w in zip(eff, want)]
            else:
                raw = ops.contract_program_backward(eff, self._compiled.program, table,
                                                    output_grad.to(eff[0].dtype), [int(w) for w in want], [])
                geff = [g if w else None for g, w in zip(raw, want)]
        result = []
        for i, g in enumerate(geff):
            if g is not None and self._pre[i] is not None:  # undo diagonal / squeeze
                with torch.enable_grad():
                    leaf = ops_[i].to(eff[i].dtype).detach().requires_grad_(True)
                    t = leaf
                    for kind, *args in self._pre[i]:
                        t = t.squeeze(args[0]) if kind == "squeeze" else torch.diagonal(t, 0, args[0], args[1])
                    g, = torch.autograd.grad(t, leaf, g)
            if g is not None and grads is not None:
                if accumulate:
                    grads[i].add_(g)
                else:
                    grads[i].copy_(g)
                g = grads[i]
            result.append(g)
        return result

    # -- derivative networks (double backward, forward AD) -----------------------------------
    def _grad_network(self, i: int, slices_ids):
        """Plan of d(out)/d(operand i) contracted with grad_out: inputs (grad_out, operands j != i),
        output the modes of operand i that occur there; same sliced modes, same slice ids."""
        eff_in, eff_out = self._eff_inputs, self._eff_output
        others = [j for j in range(len(eff_in)) if j != i]
        present = set(eff_out)
        for j in others:
            present.update(eff_in[j])
        target = [m for m in eff_in[i] if m in present]
        shapes = [tuple(self._ids[m] for m in eff_out)] + [tuple(self._ids[m] for m in eff_in[j]) for j in others]
        terms = [list(eff_out)] + [list(eff_in[j]) for j in others]
        key = ("grad-network", id(self), i)
        p = _CACHE.get(key)
        if p is None or p._parent is not self:
            p = _make_plan(None, terms, list(target), shapes, self.dtype, self.device_type, None, "auto",
                           list(self._sliced), None, interleaved=True)
            p._parent = self
            _CACHE[key] = p
        return p, target, others

    def _differentiable_grads(self, eff, grad_out, table, needs):
        """create_graph=True: each gradient is itself a contraction, computed with the
        differentiable ContractFunction (so gradgradcheck works)."""
        grads = []
        for i, need in enumerate(needs):
            if not need:
                grads.append(None)
                continue
            p, target, others = self._grad_network(i, None)
            net_ops = [grad_out.to(eff[i].dtype)] + [eff[j].conj() for j in others]
            net_ops = p._prepare(net_ops)
            g = ContractFunction.apply(p._compiled, table, *net_ops) if table is not None else \
                net_ops[0].new_zeros(p.output_shape)
            # Modes of operand i that occur nowhere else were summed: the gradient broadcasts.
            if len(target) != len(self._eff_inputs[i]):
                shape = [self._ids[m] if m in target else 1 for m in self._eff_inputs[i]]
                order = [m for m in self._eff_inputs[i] if m in target]
                g = g.permute([target.index(m) for m in order]).reshape(shape).expand(eff[i].shape)
            else:
                g = g.permute([target.index(m) for m in self._eff_inputs[i]])
            grads.append(g)
        return grads

    def __repr__(self):
        li_el, li_b = self.largest_intermediate
        path = self.path if len(self.path) <= 8 else self.path[:8] + ["..."]
        return (f"ContractionPlan(expr={self.expr!r}, shapes={list(self.shapes)}, dtype={self.dtype}, "
                f"device_type={self.device_type!r}, optimizer={self.optimizer!r}, path={path} "
                f"({len(self.path)} steps), sliced_modes={list(self.sliced_modes)}, num_slices={self.num_slices}, "
                f"flops={self.flops:.4g}, largest_intermediate={li_el} elements ({_fmt_bytes(li_b)}), "
                f"slice_working_set={_fmt_bytes(self.slice_working_set)}, checkpoints={len(self.checkpoints)}, "
                f"memory_limit={None if self.memory_limit is None else _fmt_bytes(self.memory_limit)})")


def _fmt_bytes(b):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024


def _label_of(plan, m):
    return plan._labels[m]


def _needs_function(eff) -> bool:
    if torch.compiler.is_compiling():  # dynamo sees through dual tensors; requires_grad is static
        return torch.is_grad_enabled() and any(t.requires_grad for t in eff)
    if torch.is_grad_enabled() and any(t.requires_grad for t in eff):
        return True
    # Forward AD (dual tensors) and torch.func transforms go through the Function too.
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in eff)


# ---------------------------------------------------------------------------- path and slicing
def _mode_counts(inputs, output) -> Dict[int, int]:
    """How many operands (the output counting as one) carry each mode."""
    count: Dict[int, int] = {}
    for t in list(inputs) + [output]:
        for m in t:
            count[m] = count.get(m, 0) + 1
    return count


def _step_table(inputs, output, sizes, path):
    """Per pairwise step: (frozenset of modes involved, frozenset of result modes, the two
    operands' mode sets, the steps that produced them or -1 for operands), with hyperedges
    kept while any remaining operand or the output needs them."""
    count = _mode_counts(inputs, output)
    cur = [frozenset(m for m in t if not (count[m] == 1)) for t in inputs]  # single-use: summed first
    prod = [-1] * len(cur)
    for t in inputs:
        for m in t:
            if count[m] == 1:
                count[m] = 0
    steps = []
    for j, pair in enumerate(path):
        pair = sorted(pair, reverse=True)
        sets = [cur.pop(p) for p in pair]
        prods = [prod.pop(p) for p in pair]
        allm = frozenset().union(*sets)
        for s in sets:
            for m in s:
                count[m] -= 1
        res = frozenset(m for m in allm if count[m] > 0)
        for m in res:
            count[m] += 1
        cur.append(res)
        prod.append(j)
        steps.append((allm, res, tuple(sets), tuple(prods)))
    return steps


def _working_set(steps, sizes, sliced, limit=None):
    """(elements one slice's forward + backward holds, checkpoints): the model of what the
    executor keeps, and the steps before which its backward checkpoints.

    The backward recomputes a slice segment by segment: a forward pass keeps the live
    intermediates at each checkpoint, then, from the last segment to the first, it recomputes
    the segment from its checkpoint keeping every step's inputs and sweeps back through it,
    freeing each step's inputs as it creates their gradients. Held at once, at most: the
    checkpoints up to the segment, the segment's step inputs, the gradients of the
    intermediates live at its end, and the temporaries of one step (twice its operands and
    result: gradients, and the copies a permuted reshape or a conjugation can make).
    Operands, the output and operand gradients (added into their buffers as soon as they are
    complete) are not counted. No checkpoints (one segment) is fastest; with ``limit``, the
    fewest checkpoints (greedy segments of geometrically shrinking size) that fit it, else
    the smallest working set found."""
    n = len(steps)
    if n == 0:
        return 0, []
    c, held_in, peak = [], [], 0
    consumer = [n] * n
    for j, (allm, res, sets, prods) in enumerate(steps):
        c.append(math.prod(sizes[m] for m in res if m not in sliced))
        ins = [math.prod(sizes[m] for m in s if m not in sliced) for s in sets]
        held_in.append(sum(x for x, p in zip(ins, prods) if p >= 0))
        for p in prods:
            if p >= 0:
                consumer[p] = j
        peak = max(peak, 2 * (sum(ins) + c[-1]))

    def ckpt(b):  # intermediates made before step b and used at or after it
        return sum(c[p] for p in range(b) if consumer[p] >= b and consumer[p] < n)

    def evaluate(bounds):
        edges = bounds + [n]
        total_ck, worst = 0, 0
        for j in range(len(bounds)):
            total_ck += ckpt(edges[j])
            seg = sum(held_in[edges[j]:edges[j + 1]])
            worst = max(worst, total_ck + seg + (ckpt(edges[j + 1]) if edges[j + 1] < n else 0))
        return worst + peak

    whole = sum(held_in)
    best = (evaluate([0]), [0])
    if limit is None or best[0] <= limit:
        return best[0], []
    target = whole / 2
    floor = max(held_in)
    while target >= floor and target > 0:
        bounds, acc = [0], 0
        for j in range(n):
            if acc and acc + held_in[j] > target:
                bounds.append(j)
                acc = 0
            acc += held_in[j]
        w = evaluate(bounds)
        if w <= limit:
            return w, bounds[1:]
        if w < best[0]:
            best = (w, bounds)
        target /= 2
    return best[0], best[1][1:]


def _cost(steps, sizes, sliced, limit=None) -> Tuple[int, int, int]:
    """(multiply-adds of one slice, largest step result, working set of one slice's forward +
    backward (:func:`_working_set`)), in elements, with ``sliced`` removed."""
    flops, largest = 0, 0
    for allm, res, _, _ in steps:
        flops += math.prod(sizes[m] for m in allm if m not in sliced)
        largest = max(largest, math.prod(sizes[m] for m in res if m not in sliced))
    return flops, largest, _working_set(steps, sizes, sliced, limit)[0]


def _greedy_slice(steps, sizes, output, limit_elems, min_slices, forced, gradients=True):
    """Our slicer (also extends cotengra's slicing): add the mode that most lowers one slice's
    forward + backward working set (:func:`_cost`; ties: least total work) until it and every
    intermediate fit the limit and ``min_slices`` holds. With ``gradients=False`` only the
    intermediates (the forward) must fit."""
    sliced = list(forced)
    sset = set(sliced)
    out_size = lambda s: math.prod(sizes[m] for m in output if m not in s)  # noqa: E731
    while True:
        flops, largest, working = _cost(steps, sizes, sset, limit_elems)
        need = max(largest, working if gradients else 0, out_size(sset))
        nslices = math.prod(sizes[m] for m in sliced)
        over = limit_elems is not None and need > limit_elems
        if not over and nslices >= (min_slices or 1):
            return sliced
        cands = set()
        for allm, res, _, _ in steps:
            cands.update(m for m in (res if over else allm) if m not in sset and sizes[m] > 1)
        if over:
            cands.update(m for m in output if m not in sset and sizes[m] > 1)
        if not cands:
            if over:
                raise ValueError(
                    f"memory_limit cannot be met: even with modes {sorted(sset)} sliced, one slice's "
                    f"{'forward + backward working set' if gradients else 'forward'} needs {need} elements (limit {limit_elems} elements; "
                    f"largest intermediate {largest} elements)")
            raise ValueError(f"slicing: cannot reach min_slices={min_slices}; only {nslices} slice(s) possible")
        best, best_key = None, None
        for m in sorted(cands):
            s2 = sset | {m}
            f2, l2, w2 = _cost(steps, sizes, s2, limit_elems)
            w2 = w2 if gradients else 0
            need2 = max(l2, w2, out_size(s2))
            total = f2 * nslices * sizes[m]
            # over the limit: the mode that lowers the need most, where any that meets the limit ties
            # and the least total work decides
            key = (max(need2, limit_elems) if over else 0, total, -sizes[m])
            if best_key is None or key < best_key:
                best, best_key = m, key
        sliced.append(best)
        sset.add(best)


def _find_path(inputs, output, sizes, optimize, limit_elems, min_slices):
    """(path, sliced modes suggested by the optimizer or None, optimizer name)."""
    n = len(inputs)
    if n == 1:
        return [], None, "single"
    sets = [frozenset(t) for t in inputs]
    out = frozenset(output)
    if isinstance(optimize, str):
        name = optimize
        if name == "auto":
            name = "auto" if n <= 64 else "greedy"
        if name in ("cotengra",):
            try:
                import cotengra
            except ImportError:
                raise ValueError("optimize='cotengra' needs the cotengra package (pip install cotengra)") from None
            _STATS["path_searches"] += 1
            slicing_opts = {}
            if limit_elems is not None:
                slicing_opts["target_size"] = limit_elems
            if min_slices:
                slicing_opts["target_slices"] = min_slices
            opt = cotengra.HyperOptimizer(max_repeats=32, progbar=False, parallel=False,
                                          slicing_opts=slicing_opts or None)
            sym = {m: opt_einsum.get_symbol(m) for m in sizes}
            back = {v: k for k, v in sym.items()}
            tree = opt.search([[sym[m] for m in t] for t in inputs], [sym[m] for m in output],
                              {sym[m]: e for m, e in sizes.items()})
            return [tuple(p) for p in tree.get_path()], [back[s] for s in tree.sliced_inds], "cotengra"
        try:
            fn = opt_einsum.paths.get_path_fn(name)
        except KeyError:
            raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra', an opt_einsum "
                             f"path-optimizer name or an explicit path, got {optimize!r}") from None
        _STATS["path_searches"] += 1
        return [tuple(p) for p in fn(sets, out, dict(sizes))], None, optimize
    if hasattr(optimize, "search"):  # a cotengra optimizer object
        _STATS["path_searches"] += 1
        sym = {m: opt_einsum.get_symbol(m) for m in sizes}
        back = {v: k for k, v in sym.items()}
        tree = optimize.search([[sym[m] for m in t] for t in inputs], [sym[m] for m in output],
                               {sym[m]: e for m, e in sizes.items()})
        return [tuple(p) for p in tree.get_path()], [back[s] for s in tree.sliced_inds], "cotengra"
    if isinstance(optimize, (list, tuple)):
        return _check_path(optimize, n), None, "explicit"
    raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra' or an explicit path, got {optimize!r}")


def _check_path(path, n):
    """Validate an explicit path (opt_einsum linear format) and split k-ary steps into pairs."""
    out = []
    count = n
    for step in path:
        if not isinstance(step, (list, tuple)) or not all(isinstance(p, int) and not isinstance(p, bool) for p in step):
            raise ValueError(f"optimize: explicit path step {step!r} is not a tuple of operand positions")
        if len(step) < 2 or len(set(step)) != len(step) or any(not 0 <= p < count for p in step):
            raise ValueError(f"optimize: explicit path step {tuple(step)} is invalid with {count} operands left "
                             "(each step names 2 or more distinct positions)")
        s = sorted(step)
        out.append((s[0], s[1]))
        count -= 1
        # the running result sits last; each further position moved left by the j removed before it
        for j in range(2, len(s)):
            out.append((s[j] - j, count - 1))
            count -= 1
    if count != 1:
        raise ValueError(f"optimize: explicit path leaves {count} operands; it must contract all {n} into one")
    return out


# ---------------------------------------------------------------------------- compiler
def _contiguous_strides(modes, sizes):
    strides, acc = {}, 1
    for m in reversed(modes):
        strides[m] = acc
        acc *= max(sizes[m], 1)
    return strides


def _view_orders(modes, strides, group, sizes):
    """How a slot (``modes`` in dimension order, ``strides`` per mode) can enter a GEMM without a
    copy: ``(orders, contr_first)`` with ``orders[g]`` the modes of group ``g`` ('b' batch, 'k'
    contracted, 'f' free) in memory order, when the slot's memory holds the batch modes
    outermost and then the free and the contracted modes as two blocks, each group mergeable
    by a reshape (singleton modes fit anywhere); None when a copy is needed."""
    seq = sorted((m for m in modes if sizes[m] > 1), key=lambda m: -strides[m])
    blocks, runs, run = [], {}, 0
    for j, m in enumerate(seq):
        if j and strides[seq[j - 1]] != strides[m] * sizes[m]:
            run += 1  # not mergeable with the previous mode (a sliced mode was selected between)
        g = group[m]
        if not blocks or blocks[-1] != g:
            if g in blocks:
                return None  # a group split in two
            blocks.append(g)
        if runs.setdefault(g, run) != run:
            return None  # a group a reshape cannot merge
    if "b" in blocks and blocks[0] != "b":
        return None
    orders = {g: [m for m in seq if group[m] == g] for g in "bkf"}
    for m in modes:
        if sizes[m] <= 1:
            orders[group[m]].append(m)
    rest = [g for g in blocks if g != "b"]
    return orders, bool(rest) and rest[0] == "k"


def _consumer_groups(lay, cur, path, count):
    """Per intermediate slot, the role of each of its modes at the step that consumes it ('s'
    summed first, 'b' batch, 'k' contracted, 'f' free); 'final' for the last one. Depends only
    on the path, so the compiler can lay out each step's result for its consumer."""
    cnt = dict(count)
    slots = list(cur)
    msets = [set(lay[s][0]) for s in cur]
    nslot = len(lay)
    consumer = {}
    for pair in path:
        p, q = sorted(pair)
        sb, setb = slots.pop(q), msets.pop(q)
        sa, seta = slots.pop(p), msets.pop(p)
        for m in seta:
            cnt[m] -= 1
        for m in setb:
            cnt[m] -= 1
        res = set()
        for s, mine, other in ((sa, seta, setb), (sb, setb, seta)):
            g = {}
            for m in mine:
                if m in other:
                    g[m] = "b" if cnt[m] > 0 else "k"
                elif cnt[m] == 0:
                    g[m] = "s"
                else:
                    g[m] = "f"
            consumer[s] = g
            res |= {m for m, r in g.items() if r in "bf"}
        for m in res:
            cnt[m] += 1
        slots.append(nslot)
        msets.append(res)
        nslot += 1
    if slots:
        consumer[slots[-1]] = "final"
    return consumer


def _result_fits(cm, cons, sizes, kept):
    """Whether the consumer can use a contiguous result with modes ``cm`` without a copy."""
    seq = [m for m in cm if sizes[m] > 1]
    if cons == "final":
        return seq == [m for m in kept if sizes[m] > 1]
    blocks = []
    for m in seq:
        g = cons[m]
        if g == "s":
            continue  # summed first: the sum's result is contiguous in the remaining order
        if not blocks or blocks[-1] != g:
            if g in blocks:
                return False
            blocks.append(g)
    return "b" not in blocks or blocks[0] == "b"


def _copy_cost(modes, strides, order, sizes, itemsize):
    """Estimated cost, in element-copies, of copying a slot into ``order``: its elements times a
    factor for short inner runs (a permuted copy whose innermost destination modes are not
    contiguous in the source moves a few bytes per inner loop; measured on CPU, about
    1 + 256 / (contiguous bytes per inner loop) times a plain copy)."""
    run, expect = 1, 1
    for m in reversed([m for m in order if sizes[m] > 1]):
        if strides[m] != expect:
            break
        run *= sizes[m]
        expect *= sizes[m]
    return math.prod(sizes[m] for m in modes) * (1 + 256 / (run * itemsize))


def _gemm_layout(ma, sta, mb, stb, group_a, group_b, sizes, cons, kept, itemsize=8, is_complex=False):
    """Layout of one pairwise step. Each operand enters bmm as a view when its memory allows
    ([batch, free, contr] or [batch, contr, free]; bmm takes the transposed view without
    copying) or as a copy in any order; the result is [batch, left, right] or, computing it
    transposed, [batch, right, left]. Among these choices, minimise the estimated cost of the
    copies made now (:func:`_copy_cost`), plus twice the result's size when its consumer would
    have to copy it (one step of look-ahead: the orders of a copied operand and the side of
    the result are chosen for the consumer), plus a penalty for a result whose rows are
    shorter than 16 elements and than its columns (measured on CPU: a [59049, 9] = [59049, 18]
    @ [18, 9] float32 GEMM takes about 5x as long as its transpose [9, 59049]; complex GEMMs
    care much less). Costs are in element copies. Returns (swap, per side: (copied, orders,
    contr_first))."""
    va = _view_orders(ma, sta, group_a, sizes)
    vb = _view_orders(mb, stb, group_b, sizes)
    batch = [m for m in ma if group_a[m] == "b"]
    contr = [m for m in ma if group_a[m] == "k"]
    left = [m for m in ma if group_a[m] == "f"]
    right = [m for m in mb if group_b[m] == "f"]
    mem_a = sorted(ma, key=lambda m: -sta[m])
    mem_b = sorted(mb, key=lambda m: -stb[m])
    size_c = math.prod(sizes[m] for m in batch + left + right)
    size_l = math.prod(sizes[m] for m in left)
    size_r = math.prod(sizes[m] for m in right)
    macs = size_c * math.prod(sizes[m] for m in contr)
    narrow = macs * (0.05 if is_complex else 1.0)  # cost of rows < 16 elements (see above)
    nz = lambda ms: [m for m in ms if sizes[m] > 1]  # noqa: E731
    if cons == "final":
        keys = [{m: j for j, m in enumerate(kept)}]
    else:
        keys = [{m: "bkfs".index(cons[m]) for m in cons}, {m: "bfks".index(cons[m]) for m in cons}]

    memo = {}

    def copied(side, b, k, f):
        """(cost, orders, contr_first) of the cheaper stored layout of a copied operand."""
        key = (side, tuple(b), tuple(k), f)
        if key not in memo:
            modes, strides = (ma, sta) if side == 0 else (mb, stb)
            f = list(f)
            memo[key] = min((_copy_cost(modes, strides, b + (k + f if cf else f + k), sizes, itemsize), cf)
                            for cf in (False, True)) + ({"b": b, "k": k, "f": f},)
        cost, cf, orders = memo[key]
        return cost, orders, cf

    best = None
    for copy_a in ((False, True) if va else (True,)):
        for copy_b in ((False, True) if vb else (True,)):
            if not copy_a and not copy_b:
                if nz(va[0]["b"]) != nz(vb[0]["b"]) or nz(va[0]["k"]) != nz(vb[0]["k"]):
                    continue
                shared = [(None, None)]
            elif not copy_a:
                shared = [(va[0]["b"], va[0]["k"])]
            elif not copy_b:
                shared = [(vb[0]["b"], vb[0]["k"])]
            else:  # both copied: batch and contracted orders free; try each operand's memory order
                shared = {(tuple(m for m in mem if m in batch), tuple(m for m in mem if m in contr))
                          for mem in (mem_a, mem_b)}
                shared = [(list(b), list(k)) for b, k in shared]
            for rank in keys:
                by = lambda ms: tuple(sorted(ms, key=lambda m: rank.get(m, 0)))  # noqa: E731
                for b_ord, k_ord in shared:
                    if copy_a:
                        fa = [m for m in mem_a if m in left]
                        opts_a = [copied(0, b_ord, k_ord, f) for f in {by(fa), tuple(fa)}]
                    else:
                        opts_a = [(0, va[0], va[1])]
                    if copy_b:
                        fb = [m for m in mem_b if m in right]
                        opts_b = [copied(1, b_ord, k_ord, f) for f in {by(fb), tuple(fb)}]
                    else:
                        opts_b = [(0, vb[0], vb[1])]
                    for cost_a, oa, cfa in opts_a:
                        for cost_b, ob, cfb in opts_b:
                            for swap in (0, 1):
                                x = ob if swap else oa
                                cm = x["b"] + (ob["f"] + oa["f"] if swap else oa["f"] + ob["f"])
                                fits = _result_fits(cm, cons, sizes, kept)
                                cols, rows = (size_l, size_r) if swap else (size_r, size_l)
                                cost = cost_a + cost_b + (0 if fits else 2 * size_c) + \
                                    (narrow if cols < 16 and rows > cols else 0)
                                key = (cost, copy_a + copy_b, swap)
                                if best is None or key < best[0]:
                                    best = (key, swap, (copy_a, oa, cfa), (copy_b, ob, cfb))
                                    if cost == 0 and not swap:
                                        return best[1:]  # nothing is copied: cannot do better
    return best[1:]


def _compile(inputs, output, sizes, path, sliced, itemsize=8, is_complex=False, checkpoints=()):
    """Program (see csrc/contract.cpp) and per step (multiply-adds, result elements, GEMM
    operand elements)."""
    slot_of_k = {m: k for k, m in enumerate(sliced)}
    sset = set(sliced)
    prog: List[int] = []
    count = _mode_counts(inputs, output)
    lay = []  # per slot: (modes in dimension order, stride per mode) as the executor will hold it
    for i, t in enumerate(inputs):
        modes = list(t)
        strides = _contiguous_strides(modes, sizes)  # operands are assumed contiguous
        for m in sliced:  # SELECTs first: the backward views gradient buffers through them
            if m in modes:
                d = modes.index(m)
                prog += [_SELECT, i, d, slot_of_k[m]]
                modes.pop(d)
        dims = [d for d, m in enumerate(modes) if count[m] == 1]  # only here, not in the output
        if dims:
            prog += [_SUM, i, len(dims)] + dims
            for m in modes:
                if count[m] == 1:
                    count[m] = 0
            modes = [m for m in modes if count[m] != 0]
            strides = _contiguous_strides(modes, sizes)
        lay.append((modes, strides))
    cur = list(range(len(inputs)))
    # sliced modes are gone everywhere
    for m in sset:
        count[m] = 0
    kept = [m for m in output if m not in sset]
    consumer = _consumer_groups(lay, cur, path, count)
    steps = []
    nslot = len(inputs)
    checkpoints = set(checkpoints)
    for j, pair in enumerate(path):
        if j in checkpoints:
            prog.append(_CHECKPOINT)
        p, q = sorted(pair)
        sb = cur.pop(q)
        sa = cur.pop(p)
        ma, mb = lay[sa][0], lay[sb][0]
        for m in ma:
            count[m] -= 1
        for m in mb:
            count[m] -= 1
        # modes of one side that no one else needs: sum them before the GEMM
        for side, other in ((sa, set(mb)), (sb, set(ma))):
            modes = lay[side][0]
            dims = [d for d, m in enumerate(modes) if m not in other and count[m] == 0]
            if dims:
                prog += [_SUM, side, len(dims)] + dims
                modes = [m for d, m in enumerate(modes) if d not in dims]
                lay[side] = (modes, _contiguous_strides(modes, sizes))
        (ma, sta), (mb, stb) = lay[sa], lay[sb]
        seta, setb = set(ma), set(mb)
        group_a = {m: ("b" if count[m] > 0 else "k") if m in setb else "f" for m in ma}
        group_b = {m: ("b" if count[m] > 0 else "k") if m in seta else "f" for m in mb}
        swap, (copy_a, oa, cfa), (copy_b, ob, cfb) = _gemm_layout(ma, sta, mb, stb, group_a, group_b, sizes,
                                                                  consumer[nslot], kept, itemsize, is_complex)
        # X enters bmm as [Bt,M,K] (stored [Bt,K,M] if tx), Y as [Bt,K,N] (stored [Bt,N,K] if ty)
        (sx, mx, ox, cx, fx), (sy, my, oy, cy, fy) = ((sb, mb, ob, copy_b, cfb), (sa, ma, oa, copy_a, cfa)) if swap \
            else ((sa, ma, oa, copy_a, cfa), (sb, mb, ob, copy_b, cfb))
        tx = int(fx)  # stored [Bt,K,M] when the contracted modes come first
        ty = int(not fy)
        px = [mx.index(m) for m in (ox["b"] + ox["k"] + ox["f"] if tx else ox["b"] + ox["f"] + ox["k"])]
        py = [my.index(m) for m in (oy["b"] + oy["f"] + oy["k"] if ty else oy["b"] + oy["k"] + oy["f"])]
        bt = math.prod(sizes[m] for m in ox["b"])
        mm = math.prod(sizes[m] for m in ox["f"])
        kk = math.prod(sizes[m] for m in ox["k"])
        nn = math.prod(sizes[m] for m in oy["f"])
        cm = ox["b"] + ox["f"] + oy["f"]
        prog += [_CONTRACT, sx, sy, nslot, len(px)] + px + [len(py)] + py + [tx, ty, bt, mm, kk, nn, len(cm)] + \
            [sizes[m] for m in cm]
        for m in cm:
            count[m] += 1
        steps.append((bt * mm * kk * nn, bt * mm * nn, bt * kk * (mm + nn)))
        lay.append((cm, _contiguous_strides(cm, sizes)))
        cur.append(nslot)
        nslot += 1
    if len(cur) != 1:
        raise ValueError(f"the contraction path leaves {len(cur)} tensors; it must contract all operands into one")
    slot = cur[0]
    modes = lay[slot][0]
    if sorted(modes) != sorted(kept):
        raise AssertionError(f"internal: final modes {modes} != output {kept}")
    perm = [modes.index(m) for m in kept]
    blocks = sorted(((pos, slot_of_k[m]) for pos, m in enumerate(output) if m in sset), reverse=True)
    prog += [_FINAL, slot, len(perm)] + perm + [len(blocks)] + [x for b in blocks for x in b]
    n_instr = 0
    # count instructions by re-walking (cheap, and keeps the emitters above simple)
    i = 0
    while i < len(prog):
        op = prog[i]
        n_instr += 1
        if op == _SELECT:
            i += 4
        elif op == _SUM:
            i += 3 + prog[i + 2]
        elif op == _CONTRACT:
            ra = prog[i + 4]
            rb = prog[i + 5 + ra]
            rc = prog[i + 12 + ra + rb]
            i += 13 + ra + rb + rc
        elif op == _CHECKPOINT:
            i += 1
        else:
            i += 3 + prog[i + 2]
            i += 1 + 2 * prog[i]
    header = [_VERSION, len(inputs), len(sliced), len(output)] + [sizes[m] for m in output] + [n_instr]
    return header + prog, steps


# ---------------------------------------------------------------------------- planning
def _effective(terms, output, sizes, broadcast):
    """Internal ids for labels; per operand the preprocessing (broadcast squeeze, diagonals)
    and its modes afterwards (all distinct)."""
    ids: Dict[Any, int] = {}
    labels: List[Any] = []

    def idof(lab):
        if lab not in ids:
            ids[lab] = len(labels)
            labels.append(lab)
        return ids[lab]

    eff_inputs, pre = [], []
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
            modes = [m for d, m in enumerate(modes) if d not in (d1, d2)] + [modes[d1]]
        eff_inputs.append(tuple(modes))
        pre.append(steps or None)
    eff_output = tuple(idof(lab) for lab in output)
    id_sizes = {ids[lab]: ext for lab, ext in sizes.items() if lab in ids}
    return labels, ids, eff_inputs, eff_output, pre, id_sizes


@torch.compiler.disable  # planning is host-side Python (opt_einsum/cotengra); plan before compiling
def _make_plan(expr, terms, output, shapes, dtype, device_type, memory_limit, optimize, slicing,
               device, interleaved=False, gradients=True):
    terms, out, sizes, broadcast = _normalize_labels(terms, output, shapes)
    labels, ids, eff_inputs, eff_output, pre, id_sizes = _effective(terms, out, sizes, broadcast)
    itemsize = torch.empty((), dtype=dtype).element_size()
    limit = parse_memory_limit(memory_limit, device if device is not None else device_type)
    limit_elems = None if limit is None else limit // itemsize
    if limit_elems == 0:
        raise ValueError(f"memory_limit cannot be met: {limit} bytes is less than one {dtype} element")
    forced, min_slices = [], None
    if slicing is not None:
        if isinstance(slicing, dict):
            bad = set(slicing) - {"min_slices", "modes"}
            if bad:
                raise ValueError(f"slicing: unknown keys {sorted(bad)}; use 'modes' and/or 'min_slices'")
            min_slices = slicing.get("min_slices")
            if min_slices is not None and (not isinstance(min_slices, int) or min_slices < 1):
                raise ValueError(f"slicing: min_slices must be a positive int, got {min_slices!r}")
            mode_list = slicing.get("modes", [])
        elif isinstance(slicing, (list, tuple, str)):
            mode_list = list(slicing)
        else:
            raise TypeError(f"slicing must be a list of modes or {{'min_slices': k}}, got {type(slicing).__name__}")
        counts: Dict[int, int] = {}
        for t in eff_inputs:
            for m in t:
                counts[m] = counts.get(m, 0) + 1
        for lab in mode_list:
            if isinstance(lab, int) and interleaved and lab in ids:
                m = ids[lab]
            elif lab in ids:
                m = ids[lab]
            else:
                raise ValueError(f"slicing: mode {lab!r} is not a mode of the expression")
            if counts.get(m, 0) < 2 and m not in eff_output:
                raise ValueError(f"slicing: mode {lab!r} occurs in only one operand and not in the output; "
                                 "slicing it saves nothing")
            if m in forced:
                raise ValueError(f"slicing: mode {lab!r} is listed twice")
            forced.append(m)
    path, suggested, optname = _find_path(eff_inputs, eff_output, id_sizes, optimize, limit_elems, min_slices)
    steps = _step_table(eff_inputs, eff_output, id_sizes, path)
    start = list(forced)
    if suggested:
        start += [m for m in suggested if m not in start]
    sliced = _greedy_slice(steps, id_sizes, eff_output, limit_elems, min_slices, start, gradients)
    if expr is None:
        expr = "interleaved: " + ",".join("(" + ",".join(_label_str(x) for x in t) + ")" for t in terms) + \
            "->(" + ",".join(_label_str(x) for x in out) + ")"
    return ContractionPlan(expr=expr, inputs=[tuple(t) for t in terms], output=tuple(out), shapes=shapes,
                             dtype=dtype, device_type=device_type, path=path, sliced=sliced, sizes=id_sizes,
                             eff_inputs=eff_inputs, eff_output=eff_output, pre=pre, memory_limit=limit,
                             optimizer=optname, labels=labels)


def _shapes_of(operands_or_shapes):
    shapes, tensors = [], []
    for i, x in enumerate(operands_or_shapes):
        if isinstance(x, torch.Tensor):
            shapes.append(tuple(x.shape))
            tensors.append(x)
        elif isinstance(x, (tuple, list, torch.Size)) and all(isinstance(e, int) and e >= 0 for e in x):
            shapes.append(tuple(int(e) for e in x))
        else:
            raise TypeError(f"operand {i} must be a torch.Tensor or a shape (tuple of non-negative ints), "
                            f"got {type(x).__name__}")
    return shapes, tensors


def _plan_key(expr, terms, output, shapes, dtype, device_type, memory_limit, optimize, slicing, gradients):
    """The plan cache's key. Without a memory limit, planning for gradients or not gives the
    same plan, so both share one entry."""
    return (expr if expr is not None else (_freeze(terms), _freeze(output)), tuple(shapes), dtype, device_type,
            _freeze(memory_limit), _freeze(optimize), _freeze(slicing), bool(gradients) or memory_limit is None)


def _get_plan(expr, terms, output, shapes, dtype, device, memory_limit, optimize, slicing, interleaved,
              gradients=True):
    key = _plan_key(expr, terms, output, shapes, dtype, device.type, memory_limit, optimize, slicing, gradients)
    p = _CACHE.get(key)
    if p is not None:
        _STATS["hits"] += 1
        _CACHE.move_to_end(key)
        return p
    _STATS["misses"] += 1
    p = _make_plan(expr, terms, output, shapes, dtype, device.type, memory_limit, optimize, slicing, device,
                   interleaved=interleaved, gradients=key[-1])
    _CACHE[key] = p
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return p


def plan(expr, *operands_or_shapes, dtype: Optional[torch.dtype] = None, memory_limit=None,
         optimize="auto", slicing=None, device=None, gradients: bool = True) -> ContractionPlan:
    """Plan a contraction (cached).

    ``expr``: an einsum string (``"ab,bc->ac"``, implicit output, ``...``, any Unicode letter as
    a label) followed by operands or their shapes; or the interleaved form
    ``plan(a, modes_a, b, modes_b, ..., [out_modes])`` with hashable labels.
    ``memory_limit``: bytes, ``"2GiB"``, ``"50%"`` (of the device's memory): what one slice's
    forward + backward may hold beyond operands, output and gradients
    (:attr:`ContractionPlan.slice_working_set`, which also bounds every intermediate and the
    forward's working memory); modes are sliced, and backward checkpoints placed, until it
    fits. Slicing for a budget therefore costs more than slicing only the largest
    intermediate to it (cotengra's ``target_size``): about 5-10x the largest intermediate
    must fit.
    ``optimize``: "auto", "greedy", "optimal", "cotengra" (HyperOptimizer with its slicer), any
    opt_einsum path-optimizer name, a cotengra optimizer object, or an explicit path.
    ``slicing``: a list of modes to slice, or ``{"min_slices": k, "modes": [...]}``.
    ``gradients=False`` plans for the forward only: ``memory_limit`` then bounds every
    intermediate (the forward's working memory), with as few sliced modes as that needs, as for
    cotengra's ``target_size``; such a plan still differentiates correctly, but its backward
    may exceed ``memory_limit``. :func:`contract` picks this mode itself when no operand
    requires grad (or grad mode is off).
    """
    if isinstance(expr, str):
        shapes, tensors = _shapes_of(operands_or_shapes)
        terms, output = _parse_string(expr, len(shapes))
        interleaved = False
    else:
        objs, terms, output = _split_interleaved((expr,) + operands_or_shapes)
        shapes, tensors = _shapes_of(objs)
        expr = None
        interleaved = True
    if tensors:
        _check_operands(tensors)
        if dtype is None:
            dtype = tensors[0].dtype
            for t in tensors[1:]:
                dtype = torch.promote_types(dtype, t.dtype)
        device = tensors[0].device if device is None else torch.device(device)
    dtype = dtype or torch.get_default_dtype()
    device = torch.device(device or "cpu")
    return _get_plan(expr, terms, output, shapes, dtype, device, memory_limit, optimize, slicing, interleaved,
                     gradients)


def contract(*args, memory_limit=None, optimize="auto", slicing=None, slices=None,
             plan: Optional[ContractionPlan] = None, progress: bool = False, process_group=None) -> torch.Tensor:
    """Contract a tensor network, differentiably (see the module docstring).

    ``contract("ab,bc->ac", a, b)`` or ``contract(a, [0, 1], b, [1, 2], [0, 2])``. Options as
    in :func:`plan`; ``slices``: a slice group (None = all slices; a range or list of slice
    ids: their partial sum, or their output blocks for sliced output modes); ``plan``: use this
    plan instead of looking one up; ``progress``: a tqdm bar over slices; ``process_group``: a
    ``torch.distributed`` group whose ranks share the slices (see
    :func:`torch_gradops.distributed.contract`; every rank gets the full result).
    Returns a tensor with one dimension per output mode.
    """
    plan, operands = resolve(*args, memory_limit=memory_limit, optimize=optimize, slicing=slicing, plan=plan)
    if process_group is not None:
        if slices is not None:
            raise ValueError("slices and process_group cannot be combined: the group splits the slices")
        from .distributed import contract_plan
        return contract_plan(plan, operands, process_group, progress=progress)
    return plan.contract(*operands, slices=slices, progress=progress)


def _wants_gradients(operands) -> bool:
    """Whether a plan looked up for these operands must bound the backward too: only when grad
    mode is on and some operand requires grad."""
    return torch.is_grad_enabled() and any(op.requires_grad for op in operands)


def resolve(*args, memory_limit=None, optimize="auto", slicing=None, plan: Optional[ContractionPlan] = None):
    """``(plan, operands)`` for :func:`contract`'s arguments: the plan (cached) and the operand
    tensors, from an einsum string and operands or from the interleaved form."""
    if not args:
        raise TypeError("contract() needs an expression and operands")
    if isinstance(args[0], str):
        expr, operands = args[0], args[1:]
        if plan is None:
            _check_operands(operands)
            shapes = [tuple(op.shape) for op in operands]
            dtype = operands[0].dtype
            for op in operands[1:]:
                if op.dtype != dtype:
                    dtype = torch.promote_types(dtype, op.dtype)
            gradients = _wants_gradients(operands)
            key = _plan_key(expr, None, None, shapes, dtype, operands[0].device.type, memory_limit, optimize,
                            slicing, gradients)
            p = _CACHE.get(key)  # fast path: no parsing on a cache hit
            if p is not None:
                _STATS["hits"] += 1
            else:
                terms, output = _parse_string(expr, len(shapes))
                p = _get_plan(expr, terms, output, shapes, dtype, operands[0].device, memory_limit, optimize,
                              slicing, False, gradients)
            plan = p
    else:
        operands, terms, output = _split_interleaved(args)
        if plan is None:
            _check_operands(operands)
            dtype = operands[0].dtype
            for op in operands[1:]:
                dtype = torch.promote_types(dtype, op.dtype)
            plan = _get_plan(None, terms, output, [tuple(op.shape) for op in operands], dtype, operands[0].device,
                             memory_limit, optimize, slicing, True, _wants_gradients(operands))
    if not isinstance(plan, ContractionPlan):
        raise TypeError(f"plan must be a ContractionPlan, got {type(plan).__name__}")
    return plan, operands


# ---------------------------------------------------------------------------- autograd
_STASH = threading.local()


def _engine_needs(ctx, needs):
    """needs_input_grad narrowed to the edges this backward will run: with
    ``torch.autograd.grad(inputs=subset)`` an operand whose branch is not needed costs nothing.
    (The engine cannot tell this for leaf operands under autograd.grad; those count as needed.)"""
    needs = list(needs)
    try:
        nexts = ctx.next_functions
    except AttributeError:
        return needs
    if len(nexts) != len(needs):
        return needs
    for i, (node, _) in enumerate(nexts):
        if needs[i] and node is not None:
            try:
                needs[i] = bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:
                pass
    return needs


class ContractFunction(torch.autograd.Function):
    """``ContractFunction.apply(compiled, slice_table, *operands)``: the differentiable core
    of :func:`contract` (operands already checked and preprocessed by the plan).

    backward: ``contract_program_backward`` (one slice's intermediates at a time) or, under
    ``create_graph=True``, one differentiable contraction per operand. jvp: the sum over
    operands of the network with that operand replaced by its tangent.
    """

    @staticmethod
    def forward(compiled, table, *operands):
        if compiled.cache:
            out, cache = ops.contract_program_cached(list(operands), list(compiled.program), list(table),
                                                     [int(t.requires_grad) for t in operands])
            _STASH.cache = cache  # picked up by setup_context, which runs right after
            return out
        return ops.contract_program(list(operands), list(compiled.program), list(table))

    @staticmethod
    def setup_context(ctx, inputs, output):
        compiled, table, *operands = inputs
        ctx.compiled = compiled
        ctx.table = table
        ctx.cache = _STASH.__dict__.pop("cache", None) if compiled.cache else None
        ctx.save_for_backward(*operands)
        ctx.save_for_forward(*operands)

    @staticmethod
    def backward(ctx, grad_out):
        operands = ctx.saved_tensors
        needs = _engine_needs(ctx, ctx.needs_input_grad[2:])
        if not any(needs):
            return (None, None) + (None,) * len(operands)
        compiled = ctx.compiled
        if torch.is_grad_enabled():
            grads = compiled.plan._differentiable_grads(list(operands), grad_out, ctx.table, needs)
        else:
            # the forward's step results serve one backward; a retained graph recomputes
            cache, ctx.cache = ctx.cache, None
            raw = ops.contract_program_backward(list(operands), list(compiled.program), list(ctx.table),
                                                grad_out.to(operands[0].dtype), [int(n) for n in needs],
                                                list(cache) if cache is not None else [])
            grads = [g if n else None for g, n in zip(raw, needs)]
        return (None, None) + tuple(grads)

    @staticmethod
    def jvp(ctx, _compiled_t, _table_t, *tangents):
        operands = ctx.saved_tensors
        total = None
        for i, t in enumerate(tangents):
            if t is None:
                continue
            args = list(operands)
            args[i] = t.to(operands[i].dtype)
            part = ContractFunction.apply(ctx.compiled, ctx.table, *args)
            total = part if total is None else total + part
        if total is None:
            return None
        return total


class _TraceableContract(torch.autograd.Function):
    """ContractFunction without the custom jvp, which dynamo cannot trace: what
    ``torch.compile`` records when an operand requires grad (forward AD is not compiled)."""
    forward = staticmethod(ContractFunction.forward)
    setup_context = staticmethod(ContractFunction.setup_context)
    backward = staticmethod(ContractFunction.backward)
