"""Run PyG's own layer tests against torch_gradops' drop-in layers.

    python scripts/pyg_conv_tests.py PYG_SOURCE [pytest options...]

``PYG_SOURCE``: a checkout of PyTorch Geometric's repository (its ``test/`` folder is in neither
the wheel nor the source distribution on PyPI, so the suite cannot fetch it; point this at a
clone of the tag matching the installed ``torch_geometric``). PyG's
``test/nn/conv/test_gat_conv.py`` and ``test_gatv2_conv.py`` are copied, unchanged, into a
temporary folder beside a ``conftest.py`` that puts :class:`torch_gradops.nn.GATConv` and
:class:`~torch_gradops.nn.GATv2Conv` in ``torch_geometric.nn``'s place before the test files import
them, then run with pytest. The run fails if no test built one of our layers (the substitution
did not take) or if any of PyG's tests fail. PyG's TorchScript parts run only under its
``FULL_TEST=1``, and fail there: ``torch.jit.script`` cannot compile an ``autograd.Function``.

Exit status: pytest's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

FILES = ("test_gat_conv.py", "test_gatv2_conv.py")

CONFTEST = '''\
"""Written by torch_gradops' scripts/pyg_conv_tests.py: PyG's layers replaced by ours."""
import torch_geometric.nn
import torch_geometric.nn.conv

import torch_gradops.nn as ours

BUILT = {"GATConv": 0, "GATv2Conv": 0}


def _counting(cls):
    class Counted(cls):
        def __init__(self, *args, **kwargs):
            BUILT[cls.__name__] += 1
            super().__init__(*args, **kwargs)
    Counted.__name__ = Counted.__qualname__ = cls.__name__  # PyG's tests check str(conv)
    return Counted


for _name in BUILT:
    _cls = _counting(getattr(ours, _name))
    setattr(torch_geometric.nn, _name, _cls)
    setattr(torch_geometric.nn.conv, _name, _cls)


def pytest_sessionfinish(session, exitstatus):
    print(f"\\ntorch_gradops layers built by PyG's tests: {BUILT}")
    if session.testscollected and not all(BUILT.values()):
        session.exitstatus = 3  # a test file ran on PyG's own layers: the substitution did not take
'''


def main(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    source, pytest_args = argv[0], argv[1:]
    conv_dir = os.path.join(source, "test", "nn", "conv")
    missing = [f for f in FILES if not os.path.isfile(os.path.join(conv_dir, f))]
    if missing:
        print(f"pyg_conv_tests: {conv_dir} lacks {', '.join(missing)}: PYG_SOURCE must be a PyTorch Geometric "
              "checkout", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pyg_conv_tests_") as tmp:
        for f in FILES:
            shutil.copy(os.path.join(conv_dir, f), tmp)
        with open(os.path.join(tmp, "conftest.py"), "w") as fh:
            fh.write(CONFTEST)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp, tmp, *pytest_args]
        return subprocess.call(cmd, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
