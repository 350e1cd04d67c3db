"""The contraction compiler's layout rules in plain Python: the reference that
``csrc/contract_compiler.cpp`` (``torch_gradops.tensornet.compiler``) must match program for
program (``tests/test_tensornet_program.py``). The rules are stated in compiler.py's docstring.

``compile_program`` returns ``(Program, steps)``; candidates are tried in the same order as in
C++, so that ties go the same way."""
from __future__ import annotations

import math
from typing import List

from torch_gradops.tensornet import program as fmt


def _contiguous_strides(modes, sizes):
    strides, acc = {}, 1
    for m in reversed(modes):
        strides[m] = acc
        acc *= max(sizes[m], 1)
    return strides


def _view_orders(modes, strides, group, sizes):
    """How a slot (``modes`` in dimension order, ``strides`` per mode) can enter a GEMM without a
    copy: ``(orders, contr_first)`` with ``orders[g]`` the modes of group ``g`` ('b' batch, 'k'
    contracted, 'f' free) in memory order, when the slot's memory holds the batch modes
    outermost and then the free and the contracted modes as two blocks, each group mergeable
    by a reshape (singleton modes fit anywhere); None when a copy is needed. The compiler holds
    every slot with strides non-increasing in dimension order, so memory order is dimension
    order."""
    seq = [m for m in modes if sizes[m] > 1]
    blocks, runs, run = [], {}, 0
    for j, m in enumerate(seq):
        if j and strides[seq[j - 1]] != strides[m] * sizes[m]:
            run += 1  # not mergeable with the previous mode (a sliced mode was selected between)
        g = group[m]
        if not blocks or blocks[-1] != g:
            if g in blocks:
                return None  # a group split in two
            blocks.append(g)
        if runs.setdefault(g, run) != run:
            return None  # a group a reshape cannot merge
    if "b" in blocks and blocks[0] != "b":
        return None
    orders = {g: [m for m in seq if group[m] == g] for g in "bkf"}
    for m in modes:
        if sizes[m] <= 1:
            orders[group[m]].append(m)
    rest = [g for g in blocks if g != "b"]
    return orders, bool(rest) and rest[0] == "k"


def _consumer_groups(lay, cur, path, count):
    """Per intermediate slot, the role of each of its modes at the step that consumes it ('s'
    summed first, 'b' batch, 'k' contracted, 'f' free); 'final' for the last one. Depends only
    on the path, so the compiler can lay out each step's result for its consumer."""
    cnt = dict(count)
    slots = list(cur)
    msets = [set(lay[s][0]) for s in cur]
    nslot = len(lay)
    consumer = {}
    for pair in path:
        p, q = sorted(pair)
        sb, setb = slots.pop(q), msets.pop(q)
        sa, seta = slots.pop(p), msets.pop(p)
        for m in seta:
            cnt[m] -= 1
        for m in setb:
            cnt[m] -= 1
        res = set()
        for s, mine, other in ((sa, seta, setb), (sb, setb, seta)):
            g = {}
            for m in mine:
                if m in other:
                    g[m] = "b" if cnt[m] > 0 else "k"
                elif cnt[m] == 0:
                    g[m] = "s"
                else:
                    g[m] = "f"
            consumer[s] = g
            res |= {m for m, r in g.items() if r in "bf"}
        for m in res:
            cnt[m] += 1
        slots.append(nslot)
        msets.append(res)
        nslot += 1
    if slots:
        consumer[slots[-1]] = "final"
    return consumer


def _result_fits(cm, cons, sizes, kept):
    """Whether the consumer can use a contiguous result with modes ``cm`` without a copy."""
    seq = [m for m in cm if sizes[m] > 1]
    if cons == "final":
        return seq == [m for m in kept if sizes[m] > 1]
    blocks = []
    for m in seq:
        g = cons[m]
        if g == "s":
            continue  # summed first: the sum's result is contiguous in the remaining order
        if not blocks or blocks[-1] != g:
            if g in blocks:
                return False
            blocks.append(g)
    return "b" not in blocks or blocks[0] == "b"


def _copy_cost(modes, strides, order, sizes, itemsize):
    """Estimated cost, in element-copies, of copying a slot into ``order``: its elements times a
    factor for short inner runs (a permuted copy whose innermost destination modes are not
    contiguous in the source moves a few bytes per inner loop; measured on CPU, about
    1 + 256 / (contiguous bytes per inner loop) times a plain copy)."""
    run, expect = 1, 1
    for m in reversed([m for m in order if sizes[m] > 1]):
        if strides[m] != expect:
            break
        run *= sizes[m]
        expect *= sizes[m]
    return math.prod(sizes[m] for m in modes) * (1 + 256 / (run * itemsize))


def _consumer_rank(cons, kept, roles="bkfs"):
    """Per mode of a step's result, its rank in the order its consumer wants: the position in
    the output (``cons`` "final", ``kept`` the output's modes), else the index of its role in
    ``roles``."""
    if cons == "final":
        return {m: j for j, m in enumerate(kept)}
    return {m: roles.index(g) for m, g in cons.items()}


def _views_agree(va, vb, sizes):
    """Whether two operands' views (:func:`_view_orders`) hold the batch and the contracted
    modes of extent > 1 in the same orders, as bmm needs when neither is copied."""
    nz = lambda ms: [m for m in ms if sizes[m] > 1]  # noqa: E731
    return nz(va[0]["b"]) == nz(vb[0]["b"]) and nz(va[0]["k"]) == nz(vb[0]["k"])


def _gemm_layout(ma, sta, mb, stb, group_a, group_b, sizes, cons, kept, itemsize=8, is_complex=False):
    """Layout of one pairwise step. Each operand enters bmm as a view when its memory allows
    ([batch, free, contr] or [batch, contr, free]; bmm takes the transposed view without
    copying) or as a copy in any order; the result is [batch, left, right] or, computing it
    transposed, [batch, right, left]. Among these choices, minimise the estimated cost of the
    copies made now (:func:`_copy_cost`), plus twice the result's size when its consumer would
    have to copy it (one step of look-ahead: the orders of a copied operand and the side of
    the result are chosen for the consumer), plus a penalty for a result whose rows are
    shorter than 16 elements and than its columns (measured on CPU: a [59049, 9] = [59049, 18]
    @ [18, 9] float32 GEMM takes about 5x as long as its transpose [9, 59049]; complex GEMMs
    care much less). Costs are in element copies. Returns (swap, per side: (copied, orders,
    contr_first))."""
    va = _view_orders(ma, sta, group_a, sizes)
    vb = _view_orders(mb, stb, group_b, sizes)
    batch = [m for m in ma if group_a[m] == "b"]
    contr = [m for m in ma if group_a[m] == "k"]
    left = [m for m in ma if group_a[m] == "f"]
    right = [m for m in mb if group_b[m] == "f"]
    size_c = math.prod(sizes[m] for m in batch + left + right)
    size_l = math.prod(sizes[m] for m in left)
    size_r = math.prod(sizes[m] for m in right)
    macs = size_c * math.prod(sizes[m] for m in contr)
    narrow = macs * (0.05 if is_complex else 1.0)  # cost of rows < 16 elements (see above)
    keys = [_consumer_rank(cons, kept)]
    if cons != "final":  # the consumer takes its free modes before or after the contracted ones
        keys.append(_consumer_rank(cons, kept, "bfks"))

    memo = {}

    def copied(side, b, k, f):
        """(cost, orders, contr_first) of the cheaper stored layout of a copied operand."""
        key = (side, tuple(b), tuple(k), f)
        if key not in memo:
            modes, strides = (ma, sta) if side == 0 else (mb, stb)
            f = list(f)
            memo[key] = min((_copy_cost(modes, strides, b + (k + f if cf else f + k), sizes, itemsize), cf)
                            for cf in (False, True)) + ({"b": b, "k": k, "f": f},)
        cost, cf, orders = memo[key]
        return cost, orders, cf

    best = None
    for copy_a in ((False, True) if va else (True,)):
        for copy_b in ((False, True) if vb else (True,)):
            if not copy_a and not copy_b:
                if not _views_agree(va, vb, sizes):
                    continue
                shared = [(None, None)]
            elif not copy_a:
                shared = [(va[0]["b"], va[0]["k"])]
            elif not copy_b:
                shared = [(vb[0]["b"], vb[0]["k"])]
            else:  # both copied: batch and contracted orders free; try each operand's memory order
                shared = []  # each operand's memory (= dimension) order, a's first
                for mem in (ma, mb):
                    bk = ([m for m in mem if m in batch], [m for m in mem if m in contr])
                    if bk not in shared:
                        shared.append(bk)
            for rank in keys:
                by = lambda ms: tuple(sorted(ms, key=lambda m: rank.get(m, 0)))  # noqa: E731
                # a copied operand's free modes: the consumer's order or as stored
                orders = lambda ms: [by(ms)] + ([tuple(ms)] if by(ms) != tuple(ms) else [])  # noqa: E731
                for b_ord, k_ord in shared:
                    if copy_a:
                        fa = [m for m in ma if m in left]
                        opts_a = [copied(0, b_ord, k_ord, f) for f in orders(fa)]
                    else:
                        opts_a = [(0, va[0], va[1])]
                    if copy_b:
                        fb = [m for m in mb if m in right]
                        opts_b = [copied(1, b_ord, k_ord, f) for f in orders(fb)]
                    else:
                        opts_b = [(0, vb[0], vb[1])]
                    for cost_a, oa, cfa in opts_a:
                        for cost_b, ob, cfb in opts_b:
                            for swap in (0, 1):
                                x = ob if swap else oa
                                cm = x["b"] + (ob["f"] + oa["f"] if swap else oa["f"] + ob["f"])
                                fits = _result_fits(cm, cons, sizes, kept)
                                cols, rows = (size_l, size_r) if swap else (size_r, size_l)
                                cost = cost_a + cost_b + (0 if fits else 2 * size_c) + \
                                    (narrow if cols < 16 and rows > cols else 0)
                                key = (cost, copy_a + copy_b, swap)
                                if best is None or key < best[0]:
                                    best = (key, swap, (copy_a, oa, cfa), (copy_b, ob, cfb))
                                    if cost == 0 and not swap:
                                        return best[1:]  # nothing is copied: cannot do better
    return best[1:]


def _quick_layout(ma, sta, mb, stb, group_a, group_b, sizes, cons, kept):
    """The layout of a step too small to be worth :func:`_gemm_layout`'s search
    (``quick_macs``), in its return format: an operand enters bmm as a view when its memory
    allows and the other operand can follow its batch and contracted orders, else as a copy
    whose free modes come in the order the result's consumer wants; never transposed."""
    va = _view_orders(ma, sta, group_a, sizes)
    vb = _view_orders(mb, stb, group_b, sizes)
    if va and vb:
        if _views_agree(va, vb, sizes):
            return 0, (False, va[0], va[1]), (False, vb[0], vb[1])
        vb = None  # they disagree: copy b
    if va:
        b, k = va[0]["b"], va[0]["k"]
    elif vb:
        b, k = vb[0]["b"], vb[0]["k"]
    else:  # both copied: batch and contracted modes in a's memory (= dimension) order
        b = [m for m in ma if group_a[m] == "b"]
        k = [m for m in ma if group_a[m] == "k"]
    rank = _consumer_rank(cons, kept)

    def copy(modes, group, contr_first):
        free = sorted((m for m in modes if group[m] == "f"), key=lambda m: rank.get(m, 0))
        return True, {"b": b, "k": k, "f": free}, contr_first

    # a copied x is stored [batch, free, contracted], a copied y [batch, contracted, free]: no
    # transposed view
    return (0, (False, va[0], va[1]) if va else copy(ma, group_a, False),
            (False, vb[0], vb[1]) if vb else copy(mb, group_b, True))


def _step_layout(ma, sta, mb, stb, group_a, group_b, sizes, cons, kept, itemsize, is_complex, repeats,
                 quick_macs):
    macs = math.prod(sizes[m] for m in set(ma) | set(mb))
    if macs * repeats < quick_macs:
        return _quick_layout(ma, sta, mb, stb, group_a, group_b, sizes, cons, kept)
    return _gemm_layout(ma, sta, mb, stb, group_a, group_b, sizes, cons, kept, itemsize, is_complex)


def compile_program(inputs, output, sizes, path, sliced, itemsize=8, is_complex=False, checkpoints=(),
                    quick_macs=1 << 14):
    """``(program, steps)``: the :class:`~.program.Program` of ``path`` over the network
    ``inputs -> output`` (mode ids, extents ``sizes``) with ``sliced`` modes selected and a
    CHECKPOINT before each step in ``checkpoints``; and per step, for one slice: (multiply-adds,
    result elements, GEMM operand elements, the steps whose results it copies into GEMM layout,
    whether its result is copied by the step that reads it) -- the last two for the memory
    model (:func:`~.slicer.memory_model`)."""
    slot_of_k = {m: k for k, m in enumerate(sliced)}
    sset = set(sliced)
    nslices = math.prod(sizes[m] for m in sset)
    instrs: List = []
    count = {}
    for t in list(inputs) + [output]:
        for m in t:
            count[m] = count.get(m, 0) + 1
    # per slot: (modes in dimension order, stride per mode) as the executor will hold it; strides
    # never increase along the dimensions (contiguous, or a contiguous operand with sliced modes
    # selected), which the layout functions rely on
    lay = []
    for i, t in enumerate(inputs):
        modes = list(t)
        strides = _contiguous_strides(modes, sizes)  # operands are assumed contiguous
        for m in sliced:  # SELECTs first: the backward views gradient buffers through them
            if m in modes:
                d = modes.index(m)
                instrs.append(fmt.Select(i, d, slot_of_k[m]))
                modes.pop(d)
        dims = [d for d, m in enumerate(modes) if count[m] == 1]  # only here, not in the output
        if dims:
            instrs.append(fmt.Sum(i, tuple(dims)))
            for m in modes:
                if count[m] == 1:
                    count[m] = 0
            modes = [m for m in modes if count[m] != 0]
            strides = _contiguous_strides(modes, sizes)
        lay.append((modes, strides))
    cur = list(range(len(inputs)))
    # sliced modes are gone everywhere
    for m in sset:
        count[m] = 0
    kept = [m for m in output if m not in sset]
    consumer = _consumer_groups(lay, cur, path, count)
    steps = []
    nslot = len(inputs)
    n_in = len(inputs)
    result_copied = [False] * len(path)
    checkpoints = set(checkpoints)
    for j, pair in enumerate(path):
        if j in checkpoints:
            instrs.append(fmt.Checkpoint())
        p, q = sorted(pair)
        sb = cur.pop(q)
        sa = cur.pop(p)
        ma, mb = lay[sa][0], lay[sb][0]
        for m in ma:
            count[m] -= 1
        for m in mb:
            count[m] -= 1
        # modes of one side that no one else needs: sum them before the GEMM
        for side, other in ((sa, set(mb)), (sb, set(ma))):
            modes = lay[side][0]
            dims = [d for d, m in enumerate(modes) if m not in other and count[m] == 0]
            if dims:
                instrs.append(fmt.Sum(side, tuple(dims)))
                modes = [m for d, m in enumerate(modes) if d not in dims]
                lay[side] = (modes, _contiguous_strides(modes, sizes))
        (ma, sta), (mb, stb) = lay[sa], lay[sb]
        seta, setb = set(ma), set(mb)
        group_a = {m: ("b" if count[m] > 0 else "k") if m in setb else "f" for m in ma}
        group_b = {m: ("b" if count[m] > 0 else "k") if m in seta else "f" for m in mb}
        swap, (copy_a, oa, cfa), (copy_b, ob, cfb) = _step_layout(ma, sta, mb, stb, group_a, group_b, sizes,
                                                                  consumer[nslot], kept, itemsize, is_complex, nslices,
                                                                  quick_macs)
        # X enters bmm as [Bt,M,K] (stored [Bt,K,M] if tx), Y as [Bt,K,N] (stored [Bt,N,K] if ty)
        (sx, mx, ox, fx), (sy, my, oy, fy) = ((sb, mb, ob, cfb), (sa, ma, oa, cfa)) if swap \
            else ((sa, ma, oa, cfa), (sb, mb, ob, cfb))
        tx = bool(fx)  # stored [Bt,K,M] when the contracted modes come first
        ty = not fy
        dx, dy = {m: d for d, m in enumerate(mx)}, {m: d for d, m in enumerate(my)}
        px = tuple(dx[m] for m in (ox["b"] + ox["k"] + ox["f"] if tx else ox["b"] + ox["f"] + ox["k"]))
        py = tuple(dy[m] for m in (oy["b"] + oy["f"] + oy["k"] if ty else oy["b"] + oy["k"] + oy["f"]))
        bt = math.prod(sizes[m] for m in ox["b"])
        mm = math.prod(sizes[m] for m in ox["f"])
        kk = math.prod(sizes[m] for m in ox["k"])
        nn = math.prod(sizes[m] for m in oy["f"])
        cm = ox["b"] + ox["f"] + oy["f"]
        instrs.append(fmt.Contract(sx, sy, nslot, px, py, tx, ty, bt, mm, kk, nn, tuple(sizes[m] for m in cm)))
        for m in cm:
            count[m] += 1
        copied = []
        for side, cp in ((sa, copy_a), (sb, copy_b)):
            if side >= n_in and cp:
                copied.append(side - n_in)
                result_copied[side - n_in] = True
        steps.append([bt * mm * kk * nn, bt * mm * nn, bt * kk * (mm + nn), tuple(copied), False])
        lay.append((cm, _contiguous_strides(cm, sizes)))
        cur.append(nslot)
        nslot += 1
    if len(cur) != 1:
        raise ValueError(f"the contraction path leaves {len(cur)} tensors; it must contract all operands into one")
    slot = cur[0]
    modes = lay[slot][0]
    if sorted(modes) != sorted(kept):
        raise AssertionError(f"internal: final modes {modes} != output {kept}")
    perm = tuple(modes.index(m) for m in kept)
    blocks = tuple(sorted(((pos, slot_of_k[m]) for pos, m in enumerate(output) if m in sset), reverse=True))
    instrs.append(fmt.Final(slot, perm, blocks))
    program = fmt.Program(len(inputs), len(sliced), tuple(sizes[m] for m in output), tuple(instrs))
    for j, st in enumerate(steps):
        st[4] = result_copied[j]
    return program, [tuple(st) for st in steps]
