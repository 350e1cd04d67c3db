"""Entry points: :func:`contract`, :func:`plan` and :func:`resolve` (arguments -> cached plan)."""
from __future__ import annotations

import numbers
from typing import Callable, Dict, Optional

import torch

from ..graph import as_index
from . import parser, slicer
from .plan import PLANS, ContractionPlan, build_plan

__all__ = ["contract", "plan", "resolve", "plan_cache_info", "set_plan_cache_size", "clear_plan_cache",
           "register_process_group_runner"]


def plan_cache_info() -> Dict[str, int]:
    """Plan-cache counters: ``hits``, ``misses``, ``path_searches`` (path optimizer runs),
    ``rebuilt`` (plans made again after the cache dropped them), ``size`` and ``maxsize``."""
    return PLANS.info()


def set_plan_cache_size(maxsize: int) -> int:
    """Let the in-memory plan cache hold ``maxsize`` plans (default 512; about 40-90 KiB each
    for networks of 36-200 tensors), dropping the least recently used beyond it; returns the
    previous size. A program that contracts more distinct networks than the cache holds (a
    Hamiltonian's terms, say) plans them again on every pass, which a ``RuntimeWarning``
    reports the first time; 0 keeps no plans."""
    n = as_index(maxsize)
    if n is None or n < 0:
        raise ValueError(f"maxsize must be an int >= 0, got {maxsize!r}")
    return PLANS.resize(n)


def clear_plan_cache() -> None:
    """Forget every cached plan and reset the counters."""
    PLANS.clear()


def _freeze(x):
    if isinstance(x, bool):  # apart from 1 and 0, which hash and compare equal to them
        return ("bool", x)
    if isinstance(x, numbers.Real) and not isinstance(x, (bool, int, float)):  # numpy scalars
        return int(x) if isinstance(x, numbers.Integral) else float(x)  # (Dynamo cannot hash them)
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x if parser.is_hashable(x) else ("id", id(x))


def _plan_key(expr, terms, output, shapes, dtype, device, memory_limit, optimize, slicing, max_overhead):
    """The plan cache's key (the on-disk path cache's directory does not change the plan): by
    device type, or by the device itself for a limit in percent of its memory (devices of one
    type may have different memory)."""
    percent = isinstance(memory_limit, str) and memory_limit.strip().endswith("%")
    return (expr if expr is not None else (_freeze(terms), _freeze(output)), tuple(shapes), dtype,
            str(device) if percent else device.type, _freeze(memory_limit), _freeze(optimize), _freeze(slicing),
            max_overhead)


def _get_plan(expr, terms, output, shapes, dtype, device, memory_limit, optimize, slicing, interleaved,
              path_cache=None, max_overhead=1e4) -> ContractionPlan:
    key = _plan_key(expr, terms, output, shapes, dtype, device, memory_limit, optimize, slicing, max_overhead)
    p = PLANS.get(key)
    if p is None:
        p = PLANS.build(key, lambda: build_plan(expr, terms, output, shapes, dtype, device.type, memory_limit,
                                                optimize, slicing, device, interleaved=interleaved,
                                                path_cache=path_cache, max_overhead=max_overhead))
    return p


def plan(expr, *operands_or_shapes, dtype: Optional[torch.dtype] = None, memory_limit=None,
         optimize="auto", slicing=None, device=None, path_cache=None, max_overhead=1e4) -> ContractionPlan:
    """Plan a contraction (cached: the same arguments return the same plan, with no search).

    ``expr``: an einsum string (``"ab,bc->ac"``, implicit output, ``...``; a label is any
    character but ``.,->`` and whitespace: Unicode letters, digits, symbols) followed by
    operands or their shapes; or the interleaved form
    ``plan(a, modes_a, b, modes_b, ..., [out_modes])`` with hashable labels.

    ``memory_limit``: bytes, ``"2GiB"``, ``"50%"`` (of the device's memory). It bounds the
    largest intermediate of one slice (:attr:`ContractionPlan.largest_intermediate`), as
    cotengra's ``target_size`` and cuTensorNet's workspace limit do: modes are sliced (whole,
    or in ranges where that takes fewer slices) until every intermediate fits. The backward
    keeps its extra memory within a small multiple of it by recomputation between checkpoints,
    so that the measured peak extra memory of forward + backward is at most
    ``4 x memory_limit`` + the operands + their gradients (+ the output), for any number of
    slices. (The planner places the checkpoints by a model of the executor's memory,
    :attr:`ContractionPlan.modelled_peak`, kept within 3.5 x ``memory_limit``; where no
    placement can, it slices further, preferring modes in ranges.) The forward alone holds
    less. One plan serves forward and backward.

    ``optimize``: "auto" (opt_einsum's exact or branch-and-bound search up to 8 operands, else a
    seeded cotengra hyper-search with cotengra's slicing, scored by the executor's forward +
    backward cost; deterministic), "greedy" (fast), "optimal", "cotengra" (the hyper-search at
    any size), any opt_einsum path-optimizer name, a cotengra optimizer object, an explicit
    path, or, as opt_einsum takes them, ``True`` ("auto") and ``False`` (the operands left to
    right, no search). ``path_cache``: a directory for an on-disk cache of searched paths (default:
    ``$TORCH_GRADOPS_PATH_CACHE``, else none), so a new process does not search again.
    ``slicing``: a list of modes to slice, or ``{"min_slices": k, "modes": [...]}``; a
    :class:`~.parser.ModeChunks` (``tn.ModeChunks(label, chunks)``, as
    :attr:`ContractionPlan.sliced_modes` lists them) slices its mode in that many ranges, so a
    plan's ``sliced_modes`` and ``path`` give the same plan again.
    ``max_overhead``: refuse (ValueError) a plan whose sliced FLOPs exceed this multiple of the
    same path unsliced, or of opt_einsum's greedy path unsliced where that is cheaper (a path
    found under a tight limit can cost far more unsliced than a good one), with advice; None
    creates it anyway (its slice groups can still be
    contracted one at a time: slice ids are never listed, so even 2^40 slices cost nothing
    until run).
    """
    if isinstance(expr, str):
        shapes, tensors = parser.shapes_of(operands_or_shapes)
        terms, output = parser.parse_string(expr, len(shapes))
        interleaved = False
    else:
        objs, terms, output = parser.split_interleaved((expr,) + operands_or_shapes)
        shapes, tensors = parser.shapes_of(objs)
        expr = None
        interleaved = True
    if tensors:
        parser.check_operands(tensors)
        if dtype is None:
            dtype = parser.promoted_dtype(tensors)
        device = tensors[0].device if device is None else torch.device(device)
    dtype = dtype or torch.get_default_dtype()
    parser.check_dtype(dtype, "dtype")
    device = torch.device(device or "cpu")
    return _get_plan(expr, terms, output, shapes, dtype, device, memory_limit, optimize, slicing, interleaved,
                     path_cache, max_overhead)


def resolve(*args, memory_limit=None, optimize="auto", slicing=None, plan: Optional[ContractionPlan] = None,
            path_cache=None, max_overhead=1e4):
    """``(plan, operands)`` for :func:`contract`'s arguments: the plan (cached) and the operand
    tensors, from an einsum string and operands or from the interleaved form."""
    if not args:
        raise TypeError("contract() needs an expression and operands")
    given_plan = plan is not None  # then checked against the expression passed with it
    if given_plan:
        _check_options_of(plan, memory_limit, optimize, slicing, max_overhead)
    expr = terms = output = None
    if isinstance(args[0], str):
        expr, operands = args[0], args[1:]
        if plan is None:
            parser.check_operands(operands)
            shapes = [tuple(op.shape) for op in operands]
            dtype = parser.promoted_dtype(operands)
            key = _plan_key(expr, None, None, shapes, dtype, operands[0].device, memory_limit, optimize,
                            slicing, max_overhead)
            plan = PLANS.get(key)  # fast path: no parsing on a cache hit
            if plan is None:
                terms, output = parser.parse_string(expr, len(shapes))
                plan = _get_plan(expr, terms, output, shapes, dtype, operands[0].device, memory_limit, optimize,
                                 slicing, False, path_cache, max_overhead)
    else:
        operands, terms, output = parser.split_interleaved(args)
        if plan is None:
            parser.check_operands(operands)
            plan = _get_plan(None, terms, output, [tuple(op.shape) for op in operands], parser.promoted_dtype(operands),
                             operands[0].device, memory_limit, optimize, slicing, True, path_cache, max_overhead)
    if not isinstance(plan, ContractionPlan):
        raise TypeError(f"plan must be a ContractionPlan, got {type(plan).__name__}")
    if given_plan:
        _check_plan_matches(plan, expr, terms, output, operands)
    return plan, operands


def _check_options_of(plan, memory_limit, optimize, slicing, max_overhead) -> None:
    """A plan decides the memory limit, path and slicing: another value passed with it would be
    ignored silently, so it is an error (the plan's own values, and no slicing, are not).
    ``path_cache`` only serves a search, which a given plan skips."""
    if not isinstance(plan, ContractionPlan):
        return  # resolve() names the type
    fixed = []
    if memory_limit is not None and slicer.parse_memory_limit(memory_limit, plan.device_type) != plan.memory_limit:
        fixed.append("memory_limit")
    if not (isinstance(optimize, str) and optimize == "auto"):
        fixed.append("optimize")
    if slicing is not None and not (isinstance(slicing, (list, tuple)) and len(slicing) == 0):
        fixed.append("slicing")
    if not (isinstance(max_overhead, (int, float)) and max_overhead == 1e4):
        fixed.append("max_overhead")
    if fixed:
        raise ValueError(f"plan: {', '.join(fixed)} cannot be given with a plan, which fixes them; pass them to "
                         f"tn.plan() instead")


def _check_plan_matches(plan: ContractionPlan, expr, terms, output, operands) -> None:
    """A plan passed to :func:`contract` must be one for the expression passed with it (an
    einsum string ``expr``, else the interleaved ``terms -> output``), under any labels: the
    plan alone decides the contraction, so another expression would be ignored silently. An
    einsum string that matched once is remembered (no parsing again; not while Dynamo traces,
    which would guard on the memo and recompile once it changed: a trace checks once anyway)."""
    compiling = torch.compiler.is_compiling()
    if expr is not None and not compiling and expr in plan.matching_exprs:
        return
    parser.check_operands(operands)
    if len(operands) != len(plan.shapes):
        raise ValueError(f"the plan is for {len(plan.shapes)} operand(s), got {len(operands)}")
    if expr is not None:
        terms, output = parser.parse_string(expr, len(operands))
    terms, output, _, _ = parser.normalize_labels(terms, output, [tuple(op.shape) for op in operands])
    if parser.canonical_network(terms, output) != parser.canonical_network(plan.inputs, plan.output):
        given = expr if expr is not None else parser.describe(terms, output)
        raise ValueError(f"plan: the plan was made for {plan.expr!r}, not for the expression given with it, "
                         f"{given!r}; pass the plan's own expression, or no plan")
    if expr is not None and not compiling:
        plan.matching_exprs.add(expr)


# The runner for contract(process_group=...): torch_gradops.distributed registers it on import
# (distributed uses tensornet, never the reverse).
_process_group_runner: Optional[Callable] = None


def register_process_group_runner(runner: Callable) -> None:
    """Set what ``contract(..., process_group=g)`` calls: ``runner(plan, operands, g, progress=)``."""
    global _process_group_runner
    _process_group_runner = runner


def contract(*args, memory_limit=None, optimize="auto", slicing=None, slices=None,
             plan: Optional[ContractionPlan] = None, progress: bool = False, process_group=None,
             path_cache=None, max_overhead=1e4, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Contract a tensor network, differentiably.

    ``contract("ab,bc->ac", a, b)`` or ``contract(a, [0, 1], b, [1, 2], [0, 2])``. Options as
    in :func:`plan`; ``slices``: a slice group (None = all slices; a range or list of slice
    ids: their partial sum, or their output blocks for sliced output modes); ``plan``: use this
    plan instead of looking one up; ``progress``: a tqdm bar over slices; ``process_group``: a
    ``torch.distributed`` group whose ranks share the slices (see
    :func:`torch_gradops.distributed.contract`; every rank gets the full result); ``out``: a
    tensor of the result's shape to write the result into and return, as opt_einsum's
    ``contract(out=)`` takes it (the result's dtype or, for float16/bfloat16 operands, float32,
    which takes the sum over slices unrounded). Like torch's ``out=`` arguments it is not
    differentiable: refused for an ``out`` that requires grad, and for operands that do under
    grad mode.
    Returns a tensor with one dimension per output mode (0-dim for a scalar).

    Under ``torch.autocast`` the float16/bfloat16/float32 operands are cast to autocast's dtype
    first, as torch.einsum's are (:func:`~.parser.autocast_operands`), and the result has that
    dtype; not with ``out``, which autocast leaves alone in torch's ops too. Sums over slices run
    in float32 for float16/bfloat16 operands.
    """
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor or None, got {type(out).__name__}")
        if process_group is not None:
            raise ValueError("out and process_group cannot be combined: every rank gets the full result "
                             "(copy it into out)")
        # before any planning: the operands are the tensors among args in either input form
        if out.requires_grad or torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise RuntimeError("contract(out=...) is not differentiable (as torch's out= arguments are not), but "
                               + ("out requires grad" if out.requires_grad else "an operand requires grad")
                               + ": drop out= to get a differentiable result, or run under torch.no_grad() "
                                 "with an out that does not require grad")
    else:
        args = parser.autocast_operands(args)
    plan, operands = resolve(*args, memory_limit=memory_limit, optimize=optimize, slicing=slicing, plan=plan,
                             path_cache=path_cache, max_overhead=max_overhead)
    if process_group is not None:
        if slices is not None:
            raise ValueError("slices and process_group cannot be combined: the group splits the slices")
        if _process_group_runner is None:
            raise RuntimeError("contract(process_group=...) needs torch_gradops.distributed; import it first")
        return _process_group_runner(plan, operands, process_group, progress=progress)
    return plan.contract(*operands, slices=slices, out=out, progress=progress)
