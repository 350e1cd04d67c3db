"""Shared benchmark plumbing: fresh-process workers, timing, peak memory, machine facts, JSON."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_gradops.testing import PeakMemory, format_bytes  # noqa: E402  (the one peak-memory measurement)

__all__ = ["PeakMemory", "machine_info", "matmul_flops_per_s", "median_time", "run_worker", "write_json",
           "format_bytes"]


def _sysfs_choice(path: str):
    """The bracketed choice of a sysfs setting such as ``always [madvise] never``, or None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def machine_info(device: str) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device, "platform": platform.platform(), "load_average_1min": os.getloadavg()[0],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            # PyTorch's CPU allocator asks for 2 MiB pages for large tensors when this is "1"
            # (honoured when the kernel's transparent_hugepage mode is madvise or always)
            "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            "transparent_hugepage": _sysfs_choice("/sys/kernel/mm/transparent_hugepage/enabled")}
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda,
                    # the schedule the GAT/GATv2 forward kernels ran: "1" (one edge at a time) or
                    # "default" (their edge batches); the kernels take any other value as the default
                    cuda_edge_batch="1" if os.environ.get("TORCH_GRADOPS_CUDA_EDGE_BATCH") == "1" else "default")
    try:
        import torch_geometric
        info["torch_geometric"] = torch_geometric.__version__
    except ImportError:
        pass
    return info


def median_time(fn, device: str, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops_per_s(device: str, n: int | None = None) -> dict:
    """FLOP/s of one ``n x n`` matmul (median of 10 after a warm-up; n = 1024 on CPU, 8192 on a
    GPU) in float32 and complex64 (a complex multiply-add counts 8): the same-run reference the
    tensor-network benchmarks compare their achieved FLOP/s with."""
    n = n or (8192 if device.startswith("cuda") else 1024)
    out = {}
    for name, dtype, factor in (("float32", torch.float32, 2), ("complex64", torch.complex64, 8)):
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        out[name] = factor * n ** 3 / median_time(lambda: torch.matmul(a, b), device, repeats=10)
    return out


def run_worker(script: str, args: list[str], timeout: float = 1800, env: dict | None = None,
               worker_flag: str | None = "--worker") -> dict:
    """Run one configuration in a fresh Python process (``script [worker_flag] args``), which
    prints its result as the last JSON line; adds ``process_wall_s``. On failure returns
    ``{"error": last lines of its output}`` (also when it runs past ``timeout`` seconds)."""
    cmd = [sys.executable, script] + ([worker_flag] if worker_flag else []) + list(args)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired as e:  # one configuration's timeout must not lose the others
        out = e.stderr or e.stdout or b""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return {"error": f"timed out after {timeout} s: {out[-1500:]}", "returncode": None}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:], "returncode": proc.returncode}
    result = json.loads(lines[-1])
    result["process_wall_s"] = time.perf_counter() - t0
    return result


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")

