"""Tests of torch_gradops.tensornet: values and gradients against torch.einsum, slicing,
slice groups, double backward, forward AD, plan cache, validation, memory bound, dtypes,
torch.compile and opcheck."""
import contextlib
import ctypes
import importlib
import math
import os
import random
import re
import string
import warnings

import pytest
import torch

import opt_einsum
from torch_gradops import tensornet as tn
from torch_gradops.tensornet import autograd as tn_autograd
from torch_gradops.tensornet.compiler import compile_program
from torch_gradops.tensornet.program import Checkpoint, Contract, decode
from torch_gradops.testing import circuit_amplitude_network, einsum_pairwise, interleave, lattice_network, mps_network
from torch_gradops.testing import peak_allocated_bytes as _peak_bytes

F64, C128 = torch.float64, torch.complex128


def _rand(shape, dtype=F64, gen=None, requires_grad=False):
    t = torch.randn(shape, dtype=dtype, generator=gen)
    return t.requires_grad_(requires_grad)


def _close(a, b, rtol=1e-9, atol=1e-9, msg=None):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=msg)


def _check_against_einsum(expr, ops, **kw):
    """Value and every operand's gradient (random output cotangent) vs torch.einsum."""
    ops = [o.detach().clone().requires_grad_(o.dtype.is_floating_point or o.dtype.is_complex) for o in ops]
    ref_ops = [o.detach().clone().requires_grad_(True) for o in ops]
    out = tn.contract(expr, *ops, **kw)
    ref = torch.einsum(expr, *ref_ops)
    assert out.shape == ref.shape
    _close(out, ref)
    g = torch.randn(ref.shape, dtype=ref.dtype)
    grads = torch.autograd.grad(out, ops, g)
    ref_grads = torch.autograd.grad(ref, ref_ops, g)
    for a, b in zip(grads, ref_grads):
        _close(a, b)


# ---------------------------------------------------------------------------- random family
def _random_network(rng: random.Random, max_ops=5):
    """Random expression with hyperedges, traces/diagonals, batch and singleton modes."""
    n_ops = rng.randint(1, max_ops)
    n_modes = rng.randint(1, 7)
    labels = rng.sample(string.ascii_letters, n_modes)
    extent = {m: rng.choice([1, 2, 3, 4]) for m in labels}
    terms = []
    for _ in range(n_ops):
        rank = rng.randint(0, 4)
        term = [rng.choice(labels) for _ in range(rank)]  # repeats give diagonals/traces
        terms.append(term)
    used = sorted({m for t in terms for m in t})
    if rng.random() < 0.3:
        expr = ",".join("".join(t) for t in terms)  # implicit output
    else:
        out = [m for m in used if rng.random() < 0.4]
        rng.shuffle(out)
        expr = ",".join("".join(t) for t in terms) + "->" + "".join(out)
    shapes = [tuple(extent[m] for m in t) for t in terms]
    return expr, shapes


@pytest.mark.parametrize("seed", range(60))
def test_random_expressions_match_einsum(seed):
    rng = random.Random(seed)
    expr, shapes = _random_network(rng)
    gen = torch.Generator().manual_seed(seed)
    ops = [_rand(s, gen=gen) for s in shapes]
    _check_against_einsum(expr, ops)


@pytest.mark.parametrize("seed", range(20))
def test_random_expressions_sliced_match_einsum(seed):
    rng = random.Random(1000 + seed)
    while True:
        expr, shapes = _random_network(rng, max_ops=6)
        if len(shapes) >= 2:
            break
    gen = torch.Generator().manual_seed(seed)
    ops = [_rand(s, gen=gen) for s in shapes]
    try:
        p = tn.plan(expr, *ops, slicing={"min_slices": 4})
    except ValueError as e:  # nothing sliceable (all extents 1 or too few shared modes)
        assert "min_slices" in str(e)
        p = tn.plan(expr, *ops, slicing={"min_slices": 2}) if "only 1 " not in str(e) else tn.plan(expr, *ops)
    _check_against_einsum(expr, ops, plan=p)


def test_random_networks_under_memory_limits_match_einsum():
    """Random networks of 4-12 tensors (hyperedges, repeated modes, open modes; real and
    complex) planned under a memory limit of 1/1 to 1/64 of their unsliced largest
    intermediate with each optimizer: slicing, mode chunks, checkpoints and hoisting in every
    combination the planner picks, value and gradients against torch.einsum."""
    kinds = {}
    for seed in range(24):
        rng = random.Random(7000 + seed)
        labels = rng.sample(string.ascii_letters, rng.randint(4, 14))
        extent = {m: rng.choice([2, 2, 3, 4, 5, 6]) for m in labels}
        terms = [rng.sample(labels, k) if rng.random() < 0.9 else [rng.choice(labels) for _ in range(k)]
                 for k in (rng.randint(1, 4) for _ in range(rng.randint(4, 12)))]
        out = [m for m in sorted({m for t in terms for m in t}) if rng.random() < 0.2]
        expr = ",".join("".join(t) for t in terms) + "->" + "".join(out)
        dtype = torch.complex128 if rng.random() < 0.3 else F64
        gen = torch.Generator().manual_seed(seed)
        ops = [_rand(tuple(extent[m] for m in t), dtype=dtype, gen=gen) for t in terms]
        largest = tn.plan(expr, *ops).largest_intermediate[1]
        limit = max(16, largest // rng.choice([1, 2, 4, 8, 16, 64]))
        try:
            p = tn.plan(expr, *ops, memory_limit=limit, optimize=rng.choice(["auto", "greedy", "cotengra"]))
        except ValueError as e:
            assert "too expensive" in str(e)
            continue
        assert p.largest_intermediate[1] <= limit
        key = (p.num_slices > 1, p.hoisted is not None, len(p.checkpoints) > 0)
        kinds[key] = kinds.get(key, 0) + 1
        _check_against_einsum(expr, ops, plan=p)
    # the seeds cover sliced plans with checkpoints and hoisted ones
    assert kinds.get((True, False, True)) and any(h for (_, h, _) in kinds), kinds


# ---------------------------------------------------------------------------- edge cases
EDGE = [
    ("ii->", [(4, 4)]),                       # trace
    ("ii->i", [(4, 4)]),                      # diagonal
    ("iij,jk->ik", [(3, 3, 4), (4, 2)]),      # diagonal feeding a contraction
    ("iji->j", [(3, 2, 3)]),
    ("ij,jk,jl->ikl", [(2, 3), (3, 4), (3, 5)]),   # hyperedge in 3 operands
    ("bij,bjk->bik", [(3, 2, 4), (3, 4, 5)]),      # batch mode kept
    ("ij,ij,ij->ij", [(2, 3), (2, 3), (2, 3)]),    # hyperedge kept in the output
    ("ab,bc->", [(3, 4), (4, 5)]),                 # scalar output
    ("abc->", [(2, 3, 4)]),
    ("ab->ba", [(3, 4)]),                          # single operand permute
    ("ab", [(3, 4)]),                              # implicit identity
    ("a,b->ab", [(3,), (4,)]),                     # outer product
    ("a,a->", [(5,), (5,)]),
    (",->", [(), ()]),                             # scalars
    ("i,->i", [(3,), ()]),
    ("aib,bjc->aijc", [(1, 3, 1), (1, 4, 1)]),     # singleton modes
    ("ab,bc,cd,da->", [(1, 2), (2, 1), (1, 3), (3, 1)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),  # broadcasting
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)]),
    ("i...,i...->...", [(3, 2, 1), (3, 1, 4)]),
    ("...,...->...", [(2, 3), (3,)]),
    ("ij...,jk", [(2, 3, 5), (3, 4)]),             # implicit output with ellipsis
    ("ab,cd->", [(2, 3), (4, 5)]),                 # disconnected network
    ("abc,cba->b", [(2, 3, 4), (4, 3, 2)]),
    ("a,b,c,a,b,c->", [(2,), (3,), (4,), (2,), (3,), (4,)]),
    ("ij,jk", [(0, 3), (3, 4)]),                   # zero extent
]


@pytest.mark.parametrize("expr,shapes", EDGE, ids=[e for e, _ in EDGE])
def test_edge_cases_match_einsum(expr, shapes):
    gen = torch.Generator().manual_seed(1)
    _check_against_einsum(expr, [_rand(s, gen=gen) for s in shapes])


def _short_run_network(rng: random.Random):
    """2-3 operands whose modes end in one short mode ``z`` (extent 2-4) and are otherwise
    shuffled, with extents up to 12: the GEMM layouts copy permuted operands and gradients that
    keep a run of 2-4 elements innermost on both sides, some small and some of 2^14 elements or
    more (split across threads)."""
    labels = rng.sample("abcdefghijklmnop", rng.randint(4, 6))
    extent = {m: rng.choice([3, 4, 6, 8, 12]) for m in labels}
    extent["z"] = rng.choice([2, 3, 4])
    terms = []
    for _ in range(rng.randint(2, 3)):
        t = rng.sample(labels, rng.randint(2, min(4, len(labels))))
        terms.append(t + ["z"])
    used = sorted({m for t in terms for m in t if m != "z"})
    out = [m for m in used if rng.random() < 0.5]
    rng.shuffle(out)
    out = out + ["z"] if rng.random() < 0.7 else ["z"] + out
    expr = ",".join("".join(t) for t in terms) + "->" + "".join(out)
    return expr, [tuple(extent[m] for m in t) for t in terms]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128, torch.bfloat16])
@pytest.mark.parametrize("seed", range(8))
def test_permuted_layout_copies_match_einsum(seed, dtype):
    """The executor's tiled CPU layout copy (``csrc/cpu/strided_copy.cpp``, used for permuted
    copies with a short contiguous run): values and gradients against torch.einsum in float64,
    unsliced and sliced, with tolerances of the dtype."""
    rng = random.Random(500 + seed)
    expr, shapes = _short_run_network(rng)
    gen = torch.Generator().manual_seed(seed)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    ops = [_rand(s, dtype=wide, gen=gen).to(dtype) for s in shapes]
    ref_ops = [o.to(wide).requires_grad_(True) for o in ops]
    ref = torch.einsum(expr, *ref_ops)
    g = torch.randn(ref.shape, dtype=wide, generator=gen)
    ref_grads = torch.autograd.grad(ref, ref_ops, g)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.complex128: 1e-12, torch.bfloat16: 3e-2}[dtype]
    for kw in ({}, {"slicing": {"min_slices": 2}}):
        leaves = [o.detach().clone().requires_grad_(True) for o in ops]
        out = tn.contract(expr, *leaves, **kw)
        grads = torch.autograd.grad(out, leaves, g.to(dtype))
        for got, want in [(out, ref)] + list(zip(grads, ref_grads)):
            scale = float(want.detach().abs().max()) + 1e-30
            _close(got.to(wide), want.detach(), rtol=tol, atol=tol * scale, msg=f"{expr} {kw}")


def test_complex_with_conj_bit_matches_einsum():
    gen = torch.Generator().manual_seed(2)
    a = _rand((3, 4), C128, gen)
    b = _rand((4, 5), C128, gen)
    c = _rand((5, 3), C128, gen)
    ac = a.conj().requires_grad_(True)  # conj view, conj bit set
    assert ac.is_conj()
    b.requires_grad_(True)
    c.requires_grad_(True)
    ref_ops = [t.detach().clone().requires_grad_(True) for t in (a, b, c)]
    for p in (None, tn.plan("ij,jk,ki->j", ac, b, c, slicing=["k", "i"])):
        out = tn.contract("ij,jk,ki->j", ac, b, c, plan=p)
        ref = torch.einsum("ij,jk,ki->j", ref_ops[0].conj(), ref_ops[1], ref_ops[2])
        _close(out, ref)
        loss, ref_loss = (out.abs() ** 2).sum(), (ref.abs() ** 2).sum()
        g = torch.autograd.grad(loss, [ac, b, c])
        gr = torch.autograd.grad(ref_loss, ref_ops)
        # the grad w.r.t. the conj view is the conj of the grad w.r.t. its base
        _close(g[0], gr[0].conj())
        _close(g[1], gr[1])
        _close(g[2], gr[2])


def test_unicode_labels():
    gen = torch.Generator().manual_seed(3)
    a, b, c = _rand((2, 3), gen=gen), _rand((3, 4), gen=gen), _rand((4, 2), gen=gen)
    out = tn.contract("αβ,βγ,γδ->αδ", a, b, c)
    _close(out, torch.einsum("ab,bc,cd->ad", a, b, c))
    # opt_einsum's symbols beyond the ASCII letters
    labels = [opt_einsum.get_symbol(i) for i in (100, 200, 300)]
    expr = f"{labels[0]}{labels[1]},{labels[1]}{labels[2]}"
    _close(tn.contract(expr, a, b), torch.einsum("ab,bc->ac", a, b))
    # implicit output sorts by code point: ω > α
    _close(tn.contract("ωβ,βα", a, b), torch.einsum("ab,bc->ca", a, b))


def test_interleaved_form_with_hashable_labels():
    gen = torch.Generator().manual_seed(4)
    a, b, c = _rand((2, 3), gen=gen), _rand((3, 4), gen=gen), _rand((4, 2, 3), gen=gen)
    ref = torch.einsum(a, [0, 1], b, [1, 2], c, [2, 0, 3], [3, 0])
    _close(tn.contract(a, [0, 1], b, [1, 2], c, [2, 0, 3], [3, 0]), ref)
    labs = [("site", 0), "bond", frozenset({1}), 7.5]
    out = tn.contract(a, [labs[0], labs[1]], b, [labs[1], labs[2]], c, [labs[2], labs[0], labs[3]], [labs[3], labs[0]])
    _close(out, ref)
    # implicit output in the interleaved form: sorted labels occurring once
    _close(tn.contract(a, [0, 1], b, [1, 2]), torch.einsum(a, [0, 1], b, [1, 2]))
    # Ellipsis in sublists
    x, y = _rand((5, 2, 3), gen=gen), _rand((5, 3, 4), gen=gen)
    _close(tn.contract(x, [..., 0, 1], y, [..., 1, 2], [..., 0, 2]), x @ y)
    # gradients
    ops = [t.clone().requires_grad_(True) for t in (a, b, c)]
    out = tn.contract(ops[0], ["i", "j"], ops[1], ["j", "k"], ops[2], ["k", "i", "l"], ["l"])
    g = torch.autograd.grad(out.sum(), ops)
    ref_ops = [t.clone().requires_grad_(True) for t in (a, b, c)]
    gr = torch.autograd.grad(torch.einsum("ij,jk,kil->l", *ref_ops).sum(), ref_ops)
    for x1, x2 in zip(g, gr):
        _close(x1, x2)


def test_many_modes_beyond_52():
    # a 60-site ring: more modes than torch.einsum's 52 letters
    n = 60
    gen = torch.Generator().manual_seed(5)
    ops, args = [], []
    for i in range(n):
        t = _rand((2, 2), gen=gen) / 1.5
        ops.append(t)
        args += [t, [i, (i + 1) % n]]
    out = tn.contract(*args, [])
    ref = ops[0]
    for t in ops[1:]:
        ref = ref @ t
    _close(out, torch.trace(ref))


# ---------------------------------------------------------------------------- slicing
def _ladder(gen, dtype=F64, n=4, chi=3):
    """A 2 x n ladder (PEPS-like) network: modes shared by neighbours."""
    L = string.ascii_letters  # torch.einsum (the reference) accepts only these
    h, v, g = (lambda i: L[i]), (lambda i: L[n + 1 + i]), (lambda i: L[2 * n + 1 + i])
    terms, ops = [], []
    # top row t_i(h_i, v_i, h_{i+1}); bottom row b_i(g_i, v_i, g_{i+1})
    for i in range(n):
        terms.append(h(i) + v(i) + h(i + 1))
        ops.append(_rand((chi, 2, chi), dtype, gen))
        terms.append(g(i) + v(i) + g(i + 1))
        ops.append(_rand((chi, 2, chi), dtype, gen))
    expr = ",".join(terms) + "->" + h(0) + h(n) + g(0) + g(n)
    return expr, ops


def test_min_slices_takes_modes_in_chunks_rather_than_overshooting():
    """min_slices without a memory limit sliced whole modes only: 8 slices asked of a lattice of
    bond 4 gave 16 (two modes), 2 asked of bond 6 gave 6. Modes are now taken in chunks where
    fewer slices reach the count, as under a limit; values and gradients as unsliced."""
    inputs, output, arrays = lattice_network(4, 4, 4, seed=0, dtype=torch.float64)
    arrays = [a.requires_grad_() for a in arrays]
    args = interleave(inputs, arrays, output)
    full = tn.contract(*args)
    want = torch.autograd.grad(full, arrays)
    for k in (2, 8, 100):
        p = tn.plan(*args, slicing={"min_slices": k})
        assert k <= p.num_slices < 2 * k, (k, p.num_slices, p.sliced_modes)
        out = p(*arrays)
        _close(out, full)
        for g, w in zip(torch.autograd.grad(out, arrays), want):
            _close(g, w)
    inputs, output, arrays = lattice_network(5, 5, 6, seed=0)
    assert tn.plan(*interleave(inputs, arrays, output), slicing={"min_slices": 2}).num_slices == 2


def test_sliced_equals_unsliced_and_groups_sum_to_whole():
    gen = torch.Generator().manual_seed(6)
    expr, ops = _ladder(gen)
    full = tn.contract(expr, *ops)
    _close(full, torch.einsum(expr, *ops))
    p = tn.plan(expr, *ops, slicing={"min_slices": 9})
    assert p.num_slices >= 9 and p.sliced_modes
    _close(p.contract(*ops), full)
    # slice groups: disjoint groups add up to the whole
    ids = list(range(p.num_slices))
    groups = [ids[0::3], range(1, p.num_slices, 3), ids[2::3]]
    parts = [p.contract(*ops, slices=g) for g in groups]
    _close(sum(parts), full)
    # a single slice equals the contraction with the sliced modes fixed
    s = p.num_slices - 1
    idx = p.slice_indices(s)
    one = p.contract(*ops, slices=[s])
    assert one.shape == full.shape
    # empty group: zeros
    _close(p.contract(*ops, slices=[]), torch.zeros_like(full))
    # out= and accumulate=
    buf = torch.zeros_like(full)
    for g in groups:
        p.contract(*ops, slices=g, out=buf, accumulate=True)
    _close(buf, full)
    p.contract(*ops, slices=groups[0], out=buf)
    _close(buf, parts[0])
    assert len(idx) == len(p.sliced_modes)


def test_contract_out():
    """tn.contract(out=) as opt_einsum's contract takes it: the result written into out and out
    returned, for the string and interleaved forms, sliced plans and slice groups; a float32 out
    for float16 operands takes the slices' sum unrounded (the float16 out is that sum rounded
    once); shape, dtype, process_group and autograd misuse refused with the argument named."""
    gen = torch.Generator().manual_seed(5)
    expr = "ab,bc,cd->ad"
    ops = [_rand((6, 5), gen=gen), _rand((5, 7), gen=gen), _rand((7, 4), gen=gen)]
    want = torch.einsum(expr, *ops)
    buf = torch.full((6, 4), float("nan"), dtype=F64)
    got = tn.contract(expr, *ops, out=buf)
    assert got is buf
    _close(buf, want)
    # interleaved form, a sliced plan, a slice group
    buf2 = torch.empty(6, 4, dtype=F64)
    assert tn.contract(ops[0], [0, 1], ops[1], [1, 2], ops[2], [2, 3], [0, 3], out=buf2) is buf2
    _close(buf2, want)
    p = tn.plan(expr, *ops, slicing={"min_slices": 4})
    assert p.num_slices >= 4
    tn.contract(expr, *ops, plan=p, out=buf)
    _close(buf, want)
    tn.contract(expr, *ops, plan=p, slices=[0], out=buf)
    _close(buf, p.contract(*ops, slices=[0]))
    # a scalar result
    s = torch.empty((), dtype=F64)
    tn.contract("ab,ab->", ops[0], ops[0], out=s)
    _close(s, (ops[0] * ops[0]).sum())
    # float16 operands, sliced over the summed mode: each slice rounded to float16, their sum
    # kept in float32 in a float32 out, rounded once more in a float16 out
    big = [_rand((8, 64), gen=gen), _rand((64, 8), gen=gen)]
    h = [t.half() for t in big]
    ph = tn.plan("ab,bc->ac", *h, slicing={"min_slices": 8})
    assert ph.num_slices >= 8 and "b" in "".join(map(str, ph.sliced_modes))
    out16, out32 = torch.empty(8, 8, dtype=torch.float16), torch.empty(8, 8, dtype=torch.float32)
    tn.contract("ab,bc->ac", *h, plan=ph, out=out16)
    tn.contract("ab,bc->ac", *h, plan=ph, out=out32)
    slices = [ph.contract(*h, slices=[i]).float() for i in range(ph.num_slices)]
    assert torch.equal(out32, sum(slices[1:], slices[0]))  # the float32 sum of the rounded slices
    assert torch.equal(out16, out32.half())
    assert not torch.equal(out32, out16.float())  # the float32 out was not rounded to float16
    # misuse
    with pytest.raises(ValueError, match="out has shape"):
        tn.contract(expr, *ops, out=torch.empty(4, 6, dtype=F64))
    with pytest.raises(TypeError, match="out must have the result's dtype"):
        tn.contract(expr, *ops, out=torch.empty(6, 4, dtype=torch.float32))
    with pytest.raises(TypeError, match="out must be a tensor"):
        tn.contract(expr, *ops, out=[[0.0] * 4] * 6)
    with pytest.raises(ValueError, match="out and process_group"):
        tn.contract(expr, *ops, out=buf, process_group=object())
    leaf = ops[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="out=.*not differentiable.*an operand requires grad"):
        tn.contract(expr, leaf, ops[1], ops[2], out=buf)
    with pytest.raises(RuntimeError, match="out=.*not differentiable.*an operand requires grad"):
        tn.contract(leaf, [0, 1], ops[1], [1, 2], ops[2], [2, 3], [0, 3], out=buf)
    with pytest.raises(RuntimeError, match="out requires grad"):
        tn.contract(expr, *ops, out=torch.zeros(6, 4, dtype=F64, requires_grad=True))
    with torch.no_grad():
        tn.contract(expr, leaf, ops[1], ops[2], out=buf)
    _close(buf, want)


def test_modes_sliced_in_chunks():
    """Where a limit needs an intermediate only halved, the slicer slices a mode in ranges (2
    chunks of 8) instead of index by index (16 slices): values, gradients, slice groups and
    double backward through the chunked plan equal the unsliced ones."""
    gen = torch.Generator().manual_seed(61)
    ops = [_rand((16, 16), gen=gen) for _ in range(3)]
    expr = "ab,bc,ca->"
    for limit, chunks in ((128 * 8, 2), (64 * 8, 4)):
        p = tn.plan(expr, *ops, memory_limit=limit)
        assert p.num_slices == chunks, p
        (mode,) = p.sliced_modes
        assert isinstance(mode, tn.ModeChunks) and mode.chunks == chunks and repr(mode) == f"{mode.label}/{chunks}"
        assert p.largest_intermediate[1] <= limit
        _check_against_einsum(expr, ops, memory_limit=limit)
        _close(sum(p.contract(*ops, slices=[s]) for s in range(p.num_slices)), torch.einsum(expr, *ops))
        # a non-scalar output (recomputing backward) with a chunked contracted mode
        _check_against_einsum("ab,bc,cd->ad", ops, memory_limit=limit)
    small = [_rand((4, 4), gen=gen, requires_grad=True) for _ in range(3)]
    p = tn.plan(expr, *small, memory_limit=8 * 8)
    assert any(isinstance(m, tn.ModeChunks) for m in p.sliced_modes), p
    assert torch.autograd.gradcheck(lambda *x: p.contract(*x), small, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(lambda *x: p.contract(*x), small)
    # plan.gradients (cuTensorNet-style, no autograd graph) through the chunking views
    got = p.gradients(*[x.detach() for x in small], output_grad=torch.tensor(2.0, dtype=F64))
    ref = torch.autograd.grad(2 * torch.einsum(expr, *small), small)
    for a, b in zip(got, ref):
        _close(a, b)


def test_chunks_keep_real_networks_few_slices():
    """On a lattice the planner takes modes in chunks where whole slicing would multiply the
    slices by the bond dimension: fewer slices than whole-mode slicing alone, within the limit,
    and the same value and gradients."""
    inputs, output, arrays = lattice_network(4, 4, 4, seed=1, dtype=F64)
    base = tn.plan(*interleave(inputs, arrays, output), optimize="greedy")
    limit = base.largest_intermediate[1] // 4
    p = tn.plan(*interleave(inputs, arrays, output), memory_limit=limit)
    assert p.largest_intermediate[1] <= limit
    assert any(isinstance(m, tn.ModeChunks) for m in p.sliced_modes), p
    whole = 1
    for m in p.sliced_modes:
        whole *= 4  # what slicing each of these modes index by index would give
    assert p.num_slices < whole
    leaves = [a.clone().requires_grad_(True) for a in arrays]
    ref_leaves = [a.clone().requires_grad_(True) for a in arrays]
    out = p.contract(*leaves)
    ref = base.contract(*ref_leaves)
    _close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, leaves), torch.autograd.grad(ref, ref_leaves)):
        _close(a, b, rtol=1e-10, atol=1e-12)


def test_sliced_output_mode_gives_blocks():
    gen = torch.Generator().manual_seed(7)
    a, b = _rand((4, 5), gen=gen), _rand((5, 6), gen=gen)
    p = tn.plan("ij,jk->ik", a, b, slicing=["i", "j"])
    assert p.sliced_modes == ("i", "j") and p.num_slices == 20
    full = a @ b
    _close(p.contract(a, b), full)
    # the slices with i = 2 give exactly row 2 (blocks), the rest stays zero
    ids = [s for s in range(p.num_slices) if p.slice_indices(s)[0] == 2]
    part = p.contract(a, b, slices=ids)
    expect = torch.zeros_like(full)
    expect[2] = full[2]
    _close(part, expect)
    # gradients of a block group
    a2, b2 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ga, gb = torch.autograd.grad(p.contract(a2, b2, slices=ids).sum(), [a2, b2])
    a3, b3 = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ra, rb = torch.autograd.grad((a3 @ b3)[2].sum(), [a3, b3])
    _close(ga, ra)
    _close(gb, rb)


def test_memory_limit_slices_and_errors():
    gen = torch.Generator().manual_seed(8)
    expr, ops = _ladder(gen, n=5, chi=4)
    p0 = tn.plan(expr, *ops)
    limit = p0.largest_intermediate[1] // 8
    p = tn.plan(expr, *ops, memory_limit=limit)
    assert p.num_slices > 1
    assert p.largest_intermediate[1] <= limit
    _close(p.contract(*ops), p0.contract(*ops))
    assert "num_slices" in repr(p) and "largest_intermediate" in repr(p)
    # string forms
    assert tn.parse_memory_limit("2GiB") == 2 * 2**30
    assert tn.parse_memory_limit("1.5 kB") == 1500
    assert tn.parse_memory_limit(1024) == 1024
    assert 0 < tn.parse_memory_limit("50%") < tn.parse_memory_limit("100%")
    # even slicing every mode cannot fit 1 byte... well, 8 bytes per element: error
    with pytest.raises(ValueError, match="memory_limit cannot be met"):
        tn.plan("ab,bc->ac", (64, 64), (64, 64), memory_limit=4, dtype=torch.float64)
    for bad in ("lots", "-3GB", "150%", "0"):
        with pytest.raises(ValueError, match="memory_limit"):
            tn.plan(expr, *ops, memory_limit=bad)
    with pytest.raises(TypeError, match="memory_limit"):
        tn.plan(expr, *ops, memory_limit=[1])



def test_repr_of_a_large_network_is_short():
    inputs, output, arrays = circuit_amplitude_network(3, 3, 8, seed=0)
    p = tn.plan(*interleave(inputs, arrays, output))
    text = repr(p)
    assert len(p.expr) > 400  # the attribute keeps the whole expression
    assert p.expr not in text and f"({len(inputs)} terms)" in text and p.expr[:100] in text

def test_estimated_seconds_counts_calls_steps_memory_and_the_dtype_rate(monkeypatch):
    """estimated_seconds: per call, FLOPs at the GEMM rate of the plan's own dtype (float64 had
    float32's, about 2x too fast on CPUs), per executor step and slice, and per byte of the GEMMs'
    operands and results, three passes with gradients (plans of many tiny slices were estimated
    3-7x under their time with FLOPs and steps alone)."""
    plan_mod = importlib.import_module("torch_gradops.tensornet.plan")  # (tn.plan is the function)
    monkeypatch.setitem(plan_mod.TIME_MODEL, "cpu",
                        {"call_s": (1e-3, 5e-3), "flop_factor": 2.0, "step_s": 1e-5, "byte_s": 1e-9})
    monkeypatch.setattr(plan_mod, "_RATES", {("cpu", torch.float32): 1e9, ("cpu", torch.float64): 5e8})
    inputs, output, arrays = mps_network(8, 4, dtype=torch.float64)
    p = tn.plan(*interleave(inputs, arrays, output), memory_limit=256, max_overhead=None)
    assert p.num_slices > 1 and p.hoisted is None
    gemms = compile_program(p.network.inputs, p.network.output, p.network.sizes, p.path, p.sliced_ids, 8, False,
                            p.checkpoints)[1]
    assert p.bytes_moved == sum(g[1] + g[2] for g in gemms) * 8 * p.num_slices
    steps = p.num_slices * len(p.path)
    assert math.isclose(p.estimated_seconds(False), 1e-3 + 2.0 * p.flops / 5e8 + 1e-5 * steps + 1e-9 * p.bytes_moved)
    assert math.isclose(p.estimated_seconds(True), 5e-3 + 2.0 * (3 * p.flops + p.recompute_flops) / 5e8
                        + 3 * (1e-5 * steps + 1e-9 * p.bytes_moved))
    p32 = tn.plan(*interleave(inputs, [a.float() for a in arrays], output), memory_limit=128, max_overhead=None)
    assert p32.path == p.path and p32.num_slices == p.num_slices and p32.bytes_moved * 2 == p.bytes_moved
    assert math.isclose(p32.estimated_seconds(False), 1e-3 + 2.0 * p32.flops / 1e9 + 1e-5 * steps
                        + 1e-9 * p32.bytes_moved)
    hoisted = tn.plan("ab,bc,cd,de,ea->", *[torch.randn(s) for s in [(3, 4), (4, 5), (5, 3), (3, 6), (6, 3)]],
                      memory_limit="1MiB", slicing=["e"])
    parts = hoisted.hoisted.plans()
    assert hoisted.bytes_moved == sum(q.bytes_moved for q in parts)  # (was the unhoisted program's)
    assert math.isclose(hoisted.estimated_seconds(), sum(q.estimated_seconds() for q in parts))
    monkeypatch.setattr(plan_mod, "_RATES", {})
    assert plan_mod.device_flop_rate("meta", torch.float64) == 1e10  # nothing to time: the fallback


def test_one_plan_for_forward_and_backward():
    """memory_limit bounds the largest intermediate of one slice, with or without gradients:
    contract() finds the same plan whether or not an operand requires grad, and that plan
    differentiates correctly (its backward's memory: test_peak_memory_within_contract)."""
    gen = torch.Generator().manual_seed(16)
    n, k = 48, 6
    expr = "ax,bx,cx,ay,by,cy->"
    ops = [_rand((n, k), gen=gen) for _ in range(6)]
    path = [(0, 1), (0, 1), (0, 1), (0, 1), (0, 1)]
    limit = 4 * 8 * n * n
    p = tn.plan(expr, *ops, optimize=path, memory_limit=limit)
    assert p.largest_intermediate[1] <= limit < tn.plan(expr, *ops, optimize=path).largest_intermediate[1]
    assert p.num_slices > 1 and p.modelled_peak <= 3.5 * limit
    ref = torch.einsum(expr, *ops)
    _close(p.contract(*ops), ref)
    assert tn.resolve(expr, *ops, optimize=path, memory_limit=limit)[0] is p
    leaves = [o.clone().requires_grad_() for o in ops]
    assert tn.resolve(expr, *leaves, optimize=path, memory_limit=limit)[0] is p
    with torch.no_grad():
        assert tn.resolve(expr, *leaves, optimize=path, memory_limit=limit)[0] is p
    got = torch.autograd.grad(p.contract(*leaves), leaves)
    want = torch.autograd.grad(torch.einsum(expr, *leaves), leaves)
    for g, w in zip(got, want):
        _close(g, w)


def test_slicer_meets_any_limit_of_one_element_or_more():
    """Every unsliced mode of extent > 1 is a slicing candidate (operand modes, output modes), so
    a limit is refused only below one element."""
    gen = torch.Generator().manual_seed(40)
    # the ring of the issue: six 16 x 16 float64 matrices, 512 bytes (64 elements)
    ring = "ab,bc,cd,de,ef,fa->"
    ops = [_rand((16, 16), gen=gen) for _ in range(6)]
    p = tn.plan(ring, *ops, memory_limit=512)
    assert p.largest_intermediate[1] <= 512 and p.num_slices > 1
    _check_against_einsum(ring, ops, plan=p)
    # gradcheck of the issue: complex128 at 128 bytes (8 elements)
    x = [_rand(s, C128, gen, requires_grad=True) for s in [(2, 3), (3, 4, 5), (4, 2)]]
    p = tn.plan("ab,bcd,ca->d", *x, memory_limit=128)
    assert p.largest_intermediate[1] <= 128
    assert torch.autograd.gradcheck(lambda *a: p.contract(*a), x)
    assert torch.autograd.gradgradcheck(lambda *a: p.contract(*a), x)
    # a limit smaller than every mode's extent: every mode of every intermediate is sliced
    expr = "ab,bc,cd->ad"
    ops = [_rand((8, 8), gen=gen) for _ in range(3)]
    p = tn.plan(expr, *ops, memory_limit=4 * 8)
    assert p.largest_intermediate[0] <= 4 < 8 and set(p.sliced_modes) >= {"a", "d"}
    _check_against_einsum(expr, ops, plan=p)
    # a hyperedge and an output mode
    expr = "ij,ij,jk->ik"
    ops = [_rand((6, 5), gen=gen), _rand((6, 5), gen=gen), _rand((5, 7), gen=gen)]
    p = tn.plan(expr, *ops, memory_limit=8)
    assert p.largest_intermediate[0] == 1
    _check_against_einsum(expr, ops, plan=p)
    with pytest.raises(ValueError, match="memory_limit cannot be met: 7 bytes is less than one"):
        tn.plan(expr, *ops, memory_limit=7)


def _ring_of(n, gen):
    """A ring of ``n`` 2 x 2 matrices (interleaved form): ``n`` binary modes."""
    mats = [_rand((2, 2), gen=gen) / 2 ** 0.5 for _ in range(n)]
    args = []
    for i, m in enumerate(mats):
        args += [m, [i, (i + 1) % n]]
    return mats, args + [[]]


def test_huge_slice_counts_cost_nothing_until_run():
    """2^40 slices: the plan is created at once (slice ids are never listed), refused by
    default with advice, and with max_overhead=None its slice groups run lazily."""
    import time
    gen = torch.Generator().manual_seed(41)
    mats, args = _ring_of(40, gen)
    with pytest.raises(ValueError, match="too expensive.*raise memory_limit.*max_overhead=None"):
        tn.plan(*args, slicing=list(range(40)), optimize="greedy")
    t0 = time.perf_counter()
    p = tn.plan(*args, slicing=list(range(40)), optimize="greedy", max_overhead=None)
    assert time.perf_counter() - t0 < 5
    assert p.num_slices == 2 ** 40 and p.flops > 1e4 * p.unsliced_flops
    assert "years" in repr(p) or " h " in repr(p)  # the estimated time says what running it means
    with pytest.raises(ValueError, match="more than one table holds"):
        p.slice_set.table(None)
    first = next(iter(p.slice_set.chunks(None)))
    assert len(first) == 40 * 2 ** 16  # a bounded chunk, not 2^40 rows
    # slice s fixes every mode: the value is the product of one element per matrix
    ids = [0, 5, 2 ** 40 - 1, 123456789]
    leaves = [m.clone().requires_grad_(True) for m in mats]
    got = p.contract(*leaves, slices=ids)
    ref = 0
    for s in ids:
        idx = p.slice_indices(s)
        term = 1
        for i in range(40):
            term = term * leaves[i][idx[i], idx[(i + 1) % 40]]
        ref = ref + term
    _close(got, ref)
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(ref, leaves)):
        _close(a, b)
    _close(p.contract(*mats, slices=range(2 ** 40 - 3, 2 ** 40)),
           sum(p.contract(*mats, slices=[s]) for s in range(2 ** 40 - 3, 2 ** 40)))


def test_long_chain_under_a_tiny_limit_is_refused_quickly(monkeypatch):
    """A 400-tensor MPS norm (799 steps of 32-element results) at 512 B: every intermediate
    (128 B) fits, but one level of checkpoints over 799 steps needs more than 3.5 x the limit
    (about 1 KiB of limit), and slicing shrinks them little. The planner stops slicing once the plan is past max_overhead
    (it made 50,000 checkpoint placements, over two minutes, before) and says what limit the
    checkpoints need; that limit gives an unsliced plan."""
    import re
    from torch_gradops.tensornet import slicer

    inputs, out, ops = mps_network(400, bond=4)
    args = interleave(inputs, ops, out)
    calls = []
    place = slicer.place_checkpoints
    monkeypatch.setattr(slicer, "place_checkpoints", lambda *a, **k: calls.append(1) or place(*a, **k))
    with pytest.raises(ValueError, match="too expensive.*every intermediate fits it unsliced, but the backward "
                                         "of 799 steps needs about") as err:
        tn.plan(*args, memory_limit="512B", optimize="greedy")
    assert len(calls) < 2000, len(calls)
    need = float(re.search(r"needs about ([0-9.]+) B", str(err.value)).group(1))
    p = tn.plan(*args, memory_limit=int(need * 1.1), optimize="greedy")
    assert p.num_slices == 1 and p.modelled_peak <= 3.5 * p.memory_limit
    _close(p.contract(*ops), tn.plan(*args, optimize="greedy").contract(*ops), rtol=1e-5, atol=0)


def test_max_overhead_measures_against_a_cheaper_unsliced_path():
    """max_overhead compares a plan with the cheaper of its own path's unsliced FLOPs and
    opt_einsum's greedy path's: a 16-site MPS norm of bond 8 at 128 B gets a searched path of
    1.9e7 FLOPs unsliced, which 262,144 slices take to 1.1e9 (59x that, but 2.2e4x the greedy
    path's 5.1e4, an estimated 16 s for a contraction of microseconds), and was accepted (a
    40-site MPS expectation of bond 32 at 8 KiB, 1.4e11 slices estimated at months, was too).
    The error names the yardstick and the greedy path's largest intermediate."""
    inputs, out, ops = mps_network(16, bond=8)
    args = interleave(inputs, ops, out)
    with pytest.raises(ValueError, match="too expensive.*x opt_einsum's greedy path's unsliced .*greedy path's is "
                                         "512 B") as err:
        tn.plan(*args, memory_limit=128)
    p = tn.plan(*args, memory_limit=128, max_overhead=None)
    greedy = tn.plan(*args, optimize="greedy")
    assert p.flops <= 1e4 * p.unsliced_flops and p.flops > 1e4 * greedy.flops
    assert f"{greedy.flops:.3g}" in str(err.value)


@pytest.mark.parametrize("optimize", ["greedy", "auto"])
def test_limits_past_int64_slices_are_refused(optimize):
    """Limits so small that slicing to them takes more than 2^62 slices (the executor numbers
    slices in int64) are refused by name: the compiler raised OverflowError, and a search whose
    every tree was unplannable raised KeyError from inside cotengra."""
    for network, limit in ((mps_network(200, bond=16), "512B"), (lattice_network(4, 4, 32), "64B")):
        inputs, out, ops = network
        with pytest.raises(ValueError, match="memory_limit cannot be met within 2\\^62 slices"):
            tn.plan(*interleave(inputs, ops, out), memory_limit=limit, optimize=optimize, max_overhead=None)
    gen = torch.Generator().manual_seed(3)
    _, args = _ring_of(64, gen)
    assert tn.plan(*args, slicing=list(range(62)), optimize="greedy", max_overhead=None).num_slices == 2 ** 62
    with pytest.raises(ValueError, match="slicing: more than 2\\^62 slices"):
        tn.plan(*args, slicing=list(range(63)), optimize="greedy", max_overhead=None)


def test_hopeless_limits_are_refused_without_slicing_hopeless_trees(monkeypatch):
    """A 30x30 lattice of bond 8 at 1 MiB (a width of about 2^90 against 2^18 per slice) took
    14 s to refuse and a 60x60 lattice of bond 2 at 1 GiB 92 s: cotengra's slicer removed the
    modes of every hopeless trial's tree one by one, and the planner's own slicer scanned every
    step for every candidate mode. A tree whose largest intermediate exceeds the limit times
    2^62 is now a bad trial (no slicing can fit it: a mode of extent e divides it by e at most
    and multiplies the slices by e), and the planner's slicer stops at the same bound."""
    import cotengra
    eq = cotengra.utils.lattice_equation([30, 30], d_min=8, d_max=8, seed=0)
    args = []
    for term in eq.inputs:
        args += [tuple(eq.size_dict[ix] for ix in term), list(term)]
    args.append(list(eq.output))
    sliced = []
    slice_tree = cotengra.ContractionTree.slice_  # what cotengra's trials call (a partialmethod of slice)
    monkeypatch.setattr(cotengra.ContractionTree, "slice_",
                        lambda self, *a, **k: sliced.append(1) or slice_tree(self, *a, **k))
    small = lattice_network(4, 4, 8)  # a feasible limit: the counter counts
    tn.plan(*interleave(small[0], small[2], small[1]), memory_limit="16KiB", optimize="cotengra")
    assert sliced
    sliced.clear()
    with pytest.raises(ValueError, match=r"memory_limit cannot be met within 2\^62 slices .* too few for the "
                                         r"contraction paths found \(the largest intermediate of this one: 2\^"):
        tn.plan(*args, memory_limit="1MiB")
    assert not sliced  # every trial was hopeless: cotengra's slicer never ran
    # without a limit such a network has no plan either, said as such (an OverflowError from
    # the program compiler, and slicing nobody asked for, before)
    with pytest.raises(ValueError, match="reaches 2\\^63 \\(int64\\), beyond what any device holds or runs; slicing "
                                         "\\(a memory_limit"):
        tn.plan(*args, optimize="greedy")
    with pytest.raises(ValueError, match="slicing: more than 2\\^62 slices.*no intermediate reaches 2\\^62"):
        tn.plan(*args)


def test_plan_checks_operands_against_what_it_was_made_for():
    """Shapes must match the plan's; under a memory_limit the dtype may be the plan's or
    narrower (wider or complex elements would break the limit its memory model counted), and
    without one any dtype runs (the value as torch.einsum's)."""
    gen = torch.Generator().manual_seed(5)
    a, b, c = _rand((30, 40), gen=gen), _rand((40, 50), gen=gen), _rand((50, 30), gen=gen)
    expr = "ab,bc,ca->"
    limited = tn.plan(expr, (30, 40), (40, 50), (50, 30), dtype=torch.float32, memory_limit=2048)
    assert limited.num_slices > 1
    with pytest.raises(ValueError, match="operand 1 has shape \\(40, 51\\) but the plan was made for \\(40, 50\\)"):
        limited.contract(a.float(), _rand((40, 51)).float(), c.float())
    for dtype in (F64, torch.complex64):
        with pytest.raises(ValueError, match=f"operands of dtype {dtype} on a plan made for torch.float32 under "
                                             "memory_limit=2.0 KiB: their wider elements would exceed it"):
            limited.contract(a.to(dtype), b.to(dtype), c.to(dtype))
    with pytest.raises(ValueError, match="operands of dtype torch.float64"):  # promotion counts
        limited.contract(a.float(), b, c.float())
    ref = torch.einsum(expr, a, b, c)
    _close(limited.contract(a.float(), b.float(), c.float()).double(), ref, rtol=1e-4, atol=1e-3)
    _close(limited.contract(a.half(), b.half(), c.half()).double(), ref, rtol=5e-2, atol=1.0)
    unlimited = tn.plan(expr, (30, 40), (40, 50), (50, 30), dtype=torch.float32)
    _close(unlimited.contract(a, b, c), ref)


def test_forced_slicing_and_optimizers():
    gen = torch.Generator().manual_seed(9)
    expr, ops = _ladder(gen)
    ref = torch.einsum(expr, *ops)
    for opt in ("greedy", "optimal", "auto", "branch-2", "cotengra"):
        if opt == "optimal":
            a, b, c = _rand((3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 2), gen=gen)
            _close(tn.contract("ab,bc,cd->ad", a, b, c, optimize=opt), a @ b @ c)
            continue
        _close(tn.contract(expr, *ops, optimize=opt), ref)
    p = tn.plan(expr, *ops, optimize="cotengra", memory_limit=tn.plan(expr, *ops).largest_intermediate[1] // 4)
    assert p.optimizer == "cotengra" and p.num_slices > 1
    _close(p.contract(*ops), ref)
    # memory_limit and min_slices together through the hyper-search, with a limit that the
    # network meets unsliced (cotengra's slicer then found no slicing and the search failed)
    for limit in (None, "1MiB", p.largest_intermediate[1]):
        q = tn.plan(expr, *ops, optimize="cotengra", memory_limit=limit, slicing={"min_slices": 3})
        assert q.optimizer == "cotengra" and q.num_slices >= 3
        _close(q.contract(*ops), ref)
    # explicit path, including a k-ary step that is split into pairs
    a, b, c = _rand((3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 2), gen=gen)
    _close(tn.contract("ab,bc,cd->ad", a, b, c, optimize=[(1, 2), (0, 1)]), a @ b @ c)
    _close(tn.contract("ab,bc,cd->ad", a, b, c, optimize=[(0, 1, 2)]), a @ b @ c)
    p = tn.plan("ab,bc,cd->ad", a, b, c, optimize=[(0, 2), (0, 1)])
    assert p.path == [(0, 2), (0, 1)]
    # forced modes, and min_slices on top of them
    p = tn.plan("ab,bc,cd->ad", a, b, c, slicing=["c"])
    assert p.sliced_modes == ("c",) and p.num_slices == 5
    p = tn.plan("ab,bc,cd->ad", a, b, c, slicing={"modes": ["c"], "min_slices": 20})
    assert p.sliced_modes[0] == "c" and p.num_slices >= 20
    _close(p.contract(a, b, c), a @ b @ c)


# ---------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("dtype", [F64, C128])
@pytest.mark.parametrize("sliced", [False, True])
def test_gradcheck_and_gradgradcheck(dtype, sliced):
    gen = torch.Generator().manual_seed(10)
    expr = "abc,cd,bde->ae"
    ops = [_rand(s, dtype, gen, requires_grad=True) for s in [(2, 3, 2), (2, 3), (3, 3, 2)]]
    p = tn.plan(expr, *ops, slicing={"min_slices": 4} if sliced else None)
    assert (p.num_slices > 1) == sliced
    fn = lambda *x: p.contract(*x)  # noqa: E731
    assert torch.autograd.gradcheck(fn, ops)
    assert torch.autograd.gradgradcheck(fn, ops)


def test_gradgradcheck_trace_hyperedge_and_sliced_output():
    gen = torch.Generator().manual_seed(11)
    x = _rand((3, 3, 2), gen=gen, requires_grad=True)
    y = _rand((2, 4), gen=gen, requires_grad=True)
    z = _rand((2, 4), gen=gen, requires_grad=True)
    expr = "iij,jk,jk->jk"
    p = tn.plan(expr, x, y, z, slicing=["j", "k"])
    assert torch.autograd.gradcheck(lambda *a: p.contract(*a), (x, y, z))
    assert torch.autograd.gradgradcheck(lambda *a: p.contract(*a), (x, y, z))
    # a mode that occurs only in one operand (summed): its gradient broadcasts
    w = _rand((3, 5), gen=gen, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda w, y: tn.contract("ia,ak->k", w[:, :2], y), (w, y))
    assert torch.autograd.gradgradcheck(lambda w, y: tn.contract("im,jk->jk", w, y), (w, y))


@pytest.mark.parametrize("dtype", [F64, C128])
def test_forward_ad(dtype):
    gen = torch.Generator().manual_seed(12)
    expr = "ab,bc,cd->ad"
    ops = [_rand(s, dtype, gen) for s in [(2, 3), (3, 4), (4, 2)]]
    tans = [_rand(o.shape, dtype, gen) for o in ops]
    p = tn.plan(expr, *ops, slicing=["b", "c"])
    for plan in (None, p):
        out, jv = torch.func.jvp(lambda *x: tn.contract(expr, *x, plan=plan), tuple(ops), tuple(tans))
        ref, rjv = torch.func.jvp(lambda *x: torch.einsum(expr, *x), tuple(ops), tuple(tans))
        _close(out, ref)
        _close(jv, rjv)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        duals = [fwAD.make_dual(o, t) if i != 1 else o for i, (o, t) in enumerate(zip(ops, tans))]
        out = tn.contract(expr, *duals, plan=p)
        jv = fwAD.unpack_dual(out).tangent
    ref_jv = torch.einsum(expr, tans[0], ops[1], ops[2]) + torch.einsum(expr, ops[0], ops[1], tans[2])
    _close(jv, ref_jv)
    assert torch.autograd.gradcheck(lambda *x: p.contract(*x), [o.requires_grad_() for o in ops],
                                    check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False)


@pytest.mark.parametrize("slicing", [None, ["j"]])
def test_retain_graph_and_second_backward(slicing):
    # unsliced: the first backward uses the forward's cached step results, the second recomputes
    gen = torch.Generator().manual_seed(13)
    a, b = _rand((3, 4), gen=gen, requires_grad=True), _rand((4, 5), gen=gen, requires_grad=True)
    c = _rand((5, 2), gen=gen, requires_grad=True)
    out = tn.contract("ij,jk,kl->il", a, b, c, slicing=slicing).sum()
    g1 = torch.autograd.grad(out, [a, b, c], retain_graph=True)
    g2 = torch.autograd.grad(out, [a, b, c])
    ref = torch.autograd.grad((a @ b @ c).sum(), [a, b, c])
    for x, y, z in zip(g1, g2, ref):
        _close(x, z)
        _close(y, z)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, a)


@pytest.mark.parametrize("kw", [{}, dict(slicing=["i"]), dict(optimize="greedy"), dict(memory_limit=8)])
def test_scalar_output_gradient_edited_in_place_then_second_backward(kw):
    """A one-element output's backward hands out the forward's unit-cotangent gradients as they
    are; they were also its saved tensors, so a caller scaling the gradient it got in place
    (clipping) made a retained graph's next backward fail the version check (torch.einsum:
    the right gradient again)."""
    gen = torch.Generator().manual_seed(15)
    a, b = _rand((3, 4), gen=gen, requires_grad=True), _rand((3, 4), gen=gen)
    c = _rand((4, 2), gen=gen, requires_grad=True)
    loss = tn.contract("ij,ij,jk->", a, b, c, **kw)
    ref = torch.autograd.grad(torch.einsum("ij,ij,jk->", a, b, c), [a, c])
    g1 = torch.autograd.grad(loss, [a, c], retain_graph=True)
    for g, r in zip(g1, ref):
        _close(g, r)
        g.mul_(0.5)
    g2 = torch.autograd.grad(loss, [a, c], retain_graph=True)
    g3 = torch.autograd.grad(2 * loss, [a, c])  # a scaled cotangent, last use of the graph
    for x, y, r in zip(g2, g3, ref):
        _close(x, r)
        _close(y, 2 * r)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(loss, a)


def test_grad_subset_and_no_work_for_unneeded(monkeypatch):
    gen = torch.Generator().manual_seed(14)
    a = _rand((3, 4), gen=gen, requires_grad=True)
    b = _rand((4, 5), gen=gen, requires_grad=True)
    c = _rand((5, 2), gen=gen)  # does not require grad
    d = _rand((7,), gen=gen, requires_grad=True)  # not part of the output
    calls, cached_lens = [], []
    real = tn_autograd.ops

    class Spy:
        def __getattr__(self, name):
            op = getattr(real, name)

            def wrapped(*args):
                calls.append((name, args[4] if name == "contract_program_backward" else None))
                if name == "contract_program_backward":
                    cached_lens.append(len(args[5]))
                return op(*args)
            return wrapped

    monkeypatch.setattr(tn_autograd, "ops", Spy())
    a1, b1 = a * 1, b * 1  # non-leaf operands: the engine tells which branches run
    out = tn.contract("ab,bc,cd->ad", a1, b1, c)
    ga, gd = torch.autograd.grad(out.sum(), [a, d], allow_unused=True)
    assert gd is None
    _close(ga, torch.autograd.grad((a @ b.detach() @ c).sum(), a)[0])
    bw = [n for name, n in calls if name == "contract_program_backward"]
    assert bw == [[1, 0, 0]]  # only a's gradient is computed: b's branch is not needed, c needs none
    calls.clear()
    out = tn.contract("ab,bc,cd->ad", a, b, c)  # leaves
    gb, = torch.autograd.grad(out.sum(), [b])
    _close(gb, torch.autograd.grad((a.detach() @ b @ c).sum(), b)[0])
    assert [n for name, n in calls if name == "contract_program_backward"][0][2] == 0  # c: no work
    # unsliced: the forward kept its step result (ab or bc) and the backward reused it
    assert "contract_program_cached" in [name for name, _ in calls] and cached_lens[-1] == 4


def test_plan_gradients_low_level():
    gen = torch.Generator().manual_seed(15)
    expr = "iab,bc,ca->i"
    ops = [_rand((2, 3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 3), gen=gen)]
    p = tn.plan(expr, *ops, slicing={"min_slices": 6})
    g = _rand((2,), gen=gen)
    grads = p.gradients(*ops, output_grad=g)
    ref_ops = [o.clone().requires_grad_(True) for o in ops]
    ref = torch.autograd.grad(torch.einsum(expr, *ref_ops), ref_ops, g)
    for x, y in zip(grads, ref):
        _close(x, y)
    # slice groups accumulate into caller buffers; skipped operands stay None
    bufs = [torch.zeros_like(ops[0]), None, torch.zeros_like(ops[2])]
    half = p.num_slices // 2
    p.gradients(*ops, output_grad=g, slices=range(half), grads=bufs)
    out = p.gradients(*ops, output_grad=g, slices=range(half, p.num_slices), grads=bufs, accumulate=True)
    assert out[1] is None and out[0] is bufs[0]
    _close(bufs[0], ref[0])
    _close(bufs[2], ref[2])
    # diagonal operand: the gradient is scattered back onto the diagonal
    x = _rand((3, 3), gen=gen)
    gx, = tn.plan("ii->i", x).gradients(x, output_grad=torch.ones(3, dtype=F64))
    _close(gx, torch.eye(3, dtype=F64))
    with pytest.raises(ValueError, match="output_grad has shape"):
        p.gradients(*ops, output_grad=torch.ones(3, dtype=F64))
    with pytest.raises(ValueError, match="grads must have one entry per operand"):
        p.gradients(*ops, output_grad=g, grads=[None])


# ---------------------------------------------------------------------------- memory


def _per_slice_autograd(expr, ops, p, path):
    """autograd through each slice's pairwise contraction (what cotengra + autograd does): it
    holds every slice's intermediates until backward."""
    def run():
        total = 0
        lhs = expr.split("->")[0].split(",")
        for s in range(p.num_slices):
            idx = dict(zip(p.sliced_modes, p.slice_indices(s)))
            sl = []
            for term, o in zip(lhs, ops):
                t = o
                for d in reversed(range(len(term))):
                    if term[d] in idx:
                        t = t.select(d, idx[term[d]])
                sl.append(t)
            sub = ",".join("".join(c for c in term if c not in idx) for term in lhs)
            total = total + opt_einsum.contract(sub + "->", *sl, optimize=path, backend="torch")
        total.backward()
    return run


def _contract_bound(limit, ops, out_bytes=0):
    """The measured contract: 4 x memory_limit + operands + their gradients (+ the output and
    its gradient, and 1 KiB for 0-dim tensors)."""
    operand_bytes = sum(o.numel() * o.element_size() for o in ops)
    return 4 * limit + 2 * operand_bytes + 2 * out_bytes + 1024


def test_peak_memory_within_contract():
    """forward + backward of a plan made with memory_limit L holds at most 4 L + operands +
    their gradients, for any number of slices, while autograd through the same slices holds
    every slice's intermediates."""
    gen = torch.Generator().manual_seed(16)
    n, k = 48, 6
    expr = "ax,bx,cx,ay,by,cy->"
    ops = [_rand((n, k), gen=gen, requires_grad=True) for _ in range(6)]
    path = [(0, 1), (0, 1), (0, 1), (0, 1), (0, 1)]
    unsliced = tn.plan(expr, *ops, optimize=path)
    run = lambda plan: (lambda: plan.contract(*ops).backward())  # noqa: E731
    run(unsliced)()  # warm up (allocator, thread pools)
    peaks = []
    for limit in (16 * 8 * n * n, 8 * 8 * n * n, 4 * 8 * n * n):
        p = tn.plan(expr, *ops, optimize=path, memory_limit=limit)
        more = tn.plan(expr, *ops, optimize=path, memory_limit=limit, slicing={"min_slices": 4 * p.num_slices})
        assert p.num_slices > 1 and more.num_slices >= 4 * p.num_slices
        for plan in (p, more):
            peak = _peak_bytes(run(plan))
            assert peak <= _contract_bound(limit, ops), (limit, plan.num_slices, peak, _contract_bound(limit, ops))
        peaks.append(peak)
    assert _peak_bytes(run(unsliced)) > 4 * peaks[-1]
    p = tn.plan(expr, *ops, optimize=path, memory_limit=4 * 8 * n * n)
    assert _peak_bytes(_per_slice_autograd(expr, ops, p, path)) > 4 * peaks[-1]


def _assert_group_gradients_agree(plan, ops, groups):
    """For each slice group, create_graph=True gradients (the derivative networks') equal the
    first-order ones (the executor's backward)."""
    for group in groups:
        plain = torch.autograd.grad(plan.contract(*ops, slices=group), ops)
        graph = torch.autograd.grad(plan.contract(*ops, slices=group), ops, create_graph=True)
        for a, b in zip(graph, plain):
            _close(a, b)


def _assert_hvps_close(got, ref, ops, gen):
    """Hessian-vector products (the real part of <gradient, v> differentiated again) of two sets
    of create_graph gradients agree, for random directions ``v`` of the operands' dtypes."""
    vs = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in ops]
    hvp = lambda gs: torch.autograd.grad(sum((g * v.conj()).real.sum() for g, v in zip(gs, vs)), ops)  # noqa: E731
    for a, b in zip(hvp(got), hvp(ref)):
        _close(a, b)


def test_derivative_networks_keep_the_memory_limit():
    """create_graph=True and torch.func gradients contract each operand's derivative network:
    planned under the plan's memory_limit (were planned without one: 1.9x the contract's bound
    here), slicing more where needed, each of the plan's slices then a range of the derivative's
    (slice groups map onto them); values, slice groups and double backward as einsum's."""
    inputs, output, arrays = lattice_network(3, 4, 4, seed=0, dtype=F64)
    ops = [a.requires_grad_() for a in arrays]
    limit = 2048
    p = tn.plan(*interleave(inputs, ops, output), memory_limit=limit)
    assert p.num_slices > 1
    fans = [p.derivative_plan(i)[3] for i in range(len(ops))]
    assert max(fans) > 1  # (not every derivative network fits under the plan's slicing alone)
    for i, fan in enumerate(fans):
        d = p.derivative_plan(i)[0]
        assert d.largest_intermediate[1] <= limit and d.num_slices == p.num_slices * fan
    bound = _contract_bound(limit, ops, out_bytes=8)
    first_order = lambda: torch.autograd.grad(p.contract(*ops), ops)  # noqa: E731
    double = lambda: torch.autograd.grad(p.contract(*ops), ops, create_graph=True)  # noqa: E731
    func_grad = lambda: torch.func.grad(lambda *o: p.contract(*o), argnums=tuple(range(len(ops))))(  # noqa: E731
        *[o.detach() for o in ops])
    for run in (first_order, double, func_grad):
        run()
        assert _peak_bytes(run) <= bound, (run, _peak_bytes(run), bound)
    ref = torch.autograd.grad(torch.einsum(*interleave(inputs, ops, output)), ops, create_graph=True)
    got = double()
    for a, b in zip(got, ref):
        _close(a, b)
    _assert_hvps_close(got, ref, ops, torch.Generator().manual_seed(3))  # double backward
    _assert_group_gradients_agree(p, ops, (range(1, p.num_slices - 1), [0, p.num_slices - 1, p.num_slices - 1], 1))


def test_derivative_networks_of_an_unsliced_plan_and_complex_operands():
    """A plan of one slice whose derivative networks need slices: a group with a repeated id runs
    the plan's slice once, and the create_graph gradients do the same (they came out 3x for
    [0, 0, 0]). Complex operands: create_graph and torch.func gradients within the bound (the
    derivative networks took a resolved conjugate of every operand: 1.08-1.18x the bound)."""
    inputs, output, arrays = lattice_network(3, 3, 3, seed=0, dtype=F64)
    ops = [a.requires_grad_() for a in arrays]
    p = tn.plan(*interleave(inputs, ops, output), memory_limit=1024)
    assert p.num_slices == 1 and max(p.derivative_plan(i)[3] for i in range(len(ops))) > 1
    _assert_group_gradients_agree(p, ops, ([0], [0, 0, 0]))
    for rows, cols, bond in ((3, 3, 4), (3, 4, 3)):
        inputs, output, arrays = lattice_network(rows, cols, bond, seed=0, dtype=F64)
        gen = torch.Generator().manual_seed(rows * cols)
        ops = [(a + 1j * torch.randn(a.shape, dtype=F64, generator=gen)).requires_grad_() for a in arrays]
        p = tn.plan(*interleave(inputs, ops, output), memory_limit=2048)
        bound = _contract_bound(2048, ops, out_bytes=16)
        double = lambda: torch.autograd.grad(p.contract(*ops).real, ops, create_graph=True)  # noqa: E731
        double()
        assert _peak_bytes(double) <= bound, (rows, cols, _peak_bytes(double), bound)
        ref = torch.autograd.grad(torch.einsum(*interleave(inputs, ops, output)).real, ops, create_graph=True)
        got = double()
        for a, b in zip(got, ref):
            _close(a, b)
        _assert_hvps_close(got, ref, ops, gen)


def test_derivative_network_over_the_limit_warns(monkeypatch):
    """A derivative network that cannot keep to the plan's limit is planned without one, with a
    RuntimeWarning naming the operand; its gradients stay right."""
    import sys
    inputs, output, arrays = lattice_network(3, 4, 4, seed=0, dtype=F64)
    ops = [a.requires_grad_() for a in arrays]
    p = tn.plan(*interleave(inputs, ops, output), memory_limit=2040)  # (a plan of its own: no derivatives yet)
    planner = sys.modules["torch_gradops.tensornet.plan"]
    build = planner.build_plan

    def refusing(expr, terms, output, shapes, dtype, device_type, memory_limit, *args, **kw):
        if memory_limit is not None and expr is None:  # (derivative networks come without an expression)
            raise ValueError("memory_limit cannot be met: a test's refusal")
        return build(expr, terms, output, shapes, dtype, device_type, memory_limit, *args, **kw)

    monkeypatch.setattr(planner, "build_plan", refusing)
    with pytest.warns(RuntimeWarning, match=r"derivative network of operand \d+ .* planned without memory_limit "
                                            r".*a test's refusal"):
        got = torch.autograd.grad(p.contract(*ops), ops, create_graph=True)
    ref = torch.autograd.grad(torch.einsum(*interleave(inputs, ops, output)), ops)
    for a, b in zip(got, ref):
        _close(a, b)


def _mkl_max_threads():
    """MKL's thread count for the calling thread, or None where torch has no MKL."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None
    get = getattr(lib, "MKL_Get_Max_Threads", None)
    return get() if get is not None and torch.backends.mkl.is_available() else None


def test_small_gemms_leave_the_blas_thread_count_as_it_was():
    """The executor runs GEMMs under 2^20 multiply-adds on one BLAS thread (waking MKL's sleeping
    workers costs more than they take); the caller's thread count is back afterwards, for
    real and complex networks, forward and backward."""
    before_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        before = _mkl_max_threads()
        if before is None or before < 2:
            pytest.skip("needs torch with MKL and 2 BLAS threads")
        for dtype in (F64, C128):
            inputs, output, arrays = lattice_network(3, 3, 4, seed=0, dtype=dtype)
            leaves = [a.clone().requires_grad_(True) for a in arrays]
            for limit in (None, 256 * 16):
                p = tn.plan(*interleave(inputs, leaves, output), memory_limit=limit)
                p.contract(*leaves).real.backward()
                assert _mkl_max_threads() == before, (dtype, limit)
    finally:
        torch.set_num_threads(before_threads)


def _bmm_shapes(fn):
    """The ([Bt,M,K], [Bt,K,N]) input shapes of every bmm that ``fn()`` runs."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [tuple(map(tuple, e.input_shapes[:2])) for e in prof.events() if e.name == "aten::bmm"]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_thin_gemm_results_are_computed_transposed(dtype):
    """MKL's GEMM into a row-major result with rows of fewer than 16 elements runs at a fraction
    of its speed (2-12x slower on [2048,64] x [64,8] than the transposed product): the executor
    computes such real products (rows n < 16, m >= 4n, k >= 4n), forward and backward, as
    C^T = B^T A^T, a block of rows at a time. No bmm of such a shape runs (each case ran one
    on the previous executor), and values and gradients equal torch.einsum's."""
    cases = [  # (terms, output, sizes); each runs a thin product on the previous executor
        (("ab", "bc"), "ac", dict(a=2048, b=64, c=8)),          # dB = A^T dC: [64,2048] x [2048,8]
        (("ab", "bc"), "ac", dict(a=2048, b=8, c=64)),          # dA = dC B^T: [2048,64] x [64,8]
        (("abx", "bcx"), "acx", dict(a=512, b=4, c=32, x=3)),   # batched: [3,512,32] x [3,32,4], ...
        (("ab", "bc"), "ac", dict(a=4096, b=8, c=64)),          # 2^15 result elements: 4 blocks of rows
    ]
    for terms, out, sizes in cases:
        g = torch.Generator().manual_seed(0)
        arrays = [torch.randn([sizes[c] for c in t], generator=g, dtype=dtype, requires_grad=True) for t in terms]
        ref = [a.detach().clone().requires_grad_(True) for a in arrays]
        expr = ",".join(terms) + "->" + out
        res = {}

        def run():
            y = tn.contract(expr, *arrays)
            res["y"] = y
            y.backward(torch.ones_like(y))
        shapes = _bmm_shapes(run)
        thin = [(x, y) for x, y in shapes
                if y[2] < 16 and x[1] >= 4 * y[2] and x[2] >= 4 * y[2] and x[0] * x[1] * x[2] * y[2] >= 2 ** 17]
        assert not thin, (expr, thin)
        if sizes.get("a") == 4096:  # dA^T = B dC^T by blocks of 1024 rows of dA
            assert shapes.count(((1, 8, 64), (1, 64, 1024))) == 4, shapes
        y_ref = torch.einsum(expr, *ref)
        y_ref.backward(torch.ones_like(y_ref))
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(res["y"], y_ref, **tol)
        for a, r in zip(arrays, ref):
            torch.testing.assert_close(a.grad, r.grad, **tol)


_SUBPROCESS_PASSIVE = """
import json, threading, torch
from torch_gradops import tensornet as tn
from torch_gradops.testing import gemm_team_parts, interleave, lattice_network
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)

def rand(shape, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

def record(p, leaves, y):
    w = rand(y.shape, y.dtype)
    (y * w).sum().real.backward()
    row = [float(y.detach().real.sum()), float(y.detach().imag.sum()) if y.is_complex() else 0.0, p.num_slices]
    row += [float(a.grad.abs().sum()) for a in leaves]
    for a in leaves:
        a.grad = None
    return row

out = []
for dtype in (torch.float64, torch.complex128):
    # lattices: small steps (inline under PASSIVE) and bond 8 (GEMMs and layout copies split)
    for (r, c, bond), limits in (((4, 4, 4), (None, 2048)), ((4, 4, 8), (None, 2 ** 15))):
        inputs, output, arrays = lattice_network(r, c, bond, seed=1, dtype=dtype)
        leaves = [a.clone().requires_grad_(True) for a in arrays]
        for limit in limits:
            p = tn.plan(*interleave(inputs, leaves, output), memory_limit=limit, optimize="greedy")
            out.append(record(p, leaves, p.contract(*leaves)))
    # single GEMMs split by rows, by columns and by batch
    for eq, shapes in (("ij,jk->ik", [(512, 64), (64, 128)]), ("ij,jk->ik", [(64, 64), (64, 1024)]),
                       ("bij,bjk->bik", [(4, 64, 64), (4, 64, 64)])):
        leaves = [rand(s, dtype).requires_grad_(True) for s in shapes]
        p = tn.plan(eq, *leaves)
        out.append(record(p, leaves, p.contract(*leaves)))

# two threads contracting at once: one holds the team, the other runs alone; both right
a, b = rand((256, 128), torch.float64), rand((128, 512), torch.float64)
want = a @ b
errors = []
def work():
    for _ in range(20):
        got = tn.contract("ij,jk->ik", a, b)
        errors.append(float((got - want).abs().max()))
threads = [threading.Thread(target=work) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps([torch.get_num_threads(), out, gemm_team_parts(), max(errors)]))
"""


def test_sleeping_openmp_workers_run_small_steps_inline_and_split_large_ones():
    """Under OMP_WAIT_POLICY=PASSIVE the executor runs small steps (their copies, adds and GEMMs)
    on the calling thread, a team of one for the step, and splits larger GEMMs and layout copies
    across its GEMM team (helper threads that spin only during an executor call: by rows, by
    columns, by batch). What a test can see of it: values and gradients (real and complex,
    sliced and unsliced, lattices and single GEMMs of each split) equal those under the default
    policy, the team ran parts under PASSIVE and none otherwise, two threads contracting at once
    get right results (one holds the team, the other runs alone), and the caller's OpenMP thread
    count is back afterwards; the speed is the benchmarks'."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for policy in ("PASSIVE", None):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env.update(PYTHONPATH=root, OMP_NUM_THREADS="2")
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        res = subprocess.run([sys.executable, "-c", _SUBPROCESS_PASSIVE], capture_output=True, text=True, env=env,
                             cwd=root, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[policy] = json.loads(res.stdout.splitlines()[-1])
    assert runs["PASSIVE"][0] == 2 and runs[None][0] == 2
    assert any(r[2] > 1 for r in runs[None][1])  # a sliced run among them
    assert runs["PASSIVE"][2] > 0 and runs[None][2] == 0  # the split paths ran, and only under PASSIVE
    assert runs["PASSIVE"][3] < 1e-10 and runs[None][3] < 1e-10
    assert [len(r) for r in runs["PASSIVE"][1]] == [len(r) for r in runs[None][1]]
    flat = {k: torch.tensor([x for r in v[1] for x in r]) for k, v in runs.items()}
    torch.testing.assert_close(flat["PASSIVE"], flat[None], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["lattice", "circuit"])
def test_peak_memory_within_contract_on_real_networks(kind):
    """The contract on networks shaped like the benchmarks' (a lattice; a complex circuit
    amplitude), at limits from a small fraction of the unsliced largest intermediate up, for a
    scalar output (gradients during the forward) and a non-scalar one (recomputing backward)."""
    gen = torch.Generator().manual_seed(42)
    if kind == "lattice":
        inputs, output, arrays = lattice_network(4, 4, 4, seed=1, dtype=F64)
    else:
        inputs, output, arrays = circuit_amplitude_network(3, 4, 8, seed=3, dtype=C128)
    base = tn.plan(*interleave(inputs, arrays, output), optimize="greedy")
    for scalar in (True, False):
        out_modes = list(output) if scalar else [inputs[0][0]]
        leaves = [a.clone().requires_grad_(True) for a in arrays]
        full = tn.plan(*interleave(inputs, leaves, out_modes), optimize="greedy")
        ref = [a.clone().requires_grad_(True) for a in arrays]
        ref_out = full.contract(*ref)
        g = _rand(ref_out.shape, ref_out.dtype, gen)
        ref_grads = torch.autograd.grad(ref_out, ref, g)
        for frac in ((16, 4) if kind == "lattice" else (4, 1)):
            limit = base.largest_intermediate[1] // frac
            p = tn.plan(*interleave(inputs, leaves, out_modes), memory_limit=limit)
            assert p.largest_intermediate[1] <= limit
            got = [None]

            def run():
                out = p.contract(*leaves)
                got[0] = (out.detach(), torch.autograd.grad(out, leaves, g))
            run()
            peak = _peak_bytes(run)
            out_bytes = ref_out.numel() * ref_out.element_size()
            assert peak <= _contract_bound(limit, arrays, out_bytes), (kind, scalar, frac, p, peak)
            _close(got[0][0], ref_out.detach(), rtol=1e-8, atol=1e-10)
            for a, b in zip(got[0][1], ref_grads):
                _close(a, b, rtol=1e-8, atol=1e-10)


def test_modelled_peak_bounds_the_executor_on_a_checkpointed_lattice():
    """The planner's memory model is an upper bound of what the executor holds: on the 6x6
    lattice of bond 8 (float32) at 1 MiB and 512 KiB, two checkpoints, the measured tensor peak
    of forward + backward is at most the modelled peak + the operands' gradients and the copies
    of their slices + the output. At 1 MiB some intermediates cross both checkpoints and are
    copied into their reader's GEMM layout; a checkpoint that kept them although its own
    segment does not read them held the original beside the copy (and then the gradient
    written over the copy), 1 % over the model."""
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0)
    leaves = [a.clone().requires_grad_(True) for a in arrays]
    operand_bytes = sum(a.numel() * a.element_size() for a in arrays)
    for limit in (1 << 20, 1 << 19):
        p = tn.plan(*interleave(inputs, leaves, output), memory_limit=limit)
        assert len(p.checkpoints) >= 2 and p.num_slices > 1, p

        def run():
            torch.autograd.grad(p.contract(*leaves), leaves)
        run()
        peak = _peak_bytes(run)
        assert peak <= p.modelled_peak + 2 * operand_bytes + 1024, (limit, peak, p.modelled_peak, operand_bytes)


@pytest.mark.parametrize("dtype", [F64, C128])
def test_checkpointed_backward_matches_and_bounds_memory(dtype):
    """CHECKPOINTs split the backward's recomputation into segments: same values and
    gradients; the plan places them when storing a whole slice would exceed memory_limit."""
    gen = torch.Generator().manual_seed(33)
    expr, ops = _ladder(gen, dtype=dtype, n=6, chi=3)
    p = tn.plan(expr, *ops, slicing={"min_slices": 4})
    table = list(p.slice_set.table(None))
    g = _rand(p.output_shape, dtype, gen)
    needs = [1] * len(ops)
    ref_out = torch.ops.torch_gradops.contract_program(ops, list(p.program), table)
    ref = torch.ops.torch_gradops.contract_program_backward(ops, list(p.program), table, g, needs, [])
    steps = len(p.path)
    for cps in ([1], [2, 5], [3, steps - 1], list(range(1, steps))):
        program, _ = compile_program(p.network.inputs, p.network.output, p.network.sizes, p.path, p.sliced_ids,
                                     torch.empty((), dtype=dtype).element_size(), dtype.is_complex, cps)
        assert sum(isinstance(x, Checkpoint) for x in decode(program).instructions) >= len(cps)
        prog = program
        _close(torch.ops.torch_gradops.contract_program(ops, list(prog), table), ref_out)
        got = torch.ops.torch_gradops.contract_program_backward(ops, list(prog), table, g, needs, [])
        for x, y in zip(got, ref):
            _close(x, y)
    # a deep network whose intermediates all together exceed the budget: the plan checkpoints
    inputs, output, arrays = circuit_amplitude_network(3, 3, 8, seed=2, dtype=dtype if dtype.is_complex else C128)
    args = [x for t, a in zip(inputs, arrays) for x in (a, t)] + [list(output)]
    full = tn.plan(*args, optimize="greedy")
    limit = full.largest_intermediate[1]  # no slicing needed for the limit itself
    assert full.modelled_peak > 3.5 * limit  # but all intermediates together exceed the cap
    cp = tn.plan(*args, optimize="greedy", memory_limit=limit)
    assert cp.checkpoints and cp.modelled_peak <= 3.5 * limit
    leaves = [a.clone().requires_grad_(True) for a in arrays]
    ref_leaves = [a.clone().requires_grad_(True) for a in arrays]
    out = cp.contract(*leaves)
    ref_out = full.contract(*ref_leaves)
    _close(out, ref_out)
    for x, y in zip(torch.autograd.grad(out.abs(), leaves), torch.autograd.grad(ref_out.abs(), ref_leaves)):
        _close(x, y)
    operand_bytes = sum(a.numel() * a.element_size() for a in arrays)
    peak = _peak_bytes(lambda: torch.autograd.grad(cp.contract(*leaves).abs(), leaves))
    assert peak <= 4 * limit + 2 * operand_bytes + 1024, (peak, limit)


# ---------------------------------------------------------------------------- plan cache
def test_plan_cache_hits_do_no_path_search():
    tn.clear_plan_cache()
    gen = torch.Generator().manual_seed(17)
    a, b, c = _rand((3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 6), gen=gen)
    tn.contract("ab,bc,cd->ad", a, b, c)
    searches = tn.plan_cache_info()["path_searches"]
    assert searches == 1
    for _ in range(5):
        tn.contract("ab,bc,cd->ad", a + 1, b, c)
        tn.contract(a, [0, 1], b, [1, 2], c, [2, 3], [0, 3])
    info = tn.plan_cache_info()
    assert info["path_searches"] == 1  # the interleaved form: another plan, the same network's searched path
    assert info["hits"] >= 8 and info["misses"] == 2
    p = tn.plan("ab,bc,cd->ad", a, b, c)
    assert p is tn.plan("ab,bc,cd->ad", (3, 4), (4, 5), (5, 6), dtype=F64)
    assert tn.plan_cache_info()["path_searches"] == 1
    # different shapes, dtype or options: a new plan
    tn.contract("ab,bc,cd->ad", a.float(), b.float(), c.float())
    tn.contract("ab,bc,cd->ad", a, b, c, slicing=["b"])
    assert tn.plan_cache_info()["path_searches"] == 3


def test_plan_cache_size_and_its_thrash_warning():
    """More distinct networks than the cache holds are planned again on every pass (a
    Hamiltonian of more than 512 terms did so silently): the first rebuild warns, naming
    set_plan_cache_size, and counts in plan_cache_info; with room for all, passes only hit."""
    tn.clear_plan_cache()
    gen = torch.Generator().manual_seed(18)
    nets = [[_rand((2, 2 + k % 3), gen=gen), [0, 1], _rand((2 + k % 3, 3 + k // 3), gen=gen), [1, 2], [0, 2]]
            for k in range(6)]
    assert tn.plan_cache_info()["maxsize"] == 512
    old = tn.set_plan_cache_size(4)
    try:
        assert old == 512 and tn.plan_cache_info()["maxsize"] == 4
        for net in nets:  # first pass: misses, no rebuild
            tn.contract(*net)
        assert tn.plan_cache_info()["rebuilt"] == 0
        with pytest.warns(RuntimeWarning, match=r"plan cache \(4 plans\).*set_plan_cache_size") as rec:
            for net in nets:
                tn.contract(*net)
        assert len([w for w in rec if "plan cache" in str(w.message)]) == 1  # once
        assert rec[0].filename == __file__  # the warning names the caller's line
        info = tn.plan_cache_info()
        assert info["rebuilt"] == 6 and info["hits"] == 0 and info["size"] == 4
        assert tn.set_plan_cache_size(8) == 4
        for net in nets:
            tn.contract(*net)
        hits = tn.plan_cache_info()["hits"]
        for net in nets:
            tn.contract(*net)
        assert tn.plan_cache_info()["hits"] == hits + 6
        assert tn.set_plan_cache_size(2) == 8 and tn.plan_cache_info()["size"] == 2  # shrinking drops plans
        for bad in (-1, 2.5, "8", True):
            with pytest.raises(ValueError, match="maxsize must be an int >= 0"):
                tn.set_plan_cache_size(bad)
        # a cache of size 0 (caching off) rebuilds without warning, and leaves the warning for a
        # later size that thrashes (it was used up, silently, by the size-0 rebuilds)
        tn.clear_plan_cache()
        tn.set_plan_cache_size(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for net in nets[:3] * 2:
                tn.contract(*net)
        tn.set_plan_cache_size(2)
        with pytest.warns(RuntimeWarning, match=r"plan cache \(2 plans\)"):
            for net in nets[:3] * 3:
                tn.contract(*net)
    finally:
        tn.set_plan_cache_size(old)
        tn.clear_plan_cache()


_SUBPROCESS_PLAN = """
import json, sys, torch
from torch_gradops import tensornet as tn
from torch_gradops.testing import interleave, lattice_network
inputs, output, arrays = lattice_network(3, 4, 3, seed=5, dtype=torch.float64)
args = interleave(inputs, arrays, output)
cached = tn.plan(*args, memory_limit=int(sys.argv[1]), optimize="cotengra")
tn.clear_plan_cache()
fresh = tn.plan(*args, memory_limit=int(sys.argv[1]), optimize="cotengra", path_cache=sys.argv[2])
print(json.dumps([[cached.searched, cached.path, list(cached.sliced_modes)],
                  [fresh.searched, fresh.path, list(fresh.sliced_modes)]]))
"""


def test_path_cache_on_disk_and_deterministic_search(tmp_path):
    """The hyper-search (what "auto" runs for networks of more than 8 operands whose contraction
    is worth searching for) is seeded: another process, with another hash seed, finds the same
    plan; with an on-disk path cache (path_cache= or $TORCH_GRADOPS_PATH_CACHE), a cleared plan
    cache or a new process does not search again."""
    import json
    import os
    import subprocess
    import sys
    inputs, output, arrays = lattice_network(3, 4, 3, seed=5, dtype=F64)
    args = interleave(inputs, arrays, output)
    limit = tn.plan(*args, optimize="greedy").largest_intermediate[1] // 4
    tn.clear_plan_cache()
    kw = dict(memory_limit=limit, optimize="cotengra", path_cache=tmp_path / "cache")
    p = tn.plan(*args, **kw)
    assert p.optimizer == "cotengra" and p.searched and p.num_slices > 1
    assert tn.plan_cache_info()["path_searches"] == 1
    assert tn.plan(*args, **kw) is p  # in memory: no search
    tn.clear_plan_cache()
    q = tn.plan(*args, **kw)  # on disk: no search
    assert not q.searched and tn.plan_cache_info()["path_searches"] == 0 and q.search_s == 0
    assert q.path == p.path and q.sliced_modes == p.sliced_modes
    _close(q.contract(*arrays), torch.einsum(*[x for t, a in zip(inputs, arrays) for x in (a, t)], output))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, PYTHONHASHSEED="7", TORCH_GRADOPS_PATH_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", _SUBPROCESS_PLAN, str(limit), str(tmp_path / "other")],
                         capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (c_searched, c_path, c_sliced), (f_searched, f_path, f_sliced) = json.loads(res.stdout.splitlines()[-1])
    assert not c_searched and f_searched  # the env var's cache answered; the empty one searched
    for path, sliced in ((c_path, c_sliced), (f_path, f_sliced)):
        assert [tuple(x) for x in path] == p.path and tuple(sliced) == p.sliced_modes


def test_path_cache_hit_gives_the_plan_the_search_chose(tmp_path):
    """The on-disk cache kept each search's tree and chose among them again on a hit, without
    the candidates and the reconfigured trees the search had compared: a 12-tensor ring with
    open legs at 512 bytes planned ('e', 'B') fresh and ('A', 'B', h/2) from the cache, so ranks
    with warm and cold caches would have disagreed on the slices. The cache now keeps the tree
    the search finally chose."""
    gen = torch.Generator().manual_seed(0)
    ops = [torch.randn(4, 4, 2, dtype=F64, generator=gen) for _ in range(12)]
    lower, upper = "abcdefghijkl", "ABCD"
    expr = ",".join(lower[i] + lower[(i + 1) % 12] + upper[i % 4] for i in range(12)) + "->AB"
    plans = []
    for cache in ("", tmp_path, tmp_path, tmp_path):  # none, written, read, read
        tn.clear_plan_cache()
        p = tn.plan(expr, *ops, memory_limit=512, optimize="cotengra", path_cache=cache)
        plans.append((p.searched, p.path, p.sliced_modes, p.num_slices, p.flops))
    assert [x[0] for x in plans] == [True, True, False, False]
    assert all(x[1:] == plans[0][1:] for x in plans), plans
    _close(p.contract(*ops), torch.einsum(expr, *ops))
    tn.clear_plan_cache()


def test_search_uses_pythons_seeded_greedy_whatever_is_installed(monkeypatch):
    """cotengra's own "greedy" trials run its Rust greedy when cotengrust is installed, whose
    random draws are seeded per process (plans would then differ between processes and ranks),
    and its subtree reconfiguration takes cotengrust's exact optimizer, which breaks ties
    differently (plans would depend on the install): the search must use neither. With both
    made to fail and the winner always reconfigured, the search still runs, and gives the plan
    it gives without the patches."""
    import cotengra.pathfinders.path_basic as cotengra_basic
    import cotengra.pathfinders.path_greedy as cotengra_greedy
    from torch_gradops.tensornet import paths
    monkeypatch.setattr(paths, "worth_polishing", lambda *a, **k: True)
    inputs, output, arrays = lattice_network(3, 4, 3, seed=5, dtype=F64)
    args = interleave(inputs, arrays, output)
    limit = tn.plan(*args, optimize="greedy").largest_intermediate[1] // 4
    tn.clear_plan_cache()
    ref = tn.plan(*args, memory_limit=limit, optimize="cotengra")
    tn.clear_plan_cache()

    def refuse(*a, **k):
        raise AssertionError("the search called cotengra's installed greedy")
    monkeypatch.setattr(cotengra_greedy, "ssa_greedy_optimize", refuse)
    python_optimal = cotengra_basic.get_optimize_optimal(False)
    monkeypatch.setattr(cotengra_basic, "get_optimize_optimal",
                        lambda accel="auto": python_optimal if accel is False else refuse)
    p = tn.plan(*args, memory_limit=limit, optimize="cotengra")
    assert p.searched and p.path == ref.path and p.sliced_modes == ref.sliced_modes
    tn.clear_plan_cache()


def _tree_of(path, n):
    """The contraction tree of a linear path: per step the frozenset of operands it joins."""
    live = [frozenset([i]) for i in range(n)]
    out = set()
    for a, b in path:
        x, y = live.pop(max(a, b)), live.pop(min(a, b))
        live.append(x | y)
        out.add(x | y)
    return out


def test_winner_is_reconfigured_when_worth_it(monkeypatch):
    """The search's winner is reconfigured (cotengra's subtree reconfiguration, as sliced and with
    its order unsliced) when that costs at most a fraction of its plan's estimated time: never a
    worse plan, and on the 6x6 lattice of bond 8 at 4 MiB a plan of one slice instead of several
    (its greedy trials alone leave 6.7e9 FLOPs in four slices, eight once the split layout is
    checked against the cap; their best reconfigured 1.0e9 in one). Deterministic: the same
    plan again after the plan cache is cleared."""
    from torch_gradops.tensornet import paths, slicer
    assert not paths.worth_polishing(36, 1e6) and paths.worth_polishing(36, 1e10)
    assert paths.worth_polishing(36, 3e9, trees=1) and not paths.worth_polishing(36, 3e9, trees=2)
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0)
    args = interleave(inputs, arrays, output)
    limit = 4 << 20
    tn.clear_plan_cache()
    polished = tn.plan(*args, memory_limit=limit)
    tn.clear_plan_cache()
    assert tn.plan(*args, memory_limit=limit).path == polished.path
    tn.clear_plan_cache()
    monkeypatch.setattr(paths, "worth_polishing", lambda *a, **k: False)
    plain = tn.plan(*args, memory_limit=limit)
    tn.clear_plan_cache()
    work = [p.flops + p.recompute_flops for p in (polished, plain)]
    assert polished.num_slices == 1 and plain.num_slices > 1, (polished, plain)
    assert work[0] < 0.5 * work[1], work
    assert polished.modelled_peak <= slicer.MODEL_CAP * limit
    greedy = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output),
                                     {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)})
    want = einsum_pairwise(inputs, output, [a.double() for a in arrays], greedy)
    torch.testing.assert_close(polished.contract(*arrays).double(), want, rtol=1e-4, atol=1e-6 * want.abs().item())



def test_unsliced_search_reconfigures_only_the_winner(monkeypatch):
    """Without a memory limit the trials are plain greedy trees, as with one: cotengra's own
    default (no slicing options) reconfigures every trial's tree, 10-20x a trial each (0.27 s
    of planning the 6x6 lattice unsliced on a 2-core VM, against 0.03 s). The winner alone is
    reconfigured, as sliced and with its order unsliced."""
    import cotengra
    calls = []
    for name in ("subtree_reconfigure", "subtree_reconfigure_"):
        orig = getattr(cotengra.ContractionTree, name)

        def counting(self, *a, _orig=orig, **k):
            calls.append(1)
            return _orig(self, *a, **k)
        monkeypatch.setattr(cotengra.ContractionTree, name, counting)
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0)
    tn.clear_plan_cache()
    plan = tn.plan(*interleave(inputs, arrays, output))
    tn.clear_plan_cache()
    assert plan.num_slices == 1 and plan.optimizer == "cotengra", plan
    assert 1 <= len(calls) <= 2, len(calls)


@pytest.mark.parametrize("minimize", ["flops", "combo-32"])
def test_reconfiguration_memo_gives_the_exact_optimizers_trees(monkeypatch, minimize):
    """The winner's reconfiguration memoises cotengra's exact subtree optimizer (the same
    subtree, sizes and cost cap come back within a tree and across its sliced and unsliced
    versions): the reconfigured trees are those of the optimizer called every time, from fewer
    calls, for both objectives the planner reconfigures with (unsliced plans: "combo"). Keyed by the sizes too: a chain whose best order flips with them gets the exact
    optimizer's path each way (a memo keyed by the subtree alone fails this)."""
    import cotengra
    from cotengra.pathfinders import path_basic
    from torch_gradops.tensornet import paths
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0)
    sym = {m: opt_einsum.get_symbol(i) for i, m in enumerate(sorted({m for t in inputs for m in t}))}
    c_in = [[sym[m] for m in t] for t in inputs]
    sizes = {sym[m]: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    greedy = opt_einsum.paths.greedy([frozenset(t) for t in c_in], frozenset(), sizes)
    tree = cotengra.ContractionTree.from_path(c_in, [], sizes, path=greedy)
    tree = tree.remove_ind(sym[inputs[14][1]])  # a bond in the middle sliced
    calls = {"plain": 0, "memo": 0}

    class Plain(path_basic.OptimalOptimizer):
        def __call__(self, *a, **k):
            calls[self.who] += 1
            return super().__call__(*a, **k)

    def plain_optimal(who, minimize):
        opt = Plain(minimize=minimize, accel=False)
        opt.who = who
        return opt

    memo = paths._MemoisedOptimal
    monkeypatch.setattr(paths, "_MemoisedOptimal", lambda minimize: plain_optimal("plain", minimize))
    want = [t.get_path() for t in paths._reconfigured(tree, c_in, [], sizes, minimize)]

    def counted(minimize):
        m = memo(minimize)
        m._opt = plain_optimal("memo", minimize)
        return m
    monkeypatch.setattr(paths, "_MemoisedOptimal", counted)
    got = [t.get_path() for t in paths._reconfigured(tree, c_in, [], sizes, minimize)]
    assert len(want) == 2 and got == want
    assert 0 < calls["memo"] < calls["plain"], calls
    # keyed by the sizes: a chain whose best order flips with them
    m, exact = memo(minimize), path_basic.OptimalOptimizer(minimize=minimize, accel=False)
    chain = [("a", "b"), ("b", "c"), ("c", "d")]
    for extents in ({"a": 2, "b": 10, "c": 2, "d": 10}, {"a": 10, "b": 2, "c": 10, "d": 2}) * 2:
        m.cost_cap = exact.cost_cap = 10 ** 4
        assert [tuple(p) for p in m(chain, (), extents)] == [tuple(p) for p in exact(chain, (), extents)]
    assert m(chain, (), {"a": 2, "b": 10, "c": 2, "d": 10}) != m(chain, (), {"a": 10, "b": 2, "c": 10, "d": 2})


def test_step_costs_rescaled_match_a_fresh_table():
    """StepCosts.rescaled (one mode's extent changed, in the time of that mode's steps) gives
    the table a fresh StepCosts computes, for modes chunked and sliced, on lattice and circuit
    step tables, including repeated rescaling."""
    from torch_gradops.tensornet import slicer
    rng = random.Random(5)
    fields = ("macs", "result", "inputs", "from_step", "consumer")
    for inputs, output, arrays in (lattice_network(4, 5, 4, seed=2), circuit_amplitude_network(3, 3, 6, seed=1)):
        sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
        path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
        steps = slicer.step_table(inputs, output, path)
        where = slicer.mode_steps(steps)
        for _ in range(20):
            cur, sliced = dict(sizes), set()
            costs = slicer.StepCosts(steps, cur, sliced)
            for _ in range(3):
                m = rng.choice(sorted(m for m in where if m not in sliced and cur[m] > 1))
                e = cur[m]
                new = rng.choice([1] + [d for d in range(1, e) if e % d == 0])
                if new == 1:
                    sliced.add(m)
                else:
                    cur[m] = new
                costs = costs.rescaled(where[m], e, new)
                fresh = slicer.StepCosts(steps, cur, sliced)
                for f in fields:
                    assert list(getattr(costs, f)) == list(getattr(fresh, f)), f


def test_split_layout_is_modelled_and_split_further_when_over_the_cap(monkeypatch):
    """Mode splits are chosen on the unsplit network's GEMM layout; the split network's own
    layout may copy more. The plan's checkpoints and modelled peak come from the split layout,
    and where that is over the cap the planner splits further: on the 6x6 lattice of bond 8 at
    4 MiB with the search's winner not reconfigured, the split plan was modelled at 4.4 x the
    limit (over the 3.5 x cap and the 4 x contract). Now within the cap, within the measured
    contract, and the values and gradients equal a float64 reference."""
    from torch_gradops.tensornet import paths, slicer
    monkeypatch.setattr(paths, "worth_polishing", lambda *a, **k: False)
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0)
    limit = 4 << 20
    tn.clear_plan_cache()
    try:
        p = tn.plan(*interleave(inputs, arrays, output), memory_limit=limit)
    finally:
        tn.clear_plan_cache()
    assert any(isinstance(m, tn.ModeChunks) for m in p.sliced_modes), p
    assert p.modelled_peak <= slicer.MODEL_CAP * limit, p
    leaves = [a.clone().requires_grad_(True) for a in arrays]
    got = [None]

    def run():
        out = p.contract(*leaves)
        got[0] = (out.detach(), torch.autograd.grad(out, leaves))
    run()
    assert _peak_bytes(run) <= _contract_bound(limit, arrays, 4)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    greedy = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), sizes)
    ref = [a.double().requires_grad_(True) for a in arrays]
    want = einsum_pairwise(inputs, output, ref, greedy)
    want_grads = torch.autograd.grad(want, ref)
    torch.testing.assert_close(got[0][0].double(), want.detach(), rtol=1e-4, atol=1e-6 * want.abs().item())
    for a, b in zip(got[0][1], want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-3, atol=1e-4 * b.abs().max().item())


def test_heavy_last_schedule_keeps_the_tree_and_cuts_recomputation():
    """paths.heavy_last reorders a path's steps (depth first, the heavier subtree of each step
    last): the same contraction tree, so the same values; under a memory limit the planner's
    backward then recomputes less (the executor recomputes the steps before the last checkpoint)."""
    from torch_gradops.tensornet import paths, slicer
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(2, 12)
        path, k = [], n
        while k > 1:
            a, b = rng.sample(range(k), 2)
            path.append((min(a, b), max(a, b)))
            k -= 1
        weight = [rng.randint(1, 100) for _ in path]
        new = paths.heavy_last(path, n, weight)
        assert len(new) == len(path) and _tree_of(new, n) == _tree_of(path, n)
        assert paths.check_path(new, n) == new
    # the 5x5 lattice of bond 16 on opt_einsum's greedy tree, scheduled heavy-last and heavy-first
    inputs, output, arrays = lattice_network(5, 5, 16, seed=0)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    n = len(inputs)
    tree = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
    macs = slicer.step_costs(slicer.step_table(inputs, output, tree), sizes, ()).macs
    last, first = paths.heavy_last(tree, n, macs), paths.heavy_last(tree, n, [-m for m in macs])
    assert _tree_of(last, n) == _tree_of(first, n) == _tree_of(tree, n)
    for frac in (0.8, 0.6):
        recomputed = []
        for path in (last, first):
            costs = slicer.step_costs(slicer.step_table(inputs, output, path), sizes, ())
            cap = frac * slicer.memory_model(costs)
            peak, _, rec = slicer.place_checkpoints(costs, cap)
            assert peak <= cap
            recomputed.append(rec / costs.flops())
        assert recomputed[0] < 0.75 * recomputed[1], recomputed
    small = [torch.randn(2, 2, 3, dtype=F64), torch.randn(3, 2, dtype=F64), torch.randn(2, 2, dtype=F64)]
    order = [(0, 1), (0, 1)]
    _close(tn.contract("abc,cd,db->a", *small, optimize=paths.heavy_last(order, 3, [1, 5])),
           torch.einsum("abc,cd,db->a", *small))


def _symbolic_lattice():
    """A 3x3 lattice of bond 4 as cotengra wants it: ``(inputs as symbols, sizes)``."""
    inputs, _, _ = lattice_network(3, 3, 4, seed=0)
    sym = {m: opt_einsum.get_symbol(m) for t in inputs for m in t}
    return [[sym[m] for m in t] for t in inputs], {s: 4 for s in sym.values()}


def test_search_budget_counts_trials_and_follows_the_best_plan():
    """The default search runs at least a few trials (fewer when the contraction is worth less),
    then more only while the trials cost less than a fraction of the best plan's estimated time:
    milliseconds of contraction are not searched for seconds, hours are searched up to the cap.
    Trials, not seconds, are counted: the decision is deterministic."""
    from torch_gradops.tensornet import paths
    assert paths.search_budget(36, 1e3)["min_repeats"] < 2  # worth no search: opt_einsum's greedy path
    b = paths.search_budget(36, 1e12, 3e12)  # sliced to a limit
    assert b["min_repeats"] == paths.MIN_TRIALS and b["max_repeats"] == 128
    b = paths.search_budget(36, 1e12)  # unsliced trials cost less, and fewer are the minimum
    assert b["min_repeats"] == paths.MIN_UNSLICED_TRIALS < paths.MIN_TRIALS and b["max_repeats"] == 128
    assert not paths.wants_more(36, paths.MIN_TRIALS, 1e9)
    assert paths.wants_more(36, paths.MIN_TRIALS, 1e12)
    assert not paths.wants_more(36, 10**4, 1e15)  # at most MAX_SEARCH_S worth
    # unsliced trials are cheaper, complex multiply-adds dearer: both are worth more trials
    assert not paths.wants_more(36, paths.MIN_TRIALS, 4e10)
    assert paths.wants_more(36, paths.MIN_TRIALS, 4e10, sliced=False)
    assert paths.wants_more(36, paths.MIN_TRIALS, 4e10, flops_per_mac=8)
    c_in, sizes = _symbolic_lattice()
    calls = []

    def more(trials):
        calls.append(trials)
        return trials < 10
    opt = paths.BudgetedHyperOptimizer(min_repeats=5, more=more, max_repeats=32, methods=["greedy"],
                                       progbar=False, parallel=False)
    opt.search(c_in, [], sizes)
    assert len(opt.scores) == 5 + 2 * paths.BATCH and calls == [5, 5 + paths.BATCH, 5 + 2 * paths.BATCH]
    opt = paths.BudgetedHyperOptimizer(min_repeats=3, more=lambda t: True, max_repeats=6, methods=["greedy"],
                                       progbar=False, parallel=False)
    opt.search(c_in, [], sizes)
    assert len(opt.scores) == 6 and opt.max_repeats == 6


def test_a_too_old_cotengra_is_named(monkeypatch):
    """cotengra 0.6-0.7 (which the package once declared it took) take the search's optlib_opts
    into **kwargs and fail inside the search with a TypeError; the planner checks for the option
    (not the version string: a source checkout reports 0.0.0+unknown) and names the version to
    install instead, and the paths that need no cotengra search still plan."""
    import cotengra
    from torch_gradops.tensornet import paths

    class OldHyperOptimizer:  # cotengra 0.7.5's signature
        def __init__(self, methods=None, minimize="flops", max_repeats=128, **optlib_opts):
            pass

    class NewHyperOptimizer:
        def __init__(self, methods=None, minimize="flops", max_repeats=128, optlib_opts=None, **kwargs):
            pass

    paths.check_cotengra()  # the installed one
    paths.check_cotengra(NewHyperOptimizer)
    monkeypatch.setattr(cotengra, "__version__", "0.7.5")
    with pytest.raises(ImportError, match=r"cotengra>=0\.8 .*found 0\.7\.5"):
        paths.check_cotengra(OldHyperOptimizer)
    monkeypatch.setattr(cotengra, "__version__", "0.0.0+unknown")  # a source checkout: its feature decides
    paths.check_cotengra(NewHyperOptimizer)
    inputs, output, arrays = lattice_network(3, 3, 2, seed=0, dtype=torch.float64)
    monkeypatch.setattr(cotengra, "HyperOptimizer", OldHyperOptimizer)
    tn.clear_plan_cache()
    try:
        with pytest.raises(ImportError, match="cotengra>=0.8"):
            tn.plan(*interleave(inputs, arrays, output), optimize="cotengra")
        p = tn.plan(*interleave(inputs, arrays, output), optimize="greedy")
        torch.testing.assert_close(p.contract(*arrays), einsum_pairwise(inputs, output, arrays, p.path))
    finally:
        tn.clear_plan_cache()


def test_searches_under_a_limit_take_trials_in_turn():
    """The default search under a limit runs two cotengra searches (slicing to the limit and to
    1/4 of it). One after the other, the first ran on while the budget followed only its own
    trees (8 trials of it, then 4 of the second, on the 6x6 benchmark lattice at 1 MiB, whose
    second search held the better tree after 4): in turn, the budget stops both once all have
    run their minimum. Each search's trials are still those it runs alone (its own seeded
    stream), so the plans only differ where the search now stops earlier."""
    from torch_gradops.tensornet import paths
    c_in, sizes = _symbolic_lattice()
    totals = []

    def more(total):
        totals.append(total)
        return total < 12

    def searches(n, min_repeats):
        return [paths.BudgetedHyperOptimizer(min_repeats=min_repeats, more=more, max_repeats=32,
                                             methods=[paths.GREEDY_TRIAL], optlib_opts={"seed": 0},
                                             slicing_opts={"target_size": t}, progbar=False, parallel=False)
                for t in (64, 16)[:n]]
    pair = searches(2, 4)
    trees = paths._seeded(lambda: paths._round_robin(pair, c_in, [], sizes))
    # 4 + 4 (the minimums), then a batch of the first: more(12) says stop
    assert [o.done for o in pair] == [4 + paths.BATCH, 4] and totals == [8, 12]
    assert all(t is not None for t in trees)
    for j, opt in enumerate(pair):  # the same trials as the search alone
        alone = searches(2, opt.done)[j]
        alone.more = lambda total: False
        paths._seeded(lambda: alone.search(c_in, [], sizes))
        assert alone.scores == opt.scores and alone.tree.get_path() == opt.tree.get_path()


@pytest.mark.parametrize("limit", [None, 64])
@pytest.mark.parametrize("expr, shapes", [
    ("ij,jk->ik", [(3, 1), (5, 4)]), ("ij,ij->ij", [(3, 1), (3, 4)]), ("ij,jk->ik", [(3, 1), (1, 4)]),
    ("ij,jk,kl->il", [(3, 5), (1, 4), (4, 1)]), ("ab,ab->", [(1, 4), (3, 1)]), ("ii,i->i", [(1, 1), (3,)]),
    ("...ij,jk->...ik", [(2, 3, 1), (5, 4)]), ("abc,cd,da->b", [(1, 3, 4), (4, 1), (5, 6)])])
def test_extent_one_broadcasts_like_torch_einsum(expr, shapes, limit):
    """A mode of extent 1 in one operand and n in another broadcasts, as in torch.einsum (and
    numpy, opt_einsum): it was refused ("mode 'j' has extent 5 in operand 1 but extent 1")."""
    ops = [torch.randn(s, dtype=F64, requires_grad=True) for s in shapes]
    want = torch.einsum(expr, *ops)
    got = tn.contract(expr, *ops, memory_limit=limit)
    assert got.shape == want.shape
    _close(got, want)
    for g, r in zip(torch.autograd.grad(got.square().sum(), ops), torch.autograd.grad(want.square().sum(), ops)):
        _close(g, r)
    if limit is None and len(shapes) == 2:
        assert torch.autograd.gradcheck(lambda *xs: tn.contract(expr, *xs), ops, check_forward_ad=True)


# ---------------------------------------------------------------------------- validation
def test_validation_errors():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    with pytest.raises(ValueError, match="2 operand term.*3 operand"):
        tn.contract("ab,bc->ad", a, b, b)
    with pytest.raises(ValueError, match="operand 1 has 2 dimension"):
        tn.contract("ab,bcd->ad", a, b)
    with pytest.raises(ValueError, match="mode 'b' has extent 4 in operand 1 but extent 3"):
        tn.contract("ab,cb->ac", a, b)
    with pytest.raises(ValueError, match="mode 'b' has extent 4 in operand 2 but extent 3 in operand 0"):
        tn.contract("ab,bc,db->a", a, b, torch.randn(5, 4))  # terms without '...' take a faster path: same checks
    with pytest.raises(ValueError, match="mode 'b' has extent 4 in operand 1 but extent 3 in operand 0"):
        tn.contract("...ab,...cb->", a, b)
    with pytest.raises(ValueError, match="more than one '->'"):
        tn.contract("ab,bc->ac->a", a, b)
    with pytest.raises(ValueError, match="output mode 'z' does not appear"):
        tn.contract("ab,bc->az", a, b)
    with pytest.raises(ValueError, match="repeats a mode"):
        tn.contract("ab,bc->aa", a, b)
    with pytest.raises(ValueError, match="'.' must be part of '...'"):
        tn.contract("a.b,bc->ac", a, b)
    with pytest.raises(ValueError, match="more than one '...'"):
        tn.contract("...a...,bc->", a, b)
    with pytest.raises(ValueError, match="'-' or '>'"):
        tn.contract("ab,bc-ac", a, b)
    with pytest.raises(TypeError, match="operand 1 must be a torch.Tensor"):
        tn.contract("ab,bc->ac", a, [[1.0]])
    # the operands as one list (for *operands): a short message with the fix, not every tensor
    many = [torch.randn(64, 64) for _ in range(20)]
    many_expr = ",".join(chr(97 + i) + chr(98 + i) for i in range(20)) + "->"
    with pytest.raises(TypeError, match=r"got list of tensors \(pass the operands one by one: \*operands\)"):
        tn.contract(many_expr, many)
    with pytest.raises(TypeError, match=r"got a list of 20 items \(Tensor\) \(pass the operands one by one") as e:
        tn.plan(many_expr, many)
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match="do not broadcast"):
        tn.contract("...a,...a->", torch.randn(2, 3), torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"'b' has extent 4 in operand 1 but extent 3 in operand 0 \(extents must "
                                         r"match or be 1\)"):
        tn.contract("ab,cb->ac", a, b)
    with pytest.raises(ValueError, match="'i' is repeated in operand 0 with extents 1 and 3"):
        tn.contract("ii->i", torch.randn(1, 3))  # (torch.einsum refuses it too)
    with pytest.raises(ValueError, match="'->' is split by whitespace"):
        tn.contract("ab - > ba", a)
    with pytest.raises(ValueError, match="operand 1 is on meta"):
        tn.contract("ab,bc->ac", a, b.to("meta"))
    with pytest.raises(TypeError, match="modes of operand 0"):
        tn.contract(a, "ab", b, [1, 2])
    with pytest.raises(TypeError, match="not hashable"):
        tn.contract(a, [[0], 1], b, [1, 2])
    with pytest.raises(ValueError, match="optimize must be"):
        tn.contract("ab,bc->ac", a, b, optimize="fastest-ever")
    # non-ASCII whitespace is not skipped silently (the shape error named a term 'ab' for "ab\u3000")
    for space in ("\u3000", "\u00a0"):
        with pytest.raises(ValueError, match=re.escape(f"character {space!r} is not a mode label")):
            tn.contract(f"ab{space},bc->ac", torch.randn(2, 3, 4), b)
    assert torch.equal(tn.contract(" ab ,\tbc\n -> ac ", a, b), tn.contract("ab,bc->ac", a, b))
    with pytest.raises(ValueError, match="explicit path step"):
        tn.contract("ab,bc->ac", a, b, optimize=[(0, 5)])
    with pytest.raises(ValueError, match="explicit path leaves 2"):
        tn.contract("ab,bc,cd->ad", a, b, torch.randn(4, 2), optimize=[(0, 1)])
    with pytest.raises(ValueError, match="slicing: mode 'q' is not a mode"):
        tn.contract("ab,bc->ac", a, b, slicing=["q"])
    with pytest.raises(ValueError, match="only one operand"):
        tn.contract("ab,bc->c", a, b, slicing=["a"])
    with pytest.raises(ValueError, match="min_slices"):
        tn.contract("ab,bc->ac", a, b, slicing={"min_slices": 0})
    with pytest.raises(ValueError, match="cannot reach min_slices"):
        tn.contract("ab,bc->ac", a, b, slicing={"min_slices": 10**6})
    p = tn.plan("ab,bc->ac", a, b, slicing=["b"])
    with pytest.raises(ValueError, match="slice id 3 is out of range"):
        p.contract(a, b, slices=[3])
    with pytest.raises(ValueError, match="operand 0 has shape"):
        p.contract(b, b)
    with pytest.raises(ValueError, match="plan is for 2 operand"):
        p.contract(a)
    with pytest.raises(ValueError, match="out has shape"):
        p.contract(a, b, out=torch.empty(3))
    # another dtype or device was cast into silently (an int64 out truncated the result)
    with pytest.raises(TypeError, match="out must have the result's dtype and device"):
        p.contract(a, b, out=torch.empty(p.output_shape, dtype=torch.int64))
    with pytest.raises(TypeError, match="out must have the result's dtype and device"):
        p.contract(a, b, out=torch.empty(p.output_shape, dtype=a.dtype, device="meta"))
    with pytest.raises(TypeError, match="below 2\\^63"):
        tn.plan("ab->", (2 ** 63, 1))  # was a pybind "incompatible function arguments" dump
    with pytest.raises(TypeError, match="shape"):
        tn.plan("ab,bc->ac", (2, 3), "x")
    with pytest.raises(ValueError, match="at least one operand"):
        tn.contract("")
    for bad in (torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.int64)):
        with pytest.raises(TypeError, match="operand 0 must have a floating-point or complex dtype"):
            tn.contract("ab,bc->ac", bad, b)
    # float8 and float4 pass is_floating_point but have no matrix multiply: named here, not
    # torch's "not implemented" from inside a GEMM
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float4_e2m1fn_x2):
        with pytest.raises(TypeError, match=f"operand 1 must have .* got {dtype} .torch has no general matrix"):
            tn.contract("ab,bc->ac", b.t().contiguous(), torch.empty((3, 4), dtype=dtype))
        with pytest.raises(TypeError, match="dtype must have a floating-point"):
            tn.plan("ab,bc->ac", (2, 3), (3, 4), dtype=dtype)
    with pytest.raises(TypeError, match="dtype must have a floating-point"):
        tn.plan("ab,bc->ac", (2, 3), (3, 4), dtype=torch.int32)
    # complex32: torch's bmm/addmm have no ComplexHalf kernel on CPU or CUDA. Refused where the
    # contraction would run in it; beside a complex64 operand it is promoted, as in torch.
    with warnings.catch_warnings():  # torch warns (once per process) that ComplexHalf is experimental
        warnings.simplefilter("ignore", UserWarning)
        half_complex = torch.randn((3, 4), dtype=torch.complex64).to(torch.complex32)
    with pytest.raises(TypeError, match="the operands' common dtype must have .* got torch.complex32 "
                                        ".torch has no matrix multiply for complex32; use complex64"):
        tn.contract("ab,bc->ac", half_complex.t().contiguous(), half_complex)
    with pytest.raises(TypeError, match="dtype must have .* complex32; use complex64"):
        tn.plan("ab,bc->ac", (2, 3), (3, 4), dtype=torch.complex32)
    with pytest.raises(TypeError, match="dtype must have .* complex32; use complex64"):
        tn.plan("ab,bc->ac", b.t().contiguous(), b, dtype=torch.complex32)
    a64 = torch.randn(2, 3, dtype=torch.complex64)
    mixed = tn.contract("ab,bc->ac", a64, half_complex)
    assert mixed.dtype == torch.complex64
    torch.testing.assert_close(mixed, a64 @ half_complex.to(torch.complex64))
    for limit in (float("inf"), float("nan"), 0, -5.0):
        with pytest.raises(ValueError, match="memory_limit must be a positive, finite number of bytes"):
            tn.plan("ab,bc->ac", a, b, memory_limit=limit)
    np = pytest.importorskip("numpy")
    assert tn.plan("ab,bc->ac", a, b, memory_limit=np.int64(4096)).memory_limit == 4096


def test_contract_with_a_plan_checks_the_expression_passed_with_it():
    """contract(expr, ..., plan=p) contracts what p was made for: an expression of another
    contraction (here a transposed output, also in the interleaved form) must be refused, not
    silently replaced by the plan's; the same one under other labels is accepted."""
    a, b = torch.randn(4, 4, dtype=F64), torch.randn(4, 6, dtype=F64)
    p = tn.plan("ij,jk->ik", a, b)
    _close(tn.contract("ab,bc->ac", a, b, plan=p), a @ b)
    _close(tn.contract(a, ["x", "y"], b, ["y", "z"], ["x", "z"], plan=p), a @ b)
    with pytest.raises(ValueError, match="plan was made for 'ij,jk->ik', not for .*'ij,jk->ki'"):
        tn.contract("ij,jk->ki", a, b, plan=p)  # before: (a @ b), silently
    with pytest.raises(ValueError, match="plan was made for"):
        tn.contract("ji,kj->ik", a, b.T, plan=tn.plan("ij,kj->ik", a, b.T))  # a.T, not a
    with pytest.raises(ValueError, match="plan was made for"):
        tn.contract(a, [0, 1], b, [1, 2], [2, 0], plan=p)
    x, y = torch.randn(2, 3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    pe = tn.plan("...ij,jk->...ik", x, y)
    _close(tn.contract("...ab,bc->...ac", x, y, plan=pe), x @ y)
    with pytest.raises(ValueError, match="plan was made for"):
        tn.contract("...ab,bc->ac...", x, y, plan=pe)


def test_plan_gradients_of_promoted_operands_have_the_operands_dtype():
    """plan.gradients of a real operand contracted with a complex one is real (the gradient of
    the cast, as autograd gives it), of a float32 one with a float64 one float32; a grads=
    buffer of another shape is refused, naming it."""
    gen = torch.Generator().manual_seed(3)
    a, b = _rand((3, 4), F64, gen), _rand((4, 5), C128, gen)
    g = _rand((3, 5), C128, gen)
    ga, gb = tn.plan("ab,bc->ac", a, b).gradients(a, b, output_grad=g)
    ra, rb = (o.detach().clone().requires_grad_(True) for o in (a, b))
    ref = torch.autograd.grad(torch.einsum("ab,bc->ac", ra.to(C128), rb), (ra, rb), g)
    assert ga.dtype == F64 and gb.dtype == C128
    _close(ga, ref[0])
    _close(gb, ref[1])
    a32 = a.float()
    ga32, _ = tn.plan("ab,bc->ac", a32, b.real).gradients(a32, b.real, output_grad=g.real)
    assert ga32.dtype == torch.float32
    with pytest.raises(ValueError, match=r"grads\[0\] must be None or a tensor of operand 0's shape \(3, 4\)"):
        tn.plan("ab,bc->ac", a, b).gradients(a, b, output_grad=g, grads=[torch.zeros(2, 3, 4, dtype=F64), None])
    with pytest.raises(TypeError, match=r"grads\[0\] must have operand 0's dtype and device"):
        tn.plan("ab,bc->ac", a, b).gradients(a, b, output_grad=g, grads=[torch.zeros(3, 4, dtype=torch.int64), None])


def test_empty_slice_group_keeps_the_operands_on_the_autograd_graph():
    """A slice group with no slices (a worker given none) contracts to zeros that are still on
    the graph: the operands get zero gradients (not an error in backward, not None), with
    create_graph too; a plan of zero slices (a sliced mode of extent 0) likewise, as
    torch.einsum does."""
    gen = torch.Generator().manual_seed(4)
    a, b = _rand((3, 4), F64, gen, True), _rand((4, 5), F64, gen, True)
    p = tn.plan("ab,bc->ac", a, b, slicing=["b"])
    empty = p.contract(a, b, slices=[])
    assert empty.requires_grad and torch.equal(empty, torch.zeros(3, 5, dtype=F64))
    ga, gb = torch.autograd.grad(empty.sum(), (a, b), create_graph=True)
    assert torch.equal(ga, torch.zeros_like(a)) and torch.equal(gb, torch.zeros_like(b))
    total = p.contract(a, b, slices=[]) + p.contract(a, b, slices=range(4))
    _close(torch.autograd.grad(total.sum(), a)[0], torch.autograd.grad((a @ b).sum(), a)[0])
    scalar = tn.plan("ab,ab->", a, a, slicing=["b"]).contract(a, a, slices=[])  # the fused path
    assert torch.equal(torch.autograd.grad(scalar, a)[0], torch.zeros_like(a))
    with torch.no_grad():
        assert not p.contract(a, b, slices=[]).requires_grad
    a0, b0 = _rand((3, 0), F64, gen, True), _rand((0, 5), F64, gen, True)
    z = tn.contract("ab,bc->ac", a0, b0, slicing=["b"])
    assert z.requires_grad and torch.equal(z, torch.zeros(3, 5, dtype=F64))
    z.sum().backward()
    assert a0.grad.shape == (3, 0) and b0.grad.shape == (0, 5)


# ---------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 1e-1),
                                       (torch.complex64, 1e-4)])
def test_low_precision_dtypes(dtype, tol):
    gen = torch.Generator().manual_seed(18)
    expr = "abc,cd,bde->ae"
    wide = C128 if dtype.is_complex else F64
    ops64 = [_rand(s, wide, gen) for s in [(3, 4, 5), (5, 6), (4, 6, 3)]]
    ops = [o.to(dtype).requires_grad_(True) for o in ops64]
    p = tn.plan(expr, *ops, slicing={"min_slices": 4})
    out = p.contract(*ops)
    assert out.dtype == dtype
    ref64 = [o.to(dtype).to(wide).requires_grad_(True) for o in ops64]  # same rounded inputs
    ref = torch.einsum(expr, *ref64)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.to(wide), ref, rtol=tol, atol=tol * scale)
    g = torch.ones_like(ref)
    grads = torch.autograd.grad(out, ops, g.to(dtype))
    rgrads = torch.autograd.grad(ref, ref64, g)
    for x, y in zip(grads, rgrads):
        assert x.dtype == dtype
        torch.testing.assert_close(x.to(wide), y, rtol=tol, atol=tol * y.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 4e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("expr,slicing", [("ab,bc,ca->", ["a", "c"]),   # one-element output: the fused path
                                          ("ab,bc->ac", ["b"]),           # the plain path
                                          ("ab,bc,cd->ad", ["c"])])       # a's gradient sums every slice
@pytest.mark.parametrize("table_rows", [None, 4])                       # one executor call, or several
def test_half_precision_sums_slices_in_float32(dtype, tol, expr, slicing, table_rows, monkeypatch):
    """Thousands of slices summed in float16/bfloat16 lose most of them (bfloat16 keeps 8 bits:
    1024 slices gave 50% error); the executor and the Python side sum in float32, so a sliced
    result is as accurate as the unsliced one, for values and gradients."""
    if table_rows is not None:  # several executor calls per group: the Python-side sums too
        chunks = tn.slicer.Slices.chunks
        monkeypatch.setattr(tn.slicer.Slices, "chunks", lambda self, s, max_rows=table_rows: chunks(self, s, max_rows))
    gen = torch.Generator().manual_seed(23)
    n = 2048 if len(slicing) == 1 else 32
    shapes = {"ab,bc,ca->": [(32, 32)] * 3, "ab,bc->ac": [(8, n), (n, 8)], "ab,bc,cd->ad": [(8, 8), (8, n), (n, 8)]}[expr]
    ops64 = [torch.rand(s, dtype=F64, generator=gen) + 0.5 for s in shapes]
    ops = [o.to(dtype).requires_grad_(True) for o in ops64]
    p = tn.plan(expr, *ops, slicing=slicing)
    assert p.num_slices >= 1024
    rounded = [o.to(dtype).to(F64).requires_grad_(True) for o in ops64]  # the same rounded inputs
    ref = torch.einsum(expr, *rounded)
    out = p.contract(*ops)
    assert out.dtype == dtype
    torch.testing.assert_close(out.to(F64), ref, rtol=tol, atol=0)
    g_out = torch.ones_like(ref)
    grads = torch.autograd.grad(out, ops, g_out.to(dtype))
    refs = torch.autograd.grad(ref, rounded, g_out)
    via_plan = p.gradients(*[o.detach() for o in ops], output_grad=g_out.to(dtype))
    # progress=True: a bar over the slices, the same sums (about 100 Functions whose gradients
    # autograd added in the operands' dtype before)
    progress = torch.autograd.grad(p.contract(*ops, progress=True), ops, g_out.to(dtype))
    for g, h, q, r in zip(grads, via_plan, progress, refs):
        assert g.dtype == h.dtype == q.dtype == dtype
        for x in (g, h, q):
            torch.testing.assert_close(x.to(F64), r, rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table_rows", [None, 1])                       # one executor call, or several
def test_half_precision_slice_groups_add_unrounded_into_float32_buffers(dtype, table_rows, monkeypatch):
    """A slice-group loop of the caller's own (cuTensorNet-style, or ranks) adds each group's
    result into out= and its gradients into grads=: float32 buffers for float16/bfloat16 take
    them unrounded, so groups whose partial sums cancel lose nothing (rounded, 2048 + 1 - 2048
    is 0: both dtypes hold 2048 + 1 as 2048); the buffers of the operands' dtype keep rounding."""
    if table_rows is not None:
        chunks = tn.slicer.Slices.chunks
        monkeypatch.setattr(tn.slicer.Slices, "chunks", lambda self, s, max_rows=table_rows: chunks(self, s, max_rows))
    a = torch.tensor([[2048.0], [1.0], [-2048.0], [0.0]], dtype=dtype)  # a[i, j]
    v, w = torch.ones(1, dtype=dtype), torch.ones(4, dtype=dtype)
    p = tn.plan("ij,j,i->", a, v, w, slicing=["i"])
    assert p.num_slices == 4
    groups = [range(0, 2), range(2, 4)]  # partial sums 2049 and -2048
    g_out = torch.ones((), dtype=dtype)
    for wide, expect in ((torch.float32, 1.0), (dtype, 0.0)):
        out, grads = torch.zeros((), dtype=wide), [None, torch.zeros(1, dtype=wide), torch.zeros(4, dtype=wide)]
        for g in groups:
            p.contract(a, v, w, slices=g, out=out, accumulate=True)
            p.gradients(a, v, w, output_grad=g_out, slices=g, grads=grads, accumulate=True)
        assert out.item() == expect and grads[1].item() == expect
        assert grads[2].tolist() == [2048.0, 1.0, -2048.0, 0.0]
    out = torch.zeros((), dtype=torch.float32)
    p.contract(a, v, w, slices=None, out=out)  # one group, written: its sum unrounded as well
    assert out.item() == 1.0
    assert p.contract(a, v, w).item() == 1.0  # rounded once: 1 is exact
    with pytest.raises(TypeError, match=r"or torch.float32, which takes the sum unrounded"):
        p.contract(a, v, w, out=torch.zeros((), dtype=torch.float64))
    with pytest.raises(TypeError, match=r"grads\[1\] must have operand 1's dtype \(or torch.float32\)"):
        p.gradients(a, v, w, output_grad=g_out, grads=[None, torch.zeros(1, dtype=torch.float64), None])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_hoisted_subtree_gradients_add_unrounded(dtype):
    """A hoisted plan (slice-invariant subtree A B C computed once) in a slice-group loop with
    float32 gradient buffers: the subtree's backward took its result's gradient in the
    operands' dtype, so A's gradient was rounded per group (2048 + 1 - 2048 gave 0)."""
    shapes = [(3, 4), (4, 5), (5, 3), (3, 6), (6, 3)]
    ops = [torch.zeros(s, dtype=dtype) for s in shapes]
    ops[0][0, 0] = ops[1][0, 0] = ops[2][0, 0] = 1
    ops[3][0] = torch.tensor([2048.0, 1, 0, -2048, 0, 0])
    ops[4][:, 0] = 1
    p = tn.plan("ab,bc,cd,de,ea->", *ops, memory_limit="1MiB", slicing=["e"])
    assert p.hoisted is not None and p.num_slices == 6
    out, grads = torch.zeros(()), [torch.zeros(s) for s in shapes]
    for g in (range(0, 3), range(3, 6)):
        p.contract(*ops, slices=g, out=out, accumulate=True)
        p.gradients(*ops, output_grad=torch.ones((), dtype=dtype), slices=g, grads=grads, accumulate=True)
    ref = [o.double().requires_grad_(True) for o in ops]
    value = torch.einsum("ab,bc,cd,de,ea->", *ref)
    for g, r in zip(grads, torch.autograd.grad(value, ref)):
        assert torch.equal(g.double(), r)
    assert out.item() == value.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_fused_value_of_several_executor_calls_is_rounded_once(dtype, monkeypatch):
    """A one-element output that requires grad (the fused path) over a group of several
    executor calls (more than 65,536 slices; here forced) added each call's value rounded to the
    operands' dtype: 2048 + 1 in one call and -2048 in the next gave 0."""
    chunks = tn.slicer.Slices.chunks
    monkeypatch.setattr(tn.slicer.Slices, "chunks", lambda self, s, max_rows=2: chunks(self, s, max_rows))
    a = torch.tensor([[2048.0], [1.0], [-2048.0], [0.0]], dtype=dtype)
    v, w = torch.ones(1, dtype=dtype, requires_grad=True), torch.ones(4, dtype=dtype)
    p = tn.plan("ij,j,i->", a, v, w, slicing=["i"])
    out = p.contract(a, v, w)
    out.backward()
    assert out.dtype == dtype and out.item() == 1.0 and v.grad.item() == 1.0


@pytest.mark.parametrize("expr", ["ab,bc,cd->ad", "ab,bc,ca->"])
@pytest.mark.parametrize("memory_limit", [None, 16])
def test_autocast_follows_einsum(expr, memory_limit):
    """Under torch.autocast, contract casts float32 operands to autocast's dtype as torch.einsum
    does, whatever the slicing (the result's dtype once depended on it, and a backward raised
    "Expected out tensor to have dtype float, but got BFloat16" from inside the executor);
    gradients reach the float32 leaves. A plan's gradients() run in the operands' dtype."""
    gen = torch.Generator().manual_seed(29)
    ops = [torch.randn(s, generator=gen).requires_grad_(True) for s in [(6, 5), (5, 4), (4, 6)]]
    refs = [o.detach().clone().requires_grad_(True) for o in ops]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tn.contract(expr, *ops, memory_limit=memory_limit)
        ref = torch.einsum(expr, *refs)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    g = torch.randn(ref.shape, generator=gen)
    grads = torch.autograd.grad(out, ops, g.to(out.dtype))
    rgrads = torch.autograd.grad(ref, refs, g.to(ref.dtype))
    for x, y in zip(grads, rgrads):
        assert x.dtype == y.dtype == torch.float32
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2 * y.abs().max().item())
    p = tn.plan(expr, *ops, memory_limit=memory_limit)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert p.contract(*ops).dtype == torch.bfloat16  # plan.contract casts too
        plain = p.gradients(*[o.detach() for o in ops], output_grad=g)  # the executor in float32
    for x, o in zip(plain, ops):
        assert x.dtype == torch.float32
    _close(plain[0], torch.autograd.grad(torch.einsum(expr, *ops), ops[0], g)[0], rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is not autocast, as for einsum
        assert tn.contract(expr, *[o.double() for o in ops], memory_limit=memory_limit).dtype == F64
        # nor a float32 operand contracted with a float64 one: no bfloat16 rounding in a float64 result
        mixed = tn.contract(expr, ops[0].double(), ops[1], ops[2], memory_limit=memory_limit)
        with torch.no_grad():
            p.contract(*ops, out=torch.empty(p.output_shape))  # out= keeps the plan's dtype
    assert mixed.dtype == F64
    _close(mixed, torch.einsum(expr, *[o.double() for o in ops]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("memory_limit", [None, 64])
def test_vectorized_jacobian_and_batched_grads(memory_limit):
    """torch.autograd.grad(is_grads_batched=True), jacobian/hessian(vectorize=True) and
    gradcheck's batched-gradient check run under the legacy vmap, which cannot batch the
    executor's ops (they take tensor lists): "Batching rule not implemented for
    torch_gradops::contract_program_backward" before."""
    from torch.autograd.functional import hessian, jacobian
    gen = torch.Generator().manual_seed(31)
    a, b, c = _rand((3, 4), F64, gen), _rand((4, 5), F64, gen), _rand((5, 3), F64, gen)
    f = lambda x, y: tn.contract("ab,bc,cd->ad", x, y, c, memory_limit=memory_limit)  # noqa: E731
    ref = lambda x, y: torch.einsum("ab,bc,cd->ad", x, y, c)  # noqa: E731
    for got, want in zip(jacobian(f, (a, b), vectorize=True), jacobian(ref, (a, b))):
        _close(got, want)
    s = lambda x, y: tn.contract("ab,bc,ca->", x, y, c, memory_limit=memory_limit)  # noqa: E731
    s_ref = lambda x, y: torch.einsum("ab,bc,ca->", x, y, c)  # noqa: E731
    for row, row_ref in zip(hessian(s, (a, b), vectorize=True), hessian(s_ref, (a, b))):
        for got, want in zip(row, row_ref):
            _close(got, want)
    got = jacobian(lambda x, y: s(x, y), (a, b), vectorize=True, create_graph=True)  # the fused path's too
    for g, w in zip(got, jacobian(s_ref, (a, b))):
        _close(g, w)
    x = a.clone().requires_grad_(True)
    v = _rand((6, 3, 3), F64, gen)
    got, = torch.autograd.grad(f(x, b), x, v, is_grads_batched=True)
    _close(got, torch.stack([torch.autograd.grad(ref(x, b), x, vi)[0] for vi in v]))
    assert torch.autograd.gradcheck(lambda x, y: f(x, y), (x, b.clone().requires_grad_(True)),
                                    check_batched_grad=True)
    # A one-element output contracts with its gradients (FUSED): the first backward scales them
    # by grad_out, a retained graph's later ones recompute; batched, those took the executor's
    # op, which has no batching rule (failed, as did gradcheck's batched check of any scalar).
    xs, ys = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    w = _rand((5,), F64, gen)
    want = torch.stack([torch.autograd.grad(s_ref(xs, ys), xs, wi)[0] for wi in w])
    out = s(xs, ys)
    for _ in range(2):
        got, = torch.autograd.grad(out, xs, w, is_grads_batched=True, retain_graph=True)
        _close(got, want)
    out = s(xs, ys)
    out.backward(retain_graph=True)
    got, = torch.autograd.grad(out, xs, w, is_grads_batched=True)
    _close(got, want)
    assert torch.autograd.gradcheck(s, (xs, ys), check_batched_grad=True)


@pytest.mark.parametrize("memory_limit", [None, 64])
def test_vectorized_second_derivatives_of_nonlinear_losses(memory_limit):
    """hessian(vectorize=True) and batched gradients of a gradient where the output gradient
    depends on the operands (a loss like ``o ** 2``): the mixed blocks came out with the path
    through the output gradient counted twice (``[[38, 24], [20, 66]]`` for ``[[32, 12],
    [10, 46]]`` below)."""
    from torch.autograd.functional import hessian, jacobian
    a0, b0 = torch.tensor([1., 2.], dtype=F64), torch.tensor([3., 5.], dtype=F64)
    sq = lambda x, y: tn.contract("i,i->", x, y, memory_limit=memory_limit) ** 2  # noqa: E731
    _close(hessian(sq, (a0, b0), vectorize=True)[0][1], torch.tensor([[32., 12.], [10., 46.]], dtype=F64))
    gen = torch.Generator().manual_seed(37)
    a, b, c = _rand((3, 4), F64, gen), _rand((4, 5), F64, gen), _rand((5, 3), F64, gen)
    losses = {
        "sin": (lambda x, y: tn.contract("ab,bc,ca->", x, y, c, memory_limit=memory_limit).sin(),
                lambda x, y: torch.einsum("ab,bc,ca->", x, y, c).sin()),
        "norm": (lambda x, y: tn.contract("ab,bc,cd->ad", x, y, c, memory_limit=memory_limit).square().sum(),
                 lambda x, y: torch.einsum("ab,bc,cd->ad", x, y, c).square().sum()),
    }
    for name, (f, ref) in losses.items():
        for row, row_ref in zip(hessian(f, (a, b), vectorize=True), hessian(ref, (a, b))):
            for got, want in zip(row, row_ref):
                _close(got, want, msg=name)
        # batched gradients of a create_graph gradient, and a vectorized jacobian that keeps its graph
        x, y = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        gx, = torch.autograd.grad(f(x, y), x, create_graph=True)
        xr, yr = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        gxr, = torch.autograd.grad(ref(xr, yr), xr, create_graph=True)
        v = _rand((5,) + tuple(gx.shape), F64, gen)
        for got, want in zip(torch.autograd.grad(gx, (x, y), v, is_grads_batched=True),
                             torch.autograd.grad(gxr, (xr, yr), v, is_grads_batched=True)):
            _close(got, want, msg=name)
        grad_of = lambda fn: lambda x, y: torch.autograd.grad(fn(x, y), x, create_graph=True)[0]  # noqa: E731
        jac = jacobian(grad_of(f), (x, y), vectorize=True, create_graph=True)
        jac_ref = jacobian(grad_of(ref), (xr, yr), vectorize=True, create_graph=True)
        for got, want in zip(jac, jac_ref):
            _close(got, want, msg=name)
        # third order through the vectorized jacobian's graph
        third = torch.autograd.grad(jac[1].sin().sum(), (x, y), allow_unused=True, materialize_grads=True)
        third_ref = torch.autograd.grad(jac_ref[1].sin().sum(), (xr, yr), allow_unused=True, materialize_grads=True)
        for got, want in zip(third, third_ref):
            _close(got, want, msg=name)


@pytest.mark.parametrize("memory_limit", [None, 64])
@pytest.mark.parametrize("expr, shapes, dtype", [
    ("ij,jk->ik", [(3, 4), (4, 5)], F64),
    ("abc,bcd,ce->ade", [(2, 3, 4), (3, 4, 2), (4, 3)], F64),      # c in three operands
    ("ab,ab,bc->ab", [(3, 4), (3, 4), (4, 2)], F64),                # a, b kept and shared (batch modes)
    ("i,j,ij->ij", [(3,), (4,), (3, 4)], F64),                      # an outer product
    ("ab,bc,ca->", [(3, 4), (4, 2), (2, 3)], torch.complex128),
])
def test_vectorized_forward_mode_jacobians(expr, shapes, dtype, memory_limit):
    """jacobian(strategy="forward-mode", vectorize=True), hessian with a forward-mode outer
    jacobian and gradcheck's batched forward-gradient check run the jvp under the legacy vmap,
    whose tangents neither the executor's ops nor einsum can take ("Batching rule not
    implemented for torch_gradops::contract_program" before)."""
    from torch.autograd.functional import hessian, jacobian
    gen = torch.Generator().manual_seed(41)
    ops = tuple(_rand(sh, dtype, gen) for sh in shapes)
    f = lambda *xs: tn.contract(expr, *xs, memory_limit=memory_limit)  # noqa: E731
    ref = lambda *xs: torch.einsum(expr, *xs)  # noqa: E731
    if dtype.is_complex:  # jacobian wants real outputs
        f, ref = (lambda *xs: tn.contract(expr, *xs, memory_limit=memory_limit).real), (lambda *xs: torch.einsum(expr, *xs).real)
    for got, want in zip(jacobian(f, ops, strategy="forward-mode", vectorize=True),
                         jacobian(ref, ops, strategy="forward-mode", vectorize=True)):
        _close(got, want)
    if not dtype.is_complex:
        loss = lambda *xs: f(*xs).sin().sum()  # noqa: E731
        loss_ref = lambda *xs: ref(*xs).sin().sum()  # noqa: E731
        for row, row_ref in zip(hessian(loss, ops, vectorize=True, outer_jacobian_strategy="forward-mode"),
                                hessian(loss_ref, ops)):
            for got, want in zip(row, row_ref):
                _close(got, want)
    leaves = [o.clone().requires_grad_(True) for o in ops]
    assert torch.autograd.gradcheck(f, leaves, check_forward_ad=True, check_batched_forward_grad=True,
                                    check_backward_ad=False)


def test_auto_searches_where_the_greedy_plan_runs_costly_after_all():
    """"auto" judged the greedy path by the search's proxy, which leaves out the compiled
    layout's copies; under small limits the memory model then slices the greedy plan much
    further, and "auto" kept a plan many times slower than a short search finds (a 194-tensor
    circuit state at 4 KiB: 16,384 slices, 19 s estimated, against 256 slices and 0.05 s).
    Here: the state of a 3x5 circuit of depth 8 at 8 KiB."""
    from torch_gradops.testing import circuit_amplitude_network
    inputs, _, arrays = circuit_amplitude_network(3, 5, 8, seed=0, dtype=torch.complex64)
    inputs, output, arrays = inputs[:-15], [t[0] for t in inputs[-15:]], arrays[:-15]  # |psi>: no <bits|
    args = interleave(inputs, arrays, output)
    tn.clear_plan_cache()
    for limit in (4096, 8192, 16384):  # the searches' trees vary: each at least 3x better than greedy's
        # (at 16 KiB "auto" kept greedy's plan while its budget counted complex multiply-adds as real ones)
        greedy = tn.plan(*args, memory_limit=limit, optimize="greedy")
        auto = tn.plan(*args, memory_limit=limit)
        assert auto.optimizer == "cotengra" and auto.searched, limit
        assert auto.estimated_seconds(False) < greedy.estimated_seconds(False) / 3, (limit, auto, greedy)
    _close(auto.contract(*arrays), tn.contract(*args), rtol=1e-4, atol=1e-6)
    tn.clear_plan_cache()


def test_plans_searched_in_threads_at_once_are_the_plans_searched_alone():
    """The seeded search draws from Python's global random: threads planning at once drew from
    one stream in turn and got other plans than alone (8 of 9 differed in three rounds)."""
    import threading
    from torch_gradops.testing import circuit_amplitude_network, lattice_network
    nets = [lattice_network(4, 4, 2, seed=0, dtype=torch.float64), lattice_network(3, 5, 2, seed=1, dtype=torch.float64),
            circuit_amplitude_network(3, 3, 6, seed=2, dtype=torch.complex128)]

    def plan_of(net):
        p = tn.plan(*interleave(net[0], net[2], net[1]), memory_limit="128B", optimize="cotengra")
        return p.path, p.sliced_modes, p.flops
    alone = []
    for net in nets:
        tn.clear_plan_cache()
        alone.append(plan_of(net))
    for _ in range(2):
        tn.clear_plan_cache()
        together = [None] * len(nets)

        def work(k):
            together[k] = plan_of(nets[k])
        threads = [threading.Thread(target=work, args=(k,)) for k in range(len(nets))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert together == alone
    tn.clear_plan_cache()


def test_the_same_network_under_new_labels_is_not_searched_again():
    """The plan cache is keyed by labels: a network rebuilt each step with fresh index names
    (quimb's rand_uuid) was searched again every step (0.3-0.8 s each for a 4x4 circuit at 16
    KiB, against 28 ms for a cache hit). The searched path is now also kept by the network's
    structure (its mode ids, numbered by first appearance), whatever the labels."""
    from torch_gradops.testing import lattice_network
    inputs, output, arrays = lattice_network(4, 4, 3, seed=0, dtype=torch.float64)
    tn.clear_plan_cache()
    plans = []
    for step in range(3):
        names = {m: f"step{step}-{m}" for t in inputs for m in t}
        args = interleave([[names[m] for m in t] for t in inputs], arrays, [names[m] for m in output])
        plans.append(tn.plan(*args, memory_limit=2048, optimize="cotengra"))
        _close(tn.contract(*args, memory_limit=2048, optimize="cotengra"), plans[0].contract(*arrays))
    assert [p.searched for p in plans] == [True, False, False]
    assert tn.plan_cache_info()["path_searches"] == 1
    assert all(p.path == plans[0].path and p.num_slices == plans[0].num_slices for p in plans)
    assert plans[1].sliced_modes != plans[0].sliced_modes  # each plan in its own labels
    tn.clear_plan_cache()


def test_a_relabelled_network_still_writes_the_path_cache(tmp_path):
    """The in-memory path memo served a relabelled network without running the path search,
    so a path_cache passed on that call was never written (a new process searched again)."""
    from torch_gradops.testing import lattice_network
    inputs, output, arrays = lattice_network(4, 4, 3, seed=0, dtype=torch.float64)
    tn.clear_plan_cache()
    tn.plan(*interleave(inputs, arrays, output), memory_limit=2048, optimize="cotengra")
    names = {m: f"x{m}" for t in inputs for m in t}
    args = interleave([[names[m] for m in t] for t in inputs], arrays, [names[m] for m in output])
    tn.plan(*args, memory_limit=2048, optimize="cotengra", path_cache=str(tmp_path))
    assert any(files for _, _, files in os.walk(tmp_path))
    tn.clear_plan_cache()


@pytest.mark.parametrize("fails, warning", [("update_from_tree", "could not be saved"),
                                            ("__init__", "searching without saving")])
def test_a_read_only_path_cache_still_plans(tmp_path, monkeypatch, fails, warning):
    """A path cache that cannot be written (a shared read-only folder) failed every miss: with
    a raw OSError after the search where it held entries (saving the tree), and with "cannot
    keep a cache" before it where it held none for the search's options (cotengra's cache makes
    its folder when it is created), although the folder exists."""
    import cotengra
    from torch_gradops.testing import lattice_network
    inputs, output, arrays = lattice_network(4, 4, 3, seed=0, dtype=torch.float64)
    args = interleave(inputs, arrays, output)
    tn.clear_plan_cache()
    fresh = tn.plan(*args, memory_limit=4096, optimize="cotengra")

    def read_only(self, *a, **k):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(cotengra.ReusableHyperOptimizer, fails, read_only)
    tn.clear_plan_cache()
    with pytest.warns(RuntimeWarning, match=warning):
        p = tn.plan(*args, memory_limit=4096, optimize="cotengra", path_cache=str(tmp_path))
    assert p.path == fresh.path and p.sliced_modes == fresh.sliced_modes
    if fails == "__init__":
        tn.clear_plan_cache()
        with pytest.raises(ValueError, match="cannot keep a cache"):  # not a folder at all: an error
            tn.plan(*args, memory_limit=4096, optimize="cotengra", path_cache=str(tmp_path / "missing" / "deeper"))
    tn.clear_plan_cache()


def test_auto_budget_counts_cheap_unsliced_trials_and_complex_work():
    """"auto" sized its search with a trial cost measured for sliced, scored trials (5x what an
    unsliced trial costs) and counted a complex multiply-add as 2 FLOPs (8): it kept opt_einsum's
    greedy plan of a 6x6 lattice of bond 6 (20x the FLOPs of a 10 ms search's) and of a 6x7
    lattice of bond 5 in complex64 (9x)."""
    from torch_gradops.testing import lattice_network
    for (rows, cols, bond), dtype in (((6, 6, 6), torch.float32), ((6, 7, 5), torch.complex64)):
        inputs, output, arrays = lattice_network(rows, cols, bond, seed=0, dtype=dtype)
        args = interleave(inputs, arrays, output)
        auto = tn.plan(*args)
        greedy = tn.plan(*args, optimize="greedy")
        assert auto.optimizer == "cotengra" and auto.flops < greedy.flops / 4, (rows, cols, bond, auto, greedy)


def test_slice_ids_of_any_integer_kind_and_checked_slice_indices():
    """``slices=`` took Python ints only (``np.int64(1)`` or an array of ids: TypeError), and
    ``plan.slice_indices`` did not check its id (``num_slices`` wrapped round to slice 0, -1
    gave the last)."""
    import numpy as np
    gen = torch.Generator().manual_seed(43)
    a, b, c = _rand((3, 4), F64, gen), _rand((4, 5), F64, gen), _rand((5, 3), F64, gen)
    p = tn.plan("ij,jk,ki->", a, b, c, memory_limit=16)
    n = p.num_slices
    assert n > 2
    full = p.contract(a, b, c)
    _close(p.contract(a, b, c, slices=np.int64(0)) + p.contract(a, b, c, slices=np.arange(1, n)), full)
    _close(p.contract(a, b, c, slices=torch.arange(n)), full)
    _close(p.contract(a, b, c, slices=torch.tensor(1)), p.contract(a, b, c, slices=1))
    assert p.slice_indices(np.int64(1)) == p.slice_indices(1)
    for bad in (n, -1):
        with pytest.raises(ValueError, match=f"slice id {bad} is out of range for a plan with {n} slice"):
            p.slice_indices(bad)
    with pytest.raises(TypeError, match="slice_indices takes one slice id"):
        p.slice_indices([0, 1])
    # an id listed twice counts twice (documented), in the value and in the gradients
    _close(p.contract(a, b, c, slices=[1, 1]), 2 * p.contract(a, b, c, slices=1))
    leaves = [t.clone().requires_grad_(True) for t in (a, b, c)]
    twice = torch.autograd.grad(p.contract(*leaves, slices=[1, 1]), leaves)
    for g, once in zip(twice, torch.autograd.grad(p.contract(*leaves, slices=1), leaves)):
        _close(g, 2 * once)


def test_meta_operands_and_the_first_arguments_error():
    """Operands on the meta device (shape inference) failed inside the autocast check ("unknown
    device type for autocast"); torch.einsum takes them. A first argument that is neither an
    expression nor an operand was reported as operand 0's modes."""
    gen = torch.Generator().manual_seed(47)
    ops = [_rand(s, F64, gen).to("meta") for s in ((3, 4), (4, 5), (5, 3))]
    for kw in (dict(), dict(memory_limit=16)):
        got = tn.contract("ij,jk,ki->i", *ops, **kw)
        assert got.device.type == "meta" and got.shape == torch.einsum("ij,jk,ki->i", *ops).shape
    for first in (123, None):
        with pytest.raises(TypeError, match="the first argument must be an einsum expression"):
            tn.contract(first, torch.ones(2, 2))


def test_mixed_dtypes_promote():
    a, b = torch.randn(2, 3), torch.randn(3, 4, dtype=F64)
    out = tn.contract("ab,bc->ac", a, b)
    assert out.dtype == F64
    _close(out, a.double() @ b)


# ---------------------------------------------------------------------------- large networks
def test_mps_chain_1000_operands():
    n, d, chi = 1000, 2, 4
    gen = torch.Generator().manual_seed(19)
    sym = opt_einsum.get_symbol
    terms, ops = [], []
    for i in range(n):
        # normalised site tensors keep the product O(1)
        t = torch.linalg.qr(torch.randn(chi * d, chi, dtype=F64, generator=gen))[0].reshape(chi, d, chi)
        ops.append(t)
        terms.append(sym(2 * i) + sym(2 * i + 1) + sym(2 * i + 2))
    expr = ",".join(terms) + "->" + sym(0) + sym(2 * n)
    ops = [o.requires_grad_(True) for o in ops]
    p = tn.plan(expr, *ops)
    assert len(p.path) == n - 1
    out = p.contract(*ops)
    # reference: sequential matrix products of the physical-summed sites
    ref = torch.eye(chi, dtype=F64)
    for t in ops:
        ref = ref @ t.detach().sum(1)
    _close(out, ref)
    g = torch.autograd.grad(out.sum(), ops[::250])
    assert all(x.shape == (chi, d, chi) and torch.isfinite(x).all() for x in g)
    # check one gradient numerically against the chain rule: d out / d A_k
    k = 250
    left = torch.eye(chi, dtype=F64)
    for t in ops[:k]:
        left = left @ t.detach().sum(1)
    right = torch.eye(chi, dtype=F64)
    for t in ops[k + 1:]:
        right = right @ t.detach().sum(1)
    expect = (left.sum(0)[:, None] * right.sum(1)[None, :])[:, None, :].expand(chi, d, chi)
    _close(g[1], expect)


# ---------------------------------------------------------------------------- compile / opcheck
def test_opcheck():
    gen = torch.Generator().manual_seed(20)
    a, b, c = _rand((3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 2), gen=gen)
    for slicing in (None, ["b", "a"]):
        p = tn.plan("ab,bc,cd->ad", a, b, c, slicing=slicing)
        prog, table = list(p.program), list(p.slice_set.table(None))
        torch.library.opcheck(torch.ops.torch_gradops.contract_program.default, ([a, b, c], prog, table))
        torch.library.opcheck(torch.ops.torch_gradops.contract_program_backward.default,
                              ([a, b, c], prog, table, _rand((3, 2), gen=gen), [1, 0, 1], []))
        if p.num_slices == 1:
            out, cache = torch.ops.torch_gradops.contract_program_cached([a, b, c], prog, table, [1, 1, 1])
            torch.library.opcheck(torch.ops.torch_gradops.contract_program_cached.default,
                                  ([a, b, c], prog, table, [1, 0, 1]))
            torch.library.opcheck(torch.ops.torch_gradops.contract_program_backward.default,
                                  ([a, b, c], prog, table, _rand((3, 2), gen=gen), [1, 1, 1], cache))
        grads = [torch.zeros_like(a), a.new_empty((0,)), torch.zeros_like(c)]
        torch.library.opcheck(torch.ops.torch_gradops.contract_program_accumulate.default,
                              ([a, b, c], prog, table, _rand((3, 2), gen=gen), grads))
    # the sum of bfloat16 slices in float32, unrounded (the fake kernel gives that dtype too)
    halves = [t.to(torch.bfloat16) for t in (a, b, c)]
    p = tn.plan("ab,bc,cd->ad", *halves, slicing=["b"])
    prog, table = list(p.program), list(p.slice_set.table(None))
    torch.library.opcheck(torch.ops.torch_gradops.contract_program.default, (halves, prog, table, torch.float32))
    assert torch.ops.torch_gradops.contract_program(halves, prog, table, torch.float32).dtype == torch.float32
    with pytest.raises(RuntimeError, match="dtype must be the operands'"):
        torch.ops.torch_gradops.contract_program(halves, prog, table, torch.float64)


def test_accumulate_bumps_the_version_of_the_buffers_it_writes():
    # The executor runs below ADInplaceOrView (no view tracking of its own steps); the caller's
    # buffers that contract_program_accumulate adds into must still show the write to autograd.
    gen = torch.Generator().manual_seed(20)
    a, b, c = _rand((3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 2), gen=gen)
    p = tn.plan("ab,bc,cd->ad", a, b, c, slicing=["b"])
    prog, table = list(p.program), list(p.slice_set.table(None))
    grads = [torch.zeros_like(a), a.new_empty((0,)), torch.zeros_like(c)]
    w = torch.ones_like(grads[0], requires_grad=True)
    z = (w * grads[0]).sum()  # saves grads[0] for its backward
    before = [g._version for g in grads]
    torch.ops.torch_gradops.contract_program_accumulate([a, b, c], prog, table, _rand((3, 2), gen=gen), grads)
    assert grads[0]._version > before[0] and grads[2]._version > before[2] and grads[1]._version == before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


_SUBPROCESS_FAKES = r"""
import torch
import torch_gradops  # nothing else: what a user's script imports
from torch_gradops import tensornet as tn
ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torch_gradops::"))
missing = [n for n in ops if torch._library.simple_registry.singleton.find(n).fake_impl.kernel is None]
assert len(ops) >= 10 and not missing, missing
f = torch.compile(lambda a, b, c: tn.contract("abx,bcy,cax->y", a, b, c, memory_limit="256B"))
for n in (8, 6, 5):  # a second shape recompiles with symbolic sizes
    ops = [torch.randn(n, n, 4, dtype=torch.float64) for _ in range(3)]
    torch.testing.assert_close(f(*ops), torch.einsum("abx,bcy,cax->y", *ops))
print("ok")
"""


def test_every_op_has_its_fake_kernel_after_import_torch_gradops():
    """The executor ops' fake kernels were registered only when something imported
    tensornet.program (the tests did): in a user's process FakeTensor ran the C++ executor on
    meta tensors instead, which worked for static shapes and failed torch.compile's recompile
    with symbolic ones ("Cannot call numel() on tensor with symbolic sizes/strides"). A fresh
    process, importing only torch_gradops."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-c", _SUBPROCESS_FAKES], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_torch_compile_fullgraph_matches_eager():
    gen = torch.Generator().manual_seed(21)
    a, b, c = _rand((3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 2), gen=gen)

    def fn(a, b, c):
        return tn.contract("ab,bc,cd->ad", a, b, c, slicing=["c"]).sin()

    eager = fn(a, b, c)  # plans outside the compiled region (planning is host-side Python)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _close(compiled(a, b, c), eager)
    ops = [t.clone().requires_grad_(True) for t in (a, b, c)]
    g = torch.autograd.grad(compiled(*ops).sum(), ops)
    ops2 = [t.clone().requires_grad_(True) for t in (a, b, c)]
    gr = torch.autograd.grad(fn(*ops2).sum(), ops2)
    for x, y in zip(g, gr):
        _close(x, y)


@pytest.mark.parametrize("how", ["cached", "plan=", "plan.contract"])
def test_torch_compile_does_not_recompile_per_call(how):
    """A compiled training step compiles once: Dynamo guarded on the plan cache's hit counter,
    which each call's lookup raised, so every call recompiled and the ninth failed
    (fullgraph=True: recompile limit)."""
    from torch._dynamo.utils import counters
    gen = torch.Generator().manual_seed(23)
    a0, b = _rand((6, 6), gen=gen), _rand((6, 6), gen=gen)
    p = tn.plan("ab,bc,ca->", a0, b, b, slicing=["c"])

    def loss(a):
        c = b * 1.0
        if how == "cached":
            return tn.contract("ab,bc,ca->", a, b, c, slicing=["c"])
        if how == "plan=":
            return tn.contract("ab,bc,ca->", a, b, c, plan=p)
        return p.contract(a, b, c)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    a = a0.clone().requires_grad_(True)
    for _ in range(10):  # more than Dynamo's recompile limit (8)
        out = compiled(a)
        g, = torch.autograd.grad(out, a)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    _close(out, torch.einsum("ab,bc,ca->", a, b, b))
    _close(g, torch.autograd.grad(torch.einsum("ab,bc,ca->", a, b, b), a)[0])


@pytest.mark.parametrize("slicing", [None, ["c"]])
def test_torch_compile_one_tensor_as_several_operands(slicing):
    """One tensor passed as several operands (a state or gate reused in a circuit) compiles with
    fullgraph=True, the trainable one's gradient summing its uses: Dynamo refused the Function
    ("duplicate tensor input") while torch.einsum compiled."""
    gen = torch.Generator().manual_seed(22)
    zero = torch.tensor([1.0, 0.5], dtype=F64)
    w0 = _rand((2, 2, 2, 2), gen=gen)
    expr = "a,b,abcd,cdef,e->f"

    def fn(w):
        return tn.contract(expr, zero, zero, w, w, zero, slicing=slicing).sin().sum()

    w = w0.clone().requires_grad_(True)
    eager = fn(w)
    want = torch.autograd.grad(eager, w)[0]
    ref = torch.einsum(expr, zero, zero, w, w, zero).sin().sum()
    _close(eager, ref)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    w = w0.clone().requires_grad_(True)
    got = compiled(w)
    _close(got, eager)
    _close(torch.autograd.grad(got, w)[0], want)


def test_fullgraph_compile_without_a_plan_says_to_plan_first():
    """Without a cached plan, fullgraph=True stops at the planner; the error said only "Skip
    calling torch.compiler.disable()d function" (reason: None)."""
    tn.clear_plan_cache()
    torch._dynamo.reset()
    a, b = torch.randn(7, 9, dtype=F64), torch.randn(9, 3, dtype=F64)
    compiled = torch.compile(lambda a, b: tn.contract("ab,bc->ac", a, b, slicing=["b"]), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(Exception, match="plan it before compiling"):
        compiled(a, b)
    tn.plan("ab,bc->ac", a, b, slicing=["b"])  # planned: the same call compiles
    torch._dynamo.reset()
    _close(compiled(a, b), a @ b)


def test_progress_bar(capsys):
    gen = torch.Generator().manual_seed(22)
    a, b = _rand((3, 4), gen=gen, requires_grad=True), _rand((4, 5), gen=gen)
    out = tn.contract("ab,bc->ac", a, b, slicing=["b"], progress=True)
    _close(out, a @ b)
    assert "slice" in capsys.readouterr().err
    g, = torch.autograd.grad(out.sum(), a)
    _close(g, torch.ones(3, 5, dtype=F64) @ b.T)


# ---------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(23)
    expr, ops = _ladder(gen, dtype=C128)
    p = tn.plan(expr, *ops, slicing={"min_slices": 9})
    cpu = [o.clone().requires_grad_(True) for o in ops]
    gpu = [o.cuda().requires_grad_(True) for o in ops]
    out_c = p.contract(*cpu)
    pg = tn.plan(expr, *gpu, slicing={"min_slices": 9})
    out_g = pg.contract(*gpu)
    _close(out_g.cpu(), out_c)
    gc = torch.autograd.grad(out_c.abs().sum(), cpu)
    gg = torch.autograd.grad(out_g.abs().sum(), gpu)
    for x, y in zip(gc, gg):
        _close(y.cpu(), x)


@pytest.mark.parametrize("expr", ["ji,jk->ik", "ij,kj->ik", "ji,kj->ik", "bji,bkj->bik", "jbi,kbj->bki"])
def test_transposed_gemm_layouts(expr):
    """The planner feeds bmm transposed views instead of copies; values, gradients and double
    gradients must not care which layout was picked."""
    gen = torch.Generator().manual_seed(24)
    size = {"i": 2, "j": 3, "k": 4, "b": 2}
    terms = expr.split("->")[0].split(",")
    ops = [_rand(tuple(size[c] for c in t), C128, gen, requires_grad=True) for t in terms]
    p = tn.plan(expr, *ops)
    prog = p.program
    step, = [x for x in decode(prog).instructions if isinstance(x, Contract)]
    ta, tb = int(step.ta), int(step.tb)
    expect = {"ji,jk->ik": (1, 0), "ij,kj->ik": (0, 1), "ji,kj->ik": (1, 1)}.get(expr)
    if expect is not None:
        assert (ta, tb) == expect
    _check_against_einsum(expr, [o.detach() for o in ops])
    assert torch.autograd.gradgradcheck(lambda *x: p.contract(*x), ops)
    if expr == "ji,kj->ik":
        prog_l, a, b = list(prog), ops[0].detach(), ops[1].detach()
        torch.library.opcheck(torch.ops.torch_gradops.contract_program_cached.default, ([a, b], prog_l, [], [1, 1]))
        _, cache = torch.ops.torch_gradops.contract_program_cached([a, b], prog_l, [], [1, 1])
        torch.library.opcheck(torch.ops.torch_gradops.contract_program_backward.default,
                              ([a, b], prog_l, [], _rand((2, 4), C128, gen), [1, 1], cache))


def _place_checkpoints_quadratic(costs, cap, copies=None, complex_=False):
    """place_checkpoints as first written (the test's oracle): for each last checkpoint b, the
    greedy segments of [0, b) built step by step, then memory_model of the placement."""
    from torch_gradops.tensornet import slicer
    n = len(costs.result)
    trans = slicer.step_transients(costs, copies, complex_)
    whole = slicer.memory_model(costs, (), copies, complex_, trans)
    if cap is None or whole <= cap or n <= 1:
        return whole, [], 0
    # what steps lo..hi-1 hold as one segment: a step's transients with the steps up to it
    seg = lambda lo, hi: max(sum(costs.result[lo:j + 1]) + trans[j] for j in range(lo, hi))  # noqa: E731
    best, prefix_macs = (whole, [], 0), 0
    for b in range(1, n):
        prefix_macs += costs.macs[b - 1]
        live = sum(costs.result[j] for j in range(b) if costs.consumer[j] >= b)
        if live + seg(b, n) > cap:
            continue  # the last segment cannot fit: not a candidate
        bounds, cross, lo, broken = [], 0, 0, False
        while lo < b:
            hi, need = lo, 0
            while hi < b:
                n2 = cross + seg(lo, hi + 1)
                if n2 > cap and hi > lo:
                    break
                need, hi = n2, hi + 1
            broken |= need > cap
            bounds += [lo] if lo else []
            cross += sum(costs.result[j] for j in range(lo, hi) if costs.consumer[j] >= hi)
            lo = hi
        if broken:
            continue
        peak = slicer.memory_model(costs, bounds + [b], copies, complex_, trans)
        if peak <= cap:
            return peak, bounds + [b], prefix_macs
        if peak < best[0]:
            best = (peak, bounds + [b], prefix_macs)
    if best[1] == []:
        every = list(range(1, n))
        peak = slicer.memory_model(costs, every, copies, complex_, trans)
        if peak < best[0]:
            best = (peak, every, sum(costs.macs[:-1]))
    return best


def _random_step_costs(rng, max_operands):
    """A StepCosts-like table of a random contraction tree over 2..max_operands operands (step
    results of 1-2048 elements): what the memory-model tests run on."""
    from types import SimpleNamespace
    pool = [(-1, rng.randint(1, 64)) for _ in range(rng.randint(2, max_operands))]
    result, macs, inputs, made_by = [], [], [], []
    while len(pool) > 1:
        (pa, ea), (pb, eb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        r = rng.choice([1, 4, 16, 256]) * rng.randint(1, 8)
        result.append(r), macs.append(r * rng.randint(1, 64)), inputs.append((ea, eb)), made_by.append((pa, pb))
        pool.append((len(result) - 1, r))
    n = len(result)
    consumer = [n] * n
    for j, prods in enumerate(made_by):
        for p in prods:
            if p >= 0:
                consumer[p] = j
    return SimpleNamespace(result=result, macs=macs, inputs=inputs, from_step=made_by, consumer=consumer)


def test_any_layout_peak_bounds_the_model_and_spares_compiling(monkeypatch):
    """The planner skips compiling a candidate's layout when even the worst layout (every
    intermediate operand and every result copied) fits the cap: that bound is at least
    memory_model's peak without checkpoints for any copies, on random contraction trees, real
    and complex; and a lattice plan whose candidates all fit compiles only its own layout
    (once), giving the plan it gives when every candidate is compiled."""
    import importlib
    from torch_gradops.tensornet import slicer
    plan_mod = importlib.import_module("torch_gradops.tensornet.plan")
    rng = random.Random(11)
    for _ in range(2000):
        costs = _random_step_costs(rng, 16)
        made_by, n = costs.from_step, len(costs.result)
        every = rng.random() < 0.5
        copies = [(tuple(p for p in made_by[j] if p >= 0 and (every or rng.random() < 0.5)), every or rng.random() < 0.5)
                  for j in range(n)]
        cx = rng.random() < 0.3
        assert slicer.memory_model(costs, (), copies, cx) <= plan_mod._any_layout_peak(costs, cx)
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0)
    args = interleave(inputs, arrays, output)
    tn.clear_plan_cache()
    compiled = []
    copies_of = plan_mod._copies
    monkeypatch.setattr(plan_mod, "_copies", lambda *a: compiled.append(a[1]) or copies_of(*a))
    fast = tn.plan(*args, memory_limit=64 << 20)
    assert len(compiled) == 1 and fast.num_slices == 1, len(compiled)
    tn.clear_plan_cache()
    monkeypatch.setattr(plan_mod, "_any_layout_peak", lambda *a: math.inf)
    full = tn.plan(*args, memory_limit=64 << 20)
    assert len(compiled) > 2 and (full.path, full.sliced_modes, full.checkpoints) == \
        (fast.path, fast.sliced_modes, fast.checkpoints)
    tn.clear_plan_cache()


def test_place_checkpoints_is_exact_and_matches_the_quadratic_placement():
    """place_checkpoints finds a placement within the cap whenever one exists, with the least
    recomputation: on random contraction trees of up to 10 steps, against every placement
    (with and without the layout's copies, real and complex); on trees of up to 23 steps it is
    never behind the greedy placement (the quadratic oracle), and where nothing fits it gives
    the oracle's lowest-peak placement. The peak it reports is memory_model's of its
    checkpoints. Cases that only the exact placement fits must occur (the greedy one, longest
    segments first, checkpoints more than it needs)."""
    from torch_gradops.tensornet import slicer
    rng = random.Random(7)
    kinds, only_exact = set(), 0
    for trial in range(3000):
        costs = _random_step_costs(rng, 11 if trial % 2 else 24)
        made_by, n = costs.from_step, len(costs.result)
        copies = None if rng.random() < 0.4 else [
            (tuple(p for p in made_by[j] if p >= 0 and rng.random() < 0.4), rng.random() < 0.3) for j in range(n)]
        cx = rng.random() < 0.3
        whole = slicer.memory_model(costs, (), copies, cx)
        cap = rng.choice([None, whole, whole * rng.random(), whole * 0.3 * rng.random(), rng.randint(1, 500)])
        got = slicer.place_checkpoints(costs, cap, copies, cx)
        want = _place_checkpoints_quadratic(costs, cap, copies, cx)
        assert got[0] == slicer.memory_model(costs, got[1], copies, cx)
        fits = cap is None or got[0] <= cap
        if cap is not None and want[0] <= cap:
            assert fits and got[2] <= want[2], (got, want)
        elif not fits:
            assert (got[0], list(got[1]), got[2]) == (want[0], list(want[1]), want[2])
        else:
            only_exact += 1
        if n <= 10 and cap is not None and whole > cap:  # every placement
            fitting = [sum(costs.macs[:cks[-1]]) for k in range(1, 1 << (n - 1))
                       for cks in [[b for b in range(1, n) if k >> (b - 1) & 1]]
                       if slicer.memory_model(costs, cks, copies, cx) <= cap]
            assert fits == bool(fitting), (got, fitting)
            if fitting:
                assert got[2] == min(fitting)
        kinds.add((bool(got[1]), fits))
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}
    assert only_exact > 0


def test_live_floor_bounds_every_checkpoint_placement():
    """live_floor is a lower bound of memory_model under every placement (every placement of up
    to 8 steps, random trees, with and without copies) and is reached by some placement in most
    trees; by hand on a small tree."""
    from torch_gradops.tensornet import slicer
    rng = random.Random(11)
    reached = 0
    for _ in range(400):
        costs = _random_step_costs(rng, 9)
        made_by, n = costs.from_step, len(costs.result)
        copies = None if rng.random() < 0.5 else [
            (tuple(p for p in made_by[j] if p >= 0 and rng.random() < 0.4), rng.random() < 0.3) for j in range(n)]
        cx = rng.random() < 0.3
        floor = slicer.live_floor(costs, copies, cx)
        peaks = [slicer.memory_model(costs, [b for b in range(1, n) if k >> (b - 1) & 1], copies, cx)
                 for k in range(1 << (n - 1))]
        assert floor <= min(peaks)
        reached += floor == min(peaks)
    assert reached > 100

    # A[0,1] B[1,2] -> AB (6 elements), C[3,4] D[4,5] -> CD (10), AB CD -> 60: live before the
    # last step 6 + 10; each step's transient (real, no copies) is its smaller operand's gradient
    # (14, 14, 6), so the floor is the last step's 6 + 10 + 60 + 6
    steps = slicer.step_table([[0, 1], [1, 2], [3, 4], [4, 5]], [0, 2, 3, 5], [(0, 1), (0, 1), (0, 1)])
    costs = slicer.step_costs(steps, {0: 2, 1: 7, 2: 3, 3: 2, 4: 7, 5: 5}, ())
    assert list(costs.result) == [6, 10, 60]
    assert slicer.live_floor(costs) == 82
    assert slicer.memory_model(costs) == 6 + 10 + 60 + 6


# ---------------------------------------------------------------------------- hoisting
PLAN_MODULE = __import__("torch_gradops.tensornet.plan", fromlist=["HOIST"])
# A ring whose sliced mode e lies in D and E only: A B C (modes a..d) are the same in every slice.
HOIST_SHAPES = [(3, 4), (4, 5), (5, 3), (3, 6), (6, 3)]


@contextlib.contextmanager
def _without_hoisting():
    """Plans made inside compute every slice in full (the plan cache is cleared on entry and
    exit, so that no other test meets such a plan)."""
    tn.clear_plan_cache()
    before, PLAN_MODULE.HOIST = PLAN_MODULE.HOIST, False
    try:
        yield
    finally:
        PLAN_MODULE.HOIST = before
        tn.clear_plan_cache()


def _hoist_ops(dtype=F64, seed=30, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    return [_rand(s, dtype=dtype, gen=gen, requires_grad=requires_grad) for s in HOIST_SHAPES]


def _hoisted_plan(expr, ops, **kw):
    p = tn.plan(expr, *ops, memory_limit=kw.pop("memory_limit", "1MiB"), slicing=["e"], **kw)
    assert p.hoisted is not None and len(p.hoisted.subs) == 1 and p.num_slices == 6
    return p


@pytest.mark.parametrize("out", ["", "e", "ae", "ce"])
@pytest.mark.parametrize("dtype", [F64, C128])
def test_hoisted_plan_matches_einsum_and_the_unhoisted_plan(out, dtype):
    expr = "ab,bc,cd,de,ea->" + out
    ops = _hoist_ops(dtype)
    p = _hoisted_plan(expr, ops)
    assert "slice-invariant" in repr(p)
    _check_against_einsum(expr, ops, memory_limit="1MiB", slicing=["e"])
    # slice groups: partial sums (or output blocks) that add up to the whole
    total = sum(p.contract(*ops, slices=g) for g in (range(0, 2), [2, 5], range(3, 5)))
    _close(total, torch.einsum(expr, *ops))
    # the same plan with every slice computing everything: same values, more FLOPs
    with _without_hoisting():
        q = tn.plan(expr, *ops, memory_limit="1MiB", slicing=["e"])
        assert q.hoisted is None and q.path == p.path and q.num_slices == p.num_slices
        assert p.flops < q.flops
        _close(p.contract(*ops, slices=[1, 4]), q.contract(*ops, slices=[1, 4]))


@pytest.mark.parametrize("out", ["", "e", "ae"])
def test_hoisted_plan_gradcheck_gradgradcheck_forward_ad(out):
    expr = "ab,bc,cd,de,ea->" + out
    ops = _hoist_ops(requires_grad=True)
    p = _hoisted_plan(expr, ops)
    assert torch.autograd.gradcheck(lambda *x: p.contract(*x), ops, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(lambda *x: p.contract(*x), ops)


def test_hoisted_plan_low_level_gradients_and_torch_func():
    expr = "ab,bc,cd,de,ea->e"
    ops = _hoist_ops()
    p = _hoisted_plan(expr, ops)
    g = _rand((6,), gen=torch.Generator().manual_seed(1))
    ref_ops = [o.clone().requires_grad_(True) for o in ops]
    ref = torch.autograd.grad(torch.einsum(expr, *ref_ops), ref_ops, g)
    # slice groups accumulated into caller buffers, one operand skipped
    bufs = [torch.zeros_like(o) for o in ops]
    bufs[3] = None
    p.gradients(*ops, output_grad=g, slices=range(3), grads=bufs)
    got = p.gradients(*ops, output_grad=g, slices=range(3, 6), grads=bufs, accumulate=True)
    assert got[3] is None
    for i in (0, 1, 2, 4):
        _close(bufs[i], ref[i])
    # torch.func: vmap over a batch of the hoisted subtree's operand, jacrev, jvp
    batch = torch.randn((2,) + HOIST_SHAPES[1], dtype=F64)
    got = torch.func.vmap(lambda b: p.contract(ops[0], b, *ops[2:]))(batch)
    _close(got, torch.stack([torch.einsum(expr, ops[0], b, *ops[2:]) for b in batch]))
    jac = torch.func.jacrev(lambda a: p.contract(a, *ops[1:]))(ops[0])
    _close(jac, torch.func.jacrev(lambda a: torch.einsum(expr, a, *ops[1:]))(ops[0]))
    t = torch.randn_like(ops[2])
    _, tangent = torch.func.jvp(lambda c: p.contract(*ops[:2], c, *ops[3:]), (ops[2],), (t,))
    _close(tangent, torch.einsum(expr, *ops[:2], t, *ops[3:]))


def test_hoisted_plan_under_torch_compile():
    expr = "ab,bc,cd,de,ea->ae"
    ops = _hoist_ops()
    _hoisted_plan(expr, ops)  # planned outside the compiled region

    def fn(*x):
        return tn.contract(expr, *x, memory_limit="1MiB", slicing=["e"]).sin().sum()

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [o.clone().requires_grad_(True) for o in ops]
    ref_leaves = [o.clone().requires_grad_(True) for o in ops]
    _close(compiled(*leaves), fn(*ref_leaves))
    got = torch.autograd.grad(compiled(*leaves), leaves)
    ref = torch.autograd.grad(fn(*ref_leaves), ref_leaves)
    for a, b in zip(got, ref):
        _close(a, b)


def test_hoisting_a_subtree_thousands_of_steps_deep():
    """A 1200-tensor MPS norm sliced on its first bond: the invariant subtrees are chains of
    about 1200 steps, deeper than Python's recursion limit (_hoist walked them recursively and
    raised RecursionError). Value and a gradient against the unhoisted plan."""
    inputs, out, ops = mps_network(1200, bond=4, dtype=F64)
    args = interleave(inputs, ops, out)
    p = tn.plan(*args, slicing=[inputs[0][-1]], memory_limit="1MiB", optimize="greedy")
    assert p.hoisted is not None and p.num_slices == 4
    leaves = [o.clone().requires_grad_(True) for o in ops]
    value = p.contract(*leaves)
    with _without_hoisting():
        q = tn.plan(*args, slicing=[inputs[0][-1]], memory_limit="1MiB", optimize="greedy")
        ref_leaves = [o.clone().requires_grad_(True) for o in ops]
        ref = q.contract(*ref_leaves)
    _close(value, ref, rtol=1e-10, atol=0)
    (g,), (g_ref,) = torch.autograd.grad(value, leaves[600:601]), torch.autograd.grad(ref, ref_leaves[600:601])
    _close(g, g_ref, rtol=1e-10, atol=1e-300)


# A contraction tree of the 5x5 bond-16 lattice (the search's choice at 4 MiB before the exact
# checkpoint placement; it now finds one with less work before hoisting and about the same after)
LATTICE_5X5_TREE = [(15, 16), (18, 23), (18, 22), (19, 20), (17, 20), (16, 19), (3, 4), (6, 17), (6, 16), (2, 15),
                    (4, 14), (8, 13), (7, 12), (10, 11), (6, 10), (6, 9), (6, 8), (6, 7), (5, 6), (3, 5), (1, 4),
                    (2, 3), (1, 2), (0, 1)]


def test_hoisting_cuts_the_work_of_a_real_lattice_within_the_memory_contract():
    # the 5x5 bond-16 lattice of the benchmarks at 4 MiB on that tree: about 15% of a slice's
    # multiply-adds are the same in every one of its 32 slices
    inputs, output, arrays = lattice_network(5, 5, 16, seed=0)
    args = interleave(inputs, arrays, output)
    p = tn.plan(*args, memory_limit="4MiB", optimize=LATTICE_5X5_TREE)
    with _without_hoisting():
        q = tn.plan(*args, memory_limit="4MiB", optimize=LATTICE_5X5_TREE)
    assert p.hoisted is not None and q.hoisted is None and p.num_slices == q.num_slices
    assert 3 * p.flops + p.recompute_flops < 0.9 * (3 * q.flops + q.recompute_flops)
    assert p.modelled_peak <= tn.slicer.MODEL_CAP * 4 * 2**20


def test_einsum_pairwise_reference_takes_more_than_26_output_modes():
    from torch_gradops.testing import einsum_pairwise
    inputs, output = [list(range(15)), list(range(15, 30))], list(range(30))
    arrays = [torch.randn((1,) * 14 + (2,)), torch.randn((2,) + (1,) * 14)]
    got = einsum_pairwise(inputs, output, arrays, [(0, 1)])  # failed: "invalid subscript at index 26"
    assert got.shape == (1,) * 14 + (2, 2) + (1,) * 14
    torch.testing.assert_close(got.reshape(2, 2), torch.outer(arrays[0].reshape(2), arrays[1].reshape(2)))


def test_empty_path_cache_means_no_disk_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ops = [torch.randn(2, 2) for _ in range(12)]
    expr = ",".join(f"{chr(97 + i)}{chr(98 + i)}" for i in range(12)) + "->"  # a chain worth a search
    tn.plan(expr, *ops, optimize="cotengra", path_cache="")
    assert list(tmp_path.iterdir()) == []  # it wrote torch_gradops-<hash>/ into the current directory


def test_options_given_with_a_plan_and_complex_output_grad_are_refused():
    """contract(..., plan=p, memory_limit=8) ran p and ignored the limit silently; a complex
    output_grad for a real result lost its imaginary part with only a warning (autograd
    refuses it)."""
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    p = tn.plan("ab,bc->ac", a, b)
    _close(tn.contract("ab,bc->ac", a, b, plan=p), a @ b)
    for kw in (dict(memory_limit=8), dict(optimize="greedy"), dict(slicing=["b"]), dict(max_overhead=None),
               dict(optimize=__import__("numpy").array([[0, 1]]))):
        with pytest.raises(ValueError, match=f"plan: {next(iter(kw))} cannot be given with a plan"):
            tn.contract("ab,bc->ac", a, b, plan=p, **kw)
    limited = tn.plan("ab,bc->ac", a, b, memory_limit=64)
    for kw in (dict(memory_limit=64), dict(memory_limit="64B"), dict(slicing=[]), dict(path_cache="/tmp")):
        _close(tn.contract("ab,bc->ac", a, b, plan=limited, **kw), a @ b)  # the plan's own, or harmless
    with pytest.raises(TypeError, match="output_grad is complex"):
        p.gradients(a, b, output_grad=torch.ones(3, 5, dtype=torch.complex128))


def test_unit_output_gradient_takes_the_fused_gradients_without_a_copy():
    """loss.backward() of a one-element output: the forward already holds every operand's
    gradient under a unit cotangent, and a unit output gradient now takes them as they are; it
    made a scaled copy of each (2x the operands' bytes at the peak). Other output gradients
    still scale, and the values are the same."""
    inputs, out, ops = lattice_network(4, 4, 8, seed=2, dtype=F64)
    p = tn.plan(*interleave(inputs, ops, out), memory_limit=16384)
    assert p.num_slices > 1
    ob = sum(o.numel() * o.element_size() for o in ops)
    ref = [torch.autograd.grad(tn.plan(*interleave(inputs, ops, out)).contract(*[o.requires_grad_(True) for o in xs]), xs)
           for xs in [[o.clone() for o in ops]]][0]
    peaks, grads = {}, {}
    for name, scale in (("unit", 1.0), ("scaled", 2.0)):
        leaves = [o.clone().requires_grad_(True) for o in ops]
        loss = p.contract(*leaves)  # the forward holds the gradients
        peaks[name] = _peak_bytes(lambda: loss.backward(torch.tensor(scale, dtype=F64)))
        grads[name] = [x.grad for x in leaves]
        for g, r in zip(grads[name], ref):
            _close(g, scale * r)
    assert peaks["unit"] < ob // 8 and peaks["scaled"] >= ob, (peaks, ob)


def test_slicing_takes_a_plans_sliced_modes_back():
    """plan.sliced_modes lists modes sliced in ranges as ModeChunks (``a/2``), which slicing=
    refused ("not a mode of the expression"): a plan's slicing could not be asked for again.
    With the plan's path it now gives the same plan; the values and gradients are einsum's."""
    inputs, out, ops = lattice_network(4, 4, 8, seed=2, dtype=F64)
    args = interleave(inputs, ops, out)
    p = tn.plan(*args, memory_limit=4096)
    assert any(isinstance(m, tn.ModeChunks) for m in p.sliced_modes)
    for limit in (4096, None):
        q = tn.plan(*args, memory_limit=limit, slicing=list(p.sliced_modes), optimize=list(p.path))
        assert (q.sliced_modes, q.num_slices, q.flops) == (p.sliced_modes, p.num_slices, p.flops)
    leaves = [o.clone().requires_grad_(True) for o in ops]
    refs = [o.clone().requires_grad_(True) for o in ops]
    got = q.contract(*leaves)
    want = torch.einsum(*interleave(inputs, refs, out))
    _close(got, want)
    for g, r in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, refs)):
        _close(g, r)
    a, b = torch.randn(4, 6, dtype=F64), torch.randn(6, 5, dtype=F64)
    _close(tn.contract("ab,bc->ac", a, b, slicing=[tn.ModeChunks("b", 3)]), a @ b)
    for bad, match in (([tn.ModeChunks("b", 4)], r"cannot be sliced in 4 ranges: its mode has extent 6; pass a "
                                                 r"divisor of 6 between 2 and 5 \(2, 3\), or 'b'"),
                       # (it said "pass a divisor of 4 between 2 and 3 (2)": what was passed)
                       ([tn.ModeChunks("a", 2)], r"'a' is an output mode, which slices only whole .*: pass 'a'$"),
                       ([tn.ModeChunks("b", 2), "b"], "listed twice"),
                       ([tn.ModeChunks("z", 2)], "not a mode of the expression")):
        with pytest.raises(ValueError, match=match):
            tn.plan("ab,bc->ac", a, b, slicing=bad)
    # fewer than 2 chunks is not a split (was "cannot be sliced in 0 ranges ... no divisor")
    for chunks in (0, 1, 2.5, "2"):
        with pytest.raises(ValueError, match=r"chunks must be an int >= 2 .*passing 'b' itself"):
            tn.ModeChunks("b", chunks)
    # a prime extent has no divisor to suggest (the message offered "a divisor of 5 between 2 and 4")
    with pytest.raises(ValueError, match="5 has no divisor between 2 and 4: pass 'b' to slice it whole"):
        tn.plan("ab,bc->ac", torch.randn(4, 5, dtype=F64), torch.randn(5, 3, dtype=F64),
                slicing=[tn.ModeChunks("b", 5)])


def test_slice_ids_and_dtype_arguments_are_checked_by_kind():
    """slices=[1.0] said "out of range", slices=range(0, 10**20) raised OverflowError from len(),
    plan(dtype="float32") said "must have a floating-point dtype, got float32"."""
    a, b = torch.randn(3, 4, dtype=F64), torch.randn(4, 5, dtype=F64)
    p = tn.plan("ab,bc->ac", a, b, slicing=["b"])
    for bad in ([1.0], [True], ["0"]):
        with pytest.raises(TypeError, match="slices: slice ids are ints"):
            p.contract(a, b, slices=bad)
    with pytest.raises(ValueError, match="slices: slice id 99999999999999999999 is out of range"):
        p.contract(a, b, slices=range(0, 10 ** 20))
    assert torch.equal(p.contract(a, b, slices=range(2, 2)), torch.zeros(3, 5, dtype=F64))
    np = pytest.importorskip("numpy")
    _close(p.contract(a, b, slices=[np.int64(0), torch.tensor(1)]), p.contract(a, b, slices=[0, 1]))
    with pytest.raises(TypeError, match="dtype must be a torch.dtype .*got 'float32' \\(str\\)"):
        tn.plan("ab,bc->ac", (3, 4), (4, 5), dtype="float32")


def test_corrupt_or_unusable_path_cache(tmp_path):
    """A truncated or corrupt cache entry (an interrupted write) broke every later plan of the
    network with cotengra's "UnboundLocalError: cannot access local variable 'e'"; now the
    search runs again, with a warning, and rewrites the entry. A path_cache that is a file, or
    a folder that cannot be made, is a ValueError naming path_cache (a raw OSError before)."""
    ops = [torch.randn(2, 2, dtype=F64) for _ in range(12)]
    expr = ",".join(f"{chr(97 + i)}{chr(98 + i)}" for i in range(12)) + "->"
    ref = torch.einsum(expr, *ops)
    tn.clear_plan_cache()
    first = tn.plan(expr, *ops, optimize="cotengra", path_cache=tmp_path)
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert files
    for f in files:
        f.write_bytes(b"garbage")
    tn.clear_plan_cache()
    with pytest.warns(RuntimeWarning, match="path_cache: an entry .* could not be read: it is corrupt or was cut short"):
        again = tn.plan(expr, *ops, optimize="cotengra", path_cache=tmp_path)
    assert again.searched and again.path == first.path
    _close(again.contract(*ops), ref)
    tn.clear_plan_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not tn.plan(expr, *ops, optimize="cotengra", path_cache=tmp_path).searched  # rewritten
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    for bad in (not_a_folder, "/proc/torch_gradops_no_such_folder"):
        tn.clear_plan_cache()
        with pytest.raises(ValueError, match="path_cache: cannot keep a cache in"):
            tn.plan(expr, *ops, optimize="cotengra", path_cache=bad)
    tn.clear_plan_cache()


# ---------------------------------------------------------------------------- optimizer options
def test_disk_path_cache_keys_the_objectives_options(tmp_path):
    """An on-disk cache entry written under one set of options (here: no forced slicing) served
    a plan to another (slicing=["c"]): twice the slices of a fresh search. The key now holds what
    shapes the search's objective: forced modes, min_slices, complex dtypes, max_overhead."""
    expr = "ab,bc,cd,de,ea,ax,cy->xy"
    shapes = [(4, 5), (5, 6), (6, 4), (4, 5), (5, 4), (4, 3), (6, 2)]
    kw = dict(memory_limit=64, optimize="cotengra")
    for other in (dict(slicing=["c"]), dict(slicing={"min_slices": 8}), dict(dtype=torch.complex128)):
        tn.clear_plan_cache()
        fresh = tn.plan(expr, *shapes, **kw, **other)
        tn.clear_plan_cache()
        tn.plan(expr, *shapes, path_cache=tmp_path, **kw)  # an entry for the default options
        cached = tn.plan(expr, *shapes, path_cache=tmp_path, **kw, **other)
        assert cached.searched, other
        assert (cached.path, cached.sliced_modes, cached.num_slices) == \
            (fresh.path, fresh.sliced_modes, fresh.num_slices), other
    tn.clear_plan_cache()


def test_paths_with_one_operand_steps_and_optimizer_objects():
    """opt_einsum's "dp" emits one-operand steps (a mode summed within one operand), which
    crashed the planner; explicit paths with them, and opt_einsum optimizer objects (the docs
    accept "any opt_einsum optimizer"), work too."""
    gen = torch.Generator().manual_seed(3)
    a, b, c = _rand((3, 3, 4), gen=gen), _rand((4, 5), gen=gen), _rand((5, 2, 6), gen=gen)
    expr = "aab,bc,cde->d"
    ref = torch.einsum(expr, a, b, c)
    assert any(len(s) == 1 for s in opt_einsum.contract_path(expr, a, b, c, optimize="dp")[0])
    for opt in ("dp", opt_einsum.paths.DynamicProgramming(), opt_einsum.paths.DynamicProgramming(minimize="size"),
                [(0,), (2,), (0, 1), (0, 1)], [(1, 2), (0,), (0, 1)], [(0, 1, 2)]):
        p = tn.plan(expr, a, b, c, optimize=opt)
        assert all(len(s) == 2 for s in p.path), (opt, p.path)
        _close(p.contract(a, b, c), ref)
    assert tn.plan(expr, a, b, c, optimize=opt_einsum.paths.DynamicProgramming()).optimizer == "DynamicProgramming"
    for bad in ([(0,), (0,)], [()], [(0, 0)], [(3,)]):
        with pytest.raises(ValueError, match="optimize: explicit path"):
            tn.plan(expr, a, b, c, optimize=bad)


def test_cotengra_search_edge_cases():
    import cotengra as ctg
    D = torch.float64
    # a mode of extent 0: every cotengra trial divided by zero and the search kept no tree
    x, y = torch.randn(3, 0, dtype=D), torch.randn(0, 5, dtype=D)
    for opt in ("cotengra", ctg.HyperOptimizer(max_repeats=2, progbar=False, parallel=False)):
        _close(tn.contract("ab,bc->ac", x, y, optimize=opt), torch.zeros(3, 5, dtype=D))
    # more min_slices than the network has: the planner's own message, not cotengra's KeyError
    with pytest.raises(ValueError, match="cannot reach min_slices=8"):
        tn.plan("ab,bc->", (2, 2), (2, 2), optimize="cotengra", slicing={"min_slices": 8})
    # ... refused before the search: each of its trials warned "Trial error: 'd'" first. Modes
    # in one operand only (a, c, i, g) cannot be sliced: 3 slices (mode b) at most.
    eq = "b,abci,gj,ffb,ej,b,bjbe,be,->befj"
    shapes = [(3,), (2, 3, 3, 2), (2, 1), (1, 1, 3), (1, 1), (3,), (3, 1, 3, 1), (3, 1), ()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="cannot reach min_slices=4; only 3 slice"):
            tn.plan(eq, *shapes, slicing={"min_slices": 4})
        assert tn.plan(eq, *shapes, slicing={"min_slices": 3}).num_slices == 3
    # a cotengra optimizer object keeps its tree: reused for another network it returned that tree
    opt = ctg.HyperOptimizer(max_repeats=2, progbar=False, parallel=False)
    tn.plan("ab,bc,cd->ad", (2, 3), (3, 4), (4, 5), optimize=opt)
    with pytest.raises(ValueError, match="tree of another network"):
        tn.plan("ab,bc,cd,de->ae", (2, 3), (3, 4), (4, 5), (5, 6), optimize=opt)


def test_auto_search_budget_counts_the_sliced_cost():
    """Under a memory limit "auto" sized its search by the greedy path's unsliced cost and,
    finding it cheap, kept the greedy path: sliced to 64 B it needed 72x the slices and 26x the
    FLOPs of what a search finds in milliseconds."""
    import cotengra as ctg
    inputs, _, _, sizes = ctg.utils.lattice_equation([3, 4], d_min=2, d_max=3, seed=0)
    expr = ",".join("".join(t) for t in inputs) + "->"
    shapes = [tuple(sizes[c] for c in t) for t in inputs]
    auto = tn.plan(expr, *shapes, dtype=torch.float64, memory_limit=64)
    searched = tn.plan(expr, *shapes, dtype=torch.float64, memory_limit=64, optimize="cotengra")
    greedy = tn.plan(expr, *shapes, dtype=torch.float64, memory_limit=64, optimize="greedy")
    assert auto.optimizer == "cotengra" and auto.flops <= 2 * searched.flops < greedy.flops / 4
    ops = [torch.randn(s, dtype=torch.float64) for s in shapes]
    _close(auto.contract(*ops), torch.einsum(expr, *ops))


def test_auto_search_of_a_costly_contraction_runs_the_trials_it_is_worth():
    """A 72-tensor PEPS norm (bond 3) sliced to 1 MiB: capped at 16 trials, "auto" planned
    6.4e12 FLOPs of forward + backward in 39,366 slices with this seed (between 9.6e10
    and 3.6e13 over five seeds); the contraction's estimated minutes are worth more trials
    (about a second of search here), which find 1.2e11 in 729 slices."""
    from torch_gradops.testing import peps_norm_network
    inputs, output, arrays = peps_norm_network(6, 6, 3, seed=0)
    p = tn.plan(*interleave(inputs, arrays, output), memory_limit="1MiB", max_overhead=None)
    assert p.optimizer == "cotengra"
    assert 3 * p.flops + p.recompute_flops < 1e12 and p.num_slices < 5000


def _written_and_macs(p):
    """Elements the plan's forward steps write (one slice) and its multiply-adds."""
    from torch_gradops.tensornet import slicer
    net = p.network
    costs = slicer.step_costs(slicer.step_table(net.inputs, net.output, p.path), net.sizes, p.sliced_ids)
    return sum(costs.result), sum(costs.macs)


def test_unsliced_search_weighs_the_elements_intermediates_write(monkeypatch):
    """The unsliced 6x6 PEPS norm (bond 3): the tree of least multiply-adds (2.2e9) writes
    2.1e8 elements and ran slower (0.43-0.6 s on the AMD EPYC VM) than opt_einsum's greedy tree
    of 1.05e10; charging slicer.WRITE_MACS per element written finds one of 2.9e9 that writes
    2.8e7 (0.09-0.13 s). Under a memory limit the weight is 0: the same plan as without it."""
    from torch_gradops.testing import peps_norm_network
    from torch_gradops.tensornet import slicer
    inputs, output, arrays = peps_norm_network(6, 6, 3, seed=0)
    args = interleave(inputs, arrays, output)
    tn.clear_plan_cache()
    weighed = _written_and_macs(tn.plan(*args))
    sliced = tn.plan(*args, memory_limit="1MiB", max_overhead=None)
    monkeypatch.setattr(slicer, "WRITE_MACS", 0.0)
    tn.clear_plan_cache()
    unweighed = _written_and_macs(tn.plan(*args))
    assert weighed[0] * 4 < unweighed[0] and weighed[1] < 2 * unweighed[1], (weighed, unweighed)
    again = tn.plan(*args, memory_limit="1MiB", max_overhead=None)
    assert (again.path, again.sliced_ids) == (sliced.path, sliced.sliced_ids)
    tn.clear_plan_cache()


def test_auto_searches_when_slicing_the_greedy_path_costs_more_than_the_search():
    """A 24-tensor PEPS norm (complex64) at 16 KiB: the greedy path's plan (256 slices, 10x its
    unsliced work, 99 ms forward + backward) was estimated too cheap to be worth two trials, so
    "auto" kept it, though at 8 KiB it searched and found 54 slices. What slicing adds to the
    greedy path's work now bounds the search too: 9 slices, 6 ms."""
    from torch_gradops.testing import peps_norm_network
    inputs, output, arrays = peps_norm_network(3, 4, 3, seed=0, dtype=torch.complex64)
    args = interleave(inputs, arrays, output)
    greedy = tn.plan(*args, memory_limit=16384, optimize="greedy", max_overhead=None)
    auto = tn.plan(*args, memory_limit=16384, max_overhead=None)
    assert greedy.num_slices >= 128
    assert auto.optimizer == "cotengra" and auto.num_slices <= 32
    assert 3 * auto.flops + auto.recompute_flops < (3 * greedy.flops + greedy.recompute_flops) / 4
    _close(auto(*arrays), greedy(*arrays), rtol=1e-4, atol=1e-6)


def test_unsliced_search_reconfigures_a_close_runner_up(monkeypatch):
    """Which of two close trees reconfigures into the better one the trial scores do not tell:
    on a 6x6 complex64 lattice of bond 8 the search's winner (1.73e9 by its score) became 7.9e8
    multiply-adds and the runner-up (1.98e9) 6.0e8. Both are reconfigured now."""
    from torch_gradops.tensornet import paths
    inputs, output, arrays = lattice_network(6, 6, 8, seed=0, dtype=torch.complex64)
    args = interleave(inputs, arrays, output)
    tn.clear_plan_cache()
    both = _written_and_macs(tn.plan(*args))
    monkeypatch.setattr(paths, "RUNNER_UP_RATIO", 0.0)
    tn.clear_plan_cache()
    winner_only = _written_and_macs(tn.plan(*args))
    assert both[1] < 0.85 * winner_only[1] and both[0] < winner_only[0], (both, winner_only)
    tn.clear_plan_cache()


def test_a_plan_whose_intermediate_exceeds_the_device_memory_is_refused(monkeypatch):
    """Without a memory_limit, a plan whose largest intermediate alone is larger than the
    device's memory was run until the allocator failed (on a CPU, the kernel killed the process:
    a 60-tensor random tree's greedy plan needs a 47 GiB intermediate on a 24 GiB machine).
    Now a ValueError that names memory_limit, before any work; with a limit it is sliced."""
    from torch_gradops.tensornet import slicer
    monkeypatch.setattr(slicer, "_device_memory", lambda device: 2 ** 20)  # 1 MiB
    a = torch.randn(1000, requires_grad=True)
    b = torch.randn(1000)
    with pytest.raises(ValueError, match=r"largest intermediate is 3.8 MiB, more than the 1.0 MiB of memory of "
                                         r"cpu: pass memory_limit"):
        tn.contract("a,b->ab", a, b)
    with pytest.raises(ValueError, match="pass memory_limit"):
        tn.plan("a,b->ab", a, b).contract(a.detach(), b)
    _close(tn.contract("a,b->", a, b), a.sum() * b.sum(), rtol=1e-4, atol=1e-3)  # fits: runs
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    _close(tn.contract("ab,bc->ac", x, y, memory_limit=4096), x @ y, rtol=1e-5, atol=1e-4)


def test_bad_option_values_name_the_option():
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    for limit in ("1e400", 10 ** 400, 2 ** 63, "10000000TB"):
        with pytest.raises(ValueError, match="memory_limit"):
            tn.plan("ab,bc->ac", a, b, memory_limit=limit)
    with pytest.raises(TypeError, match="slicing: 'modes'"):
        tn.plan("ab,bc->ac", a, b, slicing={"modes": None})
    with pytest.raises(TypeError, match="slicing: mode \\['b'\\]"):
        tn.plan("ab,bc->ac", a, b, slicing=[["b"]])
    with pytest.raises(TypeError, match="output mode label"):
        tn.contract(a, [0, 1], b, [1, 2], [[0], 2])
    for bad in (True, 0, 2.0, "4"):
        with pytest.raises(ValueError, match="min_slices must be a positive int"):
            tn.plan("ab,bc->ac", a, b, slicing={"min_slices": bad})
    import numpy as np
    assert tn.plan("ab,bc->ac", a, b, slicing={"min_slices": np.int64(4)}).num_slices >= 4


def test_a_percent_memory_limit_keys_plans_by_device(monkeypatch):
    """Plans were cached by device type: a plan for cuda:0 at memory_limit="50%" served cuda:1,
    whose memory (and so whose limit) may differ. Absolute limits still share plans across
    devices of a type. (Two GPUs of different memory, as the planner sees them.)"""
    from torch_gradops.tensornet import slicer
    memory = {0: 2 ** 30, 1: 2 ** 20}
    monkeypatch.setattr(slicer, "_device_memory", lambda d: memory[d.index or 0])
    tn.clear_plan_cache()
    shapes = ((64, 64), (64, 64))
    p0 = tn.plan("ab,bc->ac", *shapes, dtype=torch.float32, memory_limit="50%", device="cuda:0")
    p1 = tn.plan("ab,bc->ac", *shapes, dtype=torch.float32, memory_limit="50%", device="cuda:1")
    assert (p0.memory_limit, p1.memory_limit) == (2 ** 29, 2 ** 19)
    q0 = tn.plan("ab,bc->ac", *shapes, dtype=torch.float32, memory_limit="1MiB", device="cuda:0")
    assert q0 is tn.plan("ab,bc->ac", *shapes, dtype=torch.float32, memory_limit="1MiB", device="cuda:1")
    tn.clear_plan_cache()


def test_optimize_true_and_false_as_opt_einsum_takes_them():
    """optimize=True is "auto"; optimize=False contracts the operands left to right with no
    search (opt_einsum's meanings), against torch.einsum and opt_einsum's own False path; the
    plan cache keeps True/False apart from 1/0, which are refused."""
    import opt_einsum
    g = torch.Generator().manual_seed(0)
    expr = "ab,bc,cd,de->ae"
    ops = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 40), (40, 2), (2, 50), (50, 4))]
    ref = torch.einsum(expr, *ops)
    auto, left = tn.plan(expr, *ops, optimize=True), tn.plan(expr, *ops, optimize=False)
    assert auto.path == tn.plan(expr, *ops).path
    assert left.optimizer == "left-to-right"
    assert left.path == [(0, 1), (0, 2), (0, 1)]  # ((AB)C)D in linear form
    oe_path = opt_einsum.contract_path(expr, *[o.numpy() for o in ops], optimize=False)[0]
    assert tn.plan(expr, *ops, optimize=oe_path).path == left.path
    assert left.flops > auto.flops  # the order matters for this chain
    for p in (auto, left):
        torch.testing.assert_close(p.contract(*ops), ref)
    torch.testing.assert_close(tn.contract(expr, *ops, optimize=False), ref)
    for bad in (1, 0):
        with pytest.raises(ValueError, match="optimize must be"):
            tn.plan(expr, *ops, optimize=bad)
