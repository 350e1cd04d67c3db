"""Autograd for contractions: :class:`ContractFunction` over the C++ executor, and the
derivative networks behind double backward and forward-mode AD.

First-order backward runs the executor's backward, which recomputes one slice at a time
(segment by segment between checkpoints), writes each intermediate's gradient over the
intermediate, and accumulates each operand's gradient across slices. A one-element output
(a loss) gets its gradients during the forward instead ("fused": each slice's forward and
backward in one pass under a unit cotangent, scaled by the output gradient later), which saves
the recomputation; an unsliced plan without a memory limit reuses the GEMM operands its forward
kept. Slice groups run a bounded number of slices per executor call
(:meth:`~.slicer.Slices.chunks`). Under ``create_graph=True`` each operand's gradient is itself
a contraction (the network with that operand removed and the output gradient added,
:meth:`~.plan.ContractionPlan.derivative_plan`), computed with this same Function, so it is
differentiable again; forward-mode AD sums the network with each operand replaced by its
tangent. This module does not plan: plans come in as arguments.
"""
from __future__ import annotations

import itertools
import math
from typing import List, Optional

import torch

from .._transforms import COMPOSITE, FUNCTION, FUSED_JVP, is_legacy_batched, is_transformed, join_dual, route, split_duals
from ..library import ops
from .program import accumulate_dtype  # (the module also registers the executor ops' fake kernels)
from .parser import apply_steps

__all__ = ["ContractFunction", "contract_prepared", "operand_gradients", "PLAIN", "KEEP", "FUSED"]

PLAIN, KEEP, FUSED = "plain", "keep", "fused"


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
    return any(is_transformed(t) for t in eff)


def _engine_needs(ctx, needs):
    """needs_input_grad narrowed to the edges this backward will run: with
    ``torch.autograd.grad(inputs=subset)`` an operand whose branch is not needed costs nothing.
    (The engine cannot tell this for leaf operands under autograd.grad; those count as needed.)"""
    needs = list(needs)
    if torch.compiler.is_compiling():  # traced ahead of time: no engine to ask (torch 2.11 raises)
        return needs
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


def _forward(plan, operands, group, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The contraction over a slice group, a bounded number of slices per executor call (the
    executor sums a call's slices in :func:`accumulate_dtype`, and so does this the calls), in
    ``dtype``: the operands' (default), or :func:`accumulate_dtype` for the sum unrounded."""
    dtype = dtype or operands[0].dtype
    tables = plan.slice_set.chunks(group)
    first, second = next(tables, None), next(tables, None)
    if first is None:
        return operands[0].new_zeros(plan.output_shape, dtype=dtype)
    if second is None:  # one call: it rounds its own sum, where the result is wanted rounded
        return ops.contract_program(list(operands), list(plan.program), list(first), dtype)
    acc = accumulate_dtype(operands[0].dtype)
    total = None
    for table in itertools.chain((first, second), tables):
        part = ops.contract_program(list(operands), list(plan.program), list(table), acc)
        total = part if total is None else total.add_(part)
    return total.to(dtype)


def _backward(plan, operands, group, grad_out, needs, kept=(), rounded: bool = True) -> List[torch.Tensor]:
    """Operand gradients over a slice group under ``grad_out`` (entries not in ``needs``: empty),
    summed over the slices in :func:`accumulate_dtype`; in the operands' dtypes, or with
    ``rounded=False`` in :func:`accumulate_dtype` (for a caller that adds several groups)."""
    grad_out = grad_out.to(operands[0].dtype)
    tables = plan.slice_set.chunks(group)
    first = next(tables, None)
    acc = accumulate_dtype(operands[0].dtype)
    if first is None:
        return [torch.zeros_like(op, dtype=None if rounded else acc) if n else op.new_empty((0,))
                for op, n in zip(operands, needs)]
    second = next(tables, None)
    if (second is None and rounded) or acc == operands[0].dtype:
        grads = ops.contract_program_backward(list(operands), list(plan.program), list(first), grad_out,
                                              [int(n) for n in needs], list(kept))
        rest = [] if second is None else [second]
    else:  # several executor calls on float16/bfloat16, or unrounded: float32 buffers from the first one
        grads = [torch.zeros_like(op, dtype=acc, memory_format=torch.contiguous_format) if n else op.new_empty((0,))
                 for op, n in zip(operands, needs)]
        rest = [first] if second is None else [first, second]
    for table in itertools.chain(rest, tables):  # further chunks add into the same buffers
        ops.contract_program_accumulate(list(operands), list(plan.program), list(table), grad_out, grads)
    return [g.to(op.dtype) if n and rounded else g for g, op, n in zip(grads, operands, needs)]


class ContractFunction(torch.autograd.Function):
    """``ContractFunction.apply(plan, slices, mode, *operands) -> (out, *extra)``: the
    differentiable core of :func:`~.contract.contract` (operands already checked and
    preprocessed by ``plan.prepare``; ``slices`` a slice group).

    ``mode``: :data:`PLAIN` (backward recomputes), :data:`KEEP` (one slice: the forward also
    returns the GEMM operands its backward reuses) or :data:`FUSED` (one-element output: the
    forward also returns each operand's gradient under a unit cotangent, which the backward
    scales); the extra outputs are non-differentiable. Under ``create_graph=True`` the backward
    contracts one derivative network per operand. jvp: the sum over operands of the network
    with that operand replaced by its tangent.
    """

    @staticmethod
    def forward(plan, slices, mode, *operands):
        if mode == KEEP:
            table = next(iter(plan.slice_set.chunks(slices)))
            out, kept = ops.contract_program_cached(list(operands), list(plan.program), list(table),
                                                    [int(t.requires_grad) for t in operands])
            return (out, *kept)
        if mode == FUSED:  # value and gradients summed over the slices in accumulate_dtype
            units = [torch.zeros_like(t, dtype=accumulate_dtype(t.dtype), memory_format=torch.contiguous_format)
                     if t.requires_grad else t.new_empty((0,)) for t in operands]
            value = None
            for table in plan.slice_set.chunks(slices):
                part = ops.contract_program_accumulate(list(operands), list(plan.program), list(table), None, units)
                value = part if value is None else value.add_(part)  # each call's value is unrounded
            if value is None:
                value = operands[0].new_zeros(plan.output_shape)
            return (value.to(operands[0].dtype), *(u.to(t.dtype) for u, t in zip(units, operands)))
        return (_forward(plan, operands, slices),)

    @staticmethod
    def setup_context(ctx, inputs, output):
        plan, slices, mode, *operands = inputs
        extra = output[1:]
        ctx.mark_non_differentiable(*extra)
        ctx.set_materialize_grads(False)  # no zero gradients for the (operand-sized) extra outputs
        ctx.plan, ctx.slices, ctx.mode, ctx.n_operands, ctx.n_extra = plan, slices, mode, len(operands), len(extra)
        if mode == FUSED:
            # The unit gradients are handed to the caller as they are (no copy) by the first
            # backward, so they are not saved tensors: a caller editing its gradient in place
            # would fail a retained graph's next backward on the version check. Held here
            # (detached: no reference cycle) until that first backward; a later one recomputes.
            ctx.save_for_backward(*operands)
            ctx.units = [u.detach() for u in extra]
        else:
            ctx.save_for_backward(*operands, *extra)
        ctx.save_for_forward(*operands)

    @staticmethod
    def backward(ctx, grad_out, *_):
        saved = ctx.saved_tensors
        operands, extra = saved[:ctx.n_operands], saved[ctx.n_operands:]
        needs = _engine_needs(ctx, ctx.needs_input_grad[3:])
        if grad_out is None or not any(needs):
            return (None, None, None) + (None,) * len(operands)
        if is_legacy_batched(grad_out) and (ctx.mode != FUSED or torch.is_grad_enabled() or ctx.units is None):
            # is_grads_batched / vectorize=True: the executor's ops take tensor lists, which that
            # vmap cannot batch; PyTorch's autograd of the einsum steps can (unsliced). (FUSED
            # scales the forward's unit gradients by a batched grad_out, but only once: a
            # retained graph's later backward recomputes, and takes this way.)
            grads = _composite_gradients(ctx.plan, list(operands), grad_out, ctx.slices, needs)
        elif torch.is_grad_enabled() or is_transformed(grad_out):
            # create_graph=True, or a batched/dual output gradient (torch.func, gradcheck's
            # batched checks): gradients as contractions through this Function, whose vmap and
            # jvp rules apply; the fused backward ops have no batching rule
            grads = _derivative_gradients(ctx.plan, list(operands), grad_out, ctx.slices, needs)
        elif ctx.mode == FUSED and ctx.units is not None:  # (a later backward recomputes, below)
            units, ctx.units = ctx.units, None  # used once, and not kept past this backward
            g = grad_out.reshape(()).to(operands[0].dtype)
            # a unit output gradient (loss.backward()) takes the forward's gradients as they are,
            # not a scaled copy of each (on the CPU, where asking costs no device sync)
            unit = g.device.type == "cpu" and not is_legacy_batched(g) and bool(g == 1)
            grads = [(u if unit else u * g) if n else None for u, n in zip(units, needs)]
        else:  # (FUSED: nothing extra saved)
            raw = _backward(ctx.plan, operands, ctx.slices, grad_out, needs, extra)
            grads = [g if n else None for g, n in zip(raw, needs)]
        return (None, None, None) + tuple(grads)

    @staticmethod
    def vmap(info, in_dims, plan, slices, mode, *operands):
        """torch.func.vmap: a vmapped operand carries one more mode, shared by every vmapped
        operand and kept first in the output; the batched network is planned (and cached) like
        any other, with the same sliced modes, so the slice group still applies."""
        if mode != PLAIN:  # _mode() is PLAIN for transformed operands
            raise RuntimeError(f"ContractFunction: mode {mode!r} cannot be vmapped")
        dims = in_dims[3:]
        batched = tuple(i for i, d in enumerate(dims) if d is not None)
        size = operands[batched[0]].size(dims[batched[0]])
        moved = [op if d is None else op.movedim(d, 0) for op, d in zip(operands, dims)]
        return ContractFunction.apply(plan.batched_plan(batched, size), slices, PLAIN, *moved), (0,)

    @staticmethod
    def jvp(ctx, _plan_t, _slices_t, _mode_t, *tangents):
        operands = ctx.saved_tensors
        if any(is_legacy_batched(t) for t in tangents):
            # legacy vmap (jacobian(strategy="forward-mode", vectorize=True), gradcheck's batched
            # forward-gradient check): neither the executor's ops nor einsum (both take tensor
            # lists) run on its tensors; matmul steps along the plan's path (unsliced) do
            group = ctx.plan.slice_set.group(ctx.slices)
            total = _tangent_sum(operands, tangents,
                                 lambda args: _composite(ctx.plan, args, group, einsum=_matmul_einsum))
        else:
            total = _tangent_sum(operands, tangents,
                                 lambda args: ContractFunction.apply(ctx.plan, ctx.slices, PLAIN, *args)[0])
        return (total,) + (None,) * ctx.n_extra


class _TraceableContract(torch.autograd.Function):
    """ContractFunction without the custom jvp and vmap rules, which Dynamo cannot trace: what
    ``torch.compile`` records (forward AD and torch.func transforms are not compiled)."""
    forward = staticmethod(ContractFunction.forward)
    setup_context = staticmethod(ContractFunction.setup_context)
    backward = staticmethod(ContractFunction.backward)


def _derivative_gradients(plan, eff, grad_out, slices, needs) -> List[Optional[torch.Tensor]]:
    """create_graph=True: each operand's gradient as a differentiable contraction of its
    derivative network (so gradgradcheck works)."""
    net = plan.network
    grads = []
    for i, need in enumerate(needs):
        if not need:
            grads.append(None)
            continue
        p, target, others, fan = plan.derivative_plan(i)
        # conj(sum grad_out^* x others) = sum grad_out x conj(others): one output-sized conjugate
        # copy instead of a resolved conjugate of every other operand (complex dtypes)
        net_ops = p.prepare([grad_out.to(eff[i].dtype).conj()] + [eff[j] for j in others])
        g = ContractFunction.apply(p, plan.derivative_slices(slices, fan), PLAIN, *net_ops)[0].conj()
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


def _composite_gradients(plan, eff, grad_out, slices, needs) -> List[Optional[torch.Tensor]]:
    """The operands' gradients under a legacy-batched ``grad_out`` (``is_grads_batched=True``,
    ``jacobian``/``hessian(vectorize=True)``): neither the executor's ops (they take tensor
    lists) nor einsum's forward can run on that vmap's tensors, but autograd's backward of the
    einsum steps (:func:`_composite`, unsliced) can.

    Each gradient must be the partial derivative along this node's edge alone. Where the output
    gradient itself depends on an operand (``contract(a, b) ** 2``), ``torch.autograd.grad`` of
    the composite for the operands as they are would also follow that dependence, which the
    engine then follows again (the mixed second derivatives came out doubled). So the operand
    differentiated is a detached copy: all of them in one composite, or under
    ``create_graph=True`` one composite per operand with only that one detached, so that its
    gradient stays differentiable in the output gradient and the other operands (the network is
    linear in each operand: the gradient does not depend on the operand itself)."""
    create_graph = torch.is_grad_enabled()
    group = plan.slice_set.group(slices)
    with torch.enable_grad():
        if not create_graph:
            leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(eff, needs)]
            out = _composite(plan, leaves, group)
            got = iter(torch.autograd.grad(out, [t for t, n in zip(leaves, needs) if n], grad_out.to(out.dtype),
                                           allow_unused=True, materialize_grads=True))
            return [next(got) if n else None for n in needs]
        grads: List[Optional[torch.Tensor]] = []
        for i, n in enumerate(needs):
            if not n:
                grads.append(None)
                continue
            leaf = eff[i].detach().requires_grad_(True)
            out = _composite(plan, eff[:i] + [leaf] + eff[i + 1:], group)
            grads.append(torch.autograd.grad(out, leaf, grad_out.to(out.dtype), create_graph=True,
                                             allow_unused=True, materialize_grads=True)[0])
        return grads


def _tangent_sum(primals, tangents, contract) -> Optional[torch.Tensor]:
    """The tangent of a multilinear network: the sum over operands with a tangent of
    ``contract(args)``, ``args`` the primals with that operand replaced by its tangent (None
    when no operand has one)."""
    total = None
    for i, t in enumerate(tangents):
        if t is not None:
            part = contract(list(primals[:i]) + [t.to(primals[i].dtype)] + list(primals[i + 1:]))
            total = part if total is None else total + part
    return total


def _matmul_einsum(tensors, modes, out_modes) -> torch.Tensor:
    """One or two tensors contracted as :func:`_einsum` does, by sums, permutes, reshapes and a
    batched matmul: ops that the legacy vmap can batch (einsum, taking a tensor list, it cannot)."""
    def reduce(t, mm, keep):  # sum the modes not in keep, once each
        gone = [d for d, m in enumerate(mm) if m not in keep]
        return (t.sum(gone) if gone else t), [m for m in mm if m in keep]

    if len(tensors) == 1:
        t, mm = reduce(tensors[0], modes[0], set(out_modes))
        return t.permute([mm.index(m) for m in out_modes])
    (a, b), (ma, mb) = tensors, modes
    a, ma = reduce(a, ma, set(out_modes) | set(mb))
    b, mb = reduce(b, mb, set(out_modes) | set(ma))
    batch = [m for m in ma if m in mb and m in out_modes]
    summed = [m for m in ma if m in mb and m not in out_modes]
    free_a = [m for m in ma if m not in mb]
    free_b = [m for m in mb if m not in ma]
    size = {**dict(zip(ma, a.shape)), **dict(zip(mb, b.shape))}
    numel = lambda ms: math.prod(size[m] for m in ms)  # noqa: E731
    a3 = a.permute([ma.index(m) for m in batch + free_a + summed]).reshape(numel(batch), numel(free_a), numel(summed))
    b3 = b.permute([mb.index(m) for m in batch + summed + free_b]).reshape(numel(batch), numel(summed), numel(free_b))
    got = torch.bmm(a3, b3).reshape([size[m] for m in batch + free_a + free_b])
    have = batch + free_a + free_b
    return got.permute([have.index(m) for m in out_modes])


def _mode(plan, eff, group) -> str:
    """How a differentiable contraction runs (see :class:`ContractFunction`)."""
    wants = torch.is_grad_enabled() and any(t.requires_grad for t in eff)
    plain_ad = torch.autograd.forward_ad._current_level < 0 and not any(is_transformed(t) for t in eff)
    if not wants or not plain_ad:
        return PLAIN
    if len(plan.output_shape) == 0 or all(d == 1 for d in plan.output_shape):
        return FUSED
    if len(group) == 1 and not plan.checkpoints and plan.memory_limit is None:
        return KEEP  # no memory promise to keep: reuse the forward's GEMM operands
    return PLAIN


def _composite(plan, eff, group, einsum=None) -> torch.Tensor:
    """The whole contraction in ``torch.einsum`` steps along the plan's path, unsliced: what
    nested forward mode and torch.compile over reverse-mode or vmap transforms run (see
    :mod:`torch_gradops._transforms`); PyTorch differentiates it in every mode. It holds the
    unsliced intermediates: ``memory_limit`` does not bound it. ``einsum``: the step function
    (default :func:`_einsum`)."""
    einsum = einsum or _einsum
    if len(group) != plan.num_slices:
        raise NotImplementedError(
            "a partial slice group under nested forward-mode AD or under torch.compile of a torch.func "
            "transform is not supported; contract all slices (slices=None) there")
    net = plan.network
    tensors, modes = list(eff), [list(m) for m in net.inputs]
    for step in plan.path:
        picked = sorted(step, reverse=True)
        ts = [tensors.pop(k) for k in picked]
        ms = [modes.pop(k) for k in picked]
        keep = set(net.output).union(*map(set, modes))
        kept = list(dict.fromkeys(m for mm in ms for m in mm if m in keep))
        tensors.append(einsum(ts, ms, kept))
        modes.append(kept)
    return einsum(tensors, modes, list(net.output))


def _einsum(tensors, modes, out_modes) -> torch.Tensor:
    """torch.einsum in sublist form, the modes renumbered from 0 (it takes at most 52)."""
    ids = {m: i for i, m in enumerate(dict.fromkeys(m for mm in modes for m in mm))}
    args = []
    for t, mm in zip(tensors, modes):
        args += [t, [ids[m] for m in mm]]
    return torch.einsum(*args, [ids[m] for m in out_modes])


def _traced(plan, operands, group) -> torch.Tensor:
    """Under torch.compile: the contraction through the Function Dynamo traces when an operand
    requires grad (Dynamo inlines a Function's forward otherwise), else the op itself. Dynamo
    refuses a Function given one tensor as two inputs (a state or gate reused in a circuit), so
    a tensor's later occurrences go in as views of it (autograd adds their gradients back)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        distinct = [t.view_as(t) if any(t is u for u in operands[:i]) else t for i, t in enumerate(operands)]
        return _TraceableContract.apply(plan, group, PLAIN, *distinct)[0]
    return _forward(plan, operands, group)


def contract_prepared(plan, eff, slices, progress: bool, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Contract preprocessed operands ``eff`` over a slice group, through the autograd Function
    when a gradient, forward AD or a torch.func transform may need it. ``dtype``: where no
    Function runs, the result's (:func:`_forward`; default: the operands')."""
    group = plan.slice_set.group(slices)
    if len(group) == 0 and plan.num_slices > 0:  # an empty slice group (a rank given no slices)
        if not _needs_function(eff) or torch.compiler.is_compiling() or route(eff, vmap_traceable=False) != FUNCTION:
            return eff[0].new_zeros(plan.output_shape)
        # zeros on the autograd graph: every operand gets a zero gradient, as for any slice group
        return ContractFunction.apply(plan, group, PLAIN, *eff)[0]
    parts = plan.hoisted
    if parts is not None:  # the slice-invariant subtrees once, then the sliced rest
        results = [contract_prepared(sub, [eff[i] for i in ops_], None, False) for sub, ops_ in parts.subs]
        return contract_prepared(parts.main, parts.main_inputs(eff, results), group, progress, dtype)
    how = route(eff, vmap_traceable=False)
    if how == COMPOSITE:
        return _composite(plan, eff, group)
    if how == FUSED_JVP:  # compiled forward mode: the tangent is a sum of contractions
        primals, tangents = split_duals(eff)
        tangent = _tangent_sum(primals, tangents, lambda args: _traced(plan, args, group))
        return join_dual(_traced(plan, primals, group), tangent)
    grad = _needs_function(eff)
    if progress and len(group) > 1:
        from tqdm.auto import tqdm
        # about 100 parts (one op call each at least): a live bar at low overhead; with gradients
        # in float16/bfloat16 one part (one Function, summing in float32), since autograd would
        # add the parts' gradients in that dtype
        whole = grad and accumulate_dtype(eff[0].dtype) != eff[0].dtype
        step = len(group) if whole else max(1, -(-len(group) // 100))
        total = None
        with tqdm(total=len(group), desc="contract", unit="slice") as bar:
            for c in range(0, len(group), step):
                part_group = group[c:c + step]
                part = ContractFunction.apply(plan, part_group, _mode(plan, eff, part_group), *eff)[0] if grad \
                    else _forward(plan, eff, part_group, accumulate_dtype(eff[0].dtype))
                total = part if total is None else total.to(accumulate_dtype(part.dtype)) + part
                bar.update(len(part_group))
        return total.to(eff[0].dtype if grad else dtype or eff[0].dtype)
    if not grad:
        return _forward(plan, eff, group, dtype)
    if torch.compiler.is_compiling():
        return _traced(plan, eff, group)
    return ContractFunction.apply(plan, group, _mode(plan, eff, group), *eff)[0]


def _eff_gradients(plan, eff, group, grad_out, want, rounded: bool = True) -> List[torch.Tensor]:
    """:func:`_backward` of a plan, hoisted (``plan.hoisted``) or not: for a hoisted plan the
    gradients of the sliced rest, those of the subtrees' results passed through the subtrees;
    ``rounded=False``: in :func:`accumulate_dtype`, unrounded (:func:`_sub_backward`)."""
    parts = plan.hoisted
    if parts is None:
        return _backward(plan, eff, group, grad_out, want, rounded=rounded)
    results = [_forward(sub, [eff[i] for i in ops_], sub.slice_set.group(None)) for sub, ops_ in parts.subs]
    main_want = [want[i] if kind == "op" else any(want[j] for j in parts.subs[i][1])
                 for kind, i in parts.main_operands]
    main_grads = _backward(parts.main, parts.main_inputs(eff, results), group, grad_out, main_want, rounded=rounded)
    out = [op.new_empty((0,)) for op in eff]
    for (kind, i), g, w in zip(parts.main_operands, main_grads, main_want):
        if not w:
            continue
        if kind == "op":
            out[i] = g
            continue
        sub, ops_ = parts.subs[i]
        sub_want = [want[j] for j in ops_]
        sub_ops = [eff[j] for j in ops_]
        for j, gj, wj in zip(ops_, _sub_backward(sub, sub_ops, g, sub_want, rounded), sub_want):
            if wj:
                out[j] = gj
    return out


def _sub_backward(sub, operands, g, want, rounded: bool) -> List[torch.Tensor]:
    """A hoisted subtree's operand gradients under its result's gradient ``g``. Unrounded (``g``
    in float32 for float16/bfloat16 operands, which the executor takes in their dtype), ``g`` goes
    in as two parts, its rounding and the rest, whose gradients add up in float32: the
    backward is linear in ``g``, so a slice group's sum keeps about twice the dtype's bits."""
    group = sub.slice_set.group(None)
    if rounded or g.dtype == operands[0].dtype:
        return _backward(sub, operands, group, g, want, rounded=rounded)
    hi = g.to(operands[0].dtype)
    lo = (g - hi.to(g.dtype)).to(operands[0].dtype)
    first = _backward(sub, operands, group, hi, want, rounded=False)
    second = _backward(sub, operands, group, lo, want, rounded=False)
    return [a.add_(b) if w else a for a, b, w in zip(first, second, want)]


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
    for i, (buf, shape) in enumerate(zip(grads or (), plan.shapes)):
        if buf is not None and (not isinstance(buf, torch.Tensor) or tuple(buf.shape) != shape):
            got = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"grads[{i}] must be None or a tensor of operand {i}'s shape {shape}, got {got}")
        op = operands[i] if i < len(operands) else None
        if buf is not None and isinstance(op, torch.Tensor) and (
                buf.dtype not in (op.dtype, accumulate_dtype(op.dtype)) or buf.device != op.device):
            # another buffer dtype would truncate the gradient (float32 for a float16/bfloat16
            # operand takes it unrounded: slice groups added across calls or ranks)
            wide = "" if accumulate_dtype(op.dtype) == op.dtype else f" (or {accumulate_dtype(op.dtype)})"
            raise TypeError(f"grads[{i}] must have operand {i}'s dtype{wide} and device ({op.dtype}, {op.device}), "
                            f"got {buf.dtype}, {buf.device}")
    with torch.no_grad():
        raw_ops = [op.detach() if isinstance(op, torch.Tensor) else op for op in operands]
        eff = plan.prepare(raw_ops)
        if output_grad.is_complex() and not eff[0].is_complex():  # as autograd refuses it
            raise TypeError(f"output_grad is complex ({output_grad.dtype}) but the result is real ({eff[0].dtype}): "
                            f"pass its real part")
        # a float32 buffer for a float16/bfloat16 operand: the gradients come unrounded
        rounded = not any(buf is not None and buf.dtype != op.dtype for buf, op in zip(grads or (), eff))
        raw = _eff_gradients(plan, eff, plan.slice_set.group(slices), output_grad, want, rounded=rounded)
        geff = [g if w else None for g, w in zip(raw, want)]
    result = []
    for i, g in enumerate(geff):
        steps = plan.network.pre[i]
        if g is not None and steps is not None:  # undo diagonal / squeeze: the views' backward
            with torch.enable_grad():
                leaf = raw_ops[i].to(g.dtype).detach().requires_grad_(True)
                g, = torch.autograd.grad(apply_steps(leaf, steps), leaf, g)
        want_dtype = raw_ops[i].dtype if grads is None or grads[i] is None else grads[i].dtype
        if g is not None and g.dtype != want_dtype:
            # the operand was promoted (to a wider or complex dtype): its gradient is that of the
            # cast, as autograd gives it (the real part for a real operand)
            g = (g.real if g.is_complex() and not raw_ops[i].is_complex() else g).to(want_dtype)
        if g is not None and grads is not None:
            grads[i].add_(g) if accumulate else grads[i].copy_(g)
            g = grads[i]
        result.append(g)
    return result
