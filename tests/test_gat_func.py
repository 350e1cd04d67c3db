"""The GAT op and GATConv under torch.func and higher-order autograd.

Forward-mode AD on every path, vmap (folded into heads; dropout randomness), jacfwd / jacrev /
hessian, model ensembling, against the plain-PyTorch reference (gat_reference) and PyG's
GATConv; the fused SpMM/SDDMM primitives the double backward and JVP are built from; their
O(E x H) memory; torch.compile over the transforms.
"""
import copy
import itertools

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import (functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state,
                        vmap)

import torch_gradops as tg
from torch_gradops.gat import edge_aggregate, edge_dot
from conftest import runs_at_thread_counts
from gat_reference import gat_reference
from test_gat_attention import GRAPHS, make_graph, make_inputs

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATConv as PyGGATConv  # noqa: E402

from torch_gradops.nn import GATConv  # noqa: E402

ops = torch.ops.torch_gradops
SLOPE = 0.2


def graph_and_inputs(kind="duplicates_selfloops", heads=2, channels=2, seed=0, edge_logits=True,
                     dtype=torch.float64):
    ei, ns, nd = make_graph(kind, seed=seed)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = [None if t is None else t.detach()
              for t in make_inputs(ns, nd, ei.size(1), heads, channels, dtype, "cpu", seed=seed + 1,
                                   edge_logits=edge_logits)]
    return ei, nd, graph, inputs


def dropout_mask(graph, heads, p=0.4, seed=5):
    """A fixed keep mask [E, H] in the original edge order, and its scale."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(graph.num_edges, heads, generator=g) >= p, 1 / (1 - p)


def ours_fn(graph, return_attention, keep=None, scale=1.0):
    """gat_attention, or with a replayed dropout mask the public Function itself (so that the
    mask is an input and the forward can run under vmap, as gradcheck's batched checks do)."""
    if keep is None:
        def fn(x, a_src, a_dst, el=None):
            return tg.gat_attention(x, a_src, a_dst, graph, SLOPE, el, return_attention=return_attention)
        return fn
    rev = graph.reverse_index()
    mask = graph.edge_order(keep)

    def fn(x, a_src, a_dst, el=None):
        out, _, alpha = tg.GATAttentionFunction.apply(
            x, a_src, a_dst, None if el is None else graph.edge_order(el), graph.indptr, graph.indices,
            rev.indptr, rev.edge, rev.dst, mask, SLOPE, scale, return_attention)
        return (out, graph.original_order(alpha)) if return_attention else out
    return fn


def ref_fn(ei, nd, return_attention, keep=None, scale=1.0):
    def fn(x, a_src, a_dst, el=None):
        out, alpha = gat_reference(x, a_src, a_dst, ei, nd, SLOPE, el, keep, scale)
        return (out, alpha) if return_attention else out
    return fn


def assert_trees_close(a, b, **kw):
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **kw)


# ---------------------------------------------------------------------------- fused primitives
def ref_aggregate(weight, values, ei, num_out, into):
    src, dst = ei[0].long(), ei[1].long()
    gather, scatter = (src, dst) if into == "dst" else (dst, src)
    msg = weight.unsqueeze(-1) * values.index_select(0, gather)
    return torch.zeros((num_out,) + tuple(values.shape[1:]), dtype=values.dtype).index_add(0, scatter, msg)


def ref_dot(a, b, ei):
    return (a.index_select(0, ei[1].long()) * b.index_select(0, ei[0].long())).sum(-1)


@pytest.mark.parametrize("kind", GRAPHS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_primitives_match_reference(kind, index_dtype):
    ei, ns, nd = make_graph(kind, index_dtype)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    g = torch.Generator().manual_seed(1)
    H, C = 3, 5
    w = torch.randn(ei.size(1), H, generator=g, dtype=torch.float64)
    v_src = torch.randn(ns, H, C, generator=g, dtype=torch.float64)
    v_dst = torch.randn(nd, H, C, generator=g, dtype=torch.float64)
    torch.testing.assert_close(edge_aggregate(w, v_src, graph, "dst"), ref_aggregate(w, v_src, ei, nd, "dst"))
    torch.testing.assert_close(edge_aggregate(w, v_dst, graph, "src"), ref_aggregate(w, v_dst, ei, ns, "src"))
    torch.testing.assert_close(edge_dot(v_dst, v_src, graph), ref_dot(v_dst, v_src, ei))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_primitives_low_precision(dtype, tol):
    ei, ns, nd = make_graph("skewed")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    g = torch.Generator().manual_seed(2)
    w = torch.rand(ei.size(1), 4, generator=g, dtype=torch.float64)
    v_src = torch.randn(ns, 4, 33, generator=g, dtype=torch.float64)
    v_dst = torch.randn(nd, 4, 33, generator=g, dtype=torch.float64)
    lo = lambda t: t.to(dtype)  # noqa: E731
    hi = lambda t: lo(t).double()  # noqa: E731  (the reference sees the rounded inputs)
    for got, ref in [
        (edge_aggregate(lo(w), lo(v_src), graph, "dst"), ref_aggregate(hi(w), hi(v_src), ei, nd, "dst")),
        (edge_aggregate(lo(w), lo(v_dst), graph, "src"), ref_aggregate(hi(w), hi(v_dst), ei, ns, "src")),
        (edge_dot(lo(v_dst), lo(v_src), graph), ref_dot(hi(v_dst), hi(v_src), ei)),
    ]:
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("kind", ["random", "zero_in_degree", "no_edges"])
def test_primitives_gradcheck_all_modes(kind):
    ei, ns, nd = make_graph(kind, seed=3)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    g = torch.Generator().manual_seed(4)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    w, v_src, v_dst = mk(ei.size(1), 2), mk(ns, 2, 2), mk(nd, 2, 2)
    modes = dict(check_forward_ad=True, check_backward_ad=True, check_batched_grad=True,
                 check_batched_forward_grad=True)
    cases = [(lambda w, v: edge_aggregate(w, v, graph, "dst"), (w, v_src)),
             (lambda w, v: edge_aggregate(w, v, graph, "src"), (w, v_dst)),
             (lambda a, b: edge_dot(a, b, graph), (v_dst, v_src))]
    for fn, inputs in cases:
        assert torch.autograd.gradcheck(fn, inputs, **modes)
        assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, check_rev_over_rev=True,
                                            check_batched_grad=True)


def test_primitive_ops_opcheck():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    rev = graph.reverse_index()
    w = torch.randn(ei.size(1), 2)
    for args in [(w, torch.randn(ns, 2, 3), graph.indptr, graph.indices, None),
                 (w, torch.randn(nd, 2, 3), rev.indptr, rev.dst, rev.edge),
                 (w.half(), torch.randn(ns, 2, 1).half(), graph.indptr, graph.indices, None)]:
        torch.library.opcheck(ops.gat_spmm.default, args)
    for args in [(torch.randn(nd, 2, 3), torch.randn(ns, 2, 3), graph.indptr, graph.indices),
                 (torch.randn(nd, 1, 40), torch.randn(ns, 1, 40), graph.indptr.int(), graph.indices.int())]:
        torch.library.opcheck(ops.gat_sddmm.default, args)


def test_primitive_errors_name_the_argument():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    E = ei.size(1)
    w, v = torch.randn(E, 2), torch.randn(ns, 2, 3)
    ptr, idx = graph.indptr, graph.indices
    bad = idx.clone()
    bad[3] = ns + 2
    short = ptr.clone()
    short[-1] -= 1
    bad_edge = torch.arange(E, dtype=idx.dtype)
    bad_edge[3] = E + 2
    cases = [
        (lambda: ops.gat_spmm(w[:, :1], v, ptr, idx, None), "weight must have 2 heads"),
        (lambda: ops.gat_spmm(w.double(), v, ptr, idx, None), "weight .* must have the dtype of values"),
        (lambda: ops.gat_spmm(w, v, ptr, idx[:-1], None), "neighbors must have one entry per edge"),
        (lambda: ops.gat_spmm(w, v, ptr, bad, None), "neighbors: id .* out of range"),
        (lambda: ops.gat_spmm(w, v, ptr, idx, bad_edge), "edge_ids: id .* out of range"),
        (lambda: ops.gat_spmm(w, v, short, idx, None), "indptr must start at 0 and end at E"),
        (lambda: ops.gat_spmm(w, v.long(), ptr, idx, None), "values must be a floating-point tensor"),
        (lambda: ops.gat_spmm(w, v, torch.full((1,), E, dtype=ptr.dtype), idx, None), "indptr has no rows"),
        (lambda: ops.gat_sddmm(torch.randn(nd, 2, 3), torch.randn(ns, 2, 4), ptr, idx), "b must have a's heads"),
        (lambda: ops.gat_sddmm(torch.randn(nd + 1, 2, 3), v, ptr, idx), r"indptr must have a.size\(0\) \+ 1"),
        (lambda: ops.gat_sddmm(torch.randn(nd, 2, 3), v, ptr, bad), "indices: id .* out of range"),
        (lambda: ops.gat_sddmm(torch.randn(nd, 2, 3), v, ptr.int(), idx), "indices and indptr must share one dtype"),
        # edges but no source rows: refused on the host (on CUDA the kernels' range asserts would
        # abort the context; on the CPU they raise, as a range error)
        (lambda: ops.gat_spmm(w, v[:0], ptr, idx, None), "values has no rows for them"),
        (lambda: ops.gat_sddmm(torch.randn(nd, 2, 3), v[:0], ptr, idx), "b has no rows for them"),
    ]
    for call, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            call()
    with pytest.raises(ValueError, match="into must be"):
        edge_aggregate(w, v, graph, "both")
    with pytest.raises(ValueError, match=r"weight must have shape \[E="):
        edge_aggregate(w[:-1], v, graph)
    with pytest.raises(ValueError, match="values must have shape"):
        edge_aggregate(w, v[:-1], graph)
    with pytest.raises(ValueError, match="b must have shape"):
        edge_dot(torch.randn(nd, 2, 3), v[:-1], graph)
    with pytest.raises(TypeError, match="graph must be"):
        edge_dot(torch.randn(nd, 2, 3), v, ei)


# ---------------------------------------------------------------------------- every AD path
FLAG_COMBOS = list(itertools.product([False, True], repeat=3))  # return_attention, edge_logits, dropout


def _check_all_modes(fn, inputs, batched=True, batched_second_order=False):
    inputs = tuple(t.requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_backward_ad=True,
                                    check_batched_grad=batched, check_batched_forward_grad=batched)
    assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, check_rev_over_rev=True,
                                        check_batched_grad=batched_second_order)


@pytest.mark.parametrize("return_attention,edge_logits,dropout", FLAG_COMBOS)
def test_gradcheck_every_path(return_attention, edge_logits, dropout):
    _, _, graph, inputs = graph_and_inputs(edge_logits=edge_logits)
    keep, scale = dropout_mask(graph, 2) if dropout else (None, 1.0)
    fn = ours_fn(graph, return_attention, keep, scale)
    # batched second order (the slowest check) on the path with everything on
    _check_all_modes(fn, [t for t in inputs if t is not None],
                     batched_second_order=return_attention and edge_logits and dropout)


@pytest.mark.parametrize("kind", [k for k in GRAPHS if k != "duplicates_selfloops"])
def test_gradcheck_every_graph_kind(kind):
    # (the batched checks run in test_gradcheck_every_path; here one head keeps it quick)
    _, _, graph, inputs = graph_and_inputs(kind, heads=1, channels=2, seed=7)
    _check_all_modes(ours_fn(graph, False), inputs, batched=False)


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("edge_logits", [False, True])
@pytest.mark.parametrize("dropout", [False, True])
def test_jvp_every_tangent_subset(return_attention, edge_logits, dropout):
    """Dual tensors on any subset of the inputs (the others plain: None tangents inside), and
    torch.func.jvp over the same subset, against the reference's jvp with zero tangents."""
    ei, nd, graph, inputs = graph_and_inputs(edge_logits=edge_logits, heads=3, channels=4, seed=11)
    keep, scale = dropout_mask(graph, 3) if dropout else (None, 1.0)
    ours, ref = ours_fn(graph, return_attention, keep, scale), ref_fn(ei, nd, return_attention, keep, scale)
    present = [i for i, t in enumerate(inputs) if t is not None]
    g = torch.Generator().manual_seed(12)
    tangents = [None if t is None else torch.randn(t.shape, generator=g, dtype=t.dtype) for t in inputs]
    for r in range(1, len(present) + 1):
        for subset in itertools.combinations(present, r):
            ref_tangents = [None if t is None else (tangents[i] if i in subset else torch.zeros_like(t))
                            for i, t in enumerate(inputs)]
            expect = jvp(lambda *p: ref(*p), tuple(t for t in inputs if t is not None),
                         tuple(t for t in ref_tangents if t is not None))[1]
            with forward_ad.dual_level():
                duals = [forward_ad.make_dual(t, tangents[i]) if i in subset else t for i, t in enumerate(inputs)]
                res = ours(*duals)
                got = torch.utils._pytree.tree_map(lambda o: forward_ad.unpack_dual(o).tangent, res)
            assert_trees_close(got, expect, msg=f"dual tensors on {subset}")

            def partial(*sub):
                args = list(inputs)
                for i, t in zip(subset, sub):
                    args[i] = t
                return ours(*args)
            got = jvp(partial, tuple(inputs[i] for i in subset), tuple(tangents[i] for i in subset))[1]
            assert_trees_close(got, expect, msg=f"torch.func.jvp on {subset}")


def test_jvp_with_sampled_dropout_matches_reference():
    """gat_attention's own dropout (seeded), forward mode with and without return_attention."""
    ei, nd, graph, inputs = graph_and_inputs(heads=3, channels=4, seed=13)
    g = torch.Generator().manual_seed(14)
    tangents = tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) for t in inputs)

    def ours(*p, return_attention=True):
        torch.manual_seed(15)
        return tg.gat_attention(*p[:3], graph, SLOPE, p[3], dropout=0.4, training=True,
                                return_attention=return_attention)
    keep = ours(*inputs)[1] != 0
    assert not keep.all() and keep.any()
    ref = ref_fn(ei, nd, True, keep, 1 / 0.6)
    expect = jvp(ref, tuple(inputs), tangents)[1]
    assert_trees_close(jvp(ours, tuple(inputs), tangents)[1], expect)
    got = jvp(lambda *p: ours(*p, return_attention=False), tuple(inputs), tangents)[1]
    torch.testing.assert_close(got, expect[0])


def test_double_backward_is_bitwise_deterministic():
    g = torch.Generator().manual_seed(0)
    n, e = 300, 6000  # hub-heavy: summation order matters
    ei = torch.stack([torch.randint(0, 15, (e,), generator=g), torch.randint(0, n, (e,), generator=g)])
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    x, a_src, a_dst, el = make_inputs(n, n, e, 4, 16, torch.float32, "cpu")
    t_x = torch.randn(x.shape, generator=g)

    def run():
        out = tg.gat_attention(x, a_src, a_dst, graph, SLOPE, el)
        gx = torch.autograd.grad(out.square().sum(), x, create_graph=True)[0]
        second = torch.autograd.grad(gx.square().sum(), (x, a_src, a_dst, el))
        tangent = jvp(lambda x: tg.gat_attention(x, a_src.detach(), a_dst.detach(), graph, SLOPE, el.detach()),
                      (x.detach(),), (t_x,))[1]
        return list(second) + [tangent]

    first = run()
    for result in runs_at_thread_counts(run, (1, 2, torch.get_num_threads())):
        for a, b in zip(first, result):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_double_backward_and_jvp_low_precision(dtype, tol):
    ei, nd, graph, inputs = graph_and_inputs("skewed", heads=2, channels=8, seed=17)
    low = [t.to(dtype) for t in inputs]

    def second_order(fn, ps):
        ps = [t.clone().requires_grad_() for t in ps]
        out = fn(*ps)
        gx = torch.autograd.grad(out.sin().sum(), ps[0], create_graph=True)[0]
        return torch.autograd.grad(gx.square().sum(), ps)

    ours, ref = ours_fn(graph, False), ref_fn(ei, nd, False)
    for a, b in zip(second_order(ours, low), second_order(ref, [t.double() for t in low])):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=tol * (1 + b.abs().max().item()), rtol=tol)
    tangents = tuple(torch.ones_like(t) for t in low)
    got = jvp(ours, tuple(low), tangents)[1]
    expect = jvp(ref, tuple(t.double() for t in low), tuple(t.double() for t in tangents))[1]
    torch.testing.assert_close(got.double(), expect, atol=tol * (1 + expect.abs().max().item()), rtol=tol)


# ---------------------------------------------------------------------------- vmap
@pytest.mark.parametrize("in_dims", [(0, 0, 0, 0), (0, None, None, None), (None, 1, None, None),
                                     (None, None, 0, None), (None, None, None, 1), (2, None, 0, None)])
@pytest.mark.parametrize("return_attention", [False, True])
def test_vmap_matches_a_loop(in_dims, return_attention):
    ei, nd, graph, inputs = graph_and_inputs(heads=2, channels=3, seed=19)
    B = 3
    g = torch.Generator().manual_seed(20)
    args = [t if d is None else torch.randn((B,) + tuple(t.shape), generator=g, dtype=t.dtype).movedim(0, d)
            for t, d in zip(inputs, in_dims)]
    got = vmap(ours_fn(graph, return_attention), in_dims=in_dims)(*args)
    ref = ref_fn(ei, nd, return_attention)
    items = [ref(*[a if d is None else a.select(d, b) for a, d in zip(args, in_dims)]) for b in range(B)]
    expect = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *items)
    assert_trees_close(got, expect)


def test_vmap_without_edge_logits_and_nested():
    ei, nd, graph, (x, a_src, a_dst, _) = graph_and_inputs(edge_logits=False, seed=21)
    A = torch.randn(2, 3, *a_src.shape, dtype=a_src.dtype)
    got = vmap(vmap(lambda a: tg.gat_attention(x, a, a_dst, graph, SLOPE)))(A)
    for i, j in itertools.product(range(2), range(3)):
        torch.testing.assert_close(got[i, j], gat_reference(x, A[i, j], a_dst, ei, nd, SLOPE)[0])


def test_vmap_dropout_follows_randomness_flag():
    ei, nd, graph, (x, a_src, a_dst, el) = graph_and_inputs(heads=2, channels=3, seed=23)
    B, p = 4, 0.5
    A = a_src.expand(B, *a_src.shape)  # the same input B times: only the masks can differ

    def f(a):
        return tg.gat_attention(x, a, a_dst, graph, SLOPE, el, dropout=p, training=True, return_attention=True)

    with pytest.raises(RuntimeError, match="randomness"):
        vmap(f)(A)
    for randomness in ("same", "different"):
        out, alpha = vmap(f, randomness=randomness)(A)
        keeps = alpha != 0
        if randomness == "same":
            assert all(torch.equal(keeps[0], k) for k in keeps[1:])
        else:
            assert not all(torch.equal(keeps[0], k) for k in keeps[1:])
        for b in range(B):  # each item is the reference with its own mask
            ref, ref_alpha = gat_reference(x, A[b], a_dst, ei, nd, SLOPE, el, keeps[b], 1 / (1 - p))
            torch.testing.assert_close(out[b], ref)
            torch.testing.assert_close(alpha[b], ref_alpha)


# ---------------------------------------------------------------------------- transforms, op
@pytest.mark.parametrize("argnum", [0, 1, 2, 3])
def test_jacobians_and_hessians_match_reference(argnum):
    ei, nd, graph, inputs = graph_and_inputs(heads=2, channels=2, seed=25)
    ours, ref = ours_fn(graph, True), ref_fn(ei, nd, True)
    assert_trees_close(jacfwd(ours, argnums=argnum)(*inputs), jacfwd(ref, argnums=argnum)(*inputs))
    assert_trees_close(jacrev(ours, argnums=argnum)(*inputs), jacrev(ref, argnums=argnum)(*inputs))

    def loss(fn):
        return lambda *p: fn(*p)[0].tanh().sum() + fn(*p)[1].square().sum()
    torch.testing.assert_close(hessian(loss(ours), argnums=argnum)(*inputs),
                               hessian(loss(ref), argnums=argnum)(*inputs))
    # reverse over forward, and a Hessian-vector product as jvp of grad
    torch.testing.assert_close(jacrev(jacfwd(loss(ours), argnums=argnum), argnums=argnum)(*inputs),
                               jacrev(jacfwd(loss(ref), argnums=argnum), argnums=argnum)(*inputs))
    v = torch.ones_like(inputs[argnum])

    def hvp(fn):
        g = grad(loss(fn), argnums=argnum)
        return jvp(lambda t: g(*[t if i == argnum else p for i, p in enumerate(inputs)]),
                   (inputs[argnum],), (v,))[1]
    torch.testing.assert_close(hvp(ours), hvp(ref))


# ---------------------------------------------------------------------------- memory
def peak_tensor_bytes(fn):
    """Peak live CPU tensor bytes while fn() runs, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def gradient_penalty(fn, primals, num_penalised):
    """A double backward to measure: the squared norm of the gradients of ``fn(*primals)``'s
    squared norm for the first ``num_penalised`` inputs, differentiated for all of them."""
    def run():
        ps = [t.clone().requires_grad_() for t in primals]
        first = torch.autograd.grad(fn(*ps).square().sum(), ps[:num_penalised], create_graph=True)
        sum(g.square().sum() for g in first).backward()
    return run


def test_double_backward_and_jvp_memory_is_o_of_edges_times_heads():
    """No E x H x C tensor: both peak far below one (E x H x C x 4 bytes = 102 MB here, while
    an E x H tensor is 0.4 MB); the composite reference peaks above it (so the measure works)."""
    torch.manual_seed(0)
    n, E, H, C = 1000, 50_000, 2, 256
    ei = torch.randint(0, n, (2, E))
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    graph.reverse_index()
    primals = (torch.randn(n, H, C), torch.randn(n, H), torch.randn(n, H), torch.randn(E, H))
    tangents = tuple(torch.randn_like(t) for t in primals)
    ehc_bytes = E * H * C * 4
    ours, ref = ours_fn(graph, False), ref_fn(ei, n, False)

    for name, peak in [("jvp", peak_tensor_bytes(lambda: jvp(ours, primals, tangents))),
                       ("double backward", peak_tensor_bytes(gradient_penalty(ours, primals, 1)))]:
        assert peak < ehc_bytes / 4, (name, peak)
    assert peak_tensor_bytes(lambda: jvp(ref, primals, tangents)) > ehc_bytes
    assert peak_tensor_bytes(gradient_penalty(ref, primals, 1)) > ehc_bytes


# ---------------------------------------------------------------------------- GATConv vs PyG
CONV_CONFIGS = {
    "edge_attr_selfloops": dict(channels=(4, 3), kw=dict(heads=2, edge_dim=2)),
    "bipartite_mean": dict(channels=((3, 5), 4), kw=dict(heads=2, add_self_loops=False, concat=False)),
    "residual": dict(channels=(4, 2), kw=dict(heads=3, residual=True)),
}


def conv_setup(name, seed=0):
    cfg = CONV_CONFIGS[name]
    torch.manual_seed(seed)
    theirs = PyGGATConv(*cfg["channels"], **cfg["kw"]).double()
    torch.manual_seed(seed)
    ours = GATConv(*cfg["channels"], **cfg["kw"]).double()
    for (n1, p1), (n2, p2) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    g = torch.Generator().manual_seed(seed + 1)
    in_src, in_dst = (cfg["channels"][0] if isinstance(cfg["channels"][0], tuple) else (cfg["channels"][0],) * 2)
    ns, nd, e = 7, (5 if name == "bipartite_mean" else 7), 18
    ei = torch.stack([torch.randint(0, ns, (e,), generator=g), torch.randint(0, nd, (e,), generator=g)])
    ei[:, :2] = torch.tensor([[0, 1], [0, 1]])  # self-loops to remove
    x_src = torch.randn(ns, in_src, generator=g, dtype=torch.float64)
    x = (x_src, torch.randn(nd, in_dst, generator=g, dtype=torch.float64)) if name == "bipartite_mean" else x_src
    edge_attr = torch.randn(e, 2, generator=g, dtype=torch.float64) if "edge_dim" in cfg["kw"] else None
    return theirs, ours, x, ei, edge_attr


def with_src(x, x_src):
    return (x_src, x[1]) if isinstance(x, tuple) else x_src


@pytest.mark.parametrize("name", list(CONV_CONFIGS))
def test_gatconv_transforms_match_pyg(name):
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

    # gradient and Hessian of a loss w.r.t. the parameters, through functional_call
    def param_loss(m):
        return lambda p: functional_call(m, p, (x, ei, ea)).tanh().sum()
    params = {k: v.detach() for k, v in ours.named_parameters()}
    assert_trees_close(grad(param_loss(ours))(params), grad(param_loss(theirs))(params))
    keys = ["att_src", "att_dst"]
    sub = {k: params[k] for k in keys}

    def sub_loss(m):
        return lambda s: param_loss(m)({**params, **s})
    assert_trees_close(hessian(sub_loss(ours))(sub), hessian(sub_loss(theirs))(sub))


@pytest.mark.parametrize("name", list(CONV_CONFIGS))
def test_gatconv_ensembling_matches_pyg(name):
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
    # and each item is the plain call of that model
    for i, (_, ours) in enumerate(pairs):
        torch.testing.assert_close(results[1][0][i], ours(x, ei, ea))


def test_gatconv_ensemble_without_grad_keeps_in_place_bias_add():
    """Inference ensembling (no autograd recording): GATConv adds its bias in place, which must
    work on the op's vmapped outputs."""
    _, _, x, ei, ea = conv_setup("edge_attr_selfloops")
    models = [conv_setup("edge_attr_selfloops", seed=s)[1] for s in range(2)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    with torch.no_grad():
        out = vmap(lambda p, b: functional_call(base, (p, b), (x, ei, ea)))(params, buffers)
        for i, m in enumerate(models):
            torch.testing.assert_close(out[i], m(x, ei, ea))


# ---------------------------------------------------------------------------- torch.compile
def test_torch_compile_over_grad_and_vmap_fullgraph():
    ei, nd, graph, inputs = graph_and_inputs(heads=2, channels=8, seed=27, dtype=torch.float32)
    graph.reverse_index()
    ours, ref = ours_fn(graph, False), ref_fn(ei, nd, False)

    def loss(fn):
        return lambda *p: fn(*p).tanh().sum()
    torch._dynamo.reset()
    got = torch.compile(grad(loss(ours), argnums=(0, 1, 2, 3)), fullgraph=True)(*inputs)
    assert_trees_close(got, grad(loss(ref), argnums=(0, 1, 2, 3))(*inputs), atol=1e-5, rtol=1e-4)
    A = torch.stack([inputs[1], 2 * inputs[1]])
    got = torch.compile(vmap(ours, in_dims=(None, 0, None, None)), fullgraph=True)(inputs[0], A, *inputs[2:])
    expect = torch.stack([ref(inputs[0], a, *inputs[2:]) for a in A])
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-4)


def _transform_cases(tangents, argnum=1):
    """Every torch.func combination a user may compile, as ``name -> (fn -> fn of the inputs)``,
    differentiating input ``argnum`` where one input is picked."""
    def only(fn, p):
        return lambda a: fn(*p[:argnum], a, *p[argnum + 1:])

    def dual(fn):
        def f(*p):
            with forward_ad.dual_level():
                out = fn(*[forward_ad.make_dual(a, t) for a, t in zip(p, tangents)])
                return [forward_ad.unpack_dual(o).tangent for o in torch.utils._pytree.tree_leaves(out)]
        return f

    def scalar(fn, p):
        return lambda a: sum(o.sin().sum() for o in torch.utils._pytree.tree_leaves(only(fn, p)(a)))

    def stacked(p):
        return torch.stack([p[argnum], 2 * p[argnum]])

    return {
        "jvp": lambda fn: lambda *p: jvp(fn, tuple(p), tangents)[1],
        "jvp_one_input": lambda fn: lambda *p: jvp(only(fn, p), (p[argnum],), (tangents[argnum],))[1],
        "dual_tensors": dual,
        "jacfwd": lambda fn: lambda *p: jacfwd(only(fn, p))(p[argnum]),
        "vmap_of_jvp": lambda fn: lambda *p: vmap(lambda t: jvp(only(fn, p), (p[argnum],), (t,))[1])(
            torch.stack([tangents[argnum], -tangents[argnum]])),
        "jvp_of_vmap": lambda fn: lambda *p: jvp(vmap(only(fn, p)), (stacked(p),),
                                                 (torch.stack([tangents[argnum]] * 2),))[1],
        "grad": lambda fn: lambda *p: grad(scalar(fn, p))(p[argnum]),
        "jacrev": lambda fn: lambda *p: jacrev(only(fn, p))(p[argnum]),
        "vmap_of_grad": lambda fn: lambda *p: vmap(grad(scalar(fn, p)))(stacked(p)),
        "hessian": lambda fn: lambda *p: hessian(scalar(fn, p))(p[argnum]),
        "jacrev_of_jacfwd": lambda fn: lambda *p: jacrev(jacfwd(scalar(fn, p)))(p[argnum]),
        "jacfwd_of_jacfwd": lambda fn: lambda *p: jacfwd(jacfwd(scalar(fn, p)))(p[argnum]),
    }


TRANSFORMS = list(_transform_cases(()).keys())


def assert_nested_forward_mode_matches(ours, ref, inputs, argnum, transforms):
    """jvp of jvp along random directions, and each of ``transforms`` (names in
    :func:`_transform_cases`), of ``ours`` equal those of ``ref`` w.r.t. input ``argnum``."""
    gen = torch.Generator().manual_seed(3)
    t, u = (torch.randn(inputs[argnum].shape, generator=gen, dtype=torch.float64) for _ in range(2))

    def jvp_jvp(fn):
        def only(a):
            return fn(*inputs[:argnum], a, *inputs[argnum + 1:])
        return jvp(lambda a: jvp(only, (a,), (t,))[1], (inputs[argnum],), (u,))[1]
    assert_trees_close(jvp_jvp(ours), jvp_jvp(ref))
    cases = _transform_cases(tuple(torch.ones_like(x) for x in inputs), argnum)
    for name in transforms:
        assert_trees_close(cases[name](ours)(*inputs), cases[name](ref)(*inputs))


def assert_compiled_transform_matches(transform, inputs, fns_of):
    """torch.compile(fullgraph=True) of ``transform`` over ours equals it over the reference,
    with and without attention (``fns_of(return_attention) -> (ours, ref)``)."""
    gen = torch.Generator().manual_seed(4)
    tangents = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in inputs)
    make = _transform_cases(tangents)[transform]
    for return_attention in (False, True):
        if return_attention and transform == "jacrev" and torch.__version__ < "2.14":
            # torch < 2.14's jacrev of several outputs reads its basis offsets from a tensor
            # (_chunked_standard_basis_for_), which Dynamo cannot specialise
            continue
        ours, ref = fns_of(return_attention)
        torch._dynamo.reset()
        got = torch.compile(make(ours), fullgraph=True, backend="aot_eager")(*inputs)
        assert_trees_close(got, make(ref)(*inputs))


def assert_reverse_over_forward_matches(ours, ref, inputs):
    """Plain autograd over a forward-mode tangent (dual tensors and ``torch.func.jvp``, eager and
    compiled): the gradients of a loss of the output and its tangent equal the reference's."""
    gen = torch.Generator().manual_seed(8)
    tangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in inputs]

    def loss_dual(fn):
        def loss(*xs):
            with forward_ad.dual_level():
                out, tan = forward_ad.unpack_dual(fn(*[forward_ad.make_dual(x, t) for x, t in zip(xs, tangents)]))
                return (out * tan).sum() + tan.square().sum()
        return loss

    def loss_jvp(fn):
        def loss(*xs):
            out, tan = jvp(fn, tuple(xs), tuple(tangents))
            return (out * tan).sum() + tan.square().sum()
        return loss

    def grads(loss):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        return torch.autograd.grad(loss(*leaves), leaves, allow_unused=True, materialize_grads=True)

    for name, make in (("dual tensors", loss_dual), ("torch.func.jvp", loss_jvp)):
        want = grads(make(ref))
        assert_trees_close(grads(make(ours)), want, msg=f"eager, {name}")
        if name == "torch.func.jvp":  # (Dynamo does not trace forward_ad's dual tensors fullgraph)
            torch._dynamo.reset()
            assert_trees_close(grads(torch.compile(make(ours), fullgraph=True, backend="aot_eager")), want,
                               msg=f"compiled, {name}")


def test_reverse_over_forward_matches_reference():
    """A tangent differentiated by plain autograd: under torch.compile the fused tangent's ops
    had no autograd (the gradients came out zero); now such a compiled forward mode, with grad
    mode on, runs as plain PyTorch ops."""
    ei, nd, graph, inputs = graph_and_inputs(heads=2, channels=3, seed=43)
    assert_reverse_over_forward_matches(ours_fn(graph, False), ref_fn(ei, nd, False), inputs)


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("argnum", [0, 1, 2, 3])
def test_nested_forward_mode_matches_reference(argnum, return_attention):
    """jvp of jvp and jacfwd of jacfwd: torch.func drops the enclosing levels' tangents inside a
    custom Function's jvp (the second-order terms came out zero); with two forward levels the op
    runs as plain PyTorch ops, exact at every order."""
    ei, nd, graph, inputs = graph_and_inputs(heads=2, channels=3, seed=41)
    ours, ref = ours_fn(graph, return_attention), ref_fn(ei, nd, return_attention)
    assert_nested_forward_mode_matches(ours, ref, inputs, argnum, ["jacfwd_of_jacfwd"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_torch_compile_fullgraph_traces_every_transform(transform):
    """Under torch.compile(fullgraph=True) every transform traces with no graph break and equals
    the same transform of the reference: fused kernels with no transform, vmap and forward mode
    (the wrapper attaches the fused JVP's tangent), plain PyTorch ops under reverse-mode
    transforms and nested forward mode (torch_gradops._transforms)."""
    ei, nd, graph, inputs = graph_and_inputs(heads=2, channels=3, seed=29)
    graph.reverse_index()
    assert_compiled_transform_matches(transform, inputs, lambda ra: (ours_fn(graph, ra), ref_fn(ei, nd, ra)))


def test_graph_caches_built_inside_a_transform_do_not_escape():
    """A fresh graph's lazily built index tensors (the reverse index), first built inside
    jacrev(jacfwd(...)), must still work in later calls outside that transform."""
    ei, nd, _, inputs = graph_and_inputs("random", heads=2, channels=2, seed=31)
    ref = ref_fn(ei, nd, False)
    for kind in ("fresh graph", "second call"):
        graph = tg.BipartiteCSC.from_edge_index(ei, inputs[0].size(0), nd)
        fn = ours_fn(graph, False)
        loss = lambda f: (lambda *p: f(*p).sin().sum())  # noqa: E731
        for argnum in (1, 0):  # the first call builds the cache inside the transforms
            torch.testing.assert_close(jacrev(jacfwd(loss(fn), argnums=argnum), argnums=argnum)(*inputs),
                                       jacrev(jacfwd(loss(ref), argnums=argnum), argnums=argnum)(*inputs))
        x = inputs[0].clone().requires_grad_()
        fn(x, *inputs[1:]).sum().backward()
        assert x.grad is not None
    # The inverse permutation, first built by edge_order inside hessian (differentiated edge
    # logits, returned attention): a later jacrev(jacfwd) on the graph raised "escaped?".
    graph = tg.BipartiteCSC.from_edge_index(ei, inputs[0].size(0), nd)
    assert graph.perm is not None
    fn, ref = ours_fn(graph, True), ref_fn(ei, nd, True)
    loss = lambda f: (lambda x, el: (lambda o, a: o.sin().sum() + a.pow(3).sum())(  # noqa: E731
        *f(x, inputs[1], inputs[2], el)))
    x, el = inputs[0], inputs[3]
    assert_trees_close(hessian(loss(fn), argnums=(0, 1))(x, el), hessian(loss(ref), argnums=(0, 1))(x, el))
    assert_trees_close(jacrev(jacfwd(loss(fn), argnums=(0, 1)), argnums=(0, 1))(x, el),
                       jacrev(jacfwd(loss(ref), argnums=(0, 1)), argnums=(0, 1))(x, el))
    # A graph of batched indices (built inside vmap, unvalidated) builds its caches under the
    # transforms: torch.func is left on where any of its own tensors is a wrapper (indices only
    # here; checking indptr alone raised "Cannot access storage of BatchedTensorImpl")
    indptr = torch.tensor([0, 2, 3, 5, 6])
    batch = torch.tensor([[0, 1, 2, 3, 4, 0], [4, 3, 2, 1, 0, 1]])
    x, a_src, a_dst = (torch.randn(*s, dtype=torch.float64) for s in ((5, 2, 3), (5, 2), (4, 2)))

    def grad_x(indices, validate):
        g = tg.BipartiteCSC(indptr, indices, 5, validate=validate)
        return grad(lambda x: tg.gat_attention(x, a_src, a_dst, g, SLOPE).sum())(x)
    got = vmap(lambda i: grad_x(i, False))(batch)
    for b in range(2):
        torch.testing.assert_close(got[b], grad_x(batch[b], True), rtol=0, atol=0)
