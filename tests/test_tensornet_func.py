"""tensornet.contract under torch.func: vmap (a vmapped operand becomes one more mode), jvp,
jacrev/jacfwd, hessian and grad, each against the same transform of torch.einsum; sliced plans
included (the batched network keeps the sliced modes, so slice groups still apply)."""
import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from torch_gradops import tensornet as tn

F64, C128 = torch.float64, torch.complex128

CASES = [  # (expr, shapes, slicing)
    ("ab,bc,cd->ad", [(3, 4), (4, 5), (5, 2)], None),
    ("ab,bc,cd->ad", [(3, 4), (4, 5), (5, 2)], ["b"]),          # summed sliced mode
    ("ab,bc,cd->ad", [(3, 4), (4, 5), (5, 2)], ["a", "c"]),     # a sliced output mode: blocks
    ("abc,bcd,ce->ade", [(2, 3, 2), (3, 2, 2), (2, 3)], ["c"]),  # hyperedge, sliced
    ("ii,ij->j", [(3, 3), (3, 2)], None),                        # diagonal preprocessing
]


def _ops(shapes, dtype=F64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return [torch.complex(torch.randn(s, generator=gen, dtype=F64), torch.randn(s, generator=gen, dtype=F64))
                for s in shapes]
    return [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]


def _fns(expr, slicing):
    ours = lambda *ops: tn.contract(expr, *ops, slicing=slicing)  # noqa: E731
    ref = lambda *ops: torch.einsum(expr, *ops)  # noqa: E731
    return ours, ref


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [F64, C128])
def test_vmap_over_each_operand_and_all(case, dtype):
    expr, shapes, slicing = CASES[case]
    ours, ref = _fns(expr, slicing)
    ops = _ops(shapes, dtype)
    batch = 4
    for k in list(range(len(ops))) + ["all"]:
        which = range(len(ops)) if k == "all" else [k]
        bops = [torch.stack([o * (1 + j) + j for j in range(batch)], dim=min(1, o.dim())) if i in which else o
                for i, o in enumerate(ops)]
        in_dims = tuple(min(1, o.dim()) if i in which else None for i, o in enumerate(ops))
        got = vmap(ours, in_dims=in_dims)(*bops)
        want = vmap(ref, in_dims=in_dims)(*bops)
        torch.testing.assert_close(got, want)


def test_nested_vmap_and_out_dims():
    expr, shapes, slicing = CASES[1]
    ours, ref = _fns(expr, slicing)
    a, b, c = _ops(shapes)
    a2 = torch.randn(2, 3, *a.shape, dtype=F64)
    c2 = torch.randn(3, *c.shape, dtype=F64)
    inner = lambda f: vmap(f, in_dims=(0, None, 0), out_dims=1)  # noqa: E731
    got = vmap(inner(ours), in_dims=(0, None, None))(a2, b, c2)
    want = vmap(inner(ref), in_dims=(0, None, None))(a2, b, c2)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_jacobians_hessian_grad_jvp(case):
    expr, shapes, slicing = CASES[case]
    ours, ref = _fns(expr, slicing)
    ops = _ops(shapes)
    argnums = tuple(range(len(ops)))
    for transform in (jacrev, jacfwd):
        got = transform(ours, argnums=argnums)(*ops)
        want = transform(ref, argnums=argnums)(*ops)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    loss = lambda f: (lambda *o: (f(*o).sin() ** 2).sum())  # noqa: E731
    for g, w in zip(hessian(loss(ours), argnums=0)(*ops), hessian(loss(ref), argnums=0)(*ops)):
        torch.testing.assert_close(g, w)
    got = grad(loss(ours), argnums=argnums)(*ops)
    want = grad(loss(ref), argnums=argnums)(*ops)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    tangents = _ops(shapes, seed=1)
    torch.testing.assert_close(jvp(ours, tuple(ops), tuple(tangents))[1], jvp(ref, tuple(ops), tuple(tangents))[1])


def test_vmap_under_memory_limit_keeps_the_slices():
    """A memory-limited sliced plan under vmap: the batched network has the same sliced modes
    (it may hold more memory per slice; the slice ids must stay valid)."""
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(s, generator=gen, dtype=F64) for s in ((6, 8), (8, 8), (8, 6)))
    plan = tn.plan("ab,bc,cd->ad", a, b, c, memory_limit=160)
    assert plan.num_slices > 1
    batched = vmap(lambda x: plan.contract(x, b, c))(torch.stack([a, 2 * a, a.sin()]))
    want = torch.stack([torch.einsum("ab,bc,cd->ad", x, b, c) for x in (a, 2 * a, a.sin())])
    torch.testing.assert_close(batched, want)
    part = vmap(lambda x: plan.contract(x, b, c, slices=range(1)))(torch.stack([a, 2 * a]))
    torch.testing.assert_close(part, torch.stack([plan.contract(x, b, c, slices=range(1)) for x in (a, 2 * a)]))


def test_vmapped_plans_are_cached():
    a, b = _ops([(3, 4), (4, 5)])
    f = lambda x: tn.contract("ab,bc->ac", x, b)  # noqa: E731
    vmap(f)(torch.stack([a, a]))
    before = tn.plan_cache_info()["path_searches"]
    for _ in range(3):
        vmap(f)(torch.stack([a, a + 1]))
    assert tn.plan_cache_info()["path_searches"] == before


@pytest.mark.parametrize("case", [1, 2, 3])
def test_gradcheck_with_forward_ad(case):
    """Forward-mode checks in gradcheck and forward-over-reverse in gradgradcheck. (gradcheck's
    check_batched_grad uses torch's legacy vmap, which bypasses autograd.Function vmap rules:
    torch.func's transforms are what the tests above check.)"""
    expr, shapes, slicing = CASES[case]
    ours, _ = _fns(expr, slicing)
    ops = [o.requires_grad_() for o in _ops(shapes)]
    assert torch.autograd.gradcheck(ours, ops, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(ours, ops, check_fwd_over_rev=True)


def test_compiled_transform_raises_instead_of_dropping_the_gradient():
    """torch.compile over torch.func.grad calls the op itself (Dynamo does not trace our
    Function inside transforms): its Autograd kernel must raise, never return a gradient that
    silently misses the contraction."""
    a, b, c = _ops([(3, 4), (4, 5), (5, 2)])
    f = lambda x: tn.contract("ab,bc,cd->ad", x, b, c, slicing=["b"]).sin().sum()  # noqa: E731
    f(a)  # plan eagerly
    torch._dynamo.reset()
    compiled = torch.compile(grad(f), fullgraph=True, backend="aot_eager")
    try:
        got = compiled(a)
    except Exception as exc:  # noqa: BLE001  (Dynamo wraps the op's error)
        assert "not implemented" in str(exc)
    else:
        torch.testing.assert_close(got, grad(lambda x: torch.einsum("ab,bc,cd->ad", x, b, c).sin().sum())(a))
