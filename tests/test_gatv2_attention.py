"""The fused GATv2 op against the plain-PyTorch reference and PyG's GATv2Conv: values, gradients
of all five inputs, autograd, determinism, registration and errors."""
import math
import os

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import jvp

import torch_gradops as tg
from conftest import DEVICES, runs_at_thread_counts
from gatv2_reference import gatv2_reference
from torch_gradops.testing import powerlaw_edge_index

TOL = {  # (atol, rtol) against the float64 reference on the same (rounded) inputs
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 5e-2),
}
EDGE_MODES = ["none", "project", "direct"]


def make_graph(kind, index_dtype=torch.int64, device="cpu", seed=0):
    """Edge index [2, E] and node counts for the graph shapes the op must handle."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ns, nd, e = 23, 17, 90
        ei = torch.stack([torch.randint(0, ns, (e,), generator=g), torch.randint(0, nd, (e,), generator=g)])
    elif kind == "zero_in_degree":  # destinations 0..4 get no edge, sources 10.. are isolated
        ns, nd, e = 20, 15, 60
        ei = torch.stack([torch.randint(0, 10, (e,), generator=g), torch.randint(5, nd, (e,), generator=g)])
    elif kind == "duplicates_selfloops":
        ns = nd = 12
        base = torch.stack([torch.randint(0, ns, (30,), generator=g), torch.randint(0, nd, (30,), generator=g)])
        loops = torch.arange(ns).repeat(2, 1)
        ei = torch.cat([base, base[:, :10], loops], 1)
    elif kind == "sorted":  # already in CSC order: no permutation kept
        ns, nd, e = 16, 16, 70
        ei = torch.stack([torch.randint(0, ns, (e,), generator=g), torch.randint(0, nd, (e,), generator=g)])
        ei = ei[:, torch.argsort(ei[1], stable=True)]
    elif kind == "single_node":
        ns = nd = 1
        ei = torch.zeros(2, 1, dtype=torch.long)
    elif kind == "no_edges":
        ns, nd = 5, 4
        ei = torch.zeros(2, 0, dtype=torch.long)
    elif kind == "skewed":  # one hub destination with many edges, many light ones
        ns, nd = 50, 30
        hub = torch.stack([torch.arange(ns), torch.zeros(ns, dtype=torch.long)])
        rest = torch.stack([torch.randint(0, ns, (40,), generator=g), torch.randint(1, nd, (40,), generator=g)])
        ei = torch.cat([rest, hub], 1)
    else:
        raise ValueError(kind)
    return ei.to(index_dtype).to(device), ns, nd


GRAPHS = ["random", "zero_in_degree", "duplicates_selfloops", "sorted", "single_node", "no_edges", "skewed"]


def make_inputs(ns, nd, e, heads, channels, dtype, device, seed=1, edge_mode="project", edge_dim=3):
    """``[x_src, x_dst, att, edge_attr, edge_weight]`` (the last two None as the mode says).

    att and edge_weight are scaled like a glorot init so that scores are O(1)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    x_src, x_dst = rnd(ns, heads, channels), rnd(nd, heads, channels)
    att = rnd(heads, channels) / math.sqrt(channels)
    ea = w = None
    if edge_mode == "project":
        ea, w = rnd(e, edge_dim), rnd(edge_dim, heads, channels) / math.sqrt(edge_dim)
    elif edge_mode == "direct":
        ea = rnd(e, heads, channels)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype).requires_grad_()
    return [cast(t) for t in (x_src, x_dst, att, ea, w)]


def call(inputs, graph, **kw):
    x_src, x_dst, att, ea, w = inputs
    return tg.gatv2_attention(x_src, x_dst, att, graph, kw.pop("negative_slope", 0.2), edge_attr=ea,
                              edge_weight=w, **kw)


def reference(inputs, ei, nd, **kw):
    x_src, x_dst, att, ea, w = inputs
    return gatv2_reference(x_src, x_dst, att, ei, nd, 0.2, ea, w, **kw)


def grads_of(outputs, inputs, grad_outputs):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, retain_graph=True)


def assert_grads_close(ours, theirs, **tol):
    for a, b in zip(ours, theirs):
        b = torch.zeros_like(a) if b is None else b
        a = torch.zeros_like(b) if a is None else a
        torch.testing.assert_close(a.double(), b.double(), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edge_mode", EDGE_MODES)
@pytest.mark.parametrize("kind", GRAPHS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_reference_float64(kind, index_dtype, edge_mode, device):
    ei, ns, nd = make_graph(kind, index_dtype, device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 3, 5, torch.float64, device, edge_mode=edge_mode)
    out, alpha = call(inputs, graph, return_attention=True)
    ref, ref_alpha = reference(inputs, ei, nd)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=1e-10)
    if kind == "zero_in_degree":
        assert torch.equal(out[:5], torch.zeros_like(out[:5]))
    go = torch.randn_like(out)
    ga = torch.randn_like(alpha)
    ours = grads_of((out, alpha), inputs, (go, ga))
    theirs = grads_of((ref, ref_alpha), inputs, (go, ga))
    assert_grads_close(ours, theirs, atol=1e-11, rtol=1e-9)
    # without an attention gradient (the common case: D from <g, out> alone)
    out = call(inputs, graph)
    assert_grads_close(grads_of(out, inputs, go), grads_of(ref, inputs, go), atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("edge_mode", EDGE_MODES)
@pytest.mark.parametrize("channels", [16, 32, 64, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_widths_and_tiles(channels, dtype, edge_mode):
    """The CPU forward's unrolled head widths (16, 32, 64) and its generic loop (12), on a graph
    whose destinations have 1 to 50 incoming edges (one or many softmax tiles of 8 edges)."""
    ei, ns, nd = make_graph("skewed", torch.int64, "cpu")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 3, channels, dtype, "cpu", edge_mode=edge_mode)
    out, alpha = call(inputs, graph, return_attention=True)
    inputs64 = [None if t is None else t.detach().double() for t in inputs]
    ref, ref_alpha = reference(inputs64, ei, nd)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(alpha.double(), ref_alpha, **tol)


@pytest.mark.parametrize("edge_mode", EDGE_MODES)
@pytest.mark.parametrize("heads", [8, 11, 3])
def test_forward_scores_bitwise_equal_to_the_recomputed_ones(heads, edge_mode):
    """Every destination with one edge: alpha = exp(s - lse) = exp(s' - s) is exactly 1 only if the
    forward's scores s (scored from the rows, eight heads' sums at once) and the ones recomputed
    for the attention weights s' (scored one head at a time, as in the backward) agree bitwise."""
    n = 64
    ei = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(3)), torch.arange(n)])
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    inputs = make_inputs(n, n, n, heads, 32, torch.float32, "cpu", edge_mode=edge_mode)
    with torch.no_grad():
        inputs[2].mul_(8.0)  # scores of a few units: a last-bit difference moves exp(s' - s) off 1
    _, alpha = call(inputs, graph, return_attention=True)
    assert torch.equal(alpha, torch.ones_like(alpha))


@pytest.mark.parametrize("edge_dim", [1, 4, 16])
@pytest.mark.parametrize("bipartite", [False, True])
def test_matches_pyg_gatv2conv(edge_dim, bipartite):
    """The op between GATv2Conv's projections and bias gives PyG's outputs, attention weights and
    parameter gradients (PyG's own math: lin_l/lin_r/lin_edge, att, scatter softmax)."""
    from torch_geometric.nn import GATv2Conv

    torch.manual_seed(0)
    heads, channels, n_src, n_dst, e = 4, 8, 40, 30 if bipartite else 40, 300
    ei = torch.stack([torch.randint(0, n_src, (e,)), torch.randint(0, n_dst, (e,))])
    x_s = torch.randn(n_src, 12, dtype=torch.float64)
    x_d = torch.randn(n_dst, 12, dtype=torch.float64) if bipartite else x_s
    edge_attr = torch.randn(e, edge_dim, dtype=torch.float64)
    conv = GATv2Conv(12, channels, heads=heads, edge_dim=edge_dim, add_self_loops=False, bias=False).double()
    x_arg = (x_s, x_d) if bipartite else x_s
    ref, (ref_ei, ref_alpha) = conv(x_arg, ei, edge_attr, return_attention_weights=True)
    assert torch.equal(ref_ei, ei)

    graph = tg.BipartiteCSC.from_edge_index(ei, n_src, n_dst)
    w = conv.lin_edge.weight.t().reshape(edge_dim, heads, channels)
    out, alpha = tg.gatv2_attention(conv.lin_l(x_s).view(-1, heads, channels),
                                    conv.lin_r(x_d).view(-1, heads, channels), conv.att.view(heads, channels),
                                    graph, conv.negative_slope, edge_attr, w, return_attention=True)
    out = out.reshape(n_dst, heads * channels)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=1e-10)
    params = list(conv.parameters())
    go = torch.randn_like(out)
    ga = torch.randn_like(alpha)
    ours = torch.autograd.grad((out, alpha), params, (go, ga))
    theirs = torch.autograd.grad((ref, ref_alpha), params, (go, ga))
    assert_grads_close(ours, theirs, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,channels,edge_mode", [(1, 1, "project"), (2, 7, "direct"), (8, 32, "project"),
                                                      (4, 67, "none"), (1, 256, "project")])
def test_low_precision_against_float64(dtype, heads, channels, edge_mode, device):
    ei, ns, nd = make_graph("random", torch.int64, device, seed=heads * 1000 + channels)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), heads, channels, dtype, device, edge_mode=edge_mode, edge_dim=5)
    out, alpha = call(inputs, graph, return_attention=True)
    assert out.dtype == dtype and alpha.dtype == dtype
    inputs64 = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref, ref_alpha = reference(inputs64, ei, nd)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(alpha.double(), ref_alpha, atol=atol, rtol=rtol)
    go = torch.randn(out.shape, dtype=torch.float64, device=device)
    ours = grads_of(out, inputs, go.to(dtype))
    theirs = grads_of(ref, inputs64, go)
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype
        # sums over many edges (att, edge_weight) carry the output's rounding in absolute terms
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=atol * 4 * scale, rtol=rtol * 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,edge_mode", [("random", "project"), ("zero_in_degree", "direct"),
                                            ("duplicates_selfloops", "project"), ("no_edges", "project"),
                                            ("skewed", "none")])
def test_gradcheck_and_gradgradcheck(kind, edge_mode, device):
    ei, ns, nd = make_graph(kind, torch.int64, device, seed=3)
    if ei.size(1) > 60:  # keep the numerical Jacobians small
        ei = ei[:, :60]
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, device, seed=4, edge_mode=edge_mode,
                         edge_dim=2)
    present = [t for t in inputs if t is not None]

    def fn(*ts):
        it = iter(ts)
        full = [next(it) if t is not None else None for t in inputs]
        return call(full, graph, return_attention=True)

    assert torch.autograd.gradcheck(fn, present)
    # Forward AD and double backward run composite E x H x C code: the fast (random projection)
    # checks keep this test quick; test_gradgradcheck_full_jacobian checks full Jacobians once.
    assert torch.autograd.gradcheck(fn, present, check_forward_ad=True, check_backward_ad=False,
                                    fast_mode=True)
    # gradgradcheck asks for a bitwise repeatable double backward (on CUDA too: segment sums)
    assert torch.autograd.gradgradcheck(fn, present, fast_mode=True)


def test_gradgradcheck_full_jacobian():
    ei, ns, nd = make_graph("duplicates_selfloops", torch.int64, "cpu", seed=3)
    ei = ei[:, 25:]  # 25 edges, with duplicates and self-loops
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 2, torch.float64, "cpu", seed=4, edge_dim=2)

    def fn(*ts):
        return call(list(ts), graph, return_attention=True)

    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_with_dropout(device):
    ei, ns, nd = make_graph("random", torch.int64, device, seed=5)
    ei = ei[:, :50]
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, device, seed=6, edge_dim=2)

    def fn(*ts):
        torch.manual_seed(7)  # the same mask on every call
        return call(list(ts), graph, dropout=0.4, training=True, return_attention=True)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_backward_ad=False, fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=True)


@pytest.mark.parametrize("edge_mode, dropout", [("none", 0.0), ("project", 0.0), ("direct", 0.3)])
def test_higher_order_paths_sum_without_atomics(edge_mode, dropout):
    """Double backward, the torch.func reverse transforms, hessians and forward AD sum edge rows
    in a fixed order: no call that CUDA computes with atomic adds over repeated indices, so
    they are bitwise repeatable there without torch.use_deterministic_algorithms. The
    reference (index_add, index_select) is caught by the same check."""
    ei, ns, nd = make_graph("duplicates_selfloops", seed=2)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, "cpu", edge_mode=edge_mode, edge_dim=2)
    present = [t for t in inputs if t is not None]

    def loss(*ts, impl=call):
        it = iter(ts)
        full = [next(it) if t is not None else None for t in inputs]
        torch.manual_seed(3)
        if impl is call:
            out, alpha = call(full, graph, return_attention=True, dropout=dropout, training=dropout > 0)
        else:
            out, alpha = reference(full, ei, nd)
        return (out ** 2).sum() + (alpha ** 3).sum()

    def double_backward(impl=call):
        grads = torch.autograd.grad(loss(*present, impl=impl), present, create_graph=True)
        torch.autograd.grad(sum((g ** 2).sum() for g in grads), present)

    def tangents():
        return tuple(torch.randn_like(t) for t in present)

    argnums = tuple(range(len(present)))
    paths = {
        "double backward": double_backward,
        "jacrev(grad)": lambda: torch.func.jacrev(torch.func.grad(loss))(*present),
        "hessian": lambda: torch.func.hessian(loss, argnums=argnums)(*present),
        "jvp": lambda: jvp(loss, tuple(present), tangents()),
        "jvp of grad": lambda: jvp(torch.func.grad(loss, argnums=argnums), tuple(present), tangents()),
    }
    if dropout:  # a mask drawn under jacfwd's vmap would need randomness="same"
        del paths["jacrev(grad)"], paths["hessian"]
    for name, run in paths.items():
        assert tg.testing.atomic_sum_ops(run) == [], name
    assert tg.testing.atomic_sum_ops(lambda: double_backward(impl=reference)), "the check must see index_add"


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_matches_reference_with_the_ops_mask(device):
    ei, ns, nd = make_graph("random", torch.int64, device, seed=8)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 4, 6, torch.float64, device)
    p = 0.3
    out, alpha = call(inputs, graph, dropout=p, training=True, return_attention=True)
    _, undropped = reference(inputs, ei, nd)
    keep = alpha != 0
    assert 0 < keep.sum() < keep.numel()
    ref, ref_alpha = reference(inputs, ei, nd, keep_mask=keep, keep_scale=1 / (1 - p))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(alpha, ref_alpha)
    torch.testing.assert_close(alpha[keep], undropped[keep] / (1 - p))
    go, ga = torch.randn_like(out), torch.randn_like(alpha)
    assert_grads_close(grads_of((out, alpha), inputs, (go, ga)), grads_of((ref, ref_alpha), inputs, (go, ga)),
                       atol=1e-11, rtol=1e-9)
    # eval mode (training=False) ignores dropout
    torch.testing.assert_close(call(inputs, graph, dropout=p, training=False), reference(inputs, ei, nd)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_rate_and_seed(device):
    """As GAT's: each (edge, head) dropped with probability p, the draw following torch's seed."""
    ns = nd = 200
    ei = torch.stack([torch.arange(ns).repeat_interleave(50), torch.randint(0, nd, (ns * 50,))]).to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 4, 2, torch.float32, device, edge_mode="none")
    for p in (0.1, 0.6):
        _, alpha = call(inputs, graph, dropout=p, training=True, return_attention=True)
        dropped = (alpha == 0).double().mean().item()
        assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / alpha.numel()), (p, dropped)
    torch.manual_seed(3)
    a1 = call(inputs, graph, dropout=0.5, training=True)
    torch.manual_seed(3)
    a2 = call(inputs, graph, dropout=0.5, training=True)
    assert torch.equal(a1, a2)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_one(device):
    """As GAT's: dropout=1 drops every weight in training (zeros, no NaN) and is ignored in eval."""
    ei, ns, nd = make_graph("random", torch.int64, device, seed=8)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, device)
    out, alpha = call(inputs, graph, dropout=1.0, training=True, return_attention=True)
    assert not out.any() and not alpha.any()
    grads = grads_of((out, alpha), inputs, (torch.randn_like(out), torch.randn_like(alpha)))
    assert all(g is None or not g.any() for g in grads)
    torch.testing.assert_close(call(inputs, graph, dropout=1.0, training=False), reference(inputs, ei, nd)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edge_mode", ["project", "direct"])
def test_backward_is_bitwise_deterministic(edge_mode, device):
    g = torch.Generator().manual_seed(0)
    n, e = 400, 12000  # hub-heavy sources and several backward chunks: summation order matters
    src = torch.randint(0, 20, (e,), generator=g)
    dst = torch.randint(0, n, (e,), generator=g)
    ei = torch.stack([src, dst]).to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    inputs = make_inputs(n, n, e, 4, 16, torch.float32, device, edge_mode=edge_mode, edge_dim=8)
    go = torch.randn(n, 4, 16, generator=g).to(device)
    present = [t for t in inputs if t is not None]

    def run():
        out = call(inputs, graph)
        return [out] + list(torch.autograd.grad(out, present, go))

    first = run()
    # the CPU result does not depend on the thread count
    for result in runs_at_thread_counts(run, (1, 2, torch.get_num_threads())):
        for a, b in zip(first, result):
            assert torch.equal(a, b)


@pytest.mark.parametrize("by_degree", [True, False])
def test_powerlaw_graph_at_every_thread_count(by_degree):
    """Hubs numbered first put most edges in the first rows (destinations and sources): the CPU
    kernels' edge-balanced row ranges (several per thread here) must cover every row once,
    whatever the thread count: float64 results against the reference, and bitwise equal across
    thread counts."""
    n = 300
    ei = powerlaw_edge_index(n, 6000, by_degree=by_degree, seed=2)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    inputs = make_inputs(n, n, ei.size(1), 4, 16, torch.float64, "cpu", edge_mode="project", edge_dim=4)
    go = torch.randn(n, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref = reference(inputs, ei, n)[0]
    ref_grads = grads_of(ref, inputs, go)

    def run():
        out = call(inputs, graph)
        return [out, *grads_of(out, inputs, go)]

    runs = runs_at_thread_counts(run, (1, 2, 3))
    assert_grads_close(runs[0], [ref, *ref_grads])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


@pytest.mark.parametrize("edge_mode", EDGE_MODES)
@pytest.mark.parametrize("source_pass", ["reverse", "scatter"])
def test_both_source_passes(source_pass, edge_mode, monkeypatch):
    """x_src's CPU gradient comes from pass 2 over the reverse index, or is scattered in pass 1
    into one partial per group of chunks; the kernel picks by the machine's thread count and
    memory (small graphs: scatter), TORCH_GRADOPS_GATV2_SOURCE_PASS forces either. Both against
    the float64 reference on a graph of several backward chunks with hub sources, with dropout
    and attention weights in the loss, in float16 against float64, and bitwise equal across
    thread counts."""
    monkeypatch.setenv("TORCH_GRADOPS_GATV2_SOURCE_PASS", source_pass)
    g = torch.Generator().manual_seed(4)
    n, e = 300, 6000
    ei = torch.stack([torch.randint(0, 40, (e,), generator=g), torch.randint(0, n, (e,), generator=g)])
    ei[0, ::7] = torch.randint(40, n, (len(range(0, e, 7)),), generator=g)  # and some light sources
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    inputs = make_inputs(n, n, e, 4, 8, torch.float64, "cpu", edge_mode=edge_mode, edge_dim=5)
    out, alpha = call(inputs, graph, dropout=0.3, training=True, return_attention=True)
    keep = alpha != 0
    ref, ref_alpha = reference(inputs, ei, n, keep_mask=keep, keep_scale=1 / 0.7)
    torch.testing.assert_close(out, ref)
    go, ga = torch.randn_like(out), torch.randn_like(alpha)
    assert_grads_close(grads_of((out, alpha), inputs, (go, ga)), grads_of((ref, ref_alpha), inputs, (go, ga)),
                       atol=1e-11, rtol=1e-9)
    half = [None if t is None else t.detach().half().requires_grad_() for t in inputs]
    exact = [None if t is None else t.detach().double().requires_grad_() for t in half]
    out_h, ref_h = call(half, graph), reference(exact, ei, n)[0]
    assert_grads_close(grads_of(out_h, half, go.half()), grads_of(ref_h, exact, go.half().double()),
                       atol=2e-2, rtol=2e-2)
    inputs32 = [None if t is None else t.detach().float().requires_grad_() for t in inputs]

    def run():
        return grads_of(call(inputs32, graph), inputs32, go.float())

    runs = runs_at_thread_counts(run, (1, 2, 3))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    monkeypatch.setenv("TORCH_GRADOPS_GATV2_SOURCE_PASS", "sideways")
    with pytest.raises(RuntimeError, match="TORCH_GRADOPS_GATV2_SOURCE_PASS must be auto, scatter or reverse"):
        run()


def test_retain_graph_semantics():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 4, torch.float64, "cpu")
    loss = call(inputs, graph).square().sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in inputs]
    loss.backward()  # allowed: retain_graph=True the first time
    for t, f in zip(inputs, first):
        torch.testing.assert_close(t.grad, 2 * f)
    loss = call(inputs, graph).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time|freed"):
        loss.backward()


def test_subset_inputs_and_allow_unused():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 4, torch.float64, "cpu")
    x_src, x_dst, att, ea, w = inputs
    out = call(inputs, graph)
    go = torch.randn_like(out)
    ref, _ = reference(inputs, ei, nd)
    for t in inputs:  # each gradient alone equals the reference's
        (ours,) = torch.autograd.grad(out, (t,), go, retain_graph=True)
        torch.testing.assert_close(ours, torch.autograd.grad(ref, (t,), go, retain_graph=True)[0])
    unused = torch.zeros(3, requires_grad=True)
    gw, gu = torch.autograd.grad(out, (w, unused), go, allow_unused=True, retain_graph=True)
    assert gu is None and gw is not None
    with pytest.raises(RuntimeError, match="not have been used"):
        torch.autograd.grad(out, (x_src, unused), go, retain_graph=True)
    # backward(inputs=...) accumulates only into the named leaves
    out.backward(go, inputs=[att, ea])
    assert att.grad is not None and ea.grad is not None and x_src.grad is None and w.grad is None
    # inputs that do not require grad get no gradient
    x2 = x_src.detach()
    call([x2, x_dst, att, None, None], graph).sum().backward()
    assert x2.grad is None and x_dst.grad is not None


@pytest.mark.parametrize("with_dropout", [False, True])
@pytest.mark.parametrize("edge_mode", ["project", "direct"])
def test_forward_mode_ad_matches_reference(with_dropout, edge_mode):
    ei, ns, nd = make_graph("duplicates_selfloops")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    primals = [None if t is None else t.detach()
               for t in make_inputs(ns, nd, ei.size(1), 3, 4, torch.float64, "cpu", edge_mode=edge_mode)]
    present = [t for t in primals if t is not None]
    tangents = [torch.randn_like(t) for t in present]
    kw = dict(dropout=0.3, training=True) if with_dropout else {}

    def full(ts):
        it = iter(ts)
        return [next(it) if t is not None else None for t in primals]

    def ours(*ts):
        torch.manual_seed(11)
        return call(full(ts), graph, return_attention=True, **kw)

    _, alpha = ours(*present)
    keep = (alpha != 0) if with_dropout else None
    scale = 1 / 0.7 if with_dropout else 1.0

    def theirs(*ts):
        return reference(full(ts), ei, nd, keep_mask=keep, keep_scale=scale)

    (_, t_ours) = jvp(ours, tuple(present), tuple(tangents))
    (_, t_ref) = jvp(theirs, tuple(present), tuple(tangents))
    for a, b in zip(t_ours, t_ref):
        torch.testing.assert_close(a, b)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(p, t) for p, t in zip(present, tangents)]
        out, alpha = ours(*duals)
        torch.testing.assert_close(forward_ad.unpack_dual(out).tangent, t_ref[0])
        torch.testing.assert_close(forward_ad.unpack_dual(alpha).tangent, t_ref[1])


def test_torch_func_grad_matches_reference():
    ei, ns, nd = make_graph("skewed")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = [t.detach() for t in make_inputs(ns, nd, ei.size(1), 2, 4, torch.float64, "cpu")]
    go = torch.randn(nd, 2, 4, dtype=torch.float64)
    loss = lambda *ts: (call(list(ts), graph) * go).sum()
    loss_ref = lambda *ts: (reference(list(ts), ei, nd)[0] * go).sum()
    ours = torch.func.grad(loss, argnums=(0, 1, 2, 3, 4))(*inputs)
    theirs = torch.func.grad(loss_ref, argnums=(0, 1, 2, 3, 4))(*inputs)
    assert_grads_close(ours, theirs, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_wide_scores(device):
    """Scores hundreds apart (weights that underflow to 0 in float32, the CPU exp's clamp range):
    the online softmax must stay exact where the weights matter."""
    ei, ns, nd = make_graph("skewed", torch.int64, device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 8, 32, torch.float32, device)
    with torch.no_grad():
        inputs[2].mul_(40.0)
    out, alpha = call(inputs, graph, return_attention=True)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_alpha = reference(inputs64, ei, nd)
    assert ((ref_alpha > 0) & (ref_alpha < 1e-30)).any()  # some weights do underflow
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(alpha.double(), ref_alpha, atol=1e-4, rtol=1e-4)
    go = torch.randn(out.shape, dtype=torch.float64, device=device)
    ours = grads_of(out, inputs, go.float())
    theirs = grads_of(ref, inputs64, go)
    for a, b in zip(ours, theirs):
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=1e-4 * scale, rtol=1e-3)


def test_nan_propagates_locally():
    ei = torch.tensor([[0, 1, 2, 2], [0, 0, 1, 2]])
    graph = tg.BipartiteCSC.from_edge_index(ei, 3, 4)
    inputs = [t.detach() for t in make_inputs(3, 4, 4, 1, 2, torch.float32, "cpu", edge_mode="none")[:3]]
    inputs += [None, None]
    inputs[0][1, 0, 0] = float("nan")
    out = call(inputs, graph)
    ref, _ = reference(inputs, ei, 4)
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert torch.isnan(out[0]).any() and not torch.isnan(out[1:]).any()
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # no incoming edge


def test_empty_sizes():
    graph = tg.BipartiteCSC.from_edge_index(torch.zeros(2, 0, dtype=torch.long), 0, 0)
    x = torch.zeros(0, 2, 3, requires_grad=True)
    att = torch.zeros(2, 3, requires_grad=True)
    ea = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(4, 2, 3, requires_grad=True)
    out = tg.gatv2_attention(x, x, att, graph, edge_attr=ea, edge_weight=w)
    assert out.shape == (0, 2, 3)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(att.grad, torch.zeros_like(att))
    assert torch.equal(w.grad, torch.zeros_like(w)) and ea.grad.shape == ea.shape


def test_bad_op_inputs_raise_clear_errors():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, xd, att, ea, w = (t.detach() for t in make_inputs(ns, nd, ei.size(1), 2, 3, torch.float32, "cpu"))
    E = ei.size(1)
    cases = [
        (dict(x_src=x.double()), TypeError, r"x_dst .* must have the dtype of x_src"),
        (dict(x_src=x.long()), TypeError, "x_src must be float"),
        (dict(att=att.long()), TypeError, "att must be float"),
        (dict(x_src=x[:, :1]), ValueError, "x_dst must have shape"),
        (dict(x_src=x.reshape(ns, -1)), ValueError, r"x_src must have shape \[num_src, heads, channels\]"),
        (dict(x_dst=xd[:-1]), ValueError, "graph.num_dst"),
        (dict(x_dst=xd[:, :, :2]), ValueError, "x_dst must have shape"),
        (dict(att=att[:1]), ValueError, "att must have shape"),
        (dict(x_src=x[:-1]), ValueError, "graph.num_src"),
        (dict(att=att.double()), TypeError, r"att .* must have the dtype of x_src"),
        (dict(edge_attr=ea[:-1]), ValueError, "edge_attr must have shape"),
        (dict(edge_attr=ea[:, :2]), ValueError, "edge_weight must have shape"),
        (dict(edge_weight=w[:, :1]), ValueError, "edge_weight must have shape"),
        (dict(edge_attr=ea.double(), edge_weight=w.double()), TypeError, "edge_attr .* must have the dtype"),
        (dict(edge_weight=w.double()), TypeError, "edge_weight .* must have the dtype"),
        (dict(edge_attr=None), ValueError, "edge_weight was given without edge_attr"),
        (dict(edge_weight=None), ValueError, "edge_attr without edge_weight must be already projected"),
        (dict(edge_attr=ea.long()), TypeError, "edge_attr must be float"),
        (dict(edge_attr=ea.view(-1)[:E]), ValueError, "edge_attr must have shape"),
        (dict(dropout=-0.1), ValueError, "dropout must be in"),
        (dict(dropout=1.5), ValueError, "dropout must be in"),
        (dict(graph=ei), TypeError, "graph must be a torch_gradops.BipartiteCSC"),
        (dict(att=att.to("meta")), ValueError, r"att .* must be on the device of x_src"),
        (dict(edge_weight=w.to("meta")), ValueError, r"edge_weight .* must be on the device of x_src"),
        (dict(x_src=[1.0]), TypeError, "x_src must be a torch.Tensor"),
    ]
    base = dict(x_src=x, x_dst=xd, att=att, graph=graph, edge_attr=ea, edge_weight=w)
    for override, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            tg.gatv2_attention(**{**base, **override})
    # the raw op checks too, naming the argument
    ops = torch.ops.torch_gradops
    args = (x, xd, att, ea, w)
    with pytest.raises(RuntimeError, match=r"indptr must have num_dst \+ 1"):
        ops.gatv2_forward(*args, graph.indptr[:-1], graph.indices, None, 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match="edge_weight was given without edge_attr"):
        ops.gatv2_forward(x, xd, att, None, w, graph.indptr, graph.indices, None, 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match="edge_weight must have shape"):
        ops.gatv2_forward(x, xd, att, ea, w[:, :1], graph.indptr, graph.indices, None, 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match=r"edge_attr \(already projected"):
        ops.gatv2_forward(x, xd, att, ea, None, graph.indptr, graph.indices, None, 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match="dropout_mask must be a bool"):
        ops.gatv2_forward(*args, graph.indptr, graph.indices, torch.ones(E, 2), 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match="dropout_scale"):
        ops.gatv2_forward(*args, graph.indptr, graph.indices, None, 0.2, 0.5, False)
    bad_indices = graph.indices.clone()
    bad_indices[0] = ns + 5
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gatv2_forward(*args, graph.indptr, bad_indices, None, 0.2, 1.0, False)
    short = graph.indptr.clone()
    short[-1] -= 1
    with pytest.raises(RuntimeError, match="indptr must start at 0 and end at E"):
        ops.gatv2_forward(*args, short, graph.indices, None, 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match="x_dst has no destinations"):  # edges but no destination
        ops.gatv2_forward(x, xd[:0], att, ea, w, torch.full((1,), E, dtype=graph.indptr.dtype), graph.indices,
                          None, 0.2, 1.0, True)
    with pytest.raises(RuntimeError, match="x_src has no sources for them"):  # edges but no source
        ops.gatv2_forward(x[:0], xd, att, ea, w, graph.indptr, graph.indices, None, 0.2, 1.0, True)
    rev = graph.reverse_index()
    out, lse, _ = ops.gatv2_forward(*args, graph.indptr, graph.indices, None, 0.2, 1.0, False)
    bwd = (torch.ones_like(out), None, out, lse, *args, graph.indptr, graph.indices)
    late = rev.indptr.clone()
    late[0] = 1
    everything = [True] * 5
    with pytest.raises(RuntimeError, match="rev_indptr must start at 0 and end at E"):
        ops.gatv2_backward(*bwd, late, rev.edge, rev.dst, None, 0.2, 1.0, everything)
    assert lse.dtype == torch.float64  # for every input dtype: see kLseType in csrc/gat.h
    with pytest.raises(RuntimeError, match="lse must be Double"):
        ops.gatv2_backward(*bwd[:3], lse.float(), *bwd[4:], rev.indptr, rev.edge, rev.dst, None, 0.2, 1.0,
                           everything)
    with pytest.raises(RuntimeError, match="grad_out must have shape"):
        ops.gatv2_backward(out[:-1], *bwd[1:], rev.indptr, rev.edge, rev.dst, None, 0.2, 1.0, everything)


def test_zero_edge_features():
    """edge_attr [E, 0] with edge_weight [0, H, C]: no edge term, every gradient still written
    (the CUDA params kernel once skipped grad att for K = 0)."""
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, xd, att, _, _ = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, "cpu", edge_mode="none")
    ea = torch.zeros(ei.size(1), 0, dtype=torch.float64, requires_grad=True)
    w = torch.zeros(0, 2, 3, dtype=torch.float64, requires_grad=True)
    out = tg.gatv2_attention(x, xd, att, graph, edge_attr=ea, edge_weight=w)
    ref = tg.gatv2_attention(x, xd, att, graph)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (x, xd, att), go)
    g2 = torch.autograd.grad(ref, (x, xd, att), go)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_opcheck():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, xd, att, ea, w = (t.detach() for t in make_inputs(ns, nd, ei.size(1), 2, 3, torch.float32, "cpu"))
    ea = graph.edge_order(ea)
    ea3 = torch.randn(ei.size(1), 2, 3)
    mask = torch.rand(ei.size(1), 2) > 0.3
    ops = torch.ops.torch_gradops
    p, i = graph.indptr, graph.indices
    for args in [
        (x, xd, att, ea, w, p, i, None, 0.2, 1.0, True),
        (x, xd, att, None, None, p, i, mask, 0.1, 1.5, False),
        (x, xd, att, ea3, None, p, i, mask, 0.2, 1.5, True),
    ]:
        torch.library.opcheck(ops.gatv2_forward.default, args)
    rev = graph.reverse_index()
    # non-contiguous inputs (the layer's lin_edge weight as edge_weight is a transposed view):
    # the kernels return contiguous gradients, and so must the fake kernel (Inductor checks)
    w_t = w.reshape(-1, w.size(1) * w.size(2)).t().contiguous().t().reshape(w.shape)
    assert not w_t.is_contiguous()
    x_t = x.transpose(0, 1).contiguous().transpose(0, 1)
    for ea_, w_, x_ in ((ea, w, x), (ea3, None, x), (None, None, x), (ea, w_t, x_t)):
        x = x_
        out, lse, alpha = ops.gatv2_forward(x, xd, att, ea_, w_, p, i, mask, 0.2, 1.5, True)
        go = torch.randn_like(out)
        for mask_out, ga in (([True] * 5, torch.randn_like(alpha)), ([True, False, False, False, False], None),
                             ([False, True, True, True, False], None), ([False, False, False, False, True], None)):
            torch.library.opcheck(ops.gatv2_backward.default,
                                  (go, ga, out, lse, x, xd, att, ea_, w_, p, i, rev.indptr, rev.edge, rev.dst,
                                   mask, 0.2, 1.5, mask_out))


def test_torch_compile_fullgraph_matches_eager():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    graph.reverse_index()
    x_src, x_dst, att, ea, w = make_inputs(ns, nd, ei.size(1), 2, 8, torch.float32, "cpu")
    lin = torch.randn(8, 8)

    def f(x_src, x_dst, att, ea, w):
        out = tg.gatv2_attention(x_src @ lin, x_dst, att, graph, 0.2, ea, w)
        return torch.nn.functional.elu(out).sum(dim=(1, 2))

    compiled = torch.compile(f, fullgraph=True)
    args = (x_src, x_dst, att, ea, w)
    eager = f(*args)
    got = compiled(*args)
    torch.testing.assert_close(got, eager)
    ge = torch.autograd.grad(eager.sum(), args)
    gc = torch.autograd.grad(compiled(*args).sum(), args)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_mha_gat_v2_n2n_matches_manual_composition():
    ei, ns, nd = make_graph("random", seed=9)
    n = max(ns, nd)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    heads, c = 3, 4
    feat = torch.randn(n, heads * c, dtype=torch.float64, requires_grad=True)
    att = torch.randn(heads * c, dtype=torch.float64, requires_grad=True)
    efeat = torch.randn(ei.size(1), heads * c, dtype=torch.float64, requires_grad=True)
    xs = feat.view(n, heads, c)
    a = att.view(heads, c)
    out = tg.mha_gat_v2_n2n(feat, att, graph, num_heads=heads, edge_feat=efeat)
    ref, _ = gatv2_reference(xs, xs, a, ei, n, 0.2, efeat.view(-1, heads, c))
    torch.testing.assert_close(out, ref.reshape(n, heads * c))
    # concat_heads=False averages the heads
    mean = tg.mha_gat_v2_n2n(feat, att, graph, num_heads=heads, concat_heads=False)
    torch.testing.assert_close(mean, gatv2_reference(xs, xs, a, ei, n)[0].mean(1))
    # a (source, destination) pair on a bipartite graph; "Linear" = no activation
    g2 = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    fs, fd = torch.randn(ns, heads * c, dtype=torch.float64), torch.randn(nd, heads * c, dtype=torch.float64)
    out2 = tg.mha_gat_v2_n2n((fs, fd), att, g2, num_heads=heads, activation="Linear")
    ref2, _ = gatv2_reference(fs.view(ns, heads, c), fd.view(nd, heads, c), a, ei, nd, 1.0)
    torch.testing.assert_close(out2, ref2.reshape(nd, heads * c))
    assert torch.autograd.gradcheck(
        lambda f, w, e: tg.mha_gat_v2_n2n(f, w, graph, num_heads=heads, edge_feat=e), (feat, att, efeat))
    with pytest.raises(ValueError, match="attn_weights"):
        tg.mha_gat_v2_n2n(feat, torch.cat([att, att]), graph, num_heads=heads)
    with pytest.raises(ValueError, match="activation"):
        tg.mha_gat_v2_n2n(feat, att, graph, num_heads=heads, activation="ELU")
    with pytest.raises(ValueError, match="edge_feat"):
        tg.mha_gat_v2_n2n(feat, att, graph, num_heads=heads, edge_feat=efeat[:, :2])
    with pytest.raises(ValueError, match="num_heads"):
        tg.mha_gat_v2_n2n(feat, att, graph, num_heads=5)


def test_graph_without_the_inputs_self_loops():
    """A graph from csc_from_edges(self_loops=L) leaves the input's own loops out eagerly and
    keeps them in a trash row with static shapes: gatv2_attention takes edge features in the
    processed order of E + L rows either way, with the same output, attention and gradients
    (zero for a left-out loop's features)."""
    from torch_gradops.graph import csc_from_edges
    gen = torch.Generator().manual_seed(5)
    n, L, H, C, K = 10, 10, 2, 4, 3
    ei = torch.randint(0, n, (2, 40), generator=gen)
    ei[:, [0, 9]] = torch.tensor([[4, 7], [4, 7]])
    E, is_loop = ei.size(1), ei[0] == ei[1]
    keep = torch.cat([~is_loop, torch.ones(L, dtype=torch.bool)])
    eager = csc_from_edges(ei[0], ei[1], n, n, self_loops=L)
    static = csc_from_edges(ei[0], ei[1], n, n, self_loops=L, static_shapes=True)
    assert eager.num_dst == n and eager.num_edges == int(keep.sum())
    leaf = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    xs, xd, att, ea, w = leaf(n, H, C), leaf(n, H, C), leaf(H, C), leaf(E + L, K), leaf(K, H, C)
    out, alpha = tg.gatv2_attention(xs, xd, att, eager, edge_attr=ea, edge_weight=w, return_attention=True)
    xd_pad = torch.cat([xd, xd.new_zeros(1, H, C)])
    out_s, alpha_s = tg.gatv2_attention(xs, xd_pad, att, static, edge_attr=ea, edge_weight=w, return_attention=True)
    torch.testing.assert_close(out, out_s[:n], rtol=0, atol=1e-14)
    assert torch.equal(alpha[~keep], torch.zeros_like(alpha[~keep]))
    torch.testing.assert_close(alpha[keep], alpha_s[keep], rtol=0, atol=1e-14)
    go, ga = torch.randn_like(out), torch.randn_like(alpha)
    got = torch.autograd.grad((out, alpha), (xs, xd, att, ea, w), (go, ga))
    want = torch.autograd.grad((out_s[:n], alpha_s * keep[:, None]), (xs, xd, att, ea, w), (go, ga))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=0, atol=1e-13)
    assert torch.equal(got[3][~keep], torch.zeros_like(got[3][~keep]))
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E=50"):
        tg.gatv2_attention(xs, xd, att, eager, edge_attr=ea[:E], edge_weight=w)


def test_the_ops_own_autograd_formulas_leave_the_log_sum_exp_non_differentiable():
    """The formulas registered on gat_forward / gatv2_forward (what an exported program
    differentiates) left lse differentiable and ignored its gradient: a loss through it got
    zero gradients silently (the Functions mark it non-differentiable)."""
    import torch_gradops  # noqa: F401  (registers the ops)
    from torch_gradops.graph import csc_from_edges
    g = csc_from_edges(torch.tensor([0, 1, 2, 0]), torch.tensor([1, 2, 0, 0]), 3, 3)
    f64 = dict(dtype=torch.float64, requires_grad=True)
    xs, xd, att = torch.randn(3, 2, 4, **f64), torch.randn(3, 2, 4, **f64), torch.randn(2, 4, **f64)
    a_src, a_dst = torch.randn(3, 2, **f64), torch.randn(3, 2, **f64)
    for out, lse, _ in (torch.ops.torch_gradops.gatv2_forward(xs, xd, att, None, None, g.indptr, g.indices, None,
                                                               0.2, 1.0, False),
                        torch.ops.torch_gradops.gat_forward(xs, a_src, a_dst, None, g.indptr, g.indices, None, 0.2,
                                                            1.0, False)):
        assert out.requires_grad and not lse.requires_grad
    torch.ops.torch_gradops.gatv2_forward(xs, xd, att, None, None, g.indptr, g.indices, None, 0.2, 1.0,
                                          False)[0].sum().backward()
    assert att.grad is not None and att.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- edge_attr_rows
def _rows_case(edge_mode, dtype, index_dtype, device, extra_rows):
    """A permuted graph, edge features with ``extra_rows`` rows no edge reads (scattered among the
    read ones), the rows each CSC position reads, and the same features gathered into CSC order."""
    ei, ns, nd = make_graph("random", index_dtype, device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    E = graph.num_edges
    x, xd, att, ea, w = (None if t is None else t.detach()
                         for t in make_inputs(ns, nd, E + extra_rows, 2, 16, dtype, device, edge_mode=edge_mode,
                                              edge_dim=5))
    g = torch.Generator().manual_seed(3)
    slots = torch.randperm(E + extra_rows, generator=g)[:E].to(device)  # rows of the E input edges
    rows = slots.index_select(0, graph.perm.long()).to(index_dtype)
    return graph, (x, xd, att, ea, w), rows, ea.index_select(0, rows.long())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edge_mode", ["project", "direct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("extra_rows", [0, 7])
def test_edge_attr_rows_read_as_the_gathered_features(device, edge_mode, dtype, index_dtype, extra_rows):
    """Edge features read through edge_attr_rows give bitwise the outputs and gradients of the
    same features gathered into CSC order; grad edge_attr comes back in edge_attr's own rows, zero
    for the rows no edge reads (also with every gradient but edge_attr's skipped)."""
    graph, (x, xd, att, ea, w), rows, ea_csc = _rows_case(edge_mode, dtype, index_dtype, device, extra_rows)
    ops = torch.ops.torch_gradops
    p, i = graph.indptr, graph.indices
    rev = graph.reverse_index()
    mask = torch.rand(graph.num_edges, 2, generator=torch.Generator().manual_seed(4)).to(device) > 0.3
    ours = ops.gatv2_forward(x, xd, att, ea, w, p, i, mask, 0.2, 1.5, True, rows)
    ref = ops.gatv2_forward(x, xd, att, ea_csc, w, p, i, mask, 0.2, 1.5, True)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    out, lse, alpha = ref
    go, ga = torch.randn_like(out), torch.randn_like(alpha)
    for wanted in ([True] * 5, [False, False, False, True, False]):
        args = (go, ga, out, lse, x, xd, att)
        tail = (p, i, rev.indptr, rev.edge, rev.dst, mask, 0.2, 1.5, wanted)
        g_ours = ops.gatv2_backward(*args, ea, w, *tail, rows)
        g_ref = ops.gatv2_backward(*args, ea_csc, w, *tail)
        for k in (0, 1, 2, 4):
            assert torch.equal(g_ours[k], g_ref[k])
        assert g_ours[3].shape == ea.shape
        expect = torch.zeros_like(ea).index_copy(0, rows.long(), g_ref[3])
        assert torch.equal(g_ours[3], expect)
        if extra_rows:
            unread = torch.ones(ea.size(0), dtype=torch.bool, device=device)
            unread[rows.long()] = False
            assert unread.sum() == extra_rows and (g_ours[3][unread] == 0).all()
            assert (g_ref[3] != 0).any()


def test_edge_attr_rows_errors():
    graph, (x, xd, att, ea, w), rows, _ = _rows_case("project", torch.float32, torch.int64, "cpu", 3)
    ops = torch.ops.torch_gradops
    p, i = graph.indptr, graph.indices
    fwd = lambda ea_, rows_: ops.gatv2_forward(x, xd, att, ea_, w, p, i, None, 0.2, 1.0, False, rows_)  # noqa: E731
    with pytest.raises(RuntimeError, match=rf"edge_attr_rows: row {ea.size(0)} out of range \[0, {ea.size(0)}\)"):
        fwd(ea, torch.where(rows == rows[5], ea.size(0), rows))
    with pytest.raises(RuntimeError, match="edge_attr_rows: row -1 out of range"):
        fwd(ea, torch.where(rows == rows[0], -1, rows))
    with pytest.raises(RuntimeError, match="edge_attr_rows must have one entry per edge"):
        fwd(ea, rows[1:])
    with pytest.raises(RuntimeError, match="edge_attr_rows and indices must share one dtype"):
        fwd(ea, rows.int())
    with pytest.raises(RuntimeError, match="edge_attr_rows was given without edge_attr"):
        ops.gatv2_forward(x, xd, att, None, None, p, i, None, 0.2, 1.0, False, rows)
    with pytest.raises(RuntimeError, match="edge_attr has no rows"):
        fwd(ea[:0], rows)
    # a repeated row: reading is fine, a gradient written through it is refused
    twice = rows.clone()
    twice[1] = twice[0]
    out, lse, _ = fwd(ea, twice)
    rev = graph.reverse_index()
    args = (torch.ones_like(out), None, out, lse, x, xd, att, ea, w, p, i, rev.indptr, rev.edge, rev.dst, None,
            0.2, 1.0)
    with pytest.raises(RuntimeError, match=f"row {int(rows[0])} appears twice"):
        ops.gatv2_backward(*args, [False, False, False, True, False], twice)
    ops.gatv2_backward(*args, [True, True, True, False, True], twice)  # grad edge_attr not wanted: no check


def test_edge_attr_rows_opcheck():
    ops = torch.ops.torch_gradops
    for edge_mode in ("project", "direct"):
        graph, (x, xd, att, ea, w), rows, _ = _rows_case(edge_mode, torch.float32, torch.int64, "cpu", 4)
        p, i = graph.indptr, graph.indices
        mask = torch.rand(graph.num_edges, 2) > 0.3
        fargs = (x, xd, att, ea, w, p, i, mask, 0.2, 1.5, True, rows)
        torch.library.opcheck(ops.gatv2_forward.default, fargs)
        out, lse, alpha = ops.gatv2_forward(*fargs)
        rev = graph.reverse_index()
        for wanted in ([True] * 5, [False, False, False, True, False]):
            torch.library.opcheck(ops.gatv2_backward.default,
                                  (torch.randn_like(out), torch.randn_like(alpha), out, lse, x, xd, att, ea, w, p, i,
                                   rev.indptr, rev.edge, rev.dst, mask, 0.2, 1.5, wanted, rows))


@pytest.mark.parametrize("edge_mode", ["project", "direct"])
def test_left_out_input_edges(edge_mode):
    """A graph that holds only some of its input edges (num_input_edges > E, perm naming the
    kept ones): gatv2_attention reads edge_attr in the input order through perm, matches the
    reference on the kept edges, and gives the left-out edges' features zero gradient, under
    gradcheck and gradgradcheck (float64)."""
    ei, ns, nd = make_graph("random")
    keep = torch.arange(ei.size(1)) % 4 != 1
    full = tg.BipartiteCSC.from_edge_index(ei[:, keep], ns, nd)
    kept_ids = keep.nonzero().squeeze(1)
    graph = tg.BipartiteCSC(full.indptr, full.indices, ns, kept_ids.index_select(0, full.perm.long()),
                            num_input_edges=ei.size(1))
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, "cpu", edge_mode=edge_mode)
    x, xd, att, ea, w = inputs
    out = call(inputs, graph)
    ref, _ = reference([x, xd, att, ea[keep], w], ei[:, keep], nd)
    torch.testing.assert_close(out, ref)
    g_ea = torch.autograd.grad(out, ea, torch.randn_like(out))[0]
    assert (g_ea[~keep] == 0).all() and (g_ea[keep] != 0).any()
    diff = [t for t in inputs if t is not None]

    def f(*ts):
        return call(ts + ((None,) if w is None else ()), graph)

    torch.autograd.gradcheck(f, diff, check_forward_ad=True)
    torch.autograd.gradgradcheck(f, diff)


def test_input_order_edge_features_are_not_copied():
    """gatv2_attention with a permuted graph saves edge_attr itself for the backward, not a
    reordered copy (the kernels read it through the graph's perm)."""
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    assert graph.perm is not None
    x, xd, att, ea, w = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float32, "cpu")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tg.gatv2_attention(x, xd, att, graph, edge_attr=ea, edge_weight=w)
    assert any(t is ea for t in saved)
    assert not any(t.shape == ea.shape and t is not ea for t in saved)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="with one hardware thread both passes sum in the same order")
def test_source_pass_setting_takes_effect(monkeypatch):
    """TORCH_GRADOPS_GATV2_SOURCE_PASS reaches the kernel: the scattered pass adds a source's
    edges into one partial per group of destination chunks (one group per hardware thread) and
    then the partials, the reverse pass along all its edges in turn, so on hub sources whose
    edges span groups the float32 x_src gradients differ in their last bits, while every other
    gradient is bitwise the same and both stay close."""
    g = torch.Generator().manual_seed(4)
    n, e = 300, 6000
    ei = torch.stack([torch.randint(0, 40, (e,), generator=g), torch.randint(0, n, (e,), generator=g)])
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    inputs = make_inputs(n, n, e, 4, 8, torch.float32, "cpu", edge_dim=5)
    go = torch.randn(n, 4, 8, generator=g)
    grads = {}
    for how in ("reverse", "scatter"):
        monkeypatch.setenv("TORCH_GRADOPS_GATV2_SOURCE_PASS", how)
        grads[how] = grads_of(call(inputs, graph), inputs, go)
    rev, sca = grads["reverse"], grads["scatter"]
    assert not torch.equal(rev[0], sca[0])
    torch.testing.assert_close(rev[0], sca[0], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(rev[1:], sca[1:]))


def test_repeated_rows_sum_in_the_differentiable_backward():
    """Rows named twice (a direct caller's edge_attr_rows, not a graph's perm) are refused by the
    fused CPU backward, and the differentiable backward (create_graph) sums the positions that
    read a row, as index_select's adjoint does."""
    graph, (x, xd, att, ea, w), rows, _ = _rows_case("project", torch.float64, torch.int64, "cpu", 3)
    twice = rows.clone()
    twice[1] = twice[0]
    rev = graph.reverse_index()
    ea = ea.detach().requires_grad_()
    tail = (graph.indptr, graph.indices, rev.indptr, rev.edge, rev.dst, None, 0.2, 1.0, False)
    out = tg.GATv2AttentionFunction.apply(x, xd, att, ea, w, *tail, twice)[0]
    go = torch.randn_like(out)
    g = torch.autograd.grad(out, ea, go, create_graph=True)[0]
    ref_out = tg.GATv2AttentionFunction.apply(x, xd, att, ea.index_select(0, twice), w, *tail)[0]
    ref = torch.autograd.grad(ref_out, ea, go)[0]
    torch.testing.assert_close(g, ref)
    with pytest.raises(RuntimeError, match="appears twice"):
        torch.autograd.grad(tg.GATv2AttentionFunction.apply(x, xd, att, ea, w, *tail, twice)[0], ea, go)


def tied_exact_scores(seed, device):
    """A graph and inputs whose GATv2 scores are exact in float32 at every scale (integer rows, a
    slope of 1/4) with each destination's best score tied: sources come in pairs with equal rows
    and a destination hears both of each pair. Yields ``(ei, graph, (x_src, x_dst, att), scale)``
    for scores of about 2^6 and 2^23 (float32 ulp 2 there, so a float32 lse rounds log(2) away)."""
    g = torch.Generator().manual_seed(seed)
    ns, nd, heads, c = 16, 6, 2, 4
    src = torch.cat([torch.randperm(ns // 2, generator=g)[:3] for _ in range(nd)]) * 2
    src = torch.stack([src, src + 1], 1).reshape(-1)  # both sources of each pair
    ei = torch.stack([src, torch.arange(nd).repeat_interleave(6)]).to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    for scale in (2.0 ** 6, 2.0 ** 17):
        rows = torch.randint(-8, 9, (ns // 2, heads, c), generator=g).repeat_interleave(2, 0) * scale
        x_dst = torch.randint(-4, 5, (nd, heads, c), generator=g) * 4.0
        att = torch.randint(-2, 3, (heads, c), generator=g).float()
        yield ei, graph, [t.float().to(device) for t in (rows, x_dst, att)], scale


@pytest.mark.parametrize("device", DEVICES)
def test_returned_attention_at_large_scores(device):
    """alpha from return_attention is exp(s - max) / sum: formed as exp(s - lse), large float32
    scores lost the log-sum to lse's rounding (two tied edges at scores of 2^23 got 0.37 or 1
    instead of 0.5)."""
    for ei, graph, inputs, scale in tied_exact_scores(7, device):
        _, alpha = tg.gatv2_attention(*inputs, graph, 0.25, return_attention=True)
        _, ref = gatv2_reference(*[t.double() for t in inputs], ei, graph.num_dst, 0.25)
        torch.testing.assert_close(alpha.double(), ref, atol=1e-6, rtol=1e-6, msg=f"scale {scale:g}")


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_at_large_scores(device):
    """The backward forms its weights as exp(s - lse) from a float64 lse, split into two parts of
    the accumulation type: with a float32 lse, tied best edges at exact scores of 2^23 got
    weights of 0.37 or 1 instead of 0.5 in the backward, and gradients to match."""
    g = torch.Generator().manual_seed(9)
    for ei, graph, inputs, scale in tied_exact_scores(9, device):
        weight = torch.randn(graph.num_dst, *inputs[0].shape[1:], generator=g).to(device)
        f32 = [t.requires_grad_() for t in inputs]
        f64 = [t.detach().double().requires_grad_() for t in f32]
        got = torch.autograd.grad((tg.gatv2_attention(*f32, graph, 0.25) * weight).sum(), f32)
        ref = torch.autograd.grad((gatv2_reference(*f64, ei, graph.num_dst, 0.25)[0] * weight.double()).sum(), f64)
        for name, a, b in zip(("x_src", "x_dst", "att"), got, ref):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item(),
                                       msg=f"{name} at scale {scale:g}")
