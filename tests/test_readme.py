"""The README's Python blocks run, in order, in one namespace (as a reader pastes them), on
small inputs for the names they take as given. The distributed block needs torchrun and is
left to tests/test_distributed*.py."""
import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _given():
    """What the README's snippets take as given: a graph of 12 nodes (homogeneous, so that the
    same edge_index serves the layers and the bipartite ops), features, logits, edge features
    with 4 columns, a PyG GAT model to convert, and three operands for the Hessian."""
    from torch_geometric.nn.models import GAT as PygGAT

    gen = torch.Generator().manual_seed(0)
    n, heads, channels, in_channels, edges = 12, 2, 4, 16, 40
    edge_index = torch.stack([torch.randint(0, n, (edges,), generator=gen),
                              torch.randint(0, n, (edges,), generator=gen)])
    return dict(
        torch=torch, edge_index=edge_index, num_src=n, num_dst=n, in_channels=in_channels,
        x_src=torch.randn(n, heads, channels, generator=gen), x_dst=torch.randn(n, heads, channels, generator=gen),
        a_src=torch.randn(n, heads, generator=gen), a_dst=torch.randn(n, heads, generator=gen),
        att=torch.randn(heads, channels, generator=gen), x=torch.randn(n, in_channels, generator=gen),
        edge_attr=torch.randn(edges, 4, generator=gen),
        existing_pyg_model=PygGAT(in_channels, 8, num_layers=2, out_channels=3, heads=2),
        operands=tuple(torch.randn(3, 3, generator=gen, dtype=torch.float64) for _ in range(3)),
    )


def test_readme_python_blocks_run():
    pytest.importorskip("torch_geometric")
    runnable = [b for b in BLOCKS if "torchrun" not in b]
    assert len(runnable) >= 6, "the README's Python blocks moved: update this test"
    ns = _given()
    for i, block in enumerate(runnable):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), ns)
        except Exception as e:  # name the block in the failure
            raise AssertionError(f"README python block {i} failed: {type(e).__name__}: {e}\n{block}") from e
    # what the blocks show, checked
    assert ns["plan"].num_slices >= 4 and ns["part"].shape == ns["y"].shape
    torch.testing.assert_close(ns["z"], ns["out"].detach())  # interleaved form = string form
    assert ns["outs"].shape[0] == 5 and ns["H"][0][0].shape == (3, 3, 3, 3)
