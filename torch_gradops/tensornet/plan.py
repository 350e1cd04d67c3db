"""Plans: :class:`ContractionPlan` (a path, its slicing and the compiled program for fixed
shapes, dtype and device type), :func:`build_plan`, and the plan cache."""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from ..library import check_backend
from .._transforms import not_compiled
from .._units import format_bytes
from ..graph import as_index
from . import autograd, parser, paths, program, slicer
from .compiler import compile_program

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
        sliced_modes: labels of the sliced modes (``sliced_ids``: their mode ids); a mode
            sliced in ranges appears as :class:`~.parser.ModeChunks` (``label/chunks``);
            slice_extents: their extents; num_slices: product of the extents (slice ``s`` is
            the mixed-radix number of the modes' indices, last mode fastest; ``slice_set`` turns
            slice groups into the executor's slice tables, lazily).
        flops: real floating-point operations of the forward over all slices (a complex
            multiply-add counts 8); unsliced_flops: the same path without slicing;
            recompute_flops: what the backward recomputes over all slices (the steps before
            the last checkpoint).
        largest_intermediate: ``(elements, bytes)`` of the largest tensor a step creates, per
            slice: what ``memory_limit`` bounds.
        modelled_peak: bytes that one slice's forward + backward holds at most beyond the
            operands, their gradients and the output, by the executor's memory model
            (:func:`~.slicer.memory_model`): the planner keeps it within
            :data:`~.slicer.MODEL_CAP` x ``memory_limit``; the measured contract is
            :data:`~.slicer.BACKWARD_FACTOR` x ``memory_limit``.
        checkpoints: the steps before which the backward keeps a checkpoint.
        hoisted: None, or the :class:`HoistedParts` that run a sliced plan's slice-invariant
            subtrees once (:func:`_hoist`); ``flops``, ``recompute_flops``, ``modelled_peak``
            and the estimated time are then the parts', ``path``, ``checkpoints`` and
            ``program`` those of the whole network's plan.
        program: the compiled program (:mod:`~.program`), a tuple of ints.
        search_s / plan_s: seconds the path search / the whole planning took (0 for a search
            answered by the on-disk path cache).
    """

    def __init__(self, *, expr: str, inputs, output, shapes, dtype: torch.dtype, device_type: str,
                 network: parser.Network, path, sliced, memory_limit: Optional[int], optimizer: str,
                 searched: bool, checkpoints=(), copies=None, search_s: float = 0.0):
        self.expr = expr
        self.matching_exprs: Set[str] = set()  # einsum strings contract(..., plan=self) has accepted
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
        self.search_s = search_s
        self.plan_s = 0.0
        sizes = network.sizes
        self.sliced_ids = tuple(sliced)
        self.sliced_modes = tuple(network.labels[m] for m in sliced)
        self.slice_set = slicer.Slices(sizes[m] for m in sliced)
        self.slice_extents = self.slice_set.extents
        self.num_slices = self.slice_set.count
        self.output_shape = tuple(sizes[m] for m in network.output)
        itemsize = dtype.itemsize
        self.itemsize = itemsize
        steps = slicer.step_table(network.inputs, network.output, self.path)
        costs = slicer.step_costs(steps, sizes, sliced)
        self.checkpoints = tuple(checkpoints)
        self.program, gemms = compile_program(network.inputs, network.output, sizes, self.path, self.sliced_ids,
                                              itemsize, dtype.is_complex, self.checkpoints)
        copies = [(g[3], g[4]) for g in gemms] if copies is None else copies
        self.modelled_peak = int(slicer.memory_model(costs, self.checkpoints, copies, dtype.is_complex) * itemsize)
        scale = 2 * (4 if dtype.is_complex else 1)
        self.flops = int(costs.flops() * scale * self.num_slices)
        unsliced = slicer.step_costs(steps, sizes, ()) if sliced else costs
        self.unsliced_flops = int(unsliced.flops() * scale)
        cut = self.checkpoints[-1] if self.checkpoints else 0
        self.recompute_flops = int(sum(costs.macs[:cut]) * scale * self.num_slices)
        # the forward's GEMM operands and results over all slices, in bytes (estimated_seconds)
        self.bytes_moved = int(sum(g[1] + g[2] for g in gemms) * itemsize * self.num_slices)
        sset = set(sliced)
        largest = max([costs.largest] + [math.prod(sizes[m] for m in network.output if m not in sset)])
        self.largest_intermediate = (int(largest), int(largest) * itemsize)
        self.hoisted: Optional[HoistedParts] = None  # set by _hoist
        self._derivatives: Dict[int, Tuple["ContractionPlan", List[int], List[int], int]] = {}
        self._batched: Dict[Tuple[Tuple[int, ...], int], "ContractionPlan"] = {}

    # -- slices ---------------------------------------------------------------------------
    def slice_indices(self, s: int) -> Tuple[int, ...]:
        """The sliced modes' indices of slice ``s`` (``0 <= s < num_slices``)."""
        group = self.slice_set.group(s)  # checks s as contract(slices=s) does
        if len(group) != 1:
            raise TypeError(f"slice_indices takes one slice id, got {s!r}")
        return self.slice_set.indices(group[0])

    # -- cost -----------------------------------------------------------------------------
    def estimated_seconds(self, gradients: bool = True) -> float:
        """Estimated wall time of the forward (+ backward) over all slices on this plan's device
        type (:data:`TIME_MODEL`): the FLOPs at the device's GEMM rate in this plan's dtype,
        measured once per process (:func:`device_flop_rate`), times a factor for the
        smaller-than-square GEMMs networks make; a fixed cost per executor step and slice
        (dispatch: plans of many tiny slices pay mostly this); the GEMMs' operands and results
        at a memory rate (layout copies, strided reads); and a fixed cost per call (autograd,
        operand checks, gradient buffers). Forward + backward is 3x the forward's FLOPs plus
        what the backward recomputes (a scalar output's gradient is computed during the
        forward), and three passes of steps and memory traffic. On the CPU the constants were
        fitted to float32, float64 and complex64 plans, to within about 2x of their measured times
        (see :data:`TIME_MODEL`); a guide for choosing limits, not a timer."""
        if self.hoisted is not None:
            return sum(p.estimated_seconds(gradients) for p in self.hoisted.plans())
        m = TIME_MODEL.get(self.device_type, TIME_MODEL["cpu"])
        passes = 3 if gradients else 1
        work = self.flops * 3 + self.recompute_flops if gradients else self.flops
        steps = self.num_slices * max(len(self.path), 1) * passes
        return (m["call_s"][gradients] + m["flop_factor"] * work / device_flop_rate(self.device_type, self.dtype)
                + steps * m["step_s"] + passes * self.bytes_moved * m["byte_s"])

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
        dtype = parser.promoted_dtype(operands)
        if self.memory_limit is not None:
            # the memory model counted this plan's element size: wider elements break its limit
            if dtype.itemsize > self.itemsize or (dtype.is_complex and not self.dtype.is_complex):
                raise ValueError(f"operands of dtype {dtype} on a plan made for {self.dtype} under memory_limit="
                                 f"{format_bytes(self.memory_limit)}: their wider elements would exceed it; make the "
                                 f"plan for {dtype} (from the operands, or plan(..., dtype={dtype}))")
        else:
            self._check_fits(operands[0].device, dtype)
        return parser.preprocess(operands, self.network.pre, dtype)

    def _check_fits(self, device: torch.device, dtype: torch.dtype) -> None:
        """A plan without a limit whose largest intermediate alone is larger than the device's
        memory cannot run: a clear error instead of the allocator's failure (or, on a CPU, the
        kernel's out-of-memory kill of the process, after minutes of work)."""
        if device.type not in ("cpu", "cuda") or torch.compiler.is_compiling():
            return
        need = self.largest_intermediate[0] * dtype.itemsize
        have = slicer._device_memory(device)  # (an operand's CUDA device has its index)
        if need > have:
            raise ValueError(
                f"this plan's largest intermediate is {format_bytes(need)}, more than the {format_bytes(have)} of "
                f"memory of {device}: pass memory_limit (bytes, '4GB' or '50%') to slice the contraction, or plan "
                f"with a better optimize= (the plan: {self.flops:.3g} FLOPs, {self.optimizer})")

    # -- running ----------------------------------------------------------------------------
    def contract(self, *operands, slices=None, out: Optional[torch.Tensor] = None, accumulate: bool = False,
                 progress: bool = False) -> torch.Tensor:
        """Contract ``operands`` (shapes as planned) over the slice group ``slices`` (None: all;
        an int, a range or a list of slice ids: their partial sum, or their output blocks when
        a sliced mode is an output mode). ``out``: write (or with ``accumulate`` add) the
        result into this tensor (no autograd), of the result's dtype or, for float16/bfloat16,
        float32: the slices' sum then is not rounded, so that groups added across calls (or
        ranks) lose no more than one group. ``progress``: a tqdm bar over slices.
        Returns a tensor of shape :attr:`output_shape`, differentiable in the operands; under
        ``torch.autocast`` (without ``out``), in autocast's dtype
        (:func:`~.parser.autocast_operands`)."""
        eff = self.prepare(parser.autocast_operands(operands) if out is None else operands)
        if out is None:
            return autograd.contract_prepared(self, eff, slices, progress)
        if tuple(out.shape) != self.output_shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, the result has {self.output_shape}")
        wide = program.accumulate_dtype(eff[0].dtype)
        if out.dtype not in (eff[0].dtype, wide) or out.device != eff[0].device:
            # copy_/add_ would cast (truncating into an integer out) or cross devices silently
            also = "" if wide == eff[0].dtype else f" (or {wide}, which takes the sum unrounded)"
            raise TypeError(f"out must have the result's dtype{also} and device ({eff[0].dtype}, {eff[0].device}), "
                            f"got {out.dtype}, {out.device}")
        with torch.no_grad():
            res = autograd.contract_prepared(self, eff, slices, progress, out.dtype)
            return out.add_(res) if accumulate else out.copy_(res)

    __call__ = contract

    def gradients(self, *operands, output_grad: torch.Tensor, slices=None, grads=None, accumulate: bool = False):
        """Gradients of ``contract(*operands, slices=slices)`` under ``output_grad`` (shape
        :attr:`output_shape`), cuTensorNet-style: one slice's intermediates at a time.

        ``grads``: None to compute every operand's gradient, or one entry per operand, a
        tensor of the operand's shape to write (``accumulate``: add) its gradient into or None
        to skip it; of the operand's dtype or, for float16/bfloat16, float32 (the gradient
        then comes unrounded). Returns the list of gradients (None where skipped). No autograd graph."""
        return autograd.operand_gradients(self, operands, output_grad, slices, grads, accumulate)

    # -- derivative networks ------------------------------------------------------------------
    def derivative_plan(self, i: int) -> Tuple["ContractionPlan", List[int], List[int], int]:
        """``(plan, target, others, fan)``: the network of d(out)/d(operand i) contracted with an
        output gradient. Its inputs are the output gradient and the operands ``others`` (all but
        ``i``), its output the modes ``target`` of operand ``i`` that occur there (mode ids).
        Planned under this plan's memory limit, its sliced modes are this plan's, first and in
        order, then any more it needs: slice ``s`` here is its slices ``s * fan`` to
        ``(s + 1) * fan - 1`` (:meth:`derivative_slices`). Planned once per plan."""
        if i not in self._derivatives:
            net = self.network
            others = [j for j in range(len(net.inputs)) if j != i]
            present = set(net.output)
            for j in others:
                present.update(net.inputs[j])
            target = [m for m in net.inputs[i] if m in present]
            terms = [list(net.output)] + [list(net.inputs[j]) for j in others]
            shapes = [tuple(net.sizes[m] for m in t) for t in terms]

            def build(limit):
                return self._related_plan(terms, list(target), shapes, limit)
            p, fan = None, 1
            if self.memory_limit is not None:
                p, fan = self._limited_derivative(i, build)
            if p is None:  # this plan's slices exactly
                p = build(None)
            self._derivatives[i] = (p, target, others, fan)
        return self._derivatives[i]

    def _limited_derivative(self, i, build) -> Tuple[Optional["ContractionPlan"], int]:
        """The derivative network of operand ``i`` planned under this plan's memory limit
        (``build(limit)``), and its slices per slice of this plan, where its sliced modes begin
        with this plan's (the derivative network's labels are this plan's mode ids); else, with a
        warning, ``(None, 1)``: planned without the limit, the gradient (``create_graph=True``,
        torch.func) may go over it."""
        n = len(self.sliced_ids)
        try:
            p = build(self.memory_limit)
        except ValueError as e:  # the limit cannot be met there
            why = str(e)
        else:
            extents = p.slice_set.extents
            if tuple(p.sliced_modes[:n]) == tuple(self.sliced_ids) and extents[:n] == self.slice_set.extents:
                return p, int(math.prod(extents[n:]))
            why = "its slicing does not extend this plan's"
        warnings.warn(f"the derivative network of operand {i} (create_graph=True / torch.func gradients) is "
                      f"planned without memory_limit ({format_bytes(self.memory_limit)}): {why}", RuntimeWarning,
                      stacklevel=2)
        return None, 1

    def derivative_slices(self, slices, fan: int):
        """The slice group of a derivative plan (:meth:`derivative_plan`) covering this plan's
        slice group ``slices``: a range stays a range. (A plan of one slice runs it once for
        any non-empty group, repeated ids or not: so does the derivative's group.)"""
        group = self.slice_set.group(slices)
        if fan == 1:
            return group
        if self.num_slices == 1:
            return range(fan if len(group) else 0)
        if isinstance(group, range) and group.step == 1:
            return range(group.start * fan, group.stop * fan)
        return tuple(s * fan + k for s in group for k in range(fan))

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
            self._batched[key] = self._related_plan(terms, output, shapes, None)
        return self._batched[key]

    def _related_plan(self, terms, output, shapes, memory_limit) -> "ContractionPlan":
        """A plan of a network derived from this one (mode ids as labels: a derivative or a
        batched network), for this plan's dtype and device, slicing this plan's sliced modes
        first, in order (then any more ``memory_limit`` needs); not kept in the plan cache."""
        return PLANS.build(None, lambda: build_plan(None, terms, output, shapes, self.dtype, self.device_type,
                                                    memory_limit, "auto", list(self.sliced_ids), interleaved=True,
                                                    max_overhead=None))

    def __repr__(self):
        li_el, li_b = self.largest_intermediate
        path = self.path if len(self.path) <= 8 else self.path[:8] + ["..."]
        hoisted = f"hoisted={self.hoisted.describe()}, " if self.hoisted is not None else ""
        return (f"ContractionPlan(expr={_short_expr(self.expr, len(self.inputs))!r}, shapes={_short(list(self.shapes))}, "
                f"dtype={self.dtype}, device_type={self.device_type!r}, optimizer={self.optimizer!r}, path={path} "
                f"({len(self.path)} steps), sliced_modes={list(self.sliced_modes)}, num_slices={self.num_slices}, "
                f"flops={self.flops:.4g} (unsliced {self.unsliced_flops:.4g}), "
                f"largest_intermediate={li_el} elements ({format_bytes(li_b)}), "
                f"modelled_peak={format_bytes(self.modelled_peak)}, checkpoints={len(self.checkpoints)}, "
                f"recompute_flops={self.recompute_flops:.4g}, "
                f"memory_limit={None if self.memory_limit is None else format_bytes(self.memory_limit)}, {hoisted}"
                f"estimated_time={_seconds(self.estimated_seconds(False))} forward, "
                f"{_seconds(self.estimated_seconds(True))} forward+backward)")


def _short_expr(expr: str, n_terms: int, width: int = 120) -> str:
    """``expr`` cut to about ``width`` characters for the repr (a circuit's interleaved
    expression runs to kilobytes; ``plan.expr`` keeps all of it)."""
    return expr if len(expr) <= width else f"{expr[:width]}... ({n_terms} terms)"


def _short(shapes):
    return shapes if len(shapes) <= 6 else shapes[:6] + [f"... {len(shapes)} operands"]


def _seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 3600:
        return f"{s:.3g} s"
    if s < 86400 * 365:
        return f"{s / 3600:.3g} h"
    return f"{s / (86400 * 365):.3g} years"


_RATES: Dict[Tuple[str, torch.dtype], float] = {}
# ContractionPlan.estimated_seconds' constants per device type: seconds per call (forward,
# forward + backward), a factor on the FLOPs' time at the 512^3 GEMM rate, seconds per executor
# step and slice per pass, and seconds per byte of GEMM operands and results per pass.
# CPU: fitted (least squares on the log of the ratio) to benchmarks/tensornet_estimate.py's
# plans (lattices, circuit amplitudes and VQE terms, MPS, PEPS, random networks and matrix chains
# in float32, float64 and complex64), rounded. In its committed run (62 plans, 1 to 16,384 slices,
# 2.5e4 to 4e10 FLOPs; AMD EPYC VM, 2 threads, OMP_WAIT_POLICY=PASSIVE, 2026-11-28) measured /
# estimated is 0.24 / 0.93 / 2.0 (min / median / max) forward and 0.37 / 1.02 / 1.71 forward +
# backward, the fit's residuals on the plans it was fitted to; with FLOPs and 2 us per step
# alone it was 1.3 / 3.7 / 10 and 1.5 / 4.5 / 20. Plans outside the fit, in a review: a hoisted
# 300-site MPS 0.68-0.73, float32 lattices 0.64-0.77, bfloat16 lattices 1.25-2.8 (small bf16
# GEMMs run far below the 512^3 rate), float16 0.21-0.61. Least well served in the fit: slices
# that are matrix-vector products re-reading one large operand (the memory term overcounts
# them), small complex networks of many steps (undercounted). CUDA: not fitted (no GPU
# measurement yet): a launch per step and HBM rates.
TIME_MODEL: Dict[str, Dict] = {
    "cpu": {"call_s": (1.5e-4, 7e-4), "flop_factor": 1.6, "step_s": 5e-6, "byte_s": 2e-10},
    "cuda": {"call_s": (5e-5, 2e-4), "flop_factor": 1.6, "step_s": 5e-6, "byte_s": 5e-13},
}


def device_flop_rate(device_type: str, dtype: torch.dtype) -> float:
    """FLOP/s of a 512 x 512 GEMM on ``device_type`` (CUDA: the current device) in ``dtype``
    (float64 runs at about half float32's rate on CPUs), measured once per process and dtype
    (about 10 ms) and cached: the basis of :meth:`ContractionPlan.estimated_seconds`. Falls back
    to 1e10 FLOP/s where the device cannot run it (no CUDA, a dtype without GEMMs there) or
    computes nothing (meta)."""
    key = (device_type, dtype)
    if key not in _RATES:
        rate = 1e10
        try:
            if device_type == "meta":
                raise NotImplementedError("meta tensors time nothing")
            dev = torch.device(device_type)
            a = torch.randn(512, 512, device=dev).to(dtype)
            sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)  # noqa: E731
            a @ a
            sync()
            import time
            t0, runs = time.perf_counter(), 0
            while runs < 3:  # (queued back to back on CUDA; on CPU one run of a slow dtype, fp16's 0.1 s)
                a @ a
                runs += 1
                if dev.type == "cpu" and time.perf_counter() - t0 > 0.02:
                    break
            sync()
            dt_s = (time.perf_counter() - t0) / runs
            rate = 2 * 512 ** 3 * (4 if dtype.is_complex else 1) / max(dt_s, 1e-9)
        except (RuntimeError, NotImplementedError):
            pass
        _RATES[key] = rate
    return _RATES[key]


# ---------------------------------------------------------------------------- planning
def _forced_modes(slicing, network: parser.Network):
    """``(modes to slice, min_slices, modes to slice in chunks)`` from the ``slicing`` option:
    labels slice their mode whole, :class:`~.parser.ModeChunks` (as :attr:`ContractionPlan.
    sliced_modes` lists them) in ranges, ``{mode id: chunks}``."""
    if slicing is None:
        return [], None, {}
    min_slices = None
    if isinstance(slicing, dict):
        bad = set(slicing) - {"min_slices", "modes"}
        if bad:
            raise ValueError(f"slicing: unknown keys {sorted(bad)}; use 'modes' and/or 'min_slices'")
        min_slices = slicing.get("min_slices")
        if min_slices is not None:
            min_slices = as_index(min_slices)
            if min_slices is None or min_slices < 1:
                raise ValueError(f"slicing: min_slices must be a positive int, got {slicing['min_slices']!r}")
        mode_list = slicing.get("modes", [])
        if not isinstance(mode_list, (list, tuple, str)):
            raise TypeError(f"slicing: 'modes' must be a list of modes, got {type(mode_list).__name__}")
        mode_list = list(mode_list)
    elif isinstance(slicing, (list, tuple, str)):
        mode_list = list(slicing)
    else:
        raise TypeError(f"slicing must be a list of modes or {{'min_slices': k}}, got {type(slicing).__name__}")
    counts: Dict[int, int] = {}
    for t in network.inputs:
        for m in t:
            counts[m] = counts.get(m, 0) + 1
    if min_slices:  # refused before the search, whose trials would each fail on it (cotengra warns)
        # only modes in two operands or the output can be sliced (as checked for listed modes below)
        possible = math.prod(e for m, e in network.sizes.items()
                             if e > 1 and (counts.get(m, 0) > 1 or m in network.output))
        if possible < min_slices:
            raise ValueError(f"slicing: cannot reach min_slices={min_slices}; only {possible} slice(s) possible")
    forced: List[int] = []
    chunked: Dict[int, int] = {}
    for lab in mode_list:
        if not parser.is_hashable(lab):
            raise TypeError(f"slicing: mode {lab!r} is not a mode label (labels are hashable)")
        if isinstance(lab, parser.ModeChunks) and lab not in network.ids and lab.label in network.ids:
            m = network.ids[lab.label]
            e = network.sizes[m]
            if m in network.output:
                raise ValueError(f"slicing: {lab!r} cannot be sliced in ranges: {lab.label!r} is an output mode, "
                                 f"which slices only whole (one output block per index): pass {lab.label!r}")
            if not 1 < lab.chunks < e or e % lab.chunks:
                raise ValueError(f"slicing: {lab!r} cannot be sliced in {lab.chunks} ranges: its mode has extent {e}"
                                 + (f"; pass a divisor of {e} between 2 and {e - 1} ({', '.join(map(str, divs))}), or "
                                    if (divs := [d for d in range(2, e) if e % d == 0]) else
                                    f"; {e} has no divisor between 2 and {e - 1}: pass ")
                                 + f"{lab.label!r} to slice it whole")
            if m in chunked or m in forced:
                raise ValueError(f"slicing: mode {lab.label!r} is listed twice")
            chunked[m] = lab.chunks
            continue
        if lab not in network.ids:
            raise ValueError(f"slicing: mode {lab!r} is not a mode of the expression")
        m = network.ids[lab]
        if counts.get(m, 0) < 2 and m not in network.output:
            raise ValueError(f"slicing: mode {lab!r} occurs in only one operand and not in the output; "
                             "slicing it saves nothing")
        if m in forced or m in chunked:
            raise ValueError(f"slicing: mode {lab!r} is listed twice")
        forced.append(m)
    return forced, min_slices, chunked


class _Slicing:
    """Sliced modes and checkpoints for a path: :func:`~.slicer.choose_sliced` to the limit
    (and ``min_slices``), then, where no checkpoint placement keeps the backward's modelled
    memory within the cap, :func:`~.slicer.split_to_fit` (modes sliced in chunks, or whole)."""

    def __init__(self, network, limit_elems, min_slices, forced, is_complex, reserve: int = 0,
                 max_overhead: Optional[float] = None):
        self.network = network
        self.max_overhead = max_overhead  # past it split_to_fit stops (build_plan refuses the plan)
        self.limit_elems = limit_elems
        self.min_slices = min_slices
        self.forced = list(forced)
        self.is_complex = is_complex
        # ``reserve``: elements held besides the slice's own (a hoisted plan's slice-invariant
        # tensors and their gradients, see _hoist)
        self.cap = None if limit_elems is None else slicer.MODEL_CAP * limit_elems - reserve
        # unsliced: intermediates as large as the tree makes them, whose writes can cost more
        # than their multiply-adds (slicer.WRITE_MACS)
        self.write_macs = slicer.WRITE_MACS if limit_elems is None and not min_slices and not forced else 0.0
        self._final = {}
        self._chosen = {}

    def schedule(self, path):
        """``(path, steps)``: under a limit the path's steps reordered with the heavier subtree
        of each step last (:func:`~.paths.heavy_last`: less recomputation in a checkpointed
        backward), and its step table."""
        net = self.network
        steps = slicer.step_table(net.inputs, net.output, path)
        if self.limit_elems is None or len(path) < 3:
            return [tuple(p) for p in path], steps
        macs = slicer.step_costs(steps, net.sizes, ()).macs
        path = paths.heavy_last(path, len(net.inputs), macs)
        return path, slicer.step_table(net.inputs, net.output, path)

    def choose(self, path, suggested=()):
        """``(path, steps, sliced)``: the scheduled path, its steps and the sliced modes that fit
        the limit (and ``min_slices``). Memoised: the search scores a tree (:meth:`work`), then
        its best trees again exactly (:meth:`finalize`)."""
        key = (tuple(map(tuple, path)), tuple(suggested or ()))
        if key not in self._chosen:
            net = self.network
            path, steps = self.schedule(path)
            start = self.forced + [m for m in (suggested or []) if m not in self.forced]
            self._chosen[key] = (path, steps, slicer.choose_sliced(steps, net.sizes, net.output, self.limit_elems,
                                                                   self.min_slices, start))
        path, steps, sliced = self._chosen[key]
        return list(path), steps, list(sliced)

    def _peak_of(self, copies):
        """``costs -> (modelled peak, recomputed multiply-adds)`` with the best checkpoints."""
        return _checkpointed_peak(self.cap, copies, self.is_complex)

    def _chunked(self, steps, sliced, peak_of):
        """``(splits, sliced)``: :func:`~.slicer.chunk_sliced` under a limit or ``min_slices``
        (8 slices of two modes of extent 4: one whole, one in 2 chunks); else unchanged."""
        if self.limit_elems is None and not self.min_slices:
            return {}, sliced
        return slicer.chunk_sliced(steps, self.network.sizes, self.network.output, sliced, set(self.forced),
                                   self.limit_elems, self.min_slices, self.cap, peak_of)

    def _cost(self, steps, sliced, splits) -> Tuple[int, float]:
        """``(modelled peak without the layout's copies, work)`` of a chunked slicing."""
        net = self.network
        costs = slicer.StepCosts(steps, slicer.chunked_sizes(net.sizes, splits), set(sliced))
        peak, recompute = self._peak_of(None)(costs)
        nslices = math.prod(net.sizes[m] for m in sliced) * math.prod(splits.values())
        return peak, slicer.slicing_work(costs, nslices, recompute, self.write_macs)

    def finalize(self, path, suggested=(), itemsize=8):
        """``(path, steps, sliced, splits, work)`` for a path: scheduled (:meth:`schedule`),
        sliced to the limit, then, with the
        compiled layout's copies in the memory model, split or sliced further while no
        checkpoint placement fits the cap (``splits``: mode -> chunks). ``work``:
        :func:`~.slicer.slicing_work`. Memoised per path (the search's candidates, then the
        plan)."""
        key = (tuple(map(tuple, path)), tuple(suggested or ()), itemsize)
        if key in self._final:
            return self._final[key]
        net = self.network
        path, steps, sliced = self.choose(path, suggested)
        splits = {}
        if self.limit_elems is None and self.min_slices:
            splits, sliced = self._chunked(steps, sliced, self._peak_of(None))
        elif self.limit_elems is not None:
            # the compiled layout's copies matter only where some layout could exceed the cap
            fits = not sliced and _any_layout_peak(slicer.step_costs(steps, net.sizes, ()), self.is_complex) <= self.cap
            peak_of = self._peak_of(None if fits else _copies(net, path, sliced, itemsize, self.is_complex))
            splits, sliced = self._chunked(steps, sliced, peak_of)
            more, whole = slicer.split_to_fit(steps, slicer.chunked_sizes(net.sizes, splits), net.output, sliced,
                                              self.cap, peak_of, self.max_macs(steps))
            for m, f in more.items():  # chunks of chunks are chunks
                splits[m] = splits.get(m, 1) * f
            for m in whole:  # a split mode whose chunks are sliced whole is sliced whole
                splits.pop(m, None)
            sliced = sliced + whole
        self._final[key] = (path, steps, sliced, splits, self._cost(steps, sliced, splits)[1])
        return self._final[key]

    def max_macs(self, steps) -> Optional[float]:
        """The most multiply-adds of all slices that ``max_overhead`` allows on these steps."""
        if self.max_overhead is None:
            return None
        return self.max_overhead * max(slicer.step_costs(steps, self.network.sizes, ()).flops(), 1)

    def work(self, path, suggested=()) -> float:
        """The search's score, a cheap proxy of :meth:`finalize`'s work: the path sliced to the
        limit, whole-sliced modes taken in chunks where that fits (memory model without the
        layout's copies), with the backward's recomputation; a tree whose modelled memory does
        not fit the cap even with checkpoints is charged (peak / cap)^0.6 on top, about what
        splitting modes in halves until it fits costs."""
        _, steps, sliced = self.choose(path, suggested)
        splits, sliced = self._chunked(steps, sliced, self._peak_of(None))
        peak, work = self._cost(steps, sliced, splits)
        if self.cap is not None and peak > self.cap:
            work *= (peak / self.cap) ** 0.6
        return work


def _any_layout_peak(costs, is_complex) -> int:
    """An upper bound of :func:`~.slicer.memory_model` without checkpoints whatever the compiled
    layout copies: every step copying both its operands and its result (the most
    :func:`~.slicer.step_transients` can add). Where it is within the cap, the layout changes no
    slicing decision, and the planner need not compile a candidate to know that."""
    worst = max((ia + ib + r + (max(ia, ib) if is_complex else 0)
                 for (ia, ib), r in zip(costs.inputs, costs.result)), default=0)
    return sum(costs.result) + worst


def _checkpointed_peak(cap, copies, is_complex):
    """``costs -> (modelled peak, recomputed multiply-adds)`` with the best checkpoints within
    ``cap`` (:func:`~.slicer.place_checkpoints` on a layout with ``copies``)."""
    def peak_of(costs):
        peak, _, recompute = slicer.place_checkpoints(costs, cap, copies, is_complex)
        return peak, recompute
    return peak_of


def _split_plan_network(network, path, sliced, splits, cap, itemsize, is_complex, max_macs=None):
    """``(network, sliced, checkpoints, copies)`` with the planner's mode splits applied (the
    chunk modes sliced after the whole ones) and the checkpoints placed on its compiled layout.

    The splits were chosen on the unsplit network's layout; the split network's own layout can
    copy more (other GEMM layouts), so when its modelled peak is over ``cap`` it is split or
    sliced further (:func:`~.slicer.split_to_fit` on the split network, its modes merged into
    the original ones' splits) and laid out again, a few rounds at most (then the round with the
    lowest modelled peak)."""
    sliced, splits = list(sliced), dict(splits)
    rounds, best = 4, None
    for r in range(rounds):
        net, chunk = parser.split_modes(network, splits) if splits else (network, {})
        all_sliced = sliced + [chunk[m] for m in sorted(splits)]
        if cap is None:  # no limit, no checkpoints: the plan's own compilation gives the copies
            return net, all_sliced, [], None
        steps = slicer.step_table(net.inputs, net.output, path)
        copies = _copies(net, path, all_sliced, itemsize, is_complex)
        peak, checkpoints, _ = slicer.place_checkpoints(slicer.step_costs(steps, net.sizes, all_sliced), cap,
                                                        copies, is_complex)
        if best is None or peak < best[0]:
            best = (peak, (net, all_sliced, checkpoints, copies))
        if peak <= cap or r == rounds - 1:
            break
        # split_to_fit's candidates are unsliced modes: ids of the original network (a split mode
        # keeps its id for the part within a chunk)
        more, whole = slicer.split_to_fit(steps, net.sizes, net.output, all_sliced, cap,
                                          _checkpointed_peak(cap, copies, is_complex), max_macs)
        if not more and not whole:
            break
        for m, f in more.items():
            splits[m] = splits.get(m, 1) * f
        for m in whole:  # a split mode whose chunks are sliced whole is sliced whole
            splits.pop(m, None)
            sliced.append(m)
    return best[1]


# Planning is host-side Python (opt_einsum, cotengra): Dynamo skips it.
@functools.partial(not_compiled, reason=(
    "torch_gradops plans a contraction in Python: plan it before compiling (call tn.plan or tn.contract once "
    "with the same expression, shapes and options; the plan cache serves the compiled call), or pass plan="))
def build_plan(expr, terms, output, shapes, dtype, device_type, memory_limit, optimize, slicing,
               device=None, interleaved=False, path_cache=None, max_overhead=1e4, hoist: bool = True,
               reserve: int = 0) -> ContractionPlan:
    """Plan the contraction of operands with ``shapes`` and mode labels ``terms`` into
    ``output`` (None: implicit), with the options of :func:`~.contract.plan`. ``hoist``: let a
    sliced plan compute its slice-invariant subtrees once (:func:`_hoist`); ``reserve``:
    elements of the memory model's cap held by something else (the hoisted tensors)."""
    import time
    t0 = time.perf_counter()
    terms, out, sizes, broadcast = parser.normalize_labels(terms, output, shapes)
    network = parser.network_of(terms, out, sizes, broadcast)
    itemsize = dtype.itemsize
    limit = slicer.parse_memory_limit(memory_limit, device if device is not None else device_type)
    limit_elems = None if limit is None else limit // itemsize
    if limit_elems == 0:
        raise ValueError(f"memory_limit cannot be met: {limit} bytes is less than one {dtype} element")
    forced, min_slices, chunked = _forced_modes(slicing, network)
    if chunked:  # modes to slice in ranges: their chunk modes are modes of the network, sliced
        network, chunk_ids = parser.split_modes(network, chunked)
        forced += [chunk_ids[m] for m in sorted(chunked)]
    if max_overhead is not None and not (isinstance(max_overhead, (int, float)) and max_overhead >= 1):
        raise ValueError(f"max_overhead must be a number >= 1 or None, got {max_overhead!r}")
    slicing_ = _Slicing(network, limit_elems, min_slices, forced, dtype.is_complex, reserve, max_overhead)
    sym_back = {v: k for k, v in paths.symbols(network.sizes).items()}

    def score_tree(tree):
        return slicing_.work([tuple(p) for p in tree.get_path()], [sym_back[s] for s in tree.sliced_inds])

    def select_tree(tree):
        path = [tuple(p) for p in tree.get_path()]
        return slicing_.finalize(path, [sym_back[s] for s in tree.sliced_inds], itemsize)[-1]

    # the disk cache's key: what shapes the objective besides the search options
    cache_key = (tuple(forced), min_slices, dtype.is_complex, max_overhead, reserve)
    # The network's mode ids are numbered by first appearance, so the same network under other
    # labels (fresh index names each step, as quimb's are) has the same key: searched once.
    # (Not with an on-disk path cache, which then gets the entry for a new process.)
    path_key = (network.inputs, network.output, tuple(sorted(network.sizes.items())), optimize, limit_elems,
                min_slices, cache_key, itemsize) if isinstance(optimize, str) and paths.cache_root(path_cache) is None \
        else None
    found = PLANS.path_of(path_key)
    if found is None:
        found = paths.find_path(network.inputs, network.output, network.sizes, optimize, limit_elems, min_slices,
                                objective=score_tree, path_cache=path_cache, select=select_tree,
                                path_work=slicing_.work,
                                path_exact_work=lambda path: slicing_.finalize(path, (), itemsize)[-1],
                                cache_key=cache_key, flops_per_mac=8.0 if dtype.is_complex else 2.0,
                                write_macs=slicing_.write_macs)
        PLANS.keep_path(path_key, found)
    path, steps, sliced, splits, _ = slicing_.finalize(found.path, found.sliced, itemsize)
    unsplit = network  # for the error below (the split network renumbers modes)
    network, sliced, checkpoints, copies = _split_plan_network(network, path, sliced, splits, slicing_.cap,
                                                               itemsize, dtype.is_complex, slicing_.max_macs(steps))
    plan = ContractionPlan(expr=expr if expr is not None else parser.describe(terms, out),
                           inputs=[tuple(t) for t in terms], output=tuple(out), shapes=shapes, dtype=dtype,
                           device_type=device_type, network=network, path=path, sliced=sliced,
                           memory_limit=limit, optimizer=found.optimizer, searched=found.searched,
                           checkpoints=checkpoints, copies=copies, search_s=found.search_s)
    if hoist and HOIST and slicing_.cap is not None and plan.num_slices > 1:
        _hoist(plan, slicing_.cap)
    base, of, greedy_largest = max(plan.unsliced_flops, 1), "the unsliced", None
    if max_overhead is not None and base < plan.flops <= max_overhead * base and \
            plan.flops > max_overhead * 2 * max((math.prod(unsplit.sizes[m] for m in t) for t in unsplit.inputs),
                                                default=1):
        # (no path does fewer multiply-adds than its largest operand has elements: below that the
        # greedy path cannot be the cheaper yardstick)
        greedy, largest = paths.reference_costs(unsplit.inputs, unsplit.output, unsplit.sizes,
                                                8.0 if dtype.is_complex else 2.0)
        if greedy < base:
            base, of, greedy_largest = max(greedy, 1), "opt_einsum's greedy path's unsliced", largest
    if max_overhead is not None and plan.flops > max_overhead * base:
        unsliced_largest = _unsliced_largest(steps, unsplit.sizes)
        why = f"the unsliced largest intermediate is {format_bytes(unsliced_largest * itemsize)}"
        if greedy_largest is not None:
            why = (f"the slicing found needs a path whose unsliced largest intermediate is "
                   f"{format_bytes(unsliced_largest * itemsize)}; opt_einsum's greedy path's is "
                   f"{format_bytes(greedy_largest * itemsize)}")
        elif limit is not None and unsliced_largest <= limit_elems:
            # every intermediate fits: the backward's checkpoints of a long path do not
            need = _checkpointed_limit(unsplit, path, steps, itemsize, dtype.is_complex)
            why = (f"every intermediate fits it unsliced, but the backward of {len(steps)} steps needs about "
                   f"{format_bytes(need * itemsize)} to hold its checkpoints unsliced, and slicing shrinks "
                   f"them little")
        raise ValueError(
            f"this plan is too expensive: {plan.num_slices} slices cost {plan.flops:.3g} FLOPs, "
            f"{plan.flops / base:.3g}x {of} {base:.3g} "
            f"(estimated {_seconds(plan.estimated_seconds(False))} forward on {device_type}); raise "
            f"memory_limit (now {format_bytes(limit) if limit is not None else None}; {why}), slice fewer "
            f"modes, or pass max_overhead=None to create it anyway and contract slice groups of it lazily")
    plan.plan_s = time.perf_counter() - t0
    return plan


# ---------------------------------------------------------------------------- hoisting
HOIST = True  # sliced plans compute their slice-invariant subtrees once (False: every slice)


class HoistedParts:
    """A sliced plan split at its slice-invariant subtrees (:func:`_hoist`).

    ``subs``: per hoisted subtree ``(plan, operands)``: an unsliced plan of the subtree's
    operands (indices into the effective operands) whose result, computed once per call, is an
    operand of ``main``. ``main``: the sliced plan of the rest, with the same sliced modes in the
    same order (so the same slice ids); its operands are ``main_operands``, each ``("op", i)``
    (effective operand ``i``) or ``("sub", k)`` (the result of ``subs[k]``)."""

    def __init__(self, subs, main, main_operands, fraction):
        self.subs = subs
        self.main = main
        self.main_operands = main_operands
        self.fraction = fraction  # of one slice's multiply-adds that the subtrees do

    def plans(self) -> List["ContractionPlan"]:
        return [p for p, _ in self.subs] + [self.main]

    def main_inputs(self, eff, results) -> List[torch.Tensor]:
        """``main``'s operands from the effective operands and the subtrees' ``results``."""
        return [eff[i] if kind == "op" else results[i] for kind, i in self.main_operands]

    def describe(self) -> str:
        return f"{len(self.subs)} slice-invariant subtrees ({self.fraction:.0%} of a slice's FLOPs) run once"


def _hoist_work(p: "ContractionPlan") -> float:
    """The planner's deterministic cost of running ``p`` forward + backward: FLOPs and a fixed
    cost per executor step (:data:`~.slicer.STEP_OVERHEAD_MACS`) and slice."""
    return 3.0 * p.flops + p.recompute_flops + 6.0 * slicer.STEP_OVERHEAD_MACS * p.num_slices * max(len(p.path), 1)


def _hoist(plan: ContractionPlan, cap: float) -> None:
    """Split a sliced plan at its slice-invariant subtrees when that costs less and fits.

    A step none of whose operands (transitively) holds a sliced mode computes the same tensor
    in every slice. The subtrees of such steps whose results a slice-dependent step reads are
    planned on their own (unsliced, computed once per call, differentiated once) and their
    results become operands of the sliced rest, ``main``, planned on the same path with the same
    sliced modes. Those results and, in the backward, their gradients (accumulated over the
    slices, as any operand's) are held through all slices: ``main`` is planned with that much
    less of the memory model's ``cap``, and the split is kept only if ``main`` then needs no
    more slices and the whole does less work (:func:`_hoist_work`). Sets ``plan.hoisted`` and
    the plan's FLOPs, recomputation and modelled peak to the split's."""
    from opt_einsum.paths import linear_to_ssa, ssa_to_linear

    net = plan.network
    n_ops = len(net.inputs)
    sset = set(plan.sliced_ids)
    steps = slicer.step_table(net.inputs, net.output, plan.path)
    costs = slicer.step_costs(steps, net.sizes, sset)
    variant = [any(m in sset for m in t) for t in net.inputs]
    children = [tuple(c) for c in linear_to_ssa(plan.path)]  # step j makes node n_ops + j
    for x, y in children:
        variant.append(variant[x] or variant[y])
    # invariant steps read by a slice-dependent one: the hoisted subtrees' roots
    roots = [c for j, pair in enumerate(children) if variant[n_ops + j] for c in pair
             if not variant[c] and c >= n_ops]
    if not roots:
        return

    def leaves_and_path(root):
        """The subtree's operands (left to right), its SSA path over them and its multiply-adds
        per slice. Iterative: an invariant subtree can be a chain thousands of steps deep."""
        leaves, order, macs, stack = [], [], 0, [(root, False)]
        while stack:  # post-order, left subtree first: the order of the path's own steps
            u, ready = stack.pop()
            if u < n_ops:
                leaves.append(u)
            elif ready:
                order.append(u)
                macs += costs.macs[u - n_ops]
            else:
                x, y = children[u - n_ops]
                stack += [(u, True), (y, False), (x, False)]
        ids = {u: k for k, u in enumerate(leaves + order)}  # SSA ids: the leaves, then each step's result
        return leaves, ssa_to_linear([tuple(ids[c] for c in children[u - n_ops]) for u in order]), macs

    kw = dict(dtype=plan.dtype, device_type=plan.device_type, memory_limit=plan.memory_limit, slicing=None,
              interleaved=True, max_overhead=None, hoist=False)
    root_modes = [sorted(steps[r - n_ops][1]) for r in roots]  # the modes of each hoisted result
    subs, held, sub_macs = [], 0, 0
    for r, modes in zip(roots, root_modes):
        leaves, path, macs = leaves_and_path(r)
        terms = [list(net.inputs[i]) for i in leaves]
        shapes = [tuple(net.sizes[m] for m in t) for t in terms]
        sub = PLANS.build(None, lambda: build_plan(None, terms, modes, shapes, optimize=path, **kw))
        subs.append((sub, leaves))
        held += math.prod(net.sizes[m] for m in modes)
        sub_macs += macs
    # main: the operands that no subtree took, then the subtrees' results, along the variant steps
    in_sub = {i for _, leaves in subs for i in leaves}
    main_operands = [("op", i) for i in range(n_ops) if i not in in_sub] + [("sub", k) for k in range(len(subs))]
    main_id = {(i if kind == "op" else roots[i]): pos for pos, (kind, i) in enumerate(main_operands)}
    ssa, nxt = [], len(main_operands)
    for j, (x, y) in enumerate(children):
        if variant[n_ops + j]:
            ssa.append((main_id[x], main_id[y]))
            main_id[n_ops + j] = nxt
            nxt += 1
    terms = [list(net.inputs[i]) if kind == "op" else root_modes[i] for kind, i in main_operands]
    shapes = [tuple(net.sizes[m] for m in t) for t in terms]
    main = PLANS.build(None, lambda: build_plan(
        None, terms, list(net.output), shapes, optimize=ssa_to_linear(ssa),
        **dict(kw, slicing=list(plan.sliced_ids)), reserve=2 * held))
    if main.slice_extents != plan.slice_extents:
        return  # it would need more slices
    parts = [p for p, _ in subs] + [main]
    if sum(_hoist_work(p) for p in parts) >= _hoist_work(plan):
        return
    itemsize = plan.itemsize
    peak = max([main.modelled_peak + 2 * held * itemsize] + [p.modelled_peak for p, _ in subs])
    if peak > cap * itemsize:
        return
    plan.hoisted = HoistedParts(subs, main, main_operands, sub_macs / max(sum(costs.macs), 1))
    plan.flops = sum(p.flops for p in parts)
    plan.recompute_flops = sum(p.recompute_flops for p in parts)
    plan.bytes_moved = sum(p.bytes_moved for p in parts)
    plan.modelled_peak = int(peak)


def _copies(network, path, sliced, itemsize, is_complex):
    """Per step (copied intermediate input elements, result copied by its reader), from the
    compiled layout (memoised: the planner asks again for the path it chose)."""
    return _copies_of(tuple(map(tuple, network.inputs)), tuple(network.output), tuple(sorted(network.sizes.items())),
                      tuple(map(tuple, path)), tuple(sliced), itemsize, is_complex)


@functools.lru_cache(maxsize=64)
def _copies_of(inputs, output, sizes, path, sliced, itemsize, is_complex):
    _, gemms = compile_program(inputs, output, dict(sizes), path, sliced, itemsize, is_complex)
    return tuple((g[3], g[4]) for g in gemms)


def _unsliced_largest(steps, sizes) -> int:
    return slicer.step_costs(steps, sizes, ()).largest


def _checkpointed_limit(network, path, steps, itemsize, is_complex) -> int:
    """The least ``memory_limit`` (elements) at which the unsliced path's modelled backward fits
    with one level of checkpoints: what a chain of many small steps needs however it is sliced,
    about ``result x 2 sqrt(steps)``."""
    costs = slicer.step_costs(steps, network.sizes, ())
    copies = _copies(network, path, (), itemsize, is_complex)
    lo, hi = 1, max(1, slicer.place_checkpoints(costs, None, copies, is_complex)[0])
    while lo < hi:  # the least cap that place_checkpoints meets (fitting is monotone in the cap)
        mid = (lo + hi) // 2
        if slicer.place_checkpoints(costs, mid, copies, is_complex)[0] <= mid:
            hi = mid
        else:
            lo = mid + 1
    return math.ceil(lo / slicer.MODEL_CAP)


# ---------------------------------------------------------------------------- cache
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_level() -> int:
    """The ``stacklevel`` of a warning raised here that names the first frame outside the
    package (the user's call, whichever entry point it went through)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


class PlanCache:
    """Plans by key, least recently used dropped past ``maxsize``, with counters: ``hits``,
    ``misses``, ``path_searches`` (plans whose making ran a path optimizer) and ``rebuilt``
    (plans made again after the cache dropped them: a working set larger than the cache, which
    a ``RuntimeWarning`` reports once, naming :func:`~.contract.set_plan_cache_size`)."""

    DEFAULT_SIZE = 512  # about 40-90 KiB a plan of 36-200 tensors

    def __init__(self, maxsize: int = DEFAULT_SIZE):
        self.maxsize = maxsize
        self._plans: "OrderedDict[Any, ContractionPlan]" = OrderedDict()
        self._paths: "OrderedDict[Any, paths.PathResult]" = OrderedDict()  # searched paths by network
        # hashes of recently dropped keys (a few times the cache's size): a build of one is a rebuild
        self._dropped: "OrderedDict[int, None]" = OrderedDict()
        self._lock = threading.Lock()  # threads planning at once: a lookup's entry evicted under it
        self.hits = self.misses = self.path_searches = self.rebuilt = 0
        self._warned = False

    def resize(self, maxsize: int) -> int:
        """Keep at most ``maxsize`` plans (and searched paths), dropping the least recently
        used; returns the previous size."""
        with self._lock:
            old, self.maxsize = self.maxsize, maxsize
            self._trim()
        return old

    def _trim(self) -> None:
        while len(self._plans) > self.maxsize:
            key, _ = self._plans.popitem(last=False)
            self._dropped[hash(key)] = None
        while len(self._paths) > self.maxsize:
            self._paths.popitem(last=False)
        while len(self._dropped) > 4 * max(self.maxsize, 1):
            self._dropped.popitem(last=False)

    def path_of(self, key) -> Optional["paths.PathResult"]:
        """The path searched earlier for the network and options of ``key`` (label-independent:
        see :func:`build_plan`), as a result that ran no search; None if none (or ``key`` None)."""
        with self._lock:
            found = None if key is None else self._paths.get(key)
            if found is None:
                return None
            self._paths.move_to_end(key)
        return dataclasses.replace(found, searched=False, search_s=0.0)

    def keep_path(self, key, found: "paths.PathResult") -> None:
        if key is not None and found.searched:
            with self._lock:
                self._paths[key] = found
                self._trim()

    def get(self, key) -> Optional[ContractionPlan]:
        # No lock: compiled code traces this lookup (Dynamo cannot enter a lock). Traced, it
        # neither counts nor reorders: Dynamo would guard on the counter's value and recompile
        # on every call (each call's hit changed it).
        p = self._plans.get(key)
        if p is not None and not torch.compiler.is_compiling():
            self.hits += 1
            try:
                self._plans.move_to_end(key)
            except KeyError:  # dropped by another thread meanwhile: the plan is still good
                pass
        return p

    def build(self, key, make: Callable[[], ContractionPlan]) -> ContractionPlan:
        """Make a plan (counted as a miss) and keep it under ``key`` (None: do not keep)."""
        p = make()
        warn = False
        with self._lock:
            self.misses += 1
            self.path_searches += int(p.searched)
            if key is not None:
                if hash(key) in self._dropped:
                    del self._dropped[hash(key)]
                    self.rebuilt += 1
                    if self.maxsize > 0:  # (a cache of size 0 keeps nothing: no warning, none used up)
                        warn, self._warned = not self._warned, True
                self._plans[key] = p
                self._trim()
        if warn:
            warnings.warn(f"torch_gradops: the plan cache ({self.maxsize} plans) dropped a plan that was needed again "
                          f"and made it anew: this program uses more distinct contractions than the cache holds, "
                          f"and each call may plan again; raise the size with "
                          f"torch_gradops.tensornet.set_plan_cache_size(n), or keep the plans (tn.plan) and "
                          f"pass them (plan=)", RuntimeWarning, stacklevel=_caller_level())
        return p

    def info(self) -> Dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "path_searches": self.path_searches,
                "rebuilt": self.rebuilt, "size": len(self._plans), "maxsize": self.maxsize}

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._paths.clear()
            self._dropped.clear()
            self.hits = self.misses = self.path_searches = self.rebuilt = 0
            self._warned = False


PLANS = PlanCache()  # the process-wide plan cache behind contract() and plan()
