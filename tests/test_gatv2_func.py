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
from test_gat_func import (TRANSFORMS, assert_compiled_transform_matches, assert_nested_forward_mode_matches,
                           assert_reverse_over_forward_matches)
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


def test_jvp_in_chunks_matches_one_pass(monkeypatch):
    """JVP chunks of 1000 edges on a graph of 20000: the chunked passes add up."""
    import torch_gradops.gatv2 as gatv2_module
    monkeypatch.setattr(gatv2_module, "chunk_size", lambda num_edges, heads, channels: 1000)
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


@pytest.mark.parametrize("edge_mode", ["none", "project"])
def test_reverse_over_forward_matches_reference(edge_mode):
    """A tangent differentiated by plain autograd: the jvp took alpha as exp(score - lse) with
    the forward's saved lse, a constant to autograd, so the normaliser's derivative was missing
    (gradients off by up to 26 on small graphs); and under torch.func.jvp the reverse index was
    not built, so the backward of the primal failed."""
    ei, nd, graph, inputs = setup(edge_mode, seed=45)
    inputs = [t for t in inputs if t is not None]
    assert_reverse_over_forward_matches(ours_fn(graph, False), ref_fn(ei, nd, False), inputs)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_torch_compile_fullgraph_traces_every_transform(transform):
    """torch.compile(fullgraph=True) over each transform, against the reference (x_dst; PyTorch's
    own ops fail jacrev(jacfwd) of the edge projection under compile, so it is not tried)."""
    ei, nd, graph, inputs = setup(seed=17)
    graph.reverse_index()
    assert_compiled_transform_matches(transform, inputs, lambda ra: (ours_fn(graph, ra), ref_fn(ei, nd, ra)))


# ---------------------------------------------------------------------------- higher order in chunks
def test_node_ranges_cover_every_node_and_edge_in_order():
    from torch_gradops.gatv2 import node_ranges  # (the chunking of the higher-order maps)
    counts = torch.tensor([0, 3, 0, 0, 40, 1, 2, 0, 5, 0])  # empty nodes, a hub, trailing empties
    ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    for step in (1, 2, 4, 7, 51, 100):
        ranges = node_ranges(ptr, step)
        assert ranges[0][0] == 0 and ranges[0][2] == 0 and ranges[-1][1] == 10 and ranges[-1][3] == 51
        for (n0, n1, e0, e1), nxt in zip(ranges, ranges[1:] + ((10, None, 51, None),)):
            assert n0 < n1 or (n0 == n1 == 0 and len(ranges) == 1)
            assert (n1, e1) == (nxt[0], nxt[2]) and (e0, e1) == (int(ptr[n0]), int(ptr[n1]))
            assert e1 - e0 <= max(step, int(counts[n0:n1].max())) + step  # whole nodes, about step
        if step >= 51:
            assert ranges == ((0, 10, 0, 51),)
    assert node_ranges(torch.zeros(1, dtype=torch.long), 4) == ((0, 0, 0, 0),)
    assert node_ranges(torch.zeros(4, dtype=torch.int32), 4) == ((0, 3, 0, 0),)


@pytest.mark.parametrize("edge_mode", ["none", "project", "direct"])
def test_higher_order_in_many_chunks_matches_reference(monkeypatch, edge_mode):
    """The recomputing higher-order path with chunks of about 3 edges (by destination and by
    source, a hub making a larger one): gradgradcheck (reverse and forward over reverse,
    batched) and hessian-vector products against the reference."""
    import torch_gradops.gatv2 as gatv2_module
    monkeypatch.setattr(gatv2_module, "chunk_size", lambda num_edges, heads, channels: 3)
    seen = []
    ranges = gatv2_module.node_ranges
    monkeypatch.setattr(gatv2_module, "node_ranges", lambda ptr, step: seen.append(ranges(ptr, step)) or seen[-1])
    ns, nd = 6, 5  # a hub destination (0) and a hub source (5), an isolated destination (3)
    ei = torch.tensor([[0, 1, 2, 3, 4, 5, 5, 5, 5, 1, 2, 0, 5, 3],
                       [0, 0, 0, 0, 0, 0, 1, 2, 4, 4, 1, 2, 4, 1]])
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = [None if t is None else t.detach().requires_grad_()
              for t in make_inputs(ns, nd, ei.size(1), 2, 2, torch.float64, "cpu", seed=6, edge_mode=edge_mode)]
    f = ours_fn(graph, True)
    present = [t for t in inputs if t is not None]
    g = lambda *p: f(*(p + (None,) * (5 - len(p))))  # noqa: E731
    assert torch.autograd.gradgradcheck(g, present, check_fwd_over_rev=True, check_rev_over_rev=True,
                                        check_batched_grad=True)
    assert len(seen) >= 2 and all(len(r) >= 3 for r in seen), [len(r) for r in seen]

    ref = ref_fn(ei, nd, True)
    loss = lambda fn: lambda *p: fn(*p)[0].tanh().sum() + fn(*p)[1].square().sum()  # noqa: E731
    for argnum in range(len(present)):
        v = torch.randn_like(present[argnum])
        hvp = lambda fn: jvp(lambda t: grad(loss(fn), argnums=argnum)(  # noqa: E731
            *[t if i == argnum else p.detach() for i, p in enumerate(present)]), (present[argnum].detach(),), (v,))[1]
        torch.testing.assert_close(hvp(ours_fn(graph, True)), hvp(ref))


def test_higher_order_memory_is_o_of_edges_times_heads():
    """Double backward, torch.func.grad and the JVP hold no E x H x C tensor: each peaks far
    below one (E x H x C x 4 bytes = 205 MB here; an E x H tensor is 0.8 MB, a node feature
    tensor 1 MB: what they hold is O(E x H + N x H x C)), with edge features projected in the
    maps; the reference peaks above it (so the measure works)."""
    from test_gat_func import gradient_penalty, peak_tensor_bytes
    g = torch.Generator().manual_seed(0)
    n, E, H, C, K = 500, 100_000, 2, 256, 4
    ei = torch.randint(0, n, (2, E), generator=g)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    graph.reverse_index()
    primals = (torch.randn(n, H, C, generator=g), torch.randn(n, H, C, generator=g), torch.randn(H, C, generator=g) / 16,
               torch.randn(E, K, generator=g), torch.randn(K, H, C, generator=g) / 2)
    tangents = tuple(torch.randn_like(t) for t in primals)
    ehc_bytes = E * H * C * 4
    ours, ref = ours_fn(graph, False), ref_fn(ei, n, False)

    def func_grad(fn):
        return lambda: grad(lambda *p: fn(*p).square().sum(), argnums=(0, 1, 2, 4))(*primals)

    for name, peak in [("double backward", peak_tensor_bytes(gradient_penalty(ours, primals, 3))),
                       ("torch.func.grad", peak_tensor_bytes(func_grad(ours))),
                       ("jvp", peak_tensor_bytes(lambda: jvp(ours, primals, tangents)))]:
        assert peak < ehc_bytes / 4, (name, peak / 2**20)
    assert peak_tensor_bytes(gradient_penalty(ref, primals, 3)) > ehc_bytes
    assert peak_tensor_bytes(func_grad(ref)) > ehc_bytes
