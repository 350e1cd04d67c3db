"""The contraction program format: Python (tensornet/program.py) and C++ (csrc/contract_program.h)
stay in step. Programs encoded in Python decode and re-encode unchanged on both sides. The C++
compiler (csrc/contract_compiler.cpp) gives the programs of its plain-Python reference
(tests/compiler_reference.py)."""
import random

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


def _matmul_program(perm_a=(0, 1), final_slot=2, final_perm=(0, 1), out_shape=(3, 5), b_slot=1, shape_c=(3, 5)):
    """``a [3, 4] @ b [4, 5]`` as a hand-written program, with one field replaced."""
    return fmt.encode(fmt.Program(2, 0, out_shape, (
        fmt.Contract(0, b_slot, 2, perm_a, (0, 1), False, False, 1, 3, 4, 5, shape_c),
        fmt.Final(final_slot, final_perm, ()))))


def _sliced_matmul_program(out_shape=(3, 5), select=(0, 1, 0), sum_dims=None):
    """``a [3, 4] @ b [4, 5]`` sliced over the contracted mode (SELECTs, then the GEMM)."""
    pre = (fmt.Select(*select), fmt.Select(1, 0, 0))
    if sum_dims is not None:
        pre = (fmt.Sum(0, sum_dims),) + pre
    return fmt.encode(fmt.Program(2, 1, out_shape, pre + (
        fmt.Contract(0, 1, 2, (0,), (0,), False, False, 1, 3, 1, 5, (3, 5)), fmt.Final(2, (0, 1), ()))))


@pytest.mark.parametrize("case, match", [
    ("final_perm_out_of_range", "FINAL permutation"),
    ("final_perm_negative", "FINAL permutation"),
    ("contract_perm_out_of_range", "CONTRACT permutations"),
    ("contract_perm_negative", "CONTRACT permutations"),
    ("contract_with_itself", "with itself"),
    ("gemm_size_mismatch", "does not match its GEMM"),
    ("released_slot", "holds no tensor"),
    ("out_shape_mismatch", "does not fill the output block"),
    ("select_negative_dim", "SELECT dim"),
    ("select_intermediate", "SELECT applies to operands only"),
    ("select_after_sum", "after a SUM"),
    ("sum_dim_out_of_range", "SUM dims"),
    ("slice_index_negative", "slice_table entry"),
    ("slice_index_too_large", "slice_table entry"),
])
@pytest.mark.parametrize("entry", ["forward", "cached", "backward", "accumulate"])
def test_executor_refuses_malformed_programs_before_running(case, match, entry):
    # The ops are public (torch.ops.torch_gradops): a malformed program must raise, never index
    # out of range. Each case crashed (segfault, heap corruption), returned garbage or gave a
    # misleading error before the executor checked programs against their operands.
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    table = []
    if case == "final_perm_out_of_range":
        prog = _matmul_program(final_perm=(0, 2 ** 40))
    elif case == "final_perm_negative":
        prog = _matmul_program(final_perm=(-2, -1))
    elif case == "contract_perm_out_of_range":
        prog = _matmul_program(perm_a=(0, 10 ** 8))
    elif case == "contract_perm_negative":
        prog = _matmul_program(perm_a=(-2, -1))
    elif case == "contract_with_itself":
        b = torch.randn(3, 4)
        prog = fmt.encode(fmt.Program(2, 0, (3, 3), (
            fmt.Contract(0, 1, 2, (0, 1), (1, 0), False, False, 1, 3, 4, 3, (3, 3)),
            fmt.Contract(2, 2, 3, (0, 1), (0, 1), False, False, 1, 3, 3, 3, (3, 3)), fmt.Final(3, (0, 1), ()))))
    elif case == "gemm_size_mismatch":
        prog = _matmul_program(shape_c=(3, 6))
    elif case == "released_slot":
        prog = _matmul_program(final_slot=0)
    elif case == "out_shape_mismatch":
        prog = _matmul_program(out_shape=(2, 3, 5))
    elif case == "select_negative_dim":
        prog, table = _sliced_matmul_program(select=(0, -1, 0)), [0]
    elif case == "select_intermediate":
        prog = fmt.encode(fmt.Program(2, 1, (5,), (
            fmt.Contract(0, 1, 2, (0, 1), (0, 1), False, False, 1, 3, 4, 5, (3, 5)), fmt.Select(2, 0, 0),
            fmt.Final(2, (0,), ()))))
        table = [0]
    elif case == "select_after_sum":
        prog, table = _sliced_matmul_program(sum_dims=(0,)), [0]
    elif case == "sum_dim_out_of_range":
        prog = fmt.encode(fmt.Program(2, 0, (), (fmt.Sum(0, (100000,)), fmt.Sum(1, (0, 1)),
                                                   fmt.Contract(0, 1, 2, (0,), (), False, False, 1, 1, 4, 1, ()),
                                                   fmt.Final(2, (), ()))))
    elif case == "slice_index_negative":
        prog, table = _sliced_matmul_program(), [-1]
    else:
        prog, table = _sliced_matmul_program(), [4]
    ops = torch.ops.torch_gradops
    out_shape = fmt.decode(prog).out_shape
    calls = {
        "forward": lambda: ops.contract_program([a, b], prog, table),
        "cached": lambda: ops.contract_program_cached([a, b], prog, table, [1, 1]),
        "backward": lambda: ops.contract_program_backward([a, b], prog, table, torch.ones(out_shape), [1, 1], []),
        "accumulate": lambda: ops.contract_program_accumulate([a, b], prog, table, torch.ones(out_shape),
                                                             [torch.zeros_like(a), torch.zeros_like(b)]),
    }
    with pytest.raises(RuntimeError, match=match):
        calls[entry]()


def test_executor_program_checks_accept_every_planned_program():
    # the checks refuse nothing the planner makes: sliced, chunked, hyperedges, output blocks
    for expr, shapes, kw in [("ab,bc->ac", [(3, 4), (4, 5)], dict(slicing=["b"])),
                             ("ab,bc->ac", [(3, 4), (4, 5)], dict(slicing=["a", "c"])),
                             ("abc,bcd,dea->e", [(2, 3, 4), (3, 4, 5), (5, 6, 2)], dict(slicing={"min_slices": 8})),
                             ("ii,ij,jk->ik", [(3, 3), (3, 4), (4, 5)], dict(slicing=["j"]))]:
        ops = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
        p = tn.plan(expr, *ops, **kw)
        assert p.num_slices > 1
        out = p.contract(*ops)
        torch.testing.assert_close(out, torch.einsum(expr, *ops))
        g = torch.autograd.grad(out.square().sum(), ops)
        ref = torch.autograd.grad(torch.einsum(expr, *ops).square().sum(), ops)
        for x, y in zip(g, ref):
            torch.testing.assert_close(x, y)


def _random_networks(n, seed):
    """``n`` random networks (mode ids, sizes, an opt_einsum path, a slicing): hyperedges, batch
    and output modes, extents of 1 (and a few of 0), up to 7 operands."""
    import opt_einsum
    rng = random.Random(seed)
    for _ in range(n):
        n_modes = rng.randint(3, 12)
        extents = [0, 1, 2, 3, 4, 5, 8] if rng.random() < 0.05 else [1, 2, 3, 4, 5, 8]
        sizes = {m: rng.choice(extents) for m in range(n_modes)}
        inputs = [rng.sample(range(n_modes), rng.randint(1, min(5, n_modes))) for _ in range(rng.randint(2, 7))]
        used = sorted({m for t in inputs for m in t})
        output = rng.sample(used, rng.randint(0, min(3, len(used))))
        path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
        if len(inputs) > 1 and not path:
            continue
        sliced = rng.sample(used, rng.randint(0, min(2, len(used))))
        yield inputs, output, sizes, path, sliced


def _compile_both(inputs, output, sizes, path, sliced, itemsize, is_complex, checkpoints=(), quick_macs=1 << 14):
    from torch_gradops.tensornet import compiler
    from compiler_reference import compile_program as reference
    ref_prog, ref_steps = reference(inputs, output, dict(sizes), path, sliced, itemsize, is_complex, checkpoints,
                                    quick_macs)
    prog, steps = compiler.compile_program(inputs, output, sizes, path, sliced, itemsize, is_complex, checkpoints,
                                           quick_macs=quick_macs)
    return (fmt.encode(ref_prog), [tuple(x) for x in ref_steps]), (tuple(prog), [tuple(x) for x in steps])


@pytest.mark.parametrize("quick_macs", [0, 1 << 14, 1 << 60], ids=["searched", "default", "all_quick"])
def test_compiler_matches_the_python_reference(quick_macs):
    """The C++ compiler gives the program and step table of tests/compiler_reference.py (the
    layout rules in Python) on random networks (sliced and not, real and complex, with
    checkpoints), a lattice at several slicings and a circuit."""
    from torch_gradops.testing import lattice_network
    import opt_einsum
    cases = []
    for k, (inputs, output, sizes, path, sliced) in enumerate(_random_networks(150, seed=quick_macs % 7)):
        cases.append((inputs, output, sizes, path, sliced if k % 2 else (), (4, 8, 16)[k % 3], k % 3 == 2,
                      tuple(range(1, len(path), 2)) if k % 5 == 0 else ()))
    inputs, output, arrays = lattice_network(4, 4, 4, seed=1)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
    for sliced in ((), (inputs[0][0],), tuple(inputs[5][:2])):
        cases.append((inputs, output, sizes, path, sliced, 4, False, (3, 9)))
    inputs, output, arrays = circuit_amplitude_network(3, 3, 8, seed=2)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
    cases.append((inputs, output, sizes, path, (), 8, True, ()))
    differ = 0
    for case in cases:
        ref, got = _compile_both(*case, quick_macs=quick_macs)
        assert got == ref, case
        differ += ref != _compile_both(*case, quick_macs=0 if quick_macs else 1 << 60)[0]
    assert differ > len(cases) // 10  # the threshold changes programs: the comparison sees both rules


def test_compiled_layouts_do_not_depend_on_labels():
    """A layout is a pure function of its step: two networks that differ only in their mode
    labels compile to the same program (searched and quick layouts), and slicing a mode gives
    another program."""
    from torch_gradops.tensornet import compiler
    from torch_gradops.testing import lattice_network
    import opt_einsum
    inputs, output, arrays = lattice_network(3, 4, 3, seed=1)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))
    for quick_macs in (0, 1 << 14):
        prog = compiler.compile_program(inputs, output, sizes, path, (), 8, False, quick_macs=quick_macs)
        shift = {m: 1000 - 7 * m for m in sizes}  # other labels, another order of their values
        relabelled = compiler.compile_program([[shift[m] for m in t] for t in inputs], [shift[m] for m in output],
                                              {shift[m]: e for m, e in sizes.items()}, path, (), 8, False,
                                              quick_macs=quick_macs)
        assert relabelled == prog
        named = {m: f"mode{m}" for m in sizes}  # labels that are not ints
        assert compiler.compile_program([[named[m] for m in t] for t in inputs], [named[m] for m in output],
                                        {named[m]: e for m, e in sizes.items()}, path, (), 8, False,
                                        quick_macs=quick_macs) == prog
        sliced = compiler.compile_program(inputs, output, sizes, path, (inputs[0][0],), 8, False,
                                          quick_macs=quick_macs)
        assert sliced[0] != prog[0]


def test_compiler_refuses_malformed_paths():
    from torch_gradops.tensornet import compiler
    inputs, output, sizes = [[0, 1], [1, 2], [2, 3]], [0, 3], {0: 2, 1: 3, 2: 4, 3: 5}
    for path, match in (([(0, 1)], "leaves 2 tensors"), ([(0, 3), (0, 1)], "does not name two"),
                        ([(1, 1), (0, 1)], "does not name two"), ([(0, 1), (0, 1), (0, 1)], "does not name two")):
        with pytest.raises(ValueError, match=match):
            compiler.compile_program(inputs, output, sizes, path, ())
    program, steps = compiler.compile_program(inputs, output, sizes, [(0, 1), (0, 1)], ())
    assert len(steps) == 2 and fmt.decode(program).out_shape == (2, 5)


@pytest.mark.parametrize("quick_macs", [0, 1 << 40], ids=["full_search", "all_quick"])
def test_quick_layouts_are_valid_and_chosen_by_total_work(monkeypatch, quick_macs):
    """Steps whose multiply-adds over all slices are below compiler.QUICK_MACS get the quick
    layout instead of the search; with every step quick and with none, the programs contract to
    einsum's value and gradients (the quick layout only picks layouts the executor can run), and
    the threshold counts slices: the same small network sliced many times is searched in full."""
    from torch_gradops.tensornet import compiler
    monkeypatch.setattr(compiler, "QUICK_MACS", quick_macs)
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
    tn.clear_plan_cache()
    monkeypatch.setattr(compiler, "QUICK_MACS", 1 << 14)
    sizes = {m: a.shape[d] for t, a in zip(inputs, arrays) for d, m in enumerate(t)}
    import opt_einsum
    path = opt_einsum.paths.greedy([frozenset(t) for t in inputs], frozenset(output), dict(sizes))

    def program(sliced, quick_macs=None):
        return compiler.compile_program(inputs, output, sizes, path, sliced, 16, True, quick_macs=quick_macs)[0]
    # a tiny network: every step quick (the default threshold gives the all-quick program, which
    # differs from the searched one)
    assert program(()) == program((), 1 << 60) != program((), 0)
    big = tuple(m for m in sizes if sizes[m] > 1)[:14]  # slicing multiplies each step's runs
    assert program(big) == program(big, 0) != program(big, 1 << 60)
