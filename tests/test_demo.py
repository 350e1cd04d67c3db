"""The first Quickstart command runs ``python -m torch_gradops.demo``: it must pass its own checks
(GAT op vs reference, Cora training accuracy, sliced contraction with gradients)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_passes_its_checks():
    proc = subprocess.run([sys.executable, "-m", "torch_gradops.demo", "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout
