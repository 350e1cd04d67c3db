"""Running torch_gradops across processes with ``torch.distributed``.

* :func:`launch` starts ``world_size`` local processes (gloo on CPU, NCCL on GPUs) on a free
  127.0.0.1 port, returns each rank's result, and always cleans up: a failing or hanging rank
  ends the whole group with a clear error. Tests and benchmarks use it; production jobs use
  ``torchrun`` (see the README's "Scaling out").
* :func:`split_by_cost` balances work items (slices) over ranks.
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

__all__ = ["launch", "split_by_cost", "free_port"]


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
