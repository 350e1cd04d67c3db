"""The GATv2 op and GATv2Conv under torch.func and higher-order autograd.

vmap (folded into heads, per item where raw edge features are vmapped; dropout randomness),
forward-mode AD on every path and tangent subset (the chunked JVP), jacfwd / jacrev / hessian,
batched gradchecks, model ensembling, against the plain-PyTorch reference (gatv2_reference) and
PyG's GATv2Conv with shared weights; torch.compile over the transforms.
"""
import copy
import itertools

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import (functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state,
                        vmap)

import torch_gradops as tg
from gatv2_reference import gatv2_reference
from test_gat_func import TRANSFORMS, assert_compiled_transform_matches, assert_nested_forward_mode_matches
from test_gatv2_attention import make_graph, make_inputs

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATv2Conv as PyGGATv2Conv  # noqa: E402

from torch_gradops.nn import GATv2Conv  # noqa: E402

SLOPE = 0.2


def setup(edge_mode="project", heads=2, channels=3, seed=0, kind="duplicates_selfloops"):
    ei, ns, nd = make_graph(kind, seed=seed)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = [None if t is None else t.detach()
              for t in make_inputs(ns, nd, ei.size(1), heads, channels, torch.float64, "cpu", seed=seed + 1,
                                   edge_mode=edge_mode)]
    return ei, nd, graph, inputs


def ours_fn(graph, return_attention, **kw):
    def f(x_src, x_dst, att, ea=None, w=None):
        return tg.gatv2_attention(x_src, x_dst, att, graph, SLOPE, edge_attr=ea, edge_weight=w,
                                  return_attention=return_attention, **kw)
    return f


def ref_fn(ei, nd, return_attention, **kw):
    def f(x_src, x_dst, att, ea=None, w=None):
        out, alpha = gatv2_reference(x_src, x_dst, att, ei, nd, SLOPE, ea, w, **kw)
        return (out, alpha) if return_attention else out
    return f


def assert_trees_close(a, b, **tol):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **tol)


# ---------------------------------------------------------------------------- vmap
VMAP_DIMS = [(0, 0, 0, None, 0), (0, None, None, None, None), (None, 1, None, None, None),
             (None, None, 0, None, None), (None, None, None, None, 2), (2, None, 0, None, None),
             (None, None, None, 0, None), (0, 0, 0, 1, 0)]


@pytest.mark.parametrize("in_dims", VMAP_DIMS, ids=str)
@pytest.mark.parametrize("return_attention", [False, True])
def test_vmap_matches_a_loop(in_dims, return_attention):
    """Folded into heads, or per item when the raw [E, K] edge features are vmapped."""
    ei, nd, graph, inputs = setup(seed=3)
    B = 3
    g = torch.Generator().manual_seed(4)
    args = [t if d is None else torch.randn((B,) + tuple(t.shape), generator=g, dtype=t.dtype).movedim(0, d)
            for t, d in zip(inputs, in_dims)]
    got = vmap(ours_fn(graph, return_attention), in_dims=in_dims)(*args)
    ref = ref_fn(ei, nd, return_attention)
    items = [ref(*[a if d is None else a.select(d, b) for a, d in zip(args, in_dims)]) for b in range(B)]
    expect = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *items)
    assert_trees_close(got, expect)


@pytest.mark.parametrize("edge_mode", ["none", "direct"])
def test_vmap_other_edge_modes_and_nested(edge_mode):
    ei, nd, graph, (xs, xd, att, ea, w) = setup(edge_mode, seed=5)
    A = torch.randn(2, 3, *att.shape, dtype=att.dtype)
    got = vmap(vmap(lambda a: tg.gatv2_attention(xs, xd, a, graph, SLOPE, edge_attr=ea, edge_weight=w)))(A)
    for i, j in itertools.product(range(2), range(3)):
        torch.testing.assert_close(got[i, j], gatv2_reference(xs, xd, A[i, j], ei, nd, SLOPE, ea, w)[0])
    if ea is not None:  # vmapped projected edge features fold into heads
        EA = torch.randn(2, *ea.shape, dtype=ea.dtype)
        got = vmap(lambda e: tg.gatv2_attention(xs, xd, att, graph, SLOPE, edge_attr=e))(EA)
        for i in range(2):
            torch.testing.assert_close(got[i], gatv2_reference(xs, xd, att, ei, nd, SLOPE, EA[i], None)[0])


def test_vmap_dropout_follows_randomness_flag():
    ei, nd, graph, (xs, xd, att, ea, w) = setup(seed=7)
    B, p = 4, 0.5
    A = att.expand(B, *att.shape)

    def f(a):
        return tg.gatv2_attention(xs, xd, a, graph, SLOPE, edge_attr=ea, edge_weight=w, dropout=p, training=True,
                                  return_attention=True)

    with pytest.raises(RuntimeError, match="randomness"):
        vmap(f)(A)
    for randomness in ("same", "different"):
        out, alpha = vmap(f, randomness=randomness)(A)
        keeps = alpha != 0
        same = all(torch.equal(keeps[0], k) for k in keeps[1:])
        assert same == (randomness == "same")
        for b in range(B):
            ref, ref_alpha = gatv2_reference(xs, xd, A[b], ei, nd, SLOPE, ea, w, keep_mask=keeps[b],
                                             keep_scale=1 / (1 - p))
            torch.testing.assert_close(out[b], ref)
            torch.testing.assert_close(alpha[b], ref_alpha)


# ---------------------------------------------------------------------------- forward mode
@pytest.mark.parametrize("edge_mode", ["none", "project", "direct"])
@pytest.mark.parametrize("return_attention", [False, True])
def test_jvp_every_tangent_subset(edge_mode, return_attention):
    """Forward mode with the default return_attention=False too, any subset of tangents."""
    ei, nd, graph, inputs = setup(edge_mode, seed=9)
    present = [i for i, t in enumerate(inputs) if t is not None]
    ours, ref = ours_fn(graph, return_attention), ref_fn(ei, nd, return_attention)
    g = torch.Generator().manual_seed(10)
    for r in range(1, len(present) + 1):
        for subset in itertools.combinations(present, r):
            def partial(fn):
                def f(*ts):
                    args = list(inputs)
                    for i, t in zip(subset, ts):
                        args[i] = t
                    return fn(*args)
                return f
            prim = tuple(inputs[i] for i in subset)
            tang = tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in prim)
            assert_trees_close(jvp(partial(ours), prim, tang), jvp(partial(ref), prim, tang))


def test_jvp_in_chunks_matches_one_pass():
    """A graph with more edges than one JVP chunk (4096 at C=1): the chunked passes add up."""
    g = torch.Generator().manual_seed(11)
    ns = nd = 300
    e = 20000
    ei = torch.stack([torch.randint(0, ns, (e,), generator=g), torch.randint(0, nd, (e,), generator=g)])
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    xs, xd = torch.randn(ns, 2, 1, generator=g, dtype=torch.float64), torch.randn(nd, 2, 1, generator=g,
                                                                                   dtype=torch.float64)
    att = torch.randn(2, 1, generator=g, dtype=torch.float64)
    ea, w = torch.randn(e, 3, generator=g, dtype=torch.float64), torch.randn(3, 2, 1, generator=g, dtype=torch.float64)
    prim = (xs, xd, att, ea, w)
    tang = tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in prim)
    assert_trees_close(jvp(ours_fn(graph, True), prim, tang), jvp(ref_fn(ei, nd, True), prim, tang))


@pytest.mark.parametrize("edge_mode", ["none", "project", "direct"])
def test_gradcheck_batched_and_forward_ad(edge_mode):
    ei, nd, graph, inputs = setup(edge_mode, heads=2, channels=2, seed=13)
    inputs = [t.requires_grad_() for t in inputs if t is not None]
    f = ours_fn(graph, True)
    assert torch.autograd.gradcheck(f, inputs, check_forward_ad=True, check_backward_ad=True,
                                    check_batched_grad=True, check_batched_forward_grad=True)
    assert torch.autograd.gradgradcheck(f, inputs, check_fwd_over_rev=True, check_rev_over_rev=True)


# ---------------------------------------------------------------------------- transforms, op
@pytest.mark.parametrize("argnum", [0, 1, 2, 3, 4])
def test_jacobians_and_hessians_match_reference(argnum):
    ei, nd, graph, inputs = setup(heads=2, channels=2, seed=15)
    ours, ref = ours_fn(graph, True), ref_fn(ei, nd, True)
    assert_trees_close(jacfwd(ours, argnums=argnum)(*inputs), jacfwd(ref, argnums=argnum)(*inputs))
    assert_trees_close(jacrev(ours, argnums=argnum)(*inputs), jacrev(ref, argnums=argnum)(*inputs))

    def loss(fn):
        return lambda *p: fn(*p)[0].tanh().sum() + fn(*p)[1].square().sum()
    torch.testing.assert_close(hessian(loss(ours), argnums=argnum)(*inputs),
                               hessian(loss(ref), argnums=argnum)(*inputs))
    v = torch.ones_like(inputs[argnum])

    def hvp(fn):
        g = grad(loss(fn), argnums=argnum)
        return jvp(lambda t: g(*[t if i == argnum else p for i, p in enumerate(inputs)]),
                   (inputs[argnum],), (v,))[1]
    torch.testing.assert_close(hvp(ours), hvp(ref))


# ---------------------------------------------------------------------------- GATv2Conv
CONV_CONFIGS = {
    "default": dict(channels=(4, 3), kw=dict(heads=2)),
    "edge_dim": dict(channels=(4, 3), kw=dict(heads=2, edge_dim=2)),
    "share_weights_concat_false": dict(channels=(4, 3), kw=dict(heads=2, share_weights=True, concat=False)),
    "bipartite_residual": dict(channels=((4, 5), 3), kw=dict(heads=2, residual=True, add_self_loops=False)),
}


def conv_setup(name, seed=0):
    cfg = CONV_CONFIGS[name]
    torch.manual_seed(seed)
    theirs = PyGGATv2Conv(*cfg["channels"], **cfg["kw"]).double()
    torch.manual_seed(seed)
    ours = GATv2Conv(*cfg["channels"], **cfg["kw"]).double()
    for (n1, p1), (n2, p2) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    g = torch.Generator().manual_seed(seed + 1)
    in_src, in_dst = cfg["channels"][0] if isinstance(cfg["channels"][0], tuple) else (cfg["channels"][0],) * 2
    bip = isinstance(cfg["channels"][0], tuple)
    ns, nd, e = 7, (5 if bip else 7), 18
    ei = torch.stack([torch.randint(0, ns, (e,), generator=g), torch.randint(0, nd, (e,), generator=g)])
    ei[:, :2] = torch.tensor([[0, 1], [0, 1]])  # self-loops to remove
    x_src = torch.randn(ns, in_src, generator=g, dtype=torch.float64)
    x = (x_src, torch.randn(nd, in_dst, generator=g, dtype=torch.float64)) if bip else x_src
    ea = torch.randn(e, 2, generator=g, dtype=torch.float64) if "edge_dim" in cfg["kw"] else None
    return theirs, ours, x, ei, ea


def with_src(x, x_src):
    return (x_src, x[1]) if isinstance(x, tuple) else x_src


@pytest.mark.parametrize("name", list(CONV_CONFIGS))
def test_gatv2conv_transforms_match_pyg(name):
    theirs, ours, x, ei, ea = conv_setup(name)
    x_src = x[0] if isinstance(x, tuple) else x

    def out(m):
        return lambda xs: m(with_src(x, xs), ei, ea)

    def loss(m):
        return lambda xs: out(m)(xs).tanh().sum()

    for transform in (jacfwd, jacrev):
        torch.testing.assert_close(transform(out(ours))(x_src), transform(out(theirs))(x_src))
    torch.testing.assert_close(hessian(loss(ours))(x_src), hessian(loss(theirs))(x_src))
    t = torch.ones_like(x_src)
    assert_trees_close(jvp(out(ours), (x_src,), (t,)), jvp(out(theirs), (x_src,), (t,)))
    with forward_ad.dual_level():
        got = forward_ad.unpack_dual(out(ours)(forward_ad.make_dual(x_src, t))).tangent
    torch.testing.assert_close(got, jvp(out(theirs), (x_src,), (t,))[1])

    def param_loss(m):
        return lambda p: functional_call(m, p, (x, ei, ea)).tanh().sum()
    params = {k: v.detach() for k, v in ours.named_parameters()}
    assert_trees_close(grad(param_loss(ours))(params), grad(param_loss(theirs))(params))
    sub = {"att": params["att"]}

    def sub_loss(m):
        return lambda s: param_loss(m)({**params, **s})
    assert_trees_close(hessian(sub_loss(ours))(sub), hessian(sub_loss(theirs))(sub))


@pytest.mark.parametrize("name", list(CONV_CONFIGS))
def test_gatv2conv_ensembling_matches_pyg(name):
    """stack_module_state + functional_call + vmap over several layers (outputs and per-model
    gradients), with weights shared with PyG's layers."""
    _, _, x, ei, ea = conv_setup(name)
    pairs = [conv_setup(name, seed=s)[:2] for s in range(3)]
    results = []
    for side in (0, 1):  # theirs, ours
        models = [p[side] for p in pairs]
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")

        def f(p, b):
            return functional_call(base, (p, b), (x, ei, ea))
        out = vmap(f)(params, buffers)
        grads = vmap(grad(lambda p, b: f(p, b).tanh().sum()))(params, buffers)
        results.append((out, grads))
    assert_trees_close(results[1], results[0])
    for i, (_, ours) in enumerate(pairs):
        torch.testing.assert_close(results[1][0][i], ours(x, ei, ea))
    with torch.no_grad():  # inference ensembling (the bias is added in place)
        params, buffers = stack_module_state([p[1] for p in pairs])
        base = copy.deepcopy(pairs[0][1]).to("meta")
        assert_trees_close(vmap(lambda p, b: functional_call(base, (p, b), (x, ei, ea)))(params, buffers),
                           results[1][0])


# ---------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("argnum", [1, 2, 3, 4])
def test_nested_forward_mode_matches_reference(argnum, return_attention):
    """jvp of jvp and jacfwd of jacfwd (a custom Function's jvp loses the enclosing levels'
    tangents under torch.func: the op then runs as plain PyTorch ops)."""
    ei, nd, graph, inputs = setup(seed=43)
    ours, ref = ours_fn(graph, return_attention), ref_fn(ei, nd, return_attention)
    assert_nested_forward_mode_matches(ours, ref, inputs, argnum, ["jacfwd_of_jacfwd", "jacrev_of_jacfwd"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_torch_compile_fullgraph_traces_every_transform(transform):
    """torch.compile(fullgraph=True) over each transform, against the reference (x_dst; PyTorch's
    own ops fail jacrev(jacfwd) of the edge projection under compile, so it is not tried)."""
    ei, nd, graph, inputs = setup(seed=17)
    graph.reverse_index()
    assert_compiled_transform_matches(transform, inputs, lambda ra: (ours_fn(graph, ra), ref_fn(ei, nd, ra)))
