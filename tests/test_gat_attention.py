"""The fused GAT op against the plain-PyTorch reference: values, gradients, autograd, errors."""
import math

import numpy as np
import pytest
import torch
from torch.autograd import forward_ad
from torch.func import jvp

import torch_gradops as tg
from conftest import DEVICES, runs_at_thread_counts
from gat_reference import gat_reference
from torch_gradops.testing import powerlaw_edge_index

TOL = {  # (atol, rtol) against the float64 reference
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (6e-2, 5e-2),
}


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


def make_inputs(ns, nd, e, heads, channels, dtype, device, seed=1, edge_logits=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ns, heads, channels, generator=g, dtype=torch.float64)
    a_src = torch.randn(ns, heads, generator=g, dtype=torch.float64)
    a_dst = torch.randn(nd, heads, generator=g, dtype=torch.float64)
    el = torch.randn(e, heads, generator=g, dtype=torch.float64) if edge_logits else None
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype).requires_grad_()
    return cast(x), cast(a_src), cast(a_dst), cast(el)


def grads_of(outputs, inputs, grad_outputs):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", GRAPHS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_reference_float64(kind, index_dtype, device):
    ei, ns, nd = make_graph(kind, index_dtype, device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    assert (graph.perm is None) == (kind in ("sorted", "single_node", "no_edges")) or kind == "no_edges"
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), 3, 5, torch.float64, device)
    out, alpha = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, return_attention=True)
    ref, ref_alpha = gat_reference(x, a_src, a_dst, ei, nd, 0.2, el)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=1e-10)
    go = torch.randn_like(out)
    ga = torch.randn_like(alpha)
    ours = grads_of((out, alpha), (x, a_src, a_dst, el), (go, ga))
    theirs = grads_of((ref, ref_alpha), (x, a_src, a_dst, el), (go, ga))
    for a, b in zip(ours, theirs):
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,channels", [(1, 1), (2, 7), (8, 32), (4, 67), (1, 256)])
def test_low_precision_against_float64(dtype, heads, channels, device):
    ei, ns, nd = make_graph("random", torch.int64, device, seed=heads * 1000 + channels)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), heads, channels, dtype, device)
    out = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el)
    assert out.dtype == dtype
    x64, as64, ad64, el64 = (t.detach().double().requires_grad_() for t in (x, a_src, a_dst, el))
    ref, _ = gat_reference(x64, as64, ad64, ei, nd, 0.2, el64)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    go = torch.randn(out.shape, dtype=torch.float64, device=device)
    ours = grads_of(out, (x, a_src, a_dst, el), go.to(dtype))
    theirs = grads_of(ref, (x64, as64, ad64, el64), go)
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=atol * 4, rtol=rtol * 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_edge_logits", [True, False])
def test_half_features_with_float32_logits(dtype, with_edge_logits, device):
    """Half features with float32 logits (what GATConv passes under autocast): out in the
    features' dtype, alpha (float32-accurate: the softmax keeps its inputs) and the logits'
    gradients in float32; the differentiable backward and forward mode agree."""
    ei, ns, nd = make_graph("random", torch.int64, device, seed=11)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), 4, 16, torch.float64, device, seed=12,
                                      edge_logits=with_edge_logits)
    # logits of the size a trained layer's reach, where half rounding moves the softmax
    a_src, a_dst = (t.detach().mul(4).requires_grad_() for t in (a_src, a_dst))
    go = torch.randn(nd, 4, 16, dtype=torch.float64, device=device).to(dtype)
    ga = torch.randn(ei.size(1), 4, dtype=torch.float64, device=device)
    x_h = x.detach().to(dtype).requires_grad_()
    logits = [None if t is None else t.detach().float().requires_grad_() for t in (a_src, a_dst, el)]
    out, alpha = tg.gat_attention(x_h, logits[0], logits[1], graph, 0.2, logits[2], return_attention=True)
    assert out.dtype == dtype and alpha.dtype == torch.float32
    wrt = [t for t in (x_h, *logits) if t is not None]
    ours = torch.autograd.grad((out, alpha), wrt, (go, ga.float()), retain_graph=True)
    assert ours[0].dtype == dtype and all(g.dtype == torch.float32 for g in ours[1:])
    # the reference at the values the op saw (features rounded to half, logits float32)
    x64, as64, ad64, el64 = (None if t is None else t.detach().double().requires_grad_()
                             for t in (x_h, *logits))
    ref, ref_alpha = gat_reference(x64, as64, ad64, ei, nd, 0.2, el64)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(alpha.double(), ref_alpha, atol=1e-5, rtol=1e-4)  # float32 softmax
    theirs = grads_of((ref, ref_alpha), (x64, as64, ad64, el64), (go.double(), ga))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double(), b, atol=atol * 4, rtol=rtol * 4)
    # the differentiable backward (create_graph) and forward mode agree with the fused kernels
    again = torch.autograd.grad((out, alpha), wrt, (go, ga.float()), create_graph=True)
    for a, b in zip(again, ours):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)
    # through alpha alone the logits' gradients are float32-accurate (through out they carry the
    # half rounding of out, which the backward's D = <grad_out, out> reads)
    via_alpha = torch.autograd.grad(alpha, logits[:2], ga.float(), retain_graph=True)
    ref_via_alpha = torch.autograd.grad(gat_reference(x64, as64, ad64, ei, nd, 0.2, el64)[1], (as64, ad64), ga)
    for a, b in zip(via_alpha, ref_via_alpha):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)
    tangents = [torch.randn_like(t) for t in (x_h, *logits) if t is not None]
    primals = [t.detach() for t in (x_h, *logits) if t is not None]
    fn = lambda *a: tg.gat_attention(a[0], a[1], a[2], graph, 0.2, a[3] if len(a) > 3 else None,
                                     return_attention=True)
    (o, al), (t_o, t_al) = jvp(fn, tuple(primals), tuple(tangents))
    assert t_o.dtype == dtype and t_al.dtype == torch.float32
    (_, _), (r_o, r_al) = jvp(lambda *a: gat_reference(a[0], a[1], a[2], ei, nd, 0.2, a[3] if len(a) > 3 else None),
                              tuple(t.double() for t in primals), tuple(t.double() for t in tangents))
    torch.testing.assert_close(t_o.double(), r_o, atol=atol * 4, rtol=rtol * 4)
    torch.testing.assert_close(t_al.double(), r_al, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["random", "zero_in_degree", "duplicates_selfloops", "no_edges"])
def test_gradcheck_and_gradgradcheck(kind, device):
    ei, ns, nd = make_graph(kind, torch.int64, device, seed=3)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, device, seed=4)

    def fn(x, a_src, a_dst, el):
        return tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, return_attention=True)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_with_dropout(device):
    ei, ns, nd = make_graph("random", torch.int64, device, seed=5)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, device, seed=6)

    def fn(x, a_src, a_dst, el):
        torch.manual_seed(7)  # the same mask on every call
        return tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, dropout=0.4, training=True,
                                return_attention=True)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_matches_reference_with_the_ops_mask(device):
    ei, ns, nd = make_graph("random", torch.int64, device, seed=8)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), 4, 6, torch.float64, device)
    p = 0.3
    out, alpha = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, dropout=p, training=True,
                                  return_attention=True)
    _, undropped = gat_reference(x, a_src, a_dst, ei, nd, 0.2, el)
    keep = alpha != 0
    ref, ref_alpha = gat_reference(x, a_src, a_dst, ei, nd, 0.2, el, keep, 1 / (1 - p))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(alpha, ref_alpha)
    # kept entries are scaled by 1/(1-p); dropped ones are exactly zero
    torch.testing.assert_close(alpha[keep], undropped[keep] / (1 - p))
    # eval mode (training=False) ignores dropout
    out_eval = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, dropout=p, training=False)
    torch.testing.assert_close(out_eval, gat_reference(x, a_src, a_dst, ei, nd, 0.2, el)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_rate_and_seed(device):
    """Attention dropout drops each (edge, head) with probability p (the mask is drawn per device:
    straight into a bool tensor on CUDA) and follows torch's seed."""
    ns = nd = 200
    ei = torch.stack([torch.arange(ns).repeat_interleave(50), torch.randint(0, nd, (ns * 50,))]).to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, _ = make_inputs(ns, nd, ei.size(1), 4, 2, torch.float32, device, edge_logits=False)
    for p in (0.1, 0.6):
        _, alpha = tg.gat_attention(x, a_src, a_dst, graph, dropout=p, training=True, return_attention=True)
        dropped = (alpha == 0).double().mean().item()
        n = alpha.numel()
        assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n), (p, dropped)
    torch.manual_seed(3)
    a1 = tg.gat_attention(x, a_src, a_dst, graph, dropout=0.5, training=True)
    torch.manual_seed(3)
    a2 = tg.gat_attention(x, a_src, a_dst, graph, dropout=0.5, training=True)
    assert torch.equal(a1, a2)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_one(device):
    """dropout=1 as F.dropout(p=1): in training every weight is dropped (zero output, weights and
    gradients, none NaN); in eval it is ignored like any rate."""
    ei, ns, nd = make_graph("random", torch.int64, device, seed=8)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    inputs = make_inputs(ns, nd, ei.size(1), 2, 3, torch.float64, device)
    out, alpha = tg.gat_attention(*inputs[:3], graph, 0.2, inputs[3], dropout=1.0, training=True,
                                  return_attention=True)
    assert not out.any() and not alpha.any()
    grads = torch.autograd.grad((out, alpha), inputs, (torch.randn_like(out), torch.randn_like(alpha)))
    assert all(not g.any() for g in grads)
    out_eval = tg.gat_attention(*inputs[:3], graph, 0.2, inputs[3], dropout=1.0, training=False)
    torch.testing.assert_close(out_eval, gat_reference(*inputs[:3], ei, nd, 0.2, inputs[3])[0])


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_bitwise_deterministic(device):
    g = torch.Generator().manual_seed(0)
    n, e = 400, 8000  # hub-heavy: many edges per source, so summation order matters
    src = torch.randint(0, 20, (e,), generator=g)
    dst = torch.randint(0, n, (e,), generator=g)
    ei = torch.stack([src, dst]).to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    x, a_src, a_dst, el = make_inputs(n, n, e, 4, 16, torch.float32, device)
    go = torch.randn(n, 4, 16, generator=g).to(device)

    def run():
        out = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el)
        return [out] + list(torch.autograd.grad(out, (x, a_src, a_dst, el), go))

    first = run()
    # the CPU result does not depend on the thread count
    for result in runs_at_thread_counts(run, (1, 2, torch.get_num_threads())):
        for a, b in zip(first, result):
            assert torch.equal(a, b)


@pytest.mark.parametrize("by_degree", [True, False])
def test_powerlaw_graph_at_every_thread_count(by_degree):
    """Hubs numbered first put most edges in the first rows: the CPU kernels' edge-balanced row
    ranges (several per thread here) must cover every row once, whatever the thread count: float64
    results against the reference, and bitwise equal across thread counts."""
    n = 300
    ei = powerlaw_edge_index(n, 6000, by_degree=by_degree, seed=2)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    x, a_src, a_dst, el = make_inputs(n, n, ei.size(1), 4, 16, torch.float64, "cpu")
    go = torch.randn(n, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref = gat_reference(x, a_src, a_dst, ei, n, 0.2, el)[0]
    ref_grads = torch.autograd.grad(ref, (x, a_src, a_dst, el), go)

    def run():
        out = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el)
        return [out, *torch.autograd.grad(out, (x, a_src, a_dst, el), go)]

    runs = runs_at_thread_counts(run, (1, 2, 3))
    for a, b in zip(runs[0], [ref, *ref_grads]):
        torch.testing.assert_close(a, b)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_retain_graph_semantics():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), 2, 4, torch.float64, "cpu")
    out = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el)
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()  # second backward allowed with retain_graph=True the first time
    torch.testing.assert_close(x.grad, 2 * first)
    out = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el)
    loss = out.sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="second time|freed"):
        loss.backward()


def test_subset_inputs_and_allow_unused():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), 2, 4, torch.float64, "cpu")
    out = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el)
    go = torch.randn_like(out)
    (ga_dst,) = torch.autograd.grad(out, (a_dst,), go, retain_graph=True)
    ref, _ = gat_reference(x, a_src, a_dst, ei, nd, 0.2, el)
    torch.testing.assert_close(ga_dst, torch.autograd.grad(ref, (a_dst,), go)[0])
    unused = torch.zeros(3, requires_grad=True)
    gx, gu = torch.autograd.grad(out, (x, unused), go, allow_unused=True, retain_graph=True)
    assert gu is None and gx is not None
    with pytest.raises(RuntimeError, match="not have been used"):
        torch.autograd.grad(out, (x, unused), go)
    # inputs that do not require grad get no gradient and cost no work
    x2 = x.detach()
    out2 = tg.gat_attention(x2, a_src, a_dst, graph, 0.2, None)
    out2.sum().backward()
    assert x2.grad is None and a_src.grad is not None


@pytest.mark.parametrize("with_dropout", [False, True])
def test_forward_mode_ad_matches_reference(with_dropout):
    ei, ns, nd = make_graph("duplicates_selfloops")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    primals = [t.detach() for t in make_inputs(ns, nd, ei.size(1), 3, 4, torch.float64, "cpu")]
    tangents = [torch.randn_like(t) for t in primals]
    kw = dict(dropout=0.3, training=True) if with_dropout else {}

    def ours(x, a_src, a_dst, el):
        torch.manual_seed(11)
        return tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, return_attention=True, **kw)

    _, alpha = ours(*primals)
    keep = (alpha != 0) if with_dropout else None
    scale = 1 / 0.7 if with_dropout else 1.0

    def theirs(x, a_src, a_dst, el):
        return gat_reference(x, a_src, a_dst, ei, nd, 0.2, el, keep, scale)

    (_, t_ours) = jvp(ours, tuple(primals), tuple(tangents))
    (_, t_ref) = jvp(theirs, tuple(primals), tuple(tangents))
    for a, b in zip(t_ours, t_ref):
        torch.testing.assert_close(a, b)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(p, t) for p, t in zip(primals, tangents)]
        out, alpha = ours(*duals)
        torch.testing.assert_close(forward_ad.unpack_dual(out).tangent, t_ref[0])
        torch.testing.assert_close(forward_ad.unpack_dual(alpha).tangent, t_ref[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,channels", [(8, 32), (3, 5)])
def test_float32_wide_scores_and_masked_edges(heads, channels, device):
    """Scores hundreds apart (weights that underflow to 0 in float32, the CPU exp's clamp
    range) and -inf edge logits (masked edges, one destination with all its edges masked, whose
    output is NaN as in the reference's softmax over all -inf)."""
    ei, ns, nd = make_graph("skewed", torch.int64, device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), heads, channels, torch.float32, device)
    masked = int(ei[1, 0])  # a destination with edges, all of them masked below
    with torch.no_grad():
        a_src.mul_(60.0)
        a_dst.mul_(60.0)
        el[::7] = float("-inf")
        el[ei[1] == masked] = float("-inf")
    out, alpha = tg.gat_attention(x, a_src, a_dst, graph, 0.2, el, return_attention=True)
    x64, as64, ad64, el64 = (t.detach().double().requires_grad_() for t in (x, a_src, a_dst, el))
    ref, ref_alpha = gat_reference(x64, as64, ad64, ei, nd, 0.2, el64)
    # float32 scores of size ~200 carry rounding errors of ~1e-5, hence the looser tolerance.
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    torch.testing.assert_close(alpha.double(), ref_alpha, atol=1e-4, rtol=1e-4, equal_nan=True)
    assert torch.isnan(out[masked]).all()
    assert not torch.isnan(out[torch.arange(nd, device=device) != masked]).any()
    masked_edges = torch.zeros(ei.size(1), dtype=torch.bool, device=device)
    masked_edges[::7] = True
    assert (alpha[masked_edges & (ei[1] != masked)] == 0).all()
    assert ((ref_alpha > 0) & (ref_alpha < 1e-30)).any()  # some weights do underflow
    # Gradients, with the all-masked destination's output gradient zero (NaN there otherwise).
    go = torch.randn(out.shape, dtype=torch.float64, device=device)
    go[masked] = 0
    ours = grads_of(out, (x, a_src, a_dst), go.float())
    theirs = grads_of(ref.nan_to_num(0.0), (x64, as64, ad64), go)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.double().nan_to_num(0.0), b.nan_to_num(0.0), atol=1e-4, rtol=1e-4)


def test_nan_and_inf_propagate_locally():
    ei = torch.tensor([[0, 1, 2, 2], [0, 0, 1, 2]])
    graph = tg.BipartiteCSC.from_edge_index(ei, 3, 4)
    x, a_src, a_dst, _ = make_inputs(3, 4, 4, 1, 2, torch.float32, "cpu", edge_logits=False)
    x, a_src, a_dst = x.detach(), a_src.detach(), a_dst.detach()
    x[1, 0, 0] = float("nan")
    out = tg.gat_attention(x, a_src, a_dst, graph)
    ref, _ = gat_reference(x, a_src, a_dst, ei, 4)
    torch.testing.assert_close(out, ref, equal_nan=True)
    assert torch.isnan(out[0, 0, 0]) and not torch.isnan(out[1:]).any()
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # no incoming edge
    a_src[2, 0] = float("inf")
    out = tg.gat_attention(x, a_src, a_dst, graph)
    ref, _ = gat_reference(x, a_src, a_dst, ei, 4)
    torch.testing.assert_close(out, ref, equal_nan=True)


def test_empty_sizes():
    graph = tg.BipartiteCSC.from_edge_index(torch.zeros(2, 0, dtype=torch.long), 0, 0)
    x = torch.zeros(0, 2, 3, requires_grad=True)
    a = torch.zeros(0, 2, requires_grad=True)
    out = tg.gat_attention(x, a, a, graph)
    assert out.shape == (0, 2, 3)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_edge_order_gradient_is_the_inverse_permutation():
    """graph.edge_order (per-edge tensors into CSC order, used for edge logits, edge weights and
    GATv2 edge features) is differentiable through a gather with the inverse permutation, not
    index_select's scatter-add: the same values, gradients, double backward, forward mode, vmap
    as index_select (under torch.compile it is index_select)."""
    from torch.autograd import gradcheck, gradgradcheck
    from torch.func import jacrev, vmap
    gen = torch.Generator().manual_seed(0)
    g = tg.BipartiteCSC.from_edge_index(torch.randint(0, 9, (2, 40), generator=gen), 9, 9)
    assert not torch.equal(g.perm, torch.arange(40))
    v = torch.randn(40, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    plain = lambda t: t.index_select(0, g.perm)  # noqa: E731
    out = g.edge_order(v)
    assert torch.equal(out, plain(v)) and type(out.grad_fn).__name__ == "_EdgePermutationBackward"
    w = torch.randn(40, 3, dtype=torch.float64, generator=gen)
    assert torch.equal(torch.autograd.grad(out, v, w)[0], torch.autograd.grad(plain(v), v, w)[0])
    assert gradcheck(g.edge_order, (v,), check_forward_ad=True)
    assert gradgradcheck(g.edge_order, (v,))
    vb = torch.randn(4, 40, 3, dtype=torch.float64, generator=gen)
    assert torch.equal(vmap(g.edge_order)(vb), vb.index_select(1, g.perm))
    assert torch.equal(jacrev(g.edge_order)(v), jacrev(plain)(v))
    assert torch.equal(jvp(g.edge_order, (v,), (vb[0],))[1], plain(vb[0]))
    compiled = torch.compile(g.edge_order, fullgraph=True, backend="aot_eager")
    assert torch.equal(torch.autograd.grad(compiled(v), v, w)[0], torch.autograd.grad(plain(v), v, w)[0])
    assert torch.equal(g.original_order(g.edge_order(v)), v)


def test_self_loop_handling_leaves_the_inputs_loops_out():
    """csc_from_edges(self_loops=L) (PyG's remove_self_loops + add_self_loops, what the layers
    use): eagerly, the input's own loops are left out of the graph (no extra destination row),
    while per-edge tensors keep their processed order of E + L rows; with static shapes (under
    torch.compile) they sit in a trash row instead. Both give the same edges, outputs, gradients
    and attention, and the attention of a left-out loop is zero."""
    from torch.autograd import gradcheck, gradgradcheck
    from torch.func import vmap
    from torch_gradops.graph import csc_from_edges
    gen = torch.Generator().manual_seed(3)
    n, L, H, C = 12, 10, 2, 3
    ei = torch.randint(0, n, (2, 50), generator=gen)
    ei[:, [3, 17, 30]] = torch.tensor([[2, 11, 2], [2, 11, 2]])  # loops (one at a node >= L, one twice)
    ei[:, 40] = ei[:, 5]  # a duplicate edge is kept
    E, is_loop = ei.size(1), ei[0] == ei[1]
    eager = csc_from_edges(ei[0], ei[1], n, n, self_loops=L)
    static = csc_from_edges(ei[0], ei[1], n, n, self_loops=L, static_shapes=True)
    assert (eager.num_dst, static.num_dst) == (n, n + 1)
    assert eager.num_input_edges == static.num_input_edges == static.num_edges == E + L
    assert eager.num_edges == E - int(is_loop.sum()) + L
    real = static.dst_index() < n  # the static graph's edges outside its trash row
    for t in ("dst_index", "indices", "perm"):
        a, b = getattr(eager, t), getattr(static, t)
        a, b = (a(), b()) if callable(a) else (a, b)
        assert torch.equal(a, b[real]), t
    # the edge set is PyG's: every non-loop input edge once, then the loops (i, i) for i < L
    pairs = torch.cat([ei, torch.arange(L).repeat(2, 1)], 1)  # processed edge ids
    keep = torch.cat([~is_loop, torch.ones(L, dtype=torch.bool)])
    assert sorted(eager.perm.tolist()) == keep.nonzero().flatten().tolist()
    assert torch.equal(pairs[:, eager.perm.long()], torch.stack([eager.indices, eager.dst_index()]).long())

    x, a_src, a_dst, el = make_inputs(n, n, E + L, H, C, torch.float64, "cpu")
    out, alpha = tg.gat_attention(x, a_src, a_dst, eager, edge_logits=el, return_attention=True)
    pad = torch.cat([a_dst, a_dst.new_zeros(1, H)])
    out_s, alpha_s = tg.gat_attention(x, a_src, pad, static, edge_logits=el, return_attention=True)
    torch.testing.assert_close(out, out_s[:n], rtol=0, atol=1e-14)
    assert alpha.shape == (E + L, H) and torch.equal(alpha[~keep], torch.zeros_like(alpha[~keep]))
    torch.testing.assert_close(alpha[keep], alpha_s[keep], rtol=0, atol=1e-14)
    w = torch.randn(n, H, C, generator=gen, dtype=torch.float64)
    wa = torch.randn(E + L, H, generator=gen, dtype=torch.float64)
    got = grads_of((out, alpha), (x, a_src, a_dst, el), (w, wa))
    want = grads_of((out_s[:n], alpha_s * keep[:, None]), (x, a_src, a_dst, el), (w, wa))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=0, atol=1e-13)
    assert torch.equal(got[3][~keep], torch.zeros_like(got[3][~keep]))

    # the reorderings themselves: left-out rows dropped one way, zero-filled the other
    v = torch.randn(E + L, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.equal(eager.original_order(eager.edge_order(v)), v * keep[:, None])
    assert gradcheck(eager.edge_order, (v,), check_forward_ad=True) and gradgradcheck(eager.edge_order, (v,))
    u = torch.randn(eager.num_edges, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    assert gradcheck(eager.original_order, (u,), check_forward_ad=True)
    assert gradgradcheck(eager.original_order, (u,))
    vb = torch.randn(3, E + L, 2, dtype=torch.float64, generator=gen)
    assert torch.equal(vmap(eager.edge_order)(vb), vb.index_select(1, eager.perm))
    with pytest.raises(ValueError, match="num_input_edges"):
        tg.BipartiteCSC(eager.indptr, eager.indices, n, num_input_edges=E + L)
    with pytest.raises(ValueError, match="num_input_edges"):
        tg.BipartiteCSC(eager.indptr, eager.indices, n, eager.perm, num_input_edges=eager.num_edges - 1)
    with pytest.raises(ValueError, match=r"edge_logits must have shape \[E, heads\]"):
        tg.gat_attention(x, a_src, a_dst, eager, edge_logits=el[:eager.num_edges])

def test_graph_construction_and_validation():
    ei = torch.tensor([[0, 2, 1, 0], [1, 0, 1, 2]])
    g = tg.BipartiteCSC.from_edge_index(ei)
    assert (g.num_src, g.num_dst, g.num_edges) == (3, 3, 4)
    assert g.indptr.tolist() == [0, 1, 3, 4]
    assert g.indices.tolist() == [2, 0, 1, 0]
    assert g.perm.tolist() == [1, 0, 2, 3]
    rev = g.reverse_index()
    assert rev is g.reverse_index()  # built once
    assert rev.indptr.tolist() == [0, 2, 3, 4]
    assert g.indices[rev.edge].tolist() == [0, 0, 1, 2]
    vals = torch.arange(4.0)
    assert torch.equal(g.original_order(g.edge_order(vals)), vals)
    same = tg.BipartiteCSC.from_csc(g.indptr, g.indices, 3)
    assert same.perm is None
    with pytest.raises(IndexError, match="indices"):
        tg.BipartiteCSC.from_csc(torch.tensor([0, 1]), torch.tensor([5]), 3)
    with pytest.raises(IndexError, match="indices"):
        tg.BipartiteCSC.from_csc(torch.tensor([0, 1]), torch.tensor([-1]), 3)
    with pytest.raises(ValueError, match="monotone"):
        tg.BipartiteCSC.from_csc(torch.tensor([0, 2, 1, 3]), torch.tensor([0, 0, 0]), 3)
    with pytest.raises(ValueError, match=r"indptr\[-1\]"):
        tg.BipartiteCSC.from_csc(torch.tensor([0, 1]), torch.tensor([0, 0]), 3)
    with pytest.raises(TypeError, match="int32 or int64"):
        tg.BipartiteCSC.from_csc(torch.tensor([0.0, 1.0]), torch.tensor([0]), 3)
    with pytest.raises(TypeError, match="share one dtype"):
        tg.BipartiteCSC.from_csc(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0]), 3)
    with pytest.raises(ValueError, match=r"\[2, E\]"):
        tg.BipartiteCSC.from_edge_index(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(IndexError, match="destinations"):
        tg.BipartiteCSC.from_edge_index(torch.tensor([[0], [5]]), 1, 2)
    with pytest.raises(IndexError, match="indices"):
        tg.BipartiteCSC.from_edge_index(torch.tensor([[4], [0]]), 2, 2)


def test_edge_list_and_perm_validation_names_the_argument():
    from torch_gradops.graph import csc_from_edges
    with pytest.raises(TypeError, match="src must hold integer node ids"):
        csc_from_edges(torch.tensor([0.9, 1.7]), torch.tensor([1, 0]), 2, 2)  # was truncated to [0, 1]
    with pytest.raises(TypeError, match="dst must hold integer node ids"):
        csc_from_edges(torch.tensor([0, 1]), torch.tensor([True, False]), 2, 2)
    with pytest.raises(ValueError, match="one entry per edge"):
        csc_from_edges(torch.tensor([0]), torch.tensor([0, 1, 1]), 2, 2)  # was a graph of 1 edge, indptr [0,1,3]
    with pytest.raises(ValueError, match="one entry per edge"):
        csc_from_edges(torch.tensor([[0, 1]]), torch.tensor([[0, 1]]), 2, 2)
    with pytest.raises(ValueError, match="self_loops"):
        csc_from_edges(torch.tensor([0, 1]), torch.tensor([1, 0]), 2, 2, self_loops=-1)
    g = csc_from_edges(torch.tensor([0, 1], dtype=torch.int16), torch.tensor([1, 0], dtype=torch.uint8), 2, 2)
    assert g.indices.tolist() == [1, 0]  # other integer dtypes stay accepted
    ip, ix = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    with pytest.raises(IndexError, match="perm"):
        tg.BipartiteCSC(ip, ix, 2, perm=torch.tensor([0, -1]))  # was accepted, wrapping in index_put_
    with pytest.raises(IndexError, match="perm"):
        tg.BipartiteCSC(ip, ix, 2, perm=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="distinct"):
        tg.BipartiteCSC(ip, ix, 2, perm=torch.tensor([1, 1]))
    assert tg.BipartiteCSC(ip, ix, 2, perm=torch.tensor([1, 3]), num_input_edges=4).num_input_edges == 4


@pytest.mark.parametrize("edit", ["indices", "indptr", "perm"])
def test_cached_graph_indices_follow_in_place_edits(edit):
    # The reverse index, destinations and inverse permutation are cached on the graph; an
    # in-place edit of its tensors made the next backward use the stale ones (wrong gradients).
    from torch_gradops.graph import csc_from_edges
    torch.manual_seed(0)
    g = csc_from_edges(torch.tensor([0, 1, 2, 3, 0, 1]), torch.tensor([0, 0, 1, 1, 2, 3]), 4, 4)
    if edit == "perm":
        g = tg.BipartiteCSC.from_edge_index(torch.tensor([[0, 1, 2, 3, 0, 1], [2, 0, 0, 1, 1, 3]]), 4, 4)
    x = torch.randn(4, 1, 2, dtype=torch.float64, requires_grad=True)
    a = torch.randn(4, 1, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 1, dtype=torch.float64)
    el = torch.randn(6, 1, dtype=torch.float64, requires_grad=True)

    def grads(graph):
        out = tg.gat_attention(x, a, b, graph, edge_logits=el)
        return torch.autograd.grad(out.pow(2).sum(), (x, a, el))

    grads(g)  # builds and caches the derived indices
    with torch.no_grad():
        if edit == "indices":
            g.indices[0], g.indices[2] = 3, 0
        elif edit == "indptr":
            g.indptr[1] = 1
        else:
            g.perm[0], g.perm[1] = g.perm[1].item(), g.perm[0].item()
    fresh = tg.BipartiteCSC(g.indptr.clone(), g.indices.clone(), 4, None if g.perm is None else g.perm.clone())
    for got, want in zip(grads(g), grads(fresh)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch.save"])
def test_copied_graph_drops_indices_made_stale_before_the_copy(how):
    # A copy does not keep version counters (a loaded tensor counts from its own start), but it
    # kept the cached reverse index and the counters seen when it was built: with arrays filled
    # in place once (versions (1, 1), the usual way to build them), an index gone stale before
    # the copy matched the copy's counters and gave wrong gradients silently.
    import copy
    import io
    import pickle
    n = 6
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    indptr[1:] = torch.full((n,), 2).cumsum(0)
    indices = torch.empty(2 * n, dtype=torch.int64)
    indices[:] = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 0])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    a_s, a_d = torch.randn(n, 1, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)

    def grad(graph):
        return torch.autograd.grad(tg.gat_attention(x, a_s, a_d, graph).square().sum(), x)[0]

    def saved(o):
        buf = io.BytesIO()
        torch.save(o, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    copier = {"pickle": lambda o: pickle.loads(pickle.dumps(o)), "deepcopy": copy.deepcopy, "torch.save": saved}[how]
    graph = tg.BipartiteCSC.from_csc(indptr, indices, n)
    assert graph._versions() == (1, 1)
    grad(graph)  # builds the reverse index
    with torch.no_grad():
        graph.indices[:] = torch.tensor([5, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 5])
    clone = copier(graph)
    want = grad(tg.BipartiteCSC.from_csc(clone.indptr.clone(), clone.indices.clone(), n))
    torch.testing.assert_close(grad(clone), want, rtol=0, atol=0)
    # a current index survives the copy and serves it
    fresh = copier(clone)
    assert fresh._reverse is not None
    torch.testing.assert_close(grad(fresh), want, rtol=0, atol=0)


def test_gat_backward_never_reads_unwritten_workspace():
    # The raw op trusts its reverse index to be the graph's; one that misses edges left the CPU
    # kernel's [E, H] workspace uninitialised there, and those gradients came back as garbage
    # that changed from call to call. Now they are zero, the same on every call.
    ops = torch.ops.torch_gradops
    N, H, C = 4, 2, 3
    x, a_s, a_d, el = torch.randn(N, H, C), torch.randn(N, H), torch.randn(N, H), torch.randn(N, H)
    ip, ix = torch.arange(N + 1), torch.arange(N)
    out, lse, _ = ops.gat_forward(x, a_s, a_d, el, ip, ix, None, 0.2, 1.0, False)
    zero = torch.zeros(N, dtype=torch.long)
    results = []
    for _ in range(3):
        torch.full((1 << 16,), 1e30)  # recycle memory with junk
        g = ops.gat_backward(torch.ones(N, H, C), None, out, lse, x, a_s, a_d, el, ip, ix, ip, zero, zero,
                             None, 0.2, 1.0, [False, False, True, True])
        results.append((g[2].clone(), g[3].clone()))
        assert torch.isfinite(g[2]).all() and torch.isfinite(g[3]).all()
        assert (g[3][1:] == 0).all()  # the edges the reverse index misses
    for r in results[1:]:
        assert all(torch.equal(u, v) for u, v in zip(r, results[0]))


def test_gat_backward_fake_kernel_matches_without_edge_logits():
    ops = torch.ops.torch_gradops
    N, H, C = 4, 2, 3
    x, a_s, a_d = torch.randn(N, H, C), torch.randn(N, H), torch.randn(N, H)
    ip, ix = torch.arange(N + 1), torch.arange(N)
    out, lse, _ = ops.gat_forward(x, a_s, a_d, None, ip, ix, None, 0.2, 1.0, False)
    args = (torch.ones(N, H, C), None, out, lse, x, a_s, a_d, None, ip, ix, ip, ix, ix, None, 0.2, 1.0, [True] * 4)
    assert ops.gat_backward(*args)[3].shape == (0,)
    torch.library.opcheck(ops.gat_backward.default, args, test_utils=("test_faketensor",))


def test_cugraph_compat_errors_name_the_argument():
    g = tg.BipartiteCSC.from_edge_index(torch.tensor([[0, 1], [1, 0]]), 2, 2)
    feat = torch.randn(2, 6)
    for fn, att in ((tg.mha_gat_n2n, torch.randn(12)), (tg.mha_gat_v2_n2n, torch.randn(6))):
        for heads in (0, -2, 1.5, True):
            with pytest.raises(ValueError, match="num_heads must be a positive int"):
                fn(feat, att, g, num_heads=heads)  # 0 was a ZeroDivisionError
        with pytest.raises(TypeError, match="attn_weights"):
            fn(feat, att.double(), g, num_heads=2)  # was reported as "a_src ... dtype"
        with pytest.raises(ValueError, match="edge_feat must have shape"):
            fn(feat, torch.randn(att.numel() * 3 // 2 if fn is tg.mha_gat_n2n else 6), g, num_heads=2,
               edge_feat=torch.randn(5, 6))  # was reported as "edge_logits must have shape"
        # numpy integers are ints; mixed dtypes were promoted silently by mha_gat_n2n
        assert fn(feat, att, g, num_heads=np.int64(2)).shape == fn(feat, att, g, num_heads=2).shape
        with pytest.raises(TypeError, match=r"the destination features \(torch.float64\) must have feat's dtype"):
            fn((feat, feat[:2].double()), att, g, num_heads=2)
        with pytest.raises(TypeError, match=r"edge_feat \(torch.float64\) must have feat's dtype"):
            fn(feat, torch.randn(att.numel() * 3 // 2 if fn is tg.mha_gat_n2n else 6), g, num_heads=2,
               edge_feat=torch.randn(2, 6, dtype=torch.float64))


def test_graph_counts_and_per_edge_rows_are_checked():
    """``BipartiteCSC``: a count that is not an int (1.7 became 1, None a raw int() error) and
    per-edge tensors with the wrong number of rows (``original_order`` silently returned the
    edges' rows, ``edge_order`` a bare IndexError) are errors naming the argument."""
    ei = torch.tensor([[0, 1, 2], [2, 0, 1]])
    g = tg.BipartiteCSC.from_edge_index(ei, 3, 3)
    for bad in (1.7, 3.0, None, True):
        with pytest.raises(TypeError, match="num_src must be an int"):
            tg.BipartiteCSC.from_csc(g.indptr, g.indices, bad)
    with pytest.raises(TypeError, match="num_dst must be an int"):
        tg.BipartiteCSC.from_edge_index(ei, 3, 2.5)
    assert tg.BipartiteCSC.from_csc(g.indptr, g.indices, np.int64(3)).num_src == 3
    with pytest.raises(ValueError, match=r"original_order: values must have one row per edge \(num_edges = 3\)"):
        g.original_order(torch.randn(5, 2))
    with pytest.raises(ValueError, match=r"edge_order: values must have one row per edge \(num_input_edges = 3\)"):
        g.edge_order(torch.randn(2, 2))
    x = torch.randn(3, 2)
    torch.testing.assert_close(g.original_order(g.edge_order(x)), x)


def test_bad_op_inputs_raise_clear_errors():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = (t.detach() for t in make_inputs(ns, nd, ei.size(1), 2, 3, torch.float32, "cpu"))
    cases = [
        (dict(x_src=x.double()), TypeError, "a_src .* must have the dtype of x_src"),
        (dict(x_src=x.long()), TypeError, "x_src must be float"),
        (dict(x_src=x[:, :1]), ValueError, "a_src must have shape"),
        (dict(x_src=x.reshape(ns, -1)), ValueError, r"x_src must have shape \[num_src, heads, channels\]"),
        (dict(a_dst=a_dst[:-1]), ValueError, "graph.num_dst"),
        (dict(a_dst=a_dst[:, :1]), ValueError, "a_dst must have shape"),
        (dict(x_src=x[:-1], a_src=a_src[:-1]), ValueError, "graph.num_src"),
        (dict(edge_logits=el[:-1]), ValueError, "edge_logits must have shape"),
        (dict(edge_logits=el.double()), TypeError, "edge_logits"),
        # half features take float32 logits, all of one dtype
        (dict(x_src=x.half(), a_src=a_src.double(), a_dst=a_dst.double(), edge_logits=None), TypeError,
         r"a_src .* must have the dtype of x_src \(torch.float16\) or float32"),
        (dict(x_src=x.half(), a_dst=a_dst.half()), TypeError, r"a_dst .* must have the dtype of a_src"),
        (dict(x_src=x.half(), edge_logits=el.half()), TypeError, r"edge_logits .* must have the dtype of a_src"),
        (dict(dropout=-0.1), ValueError, "dropout must be in"),
        (dict(dropout=1.5), ValueError, "dropout must be in"),
        (dict(graph=ei), TypeError, "graph must be a torch_gradops.BipartiteCSC"),
        (dict(a_src=a_src.to("meta")), ValueError, "a_src .* must be on the device of x_src"),
    ]
    base = dict(x_src=x, a_src=a_src, a_dst=a_dst, graph=graph, edge_logits=el)
    for override, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            tg.gat_attention(**{**base, **override})
    # the raw op checks too, naming the argument
    ops = torch.ops.torch_gradops
    with pytest.raises(RuntimeError, match="indptr must have num_dst \\+ 1"):
        ops.gat_forward(x, a_src, a_dst, None, graph.indptr[:-1], graph.indices, None, 0.2, 1.0, False)
    bad_indices = graph.indices.clone()
    bad_indices[0] = ns + 5
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gat_forward(x, a_src, a_dst, None, graph.indptr, bad_indices, None, 0.2, 1.0, False)
    # pointers that stop short of E (every per-node range valid) or do not start at 0
    short = graph.indptr.clone()
    short[-1] -= 1
    with pytest.raises(RuntimeError, match="indptr must start at 0 and end at E"):
        ops.gat_forward(x, a_src, a_dst, None, short, graph.indices, None, 0.2, 1.0, False)
    # edges but no destination: refused before any backend runs (the CUDA forward returned an
    # uninitialised alpha, its backward's reverse-index assert aborted the CUDA context)
    E = graph.indices.numel()
    no_dst = (a_dst[:0], None, torch.full((1,), E, dtype=graph.indptr.dtype), graph.indices)
    with pytest.raises(RuntimeError, match="a_dst has no destinations"):
        ops.gat_forward(x, a_src, *no_dst, None, 0.2, 1.0, True)
    # and edges but no source (the CUDA kernels' range asserts would abort the context)
    with pytest.raises(RuntimeError, match="x_src has no sources for them"):
        ops.gat_forward(x[:0], a_src[:0], a_dst, None, graph.indptr, graph.indices, None, 0.2, 1.0, False)
    rev = graph.reverse_index()
    with pytest.raises(RuntimeError, match="a_dst has no destinations"):
        ops.gat_backward(torch.zeros(0, *x.shape[1:]), None, torch.zeros(0, *x.shape[1:]),
                         torch.zeros(0, x.size(1)), x, a_src, *no_dst, rev.indptr, rev.edge, rev.dst, None, 0.2,
                         1.0, [True] * 4)
    rev_indptr, rev_edge, rev_dst = rev.indptr, rev.edge, rev.dst
    out, lse, _ = ops.gat_forward(x, a_src, a_dst, None, graph.indptr, graph.indices, None, 0.2, 1.0, False)
    args = (torch.ones_like(out), None, out, lse, x, a_src, a_dst, None, graph.indptr, graph.indices)
    late = rev_indptr.clone()
    late[0] = 1
    with pytest.raises(RuntimeError, match="rev_indptr must start at 0 and end at E"):
        ops.gat_backward(*args, late, rev_edge, rev_dst, None, 0.2, 1.0, [True, True, True, False])
    with pytest.raises(RuntimeError, match=r"a_dst \(Half\) must have the dtype of a_src \(Float\)"):
        ops.gat_forward(x.half(), a_src, a_dst.half(), None, graph.indptr, graph.indices, None, 0.2, 1.0, False)
    with pytest.raises(RuntimeError, match=r"a_src must have the dtype of x_src \(Half\) or float32, got Double"):
        ops.gat_forward(x.half(), a_src.double(), a_dst.double(), None, graph.indptr, graph.indices, None, 0.2, 1.0,
                        False)
    with pytest.raises(RuntimeError, match="out must have the dtype of x_src"):
        ops.gat_backward(*args[:2], out.double(), *args[3:], rev_indptr, rev_edge, rev_dst, None, 0.2, 1.0,
                         [True, True, True, False])


def test_cuda_tensor_without_cuda_build_is_a_clear_error(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torch_gradops.library as lib

    monkeypatch.setattr(lib, "built_with_cuda", lambda: False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 1, 2, device="cuda")
    with pytest.raises(RuntimeError, match="built without CUDA support"):
        lib.check_backend(x, "x_src")


def test_build_facts_trace_under_torch_compile():
    # The wrappers ask built_with_cuda() for every CUDA input; Dynamo cannot trace into the
    # pybind function, so a compiled CUDA model broke its graph there (seen on an H100).
    f = torch.compile(lambda t: t + 1 if tg.built_with_cuda() else t - 1, fullgraph=True, backend="eager")
    expected = 2.0 if tg.built_with_cuda() else 0.0
    assert f(torch.ones(1)).item() == expected


def test_opcheck():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    x, a_src, a_dst, el = (t.detach() for t in make_inputs(ns, nd, ei.size(1), 2, 3, torch.float32, "cpu"))
    el = graph.edge_order(el)
    mask = torch.rand(ei.size(1), 2) > 0.3
    ops = torch.ops.torch_gradops
    for args in [
        (x, a_src, a_dst, el, graph.indptr, graph.indices, None, 0.2, 1.0, True),
        (x, a_src, a_dst, None, graph.indptr, graph.indices, mask, 0.1, 1.5, False),
    ]:
        torch.library.opcheck(ops.gat_forward.default, args)
    out, lse, _ = ops.gat_forward(x, a_src, a_dst, el, graph.indptr, graph.indices, mask, 0.2, 1.5, False)
    rev = graph.reverse_index()
    go = torch.randn_like(out)
    for mask_out in ([True, True, True, True], [True, False, False, False], [False, True, True, False]):
        torch.library.opcheck(ops.gat_backward.default,
                              (go, None, out, lse, x, a_src, a_dst, el, graph.indptr, graph.indices,
                               rev.indptr, rev.edge, rev.dst, mask, 0.2, 1.5, mask_out))
    # half features with float32 logits: alpha and the logits' gradients are float32
    xh = x.to(torch.bfloat16)
    torch.library.opcheck(ops.gat_forward.default, (xh, a_src, a_dst, el, graph.indptr, graph.indices, mask, 0.2,
                                                    1.5, True))
    out_h, lse_h, alpha_h = ops.gat_forward(xh, a_src, a_dst, el, graph.indptr, graph.indices, mask, 0.2, 1.5, True)
    assert out_h.dtype == torch.bfloat16 and alpha_h.dtype == torch.float32
    for mask_out in ([True] * 4, [True, False, True, False], [False, True, False, True]):
        for edge_logits in (el, None):  # (without edge logits, their gradient is skipped whatever the mask)
            torch.library.opcheck(ops.gat_backward.default,
                                  (out_h.clone(), torch.randn_like(alpha_h), out_h, lse_h, xh, a_src, a_dst,
                                   edge_logits, graph.indptr, graph.indices, rev.indptr, rev.edge, rev.dst, mask, 0.2,
                                   1.5, mask_out))
    # non-contiguous inputs (transposed views): the kernels return contiguous gradients, and so
    # must the fake kernel (Inductor checks the strides)
    x_t, a_src_t = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (x, a_src))
    assert not x_t.is_contiguous() and not a_src_t.is_contiguous()
    torch.library.opcheck(ops.gat_backward.default,
                          (go, None, out, lse, x_t, a_src_t, a_dst, el, graph.indptr, graph.indices,
                           rev.indptr, rev.edge, rev.dst, mask, 0.2, 1.5, [True, True, True, True]))


def test_torch_compile_fullgraph_matches_eager():
    ei, ns, nd = make_graph("random")
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    graph.reverse_index()
    x, a_src, a_dst, el = make_inputs(ns, nd, ei.size(1), 2, 8, torch.float32, "cpu")
    w = torch.randn(8, 8)

    def f(x, a_src, a_dst, el):
        out = tg.gat_attention(x @ w, a_src, a_dst, graph, 0.2, el)
        return torch.nn.functional.elu(out).sum(dim=(1, 2))

    compiled = torch.compile(f, fullgraph=True)
    eager = f(x, a_src, a_dst, el)
    got = compiled(x, a_src, a_dst, el)
    torch.testing.assert_close(got, eager)
    ge = torch.autograd.grad(eager.sum(), (x, a_src, a_dst, el))
    gc = torch.autograd.grad(compiled(x, a_src, a_dst, el).sum(), (x, a_src, a_dst, el))
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_mha_gat_n2n_matches_manual_composition():
    ei, ns, nd = make_graph("random", seed=9)
    n = max(ns, nd)
    graph = tg.BipartiteCSC.from_edge_index(ei, n, n)
    heads, c = 3, 4
    feat = torch.randn(n, heads * c, dtype=torch.float64, requires_grad=True)
    att = torch.randn(3 * heads * c, dtype=torch.float64, requires_grad=True)
    efeat = torch.randn(ei.size(1), heads * c, dtype=torch.float64)
    out = tg.mha_gat_n2n(feat, att, graph, num_heads=heads, edge_feat=efeat)
    xs = feat.view(n, heads, c)
    a = att.view(3, heads, c)
    ref, _ = gat_reference(xs, (xs * a[0]).sum(-1), (xs * a[1]).sum(-1), ei, n, 0.2,
                           (efeat.view(-1, heads, c) * a[2]).sum(-1))
    torch.testing.assert_close(out, ref.reshape(n, heads * c))
    mean = tg.mha_gat_n2n(feat, att[: 2 * heads * c], graph, num_heads=heads, concat_heads=False)
    ref2, _ = gat_reference(xs, (xs * a[0]).sum(-1), (xs * a[1]).sum(-1), ei, n)
    torch.testing.assert_close(mean, ref2.mean(1))
    torch.autograd.gradcheck(lambda f, w: tg.mha_gat_n2n(f, w, graph, num_heads=heads, edge_feat=efeat),
                             (feat, att))
    with pytest.raises(ValueError, match="attn_weights"):
        tg.mha_gat_n2n(feat, att[:5], graph, num_heads=heads)
    with pytest.raises(ValueError, match="activation"):
        tg.mha_gat_n2n(feat, att, graph, num_heads=heads, activation="ELU", edge_feat=efeat)
    # malformed destination or edge features are refused, not reinterpreted by a reshape
    with pytest.raises(ValueError, match=r"destination features must have shape \[n_dst, 12\]"):
        tg.mha_gat_n2n((feat, torch.randn(2 * n, 6, dtype=torch.float64)), att[: 2 * heads * c], graph,
                       num_heads=heads)
    with pytest.raises(ValueError, match=r"edge_feat must have shape \[E = \d+, num_heads\*C = 12\]"):
        tg.mha_gat_n2n(feat, att, graph, num_heads=heads, edge_feat=torch.randn(ei.size(1), 2 * heads * c))
    with pytest.raises(ValueError, match="feat must be a tensor or a"):
        tg.mha_gat_n2n((feat, feat, feat), att, graph, num_heads=heads)
    # cugraph-ops' gradient options are accepted (and need nothing: always deterministic, and
    # accumulated in float32 for half types)
    flags = dict(deterministic_dgrad=True, deterministic_wgrad=True, high_precision_dgrad=True,
                 high_precision_wgrad=True)
    torch.testing.assert_close(tg.mha_gat_n2n(feat, att, graph, num_heads=heads, edge_feat=efeat, **flags), out,
                               rtol=0, atol=0)
    # feature rows that do not match the graph are named as feat's
    wide = tg.BipartiteCSC.from_edge_index(torch.tensor([[0, 1], [2, 0]]), 2, 3)  # 2 sources, 3 destinations
    with pytest.raises(ValueError, match=r"feat has 2 rows, fewer than the graph's num_dst = 3"):
        tg.mha_gat_n2n(feat[:2], att[: 2 * heads * c], wide, num_heads=heads)
    with pytest.raises(ValueError, match=r"feat has \d+ rows, but the graph has num_src"):
        tg.mha_gat_n2n(torch.cat([feat, feat]), att, graph, num_heads=heads, edge_feat=efeat)
    with pytest.raises(ValueError, match=r"feat\[1\] has \d+ rows, but the graph has num_dst"):
        tg.mha_gat_n2n((feat, feat[:1]), att, graph, num_heads=heads, edge_feat=efeat)
    with pytest.raises(ValueError, match=r"feat\[0\] has \d+ rows, but the graph has num_src"):
        tg.mha_gat_n2n((feat[:1], feat), att, graph, num_heads=heads, edge_feat=efeat)


EDGE_BATCH_SCRIPT = r"""
import sys, torch, torch_gradops
ops, device = torch.ops.torch_gradops, sys.argv[2]
g = torch.Generator().manual_seed(0)
ns, nd, H, C = 37, 40, 3, 40  # C > 32: a lane takes several channels; destination i has i % 10 edges
indptr = torch.cat([torch.zeros(1, dtype=torch.long), (torch.arange(nd) % 10).cumsum(0)])
E = int(indptr[-1])
indices = torch.randint(0, ns, (E,), generator=g)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
    for itype in (torch.int32, torch.int64):
        ip, ix = indptr.to(itype).to(device), indices.to(itype).to(device)
        x, a_src, a_dst, el = r(ns, H, C), r(ns, H), r(nd, H), r(E, H)
        el[::7] = float("-inf")  # masked edges, first ones of their destination among them
        mask = (torch.rand(E, H, generator=g) > 0.3).to(device)
        xd, att, ea, w = r(nd, H, C), r(H, C), r(E, 5), r(5, H, C)
        for m, scale in ((None, 1.0), (mask, 1 / 0.7)):
            key = (str(dtype), str(itype), m is not None)
            out[("gat",) + key] = ops.gat_forward(x, a_src, a_dst, el, ip, ix, m, 0.2, scale, True)
            out[("gatv2_edge",) + key] = ops.gatv2_forward(x, xd, att, ea, w, ip, ix, m, 0.2, scale, True)
            out[("gatv2",) + key] = ops.gatv2_forward(x, xd, att, None, None, ip, ix, m, 0.2, scale, True)
torch.save({k: [t.cpu() for t in v] for k, v in out.items()}, sys.argv[1])
"""


@pytest.mark.parametrize("device", DEVICES)
def test_forward_edge_batches_agree_bitwise(device, tmp_path):
    """The CUDA forward kernels fold edges in batches (GAT 4, GATv2 2) in the order of the one-edge
    schedule (TORCH_GRADOPS_CUDA_EDGE_BATCH=1, read once per process): out, lse and alpha must be
    the same bits under both, for every degree 0-9 (batch tails), -inf logits, a dropout mask,
    bfloat16 and int32 indices. On the CPU (one schedule) this checks the harness itself."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's torch_gradops
    base = {k: v for k, v in os.environ.items() if k != "TORCH_GRADOPS_CUDA_EDGE_BATCH"}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    runs = []
    for batch in (None, "1"):
        env = base if batch is None else dict(base, TORCH_GRADOPS_CUDA_EDGE_BATCH=batch)
        path = tmp_path / f"batch_{batch}.pt"
        subprocess.run([sys.executable, "-c", EDGE_BATCH_SCRIPT, str(path), device], check=True, env=env, cwd=root,
                       timeout=600)
        runs.append(torch.load(path))
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) == 24

    def bits(t):  # NaN-safe bitwise view
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    for key, tensors in runs[0].items():
        out, lse, alpha = tensors
        assert alpha.shape[0] == 180 and out.shape[0] == 40
        for a, b in zip(tensors, runs[1][key]):
            assert torch.equal(bits(a), bits(b)), key


@pytest.mark.parametrize("device", DEVICES)
def test_returned_attention_at_large_scores(device):
    """alpha from return_attention is exp(s - max) / sum: formed as exp(s - lse), float32 scores of
    1e6-1e8 lost the log-sum to lse's rounding (weights off by up to 0.5 against float64)."""
    ei, ns, nd = make_graph("random", seed=4)
    ei = ei.to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    g = torch.Generator().manual_seed(5)
    for scale in (1e2, 1e6, 1e8):
        x = torch.randn(ns, 2, 3, generator=g, dtype=torch.float64)
        a_src = torch.randn(ns, 2, generator=g, dtype=torch.float64) * scale
        a_dst = torch.randn(nd, 2, generator=g, dtype=torch.float64) * scale
        f32 = [t.float().to(device) for t in (x, a_src, a_dst)]
        _, alpha = tg.gat_attention(*f32, graph, return_attention=True)
        # the reference on the same float32 inputs, in float64 (the scores' own rounding apart)
        _, ref = gat_reference(*[t.double() for t in f32], ei, nd)
        torch.testing.assert_close(alpha.double(), ref, atol=2e-6, rtol=1e-5, msg=f"scale {scale:g}")


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_at_large_scores(device):
    """The backward forms its weights as exp(s - lse) from a float64 lse, split into two parts of
    the accumulation type, and every pass rounds a score's leaky_relu product on its own: with a
    float32 lse, or with the product fused into the next subtraction in one pass and not in
    another, scores of 1e4-1e8 put the weights (and so the gradients) off by up to 0.7. At these
    scales the softmax is nearly one-hot and the logits' gradients nearly zero: all three are
    compared at the scale of x_src's."""
    ei, ns, nd = make_graph("random", seed=4)
    ei = ei.to(device)
    graph = tg.BipartiteCSC.from_edge_index(ei, ns, nd)
    g = torch.Generator().manual_seed(8)
    for scale in (1e4, 1e6, 1e8):
        x = torch.randn(ns, 2, 3, generator=g)
        a_src, a_dst = torch.randn(ns, 2, generator=g) * scale, torch.randn(nd, 2, generator=g) * scale
        weight = torch.randn(nd, 2, 3, generator=g)
        f32 = [t.to(device).requires_grad_() for t in (x, a_src, a_dst)]
        f64 = [t.detach().double().requires_grad_() for t in f32]
        got = torch.autograd.grad((tg.gat_attention(*f32, graph) * weight.to(device)).sum(), f32)
        ref = torch.autograd.grad((gat_reference(*f64, ei, nd)[0] * weight.double().to(device)).sum(), f64)
        atol = 1e-4 * ref[0].abs().max().item()
        for name, a, b in zip(("x_src", "a_src", "a_dst"), got, ref):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=atol, msg=f"{name} at scale {scale:g}")
