"""The examples run as documented, on small settings (examples/distributed_gat.py: test_distributed.py)."""
import os
import subprocess
import sys

import pytest

from torch_gradops.testing import circuit_amplitude_network

from examples_path import EXAMPLES, load_example


def test_sliced_circuit_training_learns_with_exact_gradients_and_bounded_memory():
    example = load_example("sliced_circuit_training")
    limit = 2048
    r = example.main(["--rows", "3", "--cols", "4", "--depth", "8", "--steps", "30", "--memory-limit", str(limit)])
    assert r["slices"] > 1 and r["largest_intermediate_bytes"] <= limit
    assert r["grad_rel_err"] < 1e-5  # sliced gradients = the unsliced contraction's
    assert r["last_loss"] < 0.1 * r["first_loss"]  # -log p(b): from about 8.3 to about 0.15
    _, _, arrays = circuit_amplitude_network(3, 4, 8, seed=0)
    operand_bytes = sum(a.numel() * a.element_size() for a in arrays)
    assert r["contraction_peak_bytes"] <= 4 * limit + 2 * operand_bytes  # the memory contract


@pytest.mark.cuda
def test_sliced_circuit_training_on_cuda():
    example = load_example("sliced_circuit_training")
    r = example.main(["--rows", "3", "--cols", "3", "--depth", "6", "--steps", "10", "--memory-limit", "1KiB",
                      "--device", "cuda"])
    assert r["grad_rel_err"] < 1e-5 and r["last_loss"] < r["first_loss"]


def test_sliced_circuit_training_runs_as_a_script():
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "sliced_circuit_training.py"), "--rows", "2",
                          "--cols", "3", "--depth", "4", "--steps", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ContractionPlan(" in out.stdout and '"slices"' in out.stdout.splitlines()[-1]
