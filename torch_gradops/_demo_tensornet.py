"""Demo piece for ``python -m torch_gradops.demo``: a sliced contraction of a random
quantum-circuit amplitude network with gradients, checked against torch.einsum.

Also holds the network generators that ``benchmarks/tensornet.py`` uses (random circuit
amplitude, PEPS norm, MPS) and a pairwise torch.einsum reference evaluator (torch.einsum
itself accepts at most 52 mode letters, far fewer than these networks have).
"""
from __future__ import annotations

import time
from typing import List, Sequence, Tuple

import torch

from . import tensornet

Network = Tuple[List[List[int]], List[int], List[torch.Tensor]]  # (inputs, output, arrays)


def _random_unitary(n: int, gen: torch.Generator, dtype) -> torch.Tensor:
    z = torch.complex(torch.randn(n, n, generator=gen, dtype=torch.float64),
                      torch.randn(n, n, generator=gen, dtype=torch.float64))
    q, r = torch.linalg.qr(z)
    d = torch.diagonal(r)
    return (q * (d / d.abs())).to(dtype)  # Haar-random


def circuit_amplitude_network(rows: int, cols: int, depth: int, seed: int = 0,
                              dtype=torch.complex64) -> Network:
    """<bits| C |0...0> for a random circuit on a rows x cols grid: ``depth`` layers of Haar-random
    two-qubit gates on the grid's edges in the cycling patterns (horizontal even/odd, vertical
    even/odd), as in random-circuit-sampling experiments (single-qubit gates fused in).

    Returns (inputs, output, arrays): per tensor its int mode labels; output ``[]`` (a scalar);
    tensors: |0> vectors [2], gates [2, 2, 2, 2] (out_a, out_b, in_a, in_b), <bit| vectors [2].
    """
    gen = torch.Generator().manual_seed(seed)
    nq = rows * cols
    counter = iter(range(1 << 30))
    cur = []
    inputs, arrays = [], []
    for _ in range(nq):
        m = next(counter)
        cur.append(m)
        inputs.append([m])
        arrays.append(torch.tensor([1.0, 0.0], dtype=dtype))
    q = lambda r, c: r * cols + c  # noqa: E731
    patterns = [
        [(q(r, c), q(r, c + 1)) for r in range(rows) for c in range(0, cols - 1, 2)],
        [(q(r, c), q(r + 1, c)) for r in range(0, rows - 1, 2) for c in range(cols)],
        [(q(r, c), q(r, c + 1)) for r in range(rows) for c in range(1, cols - 1, 2)],
        [(q(r, c), q(r + 1, c)) for r in range(1, rows - 1, 2) for c in range(cols)],
    ]
    for layer in range(depth):
        for a, b in patterns[layer % 4]:
            oa, ob = next(counter), next(counter)
            inputs.append([oa, ob, cur[a], cur[b]])
            arrays.append(_random_unitary(4, gen, dtype).reshape(2, 2, 2, 2))
            cur[a], cur[b] = oa, ob
    bits = torch.randint(0, 2, (nq,), generator=gen)
    for i in range(nq):
        inputs.append([cur[i]])
        v = torch.zeros(2, dtype=dtype)
        v[int(bits[i])] = 1
        arrays.append(v)
    return inputs, [], arrays


def peps_norm_network(rows: int, cols: int, bond: int, phys: int = 2, seed: int = 0,
                      dtype=torch.float32) -> Network:
    """<psi|psi> of a random rows x cols PEPS: ket tensors [phys, bonds...] and their bras
    (conjugates) sharing the physical mode. Output ``[]``."""
    gen = torch.Generator().manual_seed(seed)
    counter = iter(range(1 << 30))
    h = {(r, c): next(counter) for r in range(rows) for c in range(cols - 1)}  # ket bonds
    v = {(r, c): next(counter) for r in range(rows - 1) for c in range(cols)}
    h2 = {k: next(counter) for k in h}  # bra bonds
    v2 = {k: next(counter) for k in v}
    inputs, arrays = [], []
    for r in range(rows):
        for c in range(cols):
            p = next(counter)
            def bonds(hh, vv):
                out = []
                if c > 0:
                    out.append(hh[(r, c - 1)])
                if c < cols - 1:
                    out.append(hh[(r, c)])
                if r > 0:
                    out.append(vv[(r - 1, c)])
                if r < rows - 1:
                    out.append(vv[(r, c)])
                return out
            kb = bonds(h, v)
            t = torch.randn((phys,) + (bond,) * len(kb), generator=gen, dtype=torch.float64) / bond ** 0.5
            inputs.append([p] + kb)
            arrays.append(t.to(dtype))
            inputs.append([p] + bonds(h2, v2))
            arrays.append(t.conj().to(dtype))
    return inputs, [], arrays


def mps_network(n: int, bond: int = 4, phys: int = 2, seed: int = 0, dtype=torch.float32) -> Network:
    """An open MPS of ``n`` tensors [bond, phys, bond] (ends [phys, bond] / [bond, phys])
    contracted with itself over the physical modes (a norm). Output ``[]``."""
    gen = torch.Generator().manual_seed(seed)
    counter = iter(range(1 << 30))
    k = [next(counter) for _ in range(n - 1)]
    b = [next(counter) for _ in range(n - 1)]
    inputs, arrays = [], []
    for i in range(n):
        p = next(counter)
        lk = ([k[i - 1]] if i > 0 else []) + [p] + ([k[i]] if i < n - 1 else [])
        lb = ([b[i - 1]] if i > 0 else []) + [p] + ([b[i]] if i < n - 1 else [])
        shape = tuple(bond if j != (1 if i > 0 else 0) else phys for j in range(len(lk)))
        t = torch.randn(shape, generator=gen, dtype=torch.float64) / (bond * phys) ** 0.5
        inputs += [lk, lb]
        arrays += [t.to(dtype), t.to(dtype)]
    return inputs, [], arrays


def einsum_pairwise(inputs: Sequence[Sequence[int]], output: Sequence[int], arrays: Sequence[torch.Tensor],
                    path: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """Evaluate the network with one torch.einsum call per pairwise step of ``path`` (letters
    assigned per step), differentiable through torch's autograd."""
    items = [(list(t), a) for t, a in zip(inputs, arrays)]
    out_set = set(output)
    for step in path:
        i, j = sorted(step)
        (mj, b), (mi, a) = items.pop(j), items.pop(i)
        rest = set(out_set)
        for t, _ in items:
            rest.update(t)
        keep = [m for m in dict.fromkeys(mi + mj) if m in rest]
        letters = {m: chr(97 + n) if n < 26 else chr(65 + n - 26) for n, m in enumerate(dict.fromkeys(mi + mj))}
        eq = "".join(letters[m] for m in mi) + "," + "".join(letters[m] for m in mj) + "->" + \
            "".join(letters[m] for m in keep)
        items.append((keep, torch.einsum(eq, a, b)))
    (modes, res), = items
    letters = {m: chr(97 + n) for n, m in enumerate(modes)}
    return torch.einsum("".join(letters[m] for m in modes) + "->" + "".join(letters[m] for m in output), res)


def run(device: str, progress: bool = True) -> bool:
    """Sliced contraction of a 3x4, depth-12 random-circuit amplitude (complex128) with
    gradients w.r.t. every gate, memory-limited to force >= 16 slices, checked against a
    pairwise torch.einsum evaluation of the same network with autograd. Returns True on success."""
    dev = torch.device(device)
    inputs, output, arrays = circuit_amplitude_network(3, 4, 12, seed=1, dtype=torch.complex128)
    arrays = [a.to(dev) for a in arrays]
    args = []
    for t, a in zip(inputs, arrays):
        args += [a, t]
    args.append(output)
    base = tensornet.plan(*args)
    # the budget that 16 slices need: memory_limit bounds one slice's forward + backward working set
    limit = tensornet.plan(*args, slicing={"min_slices": 16}).slice_working_set
    p = tensornet.plan(*args, memory_limit=limit, slicing={"min_slices": 16})
    print(f"== sliced tensor-network contraction with gradients: random circuit amplitude, 3x4 qubits, "
          f"depth 12, {len(arrays)} tensors, complex128, device={dev}")
    print(f"   unsliced: largest intermediate {base.largest_intermediate[0]} elements, {base.flops:.3g} FLOPs")
    print(f"   sliced:   {len(p.sliced_modes)} modes sliced -> {p.num_slices} slices, largest intermediate "
          f"{p.largest_intermediate[0]} elements, working set {p.slice_working_set} B <= limit {limit} B, "
          f"{p.flops:.3g} FLOPs")
    gates = [a.clone().requires_grad_(a.dim() == 4) for a in arrays]
    t0 = time.perf_counter()
    amp = p.contract(*gates, progress=progress)
    loss = amp.abs() ** 2
    grads = torch.autograd.grad(loss, [g for g in gates if g.requires_grad])
    t_ours = time.perf_counter() - t0
    ref_gates = [a.clone().requires_grad_(a.dim() == 4) for a in arrays]
    t0 = time.perf_counter()
    ref = einsum_pairwise(inputs, output, ref_gates, base.path)
    ref_grads = torch.autograd.grad(ref.abs() ** 2, [g for g in ref_gates if g.requires_grad])
    t_ref = time.perf_counter() - t0
    err_amp = (amp - ref).abs().item() / max(ref.abs().item(), 1e-300)
    scale = max(g.abs().max().item() for g in ref_grads)
    err_grad = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)) / scale
    ok = err_amp < 1e-9 and err_grad < 1e-9 and p.num_slices >= 16
    print(f"   amplitude {complex(amp.item()):.6e}  (torch.einsum: {complex(ref.item()):.6e}), rel. error {err_amp:.1e}")
    print(f"   d|amp|^2/d(gate) for {len(grads)} gates: max rel. error {err_grad:.1e} vs torch.einsum autograd")
    print(f"   time: sliced contract+grad {t_ours * 1e3:.1f} ms, pairwise torch.einsum+autograd {t_ref * 1e3:.1f} ms")
    print("   OK" if ok else "   FAILED")
    return ok


if __name__ == "__main__":  # pragma: no cover
    import sys
    sys.exit(0 if run("cpu") else 1)
