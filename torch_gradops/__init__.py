"""torch_gradops: fused, deterministic, differentiable graph attention and sliced
tensor-network contraction for PyTorch, on CPU and CUDA.

Ops live under ``torch.ops.torch_gradops`` (registered with ``TORCH_LIBRARY``, with fake
kernels for ``torch.compile``); the Python API wraps them in ``torch.autograd.Function``s.
"""
from .library import built_with_cuda
from .graph import BipartiteCSC
from .gat import GATAttentionFunction, gat_attention, mha_gat_n2n
from .gatv2 import GATv2AttentionFunction, gatv2_attention, mha_gat_v2_n2n
from . import tensornet
from .tensornet import ContractFunction, ContractionPlan
from . import distributed  # noqa: E402  (registers tensornet.contract(process_group=...))

contract = tensornet.contract  # torch_gradops.contract(expr, *operands, ...)

__version__ = "0.1.0"

__all__ = ["BipartiteCSC", "GATAttentionFunction", "gat_attention", "mha_gat_n2n", "built_with_cuda",
           "GATv2AttentionFunction", "gatv2_attention", "mha_gat_v2_n2n",
           "tensornet", "distributed", "contract", "ContractFunction", "ContractionPlan"]
