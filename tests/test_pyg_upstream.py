"""PyG's own layer tests against ours (scripts/pyg_conv_tests.py).

PyG's test files are in neither its wheel nor its source distribution, so CI cannot run them:
``TORCH_GRADOPS_PYG_SOURCE=/path/to/pytorch_geometric pytest tests/test_pyg_upstream.py`` does,
on a clone of the tag matching the installed torch_geometric. In CI the harness itself is
checked on stand-in test files: that it puts our layers in torch_geometric.nn's place, and that
it fails when a test file builds PyG's own layers instead."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_geometric")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pyg_conv_tests.py")


def _run(source, *args):
    return subprocess.run([sys.executable, SCRIPT, str(source), *args], capture_output=True, text=True, timeout=600)


def _stand_in(tmp_path, gat_import, ours=lambda cls: True):
    """Stand-ins for PyG's two test files, each importing its layer with ``gat_import(cls)``
    and checking that the layer it built is ours (or, where ``ours(cls)`` is false, PyG's)."""
    conv = tmp_path / "test" / "nn" / "conv"
    conv.mkdir(parents=True)
    for name, cls in (("test_gat_conv.py", "GATConv"), ("test_gatv2_conv.py", "GATv2Conv")):
        (conv / name).write_text(
            f"import torch\n{gat_import(cls)}\n\n"
            f"def test_{cls.lower()}():\n"
            f"    conv = {cls}(8, 4, heads=2)\n"
            f"    assert str(conv) == '{cls}(8, 4, heads=2)'\n"
            f"    out = conv(torch.randn(5, 8), torch.tensor([[0, 1, 2], [1, 2, 3]]))\n"
            f"    assert out.shape == (5, 8)\n"
            f"    assert {'' if ours(cls) else 'not '}any(c.__module__.startswith('torch_gradops') for c in type(conv).__mro__)\n")
    return tmp_path


def test_harness_puts_our_layers_in_pygs_place(tmp_path):
    r = _run(_stand_in(tmp_path, lambda cls: f"from torch_geometric.nn import {cls}"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout and "{'GATConv': 1, 'GATv2Conv': 1}" in r.stdout


def test_harness_fails_when_pygs_own_layers_ran(tmp_path):
    # importing from the defining module bypasses the substitution: PyG's GATv2Conv runs there,
    # and the harness must not report that as our layers passing (while GATConv's file is ours)
    modules = {"GATConv": "torch_geometric.nn", "GATv2Conv": "torch_geometric.nn.conv.gatv2_conv"}
    src = _stand_in(tmp_path, lambda cls: f"from {modules[cls]} import {cls}",
                    ours=lambda cls: cls == "GATConv")
    r = _run(src)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "2 passed" in r.stdout and "PyG's own: {'GATConv': 0, 'GATv2Conv': 1}" in r.stdout


def test_harness_passes_options_to_pytest(tmp_path):
    r = _run(_stand_in(tmp_path, lambda cls: f"from torch_geometric.nn import {cls}"), "-k", "gatv2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "{'GATConv': 0, 'GATv2Conv': 1}" in r.stdout


def test_harness_refuses_a_folder_without_pygs_tests(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 2 and "PyTorch Geometric checkout" in r.stderr


@pytest.mark.skipif(not os.environ.get("TORCH_GRADOPS_PYG_SOURCE"),
                    reason="set TORCH_GRADOPS_PYG_SOURCE to a PyTorch Geometric checkout (PyG's tests are not on PyPI)")
def test_pygs_own_gat_and_gatv2_tests_pass_against_ours():
    r = _run(os.environ["TORCH_GRADOPS_PYG_SOURCE"], "-W", "ignore")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
