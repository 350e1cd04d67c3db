"""The compiled module links libstdc++ the way torch does: the shared libstdc++.so.6, no copy of
its own. A static copy mixed with the shared one crashed the process (SIGSEGV) on the first error
message that formats a number (the GPU machine, 2026-11-27; setup.py's _shared_libstdcxx). The
check is scripts/libstdcxx_link_check.py's, whose test (tests/test_gpu_scripts.py) shows that it
tells a -static-libstdc++ module apart."""
import importlib.util
import os
import shutil
import sys

import pytest

import torch_gradops  # noqa: F401  (loads the compiled module, as users do)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = importlib.util.find_spec("torch_gradops._C").origin  # the compiled module's file


def test_extension_uses_the_shared_libstdcxx_and_no_copy():
    if shutil.which("nm") is None or shutil.which("readelf") is None:
        pytest.skip("binutils (nm, readelf) are not installed")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from libstdcxx_link_check import inspect
    finally:
        sys.path.pop(0)
    needs, copies = inspect(MODULE)
    assert needs, f"{MODULE} does not need libstdc++.so.6"
    assert copies == 0, f"{MODULE} defines {copies} of libstdc++'s own symbols"
