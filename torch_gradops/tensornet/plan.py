"""Plans: :class:`ContractionPlan` (a path, its slicing and the compiled program for fixed
shapes, dtype and device type), :func:`build_plan`, and the plan cache."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..library import check_backend
from .._units import format_bytes
from . import autograd, parser, paths, slicer
from .compiler import compile_program
from .program import encode

__all__ = ["ContractionPlan", "build_plan", "PlanCache", "PLANS"]


class ContractionPlan:
    """A planned (and possibly sliced) contraction for fixed shapes, dtype and device type.

    Attributes:
        expr: the expression (einsum string, or a description of the interleaved form).
        inputs / output: per operand the mode labels; the output's mode labels.
        shapes: operand shapes. dtype, device_type: what it was planned for.
        network: the effective :class:`~.parser.Network` (integer mode ids) that was planned.
        path: pairwise steps, opt_einsum's linear format (positions in the current list; the
            result goes to the end).
        sliced_modes: labels of the sliced modes (``sliced_ids``: their mode ids);
            slice_extents: their extents; num_slices: product of the extents (slice ``s`` is
            the mixed-radix number of the modes' indices, last mode fastest; ``slice_set`` turns
            slice ids into the executor's slice tables).
        flops: real floating-point operations of all slices (a complex multiply-add counts 8).
        largest_intermediate: ``(elements, bytes)`` of the largest tensor a step creates, per
            slice.
        slice_working_set: bytes that one slice's forward + backward holds at most, beyond the
            operands, the output and the gradients (see :func:`~.slicer.working_set`).
            ``memory_limit`` bounds this (and so also the largest intermediate and the
            forward's working memory): the peak extra memory of forward + backward is about
            ``memory_limit`` + operands + their gradients + output, whatever the number of slices.
        checkpoints: the steps before which the backward keeps a checkpoint.
        program: the compiled program (:mod:`~.program`), a tuple of ints.
    """

    def __init__(self, *, expr: str, inputs, output, shapes, dtype: torch.dtype, device_type: str,
                 network: parser.Network, path, sliced, memory_limit: Optional[int], optimizer: str,
                 searched: bool):
        self.expr = expr
        self.inputs = inputs
        self.output = output
        self.shapes = tuple(tuple(int(x) for x in s) for s in shapes)
        self.dtype = dtype
        self.device_type = device_type
        self.network = network
        self.path = [tuple(p) for p in path]
        self.memory_limit = memory_limit
        self.optimizer = optimizer
        self.searched = searched  # a path search ran to make this plan (the cache counts them)
        sizes = network.sizes
        self.sliced_ids = tuple(sliced)
        self.sliced_modes = tuple(network.labels[m] for m in sliced)
        self.slice_set = slicer.Slices(sizes[m] for m in sliced)
        self.slice_extents = self.slice_set.extents
        self.num_slices = self.slice_set.count
        self.output_shape = tuple(sizes[m] for m in network.output)
        itemsize = torch.empty((), dtype=dtype).element_size()
        # what one slice's forward + backward holds, with as few backward checkpoints as keep it
        # within memory_limit
        steps = slicer.step_table(network.inputs, network.output, self.path)
        working, checkpoints = slicer.working_set(steps, sizes, set(sliced),
                                                  None if memory_limit is None else memory_limit // itemsize)
        self.slice_working_set = int(working * itemsize)
        self.checkpoints = tuple(checkpoints)
        prog, gemms = compile_program(network.inputs, network.output, sizes, self.path, self.sliced_ids, itemsize,
                                      dtype.is_complex, checkpoints)
        self.program = encode(prog)
        per_slice = sum(s[0] for s in gemms)
        self.flops = int(per_slice * 2 * (4 if dtype.is_complex else 1) * self.num_slices)
        sset = set(sliced)
        largest = max([s[1] for s in gemms] + [math.prod(sizes[m] for m in network.output if m not in sset)])
        self.largest_intermediate = (int(largest), int(largest) * itemsize)
        self._derivatives: Dict[int, Tuple["ContractionPlan", List[int], List[int]]] = {}
        self._batched: Dict[Tuple[Tuple[int, ...], int], "ContractionPlan"] = {}

    # -- slices ---------------------------------------------------------------------------
    def slice_indices(self, s: int) -> Tuple[int, ...]:
        """The sliced modes' indices of slice ``s``."""
        return self.slice_set.indices(s)

    # -- operands ---------------------------------------------------------------------------
    def prepare(self, operands) -> List[torch.Tensor]:
        """Check operands against the plan, promote them to one dtype and apply the
        preprocessing (broadcast squeeze, diagonals): differentiable views."""
        if len(operands) != len(self.shapes):
            raise ValueError(f"the plan is for {len(self.shapes)} operand(s), got {len(operands)}")
        parser.check_operands(operands)
        for i, (op, shape) in enumerate(zip(operands, self.shapes)):
            if tuple(op.shape) != shape:
                raise ValueError(f"operand {i} has shape {tuple(op.shape)} but the plan was made for {shape}")
        check_backend(operands[0], "operand 0")
        return parser.preprocess(operands, self.network.pre)

    # -- running ----------------------------------------------------------------------------
    def contract(self, *operands, slices=None, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                 progress: bool = False) -> torch.Tensor:
        """Contract ``operands`` (shapes as planned) over the slice group ``slices`` (None: all;
        a range or list of slice ids: their partial sum, or their output blocks when a sliced
        mode is an output mode). ``out``: write (or with ``accumulate`` add) the result into this
        tensor (no autograd). ``progress``: a tqdm bar over slices.
        Returns a tensor of shape :attr:`output_shape`, differentiable in the operands."""
        eff = self.prepare(operands)
        if out is None:
            return autograd.contract_prepared(self, eff, slices, progress)
        if tuple(out.shape) != self.output_shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, the result has {self.output_shape}")
        with torch.no_grad():
            res = autograd.contract_prepared(self, eff, slices, progress)
            return out.add_(res) if accumulate else out.copy_(res)

    __call__ = contract

    def gradients(self, *operands, output_grad: torch.Tensor, slices=None, grads=None, accumulate: bool = False):
        """Gradients of ``contract(*operands, slices=slices)`` under ``output_grad`` (shape
        :attr:`output_shape`), cuTensorNet-style: one slice's intermediates at a time.

        ``grads``: None to compute every operand's gradient, or one entry per operand, a
        tensor of the operand's shape to write (``accumulate``: add) its gradient into or None
        to skip it. Returns the list of gradients (None where skipped). No autograd graph."""
        return autograd.operand_gradients(self, operands, output_grad, slices, grads, accumulate)

    # -- derivative networks ------------------------------------------------------------------
    def derivative_plan(self, i: int) -> Tuple["ContractionPlan", List[int], List[int]]:
        """``(plan, target, others)``: the network of d(out)/d(operand i) contracted with an
        output gradient. Its inputs are the output gradient and the operands ``others`` (all but
        ``i``), its output the modes ``target`` of operand ``i`` that occur there (mode ids);
        same sliced modes, so the same slice ids. Planned once per plan."""
        if i not in self._derivatives:
            net = self.network
            others = [j for j in range(len(net.inputs)) if j != i]
            present = set(net.output)
            for j in others:
                present.update(net.inputs[j])
            target = [m for m in net.inputs[i] if m in present]
            terms = [list(net.output)] + [list(net.inputs[j]) for j in others]
            shapes = [tuple(net.sizes[m] for m in t) for t in terms]
            p = PLANS.build(None, lambda: build_plan(None, terms, list(target), shapes, self.dtype, self.device_type,
                                                     None, "auto", list(self.sliced_ids), interleaved=True))
            self._derivatives[i] = (p, target, others)
        return self._derivatives[i]

    def batched_plan(self, operands: Tuple[int, ...], size: int) -> "ContractionPlan":
        """The plan of this (effective) network with one more mode of extent ``size`` at the front
        of each operand in ``operands`` and of the output: what ``torch.func.vmap`` contracts.
        Same sliced modes in the same order, so the same slice tables; no memory limit of its
        own (slicing more would change the slice ids). Planned once per (operands, size)."""
        key = (tuple(operands), int(size))
        if key not in self._batched:
            net = self.network
            batch = len(net.labels)  # a mode id the network does not use
            terms = [([batch] if i in operands else []) + list(t) for i, t in enumerate(net.inputs)]
            sizes = {**net.sizes, batch: int(size)}
            shapes = [tuple(sizes[m] for m in t) for t in terms]
            output = [batch] + list(net.output)
            self._batched[key] = PLANS.build(None, lambda: build_plan(
                None, terms, output, shapes, self.dtype, self.device_type, None, "auto", list(self.sliced_ids),
                interleaved=True))
        return self._batched[key]

    def __repr__(self):
        li_el, li_b = self.largest_intermediate
        path = self.path if len(self.path) <= 8 else self.path[:8] + ["..."]
        return (f"ContractionPlan(expr={self.expr!r}, shapes={list(self.shapes)}, dtype={self.dtype}, "
                f"device_type={self.device_type!r}, optimizer={self.optimizer!r}, path={path} "
                f"({len(self.path)} steps), sliced_modes={list(self.sliced_modes)}, num_slices={self.num_slices}, "
                f"flops={self.flops:.4g}, largest_intermediate={li_el} elements ({format_bytes(li_b)}), "
                f"slice_working_set={format_bytes(self.slice_working_set)}, checkpoints={len(self.checkpoints)}, "
                f"memory_limit={None if self.memory_limit is None else format_bytes(self.memory_limit)})")


# ---------------------------------------------------------------------------- planning
def _forced_modes(slicing, network: parser.Network):
    """``(modes to slice, min_slices)`` from the ``slicing`` option."""
    if slicing is None:
        return [], None
    min_slices = None
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
    for t in network.inputs:
        for m in t:
            counts[m] = counts.get(m, 0) + 1
    forced: List[int] = []
    for lab in mode_list:
        if lab not in network.ids:
            raise ValueError(f"slicing: mode {lab!r} is not a mode of the expression")
        m = network.ids[lab]
        if counts.get(m, 0) < 2 and m not in network.output:
            raise ValueError(f"slicing: mode {lab!r} occurs in only one operand and not in the output; "
                             "slicing it saves nothing")
        if m in forced:
            raise ValueError(f"slicing: mode {lab!r} is listed twice")
        forced.append(m)
    return forced, min_slices


@torch.compiler.disable  # planning is host-side Python (opt_einsum/cotengra); plan before compiling
def build_plan(expr, terms, output, shapes, dtype, device_type, memory_limit, optimize, slicing,
               device=None, interleaved=False, gradients=True) -> ContractionPlan:
    """Plan the contraction of operands with ``shapes`` and mode labels ``terms`` into
    ``output`` (None: implicit), with the options of :func:`~.contract.plan`."""
    terms, out, sizes, broadcast = parser.normalize_labels(terms, output, shapes)
    network = parser.network_of(terms, out, sizes, broadcast)
    itemsize = torch.empty((), dtype=dtype).element_size()
    limit = slicer.parse_memory_limit(memory_limit, device if device is not None else device_type)
    limit_elems = None if limit is None else limit // itemsize
    if limit_elems == 0:
        raise ValueError(f"memory_limit cannot be met: {limit} bytes is less than one {dtype} element")
    forced, min_slices = _forced_modes(slicing, network)
    found = paths.find_path(network.inputs, network.output, network.sizes, optimize, limit_elems, min_slices)
    steps = slicer.step_table(network.inputs, network.output, found.path)
    start = list(forced) + [m for m in (found.sliced or []) if m not in forced]
    sliced = slicer.greedy_slice(steps, network.sizes, network.output, limit_elems, min_slices, start, gradients)
    return ContractionPlan(expr=expr if expr is not None else parser.describe(terms, out),
                           inputs=[tuple(t) for t in terms], output=tuple(out), shapes=shapes, dtype=dtype,
                           device_type=device_type, network=network, path=found.path, sliced=sliced,
                           memory_limit=limit, optimizer=found.optimizer, searched=found.searched)


# ---------------------------------------------------------------------------- cache
class PlanCache:
    """Plans by key, least recently used dropped past ``maxsize``, with counters: ``hits``,
    ``misses`` and ``path_searches`` (plans whose making ran a path optimizer)."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self._plans: "OrderedDict[Any, ContractionPlan]" = OrderedDict()
        self.hits = self.misses = self.path_searches = 0

    def get(self, key) -> Optional[ContractionPlan]:
        p = self._plans.get(key)
        if p is not None:
            self.hits += 1
            self._plans.move_to_end(key)
        return p

    def build(self, key, make: Callable[[], ContractionPlan]) -> ContractionPlan:
        """Make a plan (counted as a miss) and keep it under ``key`` (None: do not keep)."""
        self.misses += 1
        p = make()
        self.path_searches += int(p.searched)
        if key is not None:
            self._plans[key] = p
            if len(self._plans) > self.maxsize:
                self._plans.popitem(last=False)
        return p

    def info(self) -> Dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "path_searches": self.path_searches,
                "size": len(self._plans)}

    def clear(self) -> None:
        self._plans.clear()
        self.hits = self.misses = self.path_searches = 0


PLANS = PlanCache()  # the process-wide plan cache behind contract() and plan()
