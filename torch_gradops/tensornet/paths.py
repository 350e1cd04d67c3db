"""Contraction paths: opt_einsum's optimizers, one cotengra adapter, and explicit paths.

A path is opt_einsum's linear format: a list of pairs of positions in the current operand list;
the pair's result goes to the end of the list.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import opt_einsum

__all__ = ["PathResult", "find_path", "check_path"]


@dataclass(frozen=True)
class PathResult:
    """A path, the sliced modes the optimizer suggests (or None), the optimizer's name, and
    whether a search ran (an explicit path or a single operand needs none)."""
    path: List[Tuple[int, int]]
    sliced: Optional[List[int]]
    optimizer: str
    searched: bool


def _cotengra_search(optimizer, inputs, output, sizes) -> PathResult:
    """Run a cotengra optimizer on integer modes; cotengra wants single-character symbols."""
    sym = {m: opt_einsum.get_symbol(m) for m in sizes}
    back = {v: k for k, v in sym.items()}
    tree = optimizer.search([[sym[m] for m in t] for t in inputs], [sym[m] for m in output],
                            {sym[m]: e for m, e in sizes.items()})
    return PathResult([tuple(p) for p in tree.get_path()], [back[s] for s in tree.sliced_inds], "cotengra", True)


def find_path(inputs, output, sizes, optimize, limit_elems: Optional[int], min_slices: Optional[int]) -> PathResult:
    """The path for the network ``inputs -> output`` (mode ids, extents ``sizes``).

    ``optimize``: "auto" (opt_einsum's choice; "greedy" beyond 64 operands), "greedy",
    "optimal", any opt_einsum path-optimizer name, "cotengra" (a ``HyperOptimizer`` slicing to
    ``limit_elems`` / ``min_slices``), a cotengra optimizer object, or an explicit path."""
    n = len(inputs)
    if n == 1:
        return PathResult([], None, "single", False)
    if isinstance(optimize, str):
        name = optimize
        if name == "auto":
            name = "auto" if n <= 64 else "greedy"
        if name == "cotengra":
            try:
                import cotengra
            except ImportError:
                raise ValueError("optimize='cotengra' needs the cotengra package (pip install cotengra)") from None
            slicing_opts = {}
            if limit_elems is not None:
                slicing_opts["target_size"] = limit_elems
            if min_slices:
                slicing_opts["target_slices"] = min_slices
            opt = cotengra.HyperOptimizer(max_repeats=32, progbar=False, parallel=False,
                                          slicing_opts=slicing_opts or None)
            return _cotengra_search(opt, inputs, output, sizes)
        try:
            fn = opt_einsum.paths.get_path_fn(name)
        except KeyError:
            raise ValueError(f"optimize must be 'auto', 'greedy', 'optimal', 'cotengra', an opt_einsum "
                             f"path-optimizer name or an explicit path, got {optimize!r}") from None
        path = fn([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
        return PathResult([tuple(p) for p in path], None, optimize, True)
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
