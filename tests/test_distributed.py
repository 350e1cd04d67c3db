"""Multi-process runs with the gloo backend on 127.0.0.1 (bounded time, processes always reaped)."""

import pytest
import torch
import torch.nn.functional as F

from torch_gradops.distributed import rank_slices, split_by_cost
from torch_gradops.testing import launch

from examples_path import load_example

TIMEOUT = 240


def _example():
    return load_example("distributed_gat")


# --------------------------------------------------------------------------- launcher
def _echo(rank, world_size, value):
    import torch.distributed as dist
    t = torch.tensor([float(rank + value)])
    dist.all_reduce(t)
    return rank, world_size, t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def _hang(rank, world_size):
    import time
    time.sleep(60)


def _fail_while_rank_zero_waits(rank, world_size):
    import time

    import torch.distributed as dist
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("the root cause on rank one")
    dist.barrier()  # fails once rank 1 is gone: a consequence, reported after the cause


def test_launch_reports_the_rank_that_failed_first():
    # it reported rank 0's "Connection closed by peer" and never showed rank 1's error
    with pytest.raises(RuntimeError, match="rank 1 failed first:(.|\n)*the root cause on rank one(.|\n)*rank 0 failed"):
        launch(_fail_while_rank_zero_waits, 2, timeout=TIMEOUT)


def test_launch_returns_results_and_reports_failures():
    assert launch(_echo, 2, 10) == [(0, 2, 21.0), (1, 2, 21.0)]
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*rank one fails on purpose"):
        launch(_fail_on_rank_one, 2)
    with pytest.raises(RuntimeError, match="did not finish within"):
        launch(_hang, 2, timeout=3)


def test_split_by_cost_balances_and_covers():
    costs = [5, 1, 1, 1, 1, 1, 4, 2]
    groups = split_by_cost(costs, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    loads = [sum(costs[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= max(costs)
    assert split_by_cost([1.0], 3) == [[0], [], []]
    with pytest.raises(ValueError):
        split_by_cost([1.0], 0)


def test_rank_slices_are_contiguous_ranges_covering_all():
    for n, world in ((10, 3), (2, 4), (2 ** 40, 7)):
        parts = [rank_slices(n, world, r) for r in range(world)]
        assert all(isinstance(p, range) for p in parts)
        assert parts[0].start == 0 and parts[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        rank_slices(4, 2, 2)


# --------------------------------------------------------------------------- DDP GAT
def _ddp_gat(rank, world_size, epochs):
    return _example().train(rank, world_size, epochs=epochs, batch_size=35, dropout=0.0, seed=0)


def test_ddp_gat_matches_single_process_on_the_same_batches():
    ex = _example()
    epochs, world = 2, 2
    results = launch(_ddp_gat, world, epochs, timeout=TIMEOUT)
    for key, value in results[0]["state_dict"].items():  # DDP keeps the replicas identical
        assert torch.equal(value, results[1]["state_dict"][key]), key

    # One process, one step per pair of rank batches, on the mean of the two losses: what
    # DDP's gradient averaging computes.
    from torch_gradops.datasets import load_cora
    data = load_cora(normalize_features=True)
    model = ex.make_model(data.num_features, int(data.y.max()) + 1, 0.0, 0)
    opt = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    model.train()
    steps = 0
    for epoch in range(epochs):
        per_rank = [list(ex.rank_batches(data, r, world, 35, 2, epoch, 0)) for r in range(world)]
        for batches in zip(*per_rank):
            opt.zero_grad()
            loss = sum(F.cross_entropy(model(x, ei)[pos], y) for x, ei, pos, y in batches) / world
            loss.backward()
            opt.step()
            steps += 1
    assert steps == len(results[0]["losses"]) > 0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(results[0]["state_dict"][key], value, atol=2e-5, rtol=1e-4, msg=key)


# --------------------------------------------------------------------------- tensor networks
# (expression, shapes, forced sliced modes, dtype): summed sliced modes, a sliced output mode,
# fewer slices than ranks, an unsliced plan, an uneven split, a complex hyperedge network.
TN_CASES = [
    ("ab,bc,cd->ad", [(4, 5), (5, 6), (6, 3)], ["b", "c"], torch.float64),   # 30 slices, summed
    ("ab,bc->ac", [(4, 5), (5, 3)], ["a"], torch.float64),                  # output blocks
    ("ab,bc->ac", [(3, 2), (2, 4)], ["b"], torch.float64),                  # 2 slices
    ("ab,bc->ac", [(3, 2), (2, 4)], None, torch.float64),                   # 1 slice
    ("abc,bcd,ce->ade", [(2, 5, 3), (5, 3, 2), (3, 4)], ["b"], torch.complex128),  # 5 slices, hyperedge c
    # under a memory limit: ab,bc,cd do not depend on the sliced e (hoisted: computed once per rank)
    ("ab,bc,cd,de,ea->a", [(3, 4), (4, 5), (5, 3), (3, 6), (6, 3)], ["e"], torch.float64, "1MiB"),
]


@pytest.mark.parametrize("world, batch", [(3, 46), (6, 35), (3, 1000)])
def test_example_ranks_get_equal_shares_and_batch_counts(world, batch):
    # 140 training nodes over 3 ranks in batches of 46 gave 2/2/1 batches: the rank with one
    # fewer left DDP's all-reduce and the others failed ("Connection closed by peer").
    from torch_gradops.datasets import load_cora
    ex = _example()
    data = load_cora(normalize_features=True)
    for epoch in range(2):
        batches = [list(ex.rank_batches(data, r, world, batch, 1, epoch, 0)) for r in range(world)]
        counts = [len(b) for b in batches]
        nodes = [sum(len(y) for *_, y in b) for b in batches]  # seed nodes per rank
        assert len(set(counts)) == 1 and counts[0] > 0, counts
        assert nodes == [int(data.train_mask.sum()) // world] * world, nodes


def _tn_inputs(case):
    expr, shapes, slicing, dtype, *limit = TN_CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    ops = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    return expr, ops, dict(slicing=slicing, memory_limit=limit[0] if limit else None)


def _tn_ranks(rank, world_size, device="cpu"):
    import torch.distributed as dist

    from torch_gradops.distributed import ContractStats, contract

    device = f"cuda:{rank}" if device == "cuda:rank" else device  # NCCL: a GPU per rank
    results = []
    for case in range(len(TN_CASES)):
        expr, ops, options = _tn_inputs(case)
        ops = [o.to(device).requires_grad_() for o in ops]
        stats = ContractStats()
        out = contract(expr, *ops, **options, process_group=dist.group.WORLD, stats=stats)
        weight = torch.linspace(-1, 2, out.numel(), dtype=torch.float64, device=device).view(out.shape)
        (out.real * weight).sum().backward()
        results.append((out.detach().cpu(), [o.grad.cpu() for o in ops], stats.slices))
    return results


@pytest.mark.parametrize("world, device, backend", [
    (2, "cpu", "gloo"), (3, "cpu", "gloo"),
    # CUDA operands: gloo stages them through the host, so two ranks can share one GPU
    pytest.param(2, "cuda", "gloo", marks=pytest.mark.cuda),
    # NCCL needs a GPU per rank
    pytest.param(2, "cuda:rank", "nccl", marks=[pytest.mark.cuda, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (one per rank)")])])
def test_distributed_contraction_matches_single_process(world, device, backend):
    import torch_gradops as tg

    per_rank = launch(_tn_ranks, world, device, backend=backend, timeout=TIMEOUT)
    for case in range(len(TN_CASES)):
        expr, ops, options = _tn_inputs(case)
        ops = [o.requires_grad_() for o in ops]
        ref = torch.einsum(expr, *ops)
        weight = torch.linspace(-1, 2, ref.numel(), dtype=torch.float64).view(ref.shape)
        ref_grads = torch.autograd.grad((ref.real * weight).sum(), ops)
        plan = tg.tensornet.plan(expr, *ops, **options)
        num_slices = plan.num_slices
        assert (plan.hoisted is not None) == (options["memory_limit"] is not None)
        handled = [per_rank[r][case][2] for r in range(world)]
        assert sum(handled) == num_slices  # every slice once, balanced
        assert max(handled) - min(handled) <= 1
        for rank in range(world):
            out, grads, _ = per_rank[rank][case]
            torch.testing.assert_close(out, ref.detach(), msg=f"case {case} rank {rank}")
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, msg=f"case {case} rank {rank}")


def test_distributed_contract_without_process_group_is_local():
    from torch_gradops.distributed import contract

    expr, ops, options = _tn_inputs(0)
    torch.testing.assert_close(contract(expr, *ops, **options), torch.einsum(expr, *ops))


def _tn_mismatched_plans(rank, world_size, how):
    import torch.distributed as dist

    import torch_gradops as tg

    if how == "slicing":
        expr, ops, _ = _tn_inputs(0)
        tg.tensornet.contract(expr, *ops, slicing=["b"] if rank == 0 else ["c"], process_group=dist.group.WORLD)
    else:  # the same call but for the memory limit: at 8 KiB rank 1's plan is sliced, at 16 KiB not
        gen = torch.Generator().manual_seed(0)
        ops = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((40, 50), (50, 60), (60, 30))]
        limit = {"memory_limit": "8KiB", "equal_plans": "16KiB"}[how]
        out = tg.tensornet.contract("ab,bc,cd->ad", *ops, memory_limit=None if rank == 0 else limit,
                                    process_group=dist.group.WORLD)
        return out, torch.einsum("ab,bc,cd->ad", *ops)


@pytest.mark.parametrize("how, match", [
    ("slicing", r"path or sliced modes of rank\(s\) \[1\] differ from rank 0's;"),
    # (the sliced operand shapes differ too: the message said only that the network did)
    ("memory_limit", r"of rank\(s\) \[1\] differ from rank 0's \(the plans were made under different memory "
                     r"limits: rank\(s\) \[1\] passed \['memory_limit=8.0 KiB'\], rank 0 no memory_limit\)")])
def test_ranks_with_different_plans_get_a_clear_error(how, match):
    with pytest.raises(RuntimeError, match=match):
        launch(_tn_mismatched_plans, 2, how, timeout=TIMEOUT)


def test_ranks_with_different_memory_limits_but_equal_plans_agree():
    """Plans are compared, not the arguments that made them: equal plans add up."""
    for out, expected in launch(_tn_mismatched_plans, 2, "equal_plans", timeout=TIMEOUT):
        torch.testing.assert_close(out, expected)


def _tn_mismatched_inputs(rank, world_size, what):
    import torch.distributed as dist

    import torch_gradops as tg

    torch.manual_seed(0)
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    expr = "ab,bc->ac"
    if what == "expr" and rank == 1:
        expr = "ab,bc->ca"  # same shapes, another output order: the sums were silently wrong
    if what == "dtype" and rank == 1:
        a, b = a.float(), b.float()  # different buffer sizes: a gloo rank aborted
    if what == "values" and rank == 1:
        b = torch.randn(4, 5, dtype=torch.float64)  # another draw: each rank summed part of its own contraction
    if what == "order" and rank == 1:
        b = b.flip(1)  # the same numbers elsewhere: sums agree, the sampled elements do not
    if what == "swap":  # 200 numbers (sampled: 16), two unsampled ones swapped on rank 1: sums agree
        a = torch.randn(10, 20, dtype=torch.float64)
        b = torch.randn(20, 5, dtype=torch.float64)
        if rank == 1:
            a = a.flatten()
            a[[5, 150]] = a[[150, 5]]
            a = a.view(10, 20)
    if what == "swapped_output_grad":  # a loss whose weights, 200 numbers, have two swapped on rank 1
        weights = torch.randn(200, dtype=torch.float64)
        if rank == 1:
            weights[[5, 150]] = weights[[150, 5]]
    a.requires_grad_(what != "grad" or rank == 0)
    out = tg.tensornet.contract(expr, a, b, slicing=["b"], process_group=dist.group.WORLD)
    if what == "swapped_output_grad":  # a 10x20 output: its gradient has more than 64 numbers
        out = tg.tensornet.contract("ab,bc->ac", torch.randn(10, 4, dtype=torch.float64, requires_grad=True),
                                    torch.ones(4, 20, dtype=torch.float64), slicing=["b"],
                                    process_group=dist.group.WORLD)
        (out.flatten() * weights).sum().backward()
        return None
    (out * (1 + rank if what == "output_grad" else 1)).sum().backward()
    return a.grad


@pytest.mark.parametrize("what, match", [("expr", "contract different things: the network"),
                                         ("dtype", "contract different things: the dtype"),
                                         ("grad", "contract different things: the operands requiring gradients"),
                                         ("values", r"contract different things: the operand values of rank\(s\) "
                                                    r"\[1\] differ from rank 0's \(operand\(s\) \[1\]\)"),
                                         ("order", r"the operand values of rank\(s\) \[1\]"),
                                         ("output_grad", r"ranks backpropagate different output gradients: "
                                                         r"rank\(s\) \[1\]"),
                                         # two unsampled elements swapped: neither sums nor samples saw it
                                         ("swap", r"the operand values of rank\(s\) \[1\] differ from rank 0's "
                                                  r"\(operand\(s\) \[0\]\)"),
                                         ("swapped_output_grad", r"ranks backpropagate different output gradients")])
def test_ranks_contracting_different_inputs_get_a_clear_error(what, match):
    with pytest.raises(RuntimeError, match=match):
        launch(_tn_mismatched_inputs, 2, what, timeout=TIMEOUT)


def test_ranks_with_the_same_operands_from_different_summation_orders_agree():
    """The value check compares sums to a tolerance: equal tensors whose float64 sums come out
    in another order (other thread counts, devices) pass; a change of one element in 10^6
    does not."""
    from torch_gradops.distributed import fingerprints, same_fingerprint

    x = torch.randn(1000, 1000, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    f = fingerprints([x])[0]
    g = list(f)
    g[3] += 1e-12 * g[4]  # the sum, as another order of summation gives it
    assert same_fingerprint(f, tuple(g))
    y = x.clone()
    y[500, 321] += 1.0  # an element that is not sampled
    assert not same_fingerprint(f, fingerprints([y])[0])
    assert same_fingerprint(fingerprints([torch.full((3,), float("nan"))])[0],
                             fingerprints([torch.full((3,), float("nan"))])[0])
    assert not same_fingerprint(fingerprints([x])[0], fingerprints([x.double()])[0])
    z = torch.randn(12, 12, dtype=torch.complex64)  # a conjugate view: view_as_real refused it
    assert same_fingerprint(fingerprints([z.conj()])[0], fingerprints([z.conj().resolve_conj()])[0])
    assert not same_fingerprint(fingerprints([z.conj()])[0], fingerprints([z])[0])
    small = torch.randn(2, 2, 2, dtype=torch.complex64)  # compared element by element
    assert same_fingerprint(fingerprints([small.conj()])[0], fingerprints([small.conj().resolve_conj()])[0])
    assert same_fingerprint(fingerprints([small])[0], fingerprints([small.clone()])[0])
    assert not same_fingerprint(fingerprints([small])[0], fingerprints([small * (1 + 1e-7)])[0])


def test_fingerprints_see_elements_moved():
    """Swapping two elements that are not sampled left every sum the same: ranks whose operands
    differed so passed the value check and summed parts of different contractions."""
    from torch_gradops.distributed import fingerprints, same_fingerprint

    gen = torch.Generator().manual_seed(1)
    for shape in [(200,), (10, 20), (1000, 1000), (7, 13, 3)]:
        x = torch.randn(shape, dtype=torch.float32, generator=gen)
        n = x.numel()
        for i, j in [(5, n // 2 + 3), (1, 2), (n - 2, n - 1), (3, 3 + max(1, int(n ** 0.5)))]:
            y = x.flatten().clone()
            y[[i, j]] = y[[j, i]]
            assert not same_fingerprint(fingerprints([x])[0], fingerprints([y.view(shape)])[0]), (shape, i, j)
        assert same_fingerprint(fingerprints([x])[0], fingerprints([x.clone()])[0])
    assert fingerprints([torch.empty(3, 4, device="meta")])[0] == ((3, 4), "torch.float32")


def _tn_out_of_step(rank, world_size):
    import torch.distributed as dist

    import torch_gradops as tg

    torch.manual_seed(0)
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 5, dtype=torch.float64)
    for step in range(2):  # a training loop in which only rank 0 calls backward
        out = tg.tensornet.contract("ab,bc->ac", a, b, slicing=["b"], process_group=dist.group.WORLD)
        if rank == 0:
            out.sum().backward()


def test_ranks_out_of_step_get_a_clear_error():
    """Only rank 0 calling backward: rank 1's next forward check met rank 0's backward check
    and failed with a bare IndexError."""
    with pytest.raises(RuntimeError, match=r"out of step in distributed contractions: rank\(s\) \[0\] in a backward; "
                                           r"rank\(s\) \[1\] in a forward"):
        launch(_tn_out_of_step, 2, timeout=TIMEOUT)


def _tn_backward_order(rank, world_size, sizes):
    import torch.distributed as dist

    import torch_gradops as tg

    g = torch.Generator().manual_seed(0)
    k1, k2 = sizes
    a1 = torch.randn(4, k1, generator=g, dtype=torch.float64, requires_grad=True)
    a2 = torch.randn(4, k2, generator=g, dtype=torch.float64, requires_grad=True)
    b1, b2 = torch.randn(k1, 5, generator=g, dtype=torch.float64), torch.randn(k2, 5, generator=g, dtype=torch.float64)
    o1 = tg.distributed.contract("ab,bc->ac", a1, b1, slicing=["b"], process_group=dist.group.WORLD)
    o2 = tg.distributed.contract("ab,bc->ac", a2, b2, slicing=["b"], process_group=dist.group.WORLD)
    for o in ([o1, o2] if rank == 0 else [o2, o1]):  # the same losses, in another order on rank 1
        o.sum().backward()


@pytest.mark.parametrize("sizes", [(6, 6), (6, 7)])
def test_ranks_backpropagating_in_different_orders_get_a_clear_error(sizes):
    """Two contractions of one output shape, backpropagated in different orders on the two
    ranks: with equal operand shapes every rank got wrong gradients silently (the check compared
    only the output gradients, alike for two .sum() losses); with different ones gloo aborted
    the process."""
    with pytest.raises(RuntimeError, match=r"out of step in distributed contractions: they backpropagate through "
                                           r"different contractions of the group \(rank 0: #0, rank 1: #1"):
        launch(_tn_backward_order, 2, sizes, timeout=TIMEOUT)


def _tn_autocast_entry_points(rank, world_size):
    import torch.distributed as dist

    import torch_gradops as tg

    g = torch.Generator().manual_seed(0)
    ops = [torch.randn(8, 12, generator=g), torch.randn(12, 10, generator=g), torch.randn(10, 8, generator=g)]
    grads = []
    for fn in (tg.distributed.contract, tg.tensornet.contract):
        leaves = [o.clone().requires_grad_() for o in ops]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn("ab,bc,cd->ad", *leaves, slicing=["b"], process_group=dist.group.WORLD)
        out.float().square().sum().backward()
        grads.append([x.grad for x in leaves])
    return [torch.equal(u, v) for u, v in zip(*grads)]


def test_distributed_entry_points_agree_under_autocast():
    """Under CPU bfloat16 autocast distributed.contract cast inside its Function and took
    gradients with the float32 operands (0.02 off tensornet.contract(process_group=)'s)."""
    assert launch(_tn_autocast_entry_points, 2, timeout=TIMEOUT) == [[True, True, True]] * 2


def _tn_compiled_and_transforms(rank, world_size):
    import torch.distributed as dist

    import torch_gradops as tg
    from torch_gradops.distributed import contract

    torch.manual_seed(0)
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 5, dtype=torch.float64)
    tg.tensornet.plan("ab,bc->ac", a, b, slicing=["b"])

    def f(a, b):
        return torch.sin(contract("ab,bc->ac", a, b, slicing=["b"])).sum()
    out = torch.compile(f, backend="eager")(a, b)  # a graph break around the shared contraction
    out.backward()
    errors = {}

    def g(a, b):
        return torch.cos(contract("ab,bc->ac", a, b, slicing=["b"])).sum()
    try:
        torch.compile(g, backend="eager", fullgraph=True)(a, b)
    except Exception as e:
        errors["fullgraph"] = str(e)
    o = contract("ab,bc->ac", a, b, slicing=["b"])
    try:
        torch.autograd.grad(o, a, torch.eye(20, dtype=torch.float64).view(20, 4, 5), is_grads_batched=True)
    except NotImplementedError as e:
        errors["batched"] = str(e)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        try:
            contract("ab,bc->ac", fwAD.make_dual(a.detach(), torch.ones_like(a)), b, slicing=["b"])
        except NotImplementedError as e:
            errors["forward"] = str(e)
    try:
        contract("ab,bc->ac", a, b, process_group=[0, 1])
    except TypeError as e:
        errors["group"] = str(e)
    meta = contract("ab,bc->ac", a.to("meta"), b.to("meta"), slicing=["b"])
    return out.item(), a.grad, errors, tuple(meta.shape), meta.device.type


def test_distributed_contraction_compiles_with_a_graph_break_and_names_unsupported_uses():
    """torch.compile over the shared contraction failed inside Dynamo (all_gather_object's
    process group is a script object it cannot trace); batched gradients and forward mode
    failed with PyTorch's generic errors; a list as process_group with "unhashable type";
    meta operands in the value check ("Cannot copy out of meta tensor")."""
    torch.manual_seed(0)
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 5, dtype=torch.float64)
    want = torch.sin(a @ b).sum()
    want.backward()
    for value, grad, errors, meta_shape, meta_device in launch(_tn_compiled_and_transforms, 2, timeout=TIMEOUT):
        assert abs(value - want.item()) < 1e-12 and torch.allclose(grad, a.grad, atol=1e-12)
        assert "Python collectives" in errors["fullgraph"]
        assert "batched gradients" in errors["batched"] and "contract locally" in errors["batched"]
        assert "forward-mode AD" in errors["forward"]
        assert "process_group must be a torch.distributed ProcessGroup" in errors["group"]
        assert meta_shape == (4, 5) and meta_device == "meta"


def test_process_group_must_be_a_group_even_without_torch_distributed():
    """Without an initialised process group any process_group ran locally ("bogus" too)."""
    from torch_gradops.distributed import contract
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        contract("ab,bc->ac", a, b, process_group="bogus")


def _exit_hard_on_rank_one(rank, world_size):
    import os
    import time
    if rank == 1:
        os._exit(7)
    time.sleep(30)


def test_launch_names_the_rank_that_died_without_raising():
    """A rank that died hard (os._exit, a crash, a kill) was not named: the report blamed rank 0,
    which the launcher itself had stopped."""
    with pytest.raises(RuntimeError, match=r"rank 1 exited without a result \(exit code 7: killed or crashed\); "
                                           r"rank\(s\) \[0\] were stopped after it"):
        launch(_exit_hard_on_rank_one, 2, timeout=TIMEOUT)


def test_split_and_rank_slices_refuse_bad_numbers():
    with pytest.raises(ValueError, match="costs must be finite and >= 0, got nan at position 1"):
        split_by_cost([1.0, float("nan"), 2.0], 2)
    with pytest.raises(ValueError, match="costs must be finite"):
        split_by_cost([1.0, -2.0], 2)
    with pytest.raises(ValueError, match="num_slices must be >= 0"):
        rank_slices(-4, 2, 0)


def test_example_refuses_more_ranks_than_training_nodes():
    """With more ranks than Cora's 140 training nodes a rank trained on empty batches (NaN
    losses) and reported an accuracy."""
    with pytest.raises(ValueError, match="141 ranks but only 140 training nodes"):
        _example().train(0, 141, epochs=1)


def _tn_group_membership_func_progress(rank, world_size):
    import torch.distributed as dist

    import torch_gradops as tg

    out = {}
    only_zero = dist.new_group([0])  # every rank must create it
    torch.manual_seed(0)  # the same operands on every rank
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    try:
        tg.distributed.contract("ab,bc->ac", a, b, slicing=["b"], process_group=only_zero)
        out["member"] = "ran"
    except ValueError as e:
        out["member"] = str(e)
    try:
        torch.func.grad(lambda x: tg.distributed.contract("ab,bc->", x, b, slicing=["b"]))(a)
        out["func"] = "ran"
    except NotImplementedError as e:
        out["func"] = str(e)
    got = tg.distributed.contract("ab,bc->ac", a, b, slicing=["b"], progress=True)
    out["progress_close"] = bool(torch.allclose(got, a @ b))
    return out


def test_distributed_contract_group_membership_func_and_progress():
    results = launch(_tn_group_membership_func_progress, 2, timeout=TIMEOUT)
    assert results[0]["member"] == "ran"  # a group of one: local
    assert "not a member of process_group" in results[1]["member"]  # was "rank -1 is not in a world of size -1"
    assert all("torch.func transforms" in r["func"] for r in results)  # was an opaque all_reduce error
    assert all(r["progress_close"] for r in results)


def test_distributed_contract_local_path_fills_stats():
    from torch_gradops.distributed import ContractStats, contract

    expr, ops, options = _tn_inputs(0)
    stats = ContractStats()
    contract(expr, *ops, stats=stats, **options)  # no process group: local, every slice here
    from torch_gradops import tensornet
    plan = tensornet.plan(expr, *ops, **options)
    assert stats.slices == plan.num_slices > 1 and stats.compute_s > 0 and stats.comm_s == 0


def _tn_half_partials_cancelling(rank, world_size):
    import torch.distributed as dist

    from torch_gradops.distributed import contract

    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        # slices 0-1 on rank 0 (partial sum 2048 + 1, which neither dtype holds), 2-3 on rank 1 (-2048)
        a = torch.tensor([[2048.0], [1.0], [-2048.0], [0.0]], dtype=dtype)
        v = torch.ones(1, dtype=dtype, requires_grad=True)
        w = torch.ones(4, dtype=dtype)
        res = contract("ij,j,i->", a, v, w, slicing=["i"], process_group=dist.group.WORLD)
        res.backward()
        out[str(dtype)] = (res.dtype, res.item(), v.grad.dtype, v.grad.item())
    return out


def test_half_precision_partials_cancelling_across_ranks_are_exact():
    """Each rank's float16/bfloat16 slices are summed in float32 and the ranks' partial results
    and gradients travel in float32, rounded once after the all_reduce: partial sums that cancel
    across ranks give what a local contraction gives (rounded per rank they gave 0, not 1)."""
    for per_dtype in launch(_tn_half_partials_cancelling, 2, timeout=TIMEOUT):
        for name, (dtype, value, grad_dtype, grad) in per_dtype.items():
            assert str(dtype) == str(grad_dtype) == name
            assert value == 1.0 and grad == 1.0, name


def _tn_graph_outliving_its_group(rank, world_size):
    import gc
    import weakref

    import torch.distributed as dist

    from torch_gradops.distributed import contract

    group = dist.new_group(list(range(world_size)))
    a, b = torch.ones(4, 6, requires_grad=True), torch.ones(6, 3)
    out = contract("ab,bc->ac", a, b, slicing=["b"], process_group=group)
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    released = ref() is None
    try:
        out.sum().backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    return released, error


def test_autograd_graph_does_not_keep_the_process_group_alive():
    """The graph of a distributed contraction held its process group: a script's last output,
    alive until exit, kept the group (and gloo's worker threads) past destroy_process_group
    into interpreter shutdown, where a worker releasing its last work aborted the process
    ("terminate called without an active exception": 3 of 24 runs of a two-rank script, 0 of
    36 since). Destroyed, the group is gone; a backward after that says why it cannot run."""
    for released, error in launch(_tn_graph_outliving_its_group, 2, timeout=TIMEOUT):
        assert released
        assert error is not None and "destroyed before its backward" in error
