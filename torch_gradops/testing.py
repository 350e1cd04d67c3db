"""Helpers that the tests, the benchmarks and the demo share (public, documented, stable).

* Memory: :class:`PeakMemory` (peak extra memory of a region), :func:`peak_allocated_bytes`
  (exact peak of CPU tensor bytes), :func:`format_bytes`.
* Executor: :func:`gemm_team_parts`, how much work the contraction executor's GEMM team (its
  helper threads under ``OMP_WAIT_POLICY=PASSIVE``) has run.
* Determinism: :func:`atomic_sum_ops` lists the calls in a function that CUDA would sum with
  atomics (results not bitwise repeatable there), run on any device.
* Processes: :func:`launch` runs a function on ``world_size`` local ranks with a process group
  (gloo or NCCL) and always cleans up; :func:`free_port`.
* GAT: :func:`gat_composite`, the plain-PyTorch GAT (index_select + scatter softmax +
  index_add, what PyG's ``GATConv`` computes; it materialises ``E x H x C``); :class:`CoraGAT`
  and :func:`train_cora`, the original GAT trained on Cora.
* Tensor networks: generators of real-shaped networks (:func:`circuit_amplitude_network`,
  :func:`peps_norm_network`, :func:`mps_network`, :func:`lattice_network`), :func:`interleave` (a network as the
  interleaved arguments of :func:`torch_gradops.tensornet.contract`) and
  :func:`einsum_pairwise`, a torch.einsum evaluator for networks with more modes than
  ``torch.einsum`` has letters.
"""
from __future__ import annotations

import ctypes
import gc
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ._units import format_bytes

__all__ = ["PeakMemory", "peak_allocated_bytes", "format_bytes", "gemm_team_parts", "atomic_sum_ops", "free_port",
           "launch", "gat_composite", "CoraGAT", "train_cora", "powerlaw_edge_index", "Network",
           "circuit_amplitude_network", "peps_norm_network", "mps_network", "lattice_network", "interleave",
           "einsum_pairwise"]


# ---------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: the peak extra memory.

    CUDA: ``max_memory_allocated`` minus what was allocated at entry (tensor bytes). CPU
    (Linux): freed heap is returned to the OS (``malloc_trim``), the kernel's resident-set
    high-water mark is reset (``/proc/self/clear_refs``), and the result is ``VmHWM`` at exit
    minus ``VmRSS`` at entry: every page the process touched (tensors, allocator slack, Python
    objects), an upper bound on tensor memory. ``peak_bytes`` stays None where neither works.
    """

    METHOD_CPU = "VmHWM - VmRSS(entry) from /proc/self/status, after malloc_trim(0) and a VmHWM reset"
    METHOD_CUDA = "torch.cuda.max_memory_allocated() - memory_allocated() at entry"

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak_bytes = None
        self.method = self.METHOD_CUDA if self.device.type == "cuda" else self.METHOD_CPU

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024
        except (OSError, KeyError):
            self.base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self.base is not None:
            self.peak_bytes = _status_kib("VmHWM") * 1024 - self.base
        return False


def peak_allocated_bytes(fn) -> int:
    """Peak of live CPU tensor-allocator bytes while ``fn()`` runs, from the torch profiler's
    memory events: tensor memory only, exact, and independent of what the process held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


# ---------------------------------------------------------------------------- determinism
# ATen ops whose CUDA kernels add with atomics where an index repeats: the order of each sum,
# and so its rounding, changes from run to run. (op name -> the index argument's position, or
# None: always atomic.)
_ATOMIC_SUMS = {"index_add": 2, "index_add_": 2, "scatter_add": 2, "scatter_add_": 2, "scatter_reduce": 2,
                "scatter_reduce_": 2, "index_put": 1, "index_put_": 1, "_index_put_impl_": 1, "put_": 1,
                "put": 1, "embedding_dense_backward": None, "_embedding_bag_backward": None,
                "_embedding_bag_dense_backward": None, "bincount": None, "histc": None}


# ---------------------------------------------------------------------------- executor
def gemm_team_parts() -> int:
    """Parts of GEMMs and layout copies that the contraction executor has split across its GEMM
    team in this process so far (``csrc/cpu/gemm_team.h``: under ``OMP_WAIT_POLICY=PASSIVE``
    with more than one thread, helper threads that spin for work only during an executor call).
    Zero under other policies; tests use it to know that the split paths ran."""
    from . import library
    return int(library._C.gemm_team_parts())


def _repeats(t) -> bool:
    if isinstance(t, (list, tuple)):
        return any(_repeats(u) for u in t if u is not None)
    return isinstance(t, torch.Tensor) and t.numel() > 1 and torch.unique(t).numel() < t.numel()


def _is_atomic_sum(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name not in _ATOMIC_SUMS:
        return False
    if args and isinstance(args[0], torch.Tensor) and not (args[0].is_floating_point() or args[0].is_complex()) \
            and name != "bincount":
        return False  # integer sums are exact in any order
    if name in ("index_put", "index_put_", "_index_put_impl_", "put_", "put"):
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if not accumulate:
            return False
    if name == "bincount" and kwargs.get("weights", args[1] if len(args) > 1 else None) is None:
        return False  # integer counts are exact in any order
    pos = _ATOMIC_SUMS[name]
    return pos is None or _repeats(kwargs.get("index", kwargs.get("indices", args[pos] if len(args) > pos else None)))


def atomic_sum_ops(fn: Callable[[], Any]) -> List[str]:
    """Runs ``fn()`` and returns the ATen calls in it (forward, backward, torch.func, all that
    dispatches) that a CUDA device would compute with atomic adds over repeated indices:
    ``index_add`` and ``index_put(accumulate=True)`` whose index repeats, ``scatter_add``,
    ``scatter_reduce``, ``embedding`` backward, weighted ``bincount``. On CUDA their results are
    not bitwise repeatable (unless ``torch.use_deterministic_algorithms(True)`` picks a slower
    kernel); an empty list means none ran. Works on any device, the CPU included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found: List[str] = []

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _is_atomic_sum(func, args, kwargs):
                found.append(str(func))
            return func(*args, **kwargs)

    with _Recorder():
        fn()
    return found


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def _worker(rank: int, world_size: int, port: int, backend: str, result_dir: str,
            fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    path = os.path.join(result_dir, f"rank{rank}.pt")
    failed_at = None  # when fn raised: before destroying the group, which fails the waiting peers
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            failed_at = time.time()
            raise
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report every failure, KeyboardInterrupt included
        torch.save({"ok": False, "error": traceback.format_exc(), "time": failed_at or time.time()}, path)
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
        exited = None  # (rank, exit code) of a rank that died without raising (a crash, a kill, os._exit)
        stopped = []   # ranks still running when the run ended, stopped here
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"distributed run did not finish within {timeout:.0f} s")
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is in its result file
        except mp.ProcessExitedException as e:
            exited = (e.error_index, e.exit_code)
        finally:
            for rank, p in enumerate(ctx.processes):
                if p.is_alive():
                    stopped.append(rank)
                    p.kill()
                p.join(5)
        results, failed, missing = [], [], []
        for rank in range(world_size):
            path = os.path.join(result_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                missing.append(rank)
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results.append(payload["result"])
            else:
                failed.append((payload["time"], rank, payload["error"]))
        if failed:
            # the rank that failed first is the cause; the others usually failed waiting for it
            # (a collective whose peer is gone), so their tracebacks come after
            failed.sort()
            text = "\n".join(f"rank {rank} failed{' first' if i == 0 and len(failed) > 1 else ''}:\n{err}"
                              for i, (_, rank, err) in enumerate(failed))
            raise RuntimeError(text + (f"\nranks {missing} exited without a result" if missing else ""))
        if missing:
            if exited is not None and exited[0] in missing:  # the rank that died first is the cause
                rank, code = exited
            else:
                rank = next((r for r in missing if r not in stopped), missing[0])
                code = ctx.processes[rank].exitcode
            why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            after = [r for r in missing if r != rank]  # stopped by torch's spawn or here
            raise RuntimeError(f"rank {rank} exited without a result ({why}: killed or crashed)"
                               + (f"; rank(s) {after} were stopped after it" if after else ""))
        return results

# ---------------------------------------------------------------------------- GAT
def gat_composite(x_src: torch.Tensor, a_src: torch.Tensor, a_dst: torch.Tensor, src: torch.Tensor,
                  dst: torch.Tensor, num_dst: int, negative_slope: float = 0.2,
                  edge_logits: Optional[torch.Tensor] = None, dropout_mask: Optional[torch.Tensor] = None,
                  dropout_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch GAT attention and aggregation, as PyG's ``GATConv`` computes it between its
    projections and bias: ``(out [num_dst, H, C], alpha [E, H])`` with alpha after dropout.

    ``x_src [num_src, H, C]``, ``a_src [num_src, H]``, ``a_dst [num_dst, H]``, ``src``/``dst``
    ``[E]`` edge ends, ``edge_logits [E, H]`` or None, ``dropout_mask [E, H]`` (bool, kept
    edges) replayed with ``dropout_scale``. Differentiable; materialises ``E x H x C``. Computes
    in the inputs' dtype, like PyG.
    """
    src, dst = src.long(), dst.long()
    z = a_src.index_select(0, src) + a_dst.index_select(0, dst)
    if edge_logits is not None:
        z = z + edge_logits
    s = F.leaky_relu(z, negative_slope)
    smax = torch.full((num_dst, s.size(1)), float("-inf"), dtype=s.dtype, device=s.device)
    smax = smax.scatter_reduce(0, dst.view(-1, 1).expand_as(s), s.detach(), "amax", include_self=True)
    p = (s - smax.index_select(0, dst)).exp()
    alpha = p / torch.zeros_like(smax).index_add(0, dst, p).index_select(0, dst)
    if dropout_mask is not None:
        alpha = alpha * dropout_mask.to(alpha.dtype) * dropout_scale
    out = torch.zeros((num_dst,) + tuple(x_src.shape[1:]), dtype=x_src.dtype, device=x_src.device)
    return out.index_add(0, dst, alpha.unsqueeze(-1) * x_src.index_select(0, src)), alpha


class CoraGAT(torch.nn.Module):
    """The paper's 2-layer GAT for Cora, on a given ``GATConv`` class."""

    def __init__(self, conv_cls, in_channels: int, num_classes: int, hidden: int = 8,
                 heads: int = 8, dropout: float = 0.6):
        super().__init__()
        self.dropout = dropout
        self.conv1 = conv_cls(in_channels, hidden, heads=heads, dropout=dropout)
        self.conv2 = conv_cls(hidden * heads, num_classes, heads=1, concat=False, dropout=dropout)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


def train_cora(conv_cls, data, device: torch.device, epochs: int = 200, seed: int = 0,
               progress: bool = False, desc: str = "") -> Dict[str, float]:
    """Train :class:`CoraGAT` on ``data`` (already on ``device``); returns the metrics.

    Returns:
        ``{"test_acc": test accuracy at the best validation accuracy, "best_val_acc",
        "final_test_acc", "epoch_s": mean wall time of one epoch (training step + evaluation),
        "peak_bytes": see :class:`PeakMemory` (None if unavailable)}``.
    """
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    model = CoraGAT(conv_cls, data.num_features, int(data.y.max()) + 1).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
    best_val, test_at_best, test_acc = -1.0, 0.0, 0.0

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with PeakMemory(device) as mem:
        sync()
        t0 = time.perf_counter()
        bar = tqdm(range(epochs), desc=desc, disable=not progress, leave=True)
        for _ in bar:
            model.train()
            opt.zero_grad()
            out = model(data.x, data.edge_index)
            loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                pred = model(data.x, data.edge_index).argmax(dim=-1)
            correct = pred == data.y
            val_acc = correct[data.val_mask].float().mean().item()
            test_acc = correct[data.test_mask].float().mean().item()
            if val_acc > best_val:
                best_val, test_at_best = val_acc, test_acc
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{val_acc:.3f}", test=f"{test_acc:.3f}")
        sync()
        elapsed = time.perf_counter() - t0
    return {"test_acc": test_at_best, "best_val_acc": best_val, "final_test_acc": test_acc,
            "epoch_s": elapsed / max(epochs, 1), "peak_bytes": mem.peak_bytes}


# ---------------------------------------------------------------------------- graphs
def powerlaw_edge_index(num_nodes: int, num_edges: int, exponent: float = 2.1, seed: int = 0,
                        by_degree: bool = False) -> torch.Tensor:
    """``[2, num_edges]`` edge index of a random graph with power-law in- and out-degrees
    (Chung-Lu: each end drawn with probability proportional to ``rank^(-1/(exponent-1))``, so
    the degree distribution has tail exponent ``exponent``; 2.1 is typical of web and social
    graphs, whose largest hubs then hold a few percent of all edges). Node ids are shuffled, or
    with ``by_degree`` numbered by expected degree, hubs first, as many real data sets number
    them (which defeats parallel loops that split nodes by count). Self-loops and duplicate
    edges occur, as in sampled real graphs. (PyG's ``barabasi_albert_graph`` grows its graph one
    node at a time: 310 s for 100k nodes.)"""
    if num_nodes < 1 or num_edges < 0:
        raise ValueError(f"need num_nodes >= 1 and num_edges >= 0, got {num_nodes}, {num_edges}")
    if exponent <= 1.0:
        raise ValueError(f"exponent must be > 1, got {exponent}")
    gen = torch.Generator().manual_seed(seed)
    weight = torch.arange(1, num_nodes + 1, dtype=torch.float64).pow(-1.0 / (exponent - 1.0))
    ends = torch.multinomial(weight, 2 * num_edges, replacement=True, generator=gen) if num_edges else \
        torch.zeros(0, dtype=torch.long)
    if not by_degree:
        ends = torch.randperm(num_nodes, generator=gen)[ends]
    return ends.view(2, num_edges)


# ---------------------------------------------------------------------------- tensor networks
Network = Tuple[List[List[int]], List[int], List[torch.Tensor]]  # (inputs, output, arrays)


def _random_unitary(n: int, gen: torch.Generator, dtype) -> torch.Tensor:
    z = torch.complex(torch.randn(n, n, generator=gen, dtype=torch.float64),
                      torch.randn(n, n, generator=gen, dtype=torch.float64))
    q, r = torch.linalg.qr(z)
    d = torch.diagonal(r)
    return (q * (d / d.abs())).to(dtype)  # Haar-random


def circuit_amplitude_network(rows: int, cols: int, depth: int, seed: int = 0,
                              dtype=torch.complex64) -> Network:
    """<bits| C |0...0> for a random circuit on a rows x cols grid: ``depth`` layers of Haar-random
    two-qubit gates on the grid's edges in the cycling patterns (horizontal even/odd, vertical
    even/odd), as in random-circuit-sampling experiments (single-qubit gates fused in).

    Returns (inputs, output, arrays): per tensor its int mode labels; output ``[]`` (a scalar);
    tensors: |0> vectors [2], gates [2, 2, 2, 2] (out_a, out_b, in_a, in_b), <bit| vectors [2].
    """
    gen = torch.Generator().manual_seed(seed)
    nq = rows * cols
    counter = iter(range(1 << 30))
    cur = []
    inputs, arrays = [], []
    for _ in range(nq):
        m = next(counter)
        cur.append(m)
        inputs.append([m])
        arrays.append(torch.tensor([1.0, 0.0], dtype=dtype))
    q = lambda r, c: r * cols + c  # noqa: E731
    patterns = [
        [(q(r, c), q(r, c + 1)) for r in range(rows) for c in range(0, cols - 1, 2)],
        [(q(r, c), q(r + 1, c)) for r in range(0, rows - 1, 2) for c in range(cols)],
        [(q(r, c), q(r, c + 1)) for r in range(rows) for c in range(1, cols - 1, 2)],
        [(q(r, c), q(r + 1, c)) for r in range(1, rows - 1, 2) for c in range(cols)],
    ]
    for layer in range(depth):
        for a, b in patterns[layer % 4]:
            oa, ob = next(counter), next(counter)
            inputs.append([oa, ob, cur[a], cur[b]])
            arrays.append(_random_unitary(4, gen, dtype).reshape(2, 2, 2, 2))
            cur[a], cur[b] = oa, ob
    bits = torch.randint(0, 2, (nq,), generator=gen)
    for i in range(nq):
        inputs.append([cur[i]])
        v = torch.zeros(2, dtype=dtype)
        v[int(bits[i])] = 1
        arrays.append(v)
    return inputs, [], arrays


def peps_norm_network(rows: int, cols: int, bond: int, phys: int = 2, seed: int = 0,
                      dtype=torch.float32) -> Network:
    """<psi|psi> of a random rows x cols PEPS: ket tensors [phys, bonds...] and their bras
    (conjugates) sharing the physical mode. Output ``[]``."""
    gen = torch.Generator().manual_seed(seed)
    counter = iter(range(1 << 30))
    h = {(r, c): next(counter) for r in range(rows) for c in range(cols - 1)}  # ket bonds
    v = {(r, c): next(counter) for r in range(rows - 1) for c in range(cols)}
    h2 = {k: next(counter) for k in h}  # bra bonds
    v2 = {k: next(counter) for k in v}
    inputs, arrays = [], []
    for r in range(rows):
        for c in range(cols):
            p = next(counter)
            def bonds(hh, vv):
                out = []
                if c > 0:
                    out.append(hh[(r, c - 1)])
                if c < cols - 1:
                    out.append(hh[(r, c)])
                if r > 0:
                    out.append(vv[(r - 1, c)])
                if r < rows - 1:
                    out.append(vv[(r, c)])
                return out
            kb = bonds(h, v)
            t = torch.randn((phys,) + (bond,) * len(kb), generator=gen, dtype=torch.float64) / bond ** 0.5
            inputs.append([p] + kb)
            arrays.append(t.to(dtype))
            inputs.append([p] + bonds(h2, v2))
            arrays.append(t.conj().to(dtype))
    return inputs, [], arrays


def mps_network(n: int, bond: int = 4, phys: int = 2, seed: int = 0, dtype=torch.float32) -> Network:
    """An open MPS of ``n`` tensors [bond, phys, bond] (ends [phys, bond] / [bond, phys])
    contracted with itself over the physical modes (a norm). Output ``[]``."""
    gen = torch.Generator().manual_seed(seed)
    counter = iter(range(1 << 30))
    k = [next(counter) for _ in range(n - 1)]
    b = [next(counter) for _ in range(n - 1)]
    inputs, arrays = [], []
    for i in range(n):
        p = next(counter)
        lk = ([k[i - 1]] if i > 0 else []) + [p] + ([k[i]] if i < n - 1 else [])
        lb = ([b[i - 1]] if i > 0 else []) + [p] + ([b[i]] if i < n - 1 else [])
        shape = tuple(bond if j != (1 if i > 0 else 0) else phys for j in range(len(lk)))
        t = torch.randn(shape, generator=gen, dtype=torch.float64) / (bond * phys) ** 0.5
        inputs += [lk, lb]
        arrays += [t.to(dtype), t.to(dtype)]
    return inputs, [], arrays


def lattice_network(rows: int, cols: int, bond: int, seed: int = 0, dtype=torch.float32,
                    cyclic: bool = False) -> Network:
    """A ``rows x cols`` lattice of random tensors with bonds of extent ``bond`` and a scalar
    output: ``cotengra.utils.lattice_equation([rows, cols], d_min=bond, seed=seed)`` (the
    geometry of the tensornet benchmarks) with int mode labels, tensors N(0, 1/bond)."""
    import cotengra

    eq = cotengra.utils.lattice_equation([rows, cols], cyclic=cyclic, d_min=bond, d_max=bond, seed=seed)
    ids: Dict[Any, int] = {}
    inputs = [[ids.setdefault(ix, len(ids)) for ix in term] for term in eq.inputs]
    gen = torch.Generator().manual_seed(seed)
    arrays = [(torch.randn(tuple(eq.size_dict[ix] for ix in term), generator=gen, dtype=torch.float64)
               / bond ** 0.5).to(dtype) for term in eq.inputs]
    return inputs, [ids[ix] for ix in eq.output], arrays


def _letters(modes) -> Dict[Any, str]:
    """Mode -> einsum letter, a-z then A-Z (torch.einsum's 52)."""
    return {m: chr(97 + n) if n < 26 else chr(65 + n - 26) for n, m in enumerate(modes)}


def einsum_pairwise(inputs: Sequence[Sequence[int]], output: Sequence[int], arrays: Sequence[torch.Tensor],
                    path: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Evaluate the network with one torch.einsum call per pairwise step of ``path`` (letters
    assigned per step), differentiable through torch's autograd."""
    items = [(list(t), a) for t, a in zip(inputs, arrays)]
    out_set = set(output)
    for step in path:
        i, j = sorted(step)
        (mj, b), (mi, a) = items.pop(j), items.pop(i)
        rest = set(out_set)
        for t, _ in items:
            rest.update(t)
        keep = [m for m in dict.fromkeys(mi + mj) if m in rest]
        letters = _letters(dict.fromkeys(mi + mj))
        eq = "".join(letters[m] for m in mi) + "," + "".join(letters[m] for m in mj) + "->" + \
            "".join(letters[m] for m in keep)
        items.append((keep, torch.einsum(eq, a, b)))
    (modes, res), = items
    letters = _letters(modes)
    return torch.einsum("".join(letters[m] for m in modes) + "->" + "".join(letters[m] for m in output), res)


def interleave(inputs: Sequence[Sequence[Any]], arrays: Sequence[torch.Tensor], output: Sequence[Any]) -> list:
    """``[a0, modes0, a1, modes1, ..., output]``: a network as interleaved contract() arguments."""
    args: list = []
    for modes, a in zip(inputs, arrays):
        args += [a, list(modes)]
    args.append(list(output))
    return args
