"""Autograd for contractions: :class:`ContractFunction` over the C++ executor, and the
derivative networks behind double backward and forward-mode AD.

First-order backward runs ``contract_program_backward``, which recomputes one slice at a time
(segment by segment between checkpoints) and accumulates each operand's gradient across slices;
an unsliced plan reuses the GEMM operands its forward kept. Under ``create_graph=True`` each
operand's gradient is itself a contraction (the network with that operand removed and the
output gradient added, :meth:`~.plan.ContractionPlan.derivative_plan`), computed with this same
Function, so it is differentiable again; forward-mode AD sums the network with each operand
replaced by its tangent. This module does not plan: plans come in as arguments.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..library import ops
from .parser import apply_steps

__all__ = ["ContractFunction", "contract_prepared", "operand_gradients"]


def _needs_function(eff) -> bool:
    """Whether a contraction must go through the autograd Function (gradients, forward AD or a
    torch.func transform may need it) rather than the bare op."""
    if torch.compiler.is_compiling():
        # Dynamo traces the Function only for inputs that require grad. Inside torch.func
        # transforms it calls the op itself, whose Autograd kernel then raises instead of
        # dropping the gradient (csrc/contract.cpp): those are not compiled.
        return torch.is_grad_enabled() and any(t.requires_grad for t in eff)
    if torch.is_grad_enabled() and any(t.requires_grad for t in eff):
        return True
    if torch.autograd.forward_ad._current_level >= 0:
        return True
    return any(_is_transformed(t) for t in eff)


def _is_transformed(t) -> bool:
    """A torch.func wrapper (batched, gradient-tracking or dual); Dynamo cannot ask (and under
    torch.compile the transforms are not traced through our Functions)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(t)


def _engine_needs(ctx, needs):
    """needs_input_grad narrowed to the edges this backward will run: with
    ``torch.autograd.grad(inputs=subset)`` an operand whose branch is not needed costs nothing.
    (The engine cannot tell this for leaf operands under autograd.grad; those count as needed.)"""
    needs = list(needs)
    try:
        nexts = ctx.next_functions
    except AttributeError:
        return needs
    if len(nexts) != len(needs):
        return needs
    for i, (node, _) in enumerate(nexts):
        if needs[i] and node is not None:
            try:
                needs[i] = bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:
                pass
    return needs


class ContractFunction(torch.autograd.Function):
    """``ContractFunction.apply(plan, slice_table, keep, *operands) -> (out, *kept)``: the
    differentiable core of :func:`~.contract.contract` (operands already checked and
    preprocessed by ``plan.prepare``).

    With ``keep`` (single-slice plans only, so the memory bound of sliced plans holds) the
    forward also returns the GEMM operands its backward reuses instead of recomputing
    (non-differentiable outputs). backward: ``contract_program_backward`` or, under
    ``create_graph=True``, one differentiable contraction per operand. jvp: the sum over
    operands of the network with that operand replaced by its tangent.
    """

    @staticmethod
    def forward(plan, table, keep, *operands):
        if keep:
            out, kept = ops.contract_program_cached(list(operands), list(plan.program), list(table),
                                                    [int(t.requires_grad) for t in operands])
            return (out, *kept)
        return (ops.contract_program(list(operands), list(plan.program), list(table)),)

    @staticmethod
    def setup_context(ctx, inputs, output):
        plan, table, _, *operands = inputs
        kept = output[1:]
        ctx.mark_non_differentiable(*kept)
        ctx.plan, ctx.table, ctx.n_operands, ctx.n_kept = plan, table, len(operands), len(kept)
        ctx.save_for_backward(*operands, *kept)
        ctx.save_for_forward(*operands)

    @staticmethod
    def backward(ctx, grad_out, *_):
        saved = ctx.saved_tensors
        operands, kept = saved[:ctx.n_operands], saved[ctx.n_operands:]
        needs = _engine_needs(ctx, ctx.needs_input_grad[3:])
        if not any(needs):
            return (None, None, None) + (None,) * len(operands)
        if torch.is_grad_enabled() or _is_transformed(grad_out):
            # create_graph=True, or a batched/dual output gradient (torch.func, gradcheck's
            # batched checks): gradients as contractions through this Function, whose vmap and
            # jvp rules apply; the fused backward op has no batching rule
            grads = _derivative_gradients(ctx.plan, list(operands), grad_out, ctx.table, needs)
        else:
            raw = ops.contract_program_backward(list(operands), list(ctx.plan.program), list(ctx.table),
                                                grad_out.to(operands[0].dtype), [int(n) for n in needs],
                                                list(kept))
            grads = [g if n else None for g, n in zip(raw, needs)]
        return (None, None, None) + tuple(grads)

    @staticmethod
    def vmap(info, in_dims, plan, table, keep, *operands):
        """torch.func.vmap: a vmapped operand carries one more mode, shared by every vmapped
        operand and kept first in the output; the batched network is planned (and cached) like
        any other, with the same sliced modes, so the slice table still applies."""
        if keep:  # contract_prepared never keeps GEMM operands for transformed tensors
            raise RuntimeError("ContractFunction: keep=True cannot be vmapped")
        dims = in_dims[3:]
        batched = tuple(i for i, d in enumerate(dims) if d is not None)
        size = operands[batched[0]].size(dims[batched[0]])
        moved = [op if d is None else op.movedim(d, 0) for op, d in zip(operands, dims)]
        return ContractFunction.apply(plan.batched_plan(batched, size), table, False, *moved), (0,)

    @staticmethod
    def jvp(ctx, _plan_t, _table_t, _keep_t, *tangents):
        operands = ctx.saved_tensors
        total = None
        for i, t in enumerate(tangents):
            if t is None:
                continue
            args = list(operands)
            args[i] = t.to(operands[i].dtype)
            part, = ContractFunction.apply(ctx.plan, ctx.table, False, *args)
            total = part if total is None else total + part
        return (total,) + (None,) * ctx.n_kept


class _TraceableContract(torch.autograd.Function):
    """ContractFunction without the custom jvp and vmap rules, which Dynamo cannot trace: what
    ``torch.compile`` records (forward AD and torch.func transforms are not compiled)."""
    forward = staticmethod(ContractFunction.forward)
    setup_context = staticmethod(ContractFunction.setup_context)
    backward = staticmethod(ContractFunction.backward)


def _derivative_gradients(plan, eff, grad_out, table, needs) -> List[Optional[torch.Tensor]]:
    """create_graph=True: each operand's gradient as a differentiable contraction of its
    derivative network (so gradgradcheck works)."""
    net = plan.network
    grads = []
    for i, need in enumerate(needs):
        if not need:
            grads.append(None)
            continue
        p, target, others = plan.derivative_plan(i)
        net_ops = p.prepare([grad_out.to(eff[i].dtype)] + [eff[j].conj() for j in others])
        g = ContractFunction.apply(p, table, False, *net_ops)[0] if table is not None else \
            net_ops[0].new_zeros(p.output_shape)
        # Modes of operand i that occur nowhere else were summed: the gradient broadcasts.
        modes = net.inputs[i]
        if len(target) != len(modes):
            shape = [net.sizes[m] if m in target else 1 for m in modes]
            order = [m for m in modes if m in target]
            g = g.permute([target.index(m) for m in order]).reshape(shape).expand(eff[i].shape)
        else:
            g = g.permute([target.index(m) for m in modes])
        grads.append(g)
    return grads


def contract_prepared(plan, eff, slices, progress: bool) -> torch.Tensor:
    """Contract preprocessed operands ``eff`` over a slice group, through the autograd Function
    when a gradient, forward AD or a torch.func transform may need it."""
    grad = _needs_function(eff)
    table = plan.slice_set.table(slices)
    if table is None:  # empty slice group
        return eff[0].new_zeros(plan.output_shape)
    if progress and plan.num_slices > 1:
        from tqdm.auto import tqdm
        ids = plan.slice_set.ids(slices)
        # one op call per chunk of slices (at most ~100 chunks): a live bar at low overhead
        step = max(1, -(-len(ids) // 100))
        total = None
        with tqdm(total=len(ids), desc="contract", unit="slice") as bar:
            for c in range(0, len(ids), step):
                chunk_ids = ids[c:c + step]
                chunk = plan.slice_set.table(chunk_ids)
                part = ContractFunction.apply(plan, chunk, False, *eff)[0] if grad else \
                    ops.contract_program(eff, list(plan.program), list(chunk))
                total = part if total is None else total + part
                bar.update(len(chunk_ids))
        return total
    if not grad:
        return ops.contract_program(eff, list(plan.program), list(table))
    if torch.compiler.is_compiling():
        return _TraceableContract.apply(plan, table, False, *eff)[0]
    # unsliced and gradients wanted: keep the GEMM operands for the backward (a sliced plan
    # recomputes per slice instead: that is its memory bound); not under torch.func transforms,
    # whose rules see only the Function's inputs
    keep = plan.num_slices == 1 and not plan.checkpoints and torch.is_grad_enabled() and \
        any(t.requires_grad for t in eff) and not any(_is_transformed(t) for t in eff)
    return ContractFunction.apply(plan, table, keep, *eff)[0]


def operand_gradients(plan, operands, output_grad, slices, grads, accumulate):
    """:meth:`~.plan.ContractionPlan.gradients`: the operands' gradients under ``output_grad``,
    without an autograd graph, optionally written or added into ``grads``."""
    n = len(plan.shapes)
    if grads is not None and len(grads) != n:
        raise ValueError(f"grads must have one entry per operand ({n}), got {len(grads)}")
    if not isinstance(output_grad, torch.Tensor):
        raise TypeError(f"output_grad must be a torch.Tensor, got {type(output_grad).__name__}")
    if tuple(output_grad.shape) != plan.output_shape:
        raise ValueError(f"output_grad has shape {tuple(output_grad.shape)}, the result has {plan.output_shape}")
    want = [True] * n if grads is None else [g is not None for g in grads]
    with torch.no_grad():
        raw_ops = [op.detach() if isinstance(op, torch.Tensor) else op for op in operands]
        eff = plan.prepare(raw_ops)
        table = plan.slice_set.table(slices)
        if table is None:
            geff = [torch.zeros_like(e) if w else None for e, w in zip(eff, want)]
        else:
            raw = ops.contract_program_backward(eff, list(plan.program), list(table), output_grad.to(eff[0].dtype),
                                                [int(w) for w in want], [])
            geff = [g if w else None for g, w in zip(raw, want)]
    result = []
    for i, g in enumerate(geff):
        steps = plan.network.pre[i]
        if g is not None and steps is not None:  # undo diagonal / squeeze: the views' backward
            with torch.enable_grad():
                leaf = raw_ops[i].to(eff[i].dtype).detach().requires_grad_(True)
                g, = torch.autograd.grad(apply_steps(leaf, steps), leaf, g)
        if g is not None and grads is not None:
            grads[i].add_(g) if accumulate else grads[i].copy_(g)
            g = grads[i]
        result.append(g)
    return result
