"""Run PyG's own layer tests against torch_gradops' drop-in layers.

    python scripts/pyg_conv_tests.py PYG_SOURCE [pytest options...]

``PYG_SOURCE``: a checkout of PyTorch Geometric's repository (its ``test/`` folder is in neither
the wheel nor the source distribution on PyPI, so the suite cannot fetch it; point this at a
clone of the tag matching the installed ``torch_geometric``). PyG's
``test/nn/conv/test_gat_conv.py`` and ``test_gatv2_conv.py`` are copied, unchanged, into a
temporary folder beside a ``conftest.py`` that puts :class:`torch_gradops.nn.GATConv` and
:class:`~torch_gradops.nn.GATv2Conv` in ``torch_geometric.nn``'s place before the test files import
them, then run with pytest on this checkout's ``torch_gradops``. The run fails if any of PyG's
tests fail, if a test built PyG's own ``GATConv`` / ``GATv2Conv`` (one that reached PyG's class
another way than through ``torch_geometric.nn``), or if none built ours. PyG's TorchScript parts
run only under its ``FULL_TEST=1``, and fail there: ``torch.jit.script`` cannot compile an
``autograd.Function`` (with torch 2.14.1 and PyG 2.8.1 PyG's own layers fail them too). The tests build a counting subclass of each of our layers (named as
ours), defined in the ``conftest.py``.

Exit status: pytest's; 3 when a test built PyG's own layer or none built ours.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

FILES = ("test_gat_conv.py", "test_gatv2_conv.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFTEST = '''\
"""Written by torch_gradops' scripts/pyg_conv_tests.py: PyG's layers replaced by ours (a
counting subclass of each, named as ours, so that the run can tell which layers the tests built)."""
import torch_geometric.nn
import torch_geometric.nn.conv

import torch_gradops.nn as ours

OURS = {"GATConv": 0, "GATv2Conv": 0}  # ours built by the tests
PYGS = {"GATConv": 0, "GATv2Conv": 0}  # PyG's own built (a test that reached PyG's class another way)


def _counting(cls):
    class Counted(cls):
        def __init__(self, *args, **kwargs):
            OURS[cls.__name__] += 1
            super().__init__(*args, **kwargs)
    Counted.__name__ = Counted.__qualname__ = cls.__name__  # PyG's tests check str(conv)
    return Counted


def _watching(pyg_cls, our_cls):
    init = pyg_cls.__init__

    def __init__(self, *args, **kwargs):  # ours subclass PyG's: their construction passes here too
        if not isinstance(self, our_cls):
            PYGS[pyg_cls.__name__] += 1
        init(self, *args, **kwargs)
    pyg_cls.__init__ = __init__


for _name in OURS:
    _ours = getattr(ours, _name)
    _watching(getattr(torch_geometric.nn.conv, _name), _ours)
    _cls = _counting(_ours)
    setattr(torch_geometric.nn, _name, _cls)
    setattr(torch_geometric.nn.conv, _name, _cls)


def pytest_sessionfinish(session, exitstatus):
    print(f"\\ntorch_gradops layers built by PyG's tests: {OURS}; PyG's own: {PYGS}")
    if session.testscollected and (any(PYGS.values()) or not any(OURS.values())):
        session.exitstatus = 3  # a test ran on PyG's own layers: the substitution did not take
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
        # the torch_gradops of this checkout, not whichever an environment's path finds first
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        return subprocess.call(cmd, cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
