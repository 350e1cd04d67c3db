"""Where does an argument error raised inside the compiled ops crash the process?

    python scripts/cuda_error_probe.py [--cpu-only]

On the GPU machines (H100 2026-11-24, H200 2026-11-27; torch 2.11, Ubuntu's Python 3.12) the
first raw-op call with a bad argument (``ops.gat_forward`` with a short ``indptr``) ended the
process with a segmentation fault instead of a RuntimeError, on CPU and CUDA tensors alike,
while the contraction compiler's error (a pybind function whose message is built without an
ostream) was raised. The backtrace placed libstdc++'s ostream code inside the extension (see
setup.py's _shared_libstdcxx). Each case runs in a fresh process, so one crash does not hide
the others: a bad call on the CPU before and after CUDA is initialised, a bad call on CUDA
tensors, the contraction compiler's check, and the same with ``TORCH_SHOW_CPP_STACKTRACES=1``.
Prints one line per case (``raised``, ``crashed (signal N)`` or ``no error``) and, for the first
crash, the native backtrace from cuda-gdb when it is on the PATH. Exit status: the number of
cases that did not raise. ``--cpu-only`` runs the cases that need no GPU, once (how the tests
check the script itself).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

SETUP = """
import torch, torch_gradops as tg
ops = torch.ops.torch_gradops
def bad_call(device):
    ei = torch.tensor([[0, 1, 2], [0, 0, 1]], device=device)
    g = tg.BipartiteCSC.from_edge_index(ei, 3, 2)
    x = torch.randn(3, 1, 2, device=device)
    a_src, a_dst = torch.randn(3, 1, device=device), torch.randn(2, 1, device=device)
    try:
        ops.gat_forward(x, a_src, a_dst, None, g.indptr[:-1], g.indices, None, 0.2, 1.0, False)
    except RuntimeError as e:
        assert "indptr must have num_dst + 1" in str(e), e
        print("raised")
    else:
        print("no error")
"""

CASES = {
    "cpu, CUDA untouched": "bad_call('cpu')",
    "cpu, after a CUDA op": "torch.ones(1, device='cuda').sum().item(); bad_call('cpu')",
    "cuda tensors": "bad_call('cuda')",
    "contraction compiler (pybind)": (
        "from torch_gradops import _C\n"
        "try:\n"
        "    _C.compile_contract_program([[0]], [0], [2], [(0, 1)], [], 4, False, [], 0)\n"
        "except (RuntimeError, ValueError, IndexError) as e:\n"
        "    print('raised')\n"
        "else:\n"
        "    print('no error')"),
}


def run(code: str, env: dict) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-c", SETUP + "\n" + code], capture_output=True, text=True, env=env)
    out = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode < 0:
        return f"crashed (signal {-proc.returncode})", proc.returncode
    if proc.returncode != 0:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", proc.returncode
    return out, 0 if out == "raised" else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-only", action="store_true", help="only the cases that need no GPU, once")
    args = parser.parse_args()
    cases = {k: v for k, v in CASES.items() if not (args.cpu_only and "cuda" in v)}
    bad, traced = 0, False
    for stack in ("0",) if args.cpu_only else ("0", "1"):
        env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES=stack)
        for name, code in cases.items():
            result, rc = run(code, env)
            print(f"{name:32s} TORCH_SHOW_CPP_STACKTRACES={stack}: {result}", flush=True)
            if rc:
                bad += 1
            if rc < 0 and not traced and shutil.which("cuda-gdb"):  # one backtrace: each takes about 30 s there
                traced = True
                with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
                    f.write(SETUP + "\n" + code + "\n")
                gdb = subprocess.run(["cuda-gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable,
                                      f.name], capture_output=True, text=True, env=env)
                print("\n".join(gdb.stdout.splitlines()[-60:]), flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
