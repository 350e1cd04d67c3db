import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Parametrise a test over devices: the CUDA case carries the `cuda` marker.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
