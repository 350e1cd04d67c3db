"""Slicing: memory limits, the cost model of one slice, choosing sliced modes, and slice ids.

Slicing a mode fixes its index: the network splits into ``extent`` independent slices whose
results add up (or, for an output mode, fill their own blocks of the output). The planner slices
modes until one slice's modelled memory fits ``memory_limit`` (:func:`greedy_slice`), and
:class:`Slices` turns slice ids into the per-slice mode indices the executor takes.
"""
from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["parse_memory_limit", "step_table", "working_set", "slice_cost", "greedy_slice", "Slices"]


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


# ---------------------------------------------------------------------------- cost model
def step_table(inputs, output, path):
    """Per pairwise step of ``path``: (frozenset of modes involved, frozenset of result modes,
    the two operands' mode sets, the steps that produced them or -1 for operands), with
    hyperedges kept while any remaining operand or the output needs them."""
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
    return steps


def working_set(steps, sizes, sliced, limit=None) -> Tuple[int, List[int]]:
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
        return sum(c[p] for p in range(b) if b <= consumer[p] < n)

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


def slice_cost(steps, sizes, sliced, limit=None) -> Tuple[int, int, int]:
    """(multiply-adds of one slice, largest step result, working set of one slice's forward +
    backward (:func:`working_set`)), in elements, with ``sliced`` removed."""
    flops, largest = 0, 0
    for allm, res, _, _ in steps:
        flops += math.prod(sizes[m] for m in allm if m not in sliced)
        largest = max(largest, math.prod(sizes[m] for m in res if m not in sliced))
    return flops, largest, working_set(steps, sizes, sliced, limit)[0]


def greedy_slice(steps, sizes, output, limit_elems, min_slices, forced, gradients=True) -> List[int]:
    """Sliced modes for a path: starting from ``forced``, add the mode that most lowers one
    slice's forward + backward working set (:func:`slice_cost`; ties: least total work) until it
    and every intermediate fit ``limit_elems`` and ``min_slices`` holds. With
    ``gradients=False`` only the intermediates (the forward) must fit."""
    sliced = list(forced)
    sset = set(sliced)
    out_size = lambda s: math.prod(sizes[m] for m in output if m not in s)  # noqa: E731
    while True:
        flops, largest, working = slice_cost(steps, sizes, sset, limit_elems)
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
                    f"{'forward + backward working set' if gradients else 'forward'} needs {need} elements "
                    f"(limit {limit_elems} elements; largest intermediate {largest} elements)")
            raise ValueError(f"slicing: cannot reach min_slices={min_slices}; only {nslices} slice(s) possible")
        best, best_key = None, None
        for m in sorted(cands):
            s2 = sset | {m}
            f2, l2, w2 = slice_cost(steps, sizes, s2, limit_elems)
            w2 = w2 if gradients else 0
            need2 = max(l2, w2, out_size(s2))
            total = f2 * nslices * sizes[m]
            # over the limit: the mode that lowers the need most, where any that meets the limit
            # ties and the least total work decides
            key = (max(need2, limit_elems) if over else 0, total, -sizes[m])
            if best_key is None or key < best_key:
                best, best_key = m, key
        sliced.append(best)
        sset.add(best)


# ---------------------------------------------------------------------------- slice ids
class Slices:
    """The slices of a plan: slice ``s`` is the mixed-radix number of the sliced modes' indices
    (last mode fastest). A *slice group* is None (all slices), an int, a range or a list of ids.
    """

    def __init__(self, extents: Sequence[int]):
        self.extents = tuple(int(e) for e in extents)
        self.count = int(math.prod(self.extents))
        self._tables: Dict[object, Optional[Tuple[int, ...]]] = {}

    def indices(self, s: int) -> Tuple[int, ...]:
        """The sliced modes' indices of slice ``s``."""
        idx = []
        for ext in reversed(self.extents):
            idx.append(s % ext)
            s //= ext
        return tuple(reversed(idx))

    def ids(self, slices) -> List[int]:
        """The slice ids of a slice group, checked."""
        if slices is None:
            return list(range(self.count))
        if isinstance(slices, int) and not isinstance(slices, bool):
            slices = [slices]
        if not isinstance(slices, (range, list, tuple)):
            raise TypeError(f"slices must be None, a range or a list of slice ids, got {type(slices).__name__}")
        ids = list(slices)
        for s in ids:
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < self.count:
                raise ValueError(f"slices: slice id {s!r} is out of range for a plan with {self.count} slice(s)")
        return ids

    def table(self, slices) -> Optional[Tuple[int, ...]]:
        """The executor's slice table: the indices of every slice in the group, one row per
        slice (``()`` for an unsliced plan); None for an empty group. Cached for None/ranges."""
        key = slices if slices is None or isinstance(slices, range) else None
        if key is not None and key in self._tables:
            return self._tables[key]
        ids = self.ids(slices)
        if not ids:
            table = None
        elif not self.extents:
            table = ()
        else:
            table = tuple(i for s in ids for i in self.indices(s))
        if key is not None:
            self._tables[key] = table
        return table
