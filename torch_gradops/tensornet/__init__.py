"""Sliced tensor-network contraction with exact, memory-bounded gradients.

``contract("ab,bc,cd->ad", a, b, c)`` plans the contraction once (a seeded cotengra hyper-search
with cotengra's slicing for networks worth searching, opt_einsum for small ones), caches the plan
by (expression, shapes, dtype, device type, options), compiles it into a flat program of
pairwise steps (permute / reshape / batched matmul, with the sums and slice selections around
them) and runs the program in C++ through ATen (``torch.ops.torch_gradops.contract_program``):
one op call per bounded chunk of slices, no per-step Python.

What ``memory_limit`` means (the one statement of it): it bounds the largest intermediate of
one slice, as cotengra's ``target_size`` and cuTensorNet's workspace limit do. The backward
keeps its extra memory within a small multiple of it by recomputation between checkpoints,
not by slicing more: the measured peak extra memory of forward + backward is at most
``4 x memory_limit`` + the operands + their gradients (+ the output), for any number of
slices. The planner places the checkpoints with a model of the executor's memory
(:attr:`ContractionPlan.modelled_peak`, kept within 3.5 x ``memory_limit``); only where no
placement can keep it there does it slice further, and then preferably a mode in ranges
(:class:`~.parser.ModeChunks`: a mode of extent 16 in 2 chunks of 8 doubles the slices where
slicing it index by index would multiply them by 16); the slicer takes modes in chunks for the
limit itself too, wherever fewer slices do. One plan serves forward and backward.

A sliced plan computes its slice-invariant subtrees (steps none of whose operands holds a
sliced mode: the same in every slice) once per call and contracts the rest slice by slice,
where that costs less and the held results and their gradients fit the memory model
(:attr:`ContractionPlan.hoisted`).

Gradients recompute one slice at a time in C++ (segment by segment between checkpoints), write
each intermediate's gradient over the intermediate, and accumulate each operand's gradient
across slices; a one-element output's gradients are computed during the forward (each slice's
forward and backward in one pass), which saves the recomputation. ``create_graph=True`` and
forward-mode AD express the derivative of a network as further networks and contract them with
the same Function, so they are differentiable again. Slice ids are never listed: a plan with
2^40 slices costs nothing until run, and plans whose slicing costs more than ``max_overhead``
times the unsliced FLOPs (of their own path, or of a greedy one where that is cheaper) are
refused with advice.

Modules, one concern each: :mod:`.parser` (expressions, labels, the effective network),
:mod:`.paths` (path search), :mod:`.slicer` (memory limits, memory model, checkpoints, sliced
modes, slice ids), :mod:`.compiler` and :mod:`.program` (lowering to the executor's program
format), :mod:`.plan` (:class:`ContractionPlan`, the plan cache), :mod:`.autograd`
(:class:`ContractFunction`), :mod:`.contract` (the entry points).

Shapes: every operand ``k`` has one dimension per mode of its term; the result has one
dimension per output mode (a 0-dim tensor for a scalar output).
"""
from .autograd import ContractFunction
from .contract import clear_plan_cache, contract, plan, plan_cache_info, resolve, set_plan_cache_size
from .parser import ModeChunks
from .plan import ContractionPlan
from .slicer import parse_memory_limit

__all__ = ["contract", "plan", "resolve", "ContractionPlan", "ContractFunction", "ModeChunks", "parse_memory_limit",
           "plan_cache_info", "set_plan_cache_size", "clear_plan_cache"]
