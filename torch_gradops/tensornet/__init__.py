"""Sliced tensor-network contraction with exact, memory-bounded gradients.

``contract("ab,bc,cd->ad", a, b, c)`` plans the contraction once (path from ``opt_einsum`` or
``cotengra``, slicing to fit ``memory_limit``), caches the plan by (expression, shapes, dtype,
device type, options), compiles it into a flat program of pairwise steps (permute / reshape /
batched matmul, with the sums and slice selections around them) and runs the program in C++
through ATen (``torch.ops.torch_gradops.contract_program``): one op call for all slices (one per
chunk of slices with ``progress=True``), no per-step Python.

Gradients recompute one slice at a time in C++ (a slice whose intermediates together exceed the
budget is recomputed segment by segment between checkpoints) and accumulate each operand's
gradient across slices. ``memory_limit`` bounds the modelled working set of one slice's
forward + backward (:attr:`ContractionPlan.slice_working_set`), so the peak extra memory of
forward + backward stays within about ``memory_limit`` + operands + their gradients, whatever
the number of slices. ``create_graph=True`` and forward-mode AD express the derivative of a
network as further networks and contract them with the same Function, so they are
differentiable again.

Modules, one concern each: :mod:`.parser` (expressions, labels, the effective network),
:mod:`.paths` (path search), :mod:`.slicer` (memory limits, cost model, sliced modes, slice ids),
:mod:`.compiler` and :mod:`.program` (lowering to the executor's program format), :mod:`.plan`
(:class:`ContractionPlan`, the plan cache), :mod:`.autograd` (:class:`ContractFunction`),
:mod:`.contract` (the entry points).

Shapes: every operand ``k`` has one dimension per mode of its term; the result has one
dimension per output mode (a 0-dim tensor for a scalar output).
"""
from .autograd import ContractFunction
from .contract import clear_plan_cache, contract, plan, plan_cache_info, resolve
from .plan import ContractionPlan
from .slicer import parse_memory_limit

__all__ = ["contract", "plan", "resolve", "ContractionPlan", "ContractFunction", "parse_memory_limit",
           "plan_cache_info", "clear_plan_cache"]
