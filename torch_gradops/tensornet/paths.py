"""Contraction paths: cotengra's hyper-optimised, slicing-aware search (the default for all but
the smallest networks), opt_einsum's optimizers, cotengra optimizer objects and explicit paths.

A path is opt_einsum's linear format: a list of pairs of positions in the current operand list;
the pair's result goes to the end of the list.

``optimize="auto"``: networks of up to :data:`SMALL` operands take opt_einsum's choice (exact or
branch-and-bound; milliseconds); larger ones a ``cotengra.HyperOptimizer`` search over greedy
trees, each sliced by cotengra to the memory limit (``slicing_opts``, or ``slicing_reconf_opts``
-- slicing interleaved with subtree reconfiguration -- for networks that slicing makes expensive),
scored by :class:`PlanObjective`, the executor's cost of the sliced tree including the
backward's recomputation and any further slicing its memory model needs. The budget
(:func:`search_budget`) grows with the network: a few milliseconds for a handful of tensors, at
most a few seconds for a 6x6 lattice. The search is seeded (:data:`SEED`) and has no time limit,
so it is deterministic: every rank of a process group finds the same plan.

An opt-in on-disk cache of searched paths (cotengra's ``ReusableHyperOptimizer``), keyed by the
network and the options that shape the path, lets a new process skip the search: pass
``path_cache=directory`` or set ``TORCH_GRADOPS_PATH_CACHE``.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import cotengra
import opt_einsum
from cotengra.scoring import FlopsObjective

__all__ = ["PathResult", "find_path", "check_path", "search_budget", "PlanObjective", "SMALL", "SEED",
           "PATH_CACHE_ENV", "symbols"]

SMALL = 8            # up to this many operands "auto" asks opt_einsum (exact / branch-and-bound)
SEED = 0             # the hyper-search's seed: the same network gives the same plan everywhere
PATH_CACHE_ENV = "TORCH_GRADOPS_PATH_CACHE"
_CACHE_VERSION = 1   # bump when the search or its scoring changes: old cached paths are ignored


@dataclass(frozen=True)
class PathResult:
    """A path, the sliced modes the optimizer suggests (or None), the optimizer's name, whether
    a search ran (an explicit path, a single operand or an on-disk cache hit needs none) and the
    search's wall time in seconds."""
    path: List[Tuple[int, int]]
    sliced: Optional[List[int]]
    optimizer: str
    searched: bool
    search_s: float = 0.0


def symbols(sizes):
    """Mode id -> single-character symbol (what cotengra's hashing and trees want)."""
    return {m: opt_einsum.get_symbol(m) for m in sizes}


def search_budget(n_operands: int) -> dict:
    """The hyper-search's budget for a network of ``n_operands`` tensors: trials (each a greedy
    tree, sliced and scored) that cost about a millisecond per operand each on one CPU core, so
    ~0.1 s for 25 tensors and ~1-2 s for a 6x6 lattice; fewer trials for very large networks
    (each one costs more)."""
    if n_operands <= 16:
        repeats = 16
    elif n_operands <= 64:
        repeats = 32
    elif n_operands <= 256:
        repeats = 16
    else:
        repeats = 4
    return {"max_repeats": repeats}


class PlanObjective(FlopsObjective):
    """cotengra objective: log2 of the executor's work for a sliced tree, forward + backward:
    ``slices x (3 x multiply-adds per slice + recomputed ones)``, after the further slicing (if
    any) that the backward's memory model (:mod:`.slicer`) needs within ``cap`` elements.
    Refinement stages (slicing, reconfiguration) use FLOPs as usual."""

    __slots__ = ("score_tree",)

    def __init__(self, score_tree: Callable):
        super().__init__()
        self.score_tree = score_tree

    def __call__(self, trial):
        try:
            work = self.score_tree(trial["tree"])
        except (ValueError, KeyError):
            return math.inf
        return math.log2(max(work, 1.0))


def _seeded(fn):
    """Run ``fn`` with Python's global ``random`` (which cotengra's greedy and slicer draw
    from) seeded, restoring its state after: deterministic, and invisible to the caller."""
    state = random.getstate()
    random.seed(SEED)
    try:
        return fn()
    finally:
        random.setstate(state)


def _cache_directory(path_cache, options) -> Optional[str]:
    if path_cache is None:
        path_cache = os.environ.get(PATH_CACHE_ENV) or None
    if path_cache is None:
        return None
    key = hashlib.sha1(repr((_CACHE_VERSION, options)).encode()).hexdigest()[:16]
    return os.path.join(os.fspath(path_cache), f"torch_gradops-{key}")


def _cotengra_search(optimizers, inputs, output, sizes, name="cotengra", cache_dir=None,
                     score=None) -> PathResult:
    """Run cotengra optimizers on integer modes (cotengra wants single-character symbols) and
    keep the best tree by ``score`` (its own score for a single optimizer object); each
    through a ``ReusableHyperOptimizer`` on ``cache_dir`` when given (HyperOptimizer options)."""
    import time
    sym = symbols(sizes)
    back = {v: k for k, v in sym.items()}
    c_in = [[sym[m] for m in t] for t in inputs]
    c_out = [sym[m] for m in output]
    c_sizes = {sym[m]: e for m, e in sizes.items()}
    if not isinstance(optimizers, list):
        optimizers = [optimizers]
    searched, best, t0 = False, None, time.perf_counter()
    for j, optimizer in enumerate(optimizers):
        if isinstance(optimizer, dict) and cache_dir is not None:
            opt = cotengra.ReusableHyperOptimizer(directory=os.path.join(cache_dir, str(j)), **optimizer)
            searched |= opt.hash_query(c_in, c_out, c_sizes)[1]
        else:
            opt = cotengra.HyperOptimizer(**optimizer) if isinstance(optimizer, dict) else optimizer
            searched = True
        tree = _seeded(lambda: opt.search(c_in, c_out, c_sizes))
        value = score(tree) if score is not None and len(optimizers) > 1 else 0.0
        if best is None or value < best[0]:
            best = (value, tree)
    tree = best[1]
    return PathResult([tuple(p) for p in tree.get_path()], [back[s] for s in tree.sliced_inds], name, searched,
                      time.perf_counter() - t0 if searched else 0.0)


def hyper_options(n_operands, limit_elems, min_slices, objective) -> List[dict]:
    """The ``HyperOptimizer`` options of the default search: without a limit one search with
    subtree reconfiguration; with one, searches slicing to the limit and to 1/4 and 1/16 of it
    (the backward's memory may need a tree whose intermediates are well below the limit), the
    trials shared between them."""
    budget = search_budget(n_operands)
    base = dict(methods=["greedy"], parallel=False, progbar=False, minimize=objective, optlib_opts={"seed": SEED})
    if limit_elems is None and not min_slices:
        return [dict(base, reconf_opts={}, **budget)]
    out = []
    targets = [limit_elems] if limit_elems is None else \
        sorted({max(1, int(limit_elems) // d) for d in (1, 4, 16)}, reverse=True)
    for target in targets:
        slicing = {"max_repeats": 4}
        if target is not None:
            slicing["target_size"] = target
        if min_slices:
            slicing["target_slices"] = int(min_slices)
        out.append(dict(base, slicing_opts=slicing, max_repeats=max(4, budget["max_repeats"] // len(targets))))
    return out


def find_path(inputs, output, sizes, optimize, limit_elems: Optional[int], min_slices: Optional[int],
              objective: Optional[Callable] = None, path_cache=None) -> PathResult:
    """The path for the network ``inputs -> output`` (mode ids, extents ``sizes``).

    ``optimize``: "auto" (see the module docstring), "greedy" (opt_einsum's, fast), "optimal",
    any opt_einsum path-optimizer name, "cotengra" (the "auto" hyper-search at any size), a
    cotengra optimizer object, or an explicit path. ``objective``: ``tree -> work`` for
    :class:`PlanObjective`; ``path_cache``: the on-disk cache's directory (None:
    ``$TORCH_GRADOPS_PATH_CACHE`` or no disk cache)."""
    n = len(inputs)
    if n == 1:
        return PathResult([], None, "single", False)
    if isinstance(optimize, str):
        name = optimize
        if name == "auto":
            name = "auto" if n <= SMALL else "cotengra"
        if name == "cotengra":
            obj = PlanObjective(objective) if objective is not None else "flops"
            opts = hyper_options(n, limit_elems, min_slices, obj)
            key = tuple(tuple(sorted((k, repr(v)) for k, v in o.items() if k != "minimize")) for o in opts)
            return _cotengra_search(opts, inputs, output, sizes, "cotengra", _cache_directory(path_cache, key),
                                    score=(lambda tree: obj(dict(tree=tree))) if objective is not None else None)
        try:
            fn = opt_einsum.paths.get_path_fn(name)
        except KeyError:
            raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra', an opt_einsum "
                             f"path-optimizer name or an explicit path, got {optimize!r}") from None
        import time
        t0 = time.perf_counter()
        path = fn([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
        return PathResult([tuple(p) for p in path], None, optimize, True, time.perf_counter() - t0)
    if hasattr(optimize, "search"):  # a cotengra optimizer object
        return _cotengra_search(optimize, inputs, output, sizes)
    if isinstance(optimize, (list, tuple)):
        return PathResult(check_path(optimize, n), None, "explicit", False)
    raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra' or an explicit path, got {optimize!r}")


def check_path(path, n) -> List[Tuple[int, int]]:
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
