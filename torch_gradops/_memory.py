"""Peak memory of a region of code, for the demo and the benchmarks."""
from __future__ import annotations

import ctypes
import gc

import torch

__all__ = ["PeakMemory", "peak_allocated_bytes"]


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
