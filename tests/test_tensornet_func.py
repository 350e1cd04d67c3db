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


COMPILED_TRANSFORMS = {
    "grad": lambda f, rest: grad(lambda x: f(x, *rest).sin().sum()),
    "vmap": lambda f, rest: vmap(lambda x: f(x, *rest), in_dims=1),
    "jvp": lambda f, rest: lambda x: jvp(lambda y: f(y, *rest), (x,), (torch.cos(x),))[1],
    "dual_tensors": lambda f, rest: lambda x: _dual_tangent(lambda y: f(y, *rest), x),
    "jacfwd": lambda f, rest: jacfwd(lambda x: f(x, *rest)),
    "jacrev": lambda f, rest: jacrev(lambda x: f(x, *rest)),
    "hessian": lambda f, rest: hessian(lambda x: f(x, *rest).sin().sum()),
    "vmap_of_grad": lambda f, rest: vmap(grad(lambda x: f(x, *rest).sin().sum()), in_dims=1),
    "jacfwd_of_jacfwd": lambda f, rest: jacfwd(jacfwd(lambda x: f(x, *rest).sin().sum())),
}


def _dual_tangent(fn, x):
    from torch.autograd import forward_ad
    with forward_ad.dual_level():
        return forward_ad.unpack_dual(fn(forward_ad.make_dual(x, torch.cos(x)))).tangent


@pytest.mark.parametrize("transform", list(COMPILED_TRANSFORMS))
@pytest.mark.parametrize("case", [0, 1, 3])
def test_torch_compile_fullgraph_traces_every_transform(transform, case):
    """torch.compile(fullgraph=True) over each torch.func transform of contract, sliced plans
    included, equals the same transform of torch.einsum: the executor with no transform, a
    summed tangent of executor calls in forward mode, einsum steps along the plan's path
    under vmap and reverse-mode transforms (torch_gradops._transforms)."""
    expr, shapes, slicing = CASES[case]
    ours, ref = _fns(expr, slicing)
    ops = _ops(shapes)
    ours(*ops)  # plan eagerly
    x = ops[0] if transform not in ("vmap", "vmap_of_grad") else torch.stack([ops[0], 2 * ops[0]], 1)
    torch._dynamo.reset()
    got = torch.compile(COMPILED_TRANSFORMS[transform](ours, ops[1:]), fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, COMPILED_TRANSFORMS[transform](ref, ops[1:])(x))


@pytest.mark.parametrize("memory_limit", [None, 16])
def test_reverse_over_forward_eager_and_compiled(memory_limit):
    """Plain autograd over a torch.func.jvp tangent: compiled, the tangent came from the
    executor op traced without its autograd ("derivative for torch_gradops::contract_program
    is not implemented"); with grad mode on such a compiled forward mode runs as einsum steps."""
    gen = torch.Generator().manual_seed(9)
    a, b, c, t = (torch.randn(s, generator=gen, dtype=F64) for s in ((3, 4), (4, 5), (5, 3), (3, 4)))

    def loss_of(f):
        def loss(x):
            out, tan = jvp(f, (x,), (t,))
            return (out * tan).sum() + tan.square().sum()
        return loss

    ours = loss_of(lambda x: tn.contract("ij,jk,ki->i", x, b, c, memory_limit=memory_limit))
    ref = loss_of(lambda x: torch.einsum("ij,jk,ki->i", x, b, c))
    x = a.clone().requires_grad_(True)
    want = torch.autograd.grad(ref(x), x)[0]
    torch.testing.assert_close(torch.autograd.grad(ours(x), x)[0], want)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.autograd.grad(torch.compile(ours, fullgraph=True)(x), x)[0], want)
    torch._dynamo.reset()


def test_compile_after_another_compiled_contraction():
    """A sliced contraction not planned yet, compiled (default, not fullgraph) after another
    compiled contraction in the process: Dynamo's recompile of the shared frames made the
    slice group's bounds symbolic ints, and looking the group up in the table cache raised
    "InternalTorchDynamoError: ... SymNodeVariable() is not a constant"."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(s, generator=gen, dtype=F64) for s in ((3, 4), (4, 5), (5, 3)))
    batch = torch.randn(2, 3, 4, generator=gen, dtype=F64)
    got = torch.compile(vmap(lambda x: tn.contract("ij,jk->ik", x, b)))(batch)
    torch.testing.assert_close(got, torch.einsum("nij,jk->nik", batch, b))
    tn.clear_plan_cache()
    got = torch.compile(grad(lambda x: tn.contract("ij,jk,ki->", x, b, c, memory_limit=16)))(a)
    torch.testing.assert_close(got, grad(lambda x: torch.einsum("ij,jk,ki->", x, b, c))(a))
    torch._dynamo.reset()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_nested_forward_mode_matches_einsum(case):
    """jacfwd of jacfwd and jvp of jvp: a custom Function's jvp loses the enclosing forward
    levels' tangents under torch.func (the Hessian of x.x came out 0); with two forward levels
    contract runs as einsum steps along its plan."""
    expr, shapes, slicing = CASES[case]
    ours, ref = _fns(expr, slicing)
    ops = _ops(shapes, seed=5)
    for fn_of in (lambda f: jacfwd(jacfwd(lambda x: f(x, *ops[1:]).sin().sum())),
                  lambda f: lambda x: jvp(lambda y: jvp(lambda z: f(z, *ops[1:]), (y,), (y.cos(),))[1],
                                          (x,), (x.sin(),))[1]):
        torch.testing.assert_close(fn_of(ours)(ops[0]), fn_of(ref)(ops[0]))
    x = _ops([(3, 4)], seed=6)[0]
    sq = lambda y: tn.contract("ab,ab->", y, y)  # noqa: E731
    torch.testing.assert_close(jacfwd(jacfwd(sq))(x).reshape(12, 12), 2 * torch.eye(12, dtype=F64))


def test_nested_forward_mode_partial_slice_group_raises():
    a, b = _ops([(3, 4), (4, 5)])
    f = lambda x: tn.contract("ab,bc->ac", x, b, slicing=["b"], slices=[0, 1]).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="partial slice group"):
        jacfwd(jacfwd(f))(a)


