"""The compiler: lowers a path and its slicing to a contraction program (:mod:`.program`).

The work is done in C++ (``csrc/contract_compiler.cpp``), once per plan; this module states the
rules and converts the arguments.

Each pairwise step becomes one batched GEMM (``bmm``). Sliced modes are selected first (the
backward views gradient buffers through those selections) and modes that no one else needs are
summed before a step. The compiler lays out each operand and result so that, where the memory
order allows, an operand enters ``bmm`` as a view (possibly transposed) rather than a copy, and
each step's result comes out in the order its consumer wants:

* An operand can enter as a view when its memory holds the batch modes outermost and then the
  free and the contracted modes as two blocks, each group mergeable by a reshape (modes of
  extent 1 fit anywhere); two viewed operands must hold their batch and contracted modes in
  the same orders. Otherwise it is copied, in any order.
* The search (steps of at least :data:`QUICK_MACS` multiply-adds over all slices) minimises
  the estimated cost, in element copies, of the copies made now: a permuted copy costs its
  elements times ``1 + 256 / (contiguous bytes per inner loop)`` (measured on CPU), plus twice
  the result's size when its consumer would have to copy it (one step of look-ahead: the orders
  of a copied operand, the consumer's or as stored, and the side of the result, ``[batch,
  left, right]`` or transposed, are chosen for the consumer), plus a penalty of the step's
  multiply-adds (5% of them for complex types) for a result whose rows are shorter than 16
  elements and than its columns (on CPU a ``[59049, 9] = [59049, 18] @ [18, 9]`` float32 GEMM
  takes about 5x as long as its transpose). Ties go to fewer copies, then to the untransposed
  result, then to the first candidate (the consumer's order before the stored one, the first
  operand's memory order before the second's).
* Smaller steps (GEMMs of microseconds, where a layout's copies cost about as much as the call
  itself; a circuit has hundreds of them) get a quick layout: views when both operands allow
  and agree, else the first operand's view with the second copied, else both copied in the
  first operand's order, free modes in the consumer's order, never transposed.

The layout is a pure function of the step (labels do not matter), so programs are
deterministic.
"""
from __future__ import annotations

from typing import List, Tuple

from .. import library

__all__ = ["compile_program"]

# Steps of fewer multiply-adds than this over all slices get the quick layout (see above).
QUICK_MACS = 1 << 14


def compile_program(inputs, output, sizes, path, sliced, itemsize=8, is_complex=False, checkpoints=(),
                    quick_macs=None) -> Tuple[Tuple[int, ...], List[tuple]]:
    """``(program, steps)``: the encoded program (:func:`~.program.encode`'s format) of ``path``
    over the network ``inputs -> output`` (mode ids: the planner's ``0 .. n-1``, other hashable
    labels are renumbered; extents ``sizes``: a dict, or a sequence indexed by id) with the
    ``sliced`` modes selected and a CHECKPOINT before each step in ``checkpoints``; and per step,
    for one slice: (multiply-adds, result elements, GEMM operand elements, the steps whose
    results it copies into GEMM layout, whether its result is copied by the step that reads it)
    -- the last two for the memory model (:func:`~.slicer.memory_model`). ``quick_macs``: the
    threshold of the quick layouts (default :data:`QUICK_MACS`). A path that does not contract
    every operand into one raises ValueError."""
    if isinstance(sizes, dict):
        if not all(isinstance(m, int) and 0 <= m < 4 * len(sizes) + 64 for m in sizes):
            ids = {m: i for i, m in enumerate(sizes)}  # other labels: renumber them
            inputs, output = [[ids[m] for m in t] for t in inputs], [ids[m] for m in output]
            sliced, sizes = [ids[m] for m in sliced], {ids[m]: e for m, e in sizes.items()}
        dense = [1] * (max(sizes, default=-1) + 1)
        for m, e in sizes.items():
            dense[m] = e
        sizes = dense
    try:
        program, steps = library._C.compile_contract_program(
            [list(t) for t in inputs], list(output), list(sizes), [tuple(p) for p in path], list(sliced),
            int(itemsize), bool(is_complex), list(checkpoints), QUICK_MACS if quick_macs is None else int(quick_macs))
    except OverflowError:  # an intermediate, or a step's multiply-adds, of 2^63 or more
        raise ValueError("a size or a step's cost on this contraction path reaches 2^63 (int64), beyond what any "
                         "device holds or runs; slicing (a memory_limit, or a smaller one) or another path may avoid "
                         "it, unless the operands themselves are that large") from None
    return program, steps

