"""The contraction program: the flat list of ints that the C++ executor runs.

The planner compiles a plan into a :class:`Program` (instructions below) and :func:`encode`\\ s it
once; ``torch.ops.torch_gradops.contract_program*`` decode and run it. The C++ twin of this
module is ``csrc/contract_program.h`` (same version, opcodes and layout); a round-trip test keeps
the two in step (``tests/test_tensornet_program.py``). Format::

    header    : VERSION, n_operands, n_sliced, out_ndim, out_shape[out_ndim], n_instr
    SELECT    : 1, slot, dim, k                  slot = slot.select(dim, index of sliced mode k)
    SUM       : 2, slot, n, dims[n]              slot = slot.sum(dims)
    CONTRACT  : 3, a, b, c, ra, perm_a[ra], rb, perm_b[rb], ta, tb, Bt, M, K, N, rc, shape_c[rc]
                slot c = bmm(A, B).view(shape_c), A = a.permute(perm_a).reshape(Bt, M, K) or, if
                ta, .reshape(Bt, K, M).transpose(1, 2); B likewise ([Bt, K, N] or, if tb,
                [Bt, N, K] transposed). Slots a and b are released.
    FINAL     : 4, slot, rf, perm[rf], n_blk, (pos, k)[n_blk]
                out.select(pos, index of sliced mode k)... += slot.permute(perm)
    CHECKPOINT: 5                                the backward keeps the live slots here and
                                                 recomputes one segment at a time

Slots ``0 .. n_operands-1`` hold the operands; every CONTRACT creates the next slot. This module
also registers the ops' fake kernels, which read output shapes from the program.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple, Union

import torch

from .. import library  # loads the ops, which must be registered before their fake kernels

__all__ = ["VERSION", "SELECT", "SUM", "CONTRACT", "FINAL", "CHECKPOINT", "Select", "Sum", "Contract",
           "Final", "Checkpoint", "Program", "encode", "decode", "cached_shapes", "executor_format",
           "executor_reencode", "accumulate_dtype"]

VERSION = 1
SELECT, SUM, CONTRACT, FINAL, CHECKPOINT = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Select:
    slot: int
    dim: int
    k: int


@dataclass(frozen=True)
class Sum:
    slot: int
    dims: Tuple[int, ...]


@dataclass(frozen=True)
class Contract:
    a: int
    b: int
    c: int
    perm_a: Tuple[int, ...]
    perm_b: Tuple[int, ...]
    ta: bool
    tb: bool
    bt: int
    m: int
    k: int
    n: int
    shape_c: Tuple[int, ...]


@dataclass(frozen=True)
class Final:
    slot: int
    perm: Tuple[int, ...]
    blocks: Tuple[Tuple[int, int], ...]  # (output dim, sliced-mode index), dims descending


@dataclass(frozen=True)
class Checkpoint:
    pass


Instruction = Union[Select, Sum, Contract, Final, Checkpoint]


@dataclass(frozen=True)
class Program:
    n_operands: int
    n_sliced: int
    out_shape: Tuple[int, ...]
    instructions: Tuple[Instruction, ...] = field(default_factory=tuple)


def encode(program: Program) -> Tuple[int, ...]:
    """The flat int list of ``program``."""
    body: List[int] = []
    for ins in program.instructions:
        if isinstance(ins, Select):
            body += [SELECT, ins.slot, ins.dim, ins.k]
        elif isinstance(ins, Sum):
            body += [SUM, ins.slot, len(ins.dims), *ins.dims]
        elif isinstance(ins, Contract):
            body += [CONTRACT, ins.a, ins.b, ins.c, len(ins.perm_a), *ins.perm_a, len(ins.perm_b), *ins.perm_b,
                     int(ins.ta), int(ins.tb), ins.bt, ins.m, ins.k, ins.n, len(ins.shape_c), *ins.shape_c]
        elif isinstance(ins, Final):
            body += [FINAL, ins.slot, len(ins.perm), *ins.perm, len(ins.blocks)]
            for pos, k in ins.blocks:
                body += [pos, k]
        elif isinstance(ins, Checkpoint):
            body.append(CHECKPOINT)
        else:
            raise TypeError(f"not a program instruction: {ins!r}")
    header = [VERSION, program.n_operands, program.n_sliced, len(program.out_shape), *program.out_shape,
              len(program.instructions)]
    return tuple(int(x) for x in header + body)


def decode(ints: Sequence[int]) -> Program:
    """The :class:`Program` of a flat int list (the inverse of :func:`encode`)."""
    p = [int(x) for x in ints]
    i = 0

    def take(n=1):
        nonlocal i
        if n < 0 or i + n > len(p):
            raise ValueError("contract program: truncated")
        out = p[i:i + n]
        i += n
        return out

    version, n_operands, n_sliced, ndim = take(4)
    if version != VERSION:
        raise ValueError(f"contract program: version {version}, expected {VERSION}")
    out_shape = tuple(take(ndim))
    n_instr, = take()
    instrs: List[Instruction] = []
    for _ in range(n_instr):
        op, = take()
        if op == SELECT:
            instrs.append(Select(*take(3)))
        elif op == SUM:
            slot, n = take(2)
            instrs.append(Sum(slot, tuple(take(n))))
        elif op == CONTRACT:
            a, b, c, ra = take(4)
            perm_a = tuple(take(ra))
            rb, = take()
            perm_b = tuple(take(rb))
            ta, tb, bt, m, k, n, rc = take(7)
            instrs.append(Contract(a, b, c, perm_a, perm_b, bool(ta), bool(tb), bt, m, k, n, tuple(take(rc))))
        elif op == FINAL:
            slot, rf = take(2)
            perm = tuple(take(rf))
            nb, = take()
            flat = take(2 * nb)
            instrs.append(Final(slot, perm, tuple(zip(flat[0::2], flat[1::2]))))
        elif op == CHECKPOINT:
            instrs.append(Checkpoint())
        else:
            raise ValueError(f"contract program: unknown opcode {op}")
    if i != len(p):
        raise ValueError("contract program: trailing ints")
    return Program(n_operands, n_sliced, out_shape, tuple(instrs))


def cached_shapes(program: Program, needs_grad: Sequence[int]) -> List[Tuple[int, ...]]:
    """Shapes of the GEMM operands ``contract_program_cached`` keeps: per CONTRACT its A and B in
    their stored layout ([Bt,M,K] or [Bt,K,M]; [Bt,K,N] or [Bt,N,K]), or ``(0,)`` where no
    gradient in ``needs_grad`` uses it (dA needs B, dB needs A)."""
    needs = {i: bool(needs_grad[i]) for i in range(program.n_operands)}
    shapes = []
    for ins in program.instructions:
        if isinstance(ins, Contract):
            shapes.append(((ins.bt, ins.k, ins.m) if ins.ta else (ins.bt, ins.m, ins.k)) if needs[ins.b] else (0,))
            shapes.append(((ins.bt, ins.n, ins.k) if ins.tb else (ins.bt, ins.k, ins.n)) if needs[ins.a] else (0,))
            needs[ins.c] = needs[ins.a] or needs[ins.b]
    return shapes


# ---------------------------------------------------------------------------- the C++ twin
def executor_format() -> dict:
    """The C++ executor's format version and opcodes (``{"VERSION": ..., "SELECT": ...}``)."""
    return dict(library._C.contract_program_format())


def executor_reencode(ints: Sequence[int], n_operands: int) -> Tuple[int, ...]:
    """Decode ``ints`` with the C++ executor's decoder and encode the result again: equal to
    ``ints`` when both sides agree on the format (raises the executor's error otherwise)."""
    return tuple(library._C.reencode_contract_program([int(x) for x in ints], int(n_operands)))


# ---------------------------------------------------------------------------- fake kernels
def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the executor sums slices in: float32 for float16/bfloat16 (complex64 for
    complex32), else the operands' own (``accumulate_type`` in csrc/contract.cpp)."""
    return {torch.float16: torch.float32, torch.bfloat16: torch.float32,
            torch.complex32: torch.complex64}.get(dtype, dtype)


@torch.library.register_fake("torch_gradops::contract_program")
def _contract_program_fake(operands, program, slice_table, dtype=None):
    own = operands[0].dtype
    if dtype is not None and dtype not in (own, accumulate_dtype(own)):  # as the executor checks
        raise RuntimeError(f"contract_program: dtype must be the operands' ({own}) or their accumulate type, "
                           f"got {dtype}")
    return operands[0].new_empty(decode(program).out_shape, dtype=dtype)


@torch.library.register_fake("torch_gradops::contract_program_cached")
def _contract_program_cached_fake(operands, program, slice_table, needs_grad):
    prog = decode(program)
    out = operands[0].new_empty(prog.out_shape)
    return out, [operands[0].new_empty(s) for s in cached_shapes(prog, needs_grad)]


@torch.library.register_fake("torch_gradops::contract_program_backward")
def _contract_program_backward_fake(operands, program, slice_table, grad_out, needs_grad, cached):
    return [torch.empty_like(op, memory_format=torch.contiguous_format) if n else op.new_empty((0,))
            for op, n in zip(operands, needs_grad)]


@torch.library.register_fake("torch_gradops::contract_program_accumulate")
def _contract_program_accumulate_fake(operands, program, slice_table, grad_out, grads):
    if grad_out is not None:
        return operands[0].new_empty((0,))
    # the value in the accumulate type (float32 for float16/bfloat16), as the executor returns it
    return operands[0].new_empty(decode(program).out_shape, dtype=accumulate_dtype(operands[0].dtype))
