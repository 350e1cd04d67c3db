import os
import subprocess
import sys


def _avoid_unusable_amx():
    """Some VMs report AMX in cpuid while the hypervisor does not enable it: oneDNN's bfloat16
    GEMMs (torch's F.linear in bf16) then die with SIGILL, in torch itself. oneDNN reads its ISA
    cap once, before torch's first oneDNN call, so probe in a child process and cap it here,
    before this process imports torch. Nothing changes on machines where the probe passes."""
    if "ONEDNN_MAX_CPU_ISA" in os.environ or "torch" in sys.modules:
        return
    probe = ("import torch; x = torch.ones(32, 32, dtype=torch.bfloat16); "
             "torch.nn.functional.linear(x, x)")
    rc = subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode
    if rc < 0 or rc == 128 + 4:  # killed by SIGILL
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_FP16"


_avoid_unusable_amx()

import pytest  # noqa: E402
import torch  # noqa: E402

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Parametrise a test over devices: the CUDA case carries the `cuda` marker.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def runs_at_thread_counts(run, counts):
    """``[run() at each of torch's thread counts in counts]``, the thread count restored after:
    the CPU kernels' results must not depend on it."""
    threads = torch.get_num_threads()
    try:
        out = []
        for n in counts:
            torch.set_num_threads(n)
            out.append(run())
        return out
    finally:
        torch.set_num_threads(threads)
