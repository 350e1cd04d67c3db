"""Train a quantum circuit through a sliced tensor-network contraction.

    python examples/sliced_circuit_training.py                          # 4x4 qubits, depth 10, 128 KiB
    python examples/sliced_circuit_training.py --memory-limit 16KiB --steps 200
    python examples/sliced_circuit_training.py --device cuda

The amplitude <b|C|0...0> of a circuit on a grid of qubits is a tensor network: one [2] vector
per qubit's |0>, one [2, 2, 2, 2] tensor per two-qubit gate, one [2] projector per bit of b
(``torch_gradops.testing.circuit_amplitude_network``: the gate pattern of random-circuit-sampling
experiments). Here every gate is ``G_k = U_k exp(A_k - A_k^H)``, with ``U_k`` the random gate and
``A_k`` a trainable complex 4 x 4 matrix (zero at the start, so training starts from the random
circuit and every step is a unitary circuit), and the loss ``-log |<b|C|0>|^2`` drives the
circuit towards the bitstring ``b``.

The network is planned once, with ``memory_limit`` bounding the largest intermediate of one
slice; every step then contracts it slice by slice and backpropagates through the slices into
the gate tensors (and on through ``torch.linalg.matrix_exp`` into ``A``) with the peak extra
memory of forward + backward within 4 x ``memory_limit`` + the operands and their gradients.
The first step checks the gradients against the same network contracted without slicing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from torch_gradops import tensornet as tn
from torch_gradops.testing import (PeakMemory, circuit_amplitude_network, format_bytes, interleave,
                                  peak_allocated_bytes)


class CircuitAmplitude(torch.nn.Module):
    """``<b|C|0...0>`` of a trainable circuit: a 0-dim complex tensor.

    ``inputs``/``arrays``: the amplitude network of :func:`circuit_amplitude_network`; its
    [2, 2, 2, 2] tensors are the gates (out_a, out_b, in_a, in_b), the [2] vectors the states
    and projectors. ``plan``: the contraction plan of that network (one per shape, dtype and
    ``memory_limit``; :func:`torch_gradops.tensornet.plan` caches it)."""

    def __init__(self, inputs, arrays, memory_limit=None):
        super().__init__()
        self.inputs = [list(t) for t in inputs]
        self.gate_of = [k for k, a in enumerate(arrays) if a.dim() == 4]
        self.register_buffer("fixed", torch.stack([a.reshape(4, 4) for a in arrays if a.dim() == 4]))
        self.others = [a for a in arrays if a.dim() != 4]
        self.generators = torch.nn.Parameter(torch.zeros_like(self.fixed))  # A_k, [gates, 4, 4]
        self.plan = tn.plan(*interleave(self.inputs, arrays, []), memory_limit=memory_limit)

    def gates(self) -> torch.Tensor:
        """``U_k exp(A_k - A_k^H)`` for every gate: [gates, 2, 2, 2, 2]."""
        skew = self.generators - self.generators.mH
        return (self.fixed @ torch.linalg.matrix_exp(skew)).reshape(-1, 2, 2, 2, 2)

    def operands(self, gates: torch.Tensor):
        ops, g, o = [], iter(gates.unbind(0)), iter(self.others)
        gate_set = set(self.gate_of)
        for k in range(len(self.inputs)):
            ops.append(next(g) if k in gate_set else next(o).to(gates.device))
        return ops

    def forward(self) -> torch.Tensor:
        return self.plan.contract(*self.operands(self.gates()))


def gradient_check(model: CircuitAmplitude) -> float:
    """The largest difference between the sliced plan's gradient of ``|amp|^2`` with respect to
    the gates and the unsliced contraction's, relative to the largest gradient entry."""
    gates = model.gates().detach().requires_grad_(True)
    prob = model.plan.contract(*model.operands(gates)).abs().square()
    (sliced,) = torch.autograd.grad(prob, gates)
    gates2 = gates.detach().requires_grad_(True)
    ops = model.operands(gates2)
    prob2 = tn.contract(*interleave(model.inputs, ops, []), memory_limit=None).abs().square()
    (whole,) = torch.autograd.grad(prob2, gates2)
    return float((sliced - whole).abs().max() / whole.abs().max())


def contraction_peak(model: CircuitAmplitude, device: torch.device) -> int:
    """Peak extra tensor memory of the sliced contraction's forward + backward (warm: the plan's
    first call is made before): exact tensor bytes, from the CUDA allocator or, on CPU, the torch
    profiler's memory events (the resident set of so small a network is mostly Python objects)."""
    gates = model.gates().detach().requires_grad_(True)

    def forward_backward():
        model.plan.contract(*model.operands(gates)).abs().square().backward()

    forward_backward()
    if device.type == "cuda":
        with PeakMemory(device) as pm:
            forward_backward()
        return pm.peak_bytes
    return peak_allocated_bytes(forward_backward)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--cols", type=int, default=4)
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--memory-limit", default="128KiB", help="bytes, '128KiB', ... (the largest intermediate of a slice)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if args.rows < 1 or args.cols < 2 or args.depth < 1 or args.steps < 1:
        p.error("--rows and --depth must be >= 1, --cols >= 2 (the circuit needs two-qubit gates) and --steps >= 1")

    device = torch.device(args.device)
    inputs, _, arrays = circuit_amplitude_network(args.rows, args.cols, args.depth, seed=args.seed)
    model = CircuitAmplitude(inputs, [a.to(device) for a in arrays], memory_limit=args.memory_limit).to(device)
    plan = model.plan
    print(f"{args.rows}x{args.cols} qubits, depth {args.depth}: {len(inputs)} tensors, "
          f"{len(model.gate_of)} trainable gates")
    print(plan)
    grad_err = gradient_check(model)
    print(f"gradient check against the unsliced contraction: max relative difference {grad_err:.1e}")

    peak = contraction_peak(model, device)

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = -torch.log(model().abs().square())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  -log p(b) {losses[-1]:8.4f}  p(b) {torch.exp(-loss).item():.3e}")
    seconds = (time.perf_counter() - t0) / max(1, args.steps)
    summary = dict(qubits=args.rows * args.cols, depth=args.depth, tensors=len(inputs),
                   memory_limit_bytes=tn.parse_memory_limit(args.memory_limit, device),
                   slices=plan.num_slices, flops=plan.flops, largest_intermediate_bytes=plan.largest_intermediate[1],
                   modelled_peak_bytes=plan.modelled_peak, contraction_peak_bytes=peak, grad_rel_err=grad_err,
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   seconds_per_step=seconds)
    print(f"{plan.num_slices} slices, {seconds * 1e3:.1f} ms per step; the contraction's forward + backward peaks "
          f"at {format_bytes(peak)} of tensors (modelled {format_bytes(plan.modelled_peak)}; at most 4 x "
          f"memory_limit + the operands and their gradients)")
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
