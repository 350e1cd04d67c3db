"""Sliced tensor-network contraction shared by the ranks of a process group.

Each rank contracts its slice group; one ``all_reduce`` (sum) combines the partial results,
which covers both summed sliced modes and sliced output modes (a slice group's result holds its
output blocks and zeros elsewhere). In backward each rank computes the gradients of its slices
(one slice's intermediates at a time) and one ``all_reduce`` per dtype sums them (float16 and
bfloat16 results and gradients travel in float32 and are rounded once, after the sum), so
``loss.backward()`` on every rank gives every rank the full gradient, provided every rank
backpropagates the same output gradient (as when each computes the same loss from the full
result). Ranks that pass different operand values or output gradients (say, operands drawn
from an unseeded generator on each rank) would sum parts of different contractions: both are
compared across ranks by a fingerprint (:func:`fingerprints`) and refused with an error. With
no process group initialised it is a plain local contraction.
"""
from __future__ import annotations

import functools
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._transforms import is_legacy_batched, not_compiled
from .._units import format_bytes
from ..tensornet import parser, resolve
from ..tensornet.program import accumulate_dtype

__all__ = ["contract", "contract_plan", "ContractStats", "DistributedContractFunction", "split_by_cost", "rank_slices",
           "fingerprints", "same_fingerprint"]

FINGERPRINT_SAMPLES = 16  # evenly spaced elements of each tensor in its fingerprint
FINGERPRINT_WHOLE = 64    # a tensor of at most this many real numbers is its fingerprint
FINGERPRINT_RTOL = 1e-9   # float64 sums of equal tensors differ only by summation order (threads, devices)


def split_by_cost(costs: Sequence[float], world_size: int) -> List[List[int]]:
    """Split items ``0..len(costs)-1`` into ``world_size`` groups of near-equal total cost.

    Greedy longest-processing-time: items by decreasing cost, each to the currently lightest
    rank (ties to the lowest rank), so every rank computes the same split. Groups keep the
    items in increasing order; a rank may get none when there are fewer items than ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    bad = [i for i, c in enumerate(costs) if not (math.isfinite(float(c)) and float(c) >= 0)]
    if bad:
        raise ValueError(f"costs must be finite and >= 0, got {costs[bad[0]]!r} at position {bad[0]}")
    loads = [0.0] * world_size
    groups: List[List[int]] = [[] for _ in range(world_size)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        groups[rank].append(item)
        loads[rank] += float(costs[item])
    return [sorted(g) for g in groups]


@dataclass
class ContractStats:
    """What this rank did in a distributed contraction: filled in by the forward and added to
    by the backward when passed as ``stats=`` (seconds computing and communicating, slices). A
    contraction that runs locally (no process group, or a group of one) records its forward:
    every slice, no communication."""
    compute_s: float = 0.0
    comm_s: float = 0.0
    slices: int = 0


def rank_slices(num_slices: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s slice group: a contiguous range of slice ids, the ranges of all ranks
    covering ``0 .. num_slices-1`` with sizes differing by at most one (slices of a plan cost
    the same). A range, never a list: a plan may have 2^40 slices."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if num_slices < 0:
        raise ValueError(f"num_slices must be >= 0, got {num_slices}")
    return range(num_slices * rank // world_size, num_slices * (rank + 1) // world_size)


def _rank_slices(plan, group) -> range:
    """This rank's slice group."""
    return rank_slices(plan.num_slices, dist.get_world_size(group), dist.get_rank(group))


def _position_weights(k: int, multiplier: int, device) -> torch.Tensor:
    """``k`` weights in [0, 1), a fixed scramble of the positions (Knuth's multiplicative hash,
    exact in int64 on every device): neighbouring positions get unrelated weights, so that
    elements swapped or shifted by a few places change a weighted sum by about their size."""
    return (torch.arange(k, dtype=torch.int64, device=device) * multiplier % 2 ** 32).to(torch.float64) / 2 ** 32


def _weighted_sums(x: torch.Tensor) -> torch.Tensor:
    """Two position-dependent float64 sums of the flat ``x`` (so that elements moved, say two
    swapped, change the fingerprint, which plain sums do not see): ``x`` as a ``rows x cols``
    block (cols about sqrt(numel), the tail after it in a last row), the row sums weighted by
    :func:`_position_weights` of their row, and the column sums by those of their column: each
    at most the sum of absolute values, so the same tolerance applies. Two elements in
    different rows or columns change at least one of them."""
    n = x.numel()
    cols = max(1, math.isqrt(n))
    rows = n // cols
    main, tail = x[:rows * cols].view(rows, cols), x[rows * cols:]  # the tail: row `rows`
    row_w = _position_weights(rows + 1, 2654435761, x.device)
    col_w = _position_weights(cols, 2246822519, x.device)
    by_row = main.sum(1, dtype=torch.float64) @ row_w[:rows] + tail.sum(dtype=torch.float64) * row_w[rows]
    by_col = main.sum(0, dtype=torch.float64) @ col_w + tail.to(torch.float64) @ col_w[:tail.numel()]
    return torch.stack([by_row, by_col])


def fingerprints(values: Sequence[Any]) -> List[Tuple]:
    """A few numbers per tensor that tell tensors apart, cheap next to a contraction (a few
    reductions over a large tensor, one transfer to the host per device and dtype): shape,
    dtype, the float64 sum, the sums of absolute values and of squares, two position-weighted
    sums (:func:`_weighted_sums`: elements moved or swapped) and :data:`FINGERPRINT_SAMPLES`
    evenly spaced elements, or every element of a tensor of at most :data:`FINGERPRINT_WHOLE`
    (complex tensors as their real and imaginary parts). A meta tensor (no values): its shape
    and dtype. Anything but a tensor: its ``repr``. Compared with :func:`same_fingerprint`.

    Tensors that differ by less than the sums' tolerance (:data:`FINGERPRINT_RTOL` of the sum
    of absolute values, which summation order needs) in elements not sampled pass: one element
    of 10^6 changed by a few 10^-4 of a typical element goes unseen, as does its effect on the
    result, of the same relative size."""
    out: List[Any] = []
    small = {}    # (device, dtype) -> [(position in out, tensor)]: sent whole, one transfer per group
    summary = {}  # device -> [(position in out, numbers on the device)]
    with torch.no_grad():
        for t in values:
            if not isinstance(t, torch.Tensor):
                out.append(("value", repr(t)))
                continue
            x = t.detach().resolve_conj()  # (view_as_real refuses a conjugate view)
            out.append((tuple(x.shape), str(x.dtype)))
            if x.numel() == 0 or x.device.type == "meta":
                continue
            if x.numel() * (2 if x.is_complex() else 1) <= FINGERPRINT_WHOLE:  # most of a circuit's gates
                out[-1] += ("elements",)
                small.setdefault((x.device, x.dtype), []).append((len(out) - 1, x.reshape(-1)))
                continue
            out[-1] += ("summary",)
            x = (torch.view_as_real(x) if x.is_complex() else x).reshape(-1)
            if not x.is_floating_point():
                x = x.to(torch.float64)
            picks = torch.linspace(0, x.numel() - 1, FINGERPRINT_SAMPLES, device=x.device).round().long()
            numbers = torch.cat([torch.stack([x.sum(dtype=torch.float64),
                                              torch.linalg.vector_norm(x, 1, dtype=torch.float64),
                                              torch.linalg.vector_norm(x, 2, dtype=torch.float64)]),
                                 _weighted_sums(x), x[picks].to(torch.float64)])
            summary.setdefault(x.device, []).append((len(out) - 1, numbers))
        # (positions in out with their counts of numbers, the numbers on one device)
        batches = [([(pos, n.numel()) for pos, n in items], torch.cat([n for _, n in items]))
                   for items in summary.values()]
        for items in small.values():
            flat = torch.cat([x for _, x in items])
            flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
            width = 2 if items[0][1].is_complex() else 1
            batches.append(([(pos, x.numel() * width) for pos, x in items], flat.to(torch.float64)))
        for counts, flat in batches:
            flat, offset = flat.tolist(), 0
            for position, count in counts:
                out[position] += tuple(flat[offset:offset + count])
                offset += count
    return out


def same_fingerprint(a: Tuple, b: Tuple) -> bool:
    """Whether two fingerprints (:func:`fingerprints`) can come from the same tensor: the same
    shape, dtype and sent elements (NaN matching NaN), sums within :data:`FINGERPRINT_RTOL` of
    the sum of absolute values (summation order differs between thread counts and devices)."""
    if len(a) != len(b) or a[:3] != b[:3] or a[0] == "value" or len(a) == 2:  # the latter two: exact (empty)
        return a == b
    exact = a[2] == "elements"
    scale = max(abs(a[4]), abs(b[4]), 1e-300) if not exact else 0.0  # the sums of absolute values
    for k, (u, v) in enumerate(zip(a[3:], b[3:])):  # sum, abs sum, norm, 2 weighted sums, samples
        if u == v or (math.isnan(u) and math.isnan(v)):
            continue
        if exact or k >= 5 or not abs(u - v) <= FINGERPRINT_RTOL * (max(abs(u), abs(v)) if k == 2 else scale):
            return False
    return True


def _differing_ranks(every: List[List[Tuple]]) -> List[int]:
    """Ranks whose fingerprints (one list per rank) differ from rank 0's."""
    return [r for r, other in enumerate(every)
            if len(other) != len(every[0]) or not all(same_fingerprint(u, v) for u, v in zip(other, every[0]))]


def _in_step(every: List[Tuple[str, Any]], phase: str) -> List[Any]:
    """The payloads of a check's ``all_gather_object`` (``(phase, payload)`` per rank), after
    making sure every rank is in the same check: a rank in a forward's plan check while another
    is in a backward's gradient check (say, only rank 0 calls ``backward``) would otherwise read
    the other check's payload."""
    phases = [e[0] if isinstance(e, tuple) and len(e) == 2 else None for e in every]
    if any(p != phase for p in phases):
        where = {p: [r for r, q in enumerate(phases) if q == p] for p in dict.fromkeys(phases)}
        said = "; ".join(f"rank(s) {r} in a {p}" for p, r in where.items())
        raise RuntimeError(
            f"ranks are out of step in distributed contractions: {said}; every rank must run the same "
            "contractions and backward passes in the same order (call backward on the same loss on every "
            "rank, not on rank 0 only)")
    return [e[1] for e in every]


# Per process group, the distributed contractions run on it so far: every rank numbers the same
# contraction alike (each forward is checked in step first), so a backward's number tells which
# contraction each rank is backpropagating through.
_CONTRACTIONS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _next_contraction(group) -> int:
    n = _CONTRACTIONS.get(group, 0)
    _CONTRACTIONS[group] = n + 1
    return n


def _check_same_output_grad(grad_out: torch.Tensor, group, number: int) -> None:
    """Every rank must backpropagate through the same contraction (``number``: its place among
    the group's contractions) with the same output gradient (each rank's slices' gradients are
    summed across ranks, so different ones would mix gradients of different losses)."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, ("backward", (number, fingerprints([grad_out]))), group=group)
    every = _in_step(every, "backward")
    numbers = [e[0] for e in every]
    if any(n != numbers[0] for n in numbers):
        said = ", ".join(f"rank {r}: #{n}" for r, n in enumerate(numbers))
        raise RuntimeError(
            f"ranks are out of step in distributed contractions: they backpropagate through different "
            f"contractions of the group ({said}, numbered in the order they ran); every rank must call backward "
            "on the same losses in the same order (a loop over a set or dict whose order differs between "
            "processes does not)")
    ranks = _differing_ranks([e[1] for e in every])
    if ranks:
        raise RuntimeError(
            f"ranks backpropagate different output gradients: rank(s) {ranks} differ from rank 0's; every rank "
            "must backpropagate the same gradient of the full result (compute the same loss from it on every "
            "rank, not a loss of rank-local data)")


def _check_same_plan(plan, operands, group) -> None:
    """Every rank must contract the same network with the same path and slicing, operands of
    the same shapes and dtype, and want the same gradients, or the partial sums do not add up
    (or the collectives get buffers of different sizes, which ends a gloo rank and hangs NCCL).
    Randomised optimisers (cotengra's hyper-search) can differ per rank: refuse that too, and
    operands whose values differ (:func:`fingerprints`; checked last, so a different network is
    reported as such)."""
    net = plan.network
    wants = [bool(torch.is_grad_enabled() and isinstance(op, torch.Tensor) and op.requires_grad) for op in operands]
    mine = {
        "network (expression or operand shapes)": (net.inputs, net.output, sorted(net.sizes.items()), plan.shapes),
        "dtype": str(parser.promoted_dtype(operands)),
        "operands requiring gradients": wants,
        "path or sliced modes": (list(plan.path), list(plan.sliced_modes), plan.num_slices),
    }
    values = fingerprints(operands)
    every = [None] * dist.get_world_size(group)
    # (the memory limits travel along only to explain a difference: equal plans under
    # different limits add up)
    payload = (mine, values, plan.memory_limit)
    dist.all_gather_object(every, ("forward", payload), group=group)  # all ranks see all: all raise together
    every = _in_step(every, "forward")
    every, every_values, limits = [e[0] for e in every], [e[1] for e in every], [e[2] for e in every]
    for what in mine:
        if any(other[what] != every[0][what] for other in every):
            ranks = [r for r, other in enumerate(every) if other[what] != every[0][what]]
            unequal = [r for r, limit in enumerate(limits) if limit != limits[0]]
            cause = (f" (the plans were made under different memory limits: rank(s) {unequal} passed "
                     f"{[_limit_text(limits[r]) for r in unequal]}, rank 0 {_limit_text(limits[0])})" if unequal else "")
            raise RuntimeError(
                f"ranks contract different things: the {what} of rank(s) {ranks} differ from rank 0's{cause}; "
                "every rank must pass the same expression, operand shapes and dtype, and the same requires_grad "
                "flags, and plan with the same arguments (memory_limit too; the default search is seeded and "
                "deterministic), or pass an explicit path and slicing=[modes], or the same plan=")
    ranks = _differing_ranks(every_values)
    if ranks:
        which = sorted({k for r in ranks for k, (u, v) in enumerate(zip(every_values[r], every_values[0]))
                        if not same_fingerprint(u, v)})
        raise RuntimeError(
            f"ranks contract different things: the operand values of rank(s) {ranks} differ from rank 0's "
            f"(operand(s) {which}); every rank must pass the same operands: seed random operands the same on "
            "every rank, or broadcast them from rank 0 (torch.distributed.broadcast)")


def _limit_text(limit: Optional[int]) -> str:
    return "no memory_limit" if limit is None else f"memory_limit={format_bytes(limit)}"


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


class DistributedContractFunction(torch.autograd.Function):
    """``apply(plan, group, slices, stats, progress, *operands)``: this rank's slice group (a
    tqdm bar over it with ``progress``), then a sum ``all_reduce``; ``backward``: this rank's
    slices' gradients, then a sum ``all_reduce``."""

    @staticmethod
    def forward(ctx, plan, group, slices, stats, progress, *operands):
        t0 = time.perf_counter()
        cast = parser.autocast_operands(operands)
        dtype = parser.promoted_dtype(cast)
        with torch.no_grad():
            # float16/bfloat16: this rank's slices summed in float32 and travelling unrounded, so
            # that partial sums cancelling across ranks lose no more than local slices do
            part = torch.empty(plan.output_shape, dtype=accumulate_dtype(dtype), device=cast[0].device)
            plan.contract(*cast, slices=slices, out=part, progress=progress)
        _sync(part)
        t1 = time.perf_counter()
        dist.all_reduce(part, group=group)
        _sync(part)
        part = part.to(dtype)
        if stats is not None:
            stats.compute_s, stats.comm_s, stats.slices = t1 - t0, time.perf_counter() - t1, len(slices)
        # the group by weak reference: an autograd graph still alive at exit (a script's last
        # output) kept it, and with it gloo's worker threads, past destroy_process_group into
        # interpreter shutdown, where a worker releasing its last work's tensors aborts the
        # process ("terminate called without an active exception", about 1 run in 10)
        ctx.plan, ctx.group, ctx.slices, ctx.stats = plan, weakref.ref(group), slices, stats
        ctx.number = _next_contraction(group)
        ctx.save_for_backward(*operands)
        return part

    @staticmethod
    def backward(ctx, grad_out):
        group = ctx.group()
        if group is None:
            raise RuntimeError("the process group of this distributed contraction was destroyed before its backward; "
                               "backpropagate before torch.distributed.destroy_process_group()")
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "create_graph=True through a distributed contraction is not supported; contract "
                "locally (no process_group) for higher-order gradients")
        if is_legacy_batched(grad_out) or torch._C._functorch.is_functorch_wrapped_tensor(grad_out):
            raise NotImplementedError(
                "batched gradients (torch.autograd.grad(..., is_grads_batched=True), jacobian(vectorize=True)) "
                "through a distributed contraction are not supported; contract locally (no process_group), "
                "or take the output gradients one at a time")
        t_check = time.perf_counter()
        _check_same_output_grad(grad_out, group, ctx.number)
        operands = ctx.saved_tensors
        want = ctx.needs_input_grad[5:]
        t0 = time.perf_counter()
        # float16/bfloat16 gradients summed (over slices and ranks) in float32, rounded once
        grads = [torch.zeros_like(op, dtype=accumulate_dtype(op.dtype)) if w else None
                 for op, w in zip(operands, want)]
        if ctx.slices:
            ctx.plan.gradients(*operands, output_grad=grad_out.contiguous(), slices=ctx.slices,
                               grads=grads, accumulate=True)
        needed = [g for g in grads if g is not None]
        if needed:
            _sync(needed[0])
        t1 = time.perf_counter()
        # One collective per dtype: the gradients travel as one flat buffer.
        for dtype in dict.fromkeys(g.dtype for g in needed):
            group_grads = [g for g in needed if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group_grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in group_grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if needed:
            _sync(needed[0])
        if ctx.stats is not None:
            ctx.stats.compute_s += t1 - t0
            ctx.stats.comm_s += time.perf_counter() - t1 + (t0 - t_check)  # the check is communication too
        return (None, None, None, None, None, *(g if g is None else g.to(op.dtype) for g, op in zip(grads, operands)))

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "forward-mode AD (dual tensors, torch.func.jvp) through a distributed contraction is not supported; "
            "contract locally (no process_group) for forward mode")


def contract_plan(plan, operands, process_group=None, progress: bool = False,
                  stats: Optional[ContractStats] = None) -> torch.Tensor:
    """Contract ``operands`` with ``plan``, the slices shared by the ranks of ``process_group``
    (default: the whole world when ``torch.distributed`` is initialised; otherwise local).
    Every rank gets the full result; gradients flow as described in the module docstring.
    ``stats``: a :class:`ContractStats` to fill in (this rank's compute and communication time)."""
    if (dist.is_available() and dist.is_initialized() and not isinstance(process_group, (torch.Tensor, list, tuple))
            and process_group == dist.GroupMember.NON_GROUP_MEMBER):  # what new_group gives a rank outside it
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process_group")
    if process_group is not None and not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup (dist.new_group(...)) or None, "
                        f"got {type(process_group).__name__}")
    # under torch.autocast, cast before the contraction (as tensornet.contract does): its backward
    # then runs in the cast dtype and autograd carries the gradients back through the casts
    operands = parser.autocast_operands(tuple(operands))
    meta = any(isinstance(op, torch.Tensor) and op.device.type == "meta" for op in operands)
    if not (dist.is_available() and dist.is_initialized()) or meta:
        # local (meta operands have no values: their result's shape is the same on every rank)
        return _contract_local(plan, operands, progress, stats)
    return _contract_shared(plan, operands, process_group if process_group is not None else dist.group.WORLD,
                            progress, stats)


def _contract_local(plan, operands, progress, stats) -> torch.Tensor:
    """This process runs every slice."""
    t0 = time.perf_counter()
    out = plan.contract(*operands, progress=progress)
    if stats is not None:
        stats.compute_s, stats.comm_s, stats.slices = time.perf_counter() - t0, 0.0, plan.num_slices
    return out


# The collectives' checks are Python (all_gather_object): Dynamo runs the shared contraction eagerly.
@functools.partial(not_compiled, reason=(
    "a distributed contraction compares plans and operands across ranks in Python collectives, which "
    "torch.compile cannot trace: it runs eagerly (a graph break), so compile without fullgraph=True"))
def _contract_shared(plan, operands, group, progress, stats) -> torch.Tensor:
    """The slices shared by the ranks of ``group``."""
    if dist.get_rank(group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of process_group")
    if dist.get_world_size(group) == 1:
        return _contract_local(plan, operands, progress, stats)
    if any(isinstance(op, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(op) for op in operands):
        raise NotImplementedError(
            "torch.func transforms (grad, jvp, vmap, ...) through a distributed contraction are not supported; "
            "contract locally (no process_group) under torch.func")
    _check_same_plan(plan, operands, group)
    slices = _rank_slices(plan, group)
    return DistributedContractFunction.apply(plan, group, slices, stats, bool(progress), *operands)


def contract(*args, process_group=None, memory_limit=None, optimize="auto", slicing=None, plan=None,
             progress: bool = False, stats: Optional[ContractStats] = None, path_cache=None,
             max_overhead=1e4) -> torch.Tensor:
    """:func:`torch_gradops.tensornet.contract` with the slices shared by the ranks of
    ``process_group`` (default: the world group when initialised; a plain local contraction
    when ``torch.distributed`` is not initialised); ``stats`` as in :func:`contract_plan`."""
    plan, operands = resolve(*args, memory_limit=memory_limit, optimize=optimize, slicing=slicing, plan=plan,
                             path_cache=path_cache, max_overhead=max_overhead)
    return contract_plan(plan, operands, process_group, progress=progress, stats=stats)
