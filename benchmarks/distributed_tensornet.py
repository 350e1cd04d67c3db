"""Strong scaling of a sliced tensor-network contraction with gradients over ranks.

The same random-circuit amplitude network (complex64), sliced by a memory limit, contracted
with gradients w.r.t. every tensor on 1 and 2 ranks (gloo on CPU, one thread per rank; NCCL
and one GPU per rank with --device cuda), plus 1 rank with 2 threads for context. Reports the
median forward+backward time, the speed-up over 1 rank, and each rank's compute and
communication time. Prints a table and writes JSON under benchmarks/results/.

    python benchmarks/distributed_tensornet.py [--ranks 1 2] [--rows 4 --cols 5 --depth 12]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _rank_run(rank, world_size, threads, rows, cols, depth, limit_div, repeats, device):
    import torch
    import torch.distributed as dist

    import torch_gradops as tg
    from torch_gradops.distributed import ContractStats
    from torch_gradops.testing import circuit_amplitude_network

    torch.set_num_threads(threads)
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    inputs, output, arrays = circuit_amplitude_network(rows, cols, depth, seed=1, dtype=torch.complex64)
    args = []
    for labels, a in zip(inputs, arrays):
        args += [a.to(dev).requires_grad_(), labels]
    args.append(output)
    operands = args[0:-1:2]
    base = tg.tensornet.plan(*args)
    limit = max(base.largest_intermediate[1] // limit_div, 64)
    plan = tg.tensornet.plan(*args, memory_limit=limit, optimize="greedy")

    def step(stats=None):
        out = tg.distributed.contract(*args, plan=plan, process_group=dist.group.WORLD, stats=stats)
        torch.autograd.grad(out.abs().square(), operands)

    step()  # warm-up
    times, stats = [], []
    for _ in range(repeats):
        dist.barrier()
        s = ContractStats()
        t0 = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - t0)
        stats.append(s)
    return {"seconds": statistics.median(times), "compute_s": statistics.median(s.compute_s for s in stats),
            "comm_s": statistics.median(s.comm_s for s in stats), "slices": stats[-1].slices,
            "num_slices": plan.num_slices, "flops": plan.flops, "tensors": len(operands),
            "sliced_modes": len(plan.sliced_modes)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=5)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--limit-div", type=int, default=64, help="memory limit = largest unsliced intermediate / this")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on shared cores
    from torch_gradops.testing import launch

    backend = "nccl" if args.device == "cuda" else "gloo"
    runs = [(w, 1) for w in args.ranks] + ([(1, 2)] if args.device == "cpu" else [])
    rows = []
    for world, threads in runs:
        res = launch(_rank_run, world, threads, args.rows, args.cols, args.depth, args.limit_div, args.repeats,
                     args.device, backend=backend, timeout=1800)
        row = {"ranks": world, "threads_per_rank": threads, "seconds": max(r["seconds"] for r in res),
               "per_rank": res}
        rows.append(row)
    base = next(r["seconds"] for r in rows if r["ranks"] == 1 and r["threads_per_rank"] == 1)
    first = rows[0]["per_rank"][0]
    print(f"circuit {args.rows}x{args.cols} depth {args.depth}: {first['tensors']} tensors, "
          f"{first['sliced_modes']} sliced modes -> {first['num_slices']} slices, {first['flops'] / 1e9:.2f} GFLOP")
    print(f"{'ranks':>5} {'thr/rank':>8} {'fwd+bwd':>10} {'speed-up':>8} {'compute (max rank)':>19} {'comm (max rank)':>16}")
    for row in rows:
        row["speedup_vs_1_rank"] = base / row["seconds"]
        # One rank runs the local path (no collective): all of its time is compute.
        comp = row["seconds"] if row["ranks"] == 1 else max(r["compute_s"] for r in row["per_rank"])
        comm = 0.0 if row["ranks"] == 1 else max(r["comm_s"] for r in row["per_rank"])
        print(f"{row['ranks']:>5} {row['threads_per_rank']:>8} {row['seconds'] * 1e3:8.1f} ms "
              f"{row['speedup_vs_1_rank']:7.2f}x {comp * 1e3:16.1f} ms {comm * 1e3:13.1f} ms")
    out = args.out or os.path.join(HERE, "results", f"distributed_tensornet_{args.device}.json")
    write_json(out, {"benchmark": "distributed_tensornet", "machine": machine_info(args.device),
                     "backend": backend, "network": {"rows": args.rows, "cols": args.cols, "depth": args.depth,
                                                     "dtype": "complex64", "limit_div": args.limit_div},
                     "rows": rows})


if __name__ == "__main__":
    main()
