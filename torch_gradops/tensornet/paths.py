"""Contraction paths: cotengra's hyper-optimised, slicing-aware search (the default for networks
worth searching), opt_einsum's optimizers, cotengra optimizer objects and explicit paths.

A path is opt_einsum's linear format: a list of pairs of positions in the current operand list;
the pair's result goes to the end of the list.

``optimize="auto"``: networks of up to :data:`SMALL` operands take opt_einsum's choice (exact or
branch-and-bound; milliseconds). Larger ones first get opt_einsum's greedy path, an upper bound
of the contraction's cost: when even that is worth less than two trials of search
(:func:`search_budget`; under a limit, as its plan would be sliced, memory model included) it
is the path. Otherwise a ``cotengra.HyperOptimizer`` search over
greedy trees, each sliced by cotengra to the memory limit (and, with 16 trials or more, a second
search to 1/4 of it, the two taking batches of trials in turn), scored by :class:`PlanObjective`:
the executor's forward + backward work of the sliced tree, with the backward's recomputation and
a charge for any further slicing its memory model needs (unsliced, every element an intermediate
writes is charged :data:`~.slicer.WRITE_MACS` multiply-adds: trees of few multiply-adds per
element written run at memory speed). The search runs :data:`MIN_TRIALS`
trials (:data:`MIN_UNSLICED_TRIALS` unsliced), then more, :data:`BATCH` at a time, while they cost less than :data:`SEARCH_FRACTION` of
the best plan's estimated time (:func:`wants_more`; at most :func:`_budget_cap` trials, 128 for
up to 64 operands), so a contraction of milliseconds is not searched for seconds and one of
minutes gets the trials its greedy trees' spread calls for. The trials are cheap greedy trees
(cotengra's subtree reconfiguration, which its own default search runs on every trial, costs
10-20x a trial); the winner alone is then reconfigured, as sliced and with its order unsliced
(sliced afresh by the planner), where that costs at most :data:`POLISH_FRACTION` of its
estimated time (:func:`worth_polishing`): on the benchmark lattices this cut the chosen plans'
work by up to 6x (6x6, bond 8, at 4 MiB). The search is seeded (:data:`SEED`) and its budget
counts trials, not seconds, so it is deterministic: every rank of a process group finds the
same plan. The planner then schedules the chosen tree's steps heavy subtree last
(:func:`heavy_last`).

An opt-in on-disk cache of searched paths (cotengra's ``ReusableHyperOptimizer``), keyed by the
network and the options that shape the path, lets a new process skip the search: pass
``path_cache=directory`` or set ``TORCH_GRADOPS_PATH_CACHE``.
"""
from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import math
import os
import random
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import cotengra
import opt_einsum
from cotengra.hyperoptimizers.hyper import get_hyper_space, register_hyper_function
from cotengra.pathfinders import path_basic
from cotengra.scoring import FlopsObjective
from cotengra.utils import BadTrial
from opt_einsum.paths import linear_to_ssa

from .slicer import MAX_SLICES

__all__ = ["PathResult", "find_path", "cache_root", "check_path", "heavy_last", "search_budget", "wants_more",
           "worth_polishing", "reference_costs", "BudgetedHyperOptimizer", "PlanObjective", "SMALL", "SEED",
           "PATH_CACHE_ENV", "symbols"]

SMALL = 8            # up to this many operands "auto" asks opt_einsum (exact / branch-and-bound)
SEED = 0             # the hyper-search's seed: the same network gives the same plan everywhere
PATH_CACHE_ENV = "TORCH_GRADOPS_PATH_CACHE"
_CACHE_VERSION = 9   # bump when the search, its scoring or the cache's layout changes: old entries are ignored


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


NOMINAL_FLOP_RATE = 1e11  # FLOP/s assumed by the search budget (a constant: the budget must not depend on timing)
SEARCH_FRACTION = 0.1     # of the estimated forward + backward time, at most MAX_SEARCH_S
MAX_SEARCH_S = 2.0
TRIAL_S_PER_OPERAND = 5e-4  # about what one greedy trial, sliced and scored, costs per operand
UNSLICED_TRIAL_S_PER_OPERAND = 1e-4  # the same unsliced (no slicer, no memory model): 50-190 us per
                                     # operand measured on lattices, PEPS and circuits of 36-150 tensors
MIN_TRIALS = 8            # trials of every search under a limit (cotengra's greedy trials vary a lot)
MIN_UNSLICED_TRIALS = 4   # unsliced: the winner's reconfiguration does most of the work (6x6 lattice,
                          # bond 8, over 5 seeds: trees as good as with 8 trials, 21 ms against 26)
BATCH = 4                 # further trials are run this many at a time
RECONF_SUBTREE = 6        # leaves per reconfigured subtree (cotengra's default, 8, costs twice as much; on the
                          # benchmark lattices and circuits it found trees no better)
RECONF_S_PER_OPERAND = 5e-4  # about what reconfiguring one tree costs per operand (lattices of 25-36 operands)
RUNNER_UP_RATIO = 1.5     # unsliced: the runner-up within this factor of the winner's score is reconfigured too
                          # (where reconfiguring two trees is worth it; 0: the winner only)
POLISH_FRACTION = 0.5     # of the best plan's estimated time, at most, spent reconfiguring it


def _max_trials(n_operands: int) -> int:
    """The trials of the full search that ``optimize="cotengra"`` asks for: 32, 16 beyond 64
    operands, 4 beyond 256."""
    return 32 if n_operands <= 64 else 16 if n_operands <= 256 else 4


def _budget_cap(n_operands: int) -> int:
    """The most trials of ``"auto"``'s budgeted search: 4 x :func:`_max_trials` (128, 64 beyond
    64 operands, 16 beyond 256). Only a contraction whose estimated time makes them worth it
    (:func:`wants_more`, within :data:`MAX_SEARCH_S`) runs that many. Why so many: greedy trees
    vary widely. A 72-tensor PEPS norm of bond 3 sliced to 1 MiB, capped at 16 trials, planned
    between 9.6e10 and 3.6e13 FLOPs of forward + backward over five search seeds (6.4e12 with
    this seed), and between 9.6e10 and 4.7e11 with 64 trials."""
    return 4 * _max_trials(n_operands)


def _trials_worth(n_operands: int, flops: float, sliced: bool = True) -> int:
    """Trials worth :data:`SEARCH_FRACTION` of a contraction of ``flops`` (forward + backward,
    real FLOPs) at :data:`NOMINAL_FLOP_RATE`, at most :data:`MAX_SEARCH_S` seconds; a trial
    costs :data:`TRIAL_S_PER_OPERAND` per operand, :data:`UNSLICED_TRIAL_S_PER_OPERAND`
    without a limit (``sliced=False``)."""
    budget_s = min(MAX_SEARCH_S, SEARCH_FRACTION * flops / NOMINAL_FLOP_RATE)
    return int(budget_s / ((TRIAL_S_PER_OPERAND if sliced else UNSLICED_TRIAL_S_PER_OPERAND) * n_operands))


def search_budget(n_operands: int, flops: float, sliced_flops: Optional[float] = None,
                  sliced: Optional[bool] = None) -> dict:
    """The hyper-search's budget for a network of ``n_operands`` tensors whose greedy path
    costs ``flops`` (forward, real FLOPs: a complex multiply-add counts 8; opt_einsum's greedy
    path, an upper bound of what the search finds), or, sliced to a limit, ``sliced_flops``
    (forward + backward, recomputation included) where that is more: ``min_repeats`` trials (at
    most :data:`MIN_TRIALS`, :data:`MIN_UNSLICED_TRIALS` unsliced, fewer when even that path is
    worth less search; below 2 no search) and at most ``max_repeats`` (:func:`_budget_cap`).
    ``sliced``: whether the search slices (default: whether ``sliced_flops`` is given).
    Between the two, :func:`wants_more` decides from the best plan found so far. Depends only
    on the network: deterministic."""
    sliced = sliced_flops is not None if sliced is None else sliced
    cap = _budget_cap(n_operands)
    worth = _trials_worth(n_operands, max(3 * flops, sliced_flops or 0.0), sliced)
    if sliced_flops is not None and sliced_flops > 3 * flops:
        # What slicing adds to the greedy path's work is what a tree with smaller intermediates
        # can save: a search may cost up to that (at worst the call takes twice the greedy
        # plan's overhead). A 24-tensor PEPS norm (complex64) at 16 KiB: greedy's 256 slices ran
        # 99 ms forward + backward, 10x its unsliced work, where 8 trials (25 ms) find 9 slices
        # of 6 ms.
        worth = max(worth, _trials_worth(n_operands, (sliced_flops - 3 * flops) / SEARCH_FRACTION, sliced))
    least = MIN_TRIALS if sliced else MIN_UNSLICED_TRIALS
    return {"min_repeats": max(0, min(cap, least, worth)), "max_repeats": cap}


def wants_more(n_operands: int, trials: int, best_macs: float, sliced: bool = True,
               flops_per_mac: float = 2.0) -> bool:
    """Whether a search that ran ``trials`` trials and whose best plan does ``best_macs``
    multiply-adds (forward + backward, recomputation included; ``flops_per_mac`` real FLOPs
    each, 8 for complex) is worth :data:`BATCH` more: while the trials cost less than
    :data:`SEARCH_FRACTION` of that plan's time at :data:`NOMINAL_FLOP_RATE` (so a
    contraction of milliseconds is not searched for seconds). Counts trials, not seconds:
    deterministic."""
    return trials + BATCH <= _trials_worth(n_operands, flops_per_mac * best_macs, sliced)


def worth_polishing(n_operands: int, best_macs: float, trees: int = 1, flops_per_mac: float = 2.0) -> bool:
    """Whether the search's winner, whose plan does ``best_macs`` multiply-adds (forward +
    backward, recomputation included; ``flops_per_mac`` real FLOPs each), is worth cotengra's
    subtree reconfiguration of ``trees`` trees (:func:`_reconfigured`, about
    :data:`RECONF_S_PER_OPERAND` per operand each): when that costs at most
    :data:`POLISH_FRACTION` of the plan's time at :data:`NOMINAL_FLOP_RATE`. Counts operands,
    not seconds: deterministic."""
    return (RECONF_S_PER_OPERAND * n_operands * trees
            <= POLISH_FRACTION * flops_per_mac * best_macs / NOMINAL_FLOP_RATE)


def check_cotengra(hyper_optimizer=None) -> None:
    """Raise an ``ImportError`` naming the fix when the installed cotengra's ``HyperOptimizer``
    (or ``hyper_optimizer``) does not take the search's ``optlib_opts`` option by name: cotengra
    0.6-0.7 take it into ``**kwargs`` and fail inside the search with a ``TypeError``. The
    feature is checked, not the version string (a source checkout reports "0.0.0+unknown").
    Called when the default search runs (:func:`_default_search`), so that the
    graph-attention half of the package imports with any cotengra."""
    cls = hyper_optimizer if hyper_optimizer is not None else cotengra.HyperOptimizer
    param = inspect.signature(cls.__init__).parameters.get("optlib_opts")
    if param is None or param.kind is inspect.Parameter.VAR_KEYWORD:
        found = getattr(cotengra, "__version__", "of unknown version")
        raise ImportError(f"torch_gradops' tensor-network planner needs cotengra>=0.8 (its HyperOptimizer takes "
                          f"optlib_opts), found {found}: pip install -U 'cotengra>=0.8' (or plan with "
                          f"optimize='greedy')")


class BudgetedHyperOptimizer(cotengra.HyperOptimizer):
    """``cotengra.HyperOptimizer`` that runs ``min_repeats`` trials, then :data:`BATCH` at a time
    while ``more(trials)`` and fewer than ``max_repeats`` ran."""

    def __init__(self, *, min_repeats: int, more: Callable[[int], bool], **kwargs):
        super().__init__(**kwargs)
        self.min_repeats = min_repeats
        self.more = more
        self.cap = self.max_repeats
        self.done = 0  # trials run so far

    def next_batch(self) -> int:
        """Trials of the next :meth:`run`: up to ``min_repeats`` first (at least :data:`BATCH`),
        then :data:`BATCH`; 0 once ``max_repeats`` ran."""
        return min(self.cap - self.done, max(self.min_repeats - self.done, BATCH))

    def run(self, inputs, output, size_dict, trials: int):
        """Run ``trials`` more trials (cotengra's search goes on from where it stopped)."""
        self.max_repeats = trials
        try:
            self._search(inputs, output, size_dict)  # search() would fail while no trial succeeded
        finally:
            self.max_repeats = self.cap
        self.done += trials

    def search(self, inputs, output, size_dict):
        while True:
            self.run(inputs, output, size_dict, self.next_batch())
            if self.done >= self.cap or (self.done >= self.min_repeats and not self.more(self.done)):
                return self.tree


def _round_robin(searches: List[BudgetedHyperOptimizer], inputs, output, size_dict) -> list:
    """Run several :class:`BudgetedHyperOptimizer` searches of one network a batch at a time in
    turn (each first its ``min_repeats``) until all their minimums ran and their shared
    ``more(total trials)`` says no more, or each ran its ``max_repeats``. In turn rather than
    one after the other, so that the budget follows the best plan of all of them: whichever
    search finds it first stops the others (one after the other, the first search could run on
    for trials while the second already held a better tree). Returns each search's tree, or
    None where cotengra kept none (every trial failed). Each search draws from its own seeded
    stream of Python's ``random`` (run it under :func:`_seeded`): its trials are those it would
    run alone."""
    total, min_total, more = 0, sum(opt.min_repeats for opt in searches), searches[0].more
    random.seed(SEED)
    streams = [random.getstate()] * len(searches)  # each search draws its own seeded sequence
    while any(opt.next_batch() > 0 for opt in searches):
        for j, opt in enumerate(searches):
            k = opt.next_batch()
            if k <= 0:
                continue
            random.setstate(streams[j])
            opt.run(inputs, output, size_dict, k)
            streams[j] = random.getstate()
            total += k
            if total >= min_total and not more(total):
                break
        else:
            continue
        break
    trees = []
    for opt in searches:
        try:
            trees.append(opt.tree)
        except KeyError:  # no trial kept (cotengra warned why)
            trees.append(None)
    return trees


class PlanObjective(FlopsObjective):
    """cotengra objective: log2 of the executor's work for a sliced tree, forward + backward:
    ``slices x (3 x multiply-adds per slice + recomputed ones)`` (:func:`~.slicer.slicing_work`,
    unsliced with the elements written), after the further slicing (if
    any) that the backward's memory model (:mod:`.slicer`) needs within ``cap`` elements.
    Refinement stages (slicing, reconfiguration) use FLOPs as usual."""

    __slots__ = ("score_tree", "top", "seen")
    TOP = 4  # trees kept for the exact selection (the score is a proxy)
    UNPLANNABLE = 1e6  # the score (log2 work) of a tree the planner cannot slice to the limit

    def __init__(self, score_tree: Callable):
        super().__init__()
        self.score_tree = score_tree
        self.top: List[Tuple[float, int, object]] = []  # (work, trial number, tree), best first
        self.seen = 0

    def __call__(self, trial):
        try:
            work = self.score_tree(trial["tree"])
        except (ValueError, KeyError):
            # finite: a search whose every trial is unplannable (too many slices) must still
            # return a tree (cotengra keeps none scored inf), for the planner's error to name
            return self.UNPLANNABLE
        self.seen += 1
        self.top.append((work, self.seen, trial["tree"]))
        self.top.sort(key=lambda x: (x[0], x[1]))
        del self.top[self.TOP:]
        return math.log2(max(work, 1.0))


# The largest intermediate (elements) past which a trial's tree cannot meet the search's memory
# limit within MAX_SLICES slices (a mode of extent e divides it by e at most and multiplies the
# slices by e): such a tree is dropped before cotengra's slicer removes its modes one by one (on
# a 30x30 lattice at 1 MiB, seconds per tree). None: no limit.
_HOPELESS_SIZE: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("hopeless_size", default=None)


def _greedy_trial(inputs, output, size_dict, random_strength=0.0, temperature=0.0, costmod=1.0):
    """One trial of the search: cotengra's "greedy" hyper-method (jittered sizes, Boltzmann
    temperature, cost modifier) on cotengra's Python greedy, whatever else is installed.
    cotengra takes its Rust greedy when ``cotengrust`` is installed, whose random draws are
    seeded per process: plans would differ between processes, ranks and machines. This one
    draws from Python's ``random``, which :func:`_seeded` seeds. A tree that no slicing within
    the most slices a plan can have brings under the limit is a bad trial (:data:`_HOPELESS_SIZE`)."""
    sizes = cotengra.core.jitter_dict(size_dict, random_strength) if random_strength else size_dict
    ssa = path_basic.optimize_greedy(inputs, output, sizes, costmod=costmod, temperature=temperature, use_ssa=True)
    tree = cotengra.ContractionTree.from_path(inputs, output, size_dict, ssa_path=ssa)
    hopeless = _HOPELESS_SIZE.get()
    if hopeless is not None and tree.max_size() > hopeless:
        raise BadTrial
    return tree


GREEDY_TRIAL = "torch_gradops-greedy"  # the hyper-method name of _greedy_trial
register_hyper_function(GREEDY_TRIAL, _greedy_trial, get_hyper_space()["greedy"])  # cotengra's "greedy" space


# One seeded search at a time in a process: searches planning in several threads at once drew
# from the one global stream in turn, and got other plans than alone.
_SEARCH_LOCK = threading.RLock()


def _seeded(fn):
    """Run ``fn`` with Python's global ``random`` (which cotengra's greedy and slicer draw
    from) seeded, restoring its state after: deterministic, and invisible to the caller, except
    to another thread drawing from ``random`` while a search runs (the stream is shared). Holds
    :data:`_SEARCH_LOCK`: concurrent plans are searched one after the other."""
    with _SEARCH_LOCK:
        state = random.getstate()
        random.seed(SEED)
        try:
            return fn()
        finally:
            random.setstate(state)


def cache_root(path_cache) -> Optional[str]:
    """The on-disk path cache's folder in effect: ``path_cache``, else
    ``$TORCH_GRADOPS_PATH_CACHE``; None for none ("" means none, as for the variable)."""
    if path_cache is None:
        path_cache = os.environ.get(PATH_CACHE_ENV) or None
    return os.fspath(path_cache) if path_cache else None


def _cache_directory(path_cache, options) -> Optional[str]:
    root = cache_root(path_cache)
    if root is None:
        return None
    key = hashlib.sha1(repr((_CACHE_VERSION, options)).encode()).hexdigest()[:16]
    return os.path.join(root, f"torch_gradops-{key}")


def _default_search(options: List[dict], inputs, output, size_dict, cache_dir: Optional[str]):
    """``(trees, searched, cache)``: the default search's :class:`BudgetedHyperOptimizer`
    searches with ``options``, run in turn (:func:`_round_robin`), or with ``cache_dir`` the
    plan's tree read from a cotengra ``ReusableHyperOptimizer`` cache there (no search); ``cache``
    is that cache (or None), into which :func:`_cotengra_search` writes the tree it finally
    chooses: the cache holds the choice, not the searches' trees, so that a hit gives exactly
    the plan of the search that wrote it (selecting among the searches' trees again would lack
    the candidates and the reconfiguration the search compared them with)."""
    check_cotengra()
    cache = None
    if cache_dir is not None:
        try:
            cache = cotengra.ReusableHyperOptimizer(directory=os.path.join(cache_dir, "plan"), **options[0])
        except OSError as e:
            if not os.path.isdir(os.path.dirname(cache_dir)):  # a file, or a folder that cannot be made
                raise ValueError(f"path_cache: cannot keep a cache in {os.path.dirname(cache_dir)!r} ({e}); pass "
                                 f"a writable directory, or path_cache='' for none") from None
            # a folder that cannot be written (a read-only shared cache without these options' entries)
            warnings.warn(f"path_cache: no entry for this search in {os.path.dirname(cache_dir)!r} and none can be "
                          f"made ({e}); searching without saving", RuntimeWarning, stacklevel=3)
        if cache is not None and not cache.hash_query(inputs, output, size_dict)[1]:
            try:
                return [cache.search(inputs, output, size_dict)], False, cache  # a hit: no search
            except Exception as e:  # a truncated or corrupt entry (an interrupted write): search, rewrite it
                # cotengra's own error says little (an UnboundLocalError for a truncated pickle)
                warnings.warn(f"path_cache: an entry under {cache_dir!r} could not be read: it is corrupt or was cut "
                              f"short by an interrupted write (cotengra's error: {type(e).__name__}: {e}); "
                              "searching again and rewriting it", RuntimeWarning, stacklevel=2)
    trees = _seeded(lambda: _round_robin([BudgetedHyperOptimizer(**o) for o in options], inputs, output, size_dict))
    return trees, True, cache


def _cotengra_search(optimizers, inputs, output, sizes, name="cotengra", cache_dir=None,
                     score=None, candidates=(), polish: Optional[Callable[[float, int], bool]] = None,
                     reconfigure_minimize: str = "flops") -> PathResult:
    """Run cotengra optimizers on integer modes (cotengra wants single-character symbols) and
    keep the best tree by ``score`` (its own score for a single optimizer object), also among
    ``candidates`` (``(proxy, n, tree)``, filled by the searches: :attr:`PlanObjective.top`).
    When ``polish(work, trees)`` says the winner is worth it, its reconfigurations
    (:func:`_reconfigured`, minimising ``reconfigure_minimize``) compete too, and, unsliced, the
    runner-up's, when its score is within :data:`RUNNER_UP_RATIO` of the winner's and two
    reconfigurations are worth it. With ``cache_dir`` (HyperOptimizer options), a
    ``ReusableHyperOptimizer`` there keeps the tree finally chosen: a hit returns it as it is,
    the plan the search gave."""
    sym = symbols(sizes)
    back = {v: k for k, v in sym.items()}
    c_in = [[sym[m] for m in t] for t in inputs]
    c_out = [sym[m] for m in output]
    c_sizes = {sym[m]: e for m, e in sizes.items()}
    if not isinstance(optimizers, list):
        optimizers = [optimizers]
    if score is not None:
        exact = score

        def score(tree):  # a tree that cannot be planned (too many slices) loses
            try:
                return exact(tree)
            except ValueError:
                return math.inf
    searched, best, t0, cache = True, None, time.perf_counter(), None
    if all(isinstance(o, dict) for o in optimizers):  # the default search: its trials in turn
        trees, searched, cache = _default_search(optimizers, c_in, c_out, c_sizes, cache_dir)
    else:  # the caller's own optimizer object
        try:
            trees = [_seeded(lambda: optimizers[0].search(c_in, c_out, c_sizes))]
        except KeyError as e:  # cotengra kept no tree: every trial failed (it warned why)
            raise ValueError(f"optimize: the cotengra optimizer found no contraction tree ({e!r}); see "
                             "cotengra's trial warnings") from None
    for tree in trees:
        if tree is None:  # every trial of a default search failed: opt_einsum's greedy path
            tree = cotengra.ContractionTree.from_path(c_in, c_out, c_sizes, path=_greedy_path(inputs, output, sizes))
        if [tuple(t) for t in tree.inputs] != [tuple(t) for t in c_in] or tuple(tree.output) != tuple(c_out):
            # a cotengra optimizer object keeps its best tree: reused, it returns the first network's
            raise ValueError("optimize: the cotengra optimizer returned a tree of another network (an optimizer "
                             "object that already searched keeps its tree); pass a new one for each network")
        value = score(tree) if score is not None and (len(trees) > 1 or candidates) else 0.0
        if best is None or value < best[0]:
            best = (value, tree)
    if not searched:  # the cached choice of an earlier search, as it chose it
        tree = best[1]
        return PathResult([tuple(p) for p in tree.get_path()], [back[s] for s in tree.sliced_inds], name, False, 0.0)
    runner_up = None  # the next best tree by exact score
    if score is not None and candidates:  # the searches' proxy-best trees, scored exactly
        for proxy, _, tree in candidates:
            if proxy > 4 * candidates[0][0]:
                break  # far behind by the proxy: not worth an exact score
            value = score(tree)
            if value < best[0]:
                best, value, tree = (value, tree), best[0], best[1]
            if tree.get_path() != best[1].get_path() and (runner_up is None or value < runner_up[0]):
                runner_up = (value, tree)
    if score is not None and polish is not None and polish(best[0], 1 + bool(best[1].sliced_inds)):
        polished = [(score(t), t) for t in _reconfigured(best[1], c_in, c_out, c_sizes, reconfigure_minimize)]
        if (not best[1].sliced_inds and runner_up is not None and not runner_up[1].sliced_inds
                and runner_up[0] <= RUNNER_UP_RATIO * best[0] and polish(best[0], 2)):
            # which of two close trees reconfigures better is not foretold by their scores (a
            # 6x6 complex lattice: trees of 1.73e9 and 1.98e9 became 1.07e9 and 7.9e8)
            polished += [(score(t), t) for t in _reconfigured(runner_up[1], c_in, c_out, c_sizes,
                                                               reconfigure_minimize)]
        best = min([best] + polished, key=lambda x: x[0])
    tree = best[1]
    if cache is not None:
        try:
            cache.update_from_tree(tree, overwrite=True)
        except OSError as e:  # a read-only (shared) cache: the plan stands, unsaved
            warnings.warn(f"path_cache: the searched path could not be saved ({e}); the plan is used unsaved",
                          RuntimeWarning, stacklevel=2)
    return PathResult([tuple(p) for p in tree.get_path()], [back[s] for s in tree.sliced_inds], name, searched,
                      time.perf_counter() - t0)


class _MemoisedOptimal:
    """cotengra's exact path optimizer in Python (``OptimalOptimizer(accel=False)``: cotengra
    takes cotengrust's when installed, which breaks ties differently, and plans would depend on
    the install), memoised: subtree reconfiguration optimises the same subtree (same leaves,
    sizes and cost cap, which cotengra sets before each call) again and again, within a tree and
    across the sliced and unsliced trees of :func:`_reconfigured` (the benchmark lattices: 36-72
    calls, 12-44 distinct). The optimizer is a pure function of the key: same paths, less time."""

    def __init__(self, minimize: str = "flops"):
        self._opt = path_basic.OptimalOptimizer(minimize=minimize, accel=False)
        self._memo = {}
        self.cost_cap = self._opt.cost_cap

    def __call__(self, inputs, output, size_dict, **kwargs):
        key = (self.cost_cap, tuple(map(tuple, inputs)), tuple(output),
               tuple(sorted({ix: size_dict[ix] for term in inputs for ix in term}.items())),
               tuple(sorted(kwargs.items())))
        if key not in self._memo:
            self._opt.cost_cap = self.cost_cap
            self._memo[key] = tuple(map(tuple, self._opt(inputs, output, size_dict, **kwargs)))
        return list(self._memo[key])


def _reconfigured(tree, inputs, output, size_dict, minimize: str = "flops") -> list:
    """The chosen tree after cotengra's subtree reconfiguration (locally optimal subtrees, the
    refinement its default search gives every trial; 10-20x the cost of a greedy trial, so the
    budgeted search runs it on the winner only): the tree as sliced, and its contraction order
    unsliced (the planner then slices it afresh, which may slice other modes)."""
    unsliced = cotengra.ContractionTree.from_path(inputs, output, size_dict, path=tree.get_path())
    kw = dict(subtree_size=RECONF_SUBTREE, minimize=minimize, optimize=_MemoisedOptimal(minimize))
    out = [_seeded(lambda: unsliced.subtree_reconfigure(**kw))]
    if tree.sliced_inds:
        out.append(_seeded(lambda: tree.subtree_reconfigure(**kw)))
    return out


def hyper_options(budget: dict, limit_elems, min_slices, objective, more: Callable[[int], bool]) -> List[dict]:
    """The :class:`BudgetedHyperOptimizer` options of the default search: without a limit one
    search; with one, a search slicing to the limit and (given 16 trials or more) one slicing
    to 1/4 of it: the backward's memory may favour a tree with smaller intermediates (the
    planner splits modes of the others, :func:`~.slicer.split_to_fit`). The trials are shared
    between them; ``more(trials)``: whether a search goes on past its minimum."""
    lo, hi = budget["min_repeats"], budget["max_repeats"]
    base = dict(methods=[GREEDY_TRIAL], parallel=False, progbar=False, minimize=objective, optlib_opts={"seed": SEED},
                more=more)
    if limit_elems is None and not min_slices:
        # Without slicing options cotengra reconfigures every trial's tree (10-20x a greedy
        # trial each); here, as with a limit, only the winner is (_reconfigured). A slicing
        # target no tree exceeds slices nothing but gives cotengra each trial's statistics.
        return [dict(base, slicing_opts={"target_size": 2 ** 62, "max_repeats": 1}, min_repeats=lo, max_repeats=hi)]
    out = []
    divisors = (1, 4) if hi >= 16 else (1,)
    targets = [None] if limit_elems is None else sorted({max(1, int(limit_elems) // d) for d in divisors},
                                                        reverse=True)
    for target in targets:
        slicing = {"max_repeats": 4}
        if target is not None:
            slicing["target_size"] = target
        elif min_slices:
            # not both: cotengra's slicer stops at the first target met but keeps only slicings
            # that meet both, so a tree that fits the size unsliced had none and the search
            # failed (KeyError 'tree'); the planner adds the slices min_slices asks for
            slicing["target_slices"] = int(min_slices)
        out.append(dict(base, slicing_opts=slicing, min_repeats=max(1, lo // len(targets)),
                        max_repeats=max(1, hi // len(targets))))
    return out


def _greedy_path(inputs, output, sizes) -> List[Tuple[int, int]]:
    """opt_einsum's greedy path, as pairs. Memoised: "auto" sizes its search with it and the
    planner's ``max_overhead`` yardstick (:func:`reference_costs`) asks for it again."""
    return list(_memo_greedy_path(tuple(map(tuple, inputs)), tuple(output), tuple(sorted(sizes.items()))))


@functools.lru_cache(maxsize=8)
def _memo_greedy_path(inputs, output, sizes) -> Tuple[Tuple[int, int], ...]:
    return tuple(check_path(opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes)),
                            len(inputs)))


def _empty_network_path(inputs, output, sizes) -> PathResult:
    """opt_einsum's greedy path for a network with a mode of extent 0: every path costs nothing
    and the result is zeros (cotengra's trials divide by the sizes and all fail)."""
    t0 = time.perf_counter()
    return PathResult(_greedy_path(inputs, output, sizes), None, "greedy", True, time.perf_counter() - t0)


def reference_costs(inputs, output, sizes, flops_per_mac: float = 2.0) -> Tuple[float, int]:
    """``(FLOPs, largest intermediate in elements)`` of opt_einsum's greedy path, unsliced: the
    yardstick of ``max_overhead`` where a plan's own path costs more unsliced (a path searched
    under a tight limit can be astronomically costly unsliced, and its slicing then looks cheap
    next to that)."""
    from .slicer import step_costs, step_table
    costs = step_costs(step_table(inputs, output, _greedy_path(inputs, output, sizes)), sizes, ())
    return flops_per_mac * costs.flops(), costs.largest


def find_path(inputs, output, sizes, optimize, limit_elems: Optional[int], min_slices: Optional[int],
              objective: Optional[Callable] = None, path_cache=None, select: Optional[Callable] = None,
              path_work: Optional[Callable] = None, path_exact_work: Optional[Callable] = None,
              cache_key=(), flops_per_mac: float = 2.0, write_macs: float = 0.0) -> PathResult:
    """The path for the network ``inputs -> output`` (mode ids, extents ``sizes``).

    ``optimize``: "auto" (see the module docstring; also ``True``), "greedy" (opt_einsum's,
    fast), "optimal", any opt_einsum path-optimizer name, "cotengra" (the "auto" hyper-search at
    any size), a cotengra optimizer object, an explicit path, or ``False`` (the operands left to
    right, as opt_einsum takes it). ``objective``: ``tree -> work`` for
    :class:`PlanObjective`; ``select``: ``tree -> work``, exact (after any further slicing),
    to choose between the searches' best trees; ``path_work``: ``path -> work`` (multiply-adds
    of the forward + backward, sliced to the limit), which sizes "auto"'s search budget under a
    limit or ``min_slices`` (a greedy path cheap unsliced can be costly sliced), and
    ``path_exact_work`` the same after any further slicing (what ``select`` scores), asked
    before "auto" settles for the greedy path; ``flops_per_mac``: real FLOPs per multiply-add
    (2; 8 for complex operands), which the search budget's time estimates count; ``write_macs``:
    what ``objective`` charges per element an intermediate writes (:data:`~.slicer.WRITE_MACS`
    unsliced), which the winner's subtree reconfiguration then minimises with the multiply-adds
    (cotengra's "combo" objective of that weight); ``path_cache``:
    the on-disk cache's directory (None: ``$TORCH_GRADOPS_PATH_CACHE`` or no disk cache), its
    entries keyed by the search options and ``cache_key`` (what else shapes the objective)."""
    n = len(inputs)
    if n == 1:
        return PathResult([], None, "single", False)
    if optimize is True:  # opt_einsum's (and numpy's) spelling of "optimise": ours is "auto"
        optimize = "auto"
    elif optimize is False:  # no optimisation: the operands left to right, as opt_einsum does then
        return PathResult(check_path([tuple(range(n))], n), None, "left-to-right", False)
    slices = limit_elems is not None or bool(min_slices)  # whether the search's trials slice
    if isinstance(optimize, str):
        name = optimize
        budget = None
        if name == "auto" and n > SMALL:
            # as much search as the contraction is worth: a greedy path first tells how much
            t0 = time.perf_counter()
            greedy = _greedy_path(inputs, output, sizes)
            sliced = None
            if path_work is not None and (limit_elems is not None or min_slices):
                try:
                    sliced = flops_per_mac * path_work(greedy)
                except ValueError:  # too many slices to plan: the search decides
                    sliced = math.inf
            flops, _ = reference_costs(inputs, output, sizes, flops_per_mac)
            budget = search_budget(n, flops, sliced, slices)
            if budget["min_repeats"] < 2 and sliced is not None and path_exact_work is not None:
                # Before settling for greedy, its plan as it would run: the proxy leaves out the
                # compiled layout's copies, for which the memory model may slice much further
                # (a 194-tensor circuit at 4 KiB: 16,384 slices where the proxy had a few
                # hundred, 19 s estimated, against 0.05 s for the searched plan).
                try:
                    exact = flops_per_mac * path_exact_work(greedy)
                except ValueError:
                    exact = math.inf
                if exact > sliced:
                    budget = search_budget(n, flops, exact, slices)
            if budget["min_repeats"] < 2:
                return PathResult(greedy, None, "greedy", True, time.perf_counter() - t0)
            name = "cotengra"
        elif name == "auto":
            name = "auto"
        if name == "cotengra" and 0 in sizes.values():
            return _empty_network_path(inputs, output, sizes)
        if name == "cotengra":
            if budget is None:  # asked for by name: the full search
                budget = {"min_repeats": _max_trials(n), "max_repeats": _max_trials(n)}
            obj = PlanObjective(objective) if objective is not None else "flops"

            def more(trials):
                return (isinstance(obj, PlanObjective) and bool(obj.top)
                        and wants_more(n, trials, obj.top[0][0], slices, flops_per_mac))
            opts = hyper_options(budget, limit_elems, min_slices, obj, more)
            key = tuple(tuple(sorted((k, repr(v)) for k, v in o.items() if k not in ("minimize", "more")))
                        for o in opts) + (repr(cache_key),)
            token = _HOPELESS_SIZE.set(None if limit_elems is None else int(limit_elems) * MAX_SLICES)
            try:
                return _cotengra_search(opts, inputs, output, sizes, "cotengra", _cache_directory(path_cache, key),
                                        score=select, candidates=obj.top if isinstance(obj, PlanObjective) else (),
                                        polish=lambda work, trees: worth_polishing(n, work, trees, flops_per_mac),
                                        reconfigure_minimize=f"combo-{write_macs:g}" if write_macs else "flops")
            finally:
                _HOPELESS_SIZE.reset(token)
        try:
            fn = opt_einsum.paths.get_path_fn(name)
        except KeyError:
            raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra', an opt_einsum "
                             f"path-optimizer name or an explicit path, got {optimize!r}") from None
        t0 = time.perf_counter()
        path = fn([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
        return PathResult(check_path(path, n), None, optimize, True, time.perf_counter() - t0)
    if hasattr(optimize, "search"):  # a cotengra optimizer object
        if 0 in sizes.values():
            return _empty_network_path(inputs, output, sizes)
        return _cotengra_search(optimize, inputs, output, sizes)
    # an opt_einsum optimizer object (cotengra's are PathOptimizers too: taken above)
    if isinstance(optimize, opt_einsum.paths.PathOptimizer):
        t0 = time.perf_counter()
        path = optimize([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
        return PathResult(check_path(path, n), None, type(optimize).__name__, True, time.perf_counter() - t0)
    if isinstance(optimize, (list, tuple)):
        return PathResult(check_path(optimize, n), None, "explicit", False)
    raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra', True, False or an explicit path, "
                     f"got {optimize!r}")


def check_path(path, n) -> List[Tuple[int, int]]:
    """Validate a path (opt_einsum linear format) and return it as pairs: k-ary steps split into
    pairs, one-operand steps dropped (opt_einsum's "dp" emits them to sum a mode within one
    operand; moving that operand last changes no contraction, and the executor sums such modes
    in the step that reads the operand)."""
    live, ssa = list(range(n)), []
    for step in path:
        if not isinstance(step, (list, tuple)) or not all(isinstance(p, int) and not isinstance(p, bool) for p in step):
            raise ValueError(f"optimize: explicit path step {step!r} is not a tuple of operand positions")
        if not step or len(set(step)) != len(step) or any(not 0 <= p < len(live) for p in step):
            raise ValueError(f"optimize: explicit path step {tuple(step)} is invalid with {len(live)} operands "
                             "left (each step names distinct positions)")
        ids = [live[p] for p in sorted(step)]
        for p in sorted(step, reverse=True):
            live.pop(p)
        cur = ids[0]
        for other in ids[1:]:  # the running result with each further operand, in position order
            ssa.append((cur, other))
            cur = n + len(ssa) - 1
        live.append(cur)
    if len(live) != 1:
        raise ValueError(f"optimize: explicit path leaves {len(live)} operands; it must contract all {n} into one")
    # SSA ids -> linear positions: operands and results are listed in order of creation, so an
    # id's position is the number of live ids below it
    out, alive = [], list(range(n))
    for a, b in ssa:
        i, j = alive.index(a), alive.index(b)
        out.append((min(i, j), max(i, j)))
        alive.remove(a)
        alive.remove(b)
        alive.append(n + len(out) - 1)
    return out


def heavy_last(path, n: int, weight) -> List[Tuple[int, int]]:
    """The same contraction tree as ``path`` (linear format, ``n`` operands), its steps in
    depth-first order with, at every step, the operand whose subtree has the larger total
    ``weight`` (per step of ``path``, e.g. its multiply-adds) computed last.

    Why: the executor's backward recomputes every step before its last checkpoint
    (:func:`~.slicer.place_checkpoints`), so the later the expensive subtrees come, the less a
    memory-bounded backward recomputes; the lighter siblings finished first are what a
    checkpoint then holds."""
    children = {n + j: tuple(c) for j, c in enumerate(linear_to_ssa(path))}
    if not children:
        return []
    total = {}
    for v, (a, b) in children.items():  # children are made before their parents
        total[v] = weight[v - n] + total.get(a, 0) + total.get(b, 0)
    order, stack = [], [(n + len(path) - 1, False)]
    while stack:  # post-order, lighter child first
        v, ready = stack.pop()
        if ready:
            order.append(v)
            continue
        stack.append((v, True))
        a, b = children[v]
        first, last = sorted((a, b), key=lambda c: (total.get(c, 0), c))
        for c in (last, first):
            if c in children:
                stack.append((c, False))
    new_path, pos, live = [], {}, list(range(n))
    for v in order:
        a, b = (live.index(pos.get(c, c)) for c in children[v])
        new_path.append((min(a, b), max(a, b)))
        for p in sorted((a, b), reverse=True):
            live.pop(p)
        pos[v] = n + len(new_path) - 1
        live.append(pos[v])
    return new_path
