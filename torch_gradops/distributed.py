"""Running torch_gradops across processes with ``torch.distributed``.

* :func:`launch` starts ``world_size`` local processes (gloo on CPU, NCCL on GPUs) on a free
  127.0.0.1 port, returns each rank's result, and always cleans up: a failing or hanging rank
  ends the whole group with a clear error. Tests and benchmarks use it; production jobs use
  ``torchrun`` (see the README's "Scaling out").
* :func:`split_by_cost` balances work items (slices) over ranks.
* :func:`contract` / :func:`contract_plan` (also ``tensornet.contract(..., process_group=g)``):
  a sliced tensor-network contraction whose slices are shared by the ranks of a process group.
  Each rank contracts its slice group; one ``all_reduce`` (sum) combines the partial results,
  which covers both summed sliced modes and sliced output modes (a slice group's result holds
  its output blocks and zeros elsewhere). In backward each rank computes the gradients of its
  slices (one slice's intermediates at a time) and one ``all_reduce`` per dtype sums them, so
  ``loss.backward()`` on every rank gives every rank the full gradient, provided every rank
  backpropagates the same output gradient (as when each computes the same loss from the full
  result). With no process group initialised it is a plain local contraction.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "split_by_cost", "free_port", "contract", "contract_plan", "DistributedContractFunction",
           "last_contract_stats"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_by_cost(costs: Sequence[float], world_size: int) -> List[List[int]]:
    """Split items ``0..len(costs)-1`` into ``world_size`` groups of near-equal total cost.

    Greedy longest-processing-time: items by decreasing cost, each to the currently lightest
    rank (ties to the lowest rank), so every rank computes the same split. Groups keep the
    items in increasing order; a rank may get none when there are fewer items than ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0.0] * world_size
    groups: List[List[int]] = [[] for _ in range(world_size)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        groups[rank].append(item)
        loads[rank] += float(costs[item])
    return [sorted(g) for g in groups]


# --------------------------------------------------------------------------- tensor networks
_STATS = {"compute_s": 0.0, "comm_s": 0.0, "slices": 0}


def last_contract_stats() -> dict:
    """Seconds spent computing and communicating (and slices handled) by this rank in the last
    distributed forward and backward, for benchmarks."""
    return dict(_STATS)


def _rank_slices(plan, group) -> List[int]:
    """This rank's slice group: slices split by cost (equal per slice within a plan)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return split_by_cost([1.0] * plan.num_slices, world)[rank]


def _check_same_plan(plan, group) -> None:
    """Every rank must run the same path and slicing, or the partial sums do not add up.
    Randomised optimisers (cotengra's hyper-search) can differ per rank: refuse that."""
    mine = (list(plan.path), list(plan.sliced_modes), plan.num_slices)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)  # all ranks see all plans: all raise together
    if any(other != every[0] for other in every):
        raise RuntimeError(
            "ranks planned different contractions (path or sliced modes differ between ranks); "
            "use a deterministic optimize= (e.g. 'auto' or 'greedy'), an explicit path and "
            "slicing=[modes], or pass the same plan= on every rank")


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


class DistributedContractFunction(torch.autograd.Function):
    """``forward(plan, group, slices, *operands)``: this rank's slice group, then a sum
    ``all_reduce``; ``backward``: this rank's slices' gradients, then a sum ``all_reduce``."""

    @staticmethod
    def forward(ctx, plan, group, slices, *operands):
        t0 = time.perf_counter()
        with torch.no_grad():
            part = plan.contract(*operands, slices=slices)
        _sync(part)
        t1 = time.perf_counter()
        dist.all_reduce(part, group=group)
        _sync(part)
        _STATS.update(compute_s=t1 - t0, comm_s=time.perf_counter() - t1, slices=len(slices))
        ctx.plan, ctx.group, ctx.slices = plan, group, slices
        ctx.save_for_backward(*operands)
        return part

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "create_graph=True through a distributed contraction is not supported; contract "
                "locally (no process_group) for higher-order gradients")
        operands = ctx.saved_tensors
        want = ctx.needs_input_grad[3:]
        t0 = time.perf_counter()
        grads = [torch.zeros_like(op) if w else None for op, w in zip(operands, want)]
        if ctx.slices:
            ctx.plan.gradients(*operands, output_grad=grad_out.contiguous(), slices=ctx.slices,
                               grads=grads, accumulate=True)
        needed = [g for g in grads if g is not None]
        if needed:
            _sync(needed[0])
        t1 = time.perf_counter()
        # One collective per dtype: the gradients travel as one flat buffer.
        for dtype in dict.fromkeys(g.dtype for g in needed):
            group_grads = [g for g in needed if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in group_grads])
            dist.all_reduce(flat, group=ctx.group)
            offset = 0
            for g in group_grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        if needed:
            _sync(needed[0])
        _STATS.update(compute_s=_STATS["compute_s"] + t1 - t0,
                      comm_s=_STATS["comm_s"] + time.perf_counter() - t1)
        return (None, None, None, *grads)


def contract_plan(plan, operands, process_group=None, progress: bool = False) -> torch.Tensor:
    """Contract ``operands`` with ``plan``, the slices shared by the ranks of ``process_group``
    (default: the whole world when ``torch.distributed`` is initialised; otherwise local).
    Every rank gets the full result; gradients flow as described in the module docstring."""
    if not dist.is_available() or not dist.is_initialized():
        return plan.contract(*operands, progress=progress)
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return plan.contract(*operands, progress=progress)
    _check_same_plan(plan, group)
    slices = _rank_slices(plan, group)
    return DistributedContractFunction.apply(plan, group, slices, *operands)


def contract(*args, process_group=None, memory_limit=None, optimize="auto", slicing=None, plan=None,
             progress: bool = False) -> torch.Tensor:
    """:func:`torch_gradops.tensornet.contract` with the slices shared by the ranks of
    ``process_group`` (default: the world group when initialised; a plain local contraction
    when ``torch.distributed`` is not initialised)."""
    from .tensornet import resolve

    plan, operands = resolve(*args, memory_limit=memory_limit, optimize=optimize, slicing=slicing, plan=plan)
    return contract_plan(plan, operands, process_group, progress=progress)


# --------------------------------------------------------------------------- launcher
def _worker(rank: int, world_size: int, port: int, backend: str, result_dir: str,
            fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report every failure, KeyboardInterrupt included
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise


def launch(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo",
           timeout: float = 300.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return the results.

    The process group is initialised before ``fn`` runs and destroyed after it. ``fn`` must be
    importable (defined at module level) and its result picklable by ``torch.save``.

    Raises:
        RuntimeError: a rank failed (its traceback is included) or the group ran past
            ``timeout`` seconds; all processes are terminated either way.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="torch_gradops_dist_") as result_dir:
        ctx = mp.start_processes(_worker, args=(world_size, free_port(), backend, result_dir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"distributed run did not finish within {timeout:.0f} s")
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is in its result file
        except mp.ProcessExitedException:
            pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
        results = []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited without a result (killed or crashed)")
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["result"])
        return results
