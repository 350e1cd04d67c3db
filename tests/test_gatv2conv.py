"""torch_gradops.nn.GATv2Conv against torch_geometric.nn.GATv2Conv (PyG 2.8) with shared weights:
outputs, attention weights and gradients for every input form and option, dtypes, models."""
import copy

import pytest
import torch
from torch.autograd import forward_ad

pyg = pytest.importorskip("torch_geometric")

from torch_geometric import EdgeIndex  # noqa: E402
from torch_geometric.nn import GATv2Conv as PyGGATv2Conv  # noqa: E402
from torch_geometric.nn.models import GAT as PyGGAT  # noqa: E402
from torch_geometric.typing import WITH_TORCH_SPARSE  # noqa: E402
from torch_geometric.utils import to_torch_coo_tensor, to_torch_csc_tensor, to_torch_csr_tensor  # noqa: E402

from torch_gradops.nn import GAT, GATv2Conv, adjacency, convert  # noqa: E402
from pyg_helpers import (assert_sums_without_atomics, check_edge_attr_forms, check_explainer_masks_and_hooks,
                         check_loop_groups_are_cached, check_loop_groups_built_under_a_transform,
                         check_inference_pass_then_training,
                         check_uncoalesced_coo_adjacency, check_coo_adjacency_shared_with_pyg_layers,
                         check_coo_adjacency_flagged_coalesced_by_pyg, check_non_tensor_edge_index_is_refused,
                         check_edge_index_sparse_size, check_graph_edits_that_bypass_the_version_counter,
                         check_inference_tensor_graph_edits, close,
                         make_pair, random_graph, run_both)  # noqa: E402


def pair(in_channels, out_channels, seed=0, **kw):
    """PyG's GATv2Conv and ours with equal parameters."""
    return make_pair(PyGGATv2Conv, GATv2Conv, in_channels, out_channels, seed=seed, **kw)


CONFIGS = [
    dict(heads=1),
    dict(heads=8),
    dict(heads=8, concat=False),
    dict(heads=4, share_weights=True),
    dict(heads=4, residual=True),
    dict(heads=4, concat=False, residual=True),
    dict(heads=8, add_self_loops=False),
    dict(heads=2, bias=False),
    dict(heads=3, negative_slope=0.05),
]


@pytest.mark.parametrize("loops", [True, False], ids=["with_self_loops", "no_self_loops"])
@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_pyg(kw, loops):
    theirs, ours = pair(16, 8, **kw)
    run_both(theirs, ours, torch.randn(40, 16), random_graph(40, 40, 200, loops=loops))


@pytest.mark.parametrize("fill_value", [0.5, "mean", "add", "max", "min", "mul"])
@pytest.mark.parametrize("edge_dim", [1, 4])
def test_edge_features_match_pyg(edge_dim, fill_value):
    theirs, ours = pair(12, 6, heads=3, edge_dim=edge_dim, fill_value=fill_value)
    ei = random_graph(30, 30, 150)
    ea = torch.randn(150, edge_dim) if edge_dim > 1 else torch.randn(150)
    run_both(theirs, ours, torch.randn(30, 12), ei, edge_attr=ea)


def test_edge_features_without_self_loops_and_tensor_fill():
    theirs, ours = pair(12, 6, heads=2, edge_dim=3, add_self_loops=False)
    run_both(theirs, ours, torch.randn(30, 12), random_graph(30, 30, 120), edge_attr=torch.randn(120, 3))
    theirs, ours = pair(12, 6, heads=2, edge_dim=3, fill_value=torch.tensor([1.0, -2.0, 0.5]))
    run_both(theirs, ours, torch.randn(30, 12), random_graph(30, 30, 120), edge_attr=torch.randn(120, 3))


@pytest.mark.parametrize("share_weights", [False, True])
def test_bipartite_pair_input(share_weights):
    in_channels = 16 if share_weights else (16, 10)
    theirs, ours = pair(in_channels, 8, heads=4, share_weights=share_weights, residual=True)
    x = (torch.randn(25, 16), torch.randn(15, 16 if share_weights else 10))
    run_both(theirs, ours, x, random_graph(25, 15, 100))


@pytest.mark.parametrize("builder", [to_torch_coo_tensor, to_torch_csr_tensor, to_torch_csc_tensor],
                         ids=["coo", "csr", "csc"])
@pytest.mark.parametrize("loops", [True, False])
def test_torch_sparse_adjacency_matches_pyg(builder, loops):
    theirs, ours = pair(16, 8, heads=4, add_self_loops=loops)
    ei = torch.unique(random_graph(30, 30, 150), dim=1)
    adj_t = builder(ei.flip(0), size=(30, 30))
    x = torch.randn(30, 16)
    if builder is to_torch_csc_tensor:
        # PyG's GATv2Conv does not take a CSC adjacency; ours does: compare with PyG's on the
        # same edges given as a COO adjacency
        coo = to_torch_coo_tensor(ei.flip(0), size=(30, 30))
        close(ours(x, adj_t), theirs(x, coo))
        close(ours(x, adj_t, return_attention_weights=True)[1][0].to_dense(),
              theirs(x, coo, return_attention_weights=True)[1][0].to_dense())
        return
    run_both(theirs, ours, x, adj_t)


def test_edge_index_object_matches_pyg():
    theirs, ours = pair(16, 8, heads=4)
    ei = random_graph(30, 30, 150)
    order = torch.argsort(ei[1] * 30 + ei[0])
    for e in (EdgeIndex(ei, sparse_size=(30, 30)), EdgeIndex(ei[:, order], sparse_size=(30, 30), sort_order="col")):
        run_both(theirs, ours, torch.randn(30, 16), e)


@pytest.mark.skipif(not WITH_TORCH_SPARSE, reason="torch_sparse is not installed")
@pytest.mark.parametrize("add_loops", [True, False])
def test_sparse_tensor_matches_pyg(add_loops):
    from torch_geometric.typing import SparseTensor
    theirs, ours = pair(16, 8, heads=4, add_self_loops=add_loops)
    ei = torch.unique(random_graph(30, 30, 150), dim=1)
    adj_t = SparseTensor(row=ei[1], col=ei[0], sparse_sizes=(30, 30))
    x = torch.randn(30, 16)
    o1, a1 = theirs(x, adj_t, return_attention_weights=True)
    o2, a2 = ours(x, adj_t, return_attention_weights=True)
    close(o2, o1)
    close(a2.to_dense(), a1.to_dense())
    theirs, ours = pair(16, 8, heads=2, edge_dim=2)
    for conv in (theirs, ours):  # edge features + loops + SparseTensor: refused alike
        with pytest.raises(NotImplementedError, match="SparseTensor"):
            conv(x, adj_t)


def test_no_edges_and_isolated_destinations():
    theirs, ours = pair(8, 4, heads=2, add_self_loops=False)
    run_both(theirs, ours, torch.randn(6, 8), torch.zeros(2, 0, dtype=torch.long))
    ei = torch.tensor([[0, 1, 2], [3, 3, 4]])  # destinations 0-2 and 5 get nothing
    run_both(theirs, ours, torch.randn(6, 8), ei)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float16, 3e-2), (torch.bfloat16, 1e-1)])
def test_dtypes(dtype, atol):
    theirs, ours = pair(16, 8, heads=4, edge_dim=2)
    x, ei, ea = torch.randn(30, 16), random_graph(30, 30, 150), torch.randn(150, 2)
    ref = theirs.double()(x.double(), ei, ea.double())
    ours = ours.to(dtype)
    xo = x.to(dtype).requires_grad_()
    out = ours(xo, ei, ea.to(dtype))
    assert out.dtype == dtype
    close(out.double(), ref, atol=atol, rtol=atol, msg=str(dtype))
    out.float().sum().backward()
    assert xo.grad.dtype == dtype and torch.isfinite(xo.grad.float()).all()


def test_autocast_output_dtype_matches_pyg():
    theirs, ours = pair(16, 8, heads=2)
    x, ei = torch.randn(20, 16), random_graph(20, 20, 80)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o1, o2 = theirs(x, ei), ours(x, ei)
    assert o1.dtype == o2.dtype
    close(o2.float(), o1.float(), atol=5e-2, rtol=5e-2)


def test_dropout_trains_and_eval_is_deterministic():
    theirs, ours = pair(8, 4, heads=2, dropout=0.5)
    x, ei = torch.randn(20, 8), random_graph(20, 20, 100)
    ours.train()
    _, (_, alpha) = ours(x, ei, return_attention_weights=True)
    frac = (alpha == 0).float().mean().item()
    assert 0.35 < frac < 0.65
    ours.eval()
    theirs.eval()
    run_both(theirs, ours, x, ei)
    # dropout=1 drops every weight, deterministically: all equal to PyG's (bias only)
    theirs.train()
    ours.train()
    ours.dropout = theirs.dropout = 1.0
    out = run_both(theirs, ours, x, ei)
    assert torch.equal(out, ours.bias.detach().expand_as(out))


def test_forward_ad_sees_a_tangent_changed_in_place():
    """Edge features with a forward-mode tangent are not cached as fixed data: the same dual
    edge_attr passed again after its tangent changed in place (as gradcheck's forward-AD check
    does) gets the new tangent's output tangent, equal to PyG's (was the first call's)."""
    theirs, ours = pair(3, 2, heads=2, edge_dim=2)
    theirs, ours = theirs.double(), ours.double()
    x, ei = torch.randn(6, 3, dtype=torch.float64), random_graph(6, 6, 14)
    ea = torch.randn(14, 2, dtype=torch.float64)
    tangents = []
    for layer in (theirs, ours):
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(ea, torch.zeros_like(ea))
            layer(x, ei, dual)
            forward_ad.unpack_dual(dual).tangent.copy_(torch.linspace(-1, 1, ea.numel()).view_as(ea))
            tangents.append(forward_ad.unpack_dual(layer(x, ei, dual)).tangent)
    assert tangents[1] is not None and tangents[1].abs().max() > 0.01
    close(tangents[1], tangents[0], atol=1e-12, msg="output tangent")
    assert torch.autograd.gradcheck(lambda e: ours(x, ei, e), (ea.clone().requires_grad_(),),
                                    check_forward_ad=True)


def test_fixed_edge_features_are_ordered_once(monkeypatch):
    """Edge features without a gradient (fixed data) are processed into CSC order once per
    edge_attr and graph; an in-place change, another graph, a gradient-requiring edge_attr or
    inference mode rebuild them, and every result still equals PyG's."""
    from torch_gradops.nn import adjacency
    calls = {"n": 0}
    real = adjacency.loop_edge_attr

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(adjacency, "loop_edge_attr", counting)
    adjacency.clear_csc_cache()
    theirs, ours = pair(12, 6, heads=2, edge_dim=3, fill_value="mean")
    x, ei, ea = torch.randn(30, 12), random_graph(30, 30, 150), torch.randn(150, 3)

    def check(edge_index, edge_attr):
        outs, grads = [], []
        for layer in (theirs, ours):
            layer.zero_grad()
            out = layer(x, edge_index, edge_attr)
            out.square().sum().backward()
            outs.append(out)
            grads.append([p.grad for p in layer.parameters()])
        close(outs[1], outs[0])
        for a, b in zip(*grads):
            # The gradients of out.square().sum() reach 10-100 here, and float32 sums in another
            # order differ by up to ~1e-6 of a tensor's largest entry (against float64, PyG's
            # lin_l.weight gradient is off by 1.1e-5 and ours by 1.7e-5 at a scale of 109): more
            # than a fixed 1e-5 allows for its small entries.
            close(b, a, atol=max(1e-5, 4e-6 * a.abs().max().item()))

    check(ei, ea)
    assert calls["n"] == 1 and ea in adjacency.EDGE_FEATURE_CACHE
    check(ei, ea)
    assert calls["n"] == 1  # cache hit
    ea.mul_(2.0)  # in place: seen through _version
    check(ei, ea)
    assert calls["n"] == 2
    check(random_graph(30, 30, 150, seed=5), ea)  # another graph
    assert calls["n"] == 3
    with torch.inference_mode():  # an inference tensor must not be cached for later backward
        close(ours(x, ei, ea), theirs(x, ei, ea))
    check(ei, ea)
    ea_grad = ea.clone().requires_grad_()
    n = calls["n"]
    run_both(theirs, ours, x, ei, edge_attr=ea_grad)  # gradients for edge_attr: never cached
    assert calls["n"] == n + 1 and ea_grad not in adjacency.EDGE_FEATURE_CACHE
    adjacency.clear_csc_cache()
    assert len(adjacency.EDGE_FEATURE_CACHE) == 0


def test_backward_is_bitwise_deterministic():
    _, ours = pair(16, 8, heads=4, edge_dim=3)
    x, ei, ea = torch.randn(50, 16), random_graph(50, 50, 400), torch.randn(400, 3)
    grads = []
    for _ in range(2):
        ours.zero_grad()
        ours(x, ei, ea).square().sum().backward()
        grads.append([p.grad.clone() for p in ours.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fill_value", ["mean", "add"])
def test_layer_sums_without_atomics(fill_value):
    """Self-loops' edge features by mean or sum (PyG's scatter) included: see the helper."""
    assert_sums_without_atomics(*pair(16, 8, heads=4, edge_dim=3, fill_value=fill_value))


def test_state_dict_repr_and_conversion():
    theirs, ours = pair(16, 8, heads=4, edge_dim=2, residual=True)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    fresh = GATv2Conv(16, 8, heads=4, edge_dim=2, residual=True)
    fresh.load_state_dict(theirs.state_dict())
    x, ei, ea = torch.randn(20, 16), random_graph(20, 20, 80), torch.randn(80, 2)
    close(fresh(x, ei, ea), theirs(x, ei, ea))
    assert isinstance(ours, PyGGATv2Conv)
    converted = convert(copy.deepcopy(theirs))
    assert type(converted) is GATv2Conv
    close(converted(x, ei, ea), theirs(x, ei, ea))


def test_gat_model_v2_uses_ours():
    torch.manual_seed(0)
    theirs = PyGGAT(16, 32, num_layers=2, out_channels=7, heads=4, v2=True, edge_dim=2)
    torch.manual_seed(0)
    ours = GAT(16, 32, num_layers=2, out_channels=7, heads=4, v2=True, edge_dim=2)
    assert all(type(c) is GATv2Conv for c in ours.convs)
    x, ei, ea = torch.randn(30, 16), random_graph(30, 30, 150), torch.randn(150, 2)
    theirs.eval()
    ours.eval()
    close(ours(x, ei, edge_attr=ea), theirs(x, ei, edge_attr=ea))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layer_matches_eager(backend):
    """Inductor checks the fake kernels' output strides against the real ones: lin_edge's weight
    reaches the op as a transposed view, and the fake backward returned its strides."""
    _, ours = pair(16, 8, heads=4, edge_dim=2)
    x, ei, ea = torch.randn(30, 16), random_graph(30, 30, 150), torch.randn(150, 2)
    eager = ours(x, ei, ea)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend=backend)
    close(compiled(x, ei, ea), eager)
    grads = []
    for fn in (compiled, ours):  # every parameter's gradient too
        xg = x.clone().requires_grad_()
        ours.zero_grad()
        fn(xg, ei, ea).sum().backward()
        grads.append([xg.grad] + [p.grad.clone() for p in ours.parameters()])
    for g1, g2 in zip(*grads):
        close(g1, g2)


def test_bad_inputs_raise_clear_errors():
    _, ours = pair(8, 4)
    x = torch.randn(10, 8)
    with pytest.raises(IndexError, match="out of range"):
        ours(x, torch.tensor([[0, 10], [1, 2]]))
    with pytest.raises(ValueError, match="shape"):
        ours(x, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        ours(x, torch.zeros(2, 4))


def test_edge_attr_forms_match_pyg():
    check_edge_attr_forms(PyGGATv2Conv, GATv2Conv)


def test_inference_tensor_graph_edits_are_seen():
    check_inference_tensor_graph_edits(PyGGATv2Conv, GATv2Conv)


def test_explainer_masks_and_message_passing_hooks_match_pyg():
    check_explainer_masks_and_hooks(PyGGATv2Conv, GATv2Conv, {"v2": True})


def test_uncoalesced_coo_adjacency_is_left_untouched():
    check_uncoalesced_coo_adjacency(PyGGATv2Conv, GATv2Conv)


def test_coo_adjacency_shared_with_pyg_layers():
    check_coo_adjacency_shared_with_pyg_layers(PyGGATv2Conv, GATv2Conv)


def test_edge_index_sparse_size_is_checked_as_pyg_checks_it():
    check_edge_index_sparse_size(PyGGATv2Conv, GATv2Conv)


def test_graph_edits_that_bypass_the_version_counter_are_seen():
    check_graph_edits_that_bypass_the_version_counter(PyGGATv2Conv, GATv2Conv)


def test_inference_pass_then_training():
    check_inference_pass_then_training(PyGGATv2Conv, GATv2Conv)


def test_cached_edge_features_follow_the_dtype():
    """Integer edge features are cast to the layer's dtype and the loops' features computed in
    it; the edge-feature cache ignored the dtype, so a float32 layer got the float16-rounded
    features an fp16 copy had cached."""
    import copy
    from torch_gradops.nn import clear_csc_cache
    torch.manual_seed(0)
    x, ei, ea = torch.randn(8, 4), torch.randint(0, 8, (2, 20)), torch.randint(2049, 4000, (20, 1))
    layer = GATv2Conv(4, 2, heads=1, edge_dim=1)
    half = copy.deepcopy(layer).half()
    with torch.no_grad():
        ref = layer(x, ei, ea)
        clear_csc_cache()
        half(x.half(), ei, ea)
        assert torch.equal(layer(x, ei, ea), ref)


def test_coo_adjacency_flagged_coalesced_by_a_pyg_layer_is_coalesced():
    check_coo_adjacency_flagged_coalesced_by_pyg(PyGGATv2Conv, GATv2Conv)


def test_edge_feature_edits_that_bypass_the_version_counter_are_seen():
    """Edge features edited where their version counter does not see it (a ``torch.from_numpy``
    buffer written through numpy, a write through ``.data``): the layer must use the new
    features, not the cached CSC-ordered copy (outputs were off by up to 2 against PyG)."""
    import numpy as np
    from torch_gradops.nn import clear_csc_cache
    clear_csc_cache()
    theirs, ours = pair(5, 3, heads=2, edge_dim=2)
    x, ei = torch.randn(40, 5), random_graph(40, 40, 200)
    buffer = np.random.default_rng(0).standard_normal((200, 2)).astype(np.float32)
    ea = torch.from_numpy(buffer)
    close(ours(x, ei, ea), theirs(x, ei, ea))
    assert ea in adjacency.EDGE_FEATURE_CACHE
    buffer *= 4.0  # ea._version stays 0
    close(ours(x, ei, ea), theirs(x, ei, ea), msg="after a write through numpy")
    buffer[7, 1] += 1.0  # one value of one edge
    close(ours(x, ei, ea), theirs(x, ei, ea), msg="after one value written through numpy")
    buffer[[3, 9]] = buffer[[9, 3]]  # two edges' features swapped
    close(ours(x, ei, ea), theirs(x, ei, ea), msg="after two rows swapped through numpy")
    ea2 = torch.randn(200, 2)
    close(ours(x, ei, ea2), theirs(x, ei, ea2))
    ea2.data.mul_(0.5)
    close(ours(x, ei, ea2), theirs(x, ei, ea2), msg="after a write through .data")
    ints = np.arange(400).reshape(200, 2) % 7  # integer features (cast to the layer's dtype)
    ea3 = torch.from_numpy(ints)
    close(ours(x, ei, ea3), theirs(x, ei, ea3))
    assert ea3 in adjacency.EDGE_FEATURE_CACHE
    ints *= 3
    close(ours(x, ei, ea3), theirs(x, ei, ea3), msg="integer features after a write through numpy")
    clear_csc_cache()


def test_half_edge_feature_edits_are_seen_where_row_sums_overflow():
    """float16 features whose weighted row sums overflow float16 (a row of 16 features near
    6000): the key was computed in float16, came out infinite, and hid every later edit."""
    from torch_gradops.nn import clear_csc_cache
    clear_csc_cache()
    layer = GATv2Conv(4, 2, heads=1, edge_dim=16)
    x, ei = torch.randn(10, 4), random_graph(10, 10, 30)
    ea = torch.randn(30, 16).half()
    ea[0] = 6000.0
    with torch.no_grad():
        layer(x, ei, ea)
        ea.data[1:] *= -3
        got = layer(x, ei, ea)
        clear_csc_cache()
        close(got, layer(x, ei, ea))
    clear_csc_cache()


def test_edge_features_in_csc_order_are_not_kept_alive():
    """Without self-loops, a graph sorted by destination (what NeighborLoader yields) needs its
    edge features neither reordered nor extended, and they were cached as a view of the key:
    the weakly keyed entry kept its own key alive, one batch's edge_attr per entry forever."""
    import gc
    from torch_gradops.nn import clear_csc_cache
    clear_csc_cache()
    layer = GATv2Conv(6, 4, heads=2, edge_dim=3, add_self_loops=False)
    x = torch.randn(50, 6)
    for seed in range(5):
        ei = random_graph(50, 50, 300, seed=seed)
        ei = ei[:, ei[1].argsort(stable=True)]
        layer(x, ei, torch.randn(300, 3)).sum().backward()
    gc.collect()
    assert len(adjacency.EDGE_FEATURE_CACHE) == 0
    ei = random_graph(50, 50, 300, seed=9)  # unsorted: a reordered copy is cached, held only by its key
    ea = torch.randn(300, 3)
    layer(x, ei, ea)
    assert len(adjacency.EDGE_FEATURE_CACHE) == 1
    del ea
    gc.collect()
    assert len(adjacency.EDGE_FEATURE_CACHE) == 0


@pytest.mark.parametrize("shape", [(60, 5), (60, 1), (60,)])
def test_edge_attr_of_the_wrong_width_names_edge_dim(shape):
    """``edge_attr`` whose width is not the layer's ``edge_dim``: PyG's GATv2Conv fails in a
    matmul; ours named an internal weight and gave the input's width as the expected one."""
    x, ei = torch.randn(20, 8), random_graph(20, 20, 60)
    layer = GATv2Conv(8, 4, heads=2, edge_dim=3)
    width = shape[1] if len(shape) == 2 else 1
    ea = torch.randn(shape)
    GATv2Conv(8, 4, heads=2, edge_dim=width)(x, ei, ea)  # another layer caches these features
    with pytest.raises(ValueError, match=rf"edge_attr has {width} features per edge .* edge_dim=3"):
        layer(x, ei, ea)


def test_non_tensor_edge_index_is_refused_with_a_clear_message():
    check_non_tensor_edge_index_is_refused(GATv2Conv)


def test_loop_groups_of_learned_edge_features_are_cached(monkeypatch):
    check_loop_groups_are_cached(pair, monkeypatch)


def test_loop_groups_built_under_a_transform_serve_later_ones():
    check_loop_groups_built_under_a_transform(GATv2Conv)
