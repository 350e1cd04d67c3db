"""Helpers for the tests of our PyG layers against PyG's: layer pairs with shared weights, graphs
with self-loops and duplicates, one routine that compares outputs, attention and gradients, and
one that checks a layer sums without atomics."""
import pytest
import torch

ATOL = RTOL = 1e-5


def close(a, b, atol=ATOL, rtol=RTOL, msg=""):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")


def make_pair(pyg_cls, our_cls, in_channels, out_channels, seed=0, **kw):
    """PyG's layer and ours, built from the same seed (so with equal parameters)."""
    torch.manual_seed(seed)
    theirs = pyg_cls(in_channels, out_channels, **kw)
    torch.manual_seed(seed)
    ours = our_cls(in_channels, out_channels, **kw)
    for (n1, p1), (n2, p2) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert n1 == n2, n1
        if not isinstance(p1, torch.nn.parameter.UninitializedParameter):
            assert torch.equal(p1, p2), n1
    return theirs, ours


def assert_sums_without_atomics(theirs, ours):
    """Forward, backward and double backward of ``ours`` (in_channels 16, edge_dim 3, with
    self-loops) run no call that CUDA computes with atomic adds over repeated indices, so they
    are bitwise repeatable there too; PyG's layer (``scatter``) is caught by the same check."""
    from torch_gradops.testing import atomic_sum_ops

    x = torch.randn(50, 16, requires_grad=True)
    ei, ea = random_graph(50, 50, 400), torch.randn(400, 3, requires_grad=True)

    def double_backward(conv):
        grads = torch.autograd.grad(conv(x, ei, ea).square().sum(), [x, ea, *conv.parameters()], create_graph=True)
        torch.autograd.grad(sum(g.square().sum() for g in grads), [x, ea])

    assert atomic_sum_ops(lambda: ours(x, ei, ea).square().sum().backward()) == []
    assert atomic_sum_ops(lambda: double_backward(ours)) == []
    assert atomic_sum_ops(lambda: theirs(x, ei, ea).square().sum().backward())


def random_graph(num_src, num_dst, num_edges, seed=0, loops=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ei = torch.stack([torch.randint(0, num_src, (num_edges,), generator=g),
                      torch.randint(0, num_dst, (num_edges,), generator=g)])
    if loops and num_edges >= 4:  # make sure there are self-loops (and a duplicate) to remove
        k = min(num_src, num_dst)
        ei[:, :3] = torch.tensor([[0, 1, 1], [0, 1, 1]]) % max(k, 1)
    return ei.to(device)


def run_both(theirs, ours, x, edge_index, edge_attr=None, attention=True, seed=1, check_grads=True, atol=ATOL,
             **forward_kwargs):
    """Forward both layers (+ attention), backprop a random weighting, compare everything."""
    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())

    results = []
    for layer in (theirs, ours):
        xs = tuple(leaf(t) for t in x) if isinstance(x, tuple) else leaf(x)
        ea = leaf(edge_attr)
        kwargs = dict(edge_attr=ea, **forward_kwargs)
        if attention:
            kwargs["return_attention_weights"] = True
        res = layer(xs, edge_index, **kwargs)
        out, att = res if attention else (res, None)
        torch.manual_seed(seed)
        loss = (out * torch.randn_like(out)).sum()
        if att is not None:
            alpha = att[1] if isinstance(att, tuple) else att
            loss = loss + (alpha * torch.randn_like(alpha)).sum()
        inputs = [t for t in (xs if isinstance(xs, tuple) else (xs,)) if t is not None]
        if ea is not None:
            inputs.append(ea)
        params = [p for p in layer.parameters()]
        grads = torch.autograd.grad(loss, inputs + params, allow_unused=True) if check_grads and loss.requires_grad else None
        results.append((out, att, grads))
    (o1, a1, g1), (o2, a2, g2) = results
    assert o1.shape == o2.shape and o1.dtype == o2.dtype
    close(o2, o1, atol=atol, msg="output")
    if attention:
        assert type(a1) is type(a2)
        ei1, al1 = a1
        ei2, al2 = a2
        assert type(ei1) is type(ei2)
        if isinstance(ei1, torch.Tensor) and ei1.layout != torch.strided:
            assert ei1.layout == ei2.layout
            close(ei2.to_dense(), ei1.to_dense(), atol=atol, msg="attention adjacency")
        else:
            assert torch.equal(torch.as_tensor(ei1), torch.as_tensor(ei2)), "returned edge_index differs"
        close(al2, al1, atol=atol, msg="attention")
    if g1 is not None:
        for i, (a, b) in enumerate(zip(g1, g2)):
            if a is None or b is None:
                assert (a is None or not a.abs().any()) and (b is None or not b.abs().any()), f"grad {i}"
                continue
            close(b, a, atol=atol, msg=f"gradient {i}")
    return o2


def check_edge_attr_forms(pyg_cls, our_cls):
    """Edge features in the forms PyG's attention layers take beyond ``[E, edge_dim]`` float:
    integer features (promoted) and ``[E, 1, edge_dim]`` (its ``lin_edge`` maps the last dim),
    equal to PyG's; a row count other than the edge count is refused naming ``edge_attr``."""
    import pytest

    theirs, ours = make_pair(pyg_cls, our_cls, 8, 4, heads=2, edge_dim=3)
    x, ei = torch.randn(12, 8), random_graph(12, 12, 40)
    g = torch.Generator().manual_seed(5)
    ints = torch.randint(0, 5, (40, 3), generator=g)
    close(ours(x, ei, ints), theirs(x, ei, ints), msg="integer edge_attr")
    run_both(theirs, ours, x, ei, edge_attr=torch.randn(40, 1, 3, generator=g))
    with pytest.raises(ValueError, match=r"edge_attr must have one row per edge of edge_index \(40\)"):
        ours(x, ei, torch.randn(41, 3, generator=g))


def check_inference_tensor_graph_edits(pyg_cls, our_cls):
    """Graphs and edge features made under ``torch.inference_mode()`` have no version counter:
    an in-place edit between two calls must reach the layer (no stale cached CSC conversion or
    edge features), as it does PyG's; such edge features also work outside inference mode."""
    theirs, ours = make_pair(pyg_cls, our_cls, 4, 3, heads=2, edge_dim=2)
    theirs.eval(), ours.eval()
    x = torch.randn(6, 4)
    with torch.inference_mode():
        ei, ea = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]]), torch.randn(4, 2)
        close(ours(x, ei, ea), theirs(x, ei, ea))
        ei[1] = 5
        ea.mul_(3)
        close(ours(x, ei, ea), theirs(x, ei, ea), msg="after editing the graph in place")
    close(ours(x, ei, ea), theirs(x, ei, ea), msg="inference tensors outside inference mode")


def check_graph_edits_that_bypass_the_version_counter(pyg_cls, our_cls):
    """A CPU edge_index edited where its version counter does not see it (a ``torch.from_numpy``
    buffer written through numpy, a write through ``.data``, edges reordered that way): the
    layer must see the new graph, not a stale cached conversion, as PyG's does."""
    import numpy as np
    theirs, ours = make_pair(pyg_cls, our_cls, 8, 4, heads=2)
    x = torch.randn(6, 8)
    buffer = np.array([[0, 1, 2, 3], [1, 2, 3, 4]])
    ei = torch.from_numpy(buffer)
    close(ours(x, ei), theirs(x, ei))
    buffer[1] = 5  # ei._version stays 0
    close(ours(x, ei), theirs(x, ei), msg="after a write through numpy")
    ei = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
    close(ours(x, ei), theirs(x, ei))
    ei.data[:, [0, 3]] = ei.data[:, [3, 0]].clone()  # the same edges in another order
    (out, (_, alpha)), (ref, (_, ref_alpha)) = [m(x, ei, return_attention_weights=True) for m in (ours, theirs)]
    close(out, ref)
    close(alpha, ref_alpha, msg="attention of reordered edges")
    ei.data[1, 1] = 0  # one destination changed
    close(ours(x, ei), theirs(x, ei), msg="after a write through .data")
    buffer = np.array([[0, 0, 1], [2, 2, 2]])
    ei = torch.from_numpy(buffer)
    close(ours(x, ei), theirs(x, ei))
    buffer[0, 1], buffer[0, 2] = 1, 0  # two sources swapped: the same small ids in other places
    (out, (_, alpha)), (ref, (_, ref_alpha)) = [m(x, ei, return_attention_weights=True) for m in (ours, theirs)]
    close(out, ref, msg="after two sources swapped through numpy")
    close(alpha, ref_alpha, msg="attention after two sources swapped through numpy")


def check_explainer_masks_and_hooks(pyg_cls, our_cls, model_kw):
    """``torch_geometric.explain``'s edge masks and MessagePassing's hooks act inside
    ``propagate``, which the fused kernel does not run: with either present the layer runs PyG's
    forward (masked outputs and hook calls as PyG's; GNNExplainer on the model works), and
    without them the fused kernel again."""
    from torch_geometric.explain import Explainer, GNNExplainer
    from torch_geometric.explain.algorithm.utils import clear_masks, set_masks
    from torch_gradops.nn import GAT
    import torch_gradops.nn.gat_conv as fused_gat
    import torch_gradops.nn.gatv2_conv as fused_gatv2
    theirs, ours = make_pair(pyg_cls, our_cls, 4, 3, heads=2)
    x, ei = torch.randn(5, 4), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    mask = torch.tensor([-1e9, 0.5, 2.0, -3.0, 1e9])
    for layer in (theirs, ours):
        set_masks(layer, mask, ei, apply_sigmoid=True)
    masked = ours(x, ei)
    close(masked, theirs(x, ei), msg="with an explainer's edge mask")
    for layer in (theirs, ours):
        clear_masks(layer)
    calls = {id(theirs): 0, id(ours): 0}
    handles = [layer.register_message_forward_hook(lambda m, *a: calls.__setitem__(id(m), calls[id(m)] + 1))
               for layer in (theirs, ours)]
    close(ours(x, ei), theirs(x, ei), msg="with a message hook")
    assert calls[id(ours)] == calls[id(theirs)] == 1
    for h in handles:
        h.remove()
    # no mask, no hook: the fused kernel runs again
    fused = {"n": 0}
    module = fused_gat if our_cls.__name__ == "GATConv" else fused_gatv2
    op_name = "gat_attention" if our_cls.__name__ == "GATConv" else "_gatv2_attention_csc"
    op = getattr(module, op_name)

    def counting(*a, **k):
        fused["n"] += 1
        return op(*a, **k)
    setattr(module, op_name, counting)
    try:
        unmasked = ours(x, ei)
        close(unmasked, theirs(x, ei), msg="masks and hooks removed")
    finally:
        setattr(module, op_name, op)
    assert fused["n"] == 1 and not torch.allclose(masked, unmasked)
    torch.manual_seed(0)
    model = GAT(4, 8, num_layers=2, out_channels=3, **model_kw).eval()
    explainer = Explainer(model=model, algorithm=GNNExplainer(epochs=3), explanation_type="model",
                          edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification", task_level="node", return_type="raw"))
    explanation = explainer(x, ei, index=3)
    assert explanation.edge_mask.shape == (ei.size(1),) and explanation.edge_mask.abs().sum() > 0


def check_uncoalesced_coo_adjacency(pyg_cls, our_cls):
    """An uncoalesced ``torch.sparse`` COO ``adj_t`` means its coalesced graph (duplicates
    merged), as PyG's layers read it with self-loops (without, they refuse it), and the
    caller's tensor is left as it was: PyG's ``to_edge_index`` marked it coalesced without
    coalescing it, so a later ``coalesce()`` kept its duplicates. With ``edge_attr`` (whose
    rows such a tensor cannot order) it is refused."""
    theirs, ours = make_pair(pyg_cls, our_cls, 3, 2, heads=2)
    x = torch.randn(4, 3)
    idx = torch.tensor([[2, 1, 1, 3], [0, 2, 2, 1]])  # rows = destinations; unsorted, one duplicate
    for loops in (False, True):
        theirs.add_self_loops = ours.add_self_loops = loops
        adj_t = torch.sparse_coo_tensor(idx, torch.ones(4), (4, 4))
        close(ours(x, adj_t), theirs(x, adj_t.coalesce().indices().flip(0)), msg=f"add_self_loops={loops}")
        assert not adj_t.is_coalesced() and adj_t.coalesce()._nnz() == 3
        if loops:  # PyG's layer takes it with self-loops
            close(ours(x, adj_t), theirs(x, adj_t.clone()))
        # the attention weights too, whose adjacency is the coalesced one (PyG's with self-loops)
        _, (adj2, alpha) = ours(x, adj_t, return_attention_weights=True)
        _, (ref_adj, ref_alpha) = theirs(x, adj_t.coalesce(), return_attention_weights=True)
        assert torch.equal(adj2.coalesce().indices(), ref_adj.coalesce().indices())
        close(alpha, ref_alpha)
    _, with_edges = make_pair(pyg_cls, our_cls, 3, 2, heads=2, edge_dim=2)
    with pytest.raises(ValueError, match="uncoalesced"):
        with_edges(x, torch.sparse_coo_tensor(idx, torch.ones(4), (4, 4)), torch.randn(4, 2))


def check_coo_adjacency_shared_with_pyg_layers(pyg_cls, our_cls):
    """A model that runs PyG's layer and ours on one coalesced ``torch.sparse`` COO ``adj_t``
    without self-loops: reading the graph must not bump the version of the adjacency's indices,
    which PyG's layer saved for its backward (PyG's ``to_edge_index`` marks the tensor coalesced
    in place; the backward then failed "modified by an inplace operation")."""
    from torch_geometric.utils import to_torch_coo_tensor
    ei = torch.tensor([[0, 1, 2, 2], [1, 0, 1, 3]])
    adj_t = to_torch_coo_tensor(ei.flip(0), size=(4, 4))
    x = torch.randn(4, 8, requires_grad=True)
    theirs, ours = make_pair(pyg_cls, our_cls, 8, 4, heads=2, add_self_loops=False)
    first = theirs(x, adj_t)
    version = adj_t._indices()._version
    second = ours(x, adj_t)
    assert adj_t._indices()._version == version
    close(second, first)
    (first.sum() + second.sum()).backward()  # raised before
    close(x.grad, 2 * torch.autograd.grad(theirs(x, adj_t).sum(), x)[0])


def check_coo_adjacency_flagged_coalesced_by_pyg(pyg_cls, our_cls):
    """An uncoalesced ``torch.sparse`` COO ``adj_t`` with duplicate entries that a PyG layer read
    first (its ``to_edge_index`` flags the tensor coalesced without merging them): ours took the
    flag at its word and kept the duplicates (0.28 off PyG's output, whose self-loop step merges
    them), and ``return_attention_weights`` failed ("indices and values must have same nnz")."""
    from torch_geometric.nn import GCNConv
    torch.manual_seed(0)
    n = 12
    ei = torch.randint(0, n, (2, 40))
    ei = torch.cat([ei, ei[:, :5]], 1)  # duplicate edges

    def fresh():
        return torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)), (n, n))
    x = torch.randn(n, 5)
    theirs, ours = make_pair(pyg_cls, our_cls, 5, 4, heads=2)
    want = theirs(x, fresh(), return_attention_weights=True)
    adj = fresh()
    GCNConv(5, 5)(x, adj)
    assert adj.is_coalesced()  # flagged, duplicates and all
    got = ours(x, adj, return_attention_weights=True)
    close(got[0], want[0])
    (adj_got, alpha_got), (adj_want, alpha_want) = got[1], want[1]
    assert adj_got.layout == adj_want.layout and alpha_got.shape == alpha_want.shape
    close(adj_got.to_dense(), adj_want.to_dense())
    close(ours(x, adj), theirs(x, adj))
    close(ours(x, fresh()), want[0])


def check_non_tensor_edge_index_is_refused(our_cls):
    """None, a tuple of rows or a list as ``edge_index`` got "cannot create weak reference to
    'tuple' object" from the graph cache; now the message names edge_index and its forms."""
    layer = our_cls(5, 4, heads=2)
    x = torch.randn(6, 5)
    ei = torch.tensor([[0, 1, 2], [1, 2, 3]])
    for bad in (None, (ei[0], ei[1]), ei.tolist()):
        with pytest.raises(ValueError, match=r"edge_index must be a \[2, E\] integer Tensor.*got "
                                             + type(bad).__name__):
            layer(x, bad)


def check_edge_index_sparse_size(pyg_cls, our_cls):
    """An ``EdgeIndex`` whose ``sparse_size`` disagrees with the features is refused exactly
    where PyG's layer refuses it (its propagate checks the sizes, after the self-loops widen
    them), with PyG's message; elsewhere the outputs agree."""
    from torch_geometric import EdgeIndex
    edges = torch.tensor([[0, 3, 4, 1], [1, 2, 0, 3]])
    for sparse_size in [(5, 4), (6, 4), (5, 6), (4, 4), (5, None), (None, 4)]:
        for num_src, num_dst, form in [(5, 4, "pair"), (5, 5, "x"), (6, 6, "pair"), (5, 5, "pair_none")]:
            for loops in (False, True):
                theirs, ours = make_pair(pyg_cls, our_cls, 8, 4, heads=2, add_self_loops=loops)
                xs, xd = torch.randn(num_src, 8), torch.randn(num_dst, 8)
                x = xs if form == "x" else (xs, xd) if form == "pair" else (xs, None)
                what = f"sparse_size={sparse_size}, {form} {num_src}/{num_dst}, add_self_loops={loops}"
                try:
                    want = theirs(x, EdgeIndex(edges, sparse_size=sparse_size))
                except ValueError as e:
                    assert "Encountered tensor with size" in str(e)
                    with pytest.raises(ValueError, match=r"Encountered tensor with size \d+ in dimension 0, but "
                                                         r"expected size \d+: edge_index is an EdgeIndex"):
                        ours(x, EdgeIndex(edges, sparse_size=sparse_size))
                    continue
                except AssertionError:  # GATv2Conv without destination features: both assert
                    with pytest.raises(AssertionError):
                        ours(x, EdgeIndex(edges, sparse_size=sparse_size))
                    continue
                close(ours(x, EdgeIndex(edges, sparse_size=sparse_size)), want, msg=what)


def check_inference_pass_then_training(pyg_cls, our_cls):
    """A validation pass under ``torch.inference_mode()`` before training: the graph conversion
    and its lazily built indices (reverse index, inverse permutation) it caches must be normal
    tensors, which the later training call's backward can save (it failed: "Inference tensors
    cannot be saved for backward"), as PyG's layers train after such a pass."""
    theirs, ours = make_pair(pyg_cls, our_cls, 6, 4, heads=2)
    x, ei = torch.randn(10, 6), torch.randint(0, 10, (2, 30))
    for layer in (theirs, ours):
        with torch.inference_mode():
            layer.eval()
            layer(x, ei)
            layer(x, ei, return_attention_weights=True)  # builds the inverse permutation
        layer.train()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [layer(xi, ei, return_attention_weights=True) for layer, xi in zip((theirs, ours), xs)]
    for (out, (_, alpha)) in outs:
        (out.sum() + alpha.sum()).backward()
    close(outs[1][0], outs[0][0])
    close(xs[1].grad, xs[0].grad)


def check_loop_groups_are_cached(pair, monkeypatch):
    """Edge features that need a gradient are reduced into the added self-loops' features every
    step (fill_value "mean"/"add"); the grouping of the edges by loop, a sort, is built once per
    graph and cached: a later call on the same graph sorts once less, whatever the fill, an
    in-place edit of edge_index regroups, and every result (edge_attr's gradient included)
    equals PyG's."""
    from torch_gradops.nn import adjacency
    Segments = adjacency.Segments  # (the sort-based grouping the loops' reductions use)
    calls = {"n": 0}
    real = Segments.of_index

    def counting(index):
        calls["n"] += 1
        return real(index)

    monkeypatch.setattr(Segments, "of_index", staticmethod(counting))
    adjacency.clear_csc_cache()
    x, ei, ea = torch.randn(30, 12), random_graph(30, 30, 150), torch.randn(150, 3)

    def sorts(fill):
        theirs, ours = pair(12, 6, heads=2, edge_dim=3, fill_value=fill)
        n = calls["n"]
        run_both(theirs, ours, x, ei, edge_attr=ea)  # edge_attr as a leaf that needs a gradient
        return calls["n"] - n

    first = sorts("mean")
    assert first >= 1 and len(adjacency.LOOP_GROUP_CACHE) == 1
    assert sorts("mean") == first - 1
    assert sorts("add") == first - 1  # the grouping does not depend on the reduction
    ei[1, 10] = (ei[1, 10] + 1) % 30  # a destination, in place: a new CSC graph, grouped again
    assert sorts("mean") == first
    adjacency.clear_csc_cache()
    assert len(adjacency.LOOP_GROUP_CACHE) == 0


def check_loop_groups_built_under_a_transform(layer_cls):
    """What the layers cache per graph (the CSC graph, the loops' grouping, the content key's
    weights), first built inside ``torch.func.hessian``, is cached as plain tensors: later
    transforms on the graph still work (cached wrappers of the hessian's levels failed them
    with functorch's "escaped?" internal assert) and agree with autograd. Both with the CSC
    graph cached by an eager call first and with the hessian as the graph's first call."""
    from torch_gradops.nn import adjacency
    torch.manual_seed(0)
    conv = layer_cls(12, 6, heads=2, edge_dim=3)  # fill_value "mean", the default
    x, ea = torch.randn(30, 12), torch.randn(40, 3, dtype=torch.float32)
    for eager_first in (True, False):
        adjacency.clear_csc_cache()
        adjacency._key_weights.cache_clear()  # (drawn on the first key of the process)
        ei = random_graph(30, 30, 40)
        if eager_first:
            conv(x, ei)  # the CSC graph is cached; the loops' grouping is not built yet

        def f(a):
            return conv(x, ei, a).square().sum()

        torch.func.hessian(f)(ea)  # the grouping (and, unless eager_first, the graph) built here
        leaf = ea.clone().requires_grad_()
        expected, = torch.autograd.grad(f(leaf), leaf)
        close(torch.func.grad(f)(ea), expected)
        close(torch.func.jacrev(f)(ea), expected)
