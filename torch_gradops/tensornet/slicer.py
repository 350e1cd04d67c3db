"""Slicing: memory limits, the memory model of one slice, choosing sliced modes, and slice ids.

Slicing a mode fixes its index: the network splits into ``extent`` independent slices whose
results add up (or, for an output mode, fill their own blocks of the output).

``memory_limit`` bounds the largest intermediate of one slice (as cotengra's ``target_size``):
:func:`choose_sliced` slices modes until every step result fits. The backward then keeps its
extra memory within :data:`BACKWARD_FACTOR` x ``memory_limit`` by recomputation between
checkpoints: :func:`memory_model` models what the executor holds for one slice's forward +
backward, and :func:`place_checkpoints` places the fewest-recomputation checkpoints that keep
it under the cap. Where no placement can, :func:`split_to_fit` slices further, preferring
modes taken in chunks (a mode of extent 16 in 2 ranges of 8: twice the slices, not 16 times)
and the least extra work per memory saved. :class:`Slices` turns slice ids into the
executor's slice tables, lazily, in chunks.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .. import library
from ..graph import as_index

__all__ = ["BACKWARD_FACTOR", "MODEL_CAP", "parse_memory_limit", "step_table", "StepCosts", "step_costs", "mode_steps",
           "memory_model", "step_transients", "live_floor", "place_checkpoints", "choose_sliced", "chunk_sliced", "split_to_fit", "chunked_sizes",
           "slicing_work", "STEP_OVERHEAD_MACS", "WRITE_MACS", "MAX_SLICES", "Slices"]

# The measured contract: forward + backward of a plan made with memory_limit L holds at most
# BACKWARD_FACTOR * L beyond the operands, their gradients and the output, whatever the number
# of slices (tests/test_tensornet.py measures it). The planner keeps its model of that memory
# under MODEL_CAP * L, leaving the rest for what the model does not see (allocator-level
# temporaries of ATen ops).
BACKWARD_FACTOR = 4
MODEL_CAP = 3.5
# The most slices a plan can have: the executor numbers slices (and sizes them) in int64.
MAX_SLICES = 1 << 62


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
    if isinstance(limit, numbers.Real):  # int, float, numpy scalars
        try:
            finite = math.isfinite(limit)
        except OverflowError:  # an int past a float's range
            raise ValueError("memory_limit is 2^63 bytes or more; pass None for no limit") from None
        if not (finite and limit > 0):
            raise ValueError(f"memory_limit must be a positive, finite number of bytes, got {limit!r}")
        return _within_int64(int(limit), limit)
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
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"memory_limit must be positive and finite, got {limit!r}")
    return _within_int64(int(value * _UNITS[unit]), limit)


def _within_int64(nbytes: int, limit) -> int:
    if nbytes >= 1 << 63:
        raise ValueError(f"memory_limit {limit!r} is 2^63 bytes or more; pass None for no limit")
    return nbytes


# ---------------------------------------------------------------------------- steps
def step_table(inputs, output, path):
    """Per pairwise step of ``path``: (frozenset of modes involved, frozenset of result modes,
    the two operands' mode sets, the steps that produced them or -1 for operands), with
    hyperedges kept while any remaining operand or the output needs them. A tuple, memoised:
    the planner, the plan and the search's budget ask for the same path's table."""
    return _step_table(tuple(map(tuple, inputs)), tuple(output), tuple(map(tuple, path)))


@functools.lru_cache(maxsize=32)
def _step_table(inputs, output, path):
    count: Dict[int, int] = {}
    for t in list(inputs) + [output]:
        for m in t:
            count[m] = count.get(m, 0) + 1
    cur = [frozenset(m for m in t if count[m] != 1) for t in inputs]  # single-use: summed first
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
    return tuple(steps)


class StepCosts:
    """Per step of one slice (``sliced`` modes removed), in elements: ``macs`` (multiply-adds),
    ``result`` (the step's result), ``inputs`` (its two operands' sizes) and ``from_step``
    (the steps that made them, -1 for operands), ``consumer`` (the step that reads the result;
    ``n`` for the last one)."""
    __slots__ = ("macs", "result", "inputs", "from_step", "consumer")

    def __init__(self, steps, sizes, sliced):
        ext = {m: 1 if m in sliced else e for m, e in sizes.items()}
        prod = math.prod
        n = len(steps)
        self.macs = [prod([ext[m] for m in allm]) for allm, _, _, _ in steps]
        self.result = [prod([ext[m] for m in res]) for _, res, _, _ in steps]
        self.inputs = [(prod([ext[m] for m in a]), prod([ext[m] for m in b])) for _, _, (a, b), _ in steps]
        self.from_step = [tuple(prods) for _, _, _, prods in steps]
        self.consumer = [n] * n
        for j, prods in enumerate(self.from_step):
            for p in prods:
                if p >= 0:
                    self.consumer[p] = j

    def rescaled(self, where: Tuple[Tuple[int, ...], ...], old: int, new: int) -> "StepCosts":
        """These costs with one mode's extent ``old`` -> ``new`` (1: sliced), where ``where`` is
        :func:`mode_steps`' entry for that mode: what a fresh table computes, in the time of the
        steps that mode is in (the slicer tries every candidate mode this way)."""
        in_all, in_res, in_a, in_b = where
        c = StepCosts.__new__(StepCosts)
        c.macs, c.result, c.inputs = list(self.macs), list(self.result), list(self.inputs)
        c.from_step, c.consumer = self.from_step, self.consumer
        for j in in_all:
            c.macs[j] = c.macs[j] // old * new
        for j in in_res:
            c.result[j] = c.result[j] // old * new
        for j in in_a:
            a, b = c.inputs[j]
            c.inputs[j] = (a // old * new, b)
        for j in in_b:
            a, b = c.inputs[j]
            c.inputs[j] = (a, b // old * new)
        return c

    @property
    def largest(self) -> int:
        return max(self.result, default=1)

    def flops(self) -> int:
        return sum(self.macs)


def step_costs(steps, sizes, sliced) -> StepCosts:
    return StepCosts(steps, sizes, set(sliced))


def mode_steps(steps) -> Dict[int, Tuple[Tuple[int, ...], ...]]:
    """Per mode, the steps it is in: ``(involved, in the result, in operand a, in operand b)``,
    for :meth:`StepCosts.rescaled`."""
    out: Dict[int, Tuple[List[int], ...]] = {}
    for j, (allm, res, (a, b), _) in enumerate(steps):
        for m in allm:
            out.setdefault(m, ([], [], [], []))[0].append(j)
        for k, group in ((1, res), (2, a), (3, b)):
            for m in group:
                out[m][k].append(j)
    return {m: tuple(map(tuple, v)) for m, v in out.items()}


# ---------------------------------------------------------------------------- memory model
def step_transients(costs: StepCosts, copies=None, complex_=False) -> List[float]:
    """Per step, what it holds briefly beyond the slice's intermediates: in the forward, the
    copies of intermediate operands it lays out for the GEMM (the original is freed after the
    step); in the backward, the gradient of the smaller operand (the larger one is written over
    its own operand), a contiguous copy of the result's gradient when its reader copied the
    result, and for complex dtypes a conjugated copy of one operand. (C++:
    ``csrc/contract_memory.cpp``, as the rest of the model.)"""
    return library._C.step_transients(costs.inputs, costs.result, copies, bool(complex_))


def memory_model(costs: StepCosts, checkpoints: Sequence[int] = (), copies=None, complex_=False,
                 trans: Optional[List[float]] = None) -> int:
    """Elements that one slice's forward + backward holds at most beyond the operands (and
    copies of their slices), the operands' gradient buffers and the output, with a backward
    CHECKPOINT before each step in ``checkpoints``: the model of the executor
    (``csrc/contract.cpp``).

    The executor runs the forward to the last checkpoint keeping at each checkpoint the
    intermediates of earlier segments that its own segment reads, then from the last segment to
    the first recomputes the segment keeping its GEMM operands and sweeps back through it,
    writing each operand's gradient over the operand (over the copy where the step copied it
    into its GEMM layout: only the reading segment's checkpoint keeps the original, which the
    copy replaces). So an intermediate's memory lives from its creation to the backward of the
    step that made it, and while segment ``s`` is processed the executor holds every
    intermediate of ``s``, the intermediates of earlier segments that later segments read
    (checkpointed), and one step's transients (:func:`step_transients`). A step's transients
    coexist only with the segment's intermediates up to its own: in the recomputation the
    later ones are not made yet, and in the reverse sweep their memory is freed once their
    own step's gradients are done. ``copies``: per step (the steps whose results it copies,
    whether its result is copied by its reader), from the compiler; None: no copies.
    ``trans``: :func:`step_transients` when the caller has them. Counted in C++
    (``csrc/contract_memory.cpp``) in doubles: exact below 2^53 elements."""
    if not costs.result:
        return 0
    if trans is None:
        trans = step_transients(costs, copies, complex_)
    return round(library._C.checkpointed_peak(costs.result, costs.consumer, trans, list(checkpoints)))


def live_floor(costs: StepCosts, copies=None, complex_=False) -> int:
    """Elements that any backward of one slice holds at some point, however much it recomputes:
    the most the forward holds live at once (every result made earlier and read later) with a
    step's own result and transients. The backward holds the gradients of that same set, so a
    slicing whose floor is over the cap cannot be fitted by checkpoints (a lower bound of
    :func:`memory_model` for every placement)."""
    if not costs.result:
        return 0
    trans = step_transients(costs, copies, complex_)
    consumed = [0] * (len(costs.result) + 1)
    for j, r in enumerate(costs.result):
        consumed[costs.consumer[j]] += r
    live = floor = 0
    for j, r in enumerate(costs.result):
        floor = max(floor, live + r + trans[j])
        live += r - consumed[j]
    return round(floor)


def place_checkpoints(costs: StepCosts, cap: Optional[float], copies=None,
                      complex_=False) -> Tuple[int, List[int], int]:
    """``(modelled peak, checkpoints, recomputed multiply-adds)``: backward checkpoints that
    keep :func:`memory_model` within ``cap`` elements with the least recomputation, or the
    lowest-peak placement found when none fits (the caller then slices more).

    The executor recomputes, once, every step before the last checkpoint; so the cost depends
    only on the last checkpoint ``b``, which goes as early as the memory allows. Whether some
    placement of the earlier checkpoints fits with a last checkpoint at ``b`` is decided
    exactly: a pass over the boundaries keeps, for each boundary, the least memory checkpointed
    there (made earlier and read at or after it) by any placement before it whose segments all
    fit; a later segment's memory grows with that and with nothing else from before the
    boundary, so the least of it decides whether anything fits after (a greedy placement,
    longest segments first, can checkpoint more than it needs and miss a fit). Work: the steps
    times the longest segment within the cap. When none fits, one greedy pass (each segment as
    long as the cap allows) gives the lowest peak it finds over every ``b``, or a checkpoint
    per step. ``copies[j][0]`` lists producers of step ``j``'s own operands, as
    :func:`~.compiler.compile_program` reports them. The planner calls this for every
    candidate slicing of every tree it scores (200-300 times for a 36-tensor lattice): it runs
    in C++ (``csrc/contract_memory.cpp``)."""
    if not costs.result:
        return 0, [], 0
    peak, checkpoints = library._C.place_checkpoints(costs.result, costs.consumer, costs.from_step, costs.inputs,
                                                     copies, bool(complex_), None if cap is None else float(cap))
    return round(peak), checkpoints, sum(costs.macs[:checkpoints[-1]]) if checkpoints else 0


# ---------------------------------------------------------------------------- sliced modes
def choose_sliced(steps, sizes, output, limit_elems: Optional[int], min_slices: Optional[int],
                  forced: Sequence[int], fits=None) -> List[int]:
    """Sliced modes for a path: starting from ``forced``, add modes until every step result of
    one slice fits ``limit_elems`` (the mode that lowers the largest one most, ties: least total
    work), there are ``min_slices`` slices (least total work), and ``fits(sliced, costs)`` is
    <= 0 (the mode that lowers it most). Every unsliced mode of extent > 1 that occurs in a
    step or the output is a candidate, so the limit can always be met with ``limit_elems >= 1``."""
    sliced = list(forced)

    def too_many(largest=None):
        if limit_elems is None:
            return ValueError("slicing: more than 2^62 slices, the most a plan can have (the modes given in "
                              "slicing=, or those the search slices so that no intermediate reaches 2^62 elements: "
                              "then no path found fits any device)")
        found = "" if largest is None else f" (the largest intermediate of this one: 2^{math.log2(largest):.1f})"
        return ValueError(f"memory_limit cannot be met within 2^62 slices (the most a plan can have): "
                          f"{limit_elems} elements per intermediate is too few for the contraction paths "
                          f"found{found}; raise it")

    if math.prod(sizes[m] for m in sliced) > MAX_SLICES:
        raise too_many()
    if limit_elems is None and (min_slices or 1) <= 1 and fits is None:
        return sliced  # nothing to meet: the forced modes only
    sset = set(sliced)
    n = len(steps)
    res_sets = [res for _, res, _, _ in steps] + [frozenset(output)]  # the output block counts too
    all_sets = [allm for allm, _, _, _ in steps]
    universe = sorted(m for m in set().union(*all_sets, res_sets[-1]) if sizes[m] > 1)
    in_res = {m: [] for m in universe}  # the steps (and the output, n) whose result holds m
    in_all = {m: [] for m in universe}  # the steps that hold m
    for j, r in enumerate(res_sets):
        for m in r:
            if m in in_res:
                in_res[m].append(j)
    for j, a in enumerate(all_sets):
        for m in a:
            if m in in_all:
                in_all[m].append(j)
    size = lambda ms: math.prod(sizes[m] for m in ms if m not in sset)  # noqa: E731
    result = [size(r) for r in res_sets]
    macs = [size(a) for a in all_sets]
    while True:
        largest = max(result)
        nslices = math.prod(sizes[m] for m in sliced)
        over = limit_elems is not None and largest > limit_elems
        if over and nslices * -(-largest // limit_elems) > MAX_SLICES:
            # a mode of extent e divides a result by e at most and multiplies the slices by e:
            # every slicing that meets the limit has at least largest / limit_elems x the slices
            raise too_many(largest)
        few = nslices < (min_slices or 1)
        if not over and not few:
            if fits is None or fits(sset, StepCosts(steps, sizes, sset)) <= 0:
                return sliced
        if over:  # only modes of the results over the limit can lower the largest
            cands = sorted({m for j, r in enumerate(res_sets) if result[j] > limit_elems for m in r
                            if m not in sset and sizes[m] > 1})
        elif few:
            cands = [m for m in universe if m not in sset]
        else:  # the modelled memory: modes of the larger intermediates
            cands = sorted({m for j, r in enumerate(res_sets) if 16 * result[j] >= largest for m in r
                            if m not in sset and sizes[m] > 1})
        if not cands:
            if over:  # pragma: no cover - every mode sliced leaves results of one element
                raise ValueError(f"memory_limit cannot be met: {limit_elems} elements")
            if few:
                raise ValueError(f"slicing: cannot reach min_slices={min_slices}; only {nslices} slice(s) possible")
            return sliced  # fits() cannot be met: the caller reports the modelled peak
        total_macs = sum(macs)
        best, best_key = None, None
        if over:
            order = sorted(range(n + 1), key=result.__getitem__, reverse=True)
        for m in cands:
            e = sizes[m]
            saved = sum(macs[j] for j in in_all[m]) * (e - 1) // e
            total = (total_macs - saved) * nslices * e
            if over:  # the largest result once m is sliced: of those m divides, and of the rest
                hit = set(in_res[m])
                rest = next((result[j] for j in order if j not in hit), 0)
                l2 = max(rest, max(result[j] // e for j in in_res[m]))
                key = (max(l2, limit_elems), total, -e)
            elif few:
                key = (0, total, -e)
            else:
                s2 = sset | {m}
                key = (max(fits(s2, StepCosts(steps, sizes, s2)), 0.0), total, -e)
            if best_key is None or key < best_key:
                best, best_key = m, key
        if nslices * sizes[best] > MAX_SLICES:
            raise too_many(largest)
        sliced.append(best)
        sset.add(best)
        e = sizes[best]
        for j in in_res[best]:
            result[j] //= e
        for j in in_all[best]:
            macs[j] //= e


# Per executor step and slice, what a step costs besides its multiply-adds, in multiply-adds
# (dispatch and bookkeeping, a few microseconds on CPU): plans of many tiny slices pay it.
STEP_OVERHEAD_MACS = 1e5
# What writing one element of an intermediate costs an unsliced plan, in multiply-adds. Unsliced
# intermediates can be far larger than the caches, and trees with few multiply-adds per element
# written then run at memory speed: the 6x6 PEPS norm of bond 3 (float32, AMD EPYC VM, 2 threads)
# ran its tree of least multiply-adds (2.2e9, 2.1e8 elements written) in 430-600 ms, opt_einsum's
# greedy one (1.05e10, 7.7e7) in 400-410 ms, and the tree found with this weight (2.9e9, 2.8e7)
# in 90-140 ms (16: 2.4e9, 1.6e8, 350-400 ms; 64: the same tree as 32). About 60 makes the first
# two trees cost what they took; 32 is half that and half cotengra's "combo" default (64). Over
# 71 unsliced networks (lattices, PEPS, circuits, MPS, trees) no plan ran more than 15% slower
# (an 8x8 lattice of bond 6: 9-14%) and 17 ran 0.03-0.7x the time. Sliced plans keep their
# intermediates within the limit and weigh 0: on the benchmark lattices the weight changed no
# sliced plan for the better and made the search settle on a worse one (5x5, bond 16, 1 MiB:
# 512 slices instead of 128).
WRITE_MACS = 32.0


def slicing_work(costs: StepCosts, nslices: int, recompute: float = 0.0, write_macs: float = 0.0) -> float:
    """The planner's cost of a sliced path, in multiply-adds: per slice the forward + backward
    (3 x the forward, each forward step's result charged ``write_macs`` per element:
    :data:`WRITE_MACS` for unsliced plans), what the backward recomputes, and
    :data:`STEP_OVERHEAD_MACS` per step of each of the three passes."""
    forward = costs.flops() + write_macs * sum(costs.result) if write_macs else costs.flops()
    return nslices * (3.0 * forward + recompute + 3 * STEP_OVERHEAD_MACS * len(costs.result))


def chunked_sizes(sizes: Dict[int, int], splits: Dict[int, int]) -> Dict[int, int]:
    """Per-slice extents with each mode of ``splits`` taken in ``splits[m]`` chunks."""
    return {m: e // splits.get(m, 1) for m, e in sizes.items()}


def _divisors(e: int) -> List[int]:
    return [d for d in range(2, e + 1) if e % d == 0]


def chunk_sliced(steps, sizes, output, sliced, keep, limit_elems: Optional[int], min_slices: Optional[int],
                 cap: Optional[float], peak_of) -> Tuple[Dict[int, int], List[int]]:
    """Whole-sliced modes (``sliced`` but not ``keep``) taken in chunks where fewer slices do:
    each, last chosen first, is sliced in the fewest chunks that keep every intermediate of a
    slice within ``limit_elems`` (None: no limit), ``min_slices`` slices and the modelled peak within ``cap``
    (``peak_of(costs)``: as in :func:`split_to_fit`; a mode of extent 16 sliced where 4 chunks
    would fit costs 4x the slices). Returns
    ``(splits, sliced)``: mode -> chunks, and the modes still sliced whole."""
    sizes = dict(sizes)
    sliced = list(sliced)
    sset = set(sliced)
    splits: Dict[int, int] = {}
    out = set(output)
    res_sets = [res for _, res, _, _ in steps] + [frozenset(output)]
    for m in reversed(list(sliced)):
        if m in keep or m in out:
            continue
        e = sizes[m]
        others = math.prod(sizes[x] for x in sset if x != m) * math.prod(splits.values())
        for f in _divisors(e)[:-1]:
            if min_slices and others * f < min_slices:
                continue
            s2 = dict(sizes)
            s2[m] = e // f
            set2 = sset - {m}
            if limit_elems is not None and max(math.prod(s2[x] for x in r if x not in set2)
                                               for r in res_sets) > limit_elems:
                continue
            if cap is not None and peak_of(StepCosts(steps, s2, set2))[0] > cap:
                continue
            sizes, sset = s2, set2
            splits[m] = f
            sliced.remove(m)
            break
    return splits, sliced


# split_to_fit tries at most this many modes per round (those in the most intermediate
# elements): each try is a checkpoint placement, linear in the steps, and a long chain of
# steps has a candidate mode per step.
MAX_SPLIT_CANDIDATES = 32


def split_to_fit(steps, sizes, output, sliced, cap: float, peak_of,
                 max_macs: Optional[float] = None) -> Tuple[Dict[int, int], List[int]]:
    """Further slicing until ``peak_of(costs)`` (the modelled peak, elements, and the
    recomputed multiply-adds of one slice with those :class:`StepCosts`) is within ``cap``:
    ``(splits, whole)`` with ``splits[m]`` the number of chunks mode ``m`` is sliced in (its
    ranges; :func:`~.parser.split_modes`) and ``whole`` the modes sliced index by index.

    Greedy: each round halves a mode (its smallest divisor of chunks; output modes are
    sliced whole) and takes the choice that fits with the least work
    (:func:`slicing_work`), or, when none fits yet, the least extra work per memory saved
    (log work ratio over log peak ratio). Output modes are sliced whole only (their chunks
    would be output blocks). Candidates: modes of the larger intermediates, at most
    :data:`MAX_SPLIT_CANDIDATES` (those in the most intermediate elements). Stops when nothing
    lowers the peak (the caller reports the modelled peak), or when the slices' multiply-adds
    pass ``max_macs`` (slicing more only adds work: the caller refuses the plan)."""
    sizes = dict(sizes)
    sset = set(sliced)
    nslices = math.prod(sizes[m] for m in sliced)
    out = set(output)
    splits: Dict[int, int] = {}
    whole: List[int] = []
    costs = StepCosts(steps, sizes, sset)
    peak, rec = peak_of(costs)
    work = slicing_work(costs, nslices, rec)
    res_sets = [res for _, res, _, _ in steps]
    where = mode_steps(steps)
    while peak > cap:
        if max_macs is not None and costs.flops() * nslices > max_macs:
            break
        largest = max(costs.result)
        cands = sorted({m for j, r in enumerate(res_sets) if 16 * costs.result[j] >= largest for m in r
                        if m not in sset and sizes[m] > 1})
        if len(cands) > MAX_SPLIT_CANDIDATES:
            held = {m: sum(costs.result[j] for j in where[m][1]) for m in cands}
            cands = sorted(sorted(cands, key=lambda m: -held[m])[:MAX_SPLIT_CANDIDATES])
        best = None
        for m in cands:
            e = sizes[m]
            for f in ([e] if m in out else _divisors(e)[:1]):  # halved (a split mode may be split again)
                if nslices * f > MAX_SLICES:
                    continue
                c2 = costs.rescaled(where[m], e, 1 if f == e else e // f)
                pk, rc = peak_of(c2)
                if pk >= peak:
                    continue
                wk = slicing_work(c2, nslices * f, rc)
                key = (0, wk) if pk <= cap else (1, math.log(max(wk, 1.0) / max(work, 1.0)) / math.log(peak / pk))
                if best is None or key < best[0]:
                    best = (key, m, f, c2, pk, wk)
        if best is None:
            break
        _, m, f, costs, peak, work = best
        sizes = dict(sizes)
        sizes[m] //= f
        if sizes[m] == 1:
            sset = sset | {m}
        nslices *= f
        if m in sset:  # sliced whole (a split mode's chunks sliced whole: the mode sliced whole)
            whole.append(m)
            splits.pop(m, None)
        else:
            splits[m] = splits.get(m, 1) * f
    return splits, whole


# ---------------------------------------------------------------------------- slice ids
MAX_TABLE_ROWS = 1 << 16  # rows of one executor call: bounded, so no slice list is ever materialised


class Slices:
    """The slices of a plan: slice ``s`` is the mixed-radix number of the sliced modes' indices
    (last mode fastest). A *slice group* is None (all slices), an int, a range or a list of ids;
    groups are never expanded into lists: :meth:`chunks` yields the executor's slice tables a
    bounded number of rows at a time, so a plan with 2^40 slices costs nothing until run.
    """

    def __init__(self, extents: Sequence[int]):
        self.extents = tuple(int(e) for e in extents)
        self.count = int(math.prod(self.extents))
        self._tables: Dict[object, Tuple[Tuple[int, ...], ...]] = {}

    def indices(self, s: int) -> Tuple[int, ...]:
        """The sliced modes' indices of slice ``s``."""
        idx = []
        for ext in reversed(self.extents):
            idx.append(s % ext)
            s //= ext
        return tuple(reversed(idx))

    def group(self, slices) -> Union[range, Tuple[int, ...]]:
        """A slice group, checked: a range (None and ranges; O(1)) or a tuple of ids."""
        if slices is None:
            return range(self.count)
        one = as_index(slices)  # an int, a numpy integer, a 0-dim integer tensor
        if one is not None:
            slices = (one,)
        elif hasattr(slices, "tolist") and not isinstance(slices, (list, tuple, range)):
            slices = slices.tolist()  # a numpy array or tensor of ids
            slices = [slices] if not isinstance(slices, list) else slices
        if isinstance(slices, range):
            if not slices:
                return slices
            if not (0 <= slices[0] < self.count and 0 <= slices[-1] < self.count):
                bad = slices[0] if not 0 <= slices[0] < self.count else slices[-1]
                raise ValueError(f"slices: slice id {bad!r} is out of range for a plan with {self.count} slice(s)")
            return slices
        if not isinstance(slices, (list, tuple)):
            raise TypeError(f"slices must be None, an int, a range or a list of slice ids, got {type(slices).__name__}")
        ids = []
        for s in slices:
            i = as_index(s)
            if i is None:
                raise TypeError(f"slices: slice ids are ints, got {s!r} ({type(s).__name__})")
            if not 0 <= i < self.count:
                raise ValueError(f"slices: slice id {i!r} is out of range for a plan with {self.count} slice(s)")
            ids.append(i)
        return tuple(ids)

    def ids(self, slices) -> Union[range, Tuple[int, ...]]:
        """The slice ids of a slice group (a range or a tuple, never an expanded list)."""
        return self.group(slices)

    def size(self, slices) -> int:
        """How many slices a group has."""
        return len(self.group(slices))

    def _rows(self, ids) -> Tuple[int, ...]:
        if not self.extents:
            return ()
        if isinstance(ids, range) and ids.step == 1 and len(self.extents) > 0:
            # consecutive ids: count in mixed radix instead of dividing each id
            idx = list(self.indices(ids[0])) if len(ids) else []
            out = []
            exts = self.extents
            last = len(exts) - 1
            for _ in range(len(ids)):
                out.extend(idx)
                d = last
                while d >= 0:
                    idx[d] += 1
                    if idx[d] < exts[d]:
                        break
                    idx[d] = 0
                    d -= 1
            return tuple(out)
        return tuple(i for s in ids for i in self.indices(s))

    def chunks(self, slices, max_rows: int = MAX_TABLE_ROWS) -> Iterator[Tuple[int, ...]]:
        """The executor's slice tables of a group, ``max_rows`` slices (rows of the sliced
        modes' indices; ``()`` for an unsliced plan) at a time; nothing for an empty group.
        Groups of one chunk are cached."""
        group = self.group(slices)
        if len(group) == 0:
            return
        if len(group) <= max_rows:
            # not under torch.compile: a recompile can make the group's bounds symbolic
            # (Dynamo's automatic dynamic ints), which cannot be looked up in a dict
            key = group if isinstance(group, range) and not torch.compiler.is_compiling() else None
            if key is not None and key in self._tables:
                yield self._tables[key]
                return
            table = self._rows(group)
            if key is not None and len(self._tables) < 64:
                self._tables[key] = table
            yield table
            return
        for c in range(0, len(group), max_rows):
            yield self._rows(group[c:c + max_rows])

    def table(self, slices) -> Optional[Tuple[int, ...]]:
        """The slice table of a group that fits one executor call (None for an empty group);
        larger groups: :meth:`chunks`."""
        group = self.group(slices)
        if len(group) > MAX_TABLE_ROWS:
            raise ValueError(f"slices: a group of {len(group)} slices is more than one table holds "
                             f"({MAX_TABLE_ROWS}); iterate over Slices.chunks()")
        return next(iter(self.chunks(group)), None)
