"""The compiled operator library (``torch.ops.torch_gradops``): loading it once, build facts,
and the device checks that the ops share."""
import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.torch_gradops.*)
except ImportError as exc:  # pragma: no cover - only when the extension was not built
    raise ImportError(
        "torch_gradops' compiled extension (torch_gradops._C) is missing or does not match this "
        "torch; build it with `bash scripts/bootstrap.sh test` or "
        "`pip install --no-build-isolation -e .`") from exc

ops = torch.ops.torch_gradops
# Read once: torch.compile cannot trace into the pybind function, and the ops' wrappers ask on
# every CUDA call (check_backend).
_WITH_CUDA = bool(_C.with_cuda())


def built_with_cuda() -> bool:
    """True if the CUDA kernels were compiled into this build."""
    return _WITH_CUDA


def check_backend(tensor: torch.Tensor, name: str) -> None:
    """Raise a clear error for a CUDA tensor when the CUDA kernels were not compiled in."""
    if tensor.device.type == "cuda" and not built_with_cuda():
        raise RuntimeError(
            f"{name} is a CUDA tensor, but torch_gradops was built without CUDA support "
            "(nvcc or a CUDA build of torch was missing at build time, or TORCH_GRADOPS_CUDA=0); "
            "rebuild with TORCH_GRADOPS_CUDA=1")
    if tensor.device.type not in ("cpu", "cuda", "meta"):
        raise RuntimeError(f"{name} is on device {tensor.device}; torch_gradops supports cpu and cuda")
