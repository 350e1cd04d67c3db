"""How the fused ops run under torch.func transforms and ``torch.compile``.

Eager code differentiates through each op's autograd Function: its ``backward``, ``jvp`` and
``vmap`` rules. Two cases cannot use those rules, and the public wrappers route them:

* **Nested forward mode** (``jacfwd(jacfwd(f))``, ``jvp`` of a ``jvp``): torch.func runs a
  Function's ``jvp`` with forward gradients of the enclosing levels turned off, so the
  second-order tangent of any custom ``jvp`` comes out zero, silently. With two or more
  forward levels the wrappers compute with plain PyTorch ops instead (:data:`COMPOSITE`):
  exact at every order, at the memory of the unfused formulation.
* **torch.compile**: Dynamo does not call a Function's ``jvp`` (it differentiates the
  forward, whose custom op has no forward-mode formula; ``torch.library`` cannot register one)
  and cannot trace a Function's custom ``vmap`` rule or a vmapped reverse mode. Under
  ``torch.compile`` the wrappers use the first-order Function (fused forward and backward
  kernels) with no transform (``loss.backward()``) and under ``vmap``; with one forward level
  on top (``jvp``, ``jacfwd``, dual tensors) they take the dual inputs apart themselves
  (:data:`FUSED_JVP`: primal by the first-order Function, tangent by the same fused JVP code
  as the eager ``jvp``, joined with ``make_dual``); under reverse-mode transforms (``grad``,
  ``jacrev``, ``hessian``, ``vmap(grad)``) and nested forward mode they are
  :data:`COMPOSITE`, which Dynamo traces like any PyTorch code (Dynamo traces a Function
  inside ``grad`` only when it sees every input wrapped, and never a vmapped backward).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch.autograd import forward_ad

__all__ = ["FUNCTION", "FUSED_JVP", "COMPOSITE", "transform_keys", "is_transformed", "is_legacy_batched", "has_tangent",
           "route",
           "split_duals", "join_dual", "not_compiled"]

FUNCTION, FUSED_JVP, COMPOSITE = "function", "fused_jvp", "composite"


def transform_keys() -> Tuple:
    """The torch.func transforms around this call (``TransformType``), innermost first. Dynamo
    traces this (it evaluates the interpreter stack at trace time)."""
    from torch._functorch.pyfunctorch import coerce_cinterpreter
    if not torch._C._are_functorch_transforms_active():
        return ()
    interp = coerce_cinterpreter(torch._C._functorch.peek_interpreter_stack())
    if interp.level() <= 1:  # the outermost (under Dynamo, peek's None below it is not None)
        return (interp.key(),)
    with interp.lower():
        return (interp.key(),) + transform_keys()


def is_transformed(t: Optional[torch.Tensor]) -> bool:
    """``t`` is a torch.func wrapper (batched, gradient-tracking or dual), outside torch.compile:
    Dynamo cannot ask, and under it the transforms are not traced through our Functions."""
    return t is not None and not torch.compiler.is_compiling() and \
        torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_legacy_batched(t: Optional[torch.Tensor]) -> bool:
    """``t`` is batched by the legacy vmap behind ``torch.autograd.grad(is_grads_batched=True)``
    and ``torch.autograd.functional.jacobian/hessian(vectorize=True)`` (the ``Batched`` dispatch
    key, not torch.func's): only ops with batching rules or a for-loop fallback run on it, and
    there is none for ops taking a list of tensors."""
    return t is not None and not torch.compiler.is_compiling() and \
        torch._C._functorch.is_legacy_batchedtensor(t)


def has_tangent(t: Optional[torch.Tensor]) -> bool:
    """Whether ``t`` carries a forward-mode tangent at the current level."""
    return t is not None and forward_ad.unpack_dual(t).tangent is not None


def route(tensors: Sequence[Optional[torch.Tensor]], vmap_traceable: bool = True,
          reverse_over_forward: bool = True) -> str:
    """How a wrapper runs its op on ``tensors`` (see the module docstring). ``vmap_traceable``:
    whether Dynamo can trace the first-order Function under ``vmap`` (a generated vmap rule
    over ops with registered batching rules: the GAT ops; not the contraction's custom rule).
    ``reverse_over_forward``: whether the Function's ``jvp`` may run under an enclosing
    reverse-mode transform (``jacrev(jacfwd(f))``); if not, that case is composite too.
    Compiled forward mode (:data:`FUSED_JVP`) only where no reverse pass can follow: its
    tangent comes from ops that Dynamo traces without their autograd (the gradients of a tangent
    came out zero, or "derivative ... not implemented"), so with an input that requires grad
    (dual tensors), or with grad mode on under ``torch.func.jvp``/``jacfwd`` (whose wrapped
    inputs do not show ``requires_grad`` here), it is composite; under ``torch.no_grad()`` it
    stays fused."""
    from torch._C._functorch import TransformType
    keys = transform_keys()
    jvps = sum(1 for k in keys if k == TransformType.Jvp)
    if jvps >= 2:
        return COMPOSITE
    if not torch.compiler.is_compiling():
        if not reverse_over_forward and jvps == 1 and TransformType.Grad in keys[keys.index(TransformType.Jvp):]:
            return COMPOSITE
        return FUNCTION
    grads = sum(1 for k in keys if k == TransformType.Grad)
    vmaps = sum(1 for k in keys if k == TransformType.Vmap)
    if jvps == 0 and not keys and forward_ad._current_level >= 0 and any(map(has_tangent, tensors)):
        # dual tensors of a plain forward_ad.dual_level()
        wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        return COMPOSITE if wants_grad else FUSED_JVP
    if jvps == 1 and keys[0] == TransformType.Jvp and grads == 0 and (vmap_traceable or vmaps == 0):
        return COMPOSITE if torch.is_grad_enabled() else FUSED_JVP
    if jvps == 0 and grads == 0 and (vmaps == 0 or vmap_traceable):
        return FUNCTION
    return COMPOSITE


def split_duals(tensors: Sequence[Optional[torch.Tensor]]):
    """``(primals, tangents)`` of ``tensors`` at the current forward level (None stays None;
    a tensor without a tangent has tangent None)."""
    primals, tangents = [], []
    for t in tensors:
        p, tt = (None, None) if t is None else forward_ad.unpack_dual(t)
        primals.append(p)
        tangents.append(tt)
    return primals, tangents


def join_dual(primal: torch.Tensor, tangent: Optional[torch.Tensor]) -> torch.Tensor:
    """``primal`` with ``tangent`` attached at the current forward level."""
    return primal if tangent is None else forward_ad.make_dual(primal, tangent)


def not_compiled(fn, reason: str):
    """``fn`` run eagerly under ``torch.compile`` (Dynamo skips it: a graph break); under
    ``fullgraph=True`` Dynamo's error gives ``reason`` (torch >= 2.8 takes one)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch < 2.8
        return torch.compiler.disable(fn)
