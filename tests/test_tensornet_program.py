"""The contraction program format: Python (tensornet/program.py) and C++ (csrc/contract_program.h)
stay in step. Programs encoded in Python decode and re-encode unchanged on both sides."""
import pytest
import torch

from torch_gradops import tensornet as tn
from torch_gradops.tensornet import program as fmt
from torch_gradops.testing import circuit_amplitude_network, interleave


def _cpp_reencode(ints, n_operands):
    return fmt.executor_reencode(ints, n_operands)


def test_version_and_opcodes_match_the_executor():
    cpp = fmt.executor_format()
    py = {name: getattr(fmt, name) for name in ("VERSION", "SELECT", "SUM", "CONTRACT", "FINAL", "CHECKPOINT")}
    assert cpp == py


# Every instruction and field: a hand-written program (not a planner output), so that a field
# the planner happens not to vary is still checked.
HANDMADE = fmt.Program(
    n_operands=2, n_sliced=2, out_shape=(3, 2, 5),
    instructions=(
        fmt.Select(0, 1, 0),
        fmt.Select(1, 0, 1),
        fmt.Sum(1, (2,)),
        fmt.Checkpoint(),
        fmt.Contract(a=0, b=1, c=2, perm_a=(1, 0), perm_b=(0, 1), ta=True, tb=False, bt=1, m=3, k=4, n=5,
                     shape_c=(3, 5)),
        fmt.Final(slot=2, perm=(0, 1), blocks=((1, 1),)),
    ))


def test_handmade_program_round_trips():
    ints = fmt.encode(HANDMADE)
    assert fmt.decode(ints) == HANDMADE
    assert _cpp_reencode(ints, 2) == ints


def _plans():
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((3, 4), (4, 5), (5, 2)))
    yield tn.plan("ab,bc,cd->ad", a, b, c)
    yield tn.plan("ab,bc,cd->ad", a, b, c, slicing=["b", "a"])  # a sliced output mode: FINAL blocks
    yield tn.plan("ab,bc,cd->", a, b, c, slicing={"min_slices": 4})
    yield tn.plan("ii,ij->j", (4, 4), (4, 3))                     # diagonal preprocessing
    yield tn.plan("abc,bcd,ce->ade", (2, 5, 3), (5, 3, 2), (3, 4))  # hyperedge c
    inputs, output, arrays = circuit_amplitude_network(3, 3, 8, seed=2, dtype=torch.complex128)
    args = interleave(inputs, arrays, output)
    full = tn.plan(*args, optimize="greedy")
    yield tn.plan(*args, optimize="greedy", memory_limit=full.largest_intermediate[1])  # CHECKPOINTs


@pytest.mark.parametrize("k", range(6))
def test_planner_programs_round_trip(k):
    p = list(_plans())[k]
    prog = fmt.decode(p.program)
    assert fmt.encode(prog) == p.program
    assert _cpp_reencode(p.program, prog.n_operands) == p.program
    assert prog.n_sliced == len(p.sliced_modes)
    assert prog.out_shape == p.output_shape
    if k == 5:
        assert any(isinstance(x, fmt.Checkpoint) for x in prog.instructions)


def test_malformed_programs_are_refused_on_both_sides():
    ints = list(fmt.encode(HANDMADE))
    for bad in (ints[:-1], ints + [0], [fmt.VERSION + 1] + ints[1:]):
        with pytest.raises(ValueError):
            fmt.decode(bad)
        with pytest.raises(RuntimeError, match="contract_program"):
            _cpp_reencode(bad, 2)
    with pytest.raises(RuntimeError, match="program is for 2 operands"):
        _cpp_reencode(ints, 3)


@pytest.mark.parametrize("quick_macs", [0, 1 << 14], ids=["searched", "default"])
def test_compiled_layouts_are_memoised_deterministically(monkeypatch, quick_macs):
    """The compiler memoises each searched step's GEMM layout on the step's canonical form
    (modes renumbered in order of appearance): a warm memo gives the same program as a cold
    one, and two networks that differ only in their mode labels compile to the same program
    (also with the quick layouts that the default threshold gives this network's small steps)."""
    from torch_gradops.tensornet import compiler
    from torch_gradops.testing import lattice_network
    import opt_einsum
    monkeypatch.setattr(compiler, "QUICK_MACS", quick_macs)
    inputs, output, arrays = lattice_network(3, 4, 3, seed=1)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
    compiler._canonical_layout.cache_clear()
    cold = compiler.compile_program(inputs, output, sizes, path, (), 8, False)
    if quick_macs == 0:
        assert compiler._canonical_layout.cache_info().currsize > 0  # filled
    warm = compiler.compile_program(inputs, output, sizes, path, (), 8, False)
    assert fmt.encode(warm[0]) == fmt.encode(cold[0]) and warm[1] == cold[1]
    shift = {m: 1000 - 7 * m for m in sizes}  # other labels, another order of their values
    relabelled = compiler.compile_program([[shift[m] for m in t] for t in inputs], [shift[m] for m in output],
                                          {shift[m]: e for m, e in sizes.items()}, path, (), 8, False)
    assert fmt.encode(relabelled[0]) == fmt.encode(cold[0])
    # the same network with a mode sliced: a different program, still one per canonical step
    sliced = compiler.compile_program(inputs, output, sizes, path, (inputs[0][0],), 8, False)
    assert fmt.encode(sliced[0]) != fmt.encode(cold[0])


@pytest.mark.parametrize("quick_macs", [0, 1 << 40], ids=["full_search", "all_quick"])
def test_quick_layouts_are_valid_and_chosen_by_total_work(monkeypatch, quick_macs):
    """Steps whose multiply-adds over all slices are below compiler.QUICK_MACS get the quick
    layout instead of the search; with every step quick and with none, the programs contract to
    einsum's value and gradients (the quick layout only picks layouts the executor can run), and
    the threshold counts slices: the same small network sliced many times is searched in full."""
    from torch_gradops.tensornet import compiler
    monkeypatch.setattr(compiler, "QUICK_MACS", quick_macs)
    compiler._canonical_layout.cache_clear()
    tn.clear_plan_cache()
    inputs, output, arrays = circuit_amplitude_network(3, 3, 6, seed=2)
    arrays = [a.to(torch.complex128).requires_grad_() for a in arrays]
    ref_leaves = [a.detach().clone().requires_grad_() for a in arrays]
    ref = torch.einsum(*interleave(inputs, ref_leaves, output))
    ref_grads = torch.autograd.grad(ref.real.sum(), ref_leaves)
    for limit in (None, 256):
        value = tn.contract(*interleave(inputs, arrays, output), memory_limit=limit)
        grads = torch.autograd.grad(value.real.sum(), arrays)
        torch.testing.assert_close(value, ref.detach(), rtol=1e-10, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    compiler._canonical_layout.cache_clear()
    tn.clear_plan_cache()
    calls = []
    for name in ("_gemm_layout", "_quick_layout"):
        real = getattr(compiler, name)

        def spy(*a, _real=real, _quick=name == "_quick_layout"):
            calls.append(_quick)
            return _real(*a)
        monkeypatch.setattr(compiler, name, spy)
    monkeypatch.setattr(compiler, "QUICK_MACS", 1 << 14)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    import opt_einsum
    path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
    compiler.compile_program(inputs, output, sizes, path, (), 16, True)
    assert len(calls) == len(path) and all(calls)  # a tiny network: every step quick
    big = [m for m in sizes if sizes[m] > 1][:14]  # slicing multiplies each step's runs
    calls.clear()
    compiler._canonical_layout.cache_clear()
    compiler.compile_program(inputs, output, sizes, path, tuple(big), 16, True)
    assert calls and not any(calls)
