"""Build script for torch_gradops.

Always builds the C++ (CPU) kernels. Adds the CUDA kernels when nvcc and a CUDA
build of torch are present; ``TORCH_GRADOPS_CUDA=0|1`` forces either way.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig


def _find_cuda_home():
    """A toolkit root with bin/nvcc and lib64/. torch guesses it from `which nvcc`, which is wrong
    when nvcc on PATH is a wrapper script (here /usr/local/bin/nvcc -> /usr/local/cuda-13.0)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in candidates:
        if os.path.exists(os.path.join(root, "bin", "nvcc")) and os.path.isdir(os.path.join(root, "lib64")):
            os.environ["CUDA_HOME"] = root
            return


_find_cuda_home()

import torch  # noqa: E402  (after CUDA_HOME is settled: cpp_extension reads it at import)
from setuptools import find_namespace_packages, setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda():
    forced = os.environ.get("TORCH_GRADOPS_CUDA")
    if forced is not None:
        if forced not in ("0", "1"):
            sys.exit(f"TORCH_GRADOPS_CUDA must be 0 or 1, got {forced!r}")
        if forced == "1" and (torch.version.cuda is None or CUDA_HOME is None):
            sys.exit("TORCH_GRADOPS_CUDA=1 but torch is not a CUDA build or nvcc/CUDA_HOME was not found")
        return forced == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def _cuda_library_includes():
    """torch's CUDA headers include cuBLAS/cuSPARSE; wheels of torch ship them under
    site-packages/nvidia/cu13 (or cu12, or per-library folders), not in CUDA_HOME."""
    if os.path.exists(os.path.join(CUDA_HOME, "include", "cublas_v2.h")):
        return []
    nvidia = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")
    found = []
    for pattern in ("cu13/include", "cu12/include", "*/include"):
        for path in sorted(glob.glob(os.path.join(nvidia, pattern))):
            if os.path.isdir(path) and path not in found:
                found.append(path)
        if found:
            break
    return found


def _cpu_arch_flags():
    """The CPU kernels are compute-bound (scores, exp, per-head FMAs): build them for x86-64-v3
    (AVX2 + FMA), or x86-64-v4 (AVX-512), when the build machine has it, as packages built from
    source usually do.
    TORCH_GRADOPS_CPU_ARCH=generic builds portable code; any other value is passed to -march."""
    arch = os.environ.get("TORCH_GRADOPS_CPU_ARCH", "auto")
    if arch == "generic":
        return []
    if arch != "auto":
        return [f"-march={arch}"]
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    needed = {"avx2", "fma", "bmi2", "f16c", "movbe"}
    if not needed.issubset(flags):
        return []
    # x86-64-v4 (AVX-512) where the build machine has it: the edge projection's loops use
    # 512-bit vectors there (csrc/cpu/kernel_utils.h, VecWide)
    return ["-march=x86-64-v4"] if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}.issubset(flags) \
        else ["-march=x86-64-v3"]


def _shared_libstdcxx():
    """Link flags that bind libstdc++ to the shared libstdc++.so.6 that torch itself uses.

    On the GPU machine (2026-11-27: Ubuntu's Python 3.12, torch 2.11, g++ 13) the first error
    message with a number in it crashed the process (SIGSEGV), and the backtrace placed
    libstdc++'s ostream and codecvt code inside this extension: a static copy of libstdc++
    mixed with the shared one. Naming the shared library before the compiler driver's own
    -lstdc++ resolves every libstdc++ symbol there, so no archive member is pulled in, whatever
    the environment adds (-static-libstdc++, a directory holding only libstdc++.a).
    tests/test_build.py checks the built module."""
    if not sys.platform.startswith("linux"):
        return []
    # the compiler that links the extension: $CXX, else Python's configured C++ compiler
    cxx = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()
    try:
        path = subprocess.run(cxx + ["-print-file-name=libstdc++.so.6"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"setup.py: not linking libstdc++.so.6 by path ({' '.join(cxx)}: {e})", file=sys.stderr)
        return []
    if not (os.path.isabs(path) and os.path.exists(path)):  # the compiler prints the bare name back
        print(f"setup.py: {' '.join(cxx)} does not know libstdc++.so.6; not linking it by path", file=sys.stderr)
        return []
    return [os.path.realpath(path)]


def extensions():
    with_cuda = _want_cuda()
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # -fno-trapping-math: nothing here reads FP exception flags, and it lets GCC turn float
    # selects (clamps, masks) into vector blends. The C++ standard is BuildExtension's choice.
    cxx = ["-O3", "-fno-trapping-math", "-fopenmp"] + _cpu_arch_flags()
    link = ["-fopenmp"] + _shared_libstdcxx()
    define_macros = []
    if not with_cuda:
        return [CppExtension("torch_gradops._C", sources, include_dirs=[os.path.join(ROOT, "csrc")],
                             extra_compile_args={"cxx": cxx}, extra_link_args=link,
                             define_macros=define_macros)]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # Without a visible GPU torch would target every arch it knows; Ampere and Hopper
        # (+PTX for newer chips) is what we support and test.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    return [CUDAExtension("torch_gradops._C", sources,
                          include_dirs=[os.path.join(ROOT, "csrc")] + _cuda_library_includes(),
                          define_macros=define_macros + [("WITH_CUDA", None)],
                          extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link)]


setup(
    # namespace discovery: torch_gradops/data/planetoid (Cora, no __init__.py) is a package whose
    # files are package data; find_packages skipped it and setuptools warns it "would be ignored"
    packages=find_namespace_packages(include=["torch_gradops", "torch_gradops.*"], exclude=["*__pycache__*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    include_package_data=True,
)
