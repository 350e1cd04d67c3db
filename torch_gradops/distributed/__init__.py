"""torch_gradops across processes with ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

* :func:`contract` / :func:`contract_plan`: a sliced tensor-network contraction whose slices are
  shared by the ranks of a process group (also reachable as
  ``torch_gradops.tensornet.contract(..., process_group=g)``, which this package registers);
* :func:`rank_slices`: a rank's contiguous range of slice ids (what :func:`contract` runs);
  :func:`split_by_cost`: balance work items of unequal cost over ranks;
* :func:`fingerprints` / :func:`same_fingerprint`: what :func:`contract` compares across ranks
  to refuse operands (and output gradients) whose values differ between them.

Production jobs launch with ``torchrun`` (see the README's "Scaling out");
:func:`torch_gradops.testing.launch` starts local process groups for tests and benchmarks.
Imports go one way: this package uses :mod:`torch_gradops.tensornet`, never the reverse.
"""
from ..tensornet.contract import register_process_group_runner
from .tensornet import (ContractStats, DistributedContractFunction, contract, contract_plan, fingerprints, rank_slices,
                        same_fingerprint, split_by_cost)

register_process_group_runner(contract_plan)

__all__ = ["contract", "contract_plan", "ContractStats", "DistributedContractFunction", "rank_slices",
           "split_by_cost", "fingerprints", "same_fingerprint"]
